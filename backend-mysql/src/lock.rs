//! [`MySqlLock`], its builder, and the `DistributedLock` it is: every call
//! bounded by the operation timeout and handed to the strategy.

use std::{fmt, sync::Arc, time::Duration};

use async_trait::async_trait;
use fenced_api::{
    batch::{ChunkVerdict, ExtendChunk},
    Capabilities, DistributedLock, Error, Lease, LockInfo, LockKey, LockOptions, ReleaseOutcome,
    Result, WaitPolicy,
};
use sqlx::mysql::{MySqlArguments, MySqlPoolOptions, MySqlRow};

use crate::config::{self, MySqlConfig, Strategy, TableName};
use crate::error::{self, SqlResultExt};
use crate::permits::MySqlPermits;
use crate::schema;
use crate::sql::EXTEND_CHUNK;
use crate::strategy::{
    optimistic::Optimistic,
    row_lock::{self, RowLock, RowLockTransaction, RowMode},
    rows::Polled,
    unique_key::{self, UniqueKey},
};
use crate::wait;

/// A lock store on MySQL / MariaDB. Cheap to clone (shares the pool).
#[derive(Clone)]
pub struct MySqlLock {
    inner: Arc<Inner>,
}

struct Inner {
    config: MySqlConfig,
    engine: Engine,
    permits: MySqlPermits,
}

enum Engine {
    UniqueKey(Polled<UniqueKey>),
    RowLock(RowLock),
    Optimistic(Polled<Optimistic>),
}

impl fmt::Debug for MySqlLock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MySqlLock")
            .field("config", &self.inner.config)
            .finish()
    }
}

/// Builds a [`MySqlLock`]: from a URL, then adjusted.
#[derive(Debug, Clone)]
#[must_use]
pub struct MySqlLockBuilder {
    config: MySqlConfig,
    table: Option<String>,
    rows: RowMode,
}

impl MySqlLockBuilder {
    /// Starts from a URL (see [`MySqlConfig::from_url`]).
    ///
    /// # Errors
    ///
    /// [`Error::Config`] for a malformed URL.
    pub fn from_url(url: &str) -> Result<Self> {
        Ok(MySqlLockBuilder {
            config: MySqlConfig::from_url(url)?,
            table: None,
            rows: RowMode::default(),
        })
    }

    /// The strategy (default from the URL, else `unique_key`).
    pub fn strategy(mut self, strategy: Strategy) -> Self {
        self.config.strategy = strategy;
        self
    }

    /// The base table name — the namespace: two names never see each other's locks.
    pub fn table(mut self, name: impl Into<String>) -> Self {
        self.table = Some(name.into());
        self
    }

    /// Size of the lock's own connection pool (default 10).
    pub fn max_connections(mut self, n: u32) -> Self {
        self.config.max_connections = n;
        self
    }

    /// Bound on connecting and on waiting for a pooled connection (default 5 s).
    pub fn connect_timeout(mut self, d: Duration) -> Self {
        self.config.connect_timeout = d;
        self
    }

    /// Bound on one operation (default 10 s; the URL's `operation_timeout`
    /// or `timeout`): a silent network yields a retryable error after it
    /// instead of a hang. A waiting `acquire` gets its wait bound on top.
    pub fn operation_timeout(mut self, d: Duration) -> Self {
        self.config.operation_timeout = d;
        self
    }

    /// Which rows `row_lock` locks (default one per key).
    pub fn row_mode(mut self, rows: RowMode) -> Self {
        self.rows = rows;
        self
    }

    fn validated(mut self) -> Result<Self> {
        if let Some(t) = self.table.take() {
            self.config.table = TableName::new(&t)?;
        }
        if !(1..=1000).contains(&self.config.max_connections) {
            return Err(Error::config("max_connections must be from 1 to 1000"));
        }
        fenced_api::url::check_duration("connect_timeout", self.config.connect_timeout)?;
        fenced_api::url::check_duration("operation_timeout", self.config.operation_timeout)?;
        if self.config.strategy == Strategy::RowLock && self.config.max_connections < 2 {
            return Err(Error::config(
                "row_lock needs max_connections >= 2: one connection per held lock or waiter, plus one for the token",
            ));
        }
        if let RowMode::Shards(0) = self.rows {
            return Err(Error::config("row_lock shards must be at least 1"));
        }
        Ok(self)
    }

