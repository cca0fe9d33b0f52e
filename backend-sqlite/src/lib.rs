//! Embedded SQLite backend of [fenced](https://docs.rs/fenced): the
//! unique-key lock algorithm on a local database file, for **many processes
//! on one host**, with no server to run. It is the store `fenced run` uses
//! when no URL is configured.
//!
//! ```no_run
//! use std::{sync::Arc, time::Duration};
//! use fenced_api::LockClient;
//! use fenced_sqlite::SqliteLock;
//!
//! # async fn run() -> fenced_api::Result<()> {
//! // Creates /var/lib/myapp/ and the file with its table on first use.
//! let store = SqliteLock::connect("sqlite:///var/lib/myapp/locks.db?table=jobs").await?;
//! // Or the per-user default: $FENCED_HOME, $XDG_STATE_HOME/fenced or ~/.local/state/fenced.
//! let _default = SqliteLock::connect(&SqliteLock::default_url()?).await?;
//!
//! let client = LockClient::builder(Arc::new(store))
//!     .ttl(Duration::from_secs(30))
//!     .build()?;
//! let guard = client.acquire("nightly-report").await?;
//! // … write the report, passing guard.token() to whatever rejects stale writers …
//! guard.release().await?;
//! # Ok(()) }
//! ```
//!
//! # When to use it
//!
//! * **One host, many processes** — cron jobs, CLI tools, workers started by
//!   systemd — that must not run a job twice at once. Every process opening
//!   the same file (each with its own [`SqliteLock`]) sees the same locks.
//! * **Not for several hosts.** Do not put the file on NFS, SMB or any other
//!   network file system: SQLite's file locking is unreliable there, and WAL
//!   mode needs shared memory that only one host can provide. Two hosts
//!   sharing a file can both "hold" a lock. Use MySQL, Redis or etcd instead.
//!
//! # How it works
//!
//! One table per namespace (`?table=`, default `fenced_locks`):
//!
//! | column | |
//! |---|---|
//! | `id INTEGER PRIMARY KEY AUTOINCREMENT` | the fencing token |
//! | `lock_key BLOB NOT NULL UNIQUE` | the key, compared byte for byte |
//! | `owner BLOB`, `reentrant_count INTEGER` | holder and hold count |
//! | `label TEXT` | the holder's [`Label`](fenced_api::Label), NULL without one |
//! | `expire_at INTEGER` | µs since the Unix epoch, on SQLite's clock |
//!
//! * **Acquire** is one `INSERT … ON CONFLICT DO NOTHING RETURNING id`. No
//!   row back means the key is held; if that row has expired (its holder
//!   crashed), it is deleted — only while still expired — and the insert is
//!   retried once. An explicit owner re-enters (counted) when its options are
//!   reentrant, and gets [`Error::AlreadyHeld`] otherwise.
//! * **Release / extend** match `id` **and** `owner`; extend also requires
//!   the row not to have expired. A stale or foreign lease changes nothing.
//! * **Fencing tokens** are the row ids. `AUTOINCREMENT` (not a plain
//!   `INTEGER PRIMARY KEY`, which reuses the largest id after it is deleted)
//!   keeps a high-water mark in `sqlite_sequence`, so tokens strictly increase
//!   across releases, expiries, deleted rows, `VACUUM` and reopening the file.
//! * **Waiting** polls with backoff and jitter (5 ms doubling to 200 ms); a
//!   release by another [`SqliteLock`] *in the same process* on the same file
//!   and table wakes waiters at once. Across processes a waiter notices
//!   within its backoff. There is no FIFO order.
//!
//! Every statement is a single autocommit statement, run atomically under
//! SQLite's one write lock, so no read-modify-write transaction is needed.
//!
//! # Time
//!
//! Expiry is computed **inside SQL** from SQLite's clock
//! (`unixepoch('subsec')`), never from a time sent by a client. SQLite's clock
//! is the host's wall clock, with millisecond resolution, so every process on
//! the host shares it — the store's clock and the clients' are the same clock.
//! Expiries are rounded up to the end of the current millisecond, so the file
//! never frees a lock before the holder's local (monotonic) deadline. A step
//! of the wall clock (manual `date -s`, a large NTP correction) moves every
//! expiry with it: forward frees locks early, backward keeps them longer. Keep
//! the clock disciplined by slewing NTP, and protect resources with the
//! fencing token, which no clock affects.
//!
//! # Durability and settings
//!
//! * `journal_mode=WAL`: readers never block the writer, and writes do not
//!   block `inspect`.
//! * `synchronous=FULL` by default: every acquire and release is fsynced
//!   before it returns, so after a power loss no token is handed out twice
//!   (with `NORMAL`, the last commits — and the `AUTOINCREMENT` counter — could
//!   roll back). `?synchronous=normal` trades that for speed; see [`Synchronous`].
//! * `busy_timeout` (default 5 s): how long a statement waits for another
//!   connection's write lock. When it passes, the operation fails with a
//!   **retryable** [`Error::Backend`].
//! * Locks and tokens survive process restarts and reboots (the file is the
//!   store): the backend declares itself durable.
//!
//! # Schema: created on connect
//!
//! Unlike the SQL-server backends, where [`connect`](SqliteLock::connect)
//! only checks the schema and a separate `migrate` step creates it, this
//! backend **creates the file, its directory and a missing table on
//! connect**. The server rule protects shared databases whose application
//! users lack DDL rights and whose schema changes are deployments; an embedded
//! per-user file has neither problem, and being zero-config is its purpose (a
//! fresh machine runs `fenced run` with no set-up). Creation is idempotent and
//! serialised by `BEGIN IMMEDIATE`, so processes starting together are safe.
//! A step that processes built against the older schema tolerate — such as
//! version 2's nullable `label` column, which their statements never name —
//! is applied on connect too, so files made by an older build keep opening.
//! Any other upgrade of an existing, *older* schema is an explicit
//! [`SqliteLock::migrate`], because processes built against it may still be
//! using the file.
#![forbid(unsafe_code)]
#![warn(missing_docs, missing_debug_implementations, unreachable_pub)]

