//! Taking a row lock: the row made to exist first (never a gap lock), a
//! lock connection, the locking statement — without waiting (`NOWAIT`, or
//! the single-statement grant that takes the token too), or queued in
//! InnoDB's lock queue up to a client-side deadline.

use std::{sync::atomic::Ordering, time::Duration};

use fenced_api::{Error, LockKey, Result};
use sqlx::Row;
use tokio::time::Instant;

use super::conn::{plain, HeldConn, KillQueryOnDrop, LockConn, LockConns, WAIT_CHUNK_SECS};
use super::{no_fixed_row, token, Grant, Locked, RowLock, RowMode};
use crate::error::{self, SqlResultExt};
use crate::strategy::micros;

impl RowLock {
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
    pub(super) async fn plain(&self) -> Result<crate::conn::Conn<'_>> {
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

    /// One side statement returning at most one row, on a plain connection.
    pub(super) async fn fetch_optional(
        &self,
        q: sqlx::query::Query<'_, sqlx::MySql, sqlx::mysql::MySqlArguments>,
    ) -> Result<Option<sqlx::mysql::MySqlRow>> {
        let mut c = self.plain().await?;
        let r = q.fetch_optional(c.conn()).await;
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
    /// session — waiting for the pool at most until `deadline` (when given;
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
    pub(super) async fn lock_row(
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
            // The statement finished: nothing left to kill.
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

    pub(super) async fn wait_for_row(
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
}

fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}