    async fn pool(&self) -> Result<sqlx::MySqlPool> {
        let cfg = &self.config;
        let at = config::server_name(&cfg.connect);
        // One connection made directly first: a pool retries a refused
        // connection until its timeout and then reports only "pool timed
        // out", which hides the cause (refused? wrong host? TLS?). This one
        // fails fast with it; the pool then starts with no connection.
        let first = tokio::time::timeout(
            cfg.connect_timeout,
            sqlx::ConnectOptions::connect(&cfg.connect),
        )
        .await;
        match first {
            Ok(Ok(conn)) => {
                // Closed cleanly (a dropped socket shows in the server's log
                // as an aborted connection), but never waited on for long.
                let close = sqlx::Connection::close(conn);
                let _ = tokio::time::timeout(cfg.connect_timeout, close).await;
            }
            Ok(Err(e)) => return Err(error::connect_failed(&at, e)),
            Err(_) => {
                let silent = fenced_api::no_answer(error::BACKEND, "connect", cfg.connect_timeout);
                return Err(silent.connecting(&at));
            }
        }
        Ok(MySqlPoolOptions::new()
            .max_connections(cfg.max_connections)
            .acquire_timeout(cfg.connect_timeout)
            .connect_lazy_with(cfg.connect.clone()))
    }

    /// Creates or upgrades the schema for the table name. Idempotent; run it
    /// once at deploy time (or from several nodes: it is safe).
    /// Returns the schema versions applied by this call.
    ///
    /// # Errors
    ///
    /// [`Error::Config`] for bad settings or a read-only server,
    /// [`Error::Backend`] when the server fails.
    pub async fn migrate(self) -> Result<Vec<u32>> {
        let b = self.validated()?;
        let pool = b.pool().await?;
        let applied = schema::migrate(&pool, &b.config.table).await;
        pool.close().await;
        applied
    }

    /// Connects, refuses a read-only server, and checks the schema.
    ///
    /// # Errors
    ///
    /// * [`Error::Config`] when the tables are missing or old (the message
    ///   names `MySqlLock::migrate`), or the server is read-only.
    /// * [`Error::Backend`] (retryable) when the server cannot be reached
    ///   within the connect timeout.
    pub async fn connect(self) -> Result<MySqlLock> {
        let b = self.validated()?;
        let pool = b.pool().await?;
        schema::check(&pool, &b.config.table).await?;
        let cfg = b.config;
        let t = &cfg.table;
        let permits = MySqlPermits::new(&cfg, pool.clone(), wait::polling(&cfg).scope());
        let engine = match cfg.strategy {
            Strategy::UniqueKey => {
                unique_key::check_autoinc_mode(&pool, &cfg.display_url).await?;
                Engine::UniqueKey(UniqueKey::new(pool, t.quoted(""), wait::polling(&cfg)))
            }
            Strategy::Optimistic => Engine::Optimistic(Optimistic::new(
                pool,
                t.quoted("_optimistic"),
                wait::polling(&cfg),
            )),
            Strategy::RowLock => {
                let memory =
                    row_lock::live_is_memory(&pool, &format!("{}_live", t.as_str())).await?;
                if !memory {
                    tracing::warn!(table = %t, "`{t}_live` is not a MEMORY table: row_lock takes each token with a durable write");
                }
                Engine::RowLock(RowLock::new(
                    pool,
                    row_lock::Tables {
                        rows: t.quoted("_rows"),
                        fence: t.quoted("_fence"),
                        live: t.quoted("_live"),
                    },
                    b.rows,
                    cfg.operation_timeout,
                    memory,
                    cfg.row_lock_one_statement,
                ))
            }
        };
        Ok(MySqlLock {
            inner: Arc::new(Inner {
                config: cfg,
                engine,
                permits,
            }),
        })
    }
}

impl MySqlLock {
    /// A builder from a URL.
    ///
    /// # Errors
    ///
    /// [`Error::Config`] for a malformed URL.
    pub fn builder(url: &str) -> Result<MySqlLockBuilder> {
        MySqlLockBuilder::from_url(url)
    }

    /// Connects with everything taken from the URL.
    ///
    /// # Errors
    ///
    /// As [`MySqlLockBuilder::connect`].
    pub async fn connect(url: &str) -> Result<MySqlLock> {
        MySqlLockBuilder::from_url(url)?.connect().await
    }

    /// Creates or upgrades the schema named by the URL's `table` (idempotent).
    ///
    /// # Errors
    ///
    /// As [`MySqlLockBuilder::migrate`].
    pub async fn migrate(url: &str) -> Result<Vec<u32>> {
        MySqlLockBuilder::from_url(url)?.migrate().await
    }

    /// The configuration (password redacted in `Debug`).
    pub fn config(&self) -> &MySqlConfig {
        &self.inner.config
    }

    fn engine(&self) -> &dyn DistributedLock {
        match &self.inner.engine {
            Engine::UniqueKey(e) => e,
            Engine::RowLock(e) => e,
            Engine::Optimistic(e) => e,
        }
    }

