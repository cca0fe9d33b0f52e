//! Lock connections: the connections a `row_lock` hold lives on, kept
//! between holds with a known session, so an acquire sends no session setup.
//!
//! A lock connection has `autocommit = 0` (its first locking read opens the
//! transaction: no `START TRANSACTION`), `innodb_lock_wait_timeout` at
//! [`WAIT_CHUNK_SECS`] and `wait_timeout` at the TTL of its last hold, and
//! its server id is known (for `KILL QUERY` of an abandoned wait). These are
//! set once when a connection becomes a lock connection and `wait_timeout`
//! again only when a hold asks for a different TTL — not set and restored
//! around every hold. A lock connection never goes back to the pool with
//! that session: it is kept here, or closed.
//!
//! A kept connection is never in a transaction. With `autocommit = 0` a
//! *refused* locking read (`NOWAIT`, a zero or expired lock-wait timeout)
//! leaves its transaction open — the statement is rolled back, not the
//! transaction — and with it the statement's metadata locks on the lock
//! tables, which any DDL on them (`DROP TABLE`, `ALTER`, `migrate`) would
//! wait for until the connection is reused or closed for idleness. Such a
//! connection is kept with a `ROLLBACK` sent in the background
//! ([`LockConns::put_rolling_back`]): the refused caller does not wait for
//! it, and the connection is only handed out again once it has answered.

use std::{
    sync::Mutex,
    time::{Duration, Instant},
};

use fenced_api::{Error, Result};
use sqlx::{pool::PoolConnection, MySql, MySqlConnection, Row};
use tokio::task::JoinHandle;

use crate::{
    conn::Conns,
    error::{self, SqlResultExt},
};

/// `innodb_lock_wait_timeout` of every lock connection. Shorter waits are
/// bounded on the client (the abandoned statement is killed); longer ones
/// re-arm in chunks of this length.
pub(super) const WAIT_CHUNK_SECS: u64 = 50;

/// A connection in the lock-connection session (see the module docs).
/// Dropped, it is closed: it never reaches the pool with that session or
/// mid-transaction.
pub(super) struct LockConn {
    conn: Option<PoolConnection<MySql>>,
    /// A `ROLLBACK` in flight in the background: the connection comes back
    /// from it (`None`: it failed, and the connection was closed).
    rolling_back: Option<JoinHandle<Option<Closing>>>,
    /// `CONNECTION_ID()` on the server.
    pub(super) id: u64,
    /// The session's `wait_timeout`.
    pub(super) wait_secs: u64,
    /// Whether the connection was kept from an earlier use: a failure on it
    /// may just mean the server closed it meanwhile.
    pub(super) reused: bool,
    since: Instant,
}

impl LockConn {
    pub(super) fn conn(&mut self) -> Result<&mut MySqlConnection> {
        match self.conn.as_mut() {
            Some(c) => Ok(&mut **c),
            None => Err(Error::backend(
                error::BACKEND,
                true,
                "the lock connection is gone",
            )),
        }
    }

    /// Takes the connection back from a background `ROLLBACK`, if one is in
    /// flight: false if it failed (the connection is then closed). Only after
    /// this is the connection used again — nothing ever races the `ROLLBACK`.
    async fn settle(&mut self) -> bool {
        if let Some(h) = self.rolling_back.take() {
            match h.await {
                Ok(Some(mut c)) => self.conn = c.0.take(),
                _ => return false,
            }
        }
        self.conn.is_some()
    }

    /// Ends the transaction a refused statement left open with a `ROLLBACK`
    /// sent in the background, bounded by `bound` (past it, or on an error,
    /// the connection is closed). [`settle`](Self::settle) takes it back.
    fn roll_back_in_background(&mut self, bound: Duration) {
        let Some(conn) = self.conn.take() else { return };
        let mut c = Closing(Some(conn));
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return; // `c` is dropped: closed.
        };
        self.rolling_back = Some(rt.spawn(async move {
            let conn = c.0.as_mut()?;
            let rolled_back =
                tokio::time::timeout(bound, sqlx::raw_sql("ROLLBACK").execute(&mut **conn)).await;
            // On failure `c` is dropped here: closed.
            matches!(rolled_back, Ok(Ok(_))).then_some(c)
        }));
    }

    /// Sets `wait_timeout` (the server-side TTL of a frozen holder) if it differs.
    pub(super) async fn set_wait(&mut self, secs: u64) -> Result<()> {
        if self.wait_secs != secs {
            sqlx::query("SET SESSION wait_timeout = ?")
                .bind(secs)
                .execute(self.conn()?)
                .await
                .db()?;
            self.wait_secs = secs;
        }
        Ok(())
    }
}

impl Drop for LockConn {
    fn drop(&mut self) {
        if let Some(c) = self.conn.take() {
            close(c);
        }
        // Cancelled, the background `ROLLBACK` drops its connection: closed.
        if let Some(h) = self.rolling_back.take() {
            h.abort();
        }
    }
}

/// A connection that is closed, not returned to the pool, when dropped.
struct Closing(Option<PoolConnection<MySql>>);

impl Drop for Closing {
    fn drop(&mut self) {
        if let Some(c) = self.0.take() {
            close(c);
        }
    }
}

/// Closes a connection instead of returning it to the pool (it may be in a
/// transaction or a session the pool must not hand out).
pub(super) fn close(mut conn: PoolConnection<MySql>) {
    if tokio::runtime::Handle::try_current().is_ok() {
        conn.close_on_drop();
        drop(conn);
    } else {
        // Closing spawns a task; without a runtime, just drop the socket.
        drop(conn.leak());
    }
}

