//! `row_lock`: `SELECT … FOR UPDATE` on a row that exists (the seeds'
//! "posture two", fixed-id / per-key / sharded rows).
//!
//! The held lock **is** an open transaction on a dedicated connection kept
//! inside the backend; the lease stays plain data. Consequences, all handled:
//!
//! * waiting is InnoDB's own lock queue (native, roughly FIFO), bounded by a
//!   client-side deadline (the abandoned statement is killed) and re-armed in
//!   chunks of `innodb_lock_wait_timeout`; `try_acquire` uses `NOWAIT`;
//! * the row is created first (`INSERT IGNORE`, autocommit): a `FOR UPDATE`
//!   on a missing row would take a gap lock;
//! * a frozen or vanished holder loses the lock after its TTL because the
//!   connection's `wait_timeout` is the TTL (rounded up to whole seconds)
//!   and every renewal is a statement on that connection;
//! * a connection whose hold ends abnormally (future dropped, instance
//!   dropped, error) is closed, never reused mid-transaction.
//!
//! # Statements per acquire + release
//!
//! Two on MariaDB — one fewer than the seeds' `BEGIN` / `SELECT … FOR
//! UPDATE` / `COMMIT` — once a connection has served one hold:
//!
//! 1. `SET STATEMENT innodb_lock_wait_timeout = 0 FOR REPLACE INTO <base>_live
//!    … SELECT … FROM <base>_rows r JOIN <base>_live l … FOR UPDATE`: the row
//!    lock, the fencing token and the holder's description (owner, label,
//!    expiry, connection id, for `inspect` and `force_release`) in one
//!    statement.
//!    The connection runs with `autocommit = 0`, so it opens the
//!    transaction (no `START TRANSACTION`). A held row refuses it at once —
//!    a refused `try_acquire` waits for this one statement. The refusal
//!    rolls the statement back, not the transaction it opened, which keeps
//!    metadata locks on both tables (DDL on them would wait): the
//!    connection is kept with a `ROLLBACK` sent in the background, a second
//!    statement on the server that the caller does not wait for and that
//!    has answered before the connection serves again ([`conn`]). Not
//!    `NOWAIT`: that would also refuse when another holder's token
//!    statement has the `MEMORY` table's lock for a few microseconds.
//! 2. `ROLLBACK` — the release.
//!
//! An `acquire` that finds the row held queues with a plain `SELECT … FOR
//! UPDATE` (a waiting `REPLACE … SELECT` would keep the `MEMORY` table locked
//! — every other key blocked — for the whole wait), then takes its token with
//! `REPLACE INTO <base>_live … SELECT …` on the holding connection: four
//! statements for a contended acquisition, with the hand-off done by InnoDB's
//! queue. That token statement is also the proof that the hold is alive
//! after the grant: the lease counts from its send time, so a lease granted
//! after a long wait is never born expired.
//!
//! MySQL has no `SET STATEMENT`; there (and with `row_lock_one_statement=false`)
//! every grant takes the two-statement path: `SELECT … FOR UPDATE [NOWAIT]`,
//! the token `REPLACE`, `ROLLBACK` — three per cycle, a refused try one
//! (`… NOWAIT`, plus the background `ROLLBACK`).
//!
//! What is *not* sent per hold any more, and why that is safe:
//!
//! * session settings (`autocommit`, `wait_timeout`, `innodb_lock_wait_timeout`)
//!   and the connection id: set once when a pooled connection becomes a lock
//!   connection ([`conn`]), `wait_timeout` again only when the TTL changes;
//!   lock connections are kept between holds and never handed back to the
//!   pool with that session;
//! * a separate token bump on a second connection, a holder mark and a
//!   `DO 1` proof after the grant, clearing the holder at release: all folded
//!   into the token statement; a stale description after a release is harmless
//!   because `inspect` confirms with a `NOWAIT` probe and `force_release`
//!   only kills a connection whose latest grant was that key;
//! * no `COM_PING` per pool checkout or return (see [`crate::conn`]).
//!
//! # Fencing tokens without a durable write per acquire
//!
//! `<base>_live` is a `MEMORY` table: not transactional, so the token taken
//! *inside* the holder's transaction survives that transaction's rollback —
//! a released, rolled-back or killed holder never gives its token back —
//! and a write there costs no log flush. Its `AUTO_INCREMENT` id is the
//! token (one counter per table, so tokens of all keys are comparable). A
//! `MEMORY` table is emptied by a server restart; the `REPLACE … SELECT`
//! only writes while the table's lifetime row (`\x01lifetime`) exists, and a
//! fresh lifetime starts its ids at `epoch << 40`, where `epoch` is bumped
//! durably (autocommit `InnoDB` write in `<base>_fence`) once per server
//! lifetime — so every token after a restart exceeds every token before it.
//! Opening a lifetime needs a committed write, which the holding
//! transaction cannot make: the grant is given back, the lifetime opened on
//! that same connection (no second connection is ever needed while a row is
//! held, so holders cannot deadlock on a full pool), and the row locked
//! again — once per server lifetime.
//!
//! Fallbacks, both correct but a round trip dearer: if `<base>_live` is not
//! a `MEMORY` table (the engine is disabled and was substituted) the token is
//! taken in autocommit on a second connection (a durable `InnoDB` counter);
//! if the server refuses non-transactional writes inside a transaction
//! (MySQL with `enforce_gtid_consistency`), likewise, on the same `MEMORY`
//! table. That connection is reserved *before* the row is locked, and a
//! waited grant also sends `DO 1` on the holding connection before the
//! lease counts (a `NOWAIT` grant counts from the locking statement's send).

