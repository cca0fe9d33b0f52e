//! `unique_key`: INSERT a row per held key (the seeds' "posture one").
//!
//! * acquire = one autocommit `INSERT`; a duplicate key means "held". If the
//!   existing row is expired (crashed holder), it is deleted — only if still
//!   expired, in the same statement — and the INSERT retried once, so a
//!   takeover needs no reaper.
//! * the row's `AUTO_INCREMENT` id is the fencing token: it only grows, and
//!   since MariaDB 10.2.4 / MySQL 8.0 it survives restarts.
//! * release / extend match `id` **and** `owner` (and, for extend, that the
//!   row has not expired on the server's clock).

use std::time::Duration;

use async_trait::async_trait;
use fenced_api::{
    wait::{acquire_polling, notify_released, Backoff},
    Capabilities, DistributedLock, Error, FencingToken, Lease, LockInfo, LockKey, LockOptions,
    Owner, ReleaseOutcome, Result,
};
use sqlx::{MySqlPool, Row, SqlStr};
use tokio::time::Instant;

use super::{info_from_row, micros, retry_lock_conflicts};
use crate::error::{self, SqlResultExt};
use crate::sql;

/// SQL for one base table, built once.
#[derive(Debug)]
pub(crate) struct UniqueKey {
    pool: MySqlPool,
    scope: String,
    insert: SqlStr,
    delete_expired: SqlStr,
    reenter: SqlStr,
    held_by: SqlStr,
    extend: SqlStr,
    release_last: SqlStr,
    release_one: SqlStr,
    delete_own: SqlStr,
    lock_own: SqlStr,
    inspect: SqlStr,
    force_current: SqlStr,
    force_any: SqlStr,
    reap: SqlStr,
    purge: SqlStr,
    count: SqlStr,
}

impl UniqueKey {
    pub(crate) fn new(pool: MySqlPool, table: String, scope: String) -> Self {
        let t = &table;
        UniqueKey {
            pool,
            scope,
            insert: sql!(
                "INSERT INTO {t} (lock_key, owner, reentrant_count, expire_time, create_time) \
                 VALUES (?, ?, 1, UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND, UTC_TIMESTAMP(6))"
            ),
            delete_expired: sql!(
                "DELETE FROM {t} WHERE lock_key = ? AND expire_time <= UTC_TIMESTAMP(6)"
            ),
            // `id = LAST_INSERT_ID(id)` hands the token back in the OK packet:
            // re-entering costs one round trip.
            reenter: sql!(
                "UPDATE {t} SET reentrant_count = reentrant_count + 1, id = LAST_INSERT_ID(id), \
                 expire_time = GREATEST(expire_time, UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND) \
                 WHERE lock_key = ? AND owner = ? AND expire_time > UTC_TIMESTAMP(6)"
            ),
            held_by: sql!(
                "SELECT 1 FROM {t} WHERE lock_key = ? AND owner = ? AND expire_time > UTC_TIMESTAMP(6)"
            ),
            // Re-entered holds never have their expiry cut by one entry's extend.
            extend: sql!(
                "UPDATE {t} SET expire_time = IF(reentrant_count > 1, \
                 GREATEST(expire_time, UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND), \
                 UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND) \
                 WHERE id = ? AND owner = ? AND expire_time > UTC_TIMESTAMP(6)"
            ),
            release_last: sql!(
                "DELETE FROM {t} WHERE id = ? AND owner = ? AND reentrant_count <= 1 \
                 AND expire_time > UTC_TIMESTAMP(6)"
            ),
            release_one: sql!(
                "UPDATE {t} SET reentrant_count = LAST_INSERT_ID(reentrant_count - 1) \
                 WHERE id = ? AND owner = ? AND reentrant_count > 1 AND expire_time > UTC_TIMESTAMP(6)"
            ),
            delete_own: sql!("DELETE FROM {t} WHERE id = ? AND owner = ?"),
            lock_own: sql!(
                "SELECT reentrant_count, CAST(expire_time > UTC_TIMESTAMP(6) AS SIGNED) \
                 FROM {t} WHERE id = ? AND owner = ? FOR UPDATE"
            ),
            inspect: sql!(
                "SELECT owner, id, reentrant_count, \
                 TIMESTAMPDIFF(MICROSECOND, UTC_TIMESTAMP(6), expire_time) \
                 FROM {t} WHERE lock_key = ? AND expire_time > UTC_TIMESTAMP(6)"
            ),
            force_current: sql!(
                "DELETE FROM {t} WHERE lock_key = ? AND expire_time > UTC_TIMESTAMP(6)"
            ),
            // Only rows already expired: a holder that inserted after the
            // first statement keeps its fresh lock.
            force_any: sql!("DELETE FROM {t} WHERE lock_key = ? AND expire_time <= UTC_TIMESTAMP(6)"),
            reap: sql!(
                "DELETE FROM {t} WHERE expire_time < UTC_TIMESTAMP(6) ORDER BY expire_time LIMIT ?"
            ),
            purge: sql!(
                "DELETE FROM {t} WHERE expire_time < UTC_TIMESTAMP(6) - INTERVAL ? SECOND LIMIT ?"
            ),
            count: sql!(
                "SELECT COUNT(*), CAST(COALESCE(SUM(expire_time <= UTC_TIMESTAMP(6)), 0) AS SIGNED) FROM {t}"
            ),
            }
    }

