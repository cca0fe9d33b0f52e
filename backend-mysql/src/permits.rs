//! Semaphores and reader-writer locks on MySQL / MariaDB: the line model of
//! [`fenced_api::permits`] on `<table>_permits`, one implementation for
//! every strategy. Portable SQL (MariaDB 10.3+, MySQL 8.0+).
//!
//! * `<table>_permit_keys` has one row per key with the key's last token.
//!   Joining the line is one transaction that locks that row first
//!   (`SELECT … FOR UPDATE`), so arrivals on a key take turns: each reads
//!   every earlier entry (READ COMMITTED, after that row lock: every earlier
//!   arrival has committed),
//!   checks capacity and re-entry, and inserts its entry with the next token
//!   of the key. The counter is a durable InnoDB row committed with the
//!   entry, so a key's tokens only grow, across crashes and restarts.
//! * An entry is granted once the weights of the live entries up to it fit
//!   the capacity; entries before it only ever leave. A waiter first deletes
//!   the earlier entries that have expired — a locking `DELETE` waits for a
//!   renewal of such an entry that is still in flight and judges the row as
//!   that renewal left it, where a plain read would see it expired until the
//!   renewal commits — then counts every earlier entry left, and starts its
//!   lease with an `UPDATE` that requires its own entry to be still live.
//! * Waiters poll with backoff ([`fenced_api::permits::acquire_in_line`]),
//!   renew their place every third of the TTL, and are woken at once by a
//!   release in the same process. MySQL has no notification: between
//!   processes the hand-off waits for the waiter's next poll.
//! * The rows of `<table>_permit_keys` stay after their key's last entry
//!   leaves: they carry the key's last token.

use std::{sync::Arc, time::Duration};

use async_trait::async_trait;
use fenced_api::{
    permits::{self, Arrival, Decision, LineEntry, LineRow, LineStore, Look, Permits},
    wait::Polling,
    Capabilities, FencingToken, Lease, LockInfo, LockKey, LockOptions, Owner, ReleaseOutcome,
    Result,
};
use fenced_sql::{rows::stored_key, sql};
use sqlx::{MySqlPool, Row, SqlStr};
use tokio::time::Instant;

use crate::{
    config::{MySqlConfig, TableName},
    error::{self, MySqlBackend, SqlResultExt},
    list::info_from_row,
};

/// The line steps of the store's semaphores;
/// [`MySqlLock::semaphores`](fenced_api::DistributedLock::semaphores)
/// returns them as [`LineSemaphores`](fenced_api::permits::LineSemaphores).
/// Cheap to clone.
#[derive(Clone)]
pub(crate) struct MySqlPermits {
    inner: Arc<Inner>,
}

struct Inner {
    pool: MySqlPool,
    sql: Sql,
    polling: Polling,
    operation_timeout: Duration,
}

impl std::fmt::Debug for MySqlPermits {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MySqlPermits")
            .field("scope", &self.inner.polling.scope())
            .finish_non_exhaustive()
    }
}

struct Sql {
    key_row: SqlStr,
    lock_key_row: SqlStr,
    next_token: SqlStr,
    purge: SqlStr,
    line: SqlStr,
    reenter: SqlStr,
    insert: SqlStr,
    clear_before: SqlStr,
    look: SqlStr,
    start: SqlStr,
    leave: SqlStr,
    extend: SqlStr,
    release_last: SqlStr,
    release_one: SqlStr,
    count: SqlStr,
    holders: SqlStr,
    force: SqlStr,
    force_delete: SqlStr,
    list: SqlStr,
}

const NOW: &str = "UTC_TIMESTAMP(6)";