mod conn;
mod hold;
mod innodb_trx;
mod list;
mod local;
mod token;
mod transaction;

use std::{
    collections::{HashMap, HashSet},
    fmt,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc, Mutex,
    },
    time::Duration,
};

use async_trait::async_trait;
use fenced_api::{
    wait::wait_deadline, Capabilities, DistributedLock, Error, Label, Lease, LockInfo, LockKey,
    LockOptions, Owner, ReleaseOutcome, Result,
};
use sqlx::{MySqlPool, Row, SqlStr};
use tokio::time::Instant;

use self::conn::{plain, HeldConn, KillQueryOnDrop, LockConn, LockConns, WAIT_CHUNK_SECS};
use self::token::Granted;
pub(crate) use self::token::{live_is_memory, LIFETIME_KEY};
pub use self::transaction::RowLockTransaction;
use crate::conn::Conns;
use crate::error::{self, SqlResultExt};
use crate::sql;
use crate::strategy::micros;

/// Which row a key locks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum RowMode {
    /// One row per key, created on first use (default).
    #[default]
    PerKey,
    /// Rows created ahead of time with [`MySqlLock::create_rows`](crate::MySqlLock::create_rows)
    /// (the seeds' `fixed_lock` table; `migrate` creates none). Locking an
    /// unknown key is an [`Error::Config`], found by a plain (non-locking)
    /// read — a `FOR UPDATE` on the missing row would take a gap lock.
    /// Rows seen once are cached, so a known key costs no extra statement.
    Fixed,
    /// Keys hashed onto N rows (the seeds' §5.3): bounded table size, but two
    /// keys on the same shard exclude each other.
    Shards(u32),
}

/// Who a grant is for, as its description in `<base>_live` records it.
#[derive(Clone, Copy)]
struct Grant<'a> {
    owner: &'a Owner,
    /// The effective TTL (whole seconds, see [`effective_ttl`]).
    ttl: Duration,
    label: Option<&'a Label>,
}

impl<'a> Grant<'a> {
    fn new(owner: &'a Owner, ttl: Duration, opts: &'a LockOptions) -> Self {
        Grant {
            owner,
            ttl,
            label: opts.label(),
        }
    }

    fn label_param(&self) -> Option<&'a [u8]> {
        self.label.map(|l| l.as_str().as_bytes())
    }
}

/// A fresh grant, before the token.
struct Locked<'a> {
    held: HeldConn,
    /// When the locking statement was sent.
    sent: Instant,
    /// Whether the grant came after a (possibly long) wait.
    waited: bool,
    /// Only when tokens are taken in autocommit: the side connection for
    /// it, reserved *before* locking — waiting for the pool while holding
    /// could deadlock holders that each wait for a second connection.
    side: Option<crate::conn::Conn<'a>>,
    /// The token, when the locking statement took it too.
    token: Option<u64>,
}

