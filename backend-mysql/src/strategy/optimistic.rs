//! `optimistic`: one permanent row per key taken with a conditional UPDATE
//! (the seeds' "乐观锁版本号" posture).
//!
//! * acquire = `UPDATE … SET holder = ?, version = LAST_INSERT_ID(version + 1), …
//!   WHERE lock_key = ? AND (holder IS NULL OR expire_time <= now)`: one round
//!   trip once the key's row exists, and the new version — the fencing token —
//!   comes back in the OK packet. A missing row is created with `INSERT IGNORE`.
//! * release clears the holder (matching holder **and** version); the row
//!   stays, so the table never grows with traffic, only with distinct keys.

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

#[derive(Debug)]
pub(crate) struct Optimistic {
    pool: MySqlPool,
    scope: String,
    take: SqlStr,
    create_row: SqlStr,
    reenter: SqlStr,
    held_by: SqlStr,
    extend: SqlStr,
    release_last: SqlStr,
    release_one: SqlStr,
    lock_own: SqlStr,
    inspect: SqlStr,
    force: SqlStr,
}

impl Optimistic {
    pub(crate) fn new(pool: MySqlPool, table: String, scope: String) -> Self {
        let t = &table;
        let current = "holder = ? AND version = ? AND expire_time > UTC_TIMESTAMP(6)";
        Optimistic {
            pool,
            scope,
            take: sql!(
                "UPDATE {t} SET version = LAST_INSERT_ID(version + 1), holder = ?, reentrant_count = 1, \
                 expire_time = UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND \
                 WHERE lock_key = ? AND (holder IS NULL OR expire_time <= UTC_TIMESTAMP(6))"
            ),
            create_row: sql!("INSERT IGNORE INTO {t} (lock_key, version) VALUES (?, 0)"),
            reenter: sql!(
                "UPDATE {t} SET reentrant_count = reentrant_count + 1, version = LAST_INSERT_ID(version), \
                 expire_time = GREATEST(expire_time, UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND) \
                 WHERE lock_key = ? AND holder = ? AND expire_time > UTC_TIMESTAMP(6)"
            ),
            held_by: sql!(
                "SELECT 1 FROM {t} WHERE lock_key = ? AND holder = ? AND expire_time > UTC_TIMESTAMP(6)"
            ),
            // Re-entered holds never have their expiry cut by one entry's extend.
            extend: sql!(
                "UPDATE {t} SET expire_time = IF(reentrant_count > 1, \
                 GREATEST(expire_time, UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND), \
                 UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND) \
                 WHERE lock_key = ? AND {current}"
            ),
            release_last: sql!(
                "UPDATE {t} SET holder = NULL, expire_time = NULL, reentrant_count = 0 \
                 WHERE lock_key = ? AND {current} AND reentrant_count <= 1"
            ),
            release_one: sql!(
                "UPDATE {t} SET reentrant_count = LAST_INSERT_ID(reentrant_count - 1) \
                 WHERE lock_key = ? AND {current} AND reentrant_count > 1"
            ),
            lock_own: sql!(
                "SELECT reentrant_count FROM {t} WHERE lock_key = ? AND {current} FOR UPDATE"
            ),
            inspect: sql!(
                "SELECT holder, version, reentrant_count, \
                 TIMESTAMPDIFF(MICROSECOND, UTC_TIMESTAMP(6), expire_time) \
                 FROM {t} WHERE lock_key = ? AND holder IS NOT NULL AND expire_time > UTC_TIMESTAMP(6)"
            ),
            force: sql!(
                "UPDATE {t} SET holder = NULL, expire_time = NULL, reentrant_count = 0 \
                 WHERE lock_key = ? AND holder IS NOT NULL AND expire_time > UTC_TIMESTAMP(6)"
            ),
        }
    }

