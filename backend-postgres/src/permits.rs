//! Semaphores and reader-writer locks on PostgreSQL: the line model of
//! [`fenced_api::permits`] on `<table>_permits`, for either strategy.
//!
//! * One row per entry of a key's line, holder or waiter. Its id is a
//!   value of the table's token sequence (`<table>_token`, durable across
//!   crashes and restarts): its place in line and its fencing token.
//! * Joining the line is one transaction that first locks the key's row in
//!   `<table>_permit_keys` (`INSERT … ON CONFLICT DO UPDATE`), so the
//!   arrivals on a key are serialized: each reads every earlier entry
//!   (committed before it could take that row lock, and seen by its next
//!   statement under READ COMMITTED), checks capacity and re-entry, and
//!   inserts with the next sequence value. Ids of a key therefore follow the
//!   order of arrival, and every id below an entry's belongs to an entry
//!   that was committed before it.
//! * An entry is granted once the weights of the live entries up to it fit
//!   the capacity; entries before it only ever leave. A waiter first deletes
//!   the earlier entries that have expired — a `DELETE` waits for a renewal
//!   of such an entry that is still in flight and judges the row as that
//!   renewal left it, where a plain read would see it expired until the
//!   renewal commits — then counts every earlier entry left, and starts its
//!   lease with an `UPDATE` that requires its own entry to be still live.
//! * Waiting: [`fenced_api::permits::acquire_in_line`], woken across
//!   processes by `NOTIFY <table>_permits` (sent by every release, leave and
//!   force-release, payload the key in hex) through the same listener
//!   machinery as `lease` (`wait.rs`), with the recheck interval as the
//!   fallback poll.
//! * The rows of `<table>_permit_keys` stay after their key's last entry
//!   leaves (one small row per key ever used).

use std::{sync::Arc, time::Duration};

use async_trait::async_trait;
use fenced_api::{
    permits::{self, Arrival, Decision, LineEntry, LineRow, LineStore, Look, Permits},
    wait::{Backoff, Polling},
    Capabilities, FencingToken, Label, Lease, LockInfo, LockKey, LockOptions, Owner,
    ReleaseOutcome, Result,
};
use fenced_sql::{rows::stored_key, sql};
use sqlx::{PgPool, Row, SqlStr};
use tokio::time::Instant;

use crate::{
    config::{PostgresConfig, TableName},
    conn,
    error::{self, PostgresBackend, SqlResultExt},
    list::info_from_row,
    strategy::lease::{micros, stored, token},
    wait::Waiting,
};

/// `now + $n` on the server's clock, `$n` a TTL in whole microseconds.
macro_rules! plus_us {
    ($n:literal) => {
        concat!("clock_timestamp() + $", $n, " * interval '1 microsecond'")
    };
}

/// The remaining TTL of a row in whole microseconds.
const REMAINING_US: &str =
    "(EXTRACT(EPOCH FROM (expire_at - clock_timestamp())) * 1000000)::bigint";

/// The line steps of the store's semaphores;
/// [`PostgresLock::semaphores`](fenced_api::DistributedLock::semaphores)
/// returns them as [`LineSemaphores`](fenced_api::permits::LineSemaphores).
/// Cheap to clone.
#[derive(Clone)]
pub(crate) struct PostgresPermits {
    inner: Arc<Inner>,
}

struct Inner {
    pool: PgPool,
    sql: Sql,
    channel: String,
    waiting: Waiting,
    operation_timeout: Duration,
}

impl std::fmt::Debug for PostgresPermits {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PostgresPermits")
            .field("waiting", &self.inner.waiting)
            .finish_non_exhaustive()
    }
}

struct Sql {
    key_row: SqlStr,
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
    holders: SqlStr,
    force: SqlStr,
    list: SqlStr,
}

