//! MySQL / MariaDB backend of [fenced](https://docs.rs/fenced): three lock
//! strategies behind one [`DistributedLock`], tested on MariaDB 10.11 and
//! written in SQL that also runs on MySQL 8.0 (no MariaDB-only syntax).
//!
//! ```no_run
//! use std::time::Duration;
//! use fenced_api::{LockClient, LockKey};
//! use fenced_mysql::MySqlLock;
//!
//! # async fn run() -> fenced_api::Result<()> {
//! let url = "mysql://app:secret@db.internal:3306/app?strategy=unique_key&table=fenced_locks";
//! MySqlLock::migrate(url).await?;                 // once, at deploy time
//! let store = MySqlLock::connect(url).await?;     // checks schema and refuses replicas
//! let client = LockClient::builder(std::sync::Arc::new(store))
//!     .ttl(Duration::from_secs(30))
//!     .build()?;
//! let guard = client.acquire("order:1001").await?;
//! // … UPDATE orders SET …, fence = ? WHERE id = 1001 AND fence <= ?  (guard.token())
//! guard.release().await?;
//! # Ok(()) }
//! ```
//!
//! # Connecting
//!
//! The URL carries the server, the strategy and the table (the namespace);
//! [`MySqlConfig::from_url`] lists every parameter. An unknown parameter, or
//! one given twice, is an [`Error::Config`] naming it — a typo such as
//! `tabel=jobs` would otherwise put the application in the shared default
//! table. [`MySqlLock::connect`] makes one connection directly before the
//! pool starts, so an unreachable server is a retryable [`Error::Backend`]
//! within `connect_timeout` whose one line names `host:port` and the cause
//! ("cannot connect to mysql at 127.0.0.1:3306: connection refused (is the
//! server running?)"), never the password.
//!
//! **TLS** (rustls; trusts the system's roots, `SSL_CERT_FILE`, and the
//! `ssl-ca` file): `?ssl-mode=VERIFY_IDENTITY&ssl-ca=/etc/mysql/ca.pem`
//! verifies the chain and the host name, `VERIFY_CA` the chain only,
//! `REQUIRED` encrypts without verifying (an active attacker can still read
//! along), `PREFERRED` (the default) uses TLS, unverified, when the server
//! offers it and plaintext otherwise, `DISABLED` never. A server that
//! requires TLS refuses `DISABLED`; a certificate from another CA fails
//! `VERIFY_CA` — both at connect, with the cause in the message.
//! `ssl-cert` / `ssl-key` present a client certificate.
//!
//! # Choosing a strategy
//!
//! | | `unique_key` (default) | `row_lock` | `optimistic` |
//! |---|---|---|---|
//! | acquire | autocommit `INSERT … ON DUPLICATE KEY UPDATE`; duplicate key = held | `… FOR UPDATE` opening a transaction | conditional `UPDATE` of the key's row |
//! | release | `DELETE` (owner + id checked) | `ROLLBACK` / `COMMIT` | `UPDATE` clearing the holder |
//! | fencing token | the row's `AUTO_INCREMENT` id | the `AUTO_INCREMENT` id of a `MEMORY` table written inside the holder's transaction (survives its rollback; a server restart starts a higher, durably counted epoch) | the row's `version` |
//! | expiry of a dead holder | `expire_time` on the DB clock; taken over at the next acquire | the connection's `wait_timeout` (whole seconds) closes it and InnoDB rolls back | `expire_time` on the DB clock |
//! | waiting | polling with backoff, woken at once by releases in the same process | InnoDB's lock queue (native, immediate hand-off) | polling with backoff, like `unique_key` |
//! | survives a DB restart | yes (rows and ids are durable) | no: the transaction rolls back (later tokens still exceed earlier ones) | yes |
//! | connections | one per operation, returned at once | **one per held lock and per waiter** for the whole hold | one per operation |
//! | table growth | one row per *held* key; expired rows removed by takeover or the reaper | one row per key ever locked (or N shards, or fixed ids) | one row per key ever locked |
//! | business writes in the same transaction | no | yes: [`MySqlLock::lock_in_transaction`] | no |
//!
//! * **unique_key** fits most jobs: cheap holds, durable, no connection held
//!   while you work. Its cost is a write per acquire *and* per release.
//! * **row_lock** fits "do these writes under the lock and commit them with
//!   the release" — the seeds' same-transaction advice — and hot keys whose
//!   waiters should be handed the lock the moment it is freed. Size the pool
//!   (`max_connections`) for held locks + waiters: this crate uses its own
//!   pool, so waiting never starves the application's pool. Its TTL is whole
//!   seconds (minimum 1 s).
//! * **optimistic** fits a fixed, known set of keys that are locked over and
//!   over: one round trip per acquire, no row churn, no reaper.
//!
//! Statements per operation, counted by the server (`Questions`; the test
//! `tests/statements.rs` holds them to these numbers):
//!
//! | strategy | acquire + release | refused try | the statements |
//! |---|---|---|---|
//! | unique_key | 2 | 1 | `INSERT … ON DUPLICATE KEY UPDATE`, `DELETE` |
//! | optimistic | 2 | 1 | `UPDATE` (take), `UPDATE` (release) |
//! | row_lock (MariaDB) | 2 | 1 | `REPLACE … SELECT … FOR UPDATE` (lock + token), `ROLLBACK` |
//! | row_lock (MySQL) | 3 | 1 | `SELECT … FOR UPDATE`, `REPLACE` (token), `ROLLBACK` |
//!
//! — the counts of the seeds' naive insert lock (2) and row lock (`BEGIN`,
//! `FOR UPDATE`, `COMMIT`: 3) or fewer, with fencing, expiry on the server's
//! clock and owner checks included. A `row_lock` acquire that has to wait
//! costs 4 (the refused try, the waiting `FOR UPDATE`, the token, the
//! release). No statement is spent on session
//! settings, and connections are reused without the `COM_PING` a sqlx pool
//! sends per checkout and per return (see the `row_lock` module docs for
//! what each of its statements carries). Taking over an expired row costs
//! `unique_key` two more statements (a guarded `DELETE`, the `INSERT` again);
//! a key's first `optimistic` acquisition creates its row (`INSERT IGNORE`).
//! The polling strategies hand off in ~1 ms only when the release happens
//! in the same process (in-process wake-up); across processes a waiter
//! notices within its backoff (5 ms doubling to 200 ms). `row_lock` waits in
//! InnoDB's queue and is handed the lock at once.
//!
//! # Pitfalls handled (from the source articles)
//!
//! * owner tokens: release and extend check owner **and** token, so a slow
//!   ex-holder never deletes the next holder's lock;
//! * database clock: every expiry is `UTC_TIMESTAMP(6)` on the server, never
//!   the client's clock or session time zone;
//! * renewal and `max_hold`: by [`LockClient`](fenced_api::LockClient) for every strategy;
//! * reentrancy: opt-in, counted (`reentrant_count`);
//! * gap locks: `row_lock` never locks a missing row;
//! * pool exhaustion: the lock has its own pool; `try_acquire` never waits;
//! * replicas: connecting to a read-only server is refused;
//! * table growth: `unique_key` takes over expired rows inline and has a
//!   batched reaper ([`MySqlLock::spawn_reaper`]) guarded by a lock of its own.
//!
//! Speed: `unique_key`'s table is clustered on `lock_key` (schema 3), so
//! re-taking a just-released key reuses its record instead of stepping over
//! delete-marked index entries (≈ 3.5× faster acquire + release on one key);
//! a [`LockClient`](fenced_api::LockClient) holding many locks renews them
//! with one `UPDATE` per 256 leases
//! ([`extend_many`](fenced_api::DistributedLock::extend_many)) for
//! `unique_key` and `optimistic`.
//!
//! Requires MariaDB ≥ 10.3 or MySQL ≥ 8.0 (`NOWAIT`, persistent auto-increment
//! from MariaDB 10.2.4 / MySQL 8.0). `unique_key` also requires
//! `innodb_autoinc_lock_mode` 0 or 1 (MariaDB's default is 1; MySQL 8's is
//! 2, where [`MySqlLock::connect`] refuses it with [`Error::Config`]: with 2 a
//! waiting INSERT can be granted an older, lower id and tokens go backwards;
//! `optimistic` and `row_lock` work with any mode). Do not put triggers on
//! fenced's tables: `unique_key` and `optimistic` read each verdict and token
//! from the statement's OK packet, and a trigger that inserts a row changes
//! the insert id that packet carries. Tokens that must exceed every earlier
//! one after a server *crash* rely on committed writes being durable
//! (`innodb_flush_log_at_trx_commit = 1`, the default). `row_lock` uses a
//! `MEMORY` table for its tokens; where that engine is unavailable, or MySQL
//! refuses non-transactional writes inside transactions
//! (`enforce_gtid_consistency`), it falls back to taking each token in
//! autocommit on a second connection — correct, one round trip dearer. All
//! nodes sharing a table must run the same schema version of this crate
//! (`row_lock` tokens of schema 1 and 2 are not comparable). Not for Galera
//! or async-replicated failover setups: a failover can lose locks (use etcd
//! for that).
#![forbid(unsafe_code)]
#![warn(missing_docs, missing_debug_implementations, unreachable_pub)]

