//! A small cache of hot connections in front of the sqlx pool.
//!
//! Why not the pool alone: every checkout of a sqlx pool connection costs a
//! `COM_PING` round trip before it is handed out (`test_before_acquire`) and
//! another when it is given back (sqlx always pings a returned connection,
//! in a spawned task). Neither shows in the server's `Questions`, but for a
//! one-statement operation they triple the round trips: measured here, 2
//! pings per statement (`Com_admin_commands`) and well under half the
//! throughput of the same statements on one dedicated connection.
//! Connections kept here are reused without either ping; a connection idle
//! longer than [`FRESH`] goes back through the pool, which pings it before
//! the next use, so a server restart or an idle disconnect is still noticed
//! before a statement is sent on a long-idle connection.
//!
//! Fairness: while any caller waits for the pool (all connections busy), a
//! connection that is given back goes to the pool — to the longest waiter —
//! instead of into the cache, and a newcomer does not take a cached one
//! ahead of the waiters. The cache only short-cuts the pool when nobody is
//! queued, so it never starves a caller.

use std::{
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc, Mutex,
    },
    time::{Duration, Instant},
};

use sqlx::{
    mysql::{MySqlArguments, MySqlQueryResult, MySqlRow},
    pool::PoolConnection,
    query::Query,
    MySql, MySqlConnection, MySqlPool,
};

use crate::error;

/// A cached connection unused for longer than this is handed back to the
/// pool (which pings it on the way) instead of being reused blindly.
pub(crate) const FRESH: Duration = Duration::from_secs(2);

struct Idle {
    conn: PoolConnection<MySql>,
    since: Instant,
}

struct Inner {
    pool: MySqlPool,
    idle: Mutex<Vec<Idle>>,
    /// Callers currently queued in `pool.acquire()` through [`Conns`].
    waiting: AtomicUsize,
}

/// Hot connections in autocommit mode with the server's default session.
/// Cheap to clone (shared).
#[derive(Clone)]
pub(crate) struct Conns {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Conns {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Conns").finish_non_exhaustive()
    }
}

/// Counts a caller queued for the pool while alive (also when its future is dropped).
struct Queued<'a>(&'a AtomicUsize);

impl<'a> Queued<'a> {
    fn new(n: &'a AtomicUsize) -> Self {
        n.fetch_add(1, Ordering::SeqCst);
        Queued(n)
    }
}

impl Drop for Queued<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Conns {
    pub(crate) fn new(pool: MySqlPool) -> Self {
        Conns {
            inner: Arc::new(Inner {
                pool,
                idle: Mutex::default(),
                waiting: AtomicUsize::new(0),
            }),
        }
    }

    pub(crate) fn pool(&self) -> &MySqlPool {
        &self.inner.pool
    }

    /// Whether some caller is queued for a pool connection.
    pub(crate) fn has_waiters(&self) -> bool {
        self.inner.waiting.load(Ordering::SeqCst) > 0
    }

    fn pop_fresh(&self) -> Option<PoolConnection<MySql>> {
        let mut idle = self.inner.idle.lock().unwrap_or_else(|p| p.into_inner());
        // Most recently used last. If even that one has been idle too long,
        // all are: they go back to the pool, which pings before reuse.
        let top = idle.pop()?;
        if top.since.elapsed() < FRESH {
            return Some(top.conn);
        }
        let stale = std::mem::take(&mut *idle);
        drop(idle);
        drop(top);
        drop(stale);
        None
    }

    /// A pool connection, queued fairly behind earlier callers; `None` if
    /// `deadline` (when given) passes first.
    pub(crate) async fn queue_for_pool(
        &self,
        deadline: Option<tokio::time::Instant>,
    ) -> Result<Option<PoolConnection<MySql>>, sqlx::Error> {
        let _queued = Queued::new(&self.inner.waiting);
        // A connection cached while we were getting in line is ours to take
        // (nobody else would: newcomers see the queue and skip the cache).
        if let Some(c) = self.pop_fresh() {
            return Ok(Some(c));
        }
        match deadline {
            None => self.inner.pool.acquire().await.map(Some),
            Some(d) => match tokio::time::timeout_at(d, self.inner.pool.acquire()).await {
                Ok(c) => c.map(Some),
                Err(_) => Ok(None),
            },
        }
    }

