//! The unique-key algorithm on one SQLite table (the seeds' "posture one").
//!
//! * acquire = one autocommit `INSERT … ON CONFLICT DO NOTHING RETURNING id`;
//!   no row back means "held". If the existing row is expired (crashed
//!   holder), it is deleted — only if still expired, in the same statement —
//!   and the INSERT retried once, so a takeover needs no reaper.
//! * the row's `AUTOINCREMENT` id is the fencing token: SQLite never hands
//!   an id out twice, even after rows are deleted or the file is reopened.
//! * release / extend match `id` **and** `owner` (and, for extend, that the
//!   row has not expired on SQLite's clock).
//! * the holder's label is written by the INSERT that grants the key (NULL
//!   without one); a re-entry keeps the first entry's label.
//!
//! Every statement is a single autocommit statement: SQLite runs it atomically
//! under its one write lock, waiting up to `busy_timeout` for that lock.
//! No read-then-write transaction is needed, so WAL's `SQLITE_BUSY_SNAPSHOT`
//! (a deferred transaction that read a stale snapshot) cannot happen.

use std::time::Duration;

use async_trait::async_trait;
use fenced_api::{
    batch::{ChunkVerdict, ExtendChunk},
    wait::{acquire_polling, notify_released, Backoff},
    Capabilities, DistributedLock, Error, FencingToken, Label, Lease, LockInfo, LockKey,
    LockOptions, Owner, ReleaseOutcome, Result,
};
use sqlx::{sqlite::SqliteRow, Row, SqlStr, SqlitePool};
use tokio::time::Instant;

use crate::{
    error::{self, SqlResultExt},
    sql,
};

/// SQLite's clock in whole microseconds since the Unix epoch. `'now'` reads
/// the host's wall clock with millisecond resolution, truncated, and is
/// constant within one statement. `ROUND` undoes the binary fraction of
/// `unixepoch('subsec')` so the value is an exact multiple of 1000.
const NOW: &str = "(CAST(ROUND(unixepoch('subsec') * 1000) AS INTEGER) * 1000)";

/// The clock's resolution. The clock reads the *start* of the current
/// millisecond, so expiries are counted from its *end*: the store never
/// frees a lock before the holder's local deadline (TTL counted from the
/// moment the request was sent).
const RESOLUTION_US: i64 = 1000;

/// A TTL as whole microseconds plus the clock's resolution. TTLs are
/// validated (≤ 24 h), so this cannot overflow.
fn expiry_us(ttl: Duration) -> i64 {
    i64::try_from(ttl.as_micros())
        .unwrap_or(i64::MAX / 2)
        .saturating_add(RESOLUTION_US)
}

/// SQL for one table, built once.
#[derive(Debug)]
pub(crate) struct UniqueKey {
    pool: SqlitePool,
    scope: String,
    insert: SqlStr,
    delete_expired: SqlStr,
    reenter: SqlStr,
    held_by: SqlStr,
    extend: SqlStr,
    /// `extend` for many ids of one owner: this, then `?3, ?4, …)
    /// RETURNING id` (see [`fenced_api::batch`]).
    extend_batch: String,
    release_last: SqlStr,
    release_one: SqlStr,
    delete_own: SqlStr,
    inspect: SqlStr,
    list: SqlStr,
    force: SqlStr,
}

