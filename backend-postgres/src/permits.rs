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
//!   the capacity; entries before it only ever leave, so a waiter checks
//!   with a plain read, then starts its lease with an `UPDATE` that
//!   requires its entry to be still live.
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
    permits::{
        self, Arrival, Decision, KeyHolders, LineEntry, LineStore, Look, PermitHolder, Permits,
        SemaphoreStore,
    },
    wait::Backoff,
    Capabilities, DistributedLock, Error, FencingToken, Label, Lease, LockInfo, LockKey,
    LockOptions, Owner, ReleaseOutcome, Result, WaitPolicy,
};
use fenced_sql::{rows::stored_key, sql};
use sqlx::{postgres::PgRow, PgPool, Row, SqlStr};
use tokio::time::Instant;

use crate::{
    config::{PostgresConfig, TableName},
    conn,
    error::{self, PostgresBackend, SqlResultExt},
    list::info_from_row,
    strategy::lease::{micros, token},
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

/// The store's semaphores: what
/// [`PostgresLock::semaphores`](fenced_api::DistributedLock::semaphores)
/// returns. Cheap to clone.
#[derive(Clone)]
pub struct PostgresPermits {
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
        let prefix = format!(
            "(SELECT SUM(x.weight) FROM {t} x WHERE x.lock_key = e.lock_key AND x.id <= e.id \
             AND x.expire_at > clock_timestamp())"
        );
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
            look: sql!(
                "SELECT {prefix} <= e.capacity FROM {t} e \
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

fn row_id(token: FencingToken) -> i64 {
    // -1 is never a sequence value: a forged token matches nothing.
    i64::try_from(token.get()).unwrap_or(-1)
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
        let mut tx = conn::on_live_connection(max, || pool.begin()).await.db()?;
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
        let id = row_id(token);
        let owner_bytes = owner.as_str().as_bytes();
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
        let (id, owner) = (row_id(lease.token), lease.owner.as_str().as_bytes());
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
                .bind(row_id(token))
                .bind(owner.as_str().as_bytes())
                .bind(&self.inner.channel)
                .fetch_optional(&self.inner.pool)
                .await
                .db()
                .map(|_| ())
        })
        .await
    }
}

#[async_trait]
impl SemaphoreStore for PostgresPermits {
    async fn try_acquire_permits(
        &self,
        key: &LockKey,
        permits: Permits,
        opts: &LockOptions,
    ) -> Result<Option<Lease>> {
        permits::try_acquire_in_line(self, key, permits, opts).await
    }

    async fn acquire_permits(
        &self,
        key: &LockKey,
        permits: Permits,
        opts: &LockOptions,
    ) -> Result<Lease> {
        if opts.wait() == WaitPolicy::NoWait {
            return match self.try_acquire_permits(key, permits, opts).await? {
                Some(lease) => Ok(lease),
                None => Err(Error::Timeout {
                    key: key.clone(),
                    waited: Duration::ZERO,
                }),
            };
        }
        // Listening before joining the line: a release after the join is heard.
        let _listening = self.inner.waiting.listen_for(key, opts).await;
        let scope = self.inner.waiting.polling().scope();
        let recheck = self.inner.waiting.polling().backoff().max;
        let backoff = Backoff::new(Duration::from_millis(5), recheck);
        permits::acquire_in_line(self, scope, key, permits, opts, backoff).await
    }

    async fn holders(&self, key: &LockKey) -> Result<Option<KeyHolders>> {
        let rows = self
            .bounded("holders", async {
                sqlx::query(self.inner.sql.holders.clone())
                    .bind(key.as_bytes())
                    .fetch_all(&self.inner.pool)
                    .await
                    .db()
            })
            .await?;
        holders_from_rows(key, &rows)
    }
}

