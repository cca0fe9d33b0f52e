//! `row_lock`: `SELECT … FOR UPDATE` on a row that exists (the seeds'
//! "posture two", fixed-id / per-key / sharded rows).
//!
//! The held lock **is** an open transaction on a dedicated connection kept
//! inside the backend; the lease stays plain data. Consequences, all handled:
//!
//! * waiting is InnoDB's own lock queue (native, roughly FIFO), bounded with
//!   `innodb_lock_wait_timeout` (whole seconds, re-armed in chunks for long
//!   waits) plus a client-side deadline; `try_acquire` uses `NOWAIT`;
//! * the row is created first (`INSERT IGNORE`, autocommit): a `FOR UPDATE`
//!   on a missing row would take a gap lock;
//! * a frozen or vanished holder loses the lock after its TTL because the
//!   connection's `wait_timeout` is set to the TTL (rounded up to whole
//!   seconds) and every renewal is a statement on that connection;
//! * the fencing token lives in a separate `_fence` table bumped in
//!   autocommit while the row lock is held: a rolled-back or killed holder
//!   never takes its token back, so tokens strictly increase;
//! * a connection whose hold ends abnormally (future dropped, instance
//!   dropped, error) is closed, never returned to the pool with an open
//!   transaction.

use std::{
    collections::{HashMap, HashSet},
    fmt,
    sync::{Arc, Mutex},
    time::Duration,
};

use async_trait::async_trait;
use fenced_api::{
    wait::wait_deadline, Capabilities, DistributedLock, Error, FencingToken, Lease, LockInfo,
    LockKey, LockOptions, Owner, ReleaseOutcome, Result,
};
use sqlx::{pool::PoolConnection, MySql, MySqlConnection, MySqlPool, Row, SqlStr};
use tokio::time::Instant;

use super::{info_from_row, micros};
use crate::error::{self, SqlResultExt};
use crate::sql;

/// Which row a key locks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum RowMode {
    /// One row per key, created on first use (default).
    #[default]
    PerKey,
    /// Rows created ahead of time with [`MySqlLock::create_rows`](crate::MySqlLock::create_rows)
    /// (the seeds' `fixed_lock` table); locking an unknown key is a configuration error.
    Fixed,
    /// Keys hashed onto N rows (the seeds' §5.3): bounded table size, but two
    /// keys on the same shard exclude each other.
    Shards(u32),
}

/// Longest single `innodb_lock_wait_timeout` we arm; longer waits re-arm.
const WAIT_CHUNK_SECS: u64 = 50;

/// A connection holding (or trying to take) a row lock. Dropped without
/// [`HeldConn::into_pooled`], it is **closed**, so the server rolls the
/// transaction back; it is never returned to the pool mid-transaction.
struct HeldConn(Option<PoolConnection<MySql>>);

impl HeldConn {
    fn conn(&mut self) -> Result<&mut MySqlConnection> {
        match self.0.as_mut() {
            Some(c) => Ok(&mut **c),
            None => Err(Error::backend(
                error::BACKEND,
                true,
                "the lock connection is gone",
            )),
        }
    }

    /// The connection after a clean end of the transaction: back to the pool.
    fn into_pooled(mut self) -> Option<PoolConnection<MySql>> {
        self.0.take()
    }
}

impl Drop for HeldConn {
    fn drop(&mut self) {
        if let Some(c) = self.0.as_mut() {
            c.close_on_drop();
        }
    }
}

/// A fresh grant, before the token bump.
struct Locked {
    held: HeldConn,
    conn_id: u64,
    bump: PoolConnection<MySql>,
}

/// Kills the statement of an abandoned lock wait (see `lock_row`).
struct KillQueryOnDrop {
    pool: MySqlPool,
    conn_id: u64,
    armed: bool,
}

impl Drop for KillQueryOnDrop {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let (pool, id) = (self.pool.clone(), self.conn_id);
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(async move {
                // The id is a number the server gave us; KILL cannot be prepared.
                let _ = sqlx::raw_sql(sqlx::AssertSqlSafe(format!("KILL QUERY {id}")))
                    .execute(&pool)
                    .await;
            });
        }
    }
}