impl Sql {
    fn new(table: &TableName) -> Self {
        let t = &table.quoted("_permits");
        let keys = &table.quoted("_permit_keys");
        let info = format!(
            "owner, id, reentrant_count, TIMESTAMPDIFF(MICROSECOND, {NOW}, expire_time), label, \
             capacity, weight"
        );
        let prefix = format!(
            "(SELECT SUM(x.weight) FROM {t} x WHERE x.lock_key = e.lock_key AND x.id <= e.id \
             AND x.expire_time > {NOW})"
        );
        Sql {
            key_row: sql!("INSERT IGNORE INTO {keys} (lock_key, last_token) VALUES (?, 0)"),
            // Arrivals on one key take turns on this row lock.
            lock_key_row: sql!("SELECT last_token FROM {keys} WHERE lock_key = ? FOR UPDATE"),
            next_token: sql!("UPDATE {keys} SET last_token = ? WHERE lock_key = ?"),
            purge: sql!("DELETE FROM {t} WHERE lock_key = ? AND expire_time <= {NOW}"),
            line: sql!(
                "SELECT id, owner, capacity, weight FROM {t} WHERE lock_key = ? ORDER BY id"
            ),
            reenter: sql!(
                "UPDATE {t} SET reentrant_count = reentrant_count + 1, \
                 expire_time = GREATEST(expire_time, {NOW} + INTERVAL ? MICROSECOND) \
                 WHERE lock_key = ? AND id = ?"
            ),
            insert: sql!(
                "INSERT INTO {t} (lock_key, id, owner, capacity, weight, reentrant_count, \
                 expire_time, create_time, label) \
                 VALUES (?, ?, ?, ?, ?, 1, {NOW} + INTERVAL ? MICROSECOND, {NOW}, ?)"
            ),
            // A locking statement: waits for a renewal of an earlier entry
            // still in flight and judges the row as that renewal left it.
            clear_before: sql!(
                "DELETE FROM {t} WHERE lock_key = ? AND id < ? AND expire_time <= {NOW}"
            ),
            // After `clear_before`: every earlier entry left is counted.
            look: sql!(
                "SELECT CAST((SELECT SUM(x.weight) FROM {t} x WHERE x.lock_key = e.lock_key \
                 AND x.id <= e.id) <= e.capacity AS SIGNED) FROM {t} e \
                 WHERE e.lock_key = ? AND e.id = ? AND e.owner = ? AND e.expire_time > {NOW}"
            ),
            start: sql!(
                "UPDATE {t} SET expire_time = {NOW} + INTERVAL ? MICROSECOND \
                 WHERE lock_key = ? AND id = ? AND owner = ? AND expire_time > {NOW}"
            ),
            leave: sql!("DELETE FROM {t} WHERE lock_key = ? AND id = ? AND owner = ?"),
            // Re-entered: never cut the expiry another entry relies on.
            extend: sql!(
                "UPDATE {t} SET expire_time = CASE WHEN reentrant_count > 1 \
                 THEN GREATEST(expire_time, {NOW} + INTERVAL ? MICROSECOND) \
                 ELSE {NOW} + INTERVAL ? MICROSECOND END \
                 WHERE lock_key = ? AND id = ? AND owner = ? AND expire_time > {NOW}"
            ),
            release_last: sql!(
                "DELETE FROM {t} WHERE lock_key = ? AND id = ? AND owner = ? \
                 AND reentrant_count <= 1 AND expire_time > {NOW}"
            ),
            release_one: sql!(
                "UPDATE {t} SET reentrant_count = reentrant_count - 1 \
                 WHERE lock_key = ? AND id = ? AND owner = ? AND reentrant_count > 1 \
                 AND expire_time > {NOW}"
            ),
            count: sql!("SELECT reentrant_count FROM {t} WHERE lock_key = ? AND id = ?"),
            holders: sql!(
                "SELECT {info} FROM {t} WHERE lock_key = ? AND expire_time > {NOW} ORDER BY id"
            ),
            force: sql!("SELECT COUNT(*) FROM {t} WHERE lock_key = ? AND expire_time > {NOW}"),
            force_delete: sql!("DELETE FROM {t} WHERE lock_key = ?"),
            list: sql!(
                "SELECT {info}, lock_key FROM {t} e WHERE e.expire_time > {NOW} \
                 AND {prefix} <= e.capacity ORDER BY lock_key, id LIMIT ?"
            ),
        }
    }
}

