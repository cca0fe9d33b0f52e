//! A small cache of hot connections in front of a sqlx pool, for the
//! one-statement operations of the MySQL and PostgreSQL backends.
//!
//! Why not the pool alone: a sqlx pool pings every connection given back to
//! it (a round trip — `COM_PING` on MySQL, a `Sync` on PostgreSQL — in a
//! spawned task), and pings before handing one out when so configured
//! (`test_before_acquire`). For a one-statement operation that doubles or
//! triples the round trips: measured on MariaDB, 2 pings per statement
//! (`Com_admin_commands`) and well under half the throughput of the same
//! statements on one dedicated connection. Connections kept here are reused
//! without a ping; a connection idle longer than [`FRESH`] goes back through
//! the pool, whose check before reuse (the backend's `before_acquire` or
//! `test_before_acquire`) notices a server restart or an idle disconnect
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

use sqlx::{pool::PoolConnection, query::Query, Database, Executor, Pool};

use crate::SqlBackend;

/// A cached connection unused for longer than this is handed back to the
/// pool (which checks it on the way) instead of being reused blindly.
pub const FRESH: Duration = Duration::from_secs(2);

struct Idle<DB: Database> {
    conn: PoolConnection<DB>,
    since: Instant,
}

struct Inner<DB: Database> {
    pool: Pool<DB>,
    idle: Mutex<Vec<Idle<DB>>>,
    /// Callers currently queued in `pool.acquire()` through [`Conns`].
    waiting: AtomicUsize,
}

/// Hot connections in autocommit mode with the session every connection of
/// the pool starts with. Cheap to clone (shared). `B` says which errors
/// leave a connection reusable ([`SqlBackend::ends_session`]).
pub struct Conns<B: SqlBackend> {
    inner: Arc<Inner<B::Db>>,
}

impl<B: SqlBackend> Clone for Conns<B> {
    fn clone(&self) -> Self {
        Conns {
            inner: Arc::clone(&self.inner),
        }
    }
}

impl<B: SqlBackend> std::fmt::Debug for Conns<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Conns").finish_non_exhaustive()
    }
}

/// Counts a caller queued (for the pool here, or for any slot) while
/// alive, also when its future is dropped mid-wait.
#[derive(Debug)]
pub struct Queued<'a>(&'a AtomicUsize);

impl<'a> Queued<'a> {
    /// Adds one to `n` until the guard is dropped.
    pub fn new(n: &'a AtomicUsize) -> Self {
        n.fetch_add(1, Ordering::SeqCst);
        Queued(n)
    }
}

impl Drop for Queued<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

impl<B: SqlBackend> Conns<B> {
    /// Hot connections in front of `pool`.
    pub fn new(pool: Pool<B::Db>) -> Self {
        Conns {
            inner: Arc::new(Inner {
                pool,
                idle: Mutex::default(),
                waiting: AtomicUsize::new(0),
            }),
        }
    }

    /// The pool behind the cache.
    pub fn pool(&self) -> &Pool<B::Db> {
        &self.inner.pool
    }

    /// Whether some caller is queued for a pool connection.
    pub fn has_waiters(&self) -> bool {
        self.inner.waiting.load(Ordering::SeqCst) > 0
    }

    fn pop_fresh(&self) -> Option<PoolConnection<B::Db>> {
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
    ///
    /// # Errors
    ///
    /// The pool's.
    pub async fn queue_for_pool(
        &self,
        deadline: Option<tokio::time::Instant>,
    ) -> Result<Option<PoolConnection<B::Db>>, sqlx::Error> {
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
    ///
    /// # Errors
    ///
    /// The pool's.
    pub async fn get(&self) -> Result<Conn<'_, B>, sqlx::Error> {
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
    pub fn try_get(&self) -> Option<Conn<'_, B>> {
        let conn = self
            .take_cached()
            .or_else(|| self.inner.pool.try_acquire())?;
        Some(Conn {
            owner: self,
            conn: Some(conn),
        })
    }

    /// A cached, fresh connection (none while callers are queued); never waits.
    pub fn take_cached(&self) -> Option<PoolConnection<B::Db>> {
        if self.has_waiters() {
            return None;
        }
        self.pop_fresh()
    }

    /// Whether a connection is cached (fresh or not).
    pub fn has_cached(&self) -> bool {
        !self
            .inner
            .idle
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .is_empty()
    }

    /// Gives a connection in the default session state back: cached for
    /// reuse, or to the pool when somebody is queued for one.
    pub fn put(&self, conn: PoolConnection<B::Db>) {
        if self.has_waiters() || self.inner.pool.is_closed() {
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
        // The pool closing meanwhile waits for every connection, this one
        // too: give them all back.
        if self.inner.pool.is_closed() {
            self.drain();
            return;
        }
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
}

/// Closing.
impl<B: SqlBackend> Conns<B> {
    /// Gives every cached connection back to the pool.
    fn drain(&self) {
        let idle = std::mem::take(&mut *self.inner.idle.lock().unwrap_or_else(|p| p.into_inner()));
        drop(idle);
    }

    /// Closes the pool ([`Pool::close`]): the cached connections are given
    /// back first — the pool waits for every connection it handed out — and
    /// any given back later goes straight to the closed pool. Returns once
    /// every connection is closed.
    pub async fn close(&self) {
        let closing = self.inner.pool.close();
        self.drain();
        closing.await;
    }
}

/// One statement on a connection of [`Conns::get`].
impl<B: SqlBackend> Conns<B>
where
    for<'c> &'c mut <B::Db as Database>::Connection: Executor<'c, Database = B::Db>,
    <B::Db as Database>::Arguments: sqlx::IntoArguments<B::Db>,
{
    /// Runs `q` on a connection of [`get`](Self::get), given back if the
    /// exchange left it usable.
    ///
    /// # Errors
    ///
    /// The pool's or the statement's.
    pub async fn execute<'q>(
        &self,
        q: Query<'q, B::Db, <B::Db as Database>::Arguments>,
    ) -> Result<<B::Db as Database>::QueryResult, sqlx::Error> {
        let mut c = self.get().await?;
        let r = q.execute(c.conn()).await;
        c.finish(&r);
        r
    }

    /// As [`execute`](Self::execute), the row if any.
    ///
    /// # Errors
    ///
    /// The pool's or the statement's.
    pub async fn fetch_optional<'q>(
        &self,
        q: Query<'q, B::Db, <B::Db as Database>::Arguments>,
    ) -> Result<Option<<B::Db as Database>::Row>, sqlx::Error> {
        let mut c = self.get().await?;
        let r = q.fetch_optional(c.conn()).await;
        c.finish(&r);
        r
    }

    /// As [`execute`](Self::execute), every row.
    ///
    /// # Errors
    ///
    /// The pool's or the statement's.
    pub async fn fetch_all<'q>(
        &self,
        q: Query<'q, B::Db, <B::Db as Database>::Arguments>,
    ) -> Result<Vec<<B::Db as Database>::Row>, sqlx::Error> {
        let mut c = self.get().await?;
        let r = q.fetch_all(c.conn()).await;
        c.finish(&r);
        r
    }