struct HeldRow {
    owner: Owner,
    token: u64,
    count: u32,
    /// The lease deadline: after it the hold is treated as gone here.
    deadline: Instant,
    conn: Arc<tokio::sync::Mutex<Option<HeldConn>>>,
}

/// SQL for one base table, built once.
struct Sql {
    lock_token: SqlStr,
    ensure_row: SqlStr,
    row_exists: SqlStr,
    lock_nowait: SqlStr,
    lock_wait: SqlStr,
    token: SqlStr,
    touch: SqlStr,
    read_live: SqlStr,
    list_in_trx: SqlStr,
    list_described: SqlStr,
    moved_on: SqlStr,
    same_owner_described: SqlStr,
    same_owner: SqlStr,
    epoch: SqlStr,
    open_lifetime: SqlStr,
    prune: SqlStr,
}

pub(crate) struct RowLock {
    conns: Conns,
    locks: LockConns,
    max_connections: u32,
    mode: RowMode,
    op_timeout: Duration,
    /// Token inside the holder's transaction (see the module docs).
    token_in_txn: AtomicBool,
    /// Lock and token in one statement (see the module docs).
    one_statement: AtomicBool,
    held: Mutex<HashMap<LockKey, HeldRow>>,
    known_rows: Mutex<HashSet<Vec<u8>>>,
    sql: Sql,
}

impl fmt::Debug for RowLock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RowLock")
            .field("mode", &self.mode)
            .field("token_in_txn", &self.token_in_txn)
            .field("one_statement", &self.one_statement)
            .finish_non_exhaustive()
    }
}

/// The TTL the server enforces: `wait_timeout` is in whole seconds.
pub(crate) fn effective_ttl(ttl: Duration) -> (u64, Duration) {
    let secs = ttl.as_micros().div_ceil(1_000_000).max(1) as u64;
    (secs, Duration::from_secs(secs))
}

/// Fixed-row mode, and the key has no row.
fn no_fixed_row(key: &LockKey) -> Error {
    Error::config(format!(
        "no lock row for `{key}`: fixed-row mode needs its rows created first, with \
         MySqlLock::create_rows (once, e.g. at deploy time after migrate)"
    ))
}

fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

pub(crate) struct Tables {
    pub(crate) rows: String,
    pub(crate) fence: String,
    pub(crate) live: String,
}