/// The columns `info_from_row` reads (0–4), then capacity and weight (5, 6).
fn info_columns() -> String {
    format!("owner, id, reentrant_count, {REMAINING_US}, label, capacity, weight")
}

impl Sql {
    fn new(table: &TableName) -> Self {
        let t = &table.quoted("_permits");
        let keys = &table.quoted("_permit_keys");
        let seq = table.quoted("_token");
        let info = info_columns();
        let notify = "pg_notify($4, encode(lock_key, 'hex'))::text";
        Sql {
            // Locks the key's row: arrivals on one key take turns.
            key_row: sql!(
                "INSERT INTO {keys} (lock_key) VALUES ($1) \
                 ON CONFLICT (lock_key) DO UPDATE SET lock_key = EXCLUDED.lock_key"
            ),
            purge: sql!("DELETE FROM {t} WHERE lock_key = $1 AND expire_at <= clock_timestamp()"),
            line: sql!(
                "SELECT id, owner, capacity, weight FROM {t} WHERE lock_key = $1 ORDER BY id"
            ),
            reenter: sql!(
                "UPDATE {t} SET reentrant_count = reentrant_count + 1, \
                 expire_at = GREATEST(expire_at, {ttl}) WHERE id = $2",
                ttl = plus_us!(1)
            ),
            insert: sql!(
                "INSERT INTO {t} (id, lock_key, owner, capacity, weight, reentrant_count, \
                 expire_at, created_at, label) \
                 VALUES (nextval('{seq}'), $1, $2, $3, $4, 1, {ttl}, clock_timestamp(), $6) \
                 RETURNING id",
                ttl = plus_us!(5)
            ),
            // Waits for a renewal of an earlier entry still in flight and
            // judges its row as that renewal left it (READ COMMITTED).
            clear_before: sql!(
                "DELETE FROM {t} WHERE lock_key = $1 AND id < $2 AND expire_at <= clock_timestamp()"
            ),
            // After `clear_before`: every earlier entry left is counted.
            look: sql!(
                "SELECT (SELECT SUM(x.weight) FROM {t} x WHERE x.lock_key = e.lock_key \
                 AND x.id <= e.id) <= e.capacity FROM {t} e \
                 WHERE e.id = $1 AND e.owner = $2 AND e.expire_at > clock_timestamp()"
            ),
            start: sql!(
                "UPDATE {t} SET expire_at = {ttl} \
                 WHERE id = $2 AND owner = $3 AND expire_at > clock_timestamp()",
                ttl = plus_us!(1)
            ),
            leave: sql!(
                "WITH d AS (DELETE FROM {t} WHERE id = $1 AND owner = $2 RETURNING lock_key) \
                 SELECT pg_notify($3, encode(lock_key, 'hex'))::text FROM d"
            ),
            // Re-entered: never cut the expiry another entry relies on.
            extend: sql!(
                "UPDATE {t} SET expire_at = CASE WHEN reentrant_count > 1 \
                 THEN GREATEST(expire_at, {ttl}) ELSE {ttl} END \
                 WHERE id = $2 AND owner = $3 AND expire_at > clock_timestamp()",
                ttl = plus_us!(1)
            ),
            release_last: sql!(
                "WITH d AS (DELETE FROM {t} WHERE id = $1 AND owner = $2 AND reentrant_count <= 1 \
                 AND expire_at > clock_timestamp() RETURNING lock_key) \
                 SELECT {notify} FROM d",
                notify = notify.replace("$4", "$3")
            ),
            release_one: sql!(
                "UPDATE {t} SET reentrant_count = reentrant_count - 1 \
                 WHERE id = $1 AND owner = $2 AND reentrant_count > 1 \
                 AND expire_at > clock_timestamp() RETURNING reentrant_count"
            ),
            holders: sql!(
                "SELECT {info} FROM {t} WHERE lock_key = $1 AND expire_at > clock_timestamp() \
                 ORDER BY id"
            ),
            force: sql!(
                "WITH d AS (DELETE FROM {t} WHERE lock_key = $1 \
                 RETURNING expire_at > clock_timestamp() AS live) \
                 SELECT COALESCE((SELECT bool_or(live) FROM d), false), \
                 pg_notify($2, encode($1, 'hex'))::text"
            ),
            list: sql!(
                "SELECT {info}, lock_key FROM (SELECT *, SUM(weight) OVER \
                 (PARTITION BY lock_key ORDER BY id) AS upto FROM {t} \
                 WHERE expire_at > clock_timestamp()) l \
                 WHERE upto <= capacity ORDER BY lock_key, id LIMIT $1"
            ),
        }
    }
}