mod config;
mod error;
pub mod fence;
mod schema;
mod unique_key;

use std::{
    fmt,
    path::{Path, PathBuf},
    sync::Arc,
    time::Duration,
};

use async_trait::async_trait;
use fenced_api::{
    Capabilities, DistributedLock, Error, Lease, LockInfo, LockKey, LockOptions, ReleaseOutcome,
    Result,
};
use sqlx::{
    sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteSynchronous},
    Row, SqlitePool,
};

pub use config::{
    SqliteConfig, Synchronous, TableName, DEFAULT_BUSY_TIMEOUT, DEFAULT_MAX_CONNECTIONS,
    DEFAULT_TABLE,
};
pub use schema::SCHEMA_VERSION;
pub use sqlx;

use schema::Upgrade;
use unique_key::UniqueKey;

/// Builds a prepared-statement string from SQL whose only dynamic parts are
/// validated, double-quoted table names (see [`TableName`]) and constants.
macro_rules! sql {
    ($($fmt:tt)*) => {
        sqlx::SqlSafeStr::into_sql_str(sqlx::AssertSqlSafe(std::sync::Arc::<str>::from(format!($($fmt)*))))
    };
}
pub(crate) use sql;

/// URL schemes this backend serves.
pub const SCHEMES: &[&str] = &["sqlite"];

/// Oldest SQLite with everything used here (`unixepoch('subsec')`: 3.42;
/// `STRICT` tables: 3.37; `RETURNING`: 3.35). The bundled library is newer.
const MIN_SQLITE: (u32, u32) = (3, 42);

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
    /// [`Error::Config`] for a malformed URL.
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
    /// [`Error::Config`] for an empty or in-memory path.
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

    /// Creates the directory and file if missing and opens a pool with WAL,
    /// the busy timeout and the sync mode; checks the SQLite version.
    async fn open(config: &SqliteConfig) -> Result<SqlitePool> {
        let path = &config.path;
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            tokio::fs::create_dir_all(dir)
                .await
                .map_err(|e| error::create_dir_failed(dir, e))?;
        }
        let options = SqliteConnectOptions::new()
            .filename(path)
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(match config.synchronous {
                Synchronous::Full => SqliteSynchronous::Full,
                Synchronous::Normal => SqliteSynchronous::Normal,
            })
            .busy_timeout(config.busy_timeout);
        let pool_options = SqlitePoolOptions::new()
            .max_connections(config.max_connections)
            .min_connections(0)
            // Waiting for a pooled connection is bounded like waiting for the file.
            .acquire_timeout(config.busy_timeout + Duration::from_secs(1))
            // Connections to a local file do not go stale like sockets.
            .test_before_acquire(false);
        // Switching a new file to WAL needs an exclusive lock that SQLite does
        // not wait for (no busy handler): processes opening a fresh file
        // together get SQLITE_BUSY at once. Retry that within the busy timeout.
        let start = tokio::time::Instant::now();
        let mut pause = Duration::from_millis(2);
        let pool = loop {
            match pool_options.clone().connect_with(options.clone()).await {
                Ok(pool) => break pool,
                Err(e) if error::is_busy(&e) && start.elapsed() < config.busy_timeout => {
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(Duration::from_millis(50));
                }
                Err(e) => return Err(error::open_failed(path, e)),
            }
        };
        if let Err(e) = check_version(&pool).await {
            pool.close().await;
            return Err(e);
        }
        Ok(pool)
    }

    /// Creates or upgrades the schema for the table name. Idempotent and safe
    /// from several processes at once. Returns the schema versions applied.
    ///
    /// # Errors
    ///
    /// [`Error::Config`] for bad settings, [`Error::Backend`] when the file
    /// cannot be created, opened or written (retryable when it is busy).
    pub async fn migrate(self) -> Result<Vec<u32>> {
        let config = self.validated()?;
        let pool = Self::open(&config).await?;
        let applied = schema::ensure(&pool, &config.table, Upgrade::Apply).await;
        pool.close().await;
        applied
    }

    /// Opens the store: creates the directory, the file and a missing table
    /// (see the crate docs on why `connect` creates the schema here).
    ///
    /// # Errors
    ///
    /// * [`Error::Config`] for bad settings, an SQLite older than 3.42, or a
    ///   table at an older schema version (the message names `migrate`).
    /// * [`Error::Backend`] when the directory or file cannot be created or
    ///   opened (not retryable: fix the path or permissions), or when another
    ///   process keeps the file locked past `busy_timeout` (retryable).
    pub async fn connect(self) -> Result<SqliteLock> {
        let config = self.validated()?;
        let pool = Self::open(&config).await?;
        if let Err(e) = schema::ensure(&pool, &config.table, Upgrade::CreateOnly).await {
            pool.close().await;
            return Err(e);
        }
        // One scope per file and table, however the path was spelled, so
        // releases wake this process's waiters on every instance.
        let file = tokio::fs::canonicalize(&config.path)
            .await
            .unwrap_or_else(|_| config.path.clone());
        let scope = format!("sqlite://{}#{}", file.display(), config.table);
        let engine = UniqueKey::new(pool, config.table.quoted(""), scope);
        Ok(SqliteLock {
            inner: Arc::new(Inner { config, engine }),
        })
    }
}