    async fn insert(&self, key: &LockKey, owner: &Owner, ttl: Duration) -> Result<Option<u64>> {
        let res = sqlx::query(self.insert.clone())
            .bind(key.as_bytes())
            .bind(owner.as_str().as_bytes())
            .bind(micros(ttl))
            .execute(&self.pool)
            .await;
        match res {
            Ok(done) => Ok(Some(done.last_insert_id())),
            Err(e) if error::is_duplicate(&e) => Ok(None),
            // A deadlock or lock wait while racing other inserters: not acquired.
            Err(e) if error::is_lock_conflict(&e) => Ok(None),
            Err(e) => Err(error::map(e)),
        }
    }

    /// Same owner already holds the key: re-enter or refuse.
    async fn same_owner(
        &self,
        key: &LockKey,
        opts: &LockOptions,
        owner: &Owner,
    ) -> Result<Option<u64>> {
        if opts.is_reentrant() {
            let done = sqlx::query(self.reenter.clone())
                .bind(micros(opts.ttl()))
                .bind(key.as_bytes())
                .bind(owner.as_str().as_bytes())
                .execute(&self.pool)
                .await
                .db()?;
            return Ok((done.rows_affected() == 1).then(|| done.last_insert_id()));
        }
        let held = sqlx::query(self.held_by.clone())
            .bind(key.as_bytes())
            .bind(owner.as_str().as_bytes())
            .fetch_optional(&self.pool)
            .await
            .db()?;
        if held.is_some() {
            return Err(Error::AlreadyHeld { key: key.clone() });
        }
        Ok(None)
    }

    /// One expired-row cleanup for the key; true if a row was removed.
    async fn take_over_expired(&self, key: &LockKey) -> Result<bool> {
        let done = sqlx::query(self.delete_expired.clone())
            .bind(key.as_bytes())
            .execute(&self.pool)
            .await;
        match done {
            Ok(d) => Ok(d.rows_affected() > 0),
            Err(e) if error::is_lock_conflict(&e) => Ok(false),
            Err(e) => Err(error::map(e)),
        }
    }

    /// Deletes expired rows in batches of `batch`; returns how many.
    pub(crate) async fn reap(&self, batch: u32) -> Result<u64> {
        let mut total = 0;
        loop {
            let n = sqlx::query(self.reap.clone())
                .bind(batch)
                .execute(&self.pool)
                .await
                .db()?
                .rows_affected();
            total += n;
            if n < u64::from(batch) {
                return Ok(total);
            }
        }
    }

    /// Deletes rows expired for more than `older_than`, in batches.
    pub(crate) async fn purge(&self, older_than: Duration, batch: u32) -> Result<u64> {
        let mut total = 0;
        loop {
            let n = sqlx::query(self.purge.clone())
                .bind(older_than.as_secs())
                .bind(batch)
                .execute(&self.pool)
                .await
                .db()?
                .rows_affected();
            total += n;
            if n < u64::from(batch) {
                return Ok(total);
            }
        }
    }

    /// (rows, expired rows) in the lock table.
    pub(crate) async fn table_size(&self) -> Result<(u64, u64)> {
        let row = sqlx::query(self.count.clone())
            .fetch_one(&self.pool)
            .await
            .db()?;
        let rows: i64 = row.try_get(0).db()?;
        let expired: i64 = row.try_get(1).db()?;
        Ok((rows.max(0) as u64, expired.max(0) as u64))
    }
}