/// A TTL in whole microseconds, rounded up (TTLs are validated ≤ 24 h).
fn micros(ttl: Duration) -> u64 {
    u64::try_from(ttl.as_nanos().div_ceil(1000)).unwrap_or(u64::MAX)
}

impl MySqlPermits {
    pub(crate) fn new(config: &MySqlConfig, pool: MySqlPool, mutex_scope: &str) -> Self {
        MySqlPermits {
            inner: Arc::new(Inner {
                pool,
                sql: Sql::new(&config.table),
                polling: Polling::new(format!("{mutex_scope}#permits")),
                operation_timeout: config.operation_timeout,
            }),
        }
    }

    async fn bounded<T>(
        &self,
        what: &str,
        call: impl std::future::Future<Output = Result<T>>,
    ) -> Result<T> {
        error::bounded(what, self.inner.operation_timeout, call).await
    }

    fn lease(key: &LockKey, owner: &Owner, id: u64, ttl: Duration, sent: Instant) -> Lease {
        Lease::new(key.clone(), owner.clone(), FencingToken::new(id), ttl, sent)
    }

    /// Joins the line; a deadlock victim (InnoDB may pick one among the
    /// autocommit statements of other entries of the key) tries again.
    async fn arrive_unbounded(
        &self,
        key: &LockKey,
        permits: Permits,
        opts: &LockOptions,
        owner: &Owner,
        queue: bool,
    ) -> Result<Arrival> {
        let mut tries = 0;
        loop {
            match self.arrive_once(key, permits, opts, owner, queue).await {
                Err(e) if error::number(&e) == Some(error::code::DEADLOCK) && tries < 4 => {
                    tries += 1;
                    tracing::debug!(key = %key, tries, "joining the line was a deadlock victim; again");
                }
                Err(e) => return Err(error::map(e)),
                Ok(Ok(arrival)) => return Ok(arrival),
                Ok(Err(refused)) => return Err(refused),
            }
        }
    }

    /// One try at joining the line: `Ok(Err(_))` for a refusal by the rules
    /// (another capacity, already held), `Err` for the server's errors.
    async fn arrive_once(
        &self,
        key: &LockKey,
        permits: Permits,
        opts: &LockOptions,
        owner: &Owner,
        queue: bool,
    ) -> std::result::Result<Result<Arrival>, sqlx::Error> {
        let sql = &self.inner.sql;
        let k = key.as_bytes();
        let sent = Instant::now();
        sqlx::query(sql.key_row.clone())
            .bind(k)
            .execute(&self.inner.pool)
            .await?;
        let mut conn = self.inner.pool.acquire().await?;
        // READ COMMITTED for this transaction: the purge then locks only
        // the rows it deletes (no gap locks for the other entries' own
        // statements to queue behind); the key row lock orders arrivals.
        sqlx::query("SET TRANSACTION ISOLATION LEVEL READ COMMITTED")
            .execute(&mut *conn)
            .await?;
        let mut tx = sqlx::Connection::begin(&mut *conn).await?;
        let last: u64 = sqlx::query(sql.lock_key_row.clone())
            .bind(k)
            .fetch_one(&mut *tx)
            .await?
            .try_get(0)?;
        sqlx::query(sql.purge.clone())
            .bind(k)
            .execute(&mut *tx)
            .await?;
        let rows = sqlx::query(sql.line.clone())
            .bind(k)
            .fetch_all(&mut *tx)
            .await?;
        let mut ids = Vec::with_capacity(rows.len());
        let mut line = Vec::with_capacity(rows.len());
        for row in &rows {
            ids.push(row.try_get::<u64, _>(0)?);
            let who: Vec<u8> = row.try_get(1)?;
            line.push(LineEntry {
                capacity: row.try_get(2)?,
                weight: row.try_get(3)?,
                mine: who == owner.as_str().as_bytes(),
            });
        }
        let decision = match permits::decide(key, &line, permits, opts, queue) {
            Ok(d) => d,
            Err(refused) => {
                tx.rollback().await?;
                return Ok(Err(refused));
            }
        };
        let fits = match decision {
            Decision::Reenter { at } => {
                sqlx::query(sql.reenter.clone())
                    .bind(micros(opts.ttl()))
                    .bind(k)
                    .bind(ids[at])
                    .execute(&mut *tx)
                    .await?;
                tx.commit().await?;
                let lease = Self::lease(key, owner, ids[at], opts.ttl(), sent);
                return Ok(Ok(Arrival::Granted(lease)));
            }
            Decision::Busy => {
                tx.rollback().await?;
                return Ok(Ok(Arrival::Busy));
            }
            Decision::Grant => true,
            Decision::Queue => false,
        };
        let id = last + 1;
        sqlx::query(sql.next_token.clone())
            .bind(id)
            .bind(k)
            .execute(&mut *tx)
            .await?;
        sqlx::query(sql.insert.clone())
            .bind(k)
            .bind(id)
            .bind(owner.as_str().as_bytes())
            .bind(permits.capacity())
            .bind(permits.weight())
            .bind(micros(opts.ttl()))
            .bind(opts.label().map(|l| l.as_str().as_bytes()))
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(Ok(if fits {
            Arrival::Granted(Self::lease(key, owner, id, opts.ttl(), sent))
        } else {
            Arrival::Queued(FencingToken::new(id))
        }))
    }