mod config;
mod conn;
mod error;
mod reaper;
mod schema;
mod stats;
mod strategy;

use std::{fmt, sync::Arc, time::Duration};

use async_trait::async_trait;
use fenced_api::{
    Capabilities, DistributedLock, Error, Lease, LockInfo, LockKey, LockOptions, ReleaseOutcome,
    Result,
};
use sqlx::mysql::MySqlPoolOptions;

pub use config::{
    MySqlConfig, Strategy, TableName, DEFAULT_CONNECT_TIMEOUT, DEFAULT_MAX_CONNECTIONS,
    DEFAULT_OP_TIMEOUT, DEFAULT_TABLE,
};
pub use reaper::ReaperHandle;
pub use schema::SCHEMA_VERSION;
pub use sqlx;
pub use stats::{
    TableRows, TableStats, METRIC_REAPED_ROWS, METRIC_TABLE_EXPIRED_ROWS, METRIC_TABLE_ROWS,
};
pub use strategy::row_lock::{RowLockTransaction, RowMode};

use strategy::{optimistic::Optimistic, row_lock::RowLock, unique_key::UniqueKey};

/// Builds a prepared-statement string from SQL whose only dynamic parts are
/// validated, backtick-quoted table names (see [`TableName`]).
macro_rules! sql {
    ($($fmt:tt)*) => {
        sqlx::SqlSafeStr::into_sql_str(sqlx::AssertSqlSafe(std::sync::Arc::<str>::from(format!($($fmt)*))))
    };
}
pub(crate) use sql;