impl UniqueKey {
    /// `table` is the validated, quoted table; `scope` names file and table
    /// for the in-process wake-ups of [`acquire_polling`].
    pub(crate) fn new(pool: SqlitePool, table: String, scope: String) -> Self {
        let t = &table;
        UniqueKey {
            pool,
            scope,
            insert: sql!(
                "INSERT INTO {t} (lock_key, owner, reentrant_count, expire_at, created_at, label) \
                 VALUES (?1, ?2, 1, {NOW} + ?3, {NOW}, ?4) \
                 ON CONFLICT (lock_key) DO NOTHING RETURNING id"
            ),
            delete_expired: sql!("DELETE FROM {t} WHERE lock_key = ?1 AND expire_at <= {NOW}"),
            reenter: sql!(
                "UPDATE {t} SET reentrant_count = reentrant_count + 1, \
                 expire_at = MAX(expire_at, {NOW} + ?1) \
                 WHERE lock_key = ?2 AND owner = ?3 AND expire_at > {NOW} RETURNING id"
            ),
            held_by: sql!(
                "SELECT 1 FROM {t} WHERE lock_key = ?1 AND owner = ?2 AND expire_at > {NOW}"
            ),
            // Re-entered: never cut the expiry another entry relies on.
            extend: sql!(
                "UPDATE {t} SET expire_at = CASE WHEN reentrant_count > 1 \
                 THEN MAX(expire_at, {NOW} + ?1) ELSE {NOW} + ?1 END \
                 WHERE id = ?2 AND owner = ?3 AND expire_at > {NOW}"
            ),
            extend_batch: format!(
                "UPDATE {t} SET expire_at = CASE WHEN reentrant_count > 1 \
                 THEN MAX(expire_at, {NOW} + ?1) ELSE {NOW} + ?1 END \
                 WHERE owner = ?2 AND expire_at > {NOW} AND id IN ("
            ),
            release_last: sql!(
                "DELETE FROM {t} WHERE id = ?1 AND owner = ?2 AND reentrant_count <= 1 \
                 AND expire_at > {NOW}"
            ),
            release_one: sql!(
                "UPDATE {t} SET reentrant_count = reentrant_count - 1 \
                 WHERE id = ?1 AND owner = ?2 AND reentrant_count > 1 AND expire_at > {NOW} \
                 RETURNING reentrant_count"
            ),
            delete_own: sql!("DELETE FROM {t} WHERE id = ?1 AND owner = ?2"),
            inspect: sql!(
                "SELECT owner, id, reentrant_count, expire_at - ({NOW} + {RESOLUTION_US}), label \
                 FROM {t} WHERE lock_key = ?1 AND expire_at > {NOW}"
            ),
            // The unique index on lock_key gives the order (byte order).
            list: sql!(
                "SELECT owner, id, reentrant_count, expire_at - ({NOW} + {RESOLUTION_US}), label, \
                 lock_key \
                 FROM {t} WHERE expire_at > {NOW} ORDER BY lock_key LIMIT ?1"
            ),
            force: sql!("DELETE FROM {t} WHERE lock_key = ?1 RETURNING expire_at > {NOW}"),
        }
    }

    async fn insert(
        &self,
        key: &LockKey,
        owner: &Owner,
        opts: &LockOptions,
    ) -> Result<Option<i64>> {
        let res = sqlx::query(self.insert.clone())
            .bind(key.as_bytes())
            .bind(owner.as_str().as_bytes())
            .bind(expiry_us(opts.ttl()))
            .bind(opts.label().map(Label::as_str))
            .fetch_optional(&self.pool)
            .await;
        match res {
            Ok(row) => row.map(|r| r.try_get::<i64, _>(0)).transpose().db(),
            // `ON CONFLICT DO NOTHING` covers it; kept in case a future
            // schema adds another unique index.
            Err(e) if error::is_unique_violation(&e) => Ok(None),
            Err(e) => Err(error::map(e)),
        }
    }