    async fn take(&self, key: &LockKey, owner: &Owner, ttl: Duration) -> Result<Option<u64>> {
        let res = sqlx::query(self.take.clone())
            .bind(owner.as_str().as_bytes())
            .bind(micros(ttl))
            .bind(key.as_bytes())
            .execute(&self.pool)
            .await;
        match res {
            Ok(done) if done.rows_affected() == 1 => Ok(Some(done.last_insert_id())),
            Ok(_) => Ok(None),
            Err(e) if error::is_lock_conflict(&e) => Ok(None),
            Err(e) => Err(error::map(e)),
        }
    }

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
}

impl Optimistic {
    async fn release_once(
        &self,
        lease: &Lease,
    ) -> std::result::Result<ReleaseOutcome, sqlx::Error> {
        let bind = |sql: SqlStr| {
            sqlx::query(sql)
                .bind(lease.key.as_bytes())
                .bind(lease.owner.as_str().as_bytes())
                .bind(lease.token.get())
        };
        let done = bind(self.release_last.clone()).execute(&self.pool).await?;
        if done.rows_affected() == 1 {
            notify_released(&self.scope, &lease.key);
            return Ok(ReleaseOutcome::Released);
        }
        // Slow path (re-entered, expired or foreign lease): decide under a row
        // lock, so concurrent releases of re-entered entries never race.
        let mut tx = self.pool.begin().await?;
        let row = bind(self.lock_own.clone()).fetch_optional(&mut *tx).await?;
        let outcome = match row {
            Some(r) => {
                let count: u32 = r.try_get(0)?;
                if count > 1 {
                    bind(self.release_one.clone()).execute(&mut *tx).await?;
                    ReleaseOutcome::StillHeld {
                        remaining: count - 1,
                    }
                } else {
                    bind(self.release_last.clone()).execute(&mut *tx).await?;
                    ReleaseOutcome::Released
                }
            }
            None => ReleaseOutcome::NotHeld,
        };
        tx.commit().await?;
        match outcome {
            ReleaseOutcome::Released => notify_released(&self.scope, &lease.key),
            ReleaseOutcome::NotHeld => {
                tracing::warn!(key = %lease.key, token = %lease.token, "release of a lease that was no longer held")
            }
            _ => {}
        }
        Ok(outcome)
    }
}

#[async_trait]
impl DistributedLock for Optimistic {
    async fn try_acquire(&self, key: &LockKey, opts: &LockOptions) -> Result<Option<Lease>> {
        let owner = opts.owner_or_random();
        let ttl = opts.ttl();
        let sent = Instant::now();
        if let Some(version) = self.take(key, &owner, ttl).await? {
            return Ok(Some(Lease::new(
                key.clone(),
                owner,
                FencingToken::new(version),
                ttl,
                sent,
            )));
        }
        if opts.owner().is_some() {
            let sent = Instant::now();
            if let Some(version) = self.same_owner(key, opts, &owner).await? {
                return Ok(Some(Lease::new(
                    key.clone(),
                    owner,
                    FencingToken::new(version),
                    ttl,
                    sent,
                )));
            }
        }
        // Held, or the key's row does not exist yet: create it and try once more.
        let created = sqlx::query(self.create_row.clone())
            .bind(key.as_bytes())
            .execute(&self.pool)
            .await
            .db()?
            .rows_affected();
        if created == 0 {
            return Ok(None);
        }
        let sent = Instant::now();
        Ok(self
            .take(key, &owner, ttl)
            .await?
            .map(|v| Lease::new(key.clone(), owner, FencingToken::new(v), ttl, sent)))
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
            .bind(lease.key.as_bytes())
            .bind(lease.owner.as_str().as_bytes())
            .bind(lease.token.get())
            .execute(&self.pool)
            .await
            .db()?;
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
        let done = sqlx::query(self.force.clone())
            .bind(key.as_bytes())
            .execute(&self.pool)
            .await
            .db()?;
        let removed = done.rows_affected() > 0;
        if removed {
            tracing::warn!(key = %key, "lock force-released");
            notify_released(&self.scope, key);
        }
        Ok(removed)
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities::none()
            .backend("mysql/optimistic")
            .durable(true)
            .fencing(true)
            .reentrant(true)
    }
}