/// URL schemes this backend serves.
pub const SCHEMES: &[&str] = &["mysql", "mariadb"];

/// The entry for `fenced::connect(url)`: connects with [`MySqlLock::connect`]
/// and migrates with [`MySqlLock::migrate`].
pub fn driver() -> fenced_api::Driver {
    fenced_api::Driver {
        name: "mysql",
        schemes: SCHEMES,
        connect: |url| {
            Box::pin(async move {
                Ok(Arc::new(MySqlLock::connect(&url).await?) as Arc<dyn DistributedLock>)
            })
        },
        migrate: Some(|url| Box::pin(async move { MySqlLock::migrate(&url).await.map(|_| ()) })),
    }
}

/// A lock store on MySQL / MariaDB. Cheap to clone (shares the pool).
#[derive(Clone)]
pub struct MySqlLock {
    inner: Arc<Inner>,
}

struct Inner {
    config: MySqlConfig,
    engine: Engine,
}

enum Engine {
    UniqueKey(UniqueKey),
    RowLock(RowLock),
    Optimistic(Optimistic),
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
            Ok(Err(e)) => return Err(error::connect_failed(cfg, e)),
            Err(_) => {
                return Err(Error::backend(
                    error::BACKEND,
                    true,
                    format!(
                        "cannot connect to mysql at {}: no answer within {:?} (is the server running and reachable?)",
                        config::server_name(&cfg.connect),
                        cfg.connect_timeout
                    ),
                ))
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
        let scope = format!("{}#{}", cfg.display_url, cfg.table);
        let t = &cfg.table;
        let engine = match cfg.strategy {
            Strategy::UniqueKey => {
                strategy::unique_key::check_autoinc_mode(&pool, &cfg.display_url).await?;
                Engine::UniqueKey(UniqueKey::new(pool, t.quoted(""), scope))
            }
            Strategy::Optimistic => {
                Engine::Optimistic(Optimistic::new(pool, t.quoted("_optimistic"), scope))
            }
            Strategy::RowLock => {
                let memory =
                    strategy::row_lock::live_is_memory(&pool, &format!("{}_live", t.as_str()))
                        .await?;
                if !memory {
                    tracing::warn!(table = %t, "`{t}_live` is not a MEMORY table: row_lock takes each token with a durable write");
                }
                Engine::RowLock(RowLock::new(
                    pool,
                    strategy::row_lock::Tables {
                        rows: t.quoted("_rows"),
                        fence: t.quoted("_fence"),
                        live: t.quoted("_live"),
                    },
                    b.rows,
                    cfg.op_timeout,
                    memory,
                    cfg.row_lock_one_statement,
                ))
            }
        };
        Ok(MySqlLock {
            inner: Arc::new(Inner {
                config: cfg,
                engine,
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
                backend: "mysql",
                what: format!(
                    "transaction-scoped locks with strategy {}; use row_lock",
                    self.inner.config.strategy
                ),
            }),
        }
    }

    /// `row_lock` only: pre-creates lock rows (required for [`RowMode::Fixed`]).
    ///
    /// # Errors
    ///
    /// [`Error::Unsupported`] for other strategies, [`Error::Backend`] on failure.
    pub async fn create_rows(&self, keys: &[LockKey]) -> Result<u64> {
        match &self.inner.engine {
            Engine::RowLock(r) => r.create_rows(keys).await,
            _ => Err(Error::Unsupported {
                backend: "mysql",
                what: "lock rows outside row_lock".into(),
            }),
        }
    }

    pub(crate) fn unique_key(&self) -> Option<&UniqueKey> {
        match &self.inner.engine {
            Engine::UniqueKey(u) => Some(u),
            _ => None,
        }
    }
}

impl MySqlLock {
    /// Bounds one operation: a silent network yields a retryable error
    /// instead of a hang.
    async fn bounded<T>(
        &self,
        what: &str,
        fut: impl std::future::Future<Output = Result<T>>,
    ) -> Result<T> {
        let after = self.inner.config.op_timeout;
        match tokio::time::timeout(after, fut).await {
            Ok(r) => r,
            Err(_) => Err(Error::backend(
                error::BACKEND,
                true,
                format!("{what}: no answer from the server within {after:?}"),
            )),
        }
    }
}

#[async_trait]
impl DistributedLock for MySqlLock {
    async fn try_acquire(&self, key: &LockKey, opts: &LockOptions) -> Result<Option<Lease>> {
        self.bounded("try_acquire", self.engine().try_acquire(key, opts))
            .await
    }

