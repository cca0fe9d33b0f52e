//! The unique-key algorithm on one SQLite table.
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

use std::{collections::HashSet, time::Duration};

use fenced_api::{
    batch::ChunkVerdict, Error, FencingToken, Label, Lease, LockKey, LockOptions, Owner,
    ReleaseOutcome, Result,
};
use fenced_sql::{sql, sqlite::NOW_US as NOW};
use sqlx::{Row, SqlStr, Sqlite, SqlitePool};
use tokio::time::Instant;

use crate::{
    config::TableName,
    error::{self, SqlResultExt},
    gate::WriteGate,
};

/// The clock's resolution. The clock reads the *start* of the current
/// millisecond, so expiries are counted from its *end*: the store never
/// frees a lock before the holder's local deadline (TTL counted from the
/// moment the request was sent).
pub(crate) const RESOLUTION_US: i64 = 1000;

/// A TTL as whole microseconds plus the clock's resolution. TTLs are
/// validated (≤ 24 h), so this cannot overflow.
pub(crate) fn expiry_us(ttl: Duration) -> i64 {
    i64::try_from(ttl.as_micros())
        .unwrap_or(i64::MAX / 2)
        .saturating_add(RESOLUTION_US)
}

/// The fencing token of row `id`.
pub(crate) fn token(id: i64) -> FencingToken {
    // AUTOINCREMENT ids start at 1 and only grow.
    FencingToken::new(u64::try_from(id).unwrap_or(0))
}

fn row_id(lease: &Lease) -> i64 {
    i64::try_from(lease.token.get()).unwrap_or(i64::MAX)
}

/// What a release or force-release did: its outcome, and whether a row of
/// the key was deleted (so this process's waiters may try at once).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Done<T> {
    pub(crate) outcome: T,
    pub(crate) freed: bool,
}

/// SQL for one table, built once.
#[derive(Debug)]
pub(crate) struct UniqueKey {
    pool: SqlitePool,
    /// Taken by every write (see [`WriteGate`]).
    gate: WriteGate,
    insert: SqlStr,
    delete_expired: SqlStr,
    reenter: SqlStr,
    held_by: SqlStr,
    extend: SqlStr,
    /// `extend` for many leases: this, then `?2, ?3, …)`, the owners'
    /// check and `RETURNING id` (see [`UniqueKey::extend_chunk`]).
    extend_batch: String,
    release_last: SqlStr,
    release_one: SqlStr,
    delete_own: SqlStr,
    force: SqlStr,
}