async fn check_version(pool: &SqlitePool) -> Result<()> {
    let version: String = sqlx::query("SELECT sqlite_version()")
        .fetch_one(pool)
        .await
        .map_err(error::map)?
        .try_get(0)
        .map_err(error::map)?;
    let mut parts = version.split('.').map(|p| p.parse::<u32>().unwrap_or(0));
    let found = (parts.next().unwrap_or(0), parts.next().unwrap_or(0));
    if found < MIN_SQLITE {
        return Err(Error::config(format!(
            "SQLite {version} is too old: fenced-sqlite needs {}.{} or newer \
             (build with sqlx's bundled SQLite, the `sqlite` feature)",
            MIN_SQLITE.0, MIN_SQLITE.1
        )));
    }
    Ok(())
}

impl SqliteLock {
    /// A builder from a URL.
    ///
    /// # Errors
    ///
    /// [`Error::Config`] for a malformed URL.
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
    /// [`Error::Config`] when `FENCED_HOME` is relative, or none of the
    /// variables gives a location.
    pub fn default_path() -> Result<PathBuf> {
        config::default_path_from(|name| std::env::var_os(name))
    }

    /// [`SqliteLock::default_path`] as a `sqlite://` URL (percent-encoded).
    ///
    /// # Errors
    ///
    /// As [`SqliteLock::default_path`], or [`Error::Config`] for a path that
    /// is not UTF-8.
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

/// The entry for `fenced::connect(url)`: connects with [`SqliteLock::connect`]
/// and migrates with [`SqliteLock::migrate`].
pub fn driver() -> fenced_api::Driver {
    fenced_api::Driver {
        name: "sqlite",
        schemes: SCHEMES,
        connect: |url| {
            Box::pin(async move {
                Ok(Arc::new(SqliteLock::connect(&url).await?) as Arc<dyn DistributedLock>)
            })
        },
        migrate: Some(|url| Box::pin(async move { SqliteLock::migrate(&url).await.map(|_| ()) })),
    }
}

#[async_trait]
impl DistributedLock for SqliteLock {
    async fn try_acquire(&self, key: &LockKey, opts: &LockOptions) -> Result<Option<Lease>> {
        self.inner.engine.try_acquire(key, opts).await
    }

    async fn acquire(&self, key: &LockKey, opts: &LockOptions) -> Result<Lease> {
        self.inner.engine.acquire(key, opts).await
    }

    async fn extend(&self, lease: &Lease, ttl: Duration) -> Result<Lease> {
        self.inner.engine.extend(lease, ttl).await
    }

    async fn extend_many(&self, leases: &[Lease], ttl: Duration) -> Vec<Result<Lease>> {
        self.inner.engine.extend_many(leases, ttl).await
    }

    async fn release(&self, lease: &Lease) -> Result<ReleaseOutcome> {
        self.inner.engine.release(lease).await
    }

    async fn inspect(&self, key: &LockKey) -> Result<Option<LockInfo>> {
        self.inner.engine.inspect(key).await
    }

    async fn force_release(&self, key: &LockKey) -> Result<bool> {
        self.inner.engine.force_release(key).await
    }

    async fn list(&self, limit: usize) -> Result<Vec<LockInfo>> {
        self.inner.engine.list(limit).await
    }

    fn capabilities(&self) -> Capabilities {
        self.inner.engine.capabilities()
    }
}

/// Compile-time checks that the public types can cross threads and tasks.
#[allow(dead_code)]
fn _assert_send_sync() {
    fn ok<T: Send + Sync + 'static>() {}
    ok::<SqliteLock>();
    ok::<SqliteLockBuilder>();
    ok::<SqliteConfig>();
}