impl RowLock {
    pub(crate) fn new(
        pool: MySqlPool,
        tables: Tables,
        mode: RowMode,
        op_timeout: Duration,
        live_is_memory: bool,
        one_statement: bool,
    ) -> Self {
        let Tables { rows, fence, live } = tables;
        let now_plus = "UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND";
        let max_connections = pool.options().get_max_connections();
        RowLock {
            conns: Conns::new(pool),
            locks: LockConns::new(),
            max_connections,
            mode,
            op_timeout,
            token_in_txn: AtomicBool::new(live_is_memory),
            one_statement: AtomicBool::new(live_is_memory && one_statement),
            held: Mutex::default(),
            known_rows: Mutex::default(),
            sql: Sql {
                // MariaDB's per-statement setting makes InnoDB refuse at once
                // (like NOWAIT) while the MEMORY table lock is still waited
                // for; NOWAIT itself would also refuse when another holder's
                // token statement has that table for a few microseconds.
                lock_token: sql!(
                    "SET STATEMENT innodb_lock_wait_timeout = 0 FOR \
                     REPLACE INTO {live} (lock_key, owner, hold_count, expire_time, conn_id, label) \
                     SELECT ?, ?, 1, {now_plus}, CONNECTION_ID(), ? \
                     FROM {rows} r JOIN {live} l ON l.lock_key = ? WHERE r.lock_key = ? FOR UPDATE"
                ),
                ensure_row: sql!("INSERT IGNORE INTO {rows} (lock_key) VALUES (?)"),
                row_exists: sql!("SELECT 1 FROM {rows} WHERE lock_key = ?"),
                lock_nowait: sql!(
                    "SELECT lock_key, CONNECTION_ID() FROM {rows} WHERE lock_key = ? FOR UPDATE NOWAIT"
                ),
                lock_wait: sql!(
                    "SELECT lock_key, CONNECTION_ID() FROM {rows} WHERE lock_key = ? FOR UPDATE"
                ),
                // Writes only while the lifetime row exists (0 rows otherwise);
                // the new AUTO_INCREMENT id comes back in the OK packet.
                token: sql!(
                    "REPLACE INTO {live} (lock_key, owner, hold_count, expire_time, conn_id, label) \
                     SELECT ?, ?, 1, {now_plus}, ?, ? FROM {live} WHERE lock_key = ?"
                ),
                touch: sql!(
                    "UPDATE {live} SET expire_time = {now_plus}, hold_count = ? WHERE lock_key = ? AND id = ?"
                ),
                read_live: sql!(
                    "SELECT owner, id, hold_count, \
                     COALESCE(TIMESTAMPDIFF(MICROSECOND, UTC_TIMESTAMP(6), expire_time), 0), label, \
                     conn_id FROM {live} WHERE lock_key = ?"
                ),
                // Candidates for `list` (see `list.rs`): each key's latest
                // grant whose connection has not gone on to a later grant,
                // in key order — with `INNODB_TRX` (needs `PROCESS`) only
                // those whose connection is inside a transaction.
                list_in_trx: sql!(
                    "SELECT l.owner, l.id, l.hold_count, \
                     COALESCE(TIMESTAMPDIFF(MICROSECOND, UTC_TIMESTAMP(6), l.expire_time), 0), l.label, \
                     l.lock_key FROM {live} l JOIN information_schema.INNODB_TRX t ON t.trx_mysql_thread_id = l.conn_id \
                     WHERE l.lock_key <> ? AND l.owner IS NOT NULL \
                     AND NOT EXISTS (SELECT 1 FROM {live} m WHERE m.conn_id = l.conn_id AND m.id > l.id) \
                     ORDER BY l.lock_key"
                ),
                list_described: sql!(
                    "SELECT l.owner, l.id, l.hold_count, \
                     COALESCE(TIMESTAMPDIFF(MICROSECOND, UTC_TIMESTAMP(6), l.expire_time), 0), l.label, \
                     l.lock_key FROM {live} l WHERE l.lock_key <> ? AND l.owner IS NOT NULL \
                     AND NOT EXISTS (SELECT 1 FROM {live} m WHERE m.conn_id = l.conn_id AND m.id > l.id) \
                     ORDER BY l.lock_key"
                ),
                moved_on: sql!("SELECT 1 FROM {live} WHERE conn_id = ? AND id > ? LIMIT 1"),
                // The key's latest grant is this owner's, unexpired, and
                // its connection has not gone on to a later grant.
                same_owner_described: sql!(
                    "SELECT 1 FROM {live} l \
                     WHERE l.lock_key = ? AND l.owner = ? AND l.expire_time > UTC_TIMESTAMP(6) \
                     AND NOT EXISTS (SELECT 1 FROM {live} m WHERE m.conn_id = l.conn_id AND m.id > l.id) \
                     LIMIT 1"
                ),
                // The same, and that connection is still inside a
                // transaction: that transaction holds the key.
                same_owner: sql!(
                    "SELECT 1 FROM {live} l \
                     JOIN information_schema.INNODB_TRX t ON t.trx_mysql_thread_id = l.conn_id \
                     WHERE l.lock_key = ? AND l.owner = ? AND l.expire_time > UTC_TIMESTAMP(6) \
                     AND NOT EXISTS (SELECT 1 FROM {live} m WHERE m.conn_id = l.conn_id AND m.id > l.id) \
                     LIMIT 1"
                ),
                epoch: sql!(
                    "INSERT INTO {fence} (lock_key, fence) VALUES (?, LAST_INSERT_ID(1)) \
                     ON DUPLICATE KEY UPDATE fence = LAST_INSERT_ID(fence + 1)"
                ),
                open_lifetime: sql!(
                    "INSERT IGNORE INTO {live} (id, lock_key, hold_count) VALUES (?, ?, 0)"
                ),
                prune: sql!(
                    "DELETE FROM {live} WHERE lock_key <> ? AND expire_time < UTC_TIMESTAMP(6) LIMIT 1000"
                ),
            },
        }
    }

