//! [`PostgresLock`], its builder, and the `DistributedLock` it is: every
//! call bounded by the operation timeout and handed to the strategy
//! ([`Engine`](crate::strategy::Engine)).

use std::{fmt, sync::Arc, time::Duration};

use async_trait::async_trait;
use fenced_api::{
    batch::{ChunkVerdict, ExtendChunk},
    Capabilities, DistributedLock, Lease, LockInfo, LockKey, LockOptions, ReleaseOutcome, Result,
    WaitPolicy,
};

use crate::{
    config::{PostgresConfig, Strategy, TableName},
    conn, error,
    permits::PostgresPermits,
    schema::{self, Upgrade},
    strategy::Engine,
};

/// A lock store on PostgreSQL. Cheap to clone (shares the pool).
///
/// Each instance opened with [`PostgresLock::connect`] has its own
/// statement pool (and, once one of its `acquire`s has waited, one
/// listening connection); instances on the same table — in this process or
/// in others — see the same locks.
#[derive(Clone)]
pub struct PostgresLock {
    inner: Arc<Inner>,
}

struct Inner {
    config: PostgresConfig,
    engine: Engine,
    permits: PostgresPermits,
}

impl fmt::Debug for PostgresLock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PostgresLock")
            .field("config", &self.inner.config)
            .finish()
    }
}

/// Builds a [`PostgresLock`]: from a URL, then adjusted. Its options have
/// the names of the URL's parameters.
#[derive(Debug, Clone)]
#[must_use]
pub struct PostgresLockBuilder {
    config: PostgresConfig,
    table: Option<String>,
}

impl PostgresLockBuilder {
    /// Starts from a URL (see [`PostgresConfig::from_url`]).
    ///
    /// # Errors
    ///
    /// [`Error::Config`](fenced_api::Error::Config) for a malformed URL.
    pub fn from_url(url: &str) -> Result<Self> {
        Ok(PostgresLockBuilder {
            config: PostgresConfig::from_url(url)?,
            table: None,
        })
    }

    /// The strategy (default from the URL, else `lease`).
    pub fn strategy(mut self, strategy: Strategy) -> Self {
        self.config.strategy = strategy;
        self
    }

    /// The base table name — the namespace: two names never see each
    /// other's locks. Lowercase letters, digits and `_`, at most 48.
    pub fn table(mut self, name: impl Into<String>) -> Self {
        self.table = Some(name.into());
        self
    }

    /// Size of the statement pool (default 10, at most 1000).
    pub fn max_connections(mut self, n: u32) -> Self {
        self.config.max_connections = n;
        self
    }

    /// Bound on the connections `advisory` holds for locks and waits
    /// (default 64, at most 10 000).
    pub fn max_lock_connections(mut self, n: u32) -> Self {
        self.config.max_lock_connections = n;
        self
    }

    /// Bound on connecting and on waiting for a pooled connection (default 5 s).
    pub fn connect_timeout(mut self, d: Duration) -> Self {
        self.config.connect_timeout = d;
        self
    }

    /// Bound on one operation (default 10 s; the URL's `operation_timeout`
    /// or `timeout`), also the sessions' `statement_timeout`: a silent
    /// network yields a retryable error after it instead of a hang. A
    /// waiting `acquire` gets its wait bound on top.
    pub fn operation_timeout(mut self, d: Duration) -> Self {
        self.config.operation_timeout = d;
        self
    }

    /// How often a `lease` waiter looks at a held key when no notification
    /// came (10 ms to 10 s, default 500 ms): how late it notices a lease
    /// that expired, or a release while the listening session was down.
    pub fn recheck_interval(mut self, d: Duration) -> Self {
        self.config.recheck_interval = d;
        self
    }

    fn validated(mut self) -> Result<PostgresConfig> {
        if let Some(t) = self.table.take() {
            self.config.table = TableName::new(&t)?;
        }
        self.config.validate()?;
        Ok(self.config)
    }

    /// Creates or upgrades the tables of the table name (both strategies'
    /// tables and the token sequence). Idempotent and safe from several
    /// processes at once. Returns the schema versions applied.
    ///
    /// # Errors
    ///
    /// * [`Error::Config`](fenced_api::Error::Config) for bad settings, a
    ///   hot standby, an old server, or a role that may not create tables.
    /// * [`Error::Backend`](fenced_api::Error::Backend) when the server
    ///   cannot be reached (retryable) or fails.
    pub async fn migrate(self) -> Result<Vec<u32>> {
        let config = self.validated()?;
        conn::check_first(&config).await?;
        let pool = conn::pool(&config);
        let applied = error::bounded(
            "migrate",
            config.operation_timeout,
            schema::ensure(&pool, &config.table, Upgrade::Apply),
        )
        .await;
        pool.close().await;
        applied
    }