impl UniqueKey {
    async fn release_once(
        &self,
        lease: &Lease,
    ) -> std::result::Result<ReleaseOutcome, sqlx::Error> {
        let id = lease.token.get();
        let owner = lease.owner.as_str().as_bytes();
        let done = sqlx::query(self.release_last.clone())
            .bind(id)
            .bind(owner)
            .execute(&self.pool)
            .await?;
        if done.rows_affected() == 1 {
            notify_released(&self.scope, &lease.key);
            return Ok(ReleaseOutcome::Released);
        }
        // Slow path (re-entered, expired or foreign lease): decide under a row
        // lock, so concurrent releases of re-entered entries never race
        // (separate statements could delete a row another entry just re-took).
        let mut tx = self.pool.begin().await?;
        let row = sqlx::query(self.lock_own.clone())
            .bind(id)
            .bind(owner)
            .fetch_optional(&mut *tx)
            .await?;
        let outcome = match row {
            None => ReleaseOutcome::NotHeld,
            Some(r) => {
                let count: u32 = r.try_get(0)?;
                let current: i64 = r.try_get(1)?;
                if current != 0 && count > 1 {
                    sqlx::query(self.release_one.clone())
                        .bind(id)
                        .bind(owner)
                        .execute(&mut *tx)
                        .await?;
                    ReleaseOutcome::StillHeld {
                        remaining: count - 1,
                    }
                } else {
                    // Current and last: release. Expired: our own dead row, clean it up.
                    sqlx::query(self.delete_own.clone())
                        .bind(id)
                        .bind(owner)
                        .execute(&mut *tx)
                        .await?;
                    if current != 0 {
                        ReleaseOutcome::Released
                    } else {
                        ReleaseOutcome::NotHeld
                    }
                }
            }
        };
        tx.commit().await?;
        if !matches!(outcome, ReleaseOutcome::StillHeld { .. }) {
            notify_released(&self.scope, &lease.key);
        }
        if outcome == ReleaseOutcome::NotHeld {
            tracing::warn!(key = %lease.key, token = %lease.token, "release of a lease that was no longer held");
        }
        Ok(outcome)
    }
}

#[async_trait]
impl DistributedLock for UniqueKey {
    async fn try_acquire(&self, key: &LockKey, opts: &LockOptions) -> Result<Option<Lease>> {
        let owner = opts.owner_or_random();
        let ttl = opts.ttl();
        for attempt in 0..2 {
            let sent = Instant::now();
            if let Some(id) = self.insert(key, &owner, ttl).await? {
                return Ok(Some(Lease::new(
                    key.clone(),
                    owner,
                    FencingToken::new(id),
                    ttl,
                    sent,
                )));
            }
            if opts.owner().is_some() {
                let sent = Instant::now();
                if let Some(id) = self.same_owner(key, opts, &owner).await? {
                    return Ok(Some(Lease::new(
                        key.clone(),
                        owner,
                        FencingToken::new(id),
                        ttl,
                        sent,
                    )));
                }
            }
            // Held. A crashed holder's expired row is removed right here (only
            // while still expired), then the INSERT is retried once.
            if attempt == 0 && !self.take_over_expired(key).await? {
                break;
            }
        }
        Ok(None)
    }

    async fn acquire(&self, key: &LockKey, opts: &LockOptions) -> Result<Lease> {
        acquire_polling(self, &self.scope, key, opts, Backoff::default()).await
    }

    async fn extend(&self, lease: &Lease, ttl: Duration) -> Result<Lease> {
        let ttl = LockOptions::validate_ttl(ttl)?;
        let sent = Instant::now();
        let done = sqlx::query(self.extend.clone())
            .bind(micros(ttl))
            .bind(micros(ttl))
            .bind(lease.token.get())
            .bind(lease.owner.as_str().as_bytes())
            .execute(&self.pool)
            .await
            .db()?;
        // sqlx sets CLIENT_FOUND_ROWS, so this counts matched rows, not only
        // changed ones: an unchanged expire_time still reads as 1.
        if done.rows_affected() == 1 {
            Ok(lease.renewed(ttl, sent))
        } else {
            tracing::warn!(key = %lease.key, token = %lease.token, "extend refused: the lease expired or was taken over");
            Err(Error::lease_lost(
                &lease.key,
                lease.token,
                "the row expired or belongs to another holder",
            ))
        }
    }

    async fn release(&self, lease: &Lease) -> Result<ReleaseOutcome> {
        retry_lock_conflicts(|| self.release_once(lease)).await
    }

    async fn inspect(&self, key: &LockKey) -> Result<Option<LockInfo>> {
        let row = sqlx::query(self.inspect.clone())
            .bind(key.as_bytes())
            .fetch_optional(&self.pool)
            .await
            .db()?;
        row.map(|r| info_from_row(key, &r)).transpose()
    }

    async fn force_release(&self, key: &LockKey) -> Result<bool> {
        let current = sqlx::query(self.force_current.clone())
            .bind(key.as_bytes())
            .execute(&self.pool)
            .await
            .db()?
            .rows_affected()
            > 0;
        sqlx::query(self.force_any.clone())
            .bind(key.as_bytes())
            .execute(&self.pool)
            .await
            .db()?;
        if current {
            tracing::warn!(key = %key, "lock force-released");
        }
        notify_released(&self.scope, key);
        Ok(current)
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities::none()
            .backend("mysql/unique_key")
            .durable(true)
            .fencing(true)
            .reentrant(true)
    }
}