impl PostgresPermits {
    pub(crate) fn new(config: &PostgresConfig, pool: PgPool) -> Self {
        let channel = format!("{}_permits", config.table.as_str());
        PostgresPermits {
            inner: Arc::new(Inner {
                pool,
                sql: Sql::new(&config.table),
                waiting: Waiting::for_permits(config, channel.clone()),
                channel,
                operation_timeout: config.operation_timeout,
            }),
        }
    }

    pub(crate) fn stop(&self) {
        self.inner.waiting.stop();
    }

    async fn bounded<T>(
        &self,
        what: &str,
        call: impl std::future::Future<Output = Result<T>>,
    ) -> Result<T> {
        error::bounded(what, self.inner.operation_timeout, call).await
    }

    fn lease(key: &LockKey, owner: &Owner, id: i64, ttl: Duration, sent: Instant) -> Lease {
        Lease::new(key.clone(), owner.clone(), token(id), ttl, sent)
    }

    async fn arrive_unbounded(
        &self,
        key: &LockKey,
        permits: Permits,
        opts: &LockOptions,
        owner: &Owner,
        queue: bool,
    ) -> Result<Arrival> {
        let (sql, pool) = (&self.inner.sql, &self.inner.pool);
        let sent = Instant::now();
        let max = pool.options().get_max_connections();
        // READ COMMITTED whatever the server's default: after the key row
        // lock, each statement sees every earlier arrival (committed).
        let mut tx = conn::on_live_connection(max, || {
            pool.begin_with("BEGIN ISOLATION LEVEL READ COMMITTED")
        })
        .await
        .db()?;
        sqlx::query(sql.key_row.clone())
            .bind(key.as_bytes())
            .execute(&mut *tx)
            .await
            .db()?;
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
                capacity: u32::try_from(row.try_get::<i32, _>(2).db()?).unwrap_or(0),
                weight: u32::try_from(row.try_get::<i32, _>(3).db()?).unwrap_or(u32::MAX),
                mine: who == owner.as_str().as_bytes(),
            });
        }
        let fits = match permits::decide(key, &line, permits, opts, queue)? {
            Decision::Reenter { at } => {
                sqlx::query(sql.reenter.clone())
                    .bind(micros(opts.ttl()))
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
            .bind(i32::try_from(permits.capacity()).unwrap_or(i32::MAX))
            .bind(i32::try_from(permits.weight()).unwrap_or(i32::MAX))
            .bind(micros(opts.ttl()))
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

    async fn look_unbounded(
        &self,
        key: &LockKey,
        opts: &LockOptions,
        owner: &Owner,
        token: FencingToken,
        renew: bool,
    ) -> Result<Look> {
        let (sql, pool) = (&self.inner.sql, &self.inner.pool);
        let id = stored(token);
        let owner_bytes = owner.as_str().as_bytes();
        sqlx::query(sql.clear_before.clone())
            .bind(key.as_bytes())
            .bind(id)
            .execute(pool)
            .await
            .db()?;
        let row = sqlx::query(sql.look.clone())
            .bind(id)
            .bind(owner_bytes)
            .fetch_optional(pool)
            .await
            .db()?;
        let Some(row) = row else {
            return Ok(Look::Gone);
        };
        let granted: bool = row.try_get::<Option<bool>, _>(0).db()?.unwrap_or(false);
        if !granted && !renew {
            return Ok(Look::Waiting);
        }
        let sent = Instant::now();
        let done = sqlx::query(sql.start.clone())
            .bind(micros(opts.ttl()))
            .bind(id)
            .bind(owner_bytes)
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
        let (id, owner) = (stored(lease.token), lease.owner.as_str().as_bytes());
        let gone = sqlx::query(sql.release_last.clone())
            .bind(id)
            .bind(owner)
            .bind(&self.inner.channel)
            .fetch_optional(pool)
            .await
            .db()?;
        if gone.is_some() {
            return Ok(ReleaseOutcome::Released);
        }
        let left = sqlx::query(sql.release_one.clone())
            .bind(id)
            .bind(owner)
            .fetch_optional(pool)
            .await
            .db()?;
        Ok(match left {
            Some(row) => ReleaseOutcome::StillHeld {
                remaining: u32::try_from(row.try_get::<i32, _>(0).db()?).unwrap_or(u32::MAX),
            },
            None => ReleaseOutcome::NotHeld,
        })
    }
}

#[async_trait]
impl LineStore for PostgresPermits {
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

    async fn leave(&self, _key: &LockKey, owner: &Owner, token: FencingToken) -> Result<()> {
        self.bounded("leave the line", async {
            sqlx::query(self.inner.sql.leave.clone())
                .bind(stored(token))
                .bind(owner.as_str().as_bytes())
                .bind(&self.inner.channel)
                .fetch_optional(&self.inner.pool)
                .await
                .db()
                .map(|_| ())
        })
        .await
    }

    async fn renew(&self, lease: &Lease, ttl: Duration) -> Result<bool> {
        let done = self
            .bounded("extend", async {
                sqlx::query(self.inner.sql.extend.clone())
                    .bind(micros(ttl))
                    .bind(stored(lease.token))
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
                    u32::try_from(row.try_get::<i32, _>(5).db()?).unwrap_or(0),
                    u32::try_from(row.try_get::<i32, _>(6).db()?).unwrap_or(0),
                ))
            })
            .collect()
    }

    async fn clear(&self, key: &LockKey) -> Result<bool> {
        let row = self
            .bounded("force_release", async {
                sqlx::query(self.inner.sql.force.clone())
                    .bind(key.as_bytes())
                    .bind(&self.inner.channel)
                    .fetch_one(&self.inner.pool)
                    .await
                    .db()
            })
            .await?;
        row.try_get(0).db()
    }

    async fn list_granted(&self, limit: usize) -> Result<Vec<LockInfo>> {
        let rows = self
            .bounded("list", async {
                sqlx::query(self.inner.sql.list.clone())
                    .bind(i64::try_from(limit).unwrap_or(i64::MAX))
                    .fetch_all(&self.inner.pool)
                    .await
                    .db()
            })
            .await?;
        let mut held = Vec::with_capacity(rows.len());
        for row in &rows {
            let raw: Vec<u8> = row.try_get(7).db()?;
            let key = stored_key::<PostgresBackend>(&raw)?;
            held.push(info_from_row(&key, row)?);
        }
        Ok(held)
    }

    fn polling(&self) -> &Polling {
        self.inner.waiting.polling()
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

    /// Quick first looks, then at most the recheck interval: `NOTIFY`
    /// wakes waiters across processes, the looks are the fallback.
    fn backoff(&self) -> Backoff {
        Backoff::new(
            Duration::from_millis(5),
            self.inner.waiting.polling().backoff().max,
        )
    }

    /// Listening before joining the line: a release after the join is heard.
    async fn waiting_for<'a>(&'a self, key: &LockKey, opts: &LockOptions) -> Box<dyn Send + 'a> {
        Box::new(self.inner.waiting.listen_for(key, opts).await)
    }
}