struct HeldRow {
    owner: Owner,
    token: u64,
    count: u32,
    /// The `wait_timeout` last set on the connection (the server-side TTL).
    wait_secs: u64,
    /// The lease deadline: after it the hold is treated as gone here.
    deadline: Instant,
    conn: Arc<tokio::sync::Mutex<Option<HeldConn>>>,
}

pub(crate) struct RowLock {
    pool: MySqlPool,
    mode: RowMode,
    op_timeout: Duration,
    held: Mutex<HashMap<LockKey, HeldRow>>,
    known_rows: Mutex<HashSet<Vec<u8>>>,
    ensure_row: SqlStr,
    row_exists: SqlStr,
    mark_holder: SqlStr,
    read_holder: SqlStr,
    lock_nowait: SqlStr,
    lock_wait: SqlStr,
    bump_fence: SqlStr,
    touch_fence: SqlStr,
    clear_fence: SqlStr,
    read_fence: SqlStr,
    create_row: SqlStr,
}

impl fmt::Debug for RowLock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RowLock")
            .field("mode", &self.mode)
            .finish_non_exhaustive()
    }
}

/// The TTL the server enforces: `wait_timeout` is in whole seconds.
pub(crate) fn effective_ttl(ttl: Duration) -> (u64, Duration) {
    let secs = ttl.as_micros().div_ceil(1_000_000).max(1) as u64;
    (secs, Duration::from_secs(secs))
}

fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

