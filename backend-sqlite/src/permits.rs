//! Semaphores and reader-writer locks in a SQLite file: the line model of
//! [`fenced_api::permits`] on the table `<table>_permits`.
//!
//! * One row per entry of a key's line, holder or waiter. Its
//!   `AUTOINCREMENT` id is both its place in line and its fencing token: ids
//!   only grow, and SQLite runs one writer at a time, so ids are handed out
//!   in the order entries join.
//! * Joining the line is one `BEGIN IMMEDIATE` transaction: drop the key's
//!   expired entries, read the rest (capacity, re-entry, total weight),
//!   then insert.
//! * An entry is granted once the weights of the live entries up to it fit
//!   the capacity. A waiter looks inside a `BEGIN IMMEDIATE` transaction:
//!   no renewal of an earlier entry can be in flight while it counts (a
//!   plain read could see such an entry expired while its renewal commits),
//!   and it starts its lease in the same transaction.
//! * Waiters poll with backoff ([`fenced_api::permits::acquire_in_line`]),
//!   renew their place every third of the TTL, and are woken at once by a
//!   release in the same process.

use std::{sync::Arc, time::Duration};

use async_trait::async_trait;
use fenced_api::{
    permits::{self, Arrival, Decision, LineEntry, LineRow, LineStore, Look, Permits},
    wait::Polling,
    Capabilities, FencingToken, Label, Lease, LockInfo, LockKey, LockOptions, Owner,
    ReleaseOutcome, Result,
};
use fenced_sql::{rows::stored_key, sql, sqlite::NOW_US as NOW};
use sqlx::{Row, SqlStr, SqlitePool};
use tokio::time::Instant;

use crate::{
    config::TableName,
    error::{self, SqlResultExt, SqliteBackend},
    gate::WriteGate,
    list::info_from_row,
    unique_key::{expiry_us, token, RESOLUTION_US},
};

/// The line steps of the store's semaphores; [`SqliteLock::semaphores`](fenced_api::DistributedLock::semaphores)
/// returns them as [`LineSemaphores`](fenced_api::permits::LineSemaphores).
/// Cheap to clone.
#[derive(Clone)]
pub(crate) struct SqlitePermits {
    inner: Arc<Inner>,
}

struct Inner {
    pool: SqlitePool,
    /// Taken by every write, with the store's locks (see [`WriteGate`]).
    gate: WriteGate,
    sql: Sql,
    /// Local waiters' wake-ups: the mutex scope with `#permits`.
    polling: Polling,
    capabilities: Capabilities,
}

impl std::fmt::Debug for SqlitePermits {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqlitePermits")
            .field("scope", &self.inner.polling.scope())
            .finish_non_exhaustive()
    }
}

struct Sql {
    purge: SqlStr,
    line: SqlStr,
    reenter: SqlStr,
    insert: SqlStr,
    look: SqlStr,
    start: SqlStr,
    leave: SqlStr,
    extend: SqlStr,
    release_last: SqlStr,
    release_one: SqlStr,
    holders: SqlStr,
    force: SqlStr,
    list: SqlStr,
}

fn row_id(token: FencingToken) -> i64 {
    i64::try_from(token.get()).unwrap_or(i64::MAX)
}

/// The columns `info_from_row` reads (0–4), then capacity and weight (5, 6).
const INFO: &str = "owner, id, reentrant_count, expire_at - ({NOW} + {RESOLUTION_US}), label, \
                    capacity, weight";