    async fn acquire(&self, key: &LockKey, opts: &LockOptions) -> Result<Lease> {
        match opts.wait() {
            fenced_api::WaitPolicy::Forever => self.engine().acquire(key, opts).await,
            fenced_api::WaitPolicy::NoWait => {
                self.bounded("acquire", self.engine().acquire(key, opts))
                    .await
            }
            fenced_api::WaitPolicy::Timeout(d) => {
                let bound = d.saturating_add(self.inner.config.op_timeout);
                match tokio::time::timeout(bound, self.engine().acquire(key, opts)).await {
                    Ok(r) => r,
                    Err(_) => Err(Error::backend(
                        error::BACKEND,
                        true,
                        format!("acquire: no answer from the server within {bound:?}"),
                    )),
                }
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

    fn capabilities(&self) -> Capabilities {
        self.engine().capabilities()
    }
}

/// Leases renewed by one statement: far below MySQL's 65 535 placeholders,
/// small enough that a statement stays a short write.
const EXTEND_CHUNK: usize = 256;

/// Batch renewals go to the strategy's one-statement form; each is bounded
/// by the operation timeout like any other statement, and the one-by-one
/// fallback goes through [`MySqlLock`]'s own (bounded) `extend`.
#[async_trait]
impl fenced_api::batch::ExtendChunk for MySqlLock {
    async fn extend_chunk(
        &self,
        owner: &fenced_api::Owner,
        chunk: &[&Lease],
        ttl: Duration,
    ) -> Result<fenced_api::batch::ChunkVerdict> {
        use fenced_api::batch::ChunkVerdict;
        match &self.inner.engine {
            Engine::UniqueKey(u) => {
                self.bounded("extend_many", u.extend_chunk(owner, chunk, ttl))
                    .await
            }
            Engine::Optimistic(o) => {
                self.bounded("extend_many", o.extend_chunk(owner, chunk, ttl))
                    .await
            }
            // Each held row lock is its own open transaction: one by one.
            Engine::RowLock(_) => Ok(ChunkVerdict::Unknown),
        }
    }
}