/// The line of `key` (live entries in id order) as holders and waiters.
fn holders_from_rows(key: &LockKey, rows: &[PgRow]) -> Result<Option<KeyHolders>> {
    let Some(first) = rows.first() else {
        return Ok(None);
    };
    let capacity = u32::try_from(first.try_get::<i32, _>(5).db()?).unwrap_or(u32::MAX);
    let mut weights = Vec::with_capacity(rows.len());
    for row in rows {
        weights.push(u32::try_from(row.try_get::<i32, _>(6).db()?).unwrap_or(u32::MAX));
    }
    let granted = permits::granted_count(weights, capacity);
    let holders = rows[..granted]
        .iter()
        .map(|row| holder_from_row(key, row))
        .collect::<Result<Vec<_>>>()?;
    Ok(Some(KeyHolders::new(
        key.clone(),
        capacity,
        holders,
        rows.len() - granted,
    )))
}

fn holder_from_row(key: &LockKey, row: &PgRow) -> Result<PermitHolder> {
    let capacity: i32 = row.try_get(5).db()?;
    let weight: i32 = row.try_get(6).db()?;
    let permits = Permits::from_parts(
        u32::try_from(capacity).unwrap_or(0),
        u32::try_from(weight).unwrap_or(0),
    )
    .map_err(|_| {
        Error::backend(
            error::BACKEND,
            false,
            format!("an entry of `{key}` has capacity {capacity} and weight {weight}; was the table edited by hand?"),
        )
    })?;
    Ok(PermitHolder::new(info_from_row(key, row)?, permits))
}

#[async_trait]
impl DistributedLock for PostgresPermits {
    async fn try_acquire(&self, key: &LockKey, opts: &LockOptions) -> Result<Option<Lease>> {
        self.try_acquire_permits(key, Permits::semaphore(1)?, opts)
            .await
    }

    async fn acquire(&self, key: &LockKey, opts: &LockOptions) -> Result<Lease> {
        self.acquire_permits(key, Permits::semaphore(1)?, opts)
            .await
    }

    async fn extend(&self, lease: &Lease, ttl: Duration) -> Result<Lease> {
        let ttl = LockOptions::validate_ttl(ttl)?;
        let sent = Instant::now();
        let done = self
            .bounded("extend", async {
                sqlx::query(self.inner.sql.extend.clone())
                    .bind(micros(ttl))
                    .bind(row_id(lease.token))
                    .bind(lease.owner.as_str().as_bytes())
                    .execute(&self.inner.pool)
                    .await
                    .db()
            })
            .await?;
        if done.rows_affected() == 0 {
            return Err(Error::lease_lost(
                &lease.key,
                lease.token,
                "the permit expired or was force-released",
            ));
        }
        Ok(lease.renewed(ttl, sent))
    }

    async fn release(&self, lease: &Lease) -> Result<ReleaseOutcome> {
        let outcome = self
            .bounded("release", self.release_unbounded(lease))
            .await?;
        Ok(self.inner.waiting.polling().released(&lease.key, outcome))
    }

    async fn inspect(&self, key: &LockKey) -> Result<Option<LockInfo>> {
        Ok(self
            .holders(key)
            .await?
            .and_then(|k| k.holders.into_iter().next())
            .map(|h| h.info))
    }

    async fn force_release(&self, key: &LockKey) -> Result<bool> {
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
        let live: bool = row.try_get(0).db()?;
        if live {
            tracing::warn!(key = %key, "semaphore force-released");
        }
        Ok(self.inner.waiting.polling().force_released(key, live))
    }

    async fn list(&self, limit: usize) -> Result<Vec<LockInfo>> {
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

    fn capabilities(&self) -> Capabilities {
        Capabilities::none()
            .backend(error::BACKEND)
            .durable(true)
            .fencing(true)
            .reentrant(true)
            // Granted strictly in order of joining the line.
            .fifo(true)
    }

    /// Itself: a semaphore store's mutex is its semaphore of one permit.
    fn semaphores(&self) -> Option<Arc<dyn SemaphoreStore>> {
        Some(Arc::new(self.clone()))
    }
}