    /// Connects: refuses a hot standby and an old server, creates missing
    /// tables (see the crate docs on why `connect` may), and builds the
    /// strategy.
    ///
    /// # Errors
    ///
    /// * [`Error::Config`](fenced_api::Error::Config) for bad settings, a
    ///   hot standby (the message names it and the primary), an old
    ///   server, tables at an older schema version (the message names
    ///   `migrate`), or a role that may not create missing tables.
    /// * [`Error::Backend`](fenced_api::Error::Backend) (retryable) when
    ///   the server cannot be reached within the connect timeout.
    pub async fn connect(self) -> Result<PostgresLock> {
        let config = self.validated()?;
        conn::check_first(&config).await?;
        let pool = conn::pool(&config);
        let ensured = error::bounded(
            "the schema check",
            config.operation_timeout,
            schema::ensure(&pool, &config.table, Upgrade::CreateOnly),
        )
        .await;
        let engine = ensured.and_then(|_| Engine::new(&config, pool.clone()));
        match engine {
            Ok(engine) => Ok(PostgresLock {
                inner: Arc::new(Inner {
                    permits: PostgresPermits::new(&config, pool),
                    config,
                    engine,
                }),
            }),
            Err(e) => {
                pool.close().await;
                Err(e)
            }
        }
    }
}

impl PostgresLock {
    /// A builder from a URL.
    ///
    /// # Errors
    ///
    /// [`Error::Config`](fenced_api::Error::Config) for a malformed URL.
    pub fn builder(url: &str) -> Result<PostgresLockBuilder> {
        PostgresLockBuilder::from_url(url)
    }

    /// Connects with everything taken from the URL.
    ///
    /// # Errors
    ///
    /// As [`PostgresLockBuilder::connect`].
    pub async fn connect(url: &str) -> Result<PostgresLock> {
        PostgresLockBuilder::from_url(url)?.connect().await
    }

    /// Creates or upgrades the tables named by the URL's `table` (idempotent).
    ///
    /// # Errors
    ///
    /// As [`PostgresLockBuilder::migrate`].
    pub async fn migrate(url: &str) -> Result<Vec<u32>> {
        PostgresLockBuilder::from_url(url)?.migrate().await
    }

    /// The configuration (password redacted in `Debug`).
    pub fn config(&self) -> &PostgresConfig {
        &self.inner.config
    }

    /// Closes this instance's connections (waiting for statements in
    /// flight) and stops its listener. Later operations on it fail; locks
    /// it holds stay in the table until released by another instance or
    /// expired.
    pub async fn close(&self) {
        self.inner.engine.stop();
        self.inner.permits.stop();
        self.inner.engine.close_pool().await;
    }

    pub(crate) fn engine(&self) -> &Engine {
        &self.inner.engine
    }

    /// Runs one call within the operation timeout.
    pub(crate) async fn bounded<T>(
        &self,
        what: &str,
        call: impl std::future::Future<Output = Result<T>>,
    ) -> Result<T> {
        error::bounded(what, self.inner.config.operation_timeout, call).await
    }
}

#[async_trait]
impl DistributedLock for PostgresLock {
    async fn try_acquire(&self, key: &LockKey, opts: &LockOptions) -> Result<Option<Lease>> {
        self.bounded("try_acquire", self.engine().try_acquire(key, opts))
            .await
    }

    /// Bounded by the wait bound plus the operation timeout (`NoWait`: the
    /// operation timeout alone; `Forever`: each try is bounded, the wait
    /// is not).
    async fn acquire(&self, key: &LockKey, opts: &LockOptions) -> Result<Lease> {
        let op = self.inner.config.operation_timeout;
        let acquire = self.engine().acquire(self, key, opts);
        match opts.wait() {
            WaitPolicy::Forever => acquire.await,
            WaitPolicy::NoWait => error::bounded("acquire", op, acquire).await,
            WaitPolicy::Timeout(d) => {
                error::bounded("acquire", d.saturating_add(op), acquire).await
            }
        }
    }

    async fn extend(&self, lease: &Lease, ttl: Duration) -> Result<Lease> {
        self.bounded("extend", self.engine().extend(lease, ttl))
            .await
    }

    async fn extend_many(&self, leases: &[Lease], ttl: Duration) -> Vec<Result<Lease>> {
        fenced_api::batch::extend_in_chunks(self, leases, ttl, fenced_sql::EXTEND_CHUNK).await
    }

    async fn release(&self, lease: &Lease) -> Result<ReleaseOutcome> {
        self.bounded("release", self.engine().release(lease)).await
    }

    async fn inspect(&self, key: &LockKey) -> Result<Option<LockInfo>> {
        self.bounded("inspect", self.engine().inspect(key)).await
    }

    async fn force_release(&self, key: &LockKey) -> Result<bool> {
        self.bounded("force_release", self.engine().force_release(key))
            .await
    }

    /// The held locks of this table, first `limit` in key order (byte
    /// order), remaining TTLs on the server's clock.
    async fn list(&self, limit: usize) -> Result<Vec<LockInfo>> {
        self.bounded("list", self.engine().list(limit)).await
    }

    fn capabilities(&self) -> Capabilities {
        self.engine().capabilities()
    }

    fn semaphores(&self) -> Option<Arc<dyn fenced_api::SemaphoreStore>> {
        Some(Arc::new(fenced_api::permits::LineSemaphores::new(
            self.inner.permits.clone(),
        )))
    }
}

/// Batch renewals: one statement per chunk, saying exactly which leases it
/// renewed, bounded like any other statement; the one-by-one fallback goes
/// through the (bounded) `extend`.
#[async_trait]
impl ExtendChunk for PostgresLock {
    async fn extend_chunk(&self, chunk: &[&Lease], ttl: Duration) -> Result<ChunkVerdict> {
        self.bounded("extend_many", self.engine().extend_chunk(chunk, ttl))
            .await
    }
}
