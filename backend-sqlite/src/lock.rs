//! The store handle ([`SqliteLock`]), its builder, and the
//! [`DistributedLock`] implementation, which delegates to the mechanism
//! (`unique_key.rs`), the scans (`list.rs`) and the waiting (`wait.rs`).

use std::{
    fmt,
    path::{Path, PathBuf},
    sync::Arc,
    time::Duration,
};

use async_trait::async_trait;
use fenced_api::{
    batch::{ChunkVerdict, ExtendChunk},
    wait::Polling,
    Capabilities, DistributedLock, Lease, LockInfo, LockKey, LockOptions, ReleaseOutcome, Result,
};

use crate::{
    config::{self, SqliteConfig, Synchronous, TableName},
    error,
    gate::WriteGate,
    list::Scans,
    permits::SqlitePermits,
    pool,
    schema::{self, Upgrade},
    unique_key::UniqueKey,
    wait,
};

/// A lock store in a SQLite file. Cheap to clone (shares the pool).
///
/// Each instance opened with [`SqliteLock::connect`] has its own small
/// connection pool; instances on the same file — in this process or in
/// others — see the same locks.
#[derive(Clone)]
pub struct SqliteLock {
    inner: Arc<Inner>,
}

struct Inner {
    config: SqliteConfig,
    engine: UniqueKey,
    scans: Scans,
    polling: Polling,
    permits: SqlitePermits,
}

impl fmt::Debug for SqliteLock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SqliteLock")
            .field("config", &self.inner.config)
            .finish()
    }
}

/// Builds a [`SqliteLock`]: from a URL or a path, then adjusted.
#[derive(Debug, Clone)]
#[must_use]
pub struct SqliteLockBuilder {
    config: SqliteConfig,
    table: Option<String>,
}

impl SqliteLockBuilder {
    /// Starts from a URL (see [`SqliteConfig::from_url`]).
    ///
    /// # Errors
    ///
    /// [`Error::Config`](fenced_api::Error::Config) for a malformed URL.
    pub fn from_url(url: &str) -> Result<Self> {
        Ok(SqliteLockBuilder {
            config: SqliteConfig::from_url(url)?,
            table: None,
        })
    }

    /// Starts from the path of the database file, with default settings.
    ///
    /// # Errors
    ///
    /// [`Error::Config`](fenced_api::Error::Config) for an empty or in-memory path.
    pub fn from_path(path: impl Into<PathBuf>) -> Result<Self> {
        Ok(SqliteLockBuilder {
            config: SqliteConfig::for_path(path)?,
            table: None,
        })
    }

    /// The table name — the namespace: two names never see each other's locks.
    pub fn table(mut self, name: impl Into<String>) -> Self {
        self.table = Some(name.into());
        self
    }

    /// How long a statement waits for another connection's write lock before
    /// failing with a retryable error (default 5 s).
    pub fn busy_timeout(mut self, d: Duration) -> Self {
        self.config.busy_timeout = d;
        self
    }

    /// The `synchronous` setting (default [`Synchronous::Full`]).
    pub fn synchronous(mut self, s: Synchronous) -> Self {
        self.config.synchronous = s;
        self
    }

    /// Size of this instance's connection pool (default 4, at most 64).
    pub fn max_connections(mut self, n: u32) -> Self {
        self.config.max_connections = n;
        self
    }

    fn validated(mut self) -> Result<SqliteConfig> {
        if let Some(t) = self.table.take() {
            self.config.table = TableName::new(&t)?;
        }
        self.config.validate()?;
        Ok(self.config)
    }

    /// Creates or upgrades the schema for the table name. Idempotent and safe
    /// from several processes at once. Returns the schema versions applied.
    ///
    /// # Errors
    ///
    /// [`Error::Config`](fenced_api::Error::Config) for bad settings,
    /// [`Error::Backend`](fenced_api::Error::Backend) when the file cannot be
    /// created, opened or written (retryable when it is busy).
    pub async fn migrate(self) -> Result<Vec<u32>> {
        let config = self.validated()?;
        let pool = pool::open(&config).await?;
        let applied = schema::ensure(&pool, &config.table, Upgrade::Apply).await;
        pool.close().await;
        applied
    }

    /// Opens the store: creates the directory, the file and a missing table
    /// (see the crate docs on why `connect` creates the schema here).
    ///
    /// # Errors
    ///
    /// * [`Error::Config`](fenced_api::Error::Config) for bad settings, an
    ///   SQLite older than 3.42, or a table at an older schema version (the
    ///   message names `migrate`).
    /// * [`Error::Backend`](fenced_api::Error::Backend) when the directory or
    ///   file cannot be created or opened (not retryable: fix the path or
    ///   permissions), or when another process keeps the file locked past
    ///   `busy_timeout` (retryable).
    pub async fn connect(self) -> Result<SqliteLock> {
        let config = self.validated()?;
        let pool = pool::open(&config).await?;
        if let Err(e) = schema::ensure(&pool, &config.table, Upgrade::CreateOnly).await {
            pool.close().await;
            return Err(e);
        }
        let polling = wait::polling(&config).await;
        let gate = WriteGate::default();
        let inner = Inner {
            engine: UniqueKey::new(pool.clone(), gate.clone(), &config.table),
            permits: SqlitePermits::new(pool.clone(), gate, &config.table, polling.scope()),
            scans: Scans::new(pool, &config.table),
            polling,
            config,
        };
        Ok(SqliteLock {
            inner: Arc::new(inner),
        })
    }
}