impl RowLock {
    pub(crate) fn new(
        pool: MySqlPool,
        rows: String,
        fence: String,
        mode: RowMode,
        op_timeout: Duration,
    ) -> Self {
        let now_plus = "UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND";
        RowLock {
            pool,
            mode,
            op_timeout,
            held: Mutex::default(),
            known_rows: Mutex::default(),
            ensure_row: sql!("INSERT IGNORE INTO {rows} (lock_key) VALUES (?)"),
            row_exists: sql!("SELECT 1 FROM {rows} WHERE lock_key = ?"),
            mark_holder: sql!("UPDATE {rows} SET holder_conn = CONNECTION_ID() WHERE lock_key = ?"),
            read_holder: sql!("SELECT holder_conn FROM {rows} WHERE lock_key = ?"),
            lock_nowait: sql!(
                "SELECT lock_key, CONNECTION_ID() FROM {rows} WHERE lock_key = ? FOR UPDATE NOWAIT"
            ),
            lock_wait: sql!(
                "SELECT lock_key, CONNECTION_ID() FROM {rows} WHERE lock_key = ? FOR UPDATE"
            ),
            bump_fence: sql!(
                "INSERT INTO {fence} (lock_key, fence, owner, hold_count, expire_time, conn_id) \
                 VALUES (?, LAST_INSERT_ID(1), ?, 1, {now_plus}, ?) \
                 ON DUPLICATE KEY UPDATE fence = LAST_INSERT_ID(fence + 1), owner = ?, hold_count = 1, \
                 expire_time = {now_plus}, conn_id = ?"
            ),
            touch_fence: sql!(
                "UPDATE {fence} SET expire_time = {now_plus}, hold_count = ? WHERE lock_key = ? AND fence = ?"
            ),
            clear_fence: sql!(
                "UPDATE {fence} SET owner = NULL, hold_count = 0, expire_time = NULL, conn_id = NULL \
                 WHERE lock_key = ? AND fence = ?"
            ),
            read_fence: sql!(
                "SELECT owner, fence, hold_count, \
                 COALESCE(TIMESTAMPDIFF(MICROSECOND, UTC_TIMESTAMP(6), expire_time), 0), conn_id \
                 FROM {fence} WHERE lock_key = ? AND owner IS NOT NULL"
            ),
            create_row: sql!("INSERT IGNORE INTO {rows} (lock_key) VALUES (?)"),
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

    /// Pre-creates rows (for [`RowMode::Fixed`], or to warm any mode).
    pub(crate) async fn create_rows(&self, keys: &[LockKey]) -> Result<u64> {
        let mut created = 0;
        for key in keys {
            created += sqlx::query(self.create_row.clone())
                .bind(self.row_key(key))
                .execute(&self.pool)
                .await
                .db()?
                .rows_affected();
        }
        Ok(created)
    }

    /// Makes sure the row exists before it is locked. A non-locking read
    /// first: `INSERT IGNORE` on a row that another holder has locked would
    /// wait for that holder (the duplicate check takes a shared lock).
    async fn ensure_row(&self, row: &[u8]) -> Result<()> {
        let known = self
            .known_rows
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .contains(row);
        if known || self.mode == RowMode::Fixed {
            return Ok(());
        }
        let exists = sqlx::query(self.row_exists.clone())
            .bind(row)
            .fetch_optional(&self.pool)
            .await
            .db()?
            .is_some();
        if !exists {
            sqlx::query(self.ensure_row.clone())
                .bind(row)
                .execute(&self.pool)
                .await
                .db()?;
        }
        let mut set = self.known_rows.lock().unwrap_or_else(|p| p.into_inner());
        if set.len() > 100_000 {
            set.clear();
        }
        set.insert(row.to_vec());
        Ok(())
    }

    fn forget_row(&self, row: &[u8]) {
        self.known_rows
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(row);
    }

    /// Opens the transaction and takes the row lock. `wait = None` means
    /// NOWAIT. Returns the connection (in the transaction) and its id, or
    /// `None` when the lock is held elsewhere / the wait chunk ran out.
    /// A pooled connection, waiting no longer than `deadline` (when given).
    async fn pool_conn(&self, deadline: Option<Instant>) -> Result<Option<PoolConnection<MySql>>> {
        match deadline {
            None => Ok(Some(self.pool.acquire().await.db()?)),
            Some(d) => match tokio::time::timeout_at(d, self.pool.acquire()).await {
                Ok(c) => Ok(Some(c.db()?)),
                Err(_) => Ok(None),
            },
        }
    }

    /// Opens the transaction and takes the row lock. `wait = None` means
    /// NOWAIT. Returns the holding connection (inside the transaction), its
    /// id, and a second connection reserved for the token bump — reserved
    /// *before* locking, so the bump never waits for the pool while the lock's
    /// idle clock runs. `None` when the lock is held elsewhere or the wait
    /// (chunk) ran out.
    async fn lock_row(
        &self,
        key: &LockKey,
        ttl_secs: u64,
        wait: Option<(u64, Instant)>,
    ) -> Result<Option<Locked>> {
        let row = self.row_key(key);
        let pool_deadline = wait.map(|(_, d)| d);
        for _ in 0..3 {
            self.ensure_row(&row).await?;
            let Some(bump) = self.pool_conn(pool_deadline).await? else {
                return Ok(None);
            };
            let Some(conn) = self.pool_conn(pool_deadline).await? else {
                return Ok(None);
            };
            let mut held = HeldConn(Some(conn));
            let conn = held.conn()?;
            let wait_secs = wait.map_or(1, |(s, _)| s);
            sqlx::query("SET SESSION wait_timeout = ?, innodb_lock_wait_timeout = ?")
                .bind(ttl_secs)
                .bind(wait_secs)
                .execute(&mut *conn)
                .await
                .db()?;
            // A blocking wait that is abandoned (timeout, dropped future) must
            // leave InnoDB's queue too: closing the socket does not stop a
            // server-side lock wait, `KILL QUERY` does.
            let mut abandon = None;
            if wait.is_some() {
                let id: u64 = sqlx::query("SELECT CONNECTION_ID()")
                    .fetch_one(&mut *conn)
                    .await
                    .db()?
                    .try_get(0)
                    .db()?;
                abandon = Some(KillQueryOnDrop {
                    pool: self.pool.clone(),
                    conn_id: id,
                    armed: true,
                });
            }
            sqlx::raw_sql("START TRANSACTION")
                .execute(&mut *conn)
                .await
                .db()?;
            let sql = if wait.is_some() {
                &self.lock_wait
            } else {
                &self.lock_nowait
            };
            let query = sqlx::query(sql.clone())
                .bind(&row)
                .fetch_optional(&mut *conn);
            let res = match wait {
                // Client-side bound for sub-second precision; on expiry the
                // attempt is dropped, its query killed, its connection closed.
                Some((_, deadline)) => match tokio::time::timeout_at(deadline, query).await {
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
                    sqlx::query(self.mark_holder.clone())
                        .bind(&row)
                        .execute(held.conn()?)
                        .await
                        .db()?;
                    return Ok(Some(Locked {
                        held,
                        conn_id,
                        bump,
                    }));
                }
                Ok(None) => {
                    // The row vanished (purged): never keep a gap lock. Roll
                    // back, recreate, retry.
                    sqlx::raw_sql("ROLLBACK").execute(held.conn()?).await.db()?;
                    if self.mode == RowMode::Fixed {
                        return Err(Error::config(format!(
                            "no lock row for `{key}`: fixed-row mode needs rows created with MySqlLock::create_rows"
                        )));
                    }
                    self.forget_row(&row);
                }
                Err(e) if error::is_lock_conflict(&e) => {
                    sqlx::raw_sql("ROLLBACK").execute(held.conn()?).await.db()?;
                    return Ok(None);
                }
                Err(e) => return Err(error::map(e)),
            }
        }
        Err(Error::backend(
            error::BACKEND,
            true,
            format!("the lock row for `{key}` kept disappearing"),
        ))
    }

    /// After the row lock is ours: bump the fencing counter (autocommit, on
    /// the reserved connection), prove the hold is still alive with one
    /// statement on the holding connection — the lease counts from *that*
    /// send time — and register the hold. A hold lost in between (its idle
    /// clock ran out) yields an error, never a lease: its burned token is
    /// harmless.
    async fn register(
        &self,
        key: &LockKey,
        owner: Owner,
        ttl: Duration,
        locked: Locked,
    ) -> Result<Lease> {
        let Locked {
            mut held,
            conn_id,
            mut bump,
        } = locked;
        let bumped = sqlx::query(self.bump_fence.clone())
            .bind(key.as_bytes())
            .bind(owner.as_str().as_bytes())
            .bind(micros(ttl))
            .bind(conn_id)
            .bind(owner.as_str().as_bytes())
            .bind(micros(ttl))
            .bind(conn_id)
            .execute(&mut *bump)
            .await;
        drop(bump);
        let token = match bumped {
            Ok(done) => done.last_insert_id(),
            Err(e) => {
                // No token, no lock: give the row back before failing.
                let _ = sqlx::raw_sql("ROLLBACK").execute(held.conn()?).await;
                return Err(error::map(e));
            }
        };
        let sent = Instant::now();
        if let Err(e) = sqlx::raw_sql("DO 1").execute(held.conn()?).await {
            return Err(Error::backend(
                error::BACKEND,
                true,
                format!("the lock connection died right after the grant ({e}); try again"),
            ));
        }
        self.held.lock().unwrap_or_else(|p| p.into_inner()).insert(
            key.clone(),
            HeldRow {
                owner: owner.clone(),
                token,
                count: 1,
                wait_secs: ttl.as_secs().max(1),
                deadline: sent + ttl,
                conn: Arc::new(tokio::sync::Mutex::new(Some(held))),
            },
        );
        Ok(Lease::new(
            key.clone(),
            owner,
            FencingToken::new(token),
            ttl,
            sent,
        ))
    }

    /// Local reentrancy / refusal when this instance already holds `key`.
    /// `Ok(None)` means "not held here".
    fn local(
        &self,
        key: &LockKey,
        opts: &LockOptions,
        ttl: Duration,
        sent: Instant,
    ) -> Result<Option<Option<Lease>>> {
        let mut held = self.held.lock().unwrap_or_else(|p| p.into_inner());
        let Some(h) = held.get_mut(key) else {
            return Ok(None);
        };
        if Instant::now() >= h.deadline {
            // Never renewed in time: the server has closed (or is about to
            // close) that connection. Drop it — closing it rolls back — and
            // let the caller compete afresh.
            held.remove(key);
            return Ok(None);
        }
        match opts.owner() {
            Some(owner) if *owner == h.owner => {
                if !opts.is_reentrant() {
                    return Err(Error::AlreadyHeld { key: key.clone() });
                }
                h.count += 1;
                Ok(Some(Some(Lease::new(
                    key.clone(),
                    h.owner.clone(),
                    FencingToken::new(h.token),
                    ttl,
                    sent,
                ))))
            }
            // Held by another owner through this very instance: contention.
            _ => Ok(Some(None)),
        }
    }

    /// Finishes a local re-entry: the holding connection's expiry is pushed
    /// out (and the hold count published) like an extend. `None` if the
    /// connection turned out to be gone — the caller then acquires afresh.
    async fn reentered(&self, lease: Lease, ttl: Duration) -> Result<Option<Lease>> {
        match self.extend(&lease, ttl).await {
            Ok(l) => Ok(Some(l)),
            Err(Error::LeaseLost { .. }) => Ok(None),
            Err(e) => Err(e),
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

    /// Ends a transaction cleanly and returns the connection to the pool
    /// with its session settings restored. False if the connection was dead
    /// (the server had already rolled back: the lock was lost).
    async fn finish(&self, mut held: HeldConn, end: &'static str) -> bool {
        let Ok(conn) = held.conn() else { return false };
        if sqlx::raw_sql(end).execute(&mut *conn).await.is_err() {
            return false;
        }
        let restored = sqlx::raw_sql(
            "SET SESSION wait_timeout = @@GLOBAL.wait_timeout, \
             innodb_lock_wait_timeout = @@GLOBAL.innodb_lock_wait_timeout",
        )
        .execute(&mut *conn)
        .await
        .is_ok();
        if restored {
            drop(held.into_pooled());
        }
        true
    }

    async fn clear_fence(&self, key: &LockKey, token: u64) {
        if let Err(e) = sqlx::query(self.clear_fence.clone())
            .bind(key.as_bytes())
            .bind(token)
            .execute(&self.pool)
            .await
        {
            tracing::debug!(key = %key, error = %e, "could not clear the fence row's holder (inspect may lag)");
        }
    }

    /// Takes `key` inside a transaction handed to the caller.
    pub(crate) async fn lock_in_transaction(
        &self,
        key: &LockKey,
        opts: &LockOptions,
    ) -> Result<RowLockTransaction> {
        let (ttl_secs, ttl) = effective_ttl(opts.ttl());
        let owner = opts.owner_or_random();
        let start = Instant::now();
        let deadline = wait_deadline(opts.wait(), start);
        if let Some(o) = opts.owner() {
            let mine = self
                .held
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .get(key)
                .is_some_and(|h| h.owner == *o);
            if mine {
                return Err(Error::AlreadyHeld { key: key.clone() });
            }
        }
        let locked = self.wait_for_row(key, ttl_secs, deadline, start).await?;
        let lease = self.register(key, owner, ttl, locked).await?;
        let row = self
            .held
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(key)
            .ok_or_else(|| Error::backend(error::BACKEND, false, "lost track of a fresh hold"))?;
        let mut conn = row.conn.lock().await.take().unwrap_or(HeldConn(None));
        // Guards against a silent end of the transaction (deadlock victim,
        // an implicit commit by DDL or a stray BEGIN): autocommit off, so
        // nothing after such an end commits on its own, and a savepoint,
        // which any end of the transaction destroys — `commit` checks it.
        let c = conn.conn()?;
        sqlx::raw_sql("SET SESSION autocommit = 0")
            .execute(&mut *c)
            .await
            .db()?;
        sqlx::raw_sql("SAVEPOINT fenced_lock")
            .execute(&mut *c)
            .await
            .db()?;
        Ok(RowLockTransaction {
            conn,
            lease,
            clear_fence: self.clear_fence.clone(),
            pool: self.pool.clone(),
        })
    }

    async fn wait_for_row(
        &self,
        key: &LockKey,
        ttl_secs: u64,
        deadline: Option<Instant>,
        start: Instant,
    ) -> Result<Locked> {
        loop {
            let sent = Instant::now();
            let wait = match deadline {
                None => Some((
                    WAIT_CHUNK_SECS,
                    sent + Duration::from_secs(WAIT_CHUNK_SECS + 1),
                )),
                Some(d) if d <= sent => None,
                Some(d) => {
                    let secs = (d - sent).as_micros().div_ceil(1_000_000) as u64;
                    Some((
                        secs.clamp(1, WAIT_CHUNK_SECS),
                        d.min(sent + Duration::from_secs(WAIT_CHUNK_SECS)),
                    ))
                }
            };
            if let Some(locked) = self.lock_row(key, ttl_secs, wait).await? {
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
            Some(None) => return Ok(None),
            None => {}
        }
        let owner = opts.owner_or_random();
        match self.lock_row(key, ttl_secs, None).await? {
            Some(locked) => Ok(Some(self.register(key, owner, ttl, locked).await?)),
            None => Ok(None),
        }
    }

    async fn acquire(&self, key: &LockKey, opts: &LockOptions) -> Result<Lease> {
        let (ttl_secs, ttl) = effective_ttl(opts.ttl());
        let start = Instant::now();
        if let Some(Some(lease)) = self.local(key, opts, ttl, start)? {
            if let Some(lease) = self.reentered(lease, opts.ttl()).await? {
                return Ok(lease);
            }
        }
        let owner = opts.owner_or_random();
        let deadline = wait_deadline(opts.wait(), start);
        let locked = self.wait_for_row(key, ttl_secs, deadline, start).await?;
        self.register(key, owner, ttl, locked).await
    }

    async fn extend(&self, lease: &Lease, ttl: Duration) -> Result<Lease> {
        let (ttl_secs, ttl) = effective_ttl(LockOptions::validate_ttl(ttl)?);
        let lost = || {
            Error::lease_lost(
                &lease.key,
                lease.token,
                "the lock transaction is gone (expired, killed or released)",
            )
        };
        let (conn, count, ttl_secs) = {
            let mut held = self.held.lock().unwrap_or_else(|p| p.into_inner());
            match held.get_mut(&lease.key) {
                Some(h) if h.owner == lease.owner && h.token == lease.token.get() => {
                    // Re-entered: never cut the expiry another entry relies on.
                    let secs = if h.count > 1 {
                        ttl_secs.max(h.wait_secs)
                    } else {
                        ttl_secs
                    };
                    h.wait_secs = secs;
                    (Arc::clone(&h.conn), h.count, secs)
                }
                _ => return Err(lost()),
            }
        };
        let sent = Instant::now();
        let mut slot = conn.lock().await;
        let Some(held) = slot.as_mut() else {
            return Err(lost());
        };
        // A statement on the holding connection resets its idle timer; a
        // failure means the connection — and with it the lock — is gone.
        // No answer within the operation timeout counts as gone too: the
        // connection is then closed, which releases whatever it still held.
        let alive = match held.conn() {
            Ok(c) => {
                let set = sqlx::query("SET SESSION wait_timeout = ?")
                    .bind(ttl_secs)
                    .execute(c);
                matches!(tokio::time::timeout(self.op_timeout, set).await, Ok(Ok(_)))
            }
            Err(_) => false,
        };
        if !alive {
            slot.take();
            drop(slot);
            self.take_held(lease);
            tracing::warn!(key = %lease.key, token = %lease.token, "extend failed: the lock connection is gone");
            return Err(lost());
        }
        drop(slot);
        let renewed = lease.renewed(ttl, sent);
        if let Some(h) = self
            .held
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get_mut(&lease.key)
            .filter(|h| h.token == lease.token.get())
        {
            h.deadline = h.deadline.max(renewed.deadline);
        }
        let _ = sqlx::query(self.touch_fence.clone())
            .bind(micros(ttl))
            .bind(count)
            .bind(lease.key.as_bytes())
            .bind(lease.token.get())
            .execute(&self.pool)
            .await;
        Ok(renewed)
    }

    async fn release(&self, lease: &Lease) -> Result<ReleaseOutcome> {
        let row = match self.take_held(lease) {
            None => return Ok(ReleaseOutcome::NotHeld),
            Some(Ok(remaining)) => return Ok(ReleaseOutcome::StillHeld { remaining }),
            Some(Err(row)) => row,
        };
        let held = row.conn.lock().await.take();
        let clean = match held {
            Some(h) => self.finish(h, "ROLLBACK").await,
            None => false,
        };
        if clean {
            self.clear_fence(&lease.key, lease.token.get()).await;
            Ok(ReleaseOutcome::Released)
        } else {
            tracing::warn!(key = %lease.key, token = %lease.token, "release found the lock connection gone: the lock had been lost");
            Ok(ReleaseOutcome::NotHeld)
        }
    }

    async fn inspect(&self, key: &LockKey) -> Result<Option<LockInfo>> {
        let Some(row) = sqlx::query(self.read_fence.clone())
            .bind(key.as_bytes())
            .fetch_optional(&self.pool)
            .await
            .db()?
        else {
            return Ok(None);
        };
        let info = info_from_row(key, &row)?;
        let held_here = self
            .held
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(key)
            .is_some_and(|h| h.token == info.token.get());
        if held_here || self.probe_held(key).await? {
            Ok(Some(info))
        } else {
            Ok(None)
        }
    }

    async fn force_release(&self, key: &LockKey) -> Result<bool> {
        // Held through this instance: end it here (if its connection is
        // still alive; otherwise someone else may hold the key by now).
        let local = self
            .held
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(key);
        if let Some(row) = local {
            let ended = match row.conn.lock().await.take() {
                Some(h) => self.finish(h, "ROLLBACK").await,
                None => false,
            };
            self.clear_fence(key, row.token).await;
            if ended {
                tracing::warn!(key = %key, "lock force-released");
                return Ok(true);
            }
        }
        // The holder is another connection: it named itself in the lock row,
        // uncommitted, inside its locking transaction. Read that with READ
        // UNCOMMITTED: it is there exactly while the lock is held, and the
        // holder's rollback erases it — so a released holder's pooled
        // connection is never mistaken for the holder.
        let mut conn = HeldConn(Some(self.pool.acquire().await.db()?));
        let c = conn.conn()?;
        sqlx::raw_sql("SET TRANSACTION ISOLATION LEVEL READ UNCOMMITTED")
            .execute(&mut *c)
            .await
            .db()?;
        let holder: Option<u64> = sqlx::query(self.read_holder.clone())
            .bind(self.row_key(key))
            .fetch_optional(&mut *c)
            .await
            .db()?
            .map(|r| r.try_get::<Option<u64>, _>(0))
            .transpose()
            .db()?
            .flatten();
        drop(conn.into_pooled());
        let Some(conn_id) = holder else {
            return Ok(false);
        };
        // Killing the connection rolls its transaction back. KILL cannot be
        // prepared; the id is a number the server gave us.
        match sqlx::raw_sql(sqlx::AssertSqlSafe(format!("KILL CONNECTION {conn_id}")))
            .execute(&self.pool)
            .await
        {
            Ok(_) => {}
            Err(e) if error::number(&e) == Some(1094) => return Ok(false), // unknown thread id
            Err(e) => return Err(error::map(e)),
        }
        tracing::warn!(key = %key, conn_id, "lock force-released by killing the holder's connection");
        Ok(true)
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

impl RowLock {
    /// Whether another connection holds the row lock of `key` (NOWAIT probe in
    /// a throw-away transaction).
    async fn probe_held(&self, key: &LockKey) -> Result<bool> {
        let row = self.row_key(key);
        let mut probe = HeldConn(Some(self.pool.acquire().await.db()?));
        let conn = probe.conn()?;
        sqlx::raw_sql("START TRANSACTION")
            .execute(&mut *conn)
            .await
            .db()?;
        let res = sqlx::query(self.lock_nowait.clone())
            .bind(&row)
            .fetch_optional(&mut *conn)
            .await;
        let held = match res {
            Ok(_) => false,
            Err(e) if error::is_lock_conflict(&e) => true,
            Err(e) => return Err(error::map(e)),
        };
        if self.finish(probe, "ROLLBACK").await {
            Ok(held)
        } else {
            Err(Error::backend(
                error::BACKEND,
                true,
                "the inspect probe lost its connection",
            ))
        }
    }
}

/// A row lock held inside a transaction that the caller writes through.
///
/// Business writes made with [`connection`](Self::connection) commit
/// **atomically with the release** ([`commit`](Self::commit)); a
/// [`rollback`](Self::rollback) — or dropping this value — undoes them and
/// releases the lock too. Nothing in between is visible to others.
pub struct RowLockTransaction {
    conn: HeldConn,
    lease: Lease,
    clear_fence: SqlStr,
    pool: MySqlPool,
}

impl fmt::Debug for RowLockTransaction {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RowLockTransaction")
            .field("lease", &self.lease)
            .finish_non_exhaustive()
    }
}

impl RowLockTransaction {
    /// The lease (key, owner, fencing token, effective TTL).
    pub fn lease(&self) -> &Lease {
        &self.lease
    }

    /// The fencing token of this hold.
    pub fn token(&self) -> FencingToken {
        self.lease.token
    }

    /// The connection, inside the locking transaction: run business writes on it.
    ///
    /// Do not `begin()`, `COMMIT` or run DDL on it: that would end the locking
    /// transaction (MySQL commits implicitly) and release the lock. Use
    /// [`commit`](Self::commit) / [`rollback`](Self::rollback); `commit`
    /// detects an early end and then commits nothing.
    ///
    /// # Errors
    ///
    /// [`Error::Backend`] if the connection was lost.
    pub fn connection(&mut self) -> Result<&mut MySqlConnection> {
        self.conn.conn()
    }

    /// Commits the business writes and releases the lock, atomically.
    ///
    /// # Errors
    ///
    /// [`Error::LeaseLost`] if the transaction was already gone (connection
    /// killed or timed out): nothing was committed.
    pub async fn commit(self) -> Result<()> {
        self.end("COMMIT").await
    }

    /// Rolls the business writes back and releases the lock.
    ///
    /// # Errors
    ///
    /// [`Error::LeaseLost`] if the transaction was already gone.
    pub async fn rollback(self) -> Result<()> {
        self.end("ROLLBACK").await
    }

    async fn end(mut self, how: &'static str) -> Result<()> {
        let conn = self.conn.conn()?;
        // Still the transaction that took the lock? A deadlock victim, an
        // implicit commit or a stray BEGIN ended it — and the lock with it —
        // without a word; the savepoint set at lock time is then gone.
        if how == "COMMIT" {
            if let Err(e) = sqlx::raw_sql("RELEASE SAVEPOINT fenced_lock")
                .execute(&mut *conn)
                .await
            {
                let _ = sqlx::raw_sql("ROLLBACK").execute(&mut *conn).await;
                return Err(Error::lease_lost(
                    &self.lease.key,
                    self.lease.token,
                    format!(
                        "the locking transaction ended early (deadlock victim, implicit commit or \
                         lost connection: {e}); nothing after that point was committed"
                    ),
                ));
            }
        }
        if let Err(e) = sqlx::raw_sql(how).execute(&mut *conn).await {
            return Err(Error::lease_lost(
                &self.lease.key,
                self.lease.token,
                format!("the lock transaction was gone before {how}: {e}"),
            ));
        }
        let restored = sqlx::raw_sql(
            "SET SESSION autocommit = 1, wait_timeout = @@GLOBAL.wait_timeout, \
             innodb_lock_wait_timeout = @@GLOBAL.innodb_lock_wait_timeout",
        )
        .execute(&mut *conn)
        .await
        .is_ok();
        let conn = std::mem::replace(&mut self.conn, HeldConn(None));
        if restored {
            drop(conn.into_pooled());
        }
        let _ = sqlx::query(self.clear_fence.clone())
            .bind(self.lease.key.as_bytes())
            .bind(self.lease.token.get())
            .execute(&self.pool)
            .await;
        Ok(())
    }
}