    /// The row a key locks.
    fn row_key(&self, key: &LockKey) -> Vec<u8> {
        match self.mode {
            RowMode::PerKey | RowMode::Fixed => key.as_bytes().to_vec(),
            // `\x01` cannot appear in a key, so shard rows never collide with keys.
            RowMode::Shards(n) => {
                format!("\u{1}shard:{}", fnv1a(key.as_bytes()) % u64::from(n.max(1))).into_bytes()
            }
        }
    }

    /// A plain autocommit connection for side statements.
    async fn plain(&self) -> Result<crate::conn::Conn<'_>> {
        plain(&self.conns, &self.locks, self.max_connections).await
    }

    /// One side statement returning one row (table statistics), on a plain
    /// connection — evicting an idle lock connection if the pool is full.
    pub(crate) async fn fetch_one(
        &self,
        q: sqlx::query::Query<'_, sqlx::MySql, sqlx::mysql::MySqlArguments>,
    ) -> Result<sqlx::mysql::MySqlRow> {
        let mut c = self.plain().await?;
        let r = q.fetch_one(c.conn()).await;
        c.finish(&r);
        r.db()
    }

    /// Pre-creates rows (for [`RowMode::Fixed`], or to warm any mode).
    pub(crate) async fn create_rows(&self, keys: &[LockKey]) -> Result<u64> {
        let mut created = 0;
        for key in keys {
            let mut c = self.plain().await?;
            let r = sqlx::query(self.sql.ensure_row.clone())
                .bind(self.row_key(key))
                .execute(c.conn())
                .await;
            c.finish(&r);
            created += r.db()?.rows_affected();
            self.remember_row(&self.row_key(key));
        }
        Ok(created)
    }

    /// Makes sure the row exists before it is locked. A non-locking read
    /// first: `INSERT IGNORE` on a row that another holder has locked would
    /// wait for that holder (the duplicate check takes a shared lock).
    ///
    /// In fixed-row mode a missing row is a configuration error, found by
    /// that same non-locking read — never by a `FOR UPDATE`, which on a
    /// missing row takes a gap lock (blocking inserts of neighbouring rows,
    /// `create_rows` of other ids included) until it is rolled back. Rows
    /// are only cached once seen: a row created later (by `create_rows` on
    /// another node) is found by the next read.
    async fn ensure_row(&self, key: &LockKey, row: &[u8]) -> Result<()> {
        let known = self
            .known_rows
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .contains(row);
        if known {
            return Ok(());
        }
        let mut c = self.plain().await?;
        let r = sqlx::query(self.sql.row_exists.clone())
            .bind(row)
            .fetch_optional(c.conn())
            .await;
        let exists = match r {
            Ok(r) => r.is_some(),
            Err(e) => {
                c.settle(Some(&e));
                return Err(error::map(e));
            }
        };
        if !exists && self.mode == RowMode::Fixed {
            c.settle(None);
            return Err(no_fixed_row(key));
        }
        let r = if exists {
            Ok(())
        } else {
            sqlx::query(self.sql.ensure_row.clone())
                .bind(row)
                .execute(c.conn())
                .await
                .map(|_| ())
        };
        c.finish(&r);
        r.db()?;
        self.remember_row(row);
        Ok(())
    }

    fn remember_row(&self, row: &[u8]) {
        let mut set = self.known_rows.lock().unwrap_or_else(|p| p.into_inner());
        if set.len() > 100_000 {
            set.clear();
        }
        set.insert(row.to_vec());
    }

    fn forget_row(&self, row: &[u8]) {
        self.known_rows
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(row);
    }

    /// A lock connection with `wait_timeout = ttl_secs` (any, for `None`: a
    /// momentary probe): a kept one, else a pooled one adopted into the lock
    /// session — waiting for the pool no longer than `deadline` (when given;
    /// `None` returned after it).
    async fn lock_conn(
        &self,
        ttl_secs: Option<u64>,
        deadline: Option<Instant>,
    ) -> Result<Option<LockConn>> {
        let mut lc = match self.locks.pop().await {
            Some(c) => c,
            None => {
                let pooled = match self.conns.take_cached() {
                    Some(c) => c,
                    None => match self.conns.queue_for_pool(deadline).await.db()? {
                        Some(c) => c,
                        None => return Ok(None),
                    },
                };
                LockConns::adopt(pooled, ttl_secs.unwrap_or(WAIT_CHUNK_SECS)).await?
            }
        };
        if let Some(secs) = ttl_secs {
            lc.set_wait(secs).await?;
        }
        Ok(Some(lc))
    }

    /// Takes the row lock. `wait = None` means NOWAIT; `Some(d)` waits in
    /// InnoDB's queue until the client-side deadline `d`. `None` when the
    /// lock is held elsewhere or the wait (chunk) ran out.
    async fn lock_row(
        &self,
        key: &LockKey,
        grant: Option<Grant<'_>>,
        ttl_secs: Option<u64>,
        wait: Option<Instant>,
    ) -> Result<Option<Locked<'_>>> {
        let row = self.row_key(key);
        let mut attempts = 0;
        loop {
            attempts += 1;
            self.ensure_row(key, &row).await?;
            let side = if self.token_in_txn.load(Ordering::Relaxed) || ttl_secs.is_none() {
                None
            } else {
                Some(self.plain().await?)
            };
            let Some(lc) = self.lock_conn(ttl_secs, wait).await? else {
                return Ok(None);
            };
            let reused = lc.reused;
            let mut held = HeldConn(Some(lc));
            if let Some(g) = grant.filter(|_| self.one_statement.load(Ordering::Relaxed)) {
                let sent = Instant::now();
                let res = sqlx::query(self.sql.lock_token.clone())
                    .bind(key.as_bytes())
                    .bind(g.owner.as_str().as_bytes())
                    .bind(micros(g.ttl))
                    .bind(g.label_param())
                    .bind(token::LIFETIME_KEY)
                    .bind(&row)
                    .execute(held.conn()?)
                    .await;
                match res {
                    Ok(done) if done.rows_affected() > 0 => {
                        return Ok(Some(Locked {
                            held,
                            sent,
                            waited: false,
                            side,
                            token: Some(done.last_insert_id()),
                        }));
                    }
                    // No row to lock, or no token lifetime: give back any gap
                    // lock; the two-statement path below sorts either out.
                    Ok(_) => {
                        sqlx::raw_sql("ROLLBACK").execute(held.conn()?).await.db()?;
                    }
                    // Held elsewhere (refused at once, no row lock taken,
                    // but the transaction it opened is still open): a
                    // refused try costs this one statement on its path and
                    // a background ROLLBACK; a waiting acquire queues below.
                    Err(e) if error::is_lock_conflict(&e) => {
                        if wait.is_none() {
                            if let Some(lc) = held.take() {
                                self.locks
                                    .put_rolling_back(lc, &self.conns, self.op_timeout);
                            }
                            return Ok(None);
                        }
                    }
                    Err(e) if token::refuses_one_statement(&e) => {
                        tracing::info!(error = %e, "the server does not take row_lock's single-statement grant; using two statements");
                        self.one_statement.store(false, Ordering::Relaxed);
                    }
                    Err(e) if reused && !error::leaves_session_usable(&e) => {
                        tracing::debug!(key = %key, error = %e, "kept lock connection was dead; retrying on a fresh one");
                        if attempts >= 3 {
                            return Err(error::map(e));
                        }
                        continue;
                    }
                    Err(e) => return Err(error::map(e)),
                }
            }
            // A blocking wait that is abandoned (timeout, dropped future) must
            // leave InnoDB's queue too: closing the socket does not stop a
            // server-side lock wait, `KILL QUERY` does.
            let mut abandon = wait.map(|_| KillQueryOnDrop {
                conns: self.conns.clone(),
                conn_id: held.0.as_ref().map_or(0, |c| c.id),
                armed: true,
            });
            let sql = if wait.is_some() {
                &self.sql.lock_wait
            } else {
                &self.sql.lock_nowait
            };
            let sent = Instant::now();
            let query = sqlx::query(sql.clone())
                .bind(&row)
                .fetch_optional(held.conn()?);
            let res = match wait {
                // Client-side bound for sub-second precision; on expiry the
                // attempt is dropped, its query killed, its connection closed.
                Some(deadline) => match tokio::time::timeout_at(deadline, query).await {
                    Ok(r) => r,
                    Err(_) => return Ok(None),
                },
                None => query.await,
            };
            // The statement finished: nothing to kill any more.
            if let Some(a) = abandon.as_mut() {
                a.armed = false;
            }
            match res {
                Ok(Some(r)) => {
                    let conn_id: u64 = r.try_get(1).db()?;
                    let lc = held.lock_conn()?;
                    if lc.id != conn_id {
                        // Cannot happen unless the session was swapped under
                        // us; trust the server.
                        lc.id = conn_id;
                    }
                    return Ok(Some(Locked {
                        held,
                        sent,
                        waited: wait.is_some(),
                        side,
                        token: None,
                    }));
                }
                Ok(None) => {
                    // The row vanished (purged): never keep a gap lock. Roll
                    // back, recreate, retry.
                    sqlx::raw_sql("ROLLBACK").execute(held.conn()?).await.db()?;
                    if let Some(lc) = held.take() {
                        self.locks.put(lc, &self.conns);
                    }
                    // Seen before, deleted since (cached rows skip the read).
                    self.forget_row(&row);
                    if self.mode == RowMode::Fixed {
                        return Err(no_fixed_row(key));
                    }
                }
                // Refused (NOWAIT) or the wait chunk ran out: the statement is
                // rolled back and holds no row lock, but its transaction —
                // with the metadata locks on the lock tables — is still open:
                // the connection is kept with a ROLLBACK sent in the
                // background. A refused try costs this one statement on the
                // caller's path (and that ROLLBACK on the server).
                Err(e) if error::is_lock_conflict(&e) => {
                    if error::number(&e) == Some(error::code::DEADLOCK) {
                        // A deadlock victim's whole transaction is gone already.
                        tracing::debug!(key = %key, "lock wait chosen as deadlock victim");
                    }
                    if let Some(lc) = held.take() {
                        self.locks
                            .put_rolling_back(lc, &self.conns, self.op_timeout);
                    }
                    return Ok(None);
                }
                // A kept connection the server closed meanwhile (idle timeout,
                // restart, KILL): nothing was locked on it; try a fresh one.
                Err(e) if reused && !error::leaves_session_usable(&e) => {
                    tracing::debug!(key = %key, error = %e, "kept lock connection was dead; retrying on a fresh one");
                }
                Err(e) => return Err(error::map(e)),
            }
            if attempts >= 3 {
                return Err(Error::backend(
                    error::BACKEND,
                    true,
                    format!("could not lock the row for `{key}` after {attempts} attempts (row disappearing or connections dying)"),
                ));
            }
        }
    }

    fn take_held(&self, lease: &Lease) -> Option<std::result::Result<u32, HeldRow>> {
        let mut held = self.held.lock().unwrap_or_else(|p| p.into_inner());
        let h = held.get_mut(&lease.key)?;
        if h.owner != lease.owner || h.token != lease.token.get() {
            return None;
        }
        if h.count > 1 {
            h.count -= 1;
            return Some(Ok(h.count));
        }
        held.remove(&lease.key).map(Err)
    }

    /// Ends a hold with `ROLLBACK` and keeps the connection for the next
    /// one. False if the connection was dead (the server had already rolled
    /// back: the lock was lost).
    async fn end_hold(&self, mut held: HeldConn) -> bool {
        let Ok(conn) = held.conn() else { return false };
        if sqlx::raw_sql("ROLLBACK").execute(conn).await.is_err() {
            return false;
        }
        if let Some(lc) = held.take() {
            self.locks.put(lc, &self.conns);
        }
        true
    }

    async fn wait_for_row(
        &self,
        key: &LockKey,
        grant: Grant<'_>,
        ttl_secs: u64,
        deadline: Option<Instant>,
        start: Instant,
    ) -> Result<Locked<'_>> {
        loop {
            let sent = Instant::now();
            // The server ends a wait after WAIT_CHUNK_SECS (and the loop
            // re-arms it); the client ends it at the caller's deadline.
            let chunk_end = sent + Duration::from_secs(WAIT_CHUNK_SECS + 1);
            let wait = match deadline {
                None => Some(chunk_end),
                Some(d) if d <= sent => None,
                Some(d) => Some(d.min(chunk_end)),
            };
            if let Some(locked) = self
                .lock_row(key, Some(grant), Some(ttl_secs), wait)
                .await?
            {
                return Ok(locked);
            }
            let now = Instant::now();
            if deadline.is_some_and(|d| now >= d) {
                return Err(Error::Timeout {
                    key: key.clone(),
                    waited: now - start,
                });
            }
        }
    }

    /// Whether another connection holds the row lock of `key` (NOWAIT probe
    /// on a lock connection, rolled back).
    async fn probe_held(&self, key: &LockKey) -> Result<bool> {
        match self.lock_row(key, None, None, None).await? {
            None => Ok(true),
            Some(locked) => {
                if self.end_hold(locked.held).await {
                    Ok(false)
                } else {
                    Err(Error::backend(
                        error::BACKEND,
                        true,
                        "the inspect probe lost its connection",
                    ))
                }
            }
        }
    }
}