    /// As [`execute`](Self::execute), exactly one row.
    ///
    /// # Errors
    ///
    /// The pool's or the statement's (`RowNotFound` for none).
    pub async fn fetch_one<'q>(
        &self,
        q: Query<'q, B::Db, <B::Db as Database>::Arguments>,
    ) -> Result<<B::Db as Database>::Row, sqlx::Error> {
        let mut c = self.get().await?;
        let r = q.fetch_one(c.conn()).await;
        c.finish(&r);
        r
    }

    /// A statement that cannot be prepared (MySQL's `KILL`), sent as text.
    ///
    /// # Errors
    ///
    /// The pool's or the statement's.
    pub async fn raw(&self, sql: String) -> Result<(), sqlx::Error> {
        let mut c = self.get().await?;
        let r = sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
            .execute(c.conn())
            .await
            .map(|_| ());
        c.finish(&r);
        r
    }
}

impl<DB: Database> Drop for Inner<DB> {
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
pub struct Conn<'a, B: SqlBackend> {
    owner: &'a Conns<B>,
    conn: Option<PoolConnection<B::Db>>,
}

impl<B: SqlBackend> std::fmt::Debug for Conn<'_, B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Conn").finish_non_exhaustive()
    }
}

impl<B: SqlBackend> Conn<'_, B> {
    /// The connection, for statements of the caller's own.
    pub fn conn(&mut self) -> &mut <B::Db as Database>::Connection {
        // Present until `finish`/`settle` (which consume the Conn) take it.
        match self.conn.as_mut() {
            Some(c) => c,
            None => unreachable!("a Conn is used after it was finished"),
        }
    }

    /// Caches the connection for reuse if `r` shows it is still in sync with
    /// the server (success, or an error the server reported on a live
    /// session); closes it otherwise.
    pub fn finish<T>(self, r: &Result<T, sqlx::Error>) {
        self.settle(r.as_ref().err());
    }

    /// As [`finish`](Self::finish), from the error alone (`None`: success).
    pub fn settle(mut self, err: Option<&sqlx::Error>) {
        if err.is_none_or(crate::leaves_session_usable::<B>) {
            if let Some(c) = self.conn.take() {
                self.owner.put(c);
            }
        }
    }
}

impl<B: SqlBackend> Drop for Conn<'_, B> {
    fn drop(&mut self) {
        if let Some(c) = self.conn.as_mut() {
            c.close_on_drop();
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::dialect::Plain;

    type Lite = Plain<sqlx::Sqlite>;

    async fn conns() -> Conns<Lite> {
        let pool = sqlx::sqlite::SqlitePoolOptions::new()
            .max_connections(2)
            .connect("sqlite::memory:")
            .await
            .unwrap();
        Conns::new(pool)
    }

    #[tokio::test]
    async fn a_connection_given_back_is_reused_from_the_cache() {
        let conns = conns().await;
        conns.execute(sqlx::query("SELECT 1")).await.unwrap();
        assert!(conns.has_cached());
        assert!(conns.take_cached().is_some(), "fresh, nobody queued");
    }

    #[tokio::test]
    async fn close_returns_with_connections_cached_and_given_back_later() {
        let conns = conns().await;
        let mut held = conns.get().await.unwrap();
        sqlx::query("SELECT 1").execute(held.conn()).await.unwrap();
        conns.execute(sqlx::query("SELECT 1")).await.unwrap();
        assert!(conns.has_cached());
        let closing = {
            let conns = conns.clone();
            tokio::spawn(async move { conns.close().await })
        };
        tokio::time::sleep(Duration::from_millis(50)).await;
        // Given back after the close began: to the closed pool, not cached.
        held.finish(&Ok::<(), sqlx::Error>(()));
        tokio::time::timeout(Duration::from_secs(10), closing)
            .await
            .expect("close waited for a cached connection")
            .unwrap();
        assert!(!conns.has_cached());
        assert!(conns.pool().is_closed());
    }
}