impl Sql {
    fn new(table: &TableName) -> Self {
        let t = &table.quoted("_permits");
        let info = INFO
            .replace("{NOW}", NOW)
            .replace("{RESOLUTION_US}", &RESOLUTION_US.to_string());
        // The weight of the live entries of `e`'s key up to `e`.
        let prefix = format!(
            "(SELECT SUM(x.weight) FROM {t} x WHERE x.lock_key = e.lock_key AND x.id <= e.id \
             AND x.expire_at > {NOW})"
        );
        Sql {
            purge: sql!("DELETE FROM {t} WHERE lock_key = ?1 AND expire_at <= {NOW}"),
            line: sql!(
                "SELECT id, owner, capacity, weight FROM {t} WHERE lock_key = ?1 ORDER BY id"
            ),
            reenter: sql!(
                "UPDATE {t} SET reentrant_count = reentrant_count + 1, \
                 expire_at = MAX(expire_at, {NOW} + ?1) WHERE id = ?2"
            ),
            insert: sql!(
                "INSERT INTO {t} (lock_key, owner, capacity, weight, reentrant_count, expire_at, \
                 created_at, label) VALUES (?1, ?2, ?3, ?4, 1, {NOW} + ?5, {NOW}, ?6) RETURNING id"
            ),
            look: sql!(
                "SELECT {prefix} <= e.capacity FROM {t} e \
                 WHERE e.id = ?1 AND e.owner = ?2 AND e.expire_at > {NOW}"
            ),
            start: sql!(
                "UPDATE {t} SET expire_at = {NOW} + ?1 \
                 WHERE id = ?2 AND owner = ?3 AND expire_at > {NOW}"
            ),
            leave: sql!("DELETE FROM {t} WHERE id = ?1 AND owner = ?2"),
            // Re-entered: never cut the expiry another entry relies on.
            extend: sql!(
                "UPDATE {t} SET expire_at = CASE WHEN reentrant_count > 1 \
                 THEN MAX(expire_at, {NOW} + ?1) ELSE {NOW} + ?1 END \
                 WHERE id = ?2 AND owner = ?3 AND expire_at > {NOW}"
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
            holders: sql!(
                "SELECT {info} FROM {t} WHERE lock_key = ?1 AND expire_at > {NOW} ORDER BY id"
            ),
            force: sql!("DELETE FROM {t} WHERE lock_key = ?1 RETURNING expire_at > {NOW}"),
            list: sql!(
                "SELECT {info}, lock_key FROM (SELECT *, SUM(weight) OVER \
                 (PARTITION BY lock_key ORDER BY id) AS upto FROM {t} WHERE expire_at > {NOW}) \
                 WHERE upto <= capacity ORDER BY lock_key, id LIMIT ?1"
            ),
        }
    }
}

impl SqlitePermits {
    pub(crate) fn new(
        pool: SqlitePool,
        gate: WriteGate,
        table: &TableName,
        mutex_scope: &str,
    ) -> Self {
        SqlitePermits {
            inner: Arc::new(Inner {
                pool,
                gate,
                sql: Sql::new(table),
                polling: Polling::new(format!("{mutex_scope}#permits")),
                capabilities: Capabilities::none()
                    .backend(error::BACKEND)
                    .durable(true)
                    .fencing(true)
                    .reentrant(true)
                    // Granted strictly in order of joining the line.
                    .fifo(true),
            }),
        }
    }

    fn lease(key: &LockKey, owner: &Owner, id: i64, ttl: Duration, sent: Instant) -> Lease {
        Lease::new(key.clone(), owner.clone(), token(id), ttl, sent)
    }
}

#[async_trait]
impl LineStore for SqlitePermits {
    async fn arrive(
        &self,
        key: &LockKey,
        permits: Permits,
        opts: &LockOptions,
        owner: &Owner,
        queue: bool,
    ) -> Result<Arrival> {
        let sql = &self.inner.sql;
        let sent = Instant::now();
        let _write = self.inner.gate.enter().await;
        let mut tx = self.inner.pool.begin_with("BEGIN IMMEDIATE").await.db()?;
        sqlx::query(sql.purge.clone())
            .bind(key.as_bytes())
            .execute(&mut *tx)
            .await
            .db()?;
        let rows = sqlx::query(sql.line.clone())
            .bind(key.as_bytes())
            .fetch_all(&mut *tx)
            .await
            .db()?;
        let mut ids = Vec::with_capacity(rows.len());
        let mut line = Vec::with_capacity(rows.len());
        for row in &rows {
            ids.push(row.try_get::<i64, _>(0).db()?);
            let who: Vec<u8> = row.try_get(1).db()?;
            line.push(LineEntry {
                capacity: u32::try_from(row.try_get::<i64, _>(2).db()?).unwrap_or(0),
                weight: u32::try_from(row.try_get::<i64, _>(3).db()?).unwrap_or(u32::MAX),
                mine: who == owner.as_str().as_bytes(),
            });
        }
        let fits = match permits::decide(key, &line, permits, opts, queue)? {
            Decision::Reenter { at } => {
                sqlx::query(sql.reenter.clone())
                    .bind(expiry_us(opts.ttl()))
                    .bind(ids[at])
                    .execute(&mut *tx)
                    .await
                    .db()?;
                tx.commit().await.db()?;
                let lease = Self::lease(key, owner, ids[at], opts.ttl(), sent);
                return Ok(Arrival::Granted(lease));
            }
            Decision::Busy => {
                tx.rollback().await.db()?;
                return Ok(Arrival::Busy);
            }
            Decision::Grant => true,
            Decision::Queue => false,
        };
        let id: i64 = sqlx::query(sql.insert.clone())
            .bind(key.as_bytes())
            .bind(owner.as_str().as_bytes())
            .bind(i64::from(permits.capacity()))
            .bind(i64::from(permits.weight()))
            .bind(expiry_us(opts.ttl()))
            .bind(opts.label().map(Label::as_str))
            .fetch_one(&mut *tx)
            .await
            .db()?
            .try_get(0)
            .db()?;
        tx.commit().await.db()?;
        Ok(if fits {
            Arrival::Granted(Self::lease(key, owner, id, opts.ttl(), sent))
        } else {
            Arrival::Queued(token(id))
        })
    }