    /// Same owner already holds the key: re-enter or refuse.
    async fn same_owner(
        &self,
        key: &LockKey,
        opts: &LockOptions,
        owner: &Owner,
    ) -> Result<Option<i64>> {
        if opts.is_reentrant() {
            let row = sqlx::query(self.reenter.clone())
                .bind(expiry_us(opts.ttl()))
                .bind(key.as_bytes())
                .bind(owner.as_str().as_bytes())
                .fetch_optional(&self.pool)
                .await
                .db()?;
            return row.map(|r| r.try_get::<i64, _>(0)).transpose().db();
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
            .await
            .db()?;
        Ok(done.rows_affected() > 0)
    }

    pub(crate) fn pool(&self) -> &SqlitePool {
        &self.pool
    }
}

fn token(id: i64) -> FencingToken {
    // AUTOINCREMENT ids start at 1 and only grow.
    FencingToken::new(u64::try_from(id).unwrap_or(0))
}

fn info_from_row(key: &LockKey, row: &SqliteRow) -> Result<LockInfo> {
    let owner: Vec<u8> = row.try_get(0).db()?;
    let id: i64 = row.try_get(1).db()?;
    let count: i64 = row.try_get(2).db()?;
    let remaining_us: i64 = row.try_get(3).db()?;
    let label: Option<String> = row.try_get(4).db()?;
    let owner = std::str::from_utf8(&owner)
        .ok()
        .and_then(|o| Owner::new(o).ok())
        .ok_or_else(|| {
            Error::backend(
                error::BACKEND,
                false,
                format!("the row of `{key}` has an invalid owner; was the table edited by hand?"),
            )
        })?;
    Ok(LockInfo::new(
        key.clone(),
        owner,
        token(id),
        Duration::from_micros(u64::try_from(remaining_us).unwrap_or(0)),
        u32::try_from(count).unwrap_or(u32::MAX),
    )
    .with_label(label.and_then(|l| stored_label(key, &l))))
}

/// A stored label; one that is no longer valid (edited by hand) is shown
/// as none rather than failing `inspect` — it is for people, not for the lock.
fn stored_label(key: &LockKey, label: &str) -> Option<Label> {
    Label::new(label)
        .inspect_err(|e| tracing::warn!(key = %key, error = %e, "ignoring an invalid stored label"))
        .ok()
}

#[async_trait]
impl DistributedLock for UniqueKey {
    async fn try_acquire(&self, key: &LockKey, opts: &LockOptions) -> Result<Option<Lease>> {
        let owner = opts.owner_or_random();
        let ttl = opts.ttl();
        for attempt in 0..2 {
            let sent = Instant::now();
            if let Some(id) = self.insert(key, &owner, opts).await? {
                tracing::debug!(key = %key, token = id, "lock acquired");
                return Ok(Some(Lease::new(key.clone(), owner, token(id), ttl, sent)));
            }
            if opts.owner().is_some() {
                let sent = Instant::now();
                if let Some(id) = self.same_owner(key, opts, &owner).await? {
                    return Ok(Some(Lease::new(key.clone(), owner, token(id), ttl, sent)));
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
            .bind(expiry_us(ttl))
            .bind(i64::try_from(lease.token.get()).unwrap_or(i64::MAX))
            .bind(lease.owner.as_str().as_bytes())
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

    async fn extend_many(&self, leases: &[Lease], ttl: Duration) -> Vec<Result<Lease>> {
        fenced_api::batch::extend_in_chunks(self, leases, ttl, EXTEND_CHUNK).await
    }

    async fn release(&self, lease: &Lease) -> Result<ReleaseOutcome> {
        let id = i64::try_from(lease.token.get()).unwrap_or(i64::MAX);
        let owner = lease.owner.as_str().as_bytes();
        // Review fix: the three steps in one write transaction.
        let mut tx = self.pool.begin_with("BEGIN IMMEDIATE").await.db()?;
        let done = sqlx::query(self.release_last.clone())
            .bind(id)
            .bind(owner)
            .execute(&mut *tx)
            .await
            .db()?;
        if done.rows_affected() == 1 {
            tx.commit().await.db()?;
            notify_released(&self.scope, &lease.key);
            return Ok(ReleaseOutcome::Released);
        }
        let left = sqlx::query(self.release_one.clone())
            .bind(id)
            .bind(owner)
            .fetch_optional(&mut *tx)
            .await
            .db()?;
        if let Some(row) = left {
            let remaining: i64 = row.try_get(0).db()?;
            tx.commit().await.db()?;
            return Ok(ReleaseOutcome::StillHeld {
                remaining: u32::try_from(remaining).unwrap_or(u32::MAX),
            });
        }
        let cleaned = sqlx::query(self.delete_own.clone())
            .bind(id)
            .bind(owner)
            .execute(&mut *tx)
            .await
            .db()?;
        tx.commit().await.db()?;
        if cleaned.rows_affected() > 0 {
            notify_released(&self.scope, &lease.key);
        }
        Ok(ReleaseOutcome::NotHeld)
    }

    async fn inspect(&self, key: &LockKey) -> Result<Option<LockInfo>> {
        let row = sqlx::query(self.inspect.clone())
            .bind(key.as_bytes())
            .fetch_optional(&self.pool)
            .await
            .db()?;
        row.map(|r| info_from_row(key, &r)).transpose()
    }

    async fn list(&self, limit: usize) -> Result<Vec<LockInfo>> {
        let rows = sqlx::query(self.list.clone())
            .bind(i64::try_from(limit).unwrap_or(i64::MAX))
            .fetch_all(&self.pool)
            .await
            .db()?;
        let mut held = Vec::with_capacity(rows.len());
        for row in &rows {
            let raw: Vec<u8> = row.try_get(5).db()?;
            let key = std::str::from_utf8(&raw)
                .ok()
                .and_then(|k| LockKey::new(k).ok())
                .ok_or_else(|| {
                    Error::backend(
                        error::BACKEND,
                        false,
                        "a row has an invalid lock_key; was the table edited by hand?",
                    )
                })?;
            held.push(info_from_row(&key, row)?);
        }
        Ok(held)
    }

    async fn force_release(&self, key: &LockKey) -> Result<bool> {
        let rows = sqlx::query(self.force.clone())
            .bind(key.as_bytes())
            .fetch_all(&self.pool)
            .await
            .db()?;
        let mut current = false;
        for row in &rows {
            current |= row.try_get::<bool, _>(0).db()?;
        }
        if current {
            tracing::warn!(key = %key, "lock force-released");
        }
        if !rows.is_empty() {
            notify_released(&self.scope, key);
        }
        Ok(current)
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities::none()
            .backend(error::BACKEND)
            .durable(true)
            .fencing(true)
            .reentrant(true)
    }
}

/// Leases renewed by one statement (SQLite allows 32 766 parameters).
const EXTEND_CHUNK: usize = 256;

#[async_trait]
impl ExtendChunk for UniqueKey {
    async fn extend_chunk(
        &self,
        owner: &Owner,
        chunk: &[&Lease],
        ttl: Duration,
    ) -> Result<ChunkVerdict> {
        let places = fenced_api::batch::padded_len(chunk.len());
        let mut text = self.extend_batch.clone();
        for p in 0..places {
            text.push_str(if p == 0 { "?" } else { ", ?" });
            text.push_str(&(p + 3).to_string());
        }
        text.push_str(") RETURNING id");
        let mut query = sqlx::query(sql!("{text}"))
            .bind(expiry_us(ttl))
            .bind(owner.as_str().as_bytes());
        for p in 0..places {
            let lease = chunk[p.min(chunk.len() - 1)];
            query = query.bind(i64::try_from(lease.token.get()).unwrap_or(i64::MAX));
        }
        let rows = query.fetch_all(&self.pool).await.db()?;
        let mut renewed = std::collections::HashSet::with_capacity(rows.len());
        for row in rows {
            renewed.insert(token(row.try_get::<i64, _>(0).db()?));
        }
        Ok(ChunkVerdict::Exactly(renewed))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expiry_is_rounded_up_by_the_clock_resolution() {
        assert_eq!(expiry_us(Duration::from_millis(10)), 11_000);
        assert_eq!(
            expiry_us(LockOptions::MAX_TTL),
            86_400_000_000 + RESOLUTION_US
        );
    }
}
