//! Operations on a hold that exists: extend (the keep-alive on the holding
//! connection), release, inspect and force-release, and the probe that
//! tells whether some connection holds a key.

use std::{
    sync::{atomic::Ordering, Arc},
    time::Duration,
};

use fenced_api::{Error, Lease, LockInfo, LockKey, LockOptions, ReleaseOutcome, Result};
use sqlx::Row;
use tokio::time::Instant;

use super::{conn::HeldConn, effective_ttl, HeldRow, RowLock};
use crate::error::{self, SqlResultExt};
use crate::list::info_from_row;
use crate::strategy::micros;

impl RowLock {
    pub(super) async fn extend_hold(&self, lease: &Lease, ttl: Duration) -> Result<Lease> {
        let (ttl_secs, ttl) = effective_ttl(LockOptions::validate_ttl(ttl)?);
        let lost = || {
            Error::lease_lost(
                &lease.key,
                lease.token,
                "the lock transaction is gone (expired, killed or released)",
            )
        };
        let (conn, count) = {
            let held = self.held.lock().unwrap_or_else(|p| p.into_inner());
            match held.get(&lease.key) {
                Some(h) if h.owner == lease.owner && h.token == lease.token.get() => {
                    (Arc::clone(&h.conn), h.count)
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
        let in_txn = self.token_in_txn.load(Ordering::Relaxed);
        let alive = match held.lock_conn() {
            Ok(lc) => {
                let keepalive = async {
                    // Re-entered: never cut the expiry another entry relies on.
                    let secs = if count > 1 {
                        ttl_secs.max(lc.wait_secs)
                    } else {
                        ttl_secs
                    };
                    let changed = lc.wait_secs != secs;
                    lc.set_wait(secs).await?;
                    if in_txn {
                        // The description's expiry, on the holding connection:
                        // also the keep-alive statement.
                        sqlx::query(self.sql.touch.clone())
                            .bind(micros(Duration::from_secs(secs)))
                            .bind(count)
                            .bind(lease.key.as_bytes())
                            .bind(lease.token.get())
                            .execute(lc.conn()?)
                            .await
                            .db()?;
                    } else if !changed {
                        sqlx::raw_sql("DO 1").execute(lc.conn()?).await.db()?;
                    }
                    Ok::<_, Error>(())
                };
                error::bounded("keep-alive", self.op_timeout, keepalive)
                    .await
                    .is_ok()
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
        // Fallback mode: the description's expiry on a side connection —
        // only if one is at hand: waiting for the pool while holding could
        // stall behind other holders doing the same.
        if !in_txn {
            if let Some(mut c) = self.conns.try_get() {
                let r = sqlx::query(self.sql.touch.clone())
                    .bind(micros(ttl))
                    .bind(count)
                    .bind(lease.key.as_bytes())
                    .bind(lease.token.get())
                    .execute(c.conn())
                    .await;
                c.finish(&r);
            }
        }
        Ok(renewed)
    }

    pub(super) async fn release_hold(&self, lease: &Lease) -> Result<ReleaseOutcome> {
        let row = match self.take_held(lease) {
            None => return Ok(ReleaseOutcome::NotHeld),
            Some(Ok(remaining)) => return Ok(ReleaseOutcome::StillHeld { remaining }),
            Some(Err(row)) => row,
        };
        let held = row.conn.lock().await.take();
        let clean = match held {
            Some(h) => self.end_hold(h).await,
            None => false,
        };
        if clean {
            Ok(ReleaseOutcome::Released)
        } else {
            tracing::warn!(key = %lease.key, token = %lease.token, "release found the lock connection gone: the lock had been lost");
            Ok(ReleaseOutcome::NotHeld)
        }
    }

    /// The description of `key`'s latest grant.
    async fn read_live(&self, key: &LockKey) -> Result<Option<sqlx::mysql::MySqlRow>> {
        self.fetch_optional(sqlx::query(self.sql.read_live.clone()).bind(key.as_bytes()))
            .await
    }

    pub(super) async fn inspect_key(&self, key: &LockKey) -> Result<Option<LockInfo>> {
        let Some(row) = self.read_live(key).await? else {
            return Ok(None);
        };
        let info = info_from_row(key, &row)?;
        let held_here = self
            .held
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(key)
            .is_some_and(|h| h.token == info.token.get() && Instant::now() < h.deadline);
        // The description outlives the hold (a release does not clear it):
        // confirm that somebody holds the row.
        if held_here || self.probe_held(key).await? {
            Ok(Some(info))
        } else {
            Ok(None)
        }
    }

    pub(super) async fn force_release_key(&self, key: &LockKey) -> Result<bool> {
        // Held through this instance: end it here (if its connection is
        // still alive; otherwise someone else may hold the key by now).
        let local = self
            .held
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(key);
        if let Some(row) = local {
            let ended = match row.conn.lock().await.take() {
                Some(h) => self.end_hold(h).await,
                None => false,
            };
            if ended {
                tracing::warn!(key = %key, "lock force-released");
                return Ok(true);
            }
        }
        // Held by another connection: the description names the connection
        // of the latest grant of this key. Kill it only if the key is held
        // and that connection's latest grant (ids grow across all keys) is
        // still this one — a released holder's connection that went on to
        // lock another key is left alone; one that sits idle may be killed,
        // which costs its owner only a reconnect.
        let described = match self.read_live(key).await? {
            Some(row) => Some((
                row.try_get::<u64, _>(1).db()?,
                row.try_get::<Option<u64>, _>(5).db()?,
            )),
            None => None,
        };
        let Some((token, Some(conn_id))) = described else {
            return Ok(false);
        };
        if !self.probe_held(key).await? {
            return Ok(false);
        }
        let moved_on = self
            .fetch_optional(
                sqlx::query(self.sql.moved_on.clone())
                    .bind(conn_id)
                    .bind(token),
            )
            .await?
            .is_some();
        if moved_on {
            return Ok(false);
        }
        // Killing the connection rolls its transaction back. KILL cannot be
        // prepared; the id is a number the server gave us.
        match self.conns.raw(format!("KILL CONNECTION {conn_id}")).await {
            Ok(_) => {}
            Err(e) if error::number(&e) == Some(error::code::NO_SUCH_THREAD) => return Ok(false),
            Err(e) => return Err(error::map(e)),
        }
        tracing::warn!(key = %key, conn_id, "lock force-released by killing the holder's connection");
        Ok(true)
    }

    pub(super) fn take_held(&self, lease: &Lease) -> Option<std::result::Result<u32, HeldRow>> {
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
    pub(super) async fn end_hold(&self, mut held: HeldConn) -> bool {
        let Ok(conn) = held.conn() else { return false };
        if sqlx::raw_sql("ROLLBACK").execute(conn).await.is_err() {
            return false;
        }
        if let Some(lc) = held.take() {
            self.locks.put(lc, &self.conns);
        }
        true
    }

    /// Whether another connection holds the row lock of `key` (NOWAIT probe
    /// on a lock connection, rolled back).
    pub(super) async fn probe_held(&self, key: &LockKey) -> Result<bool> {
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