    /// One `BEGIN IMMEDIATE` transaction: no write (a renewal of an
    /// earlier entry) can be in flight while it counts.
    async fn look(
        &self,
        key: &LockKey,
        opts: &LockOptions,
        owner: &Owner,
        token: FencingToken,
        renew: bool,
    ) -> Result<Look> {
        let sql = &self.inner.sql;
        let id = row_id(token);
        let owner_bytes = owner.as_str().as_bytes();
        let _write = self.inner.gate.enter().await;
        let mut tx = self.inner.pool.begin_with("BEGIN IMMEDIATE").await.db()?;
        let row = sqlx::query(sql.look.clone())
            .bind(id)
            .bind(owner_bytes)
            .fetch_optional(&mut *tx)
            .await
            .db()?;
        let Some(row) = row else {
            tx.rollback().await.db()?;
            return Ok(Look::Gone);
        };
        let granted: bool = row.try_get(0).db()?;
        if !granted && !renew {
            tx.rollback().await.db()?;
            return Ok(Look::Waiting);
        }
        let sent = Instant::now();
        let done = sqlx::query(sql.start.clone())
            .bind(expiry_us(opts.ttl()))
            .bind(id)
            .bind(owner_bytes)
            .execute(&mut *tx)
            .await
            .db()?;
        tx.commit().await.db()?;
        Ok(match (done.rows_affected(), granted) {
            (0, _) => Look::Gone,
            (_, true) => Look::Granted(Self::lease(key, owner, id, opts.ttl(), sent)),
            (_, false) => Look::Waiting,
        })
    }

    async fn leave(&self, key: &LockKey, owner: &Owner, token: FencingToken) -> Result<()> {
        let _write = self.inner.gate.enter().await;
        let done = sqlx::query(self.inner.sql.leave.clone())
            .bind(row_id(token))
            .bind(owner.as_str().as_bytes())
            .execute(&self.inner.pool)
            .await
            .db()?;
        if done.rows_affected() > 0 {
            // Those behind it may be granted now.
            self.inner.polling.freed(key);
        }
        Ok(())
    }

    async fn renew(&self, lease: &Lease, ttl: Duration) -> Result<bool> {
        let _write = self.inner.gate.enter().await;
        let done = sqlx::query(self.inner.sql.extend.clone())
            .bind(expiry_us(ttl))
            .bind(row_id(lease.token))
            .bind(lease.owner.as_str().as_bytes())
            .execute(&self.inner.pool)
            .await
            .db()?;
        Ok(done.rows_affected() > 0)
    }

    async fn give_back(&self, lease: &Lease) -> Result<ReleaseOutcome> {
        let sql = &self.inner.sql;
        let (id, owner) = (row_id(lease.token), lease.owner.as_str().as_bytes());
        let _write = self.inner.gate.enter().await;
        let mut tx = self.inner.pool.begin_with("BEGIN IMMEDIATE").await.db()?;
        let gone = sqlx::query(sql.release_last.clone())
            .bind(id)
            .bind(owner)
            .execute(&mut *tx)
            .await
            .db()?;
        let outcome = if gone.rows_affected() == 1 {
            ReleaseOutcome::Released
        } else {
            match sqlx::query(sql.release_one.clone())
                .bind(id)
                .bind(owner)
                .fetch_optional(&mut *tx)
                .await
                .db()?
            {
                Some(row) => ReleaseOutcome::StillHeld {
                    remaining: u32::try_from(row.try_get::<i64, _>(0).db()?).unwrap_or(u32::MAX),
                },
                None => ReleaseOutcome::NotHeld,
            }
        };
        tx.commit().await.db()?;
        Ok(outcome)
    }

    async fn read_line(&self, key: &LockKey) -> Result<Vec<LineRow>> {
        let rows = sqlx::query(self.inner.sql.holders.clone())
            .bind(key.as_bytes())
            .fetch_all(&self.inner.pool)
            .await
            .db()?;
        rows.iter()
            .map(|row| {
                Ok(LineRow::new(
                    info_from_row(key, row)?,
                    u32::try_from(row.try_get::<i64, _>(5).db()?).unwrap_or(0),
                    u32::try_from(row.try_get::<i64, _>(6).db()?).unwrap_or(0),
                ))
            })
            .collect()
    }

    async fn clear(&self, key: &LockKey) -> Result<bool> {
        let _write = self.inner.gate.enter().await;
        let rows = sqlx::query(self.inner.sql.force.clone())
            .bind(key.as_bytes())
            .fetch_all(&self.inner.pool)
            .await
            .db()?;
        let mut live = false;
        for row in &rows {
            live |= row.try_get::<bool, _>(0).db()?;
        }
        Ok(live)
    }

    async fn list_granted(&self, limit: usize) -> Result<Vec<LockInfo>> {
        let rows = sqlx::query(self.inner.sql.list.clone())
            .bind(i64::try_from(limit).unwrap_or(i64::MAX))
            .fetch_all(&self.inner.pool)
            .await
            .db()?;
        let mut held = Vec::with_capacity(rows.len());
        for row in &rows {
            let raw: Vec<u8> = row.try_get(7).db()?;
            let key = stored_key::<SqliteBackend>(&raw)?;
            held.push(info_from_row(&key, row)?);
        }
        Ok(held)
    }

    fn polling(&self) -> &Polling {
        &self.inner.polling
    }

    fn line_capabilities(&self) -> Capabilities {
        self.inner.capabilities
    }
}