    async fn look_unbounded(
        &self,
        key: &LockKey,
        opts: &LockOptions,
        owner: &Owner,
        token: FencingToken,
        renew: bool,
    ) -> Result<Look> {
        let (sql, pool) = (&self.inner.sql, &self.inner.pool);
        let (k, id, who) = (key.as_bytes(), token.get(), owner.as_str().as_bytes());
        sqlx::query(sql.clear_before.clone())
            .bind(k)
            .bind(id)
            .execute(pool)
            .await
            .db()?;
        let row = sqlx::query(sql.look.clone())
            .bind(k)
            .bind(id)
            .bind(who)
            .fetch_optional(pool)
            .await
            .db()?;
        let Some(row) = row else {
            return Ok(Look::Gone);
        };
        let granted = row.try_get::<Option<i64>, _>(0).db()?.unwrap_or(0) != 0;
        if !granted && !renew {
            return Ok(Look::Waiting);
        }
        let sent = Instant::now();
        let done = sqlx::query(sql.start.clone())
            .bind(micros(opts.ttl()))
            .bind(k)
            .bind(id)
            .bind(who)
            .execute(pool)
            .await
            .db()?;
        Ok(match (done.rows_affected(), granted) {
            (0, _) => Look::Gone,
            (_, true) => Look::Granted(Self::lease(key, owner, id, opts.ttl(), sent)),
            (_, false) => Look::Waiting,
        })
    }

    async fn release_unbounded(&self, lease: &Lease) -> Result<ReleaseOutcome> {
        let (sql, pool) = (&self.inner.sql, &self.inner.pool);
        let (k, id, who) = (
            lease.key.as_bytes(),
            lease.token.get(),
            lease.owner.as_str().as_bytes(),
        );
        let gone = sqlx::query(sql.release_last.clone())
            .bind(k)
            .bind(id)
            .bind(who)
            .execute(pool)
            .await
            .db()?;
        if gone.rows_affected() > 0 {
            return Ok(ReleaseOutcome::Released);
        }
        let left = sqlx::query(sql.release_one.clone())
            .bind(k)
            .bind(id)
            .bind(who)
            .execute(pool)
            .await
            .db()?;
        if left.rows_affected() == 0 {
            return Ok(ReleaseOutcome::NotHeld);
        }
        let remaining: u32 = sqlx::query(sql.count.clone())
            .bind(k)
            .bind(id)
            .fetch_optional(pool)
            .await
            .db()?
            .map(|r| r.try_get(0))
            .transpose()
            .db()?
            .unwrap_or(1);
        Ok(ReleaseOutcome::StillHeld { remaining })
    }
}