#[async_trait]
impl DistributedLock for RowLock {
    async fn try_acquire(&self, key: &LockKey, opts: &LockOptions) -> Result<Option<Lease>> {
        let (ttl_secs, ttl) = effective_ttl(opts.ttl());
        let sent = Instant::now();
        match self.local(key, opts, ttl, sent)? {
            Some(Some(lease)) => {
                if let Some(lease) = self.reentered(lease, opts.ttl()).await? {
                    return Ok(Some(lease));
                }
            }
            // Held through this instance by another owner — unless its
            // connection has died meanwhile: then compete on the server.
            Some(None) if !self.local_hold_gone(key).await? => return Ok(None),
            Some(None) | None => {}
        }
        let owner = opts.owner_or_random();
        let grant = Grant::new(&owner, ttl, opts);
        for _ in 0..3 {
            let Some(locked) = self
                .lock_row(key, Some(grant), Some(ttl_secs), None)
                .await?
            else {
                self.refuse_same_owner(key, opts).await?;
                return Ok(None);
            };
            if let Granted::Lease(l) = self.register(key, grant, locked).await? {
                return Ok(Some(l));
            }
        }
        Err(Error::backend(
            error::BACKEND,
            true,
            "the row_lock token table kept being reset; try again",
        ))
    }

    async fn acquire(&self, key: &LockKey, opts: &LockOptions) -> Result<Lease> {
        let (ttl_secs, ttl) = effective_ttl(opts.ttl());
        let start = Instant::now();
        if let Some(Some(lease)) = self.local(key, opts, ttl, start)? {
            if let Some(lease) = self.reentered(lease, opts.ttl()).await? {
                return Ok(lease);
            }
        }
        // An explicit owner tries without waiting first: a refusal tells
        // whether that owner holds the key through another instance, where
        // waiting would be waiting for itself (one more statement, only for
        // a contended acquire with an explicit owner).
        if opts.owner().is_some() && opts.wait() != fenced_api::WaitPolicy::NoWait {
            if let Some(lease) = self.try_acquire(key, opts).await? {
                return Ok(lease);
            }
        }
        let owner = opts.owner_or_random();
        let grant = Grant::new(&owner, ttl, opts);
        let deadline = wait_deadline(opts.wait(), start);
        loop {
            let locked = self
                .wait_for_row(key, grant, ttl_secs, deadline, start)
                .await?;
            if let Granted::Lease(l) = self.register(key, grant, locked).await? {
                return Ok(l);
            }
        }
    }

    async fn extend(&self, lease: &Lease, ttl: Duration) -> Result<Lease> {
        self.extend_hold(lease, ttl).await
    }

    async fn release(&self, lease: &Lease) -> Result<ReleaseOutcome> {
        self.release_hold(lease).await
    }

    async fn inspect(&self, key: &LockKey) -> Result<Option<LockInfo>> {
        self.inspect_key(key).await
    }

    /// See [`list_held`](Self::list_held): one `SELECT` of the grant
    /// descriptions, then a `NOWAIT` probe per candidate not held through
    /// this instance.
    async fn list(&self, limit: usize) -> Result<Vec<LockInfo>> {
        self.list_held(limit).await
    }

    async fn force_release(&self, key: &LockKey) -> Result<bool> {
        self.force_release_key(key).await
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities::none()
            .backend("mysql/row_lock")
            .native_wait(true)
            .transaction_scoped(true)
            .fencing(true)
            .reentrant(true)
            .min_ttl(Duration::from_secs(1))
    }
}