/// Idle lock connections, most recently used last.
pub(super) struct LockConns {
    idle: Mutex<Vec<LockConn>>,
}

impl LockConns {
    pub(super) fn new() -> Self {
        LockConns {
            idle: Mutex::default(),
        }
    }

    /// An idle lock connection the server has not closed for idleness, out
    /// of its background `ROLLBACK` if it had one.
    pub(super) async fn pop(&self) -> Option<LockConn> {
        loop {
            let mut c = self.pop_fresh()?;
            if c.settle().await {
                return Some(c);
            }
            // The ROLLBACK failed: that one is closed; next.
        }
    }

    fn pop_fresh(&self) -> Option<LockConn> {
        let mut idle = self.idle.lock().unwrap_or_else(|p| p.into_inner());
        while let Some(c) = idle.pop() {
            // Half a second of margin against the server's idle timer.
            let limit = Duration::from_secs(c.wait_secs).saturating_sub(Duration::from_millis(500));
            if c.since.elapsed() < limit {
                return Some(c);
            }
        }
        None
    }

    /// Keeps a lock connection for the next hold — unless callers are
    /// queued for the pool: then it is closed, which frees its slot for them
    /// (it cannot be handed to the pool with its session).
    pub(super) fn put(&self, mut c: LockConn, conns: &Conns) {
        if conns.has_waiters() {
            return;
        }
        c.since = Instant::now();
        c.reused = true;
        self.idle.lock().unwrap_or_else(|p| p.into_inner()).push(c);
        // Somebody got in line meanwhile: it may have missed this one.
        if conns.has_waiters() {
            self.evict_one();
        }
    }

    /// Keeps a lock connection whose last statement was refused (see the
    /// module docs): its transaction is still open, so a `ROLLBACK` is sent
    /// in the background — one more statement on the server, none on the
    /// caller's path. Closed instead (no `ROLLBACK` needed) when callers
    /// are queued for the pool, like [`put`](Self::put).
    pub(super) fn put_rolling_back(&self, mut c: LockConn, conns: &Conns, bound: Duration) {
        if conns.has_waiters() {
            return;
        }
        c.roll_back_in_background(bound);
        self.put(c, conns);
    }

    /// Closes the least recently used idle lock connection (frees a pool slot).
    pub(super) fn evict_one(&self) -> bool {
        let mut idle = self.idle.lock().unwrap_or_else(|p| p.into_inner());
        if idle.is_empty() {
            return false;
        }
        drop(idle.remove(0));
        true
    }

    /// Turns a plain connection into a lock connection.
    pub(super) async fn adopt(mut conn: PoolConnection<MySql>, wait_secs: u64) -> Result<LockConn> {
        let set = sqlx::query(
            "SET SESSION autocommit = 0, wait_timeout = ?, innodb_lock_wait_timeout = ?",
        )
        .bind(wait_secs)
        .bind(WAIT_CHUNK_SECS)
        .execute(&mut *conn)
        .await;
        let id = match set {
            Ok(_) => sqlx::query("SELECT CONNECTION_ID()")
                .fetch_one(&mut *conn)
                .await
                .and_then(|r| r.try_get::<u64, _>(0)),
            Err(e) => Err(e),
        };
        match id {
            Ok(id) => Ok(LockConn {
                conn: Some(conn),
                rolling_back: None,
                id,
                wait_secs,
                reused: false,
                since: Instant::now(),
            }),
            Err(e) => {
                close(conn);
                Err(error::map(e))
            }
        }
    }
}

impl Drop for LockConns {
    fn drop(&mut self) {
        // Each LockConn closes itself.
        drop(std::mem::take(
            &mut *self.idle.lock().unwrap_or_else(|p| p.into_inner()),
        ));
    }
}

/// A lock connection holding (or trying to take) a row lock. Dropped without
/// [`HeldConn::take`], it is **closed** (see [`LockConn`]), so the server
/// rolls the transaction back.
pub(super) struct HeldConn(pub(super) Option<LockConn>);

impl HeldConn {
    pub(super) fn lock_conn(&mut self) -> Result<&mut LockConn> {
        self.0
            .as_mut()
            .ok_or_else(|| Error::backend(error::BACKEND, true, "the lock connection is gone"))
    }

    pub(super) fn conn(&mut self) -> Result<&mut MySqlConnection> {
        self.lock_conn()?.conn()
    }

    /// The connection after a clean end of the transaction.
    pub(super) fn take(mut self) -> Option<LockConn> {
        self.0.take()
    }
}

/// Kills the statement of an abandoned lock wait: closing the socket does
/// not stop a server-side lock wait, `KILL QUERY` does.
pub(super) struct KillQueryOnDrop {
    pub(super) conns: Conns,
    pub(super) conn_id: u64,
    pub(super) armed: bool,
}

impl Drop for KillQueryOnDrop {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let (conns, id) = (self.conns.clone(), self.conn_id);
        fenced_api::cleanup::spawn(async move {
            // The id is a number the server gave us; KILL cannot be prepared.
            let _ = conns.raw(format!("KILL QUERY {id}")).await;
        });
    }
}

/// A plain (autocommit) connection for `row_lock`'s side statements. Lock
/// connections idle in `locks` are closed when the pool has no other slot,
/// so an idle lock connection never starves a side statement.
pub(super) async fn plain<'a>(
    conns: &'a Conns,
    locks: &LockConns,
    max: u32,
) -> Result<crate::conn::Conn<'a>> {
    let pool = conns.pool();
    if !conns.has_cached() && pool.num_idle() == 0 && pool.size() >= max {
        locks.evict_one();
    }
    conns.get().await.db()
}