    /// A connection: a fresh cached one when nobody is queued, else one
    /// from the pool.
    pub(crate) async fn get(&self) -> Result<Conn<'_>, sqlx::Error> {
        if let Some(c) = self.take_cached() {
            return Ok(Conn {
                owner: self,
                conn: Some(c),
            });
        }
        match self.queue_for_pool(None).await? {
            Some(c) => Ok(Conn {
                owner: self,
                conn: Some(c),
            }),
            None => Err(sqlx::Error::PoolTimedOut),
        }
    }

    /// A connection only if one is at hand (cached, or idle in the pool);
    /// never waits.
    pub(crate) fn try_get(&self) -> Option<Conn<'_>> {
        let conn = self
            .take_cached()
            .or_else(|| self.inner.pool.try_acquire())?;
        Some(Conn {
            owner: self,
            conn: Some(conn),
        })
    }

    /// A cached, fresh connection (none while callers are queued); never waits.
    pub(crate) fn take_cached(&self) -> Option<PoolConnection<MySql>> {
        if self.has_waiters() {
            return None;
        }
        self.pop_fresh()
    }

    /// Whether a connection is cached (fresh or not).
    pub(crate) fn has_cached(&self) -> bool {
        !self
            .inner
            .idle
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .is_empty()
    }

    /// Gives a connection in the default session state back: cached for
    /// reuse, or to the pool when somebody is queued for one.
    pub(crate) fn put(&self, conn: PoolConnection<MySql>) {
        if self.has_waiters() {
            drop(conn);
            return;
        }
        self.inner
            .idle
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(Idle {
                conn,
                since: Instant::now(),
            });
        // Somebody got in line meanwhile: it may have missed this one.
        if self.has_waiters() {
            let c = self
                .inner
                .idle
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .pop();
            drop(c);
        }
    }

    pub(crate) async fn execute(
        &self,
        q: Query<'_, MySql, MySqlArguments>,
    ) -> Result<MySqlQueryResult, sqlx::Error> {
        let mut c = self.get().await?;
        let r = q.execute(c.conn()).await;
        c.finish(&r);
        r
    }

    pub(crate) async fn fetch_optional(
        &self,
        q: Query<'_, MySql, MySqlArguments>,
    ) -> Result<Option<MySqlRow>, sqlx::Error> {
        let mut c = self.get().await?;
        let r = q.fetch_optional(c.conn()).await;
        c.finish(&r);
        r
    }

    pub(crate) async fn fetch_all(
        &self,
        q: Query<'_, MySql, MySqlArguments>,
    ) -> Result<Vec<MySqlRow>, sqlx::Error> {
        let mut c = self.get().await?;
        let r = q.fetch_all(c.conn()).await;
        c.finish(&r);
        r
    }

    /// A statement that cannot be prepared (`KILL`), on a cached or pooled connection.
    pub(crate) async fn raw(&self, sql: String) -> Result<(), sqlx::Error> {
        let mut c = self.get().await?;
        let r = sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
            .execute(c.conn())
            .await
            .map(|_| ());
        c.finish(&r);
        r
    }

    pub(crate) async fn fetch_one(
        &self,
        q: Query<'_, MySql, MySqlArguments>,
    ) -> Result<MySqlRow, sqlx::Error> {
        let mut c = self.get().await?;
        let r = q.fetch_one(c.conn()).await;
        c.finish(&r);
        r
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        let idle = std::mem::take(&mut *self.idle.lock().unwrap_or_else(|p| p.into_inner()));
        // Returning a connection to the pool spawns a task; without a runtime
        // (a lock dropped after its runtime) the sockets are simply closed.
        if tokio::runtime::Handle::try_current().is_err() {
            for i in idle {
                drop(i.conn.leak());
            }
        }
    }
}

/// A connection taken from [`Conns`]. [`finish`](Conn::finish) gives it back
/// when the statement left it usable; dropped otherwise (an interrupted or
/// failed exchange), it is closed, never reused mid-protocol.
pub(crate) struct Conn<'a> {
    owner: &'a Conns,
    conn: Option<PoolConnection<MySql>>,
}

impl Conn<'_> {
    pub(crate) fn conn(&mut self) -> &mut MySqlConnection {
        // Present until `finish`/`settle` (which consume the Conn) take it.
        match self.conn.as_mut() {
            Some(c) => c,
            None => unreachable!("a Conn is used after it was finished"),
        }
    }

    /// Caches the connection for reuse if `r` shows it is still in sync with
    /// the server (success, or an error the server reported on a live
    /// session); closes it otherwise.
    pub(crate) fn finish<T>(self, r: &Result<T, sqlx::Error>) {
        self.settle(r.as_ref().err());
    }

    /// As [`finish`](Self::finish), from the error alone (`None`: success).
    pub(crate) fn settle(mut self, err: Option<&sqlx::Error>) {
        if err.is_none_or(error::leaves_session_usable) {
            if let Some(c) = self.conn.take() {
                self.owner.put(c);
            }
        }
    }
}

impl Drop for Conn<'_> {
    fn drop(&mut self) {
        if let Some(c) = self.conn.as_mut() {
            c.close_on_drop();
        }
    }
}