impl SqliteLock {
    /// A builder from a URL.
    ///
    /// # Errors
    ///
    /// [`Error::Config`](fenced_api::Error::Config) for a malformed URL.
    pub fn builder(url: &str) -> Result<SqliteLockBuilder> {
        SqliteLockBuilder::from_url(url)
    }

    /// Opens the store named by the URL, creating what is missing.
    ///
    /// # Errors
    ///
    /// As [`SqliteLockBuilder::connect`].
    pub async fn connect(url: &str) -> Result<SqliteLock> {
        SqliteLockBuilder::from_url(url)?.connect().await
    }

    /// Opens the per-user default store ([`SqliteLock::default_path`]).
    ///
    /// # Errors
    ///
    /// As [`SqliteLock::default_path`] and [`SqliteLockBuilder::connect`].
    pub async fn connect_default() -> Result<SqliteLock> {
        SqliteLockBuilder::from_path(Self::default_path()?)?
            .connect()
            .await
    }

    /// Creates or upgrades the schema named by the URL's `table` (idempotent).
    ///
    /// # Errors
    ///
    /// As [`SqliteLockBuilder::migrate`].
    pub async fn migrate(url: &str) -> Result<Vec<u32>> {
        SqliteLockBuilder::from_url(url)?.migrate().await
    }

    /// The per-user default database file, the store used when no URL is
    /// configured (the `fenced` CLI lets `FENCED_URL` override it):
    ///
    /// 1. `$FENCED_HOME/locks.db` if `FENCED_HOME` is set (an absolute directory);
    /// 2. else `$XDG_STATE_HOME/fenced/locks.db` if `XDG_STATE_HOME` is set and absolute;
    /// 3. else `$HOME/.local/state/fenced/locks.db`.
    ///
    /// Empty variables count as unset. Nothing is created until `connect`.
    ///
    /// # Errors
    ///
    /// [`Error::Config`](fenced_api::Error::Config) when `FENCED_HOME` is
    /// relative, or none of the variables gives a location.
    pub fn default_path() -> Result<PathBuf> {
        config::default_path_from(|name| std::env::var_os(name))
    }

    /// [`SqliteLock::default_path`] as a `sqlite://` URL (percent-encoded).
    ///
    /// # Errors
    ///
    /// As [`SqliteLock::default_path`], or
    /// [`Error::Config`](fenced_api::Error::Config) for a path that is not UTF-8.
    pub fn default_url() -> Result<String> {
        config::url_for_path(&Self::default_path()?)
    }

    /// The configuration.
    pub fn config(&self) -> &SqliteConfig {
        &self.inner.config
    }

    /// The database file.
    pub fn path(&self) -> &Path {
        &self.inner.config.path
    }

    /// Closes this instance's connections (waiting for operations in
    /// flight). Later operations on it fail; locks it holds stay in the file
    /// until released by another instance or expired.
    pub async fn close(&self) {
        self.inner.engine.pool().close().await;
    }
}

#[async_trait]
impl DistributedLock for SqliteLock {
    async fn try_acquire(&self, key: &LockKey, opts: &LockOptions) -> Result<Option<Lease>> {
        self.inner.engine.try_acquire(key, opts).await
    }

    async fn acquire(&self, key: &LockKey, opts: &LockOptions) -> Result<Lease> {
        self.inner.polling.acquire(self, key, opts).await
    }

    async fn extend(&self, lease: &Lease, ttl: Duration) -> Result<Lease> {
        self.inner.engine.extend(lease, ttl).await
    }

    async fn extend_many(&self, leases: &[Lease], ttl: Duration) -> Vec<Result<Lease>> {
        fenced_api::batch::extend_in_chunks(self, leases, ttl, fenced_sql::EXTEND_CHUNK).await
    }

    async fn release(&self, lease: &Lease) -> Result<ReleaseOutcome> {
        let done = self.inner.engine.release(lease).await?;
        if done.freed {
            self.inner.polling.freed(&lease.key);
        }
        Ok(done.outcome)
    }

    async fn inspect(&self, key: &LockKey) -> Result<Option<LockInfo>> {
        self.inner.scans.inspect(key).await
    }

    async fn force_release(&self, key: &LockKey) -> Result<bool> {
        let done = self.inner.engine.force_release(key).await?;
        if done.freed {
            self.inner.polling.freed(key);
        }
        Ok(done.outcome)
    }

    async fn list(&self, limit: usize) -> Result<Vec<LockInfo>> {
        self.inner.scans.list(limit).await
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities::none()
            .backend(error::BACKEND)
            .durable(true)
            .fencing(true)
            .reentrant(true)
    }

    fn semaphores(&self) -> Option<Arc<dyn fenced_api::SemaphoreStore>> {
        Some(Arc::new(fenced_api::permits::LineSemaphores::new(
            self.inner.permits.clone(),
        )))
    }
}

/// Batch renewals: one statement per chunk, saying exactly which leases it
/// renewed; the one-by-one fallback goes through `extend`.
#[async_trait]
impl ExtendChunk for SqliteLock {
    async fn extend_chunk(&self, chunk: &[&Lease], ttl: Duration) -> Result<ChunkVerdict> {
        self.inner.engine.extend_chunk(chunk, ttl).await
    }
}
