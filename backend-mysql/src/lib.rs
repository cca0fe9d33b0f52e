//! MySQL / MariaDB backend of [fenced](https://docs.rs/fenced): three lock
//! strategies behind one [`DistributedLock`], tested on MariaDB 10.11 and
//! written in SQL that also runs on MySQL 8.0. One statement is
//! MariaDB-only: `row_lock`'s single-statement grant (`SET STATEMENT
//! innodb_lock_wait_timeout = 0 FOR REPLACE … SELECT … FOR UPDATE`). A
//! server that refuses it (MySQL: no `SET STATEMENT`) is detected by its
//! error and `row_lock` switches to the portable two-statement grant
//! (`SELECT … FOR UPDATE [NOWAIT]`, then the token); every other statement
//! is the same on both.
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
//! | rows to create first | none | none per key (created on first use); **fixed ids: [`MySqlLock::create_rows`]** | none (created on first use) |
//! | reentrancy | by owner, across instances | by owner, **per `MySqlLock` instance** (see below) | by owner, across instances |
//! | business writes in the same transaction | no | yes: [`MySqlLock::lock_in_transaction`] | no |
//! | holder's [`Label`](fenced_api::Label) (schema 4; NULL without one; a re-entry keeps the first) | `label` column of the row, written by the granting `INSERT` | `label` of the grant's description in `<base>_live`, written by the token statement | `label` column of the row, set by the taking `UPDATE`, cleared with the holder |
//! | **measured**: uncontended acquire + release /s | 3 589 | 13 432 | 3 431 |
//! | **measured**: 16 tasks of one process on one key, hold 20 ms: acquisitions/s, hand-off p99 | 44 /s, 3.23 ms | 46 /s, 1.47 ms | 44 /s, 3.26 ms |
//! | **measured**: hand-off to another *process*, p50 / p90 / p99 | 14–16 / 33–38 / 70–72 ms | 0.6 / 1.2–1.6 / 4.6–55 ms | 12–16 / 34–35 / 62–101 ms |
//! | **measured**: 10 000 locks held by one client | held, 0 lost, 3 server connections | not run: it would take 10 000 connections | held, 0 lost, 3 server connections |
//! | statements per acquire + release (refused try) | 2 (1) | 2 (1 + a background `ROLLBACK`); 3 (1 + 1) on MySQL | 2 (1) |
//!
//! Where the rows marked *measured* come from: `BENCHMARKS.md` at the
//! workspace root (`fenced bench --full`, 2026-11-30, 2 vCPUs, loopback
//! MariaDB 10.11; same run, peers: the seeds' naive insert lock 4 659 /s, the
//! seeds' `BEGIN` / `FOR UPDATE` / `COMMIT` row lock 10 331 /s, both
//! uncontended), except the hand-off to another process: `cargo run --release
//! -p fenced-mysql --example measure` (three runs of 200 hand-offs each,
//! 2026-12-01, the same 2-vCPU AMD EPYC VM and MariaDB, with other test runs
//! loading it — load average 4–7 — so take the tails as rough). Statement
//! counts are held exactly by `tests/statements.rs`.
//!
//! * **unique_key** fits most jobs: cheap holds, durable, no connection held
//!   while you work. Its cost is a durable write per acquire *and* per
//!   release. It **refuses `innodb_autoinc_lock_mode = 2`**, MySQL 8's
//!   default ([`MySqlLock::connect`] returns [`Error::Config`]): in that mode a
//!   waiting `INSERT` can be granted an older, lower id than one already
//!   granted, and tokens would go backwards. Fix: start the server with
//!   `innodb_autoinc_lock_mode=1` (`[mysqld]` in `my.cnf`; it is not a dynamic
//!   variable), or choose `optimistic` or `row_lock`, which work with any
//!   mode. MariaDB's default is 1.
//! * **row_lock** fits "do these writes under the lock and commit them with
//!   the release" — the seeds' same-transaction advice — and hot keys whose
//!   waiters should be handed the lock the moment it is freed. Size the pool
//!   (`max_connections`) for held locks + waiters: this crate uses its own
//!   pool, so waiting never starves the application's pool. Its TTL is whole
//!   seconds (minimum 1 s). Row modes ([`RowMode`]): one row per key,
//!   created on first use (default); N hashed shards; or **fixed ids, which
//!   must be created before use with [`MySqlLock::create_rows`]** (once, after
//!   `migrate`; `migrate` itself creates no lock rows) — an unknown fixed id
//!   is an [`Error::Config`] found by a plain read, never by locking the
//!   missing row.
//! * **optimistic** fits a fixed, known set of keys that are locked over and
//!   over: one round trip per acquire, no row churn, no reaper.
//!
//! **Reentrancy of `row_lock` is per instance.** A hold is a transaction on
//! one connection of the [`MySqlLock`] that took it, so only that instance can
//! re-enter it (count up, last release frees). The same owner through another
//! instance — another process, or a second `MySqlLock` built from the same URL
//! — is a second transaction that InnoDB would make wait for the first: it
//! gets [`Error::AlreadyHeld`] at once instead (found after the refused
//! attempt, from the key's grant description and
//! `information_schema.INNODB_TRX`). That check needs the `PROCESS`
//! privilege and does not work in [`RowMode::Shards`]: without the privilege
//! (common on managed servers), or with shards, such an attempt waits for
//! itself until its wait bound and ends in [`Error::Timeout`]. InnoDB serves
//! `INNODB_TRX` from a cache it refills at most every 0.1 s, so the check
//! reads it with a witness and may take up to a second (up to 2 s more
//! while other such reads of the process wait for their turn); while
//! something else on the server reads that table more often than every
//! 0.1 s the cache never refills, and the attempt waits as without the
//! privilege. Everything else works without `PROCESS` (tested: lock,
//! refuse, wait, `inspect`, `list` — which then probes every described
//! key). `unique_key` and `optimistic` keep the owner in the row, so any
//! instance of that owner re-enters.
//!
//! ## Corrections to the articles' comparison
//!
//! The source articles (§4.4 "两种方案怎么选") compare the insert
//! lock and the fixed-row lock. Measured here, and as built in this crate:
//!
//! * *"数据表规模：会持续增长" (the insert lock's table keeps growing)* — not
//!   if releases delete and dead holders are taken over: `unique_key`'s table
//!   holds one row per *held* key; an expired row is deleted by the next
//!   acquire of its key, the rest by the reaper. Its size is a metric
//!   ([`MySqlLock::table_stats`]). It is `optimistic` and per-key `row_lock`
//!   whose tables grow, with distinct keys, never with traffic.
//! * *"并发性能：插入有自增锁和索引维护开销 / 行锁等待相对更可控"* — uncontended,
//!   the row lock is indeed faster (13 432 vs 3 589 acquisitions/s), but not
//!   because of the auto-increment lock or index upkeep: `unique_key` commits
//!   two durable writes per cycle (like the naive insert lock, 4 659 /s) where
//!   the row lock commits none. Under contention the hold time decides: 16
//!   tasks holding 20 ms get 44–46 /s from all three strategies.
//! * *"锁超时处理：事务超时或设置锁等待超时" (the row lock times out by
//!   transaction or lock-wait timeout)* — `innodb_lock_wait_timeout` bounds a
//!   *waiter*, never the holder: a frozen holder keeps the row until its
//!   connection dies. `row_lock` therefore sets the connection's
//!   `wait_timeout` to the TTL and renews by running a statement on it.
//! * *"预先准备锁记录：必须初始化" (rows must exist first)* — only for fixed
//!   ids ([`MySqlLock::create_rows`]); per-key and sharded rows are created on
//!   first use, with a plain read first so no missing row is ever locked.
//! * *"适用场景：高频但锁数量固定"* — fine for a few hot keys, but each held
//!   lock and each waiter is an open connection: 10 000 held locks would need
//!   10 000 connections, where `unique_key` held 10 000 with 3.
//! * *"代码复杂度：事务边界清晰代码更简单"* — simple for the caller, not for the
//!   library: the lock is an open transaction whose connection must never go
//!   back to a pool mid-transaction, whose abandoned waits must be killed on
//!   the server, and whose token must survive its rollback.
//! * §5.1's figures (50 threads holding one key 20 ms: 147 /s; 5 ms: 350 /s)
//!   exceed what a held lock allows — one holder at a time, 20 ms each, is at
//!   most 50 /s (5 ms: 200 /s). Measured here with 50 tasks: 44–46 /s and
//!   130–152 /s.
//! * *"MySQL 分布式锁天然不支持重入"* (the second article: no reentrancy) —
//!   all three strategies re-enter, opt-in and counted (`row_lock`: per
//!   instance, above).
//!
//! ## Statements per operation
//!
//! Counted by the server (`Questions`; the test `tests/statements.rs` holds
//! them to these numbers):
//!
//! | strategy | acquire + release | refused try | the statements |
//! |---|---|---|---|
//! | unique_key | 2 | 1 | `INSERT … ON DUPLICATE KEY UPDATE`, `DELETE` |
//! | optimistic | 2 | 1 | `UPDATE` (take), `UPDATE` (release) |
//! | row_lock (MariaDB) | 2 | 1 + 1 | `REPLACE … SELECT … FOR UPDATE` (lock + token), `ROLLBACK` |
//! | row_lock (MySQL) | 3 | 1 + 1 | `SELECT … FOR UPDATE`, `REPLACE` (token), `ROLLBACK` |
//!
//! — the counts of the seeds' naive insert lock (2) and row lock (`BEGIN`,
//! `FOR UPDATE`, `COMMIT`: 3) or fewer, with fencing, expiry on the server's
//! clock and owner checks included. A refused `row_lock` try answers after
//! its one statement; the `+ 1` is a `ROLLBACK` sent in the background
//! before its connection is kept (the refusal leaves the transaction, and
//! its metadata locks on the lock tables, open — DDL would wait for them). A `row_lock` acquire that has to wait
//! costs 4 (the refused try, the waiting `FOR UPDATE`, the token, the
//! release). With an explicit owner, a refused `row_lock` try also reads
//! the key's grant description (the same-owner check above: 2 statements),
//! and a waiting acquire makes such a try first; a try refused because
//! another owner holds the key through the *same* instance costs one read
//! (is the holding connection still alive?) instead of none. No statement
//! is spent on session settings, and connections are reused without the
//! `COM_PING` a sqlx pool sends per checkout and per return (see the
//! `row_lock` module docs for what each of its statements carries). Taking over an expired row costs `unique_key` two
//! more statements (a guarded `DELETE`, the `INSERT` again); a key's first
//! `optimistic` acquisition creates its row (`INSERT IGNORE`).
//!
//! ## Hand-off
//!
//! `row_lock` waits in InnoDB's queue and is handed the lock by the server:
//! 0.6 ms at the median to a waiter in another process. The polling
//! strategies (`unique_key`, `optimistic`) hand off in about 1 ms only when
//! the release happens in the same process (the release wakes the waiter;
//! p99 3.2 ms with 16 tasks). A waiter in **another process** only notices at
//! its next poll — backoff from 5 ms doubling to 200 ms, with jitter — so
//! after holds of 10–60 ms the gap from release to grant measured p50
//! 12–16 ms, p90 33–38 ms, p99 62–101 ms (worst of 1 200 hand-offs:
//! 189 ms; `examples/measure.rs`, 2026-12-01, 2 vCPUs, loaded). Where
//! cross-process hand-off latency matters, use `row_lock` (or Redis / etcd,
//! which push the release to waiters).
//!
//! # Housekeeping and metrics
//!
//! [`MySqlLock::spawn_reaper`] runs in the background for every strategy:
//! for `unique_key` each pass deletes expired rows in batches (guarded so one
//! node reaps a table at a time, and bounded to half the guard's TTL), and for
//! all three it publishes the table size as the gauges `fenced_table_rows`
//! and `fenced_table_expired_rows` (labels `backend`, `table`; see
//! [`METRIC_TABLE_ROWS`]) and logs it. [`MySqlLock::table_stats`] returns the
//! same counts on demand, [`MySqlLock::purge_stale`] is the seeds' daily
//! purge of long-dead `unique_key` rows.
//!
//! # Pitfalls handled (from the source articles)
//!
//! * owner tokens: release and extend check owner **and** token, so a slow
//!   ex-holder never deletes the next holder's lock;
//! * database clock: every expiry is `UTC_TIMESTAMP(6)` on the server, never
//!   the client's clock or session time zone;
//! * renewal and `max_hold`: by [`LockClient`](fenced_api::LockClient) for every strategy;
//! * reentrancy: opt-in, counted (`reentrant_count`);
//! * gap locks: `row_lock` never locks a missing row (fixed ids included);
//! * pool exhaustion: the lock has its own pool; `try_acquire` never waits
//!   for a lock (only, when every connection is busy, for a connection);
//! * replicas: connecting to a read-only server is refused;
//! * table growth: `unique_key` takes over expired rows inline and has a
//!   batched reaper guarded by a lock of its own; every strategy's table size
//!   is a metric.
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
//! from MariaDB 10.2.4 / MySQL 8.0); `unique_key` also
//! `innodb_autoinc_lock_mode` 0 or 1 (above). Do not put triggers on
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
pub mod fence;
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