#[async_trait]
impl LineStore for MySqlPermits {
    async fn arrive(
        &self,
        key: &LockKey,
        permits: Permits,
        opts: &LockOptions,
        owner: &Owner,
        queue: bool,
    ) -> Result<Arrival> {
        self.bounded(
            "acquire",
            self.arrive_unbounded(key, permits, opts, owner, queue),
        )
        .await
    }

    async fn look(
        &self,
        key: &LockKey,
        opts: &LockOptions,
        owner: &Owner,
        token: FencingToken,
        renew: bool,
    ) -> Result<Look> {
        self.bounded(
            "acquire",
            self.look_unbounded(key, opts, owner, token, renew),
        )
        .await
    }

    async fn leave(&self, key: &LockKey, owner: &Owner, token: FencingToken) -> Result<()> {
        let done = self
            .bounded("leave the line", async {
                sqlx::query(self.inner.sql.leave.clone())
                    .bind(key.as_bytes())
                    .bind(token.get())
                    .bind(owner.as_str().as_bytes())
                    .execute(&self.inner.pool)
                    .await
                    .db()
            })
            .await?;
        if done.rows_affected() > 0 {
            // Those behind it may be granted now.
            self.inner.polling.freed(key);
        }
        Ok(())
    }

    async fn renew(&self, lease: &Lease, ttl: Duration) -> Result<bool> {
        let done = self
            .bounded("extend", async {
                sqlx::query(self.inner.sql.extend.clone())
                    .bind(micros(ttl))
                    .bind(micros(ttl))
                    .bind(lease.key.as_bytes())
                    .bind(lease.token.get())
                    .bind(lease.owner.as_str().as_bytes())
                    .execute(&self.inner.pool)
                    .await
                    .db()
            })
            .await?;
        Ok(done.rows_affected() > 0)
    }

    async fn give_back(&self, lease: &Lease) -> Result<ReleaseOutcome> {
        self.bounded("release", self.release_unbounded(lease)).await
    }

    async fn read_line(&self, key: &LockKey) -> Result<Vec<LineRow>> {
        let rows = self
            .bounded("holders", async {
                sqlx::query(self.inner.sql.holders.clone())
                    .bind(key.as_bytes())
                    .fetch_all(&self.inner.pool)
                    .await
                    .db()
            })
            .await?;
        rows.iter()
            .map(|row| {
                Ok(LineRow::new(
                    info_from_row(key, row)?,
                    row.try_get(5).db()?,
                    row.try_get(6).db()?,
                ))
            })
            .collect()
    }

    async fn clear(&self, key: &LockKey) -> Result<bool> {
        self.bounded("force_release", async {
            let mut tx = self.inner.pool.begin().await.db()?;
            let live: i64 = sqlx::query(self.inner.sql.force.clone())
                .bind(key.as_bytes())
                .fetch_one(&mut *tx)
                .await
                .db()?
                .try_get(0)
                .db()?;
            sqlx::query(self.inner.sql.force_delete.clone())
                .bind(key.as_bytes())
                .execute(&mut *tx)
                .await
                .db()?;
            tx.commit().await.db()?;
            Ok(live > 0)
        })
        .await
    }

    async fn list_granted(&self, limit: usize) -> Result<Vec<LockInfo>> {
        let rows = self
            .bounded("list", async {
                sqlx::query(self.inner.sql.list.clone())
                    .bind(u64::try_from(limit).unwrap_or(u64::MAX))
                    .fetch_all(&self.inner.pool)
                    .await
                    .db()
            })
            .await?;
        let mut held = Vec::with_capacity(rows.len());
        for row in &rows {
            let raw: Vec<u8> = row.try_get(7).db()?;
            let key = stored_key::<MySqlBackend>(&raw)?;
            held.push(info_from_row(&key, row)?);
        }
        Ok(held)
    }

    fn polling(&self) -> &Polling {
        &self.inner.polling
    }

    fn line_capabilities(&self) -> Capabilities {
        Capabilities::none()
            .backend(error::BACKEND)
            .durable(true)
            .fencing(true)
            .reentrant(true)
            // Granted strictly in order of joining the line.
            .fifo(true)
    }
}
