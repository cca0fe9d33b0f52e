//! The transaction-scoped API: business writes commit atomically with the release.

use std::fmt;

use fenced_api::{wait::wait_deadline, Error, FencingToken, Lease, LockKey, LockOptions, Result};
use sqlx::MySqlConnection;
use tokio::time::Instant;

use super::{conn::HeldConn, effective_ttl, token::Granted, Grant, RowLock};
use crate::error::{self, SqlResultExt};

impl RowLock {
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
        let grant = Grant::new(&owner, ttl, opts);
        let lease = loop {
            let locked = self
                .wait_for_row(key, grant, ttl_secs, deadline, start)
                .await?;
            if let Granted::Lease(l) = self.register(key, grant, locked).await? {
                break l;
            }
        };
        let row = self
            .held
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(key)
            .ok_or_else(|| Error::backend(error::BACKEND, false, "lost track of a fresh hold"))?;
        let mut conn = row.conn.lock().await.take().unwrap_or(HeldConn(None));
        // Guards against a silent end of the transaction (deadlock victim,
        // an implicit commit by DDL or a stray BEGIN): the lock connection
        // runs with autocommit off, so nothing after such an end commits on
        // its own, and a savepoint, which any end of the transaction
        // destroys, is what `commit` checks.
        sqlx::raw_sql("SAVEPOINT fenced_lock")
            .execute(conn.conn()?)
            .await
            .db()?;
        Ok(RowLockTransaction { conn, lease })
    }
}

/// A row lock held inside a transaction that the caller writes through.
///
/// Business writes made with [`connection`](Self::connection) commit
/// **atomically with the release** ([`commit`](Self::commit)); a
/// [`rollback`](Self::rollback) — or dropping this value — undoes them and
/// releases the lock too. Nothing in between is visible to others.
///
/// The connection is yours for the transaction: change its session if you
/// need to (`sql_mode`, isolation level, user variables, temporary tables).
/// None of it leaks: when the transaction ends, the connection is closed,
/// not returned to the lock's pool.
pub struct RowLockTransaction {
    pub(super) conn: HeldConn,
    pub(super) lease: Lease,
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
        // The caller had the connection in hand: anything it changed in the
        // session (sql_mode, isolation level, time zone, user variables,
        // temporary tables, prepared statements) would follow the connection to its next
        // user. Resetting a list of variables cannot know what was changed,
        // and `COM_RESET_CONNECTION` is not reachable through sqlx — so the
        // connection is closed (dropping the lock connection closes it) and
        // the pool opens a fresh one when needed: one connect per
        // transaction-scoped lock, against a session leak.
        drop(std::mem::replace(&mut self.conn, HeldConn(None)));
        Ok(())
    }
}