    /// `row_lock` only: takes `key` inside a transaction whose connection the
    /// caller writes through; [`RowLockTransaction::commit`] commits those
    /// writes and releases the lock atomically.
    ///
    /// # Errors
    ///
    /// [`Error::Unsupported`] for other strategies; otherwise as `acquire`.
    pub async fn lock_in_transaction(
        &self,
        key: &LockKey,
        opts: &LockOptions,
    ) -> Result<RowLockTransaction> {
        match &self.inner.engine {
            Engine::RowLock(r) => r.lock_in_transaction(key, opts).await,
            _ => Err(Error::Unsupported {
                backend: error::BACKEND,
                what: format!(
                    "transaction-scoped locks with strategy {}; use row_lock",
                    self.inner.config.strategy
                ),
            }),
        }
    }

    /// `row_lock` only: pre-creates lock rows (required for [`RowMode::Fixed`]:
    /// run it once, after [`migrate`](Self::migrate), with every key the
    /// application will lock; it is idempotent). Returns how many rows were
    /// new.
    ///
    /// # Errors
    ///
    /// [`Error::Unsupported`] for other strategies, [`Error::Backend`] on failure.
    pub async fn create_rows(&self, keys: &[LockKey]) -> Result<u64> {
        match &self.inner.engine {
            Engine::RowLock(r) => r.create_rows(keys).await,
            _ => Err(Error::Unsupported {
                backend: error::BACKEND,
                what: "lock rows outside row_lock".into(),
            }),
        }
    }

    /// The `unique_key` strategy, if that is this handle's.
    pub(crate) fn unique_key(&self) -> Option<&UniqueKey> {
        match &self.inner.engine {
            Engine::UniqueKey(u) => Some(&u.0),
            _ => None,
        }
    }

    /// One side statement returning one row (table statistics), on the
    /// strategy's plain connections.
    pub(crate) async fn fetch_one(
        &self,
        query: sqlx::query::Query<'_, sqlx::MySql, MySqlArguments>,
    ) -> Result<MySqlRow> {
        match &self.inner.engine {
            Engine::UniqueKey(e) => e.conns().fetch_one(query).await.db(),
            Engine::Optimistic(e) => e.conns().fetch_one(query).await.db(),
            Engine::RowLock(e) => e.fetch_one(query).await,
        }
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
impl DistributedLock for MySqlLock {
    async fn try_acquire(&self, key: &LockKey, opts: &LockOptions) -> Result<Option<Lease>> {
        self.bounded("try_acquire", self.engine().try_acquire(key, opts))
            .await
    }

    /// Bounded by the wait bound plus the operation timeout (`NoWait`: the
    /// operation timeout alone; `Forever`: not at all).
    async fn acquire(&self, key: &LockKey, opts: &LockOptions) -> Result<Lease> {
        let op = self.inner.config.operation_timeout;
        let acquire = self.engine().acquire(key, opts);
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
        fenced_api::batch::extend_in_chunks(self, leases, ttl, EXTEND_CHUNK).await
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

    /// The held locks of this table, first `limit` in key order, as the
    /// strategy sees them:
    ///
    /// * `unique_key`: the unexpired rows (server clock) — one `SELECT`
    ///   along the primary key, which holds only held and not yet reaped
    ///   rows;
    /// * `optimistic`: the rows with a holder and an unexpired expiry — one
    ///   `SELECT` along the primary key, reading free rows too (one row per
    ///   key ever locked): O(rows read), at worst the table;
    /// * `row_lock`: the keys whose latest grant description is confirmed
    ///   held — one `SELECT` of `<table>_live`, then a `NOWAIT` probe per
    ///   candidate not held through this instance (about one per lock held
    ///   elsewhere; one per described key without the `PROCESS` privilege,
    ///   which `information_schema.INNODB_TRX` needs, or while InnoDB's
    ///   cache of that table stays stale). Exact, except that in
    ///   [`RowMode::Shards`] a released key may be listed while another key
    ///   of its shard is held, and that a grant is described only once its
    ///   token is taken (an instant after its row lock).
    ///
    /// Remaining TTLs are computed on the database's clock.
    async fn list(&self, limit: usize) -> Result<Vec<LockInfo>> {
        match &self.inner.engine {
            // Bounded per statement inside (one probe per candidate).
            Engine::RowLock(r) => r.list(limit).await,
            _ => self.bounded("list", self.engine().list(limit)).await,
        }
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

/// Batch renewals go to the strategy's one-statement form; each is bounded
/// by the operation timeout like any other statement, and the one-by-one
/// fallback goes through [`MySqlLock`]'s own (bounded) `extend`.
#[async_trait]
impl ExtendChunk for MySqlLock {
    async fn extend_chunk(&self, chunk: &[&Lease], ttl: Duration) -> Result<ChunkVerdict> {
        match &self.inner.engine {
            Engine::UniqueKey(u) => {
                self.bounded("extend_many", u.extend_chunk(chunk, ttl))
                    .await
            }
            Engine::Optimistic(o) => {
                self.bounded("extend_many", o.extend_chunk(chunk, ttl))
                    .await
            }
            // Each held row lock is its own open transaction: one by one.
            Engine::RowLock(_) => Ok(ChunkVerdict::Unknown),
        }
    }
}