impl UniqueKey {
    pub(crate) fn new(pool: SqlitePool, gate: WriteGate, table: &TableName) -> Self {
        let t = &table.quoted("");
        UniqueKey {
            pool,
            gate,
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
                 WHERE expire_at > {NOW} AND id IN ("
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
            force: sql!("DELETE FROM {t} WHERE lock_key = ?1 RETURNING expire_at > {NOW}"),
        }
    }

    pub(crate) fn pool(&self) -> &SqlitePool {
        &self.pool
    }

    async fn insert(
        &self,
        key: &LockKey,
        owner: &Owner,
        opts: &LockOptions,
    ) -> Result<Option<i64>> {
        let _write = self.gate.enter().await;
        let res = sqlx::query(self.insert.clone())
            .bind(key.as_bytes())
            .bind(owner.as_str().as_bytes())
            .bind(expiry_us(opts.ttl()))
            .bind(opts.label().map(Label::as_str))
            .fetch_optional(&self.pool)
            .await;
        match res {
            Ok(row) => row.map(|r| r.try_get::<i64, _>(0)).transpose().db(),
            // `ON CONFLICT DO NOTHING` covers the key's index; any other
            // unique index also means "held", never a failure.
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
            let _write = self.gate.enter().await;
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
        let _write = self.gate.enter().await;
        let done = sqlx::query(self.delete_expired.clone())
            .bind(key.as_bytes())
            .execute(&self.pool)
            .await
            .db()?;
        Ok(done.rows_affected() > 0)
    }

    pub(crate) async fn try_acquire(
        &self,
        key: &LockKey,
        opts: &LockOptions,
    ) -> Result<Option<Lease>> {
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

    pub(crate) async fn extend(&self, lease: &Lease, ttl: Duration) -> Result<Lease> {
        let ttl = LockOptions::validate_ttl(ttl)?;
        let _write = self.gate.enter().await;
        let sent = Instant::now();
        let done = sqlx::query(self.extend.clone())
            .bind(expiry_us(ttl))
            .bind(row_id(lease))
            .bind(lease.owner.as_str().as_bytes())
            .execute(&self.pool)
            .await
            .db()?;
        if done.rows_affected() == 1 {
            Ok(lease.renewed(ttl, sent))
        } else {
            Err(fenced_sql::extend_refused(lease))
        }
    }

    /// One statement renewing `chunk`, each row checked against its own
    /// lease's owner (the `CASE` reuses the id list's numbered
    /// placeholders); `RETURNING` says exactly which rows.
    pub(crate) async fn extend_chunk(
        &self,
        chunk: &[&Lease],
        ttl: Duration,
    ) -> Result<ChunkVerdict> {
        let (list, padded) = fenced_sql::in_list::<Sqlite>(chunk, 2);
        let padded: Vec<&Lease> = padded.collect();
        let places = padded.len();
        let owners: String = (0..places)
            .map(|p| format!(" WHEN ?{} THEN ?{}", 2 + p, 2 + places + p))
            .collect();
        let text = format!(
            "{}{list}) AND owner = CASE id{owners} END RETURNING id",
            self.extend_batch
        );
        let mut query = sqlx::query(sql!("{text}")).bind(expiry_us(ttl));
        for lease in &padded {
            query = query.bind(row_id(lease));
        }
        for lease in &padded {
            query = query.bind(lease.owner.as_str().as_bytes());
        }
        let rows = {
            let _write = self.gate.enter().await;
            query.fetch_all(&self.pool).await.db()?
        };
        let mut renewed = HashSet::with_capacity(rows.len());
        for row in rows {
            renewed.insert(token(row.try_get::<i64, _>(0).db()?));
        }
        Ok(ChunkVerdict::Exactly(renewed))
    }

    pub(crate) async fn release(&self, lease: &Lease) -> Result<Done<ReleaseOutcome>> {
        let id = row_id(lease);
        let owner = lease.owner.as_str().as_bytes();
        // The three steps in one write transaction: no other writer between them.
        let _write = self.gate.enter().await;
        let mut tx = self.pool.begin_with("BEGIN IMMEDIATE").await.db()?;
        let done = sqlx::query(self.release_last.clone())
            .bind(id)
            .bind(owner)
            .execute(&mut *tx)
            .await
            .db()?;
        if done.rows_affected() == 1 {
            tx.commit().await.db()?;
            return Ok(Done {
                outcome: ReleaseOutcome::Released,
                freed: true,
            });
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
            return Ok(Done {
                outcome: ReleaseOutcome::StillHeld {
                    remaining: u32::try_from(remaining).unwrap_or(u32::MAX),
                },
                freed: false,
            });
        }
        // Not current: an expired row of this lease is removed all the same.
        let cleaned = sqlx::query(self.delete_own.clone())
            .bind(id)
            .bind(owner)
            .execute(&mut *tx)
            .await
            .db()?;
        tx.commit().await.db()?;
        Ok(Done {
            outcome: ReleaseOutcome::NotHeld,
            freed: cleaned.rows_affected() > 0,
        })
    }

    /// Deletes the key's row; the outcome is whether it had a live holder.
    pub(crate) async fn force_release(&self, key: &LockKey) -> Result<Done<bool>> {
        let _write = self.gate.enter().await;
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
        Ok(Done {
            outcome: current,
            freed: !rows.is_empty(),
        })
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
