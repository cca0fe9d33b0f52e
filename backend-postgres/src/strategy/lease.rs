//! The `lease` strategy: one row per key in the lock table, every
//! operation one autocommit statement. The recipe, statement by statement,
//! is in the crate docs ("The lease recipe").
//!
//! * acquire: `INSERT … ON CONFLICT (lock_key) DO UPDATE … WHERE <the row
//!   expired> RETURNING token`; no row back means "held". The token is a
//!   `nextval` of the table's sequence: in the inserted row for a key
//!   without a row, in the `DO UPDATE` — under the row lock — for a
//!   takeover, so it is larger than the token of every grant committed
//!   before it. Grants commit durably, refusals without waiting for the WAL.
//! * rows stay after release (`expire_at` := now, `reentrant_count` := 0),
//!   so later grants of the key are updates under that row's lock; the
//!   reaper deletes rows long expired.
//! * extend and release match the key, the token **and** the owner, and
//!   only a row that has not expired on the server's clock.
//! * a release that frees the key sends `pg_notify(<base>_released, hex
//!   key)` in the same statement: waiters in every process are told when
//!   it commits. Releases commit without waiting for the WAL.

use std::{collections::HashSet, time::Duration};

use fenced_api::{
    batch::ChunkVerdict, Error, FencingToken, Label, Lease, LockKey, LockOptions, Owner,
    ReleaseOutcome, Result,
};
use fenced_sql::{sql, Conns};
use sqlx::{PgPool, Row, SqlStr};
use tokio::time::Instant;

use crate::{
    config::TableName,
    conn,
    error::{PostgresBackend, SqlResultExt},
};

/// `now + $n` on the server's clock, `$n` a TTL in whole microseconds.
///
/// `clock_timestamp()`, not `now()`: `now()` is the start of the
/// transaction, which for a statement that waited for a row lock is earlier
/// than the grant. The server evaluates it after it received the request,
/// and the holder's local deadline counts from the request's send time, so
/// the row never expires before the holder's deadline.
macro_rules! plus_us {
    ($n:literal) => {
        concat!("clock_timestamp() + $", $n, " * interval '1 microsecond'")
    };
}

/// A TTL in whole microseconds, rounded up. TTLs are validated (≤ 24 h),
/// so this cannot overflow.
pub(crate) fn micros(ttl: Duration) -> i64 {
    let us = ttl.as_nanos().div_ceil(1000);
    i64::try_from(us).unwrap_or(i64::MAX / 2)
}

/// The fencing token of a stored value (sequence values start at 1).
pub(crate) fn token(v: i64) -> FencingToken {
    FencingToken::new(u64::try_from(v).unwrap_or(0))
}

/// A token as stored; -1 (never a sequence value) for a token no row can
/// have, so a forged lease matches nothing.
pub(crate) fn stored(token: FencingToken) -> i64 {
    i64::try_from(token.get()).unwrap_or(-1)
}

/// What a release or force-release did: its outcome, and whether the key
/// was freed (so this process's waiters may try at once).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Done<T> {
    pub(crate) outcome: T,
    pub(crate) freed: bool,
}

/// The statements of one table, built once.
#[derive(Debug)]
pub(crate) struct LeaseRows {
    /// Hot connections in front of the statement pool: one statement per
    /// operation, without the pool's ping per return.
    conns: Conns<PostgresBackend>,
    /// The `NOTIFY` channel of this table (bound as a value to `pg_notify`).
    channel: String,
    acquire: SqlStr,
    reenter: SqlStr,
    held_by: SqlStr,
    extend: SqlStr,
    extend_batch: SqlStr,
    release: SqlStr,
    force: SqlStr,
}

impl LeaseRows {
    pub(crate) fn new(pool: PgPool, table: &TableName) -> Self {
        let t = &table.quoted("");
        let seq = table.quoted("_token");
        LeaseRows {
            conns: Conns::new(pool),
            channel: notify_channel(table),
            // A refused attempt still writes: the `DO UPDATE` path locks
            // the row (and `nextval` may log the sequence), so its commit
            // would wait for a WAL flush like a grant's. It changed nothing
            // anyone relies on, so its transaction commits without waiting
            // (`synchronous_commit` off for this transaction, set before
            // the insert); a grant's `RETURNING` sets it back on, so every
            // grant — and the sequence value it hands out — is on disk
            // before the holder hears of it.
            acquire: sql!(
                "INSERT INTO {t} AS l \
                 (lock_key, owner, token, reentrant_count, expire_at, created_at, label) \
                 SELECT $1, $2, nextval('{seq}'), 1, {ttl}, clock_timestamp(), $4 \
                 FROM (SELECT set_config('synchronous_commit', 'off', true)) AS refused \
                 ON CONFLICT (lock_key) DO UPDATE SET owner = EXCLUDED.owner, \
                 token = nextval('{seq}'), reentrant_count = 1, \
                 expire_at = EXCLUDED.expire_at, created_at = EXCLUDED.created_at, \
                 label = EXCLUDED.label \
                 WHERE l.expire_at <= clock_timestamp() \
                 RETURNING token, set_config('synchronous_commit', 'on', true)",
                ttl = plus_us!(3),
            ),
            reenter: sql!(
                "UPDATE {t} SET reentrant_count = reentrant_count + 1, \
                 expire_at = GREATEST(expire_at, {ttl}) \
                 WHERE lock_key = $2 AND owner = $3 AND expire_at > clock_timestamp() \
                 RETURNING token",
                ttl = plus_us!(1),
            ),
            held_by: sql!(
                "SELECT 1 FROM {t} WHERE lock_key = $1 AND owner = $2 \
                 AND expire_at > clock_timestamp()"
            ),
            // Re-entered: never cut the expiry another entry relies on.
            extend: sql!(
                "UPDATE {t} SET expire_at = CASE WHEN reentrant_count > 1 \
                 THEN GREATEST(expire_at, {ttl}) ELSE {ttl} END \
                 WHERE lock_key = $2 AND token = $3 AND owner = $4 \
                 AND expire_at > clock_timestamp()",
                ttl = plus_us!(1),
            ),
            // One row per listed lease, found through the primary key and
            // checked against that lease's token and owner (a chunk mixes
            // owners: a client gives each acquisition its own). Tokens are
            // unique in the table (one sequence): `RETURNING` names the
            // renewed leases exactly.
            extend_batch: sql!(
                "UPDATE {t} AS t SET expire_at = CASE WHEN t.reentrant_count > 1 \
                 THEN GREATEST(t.expire_at, {ttl}) ELSE {ttl} END \
                 FROM unnest($2::bytea[], $3::bigint[], $4::bytea[]) AS b(k, tok, own) \
                 WHERE t.lock_key = b.k AND t.token = b.tok AND t.owner = b.own \
                 AND t.expire_at > clock_timestamp() RETURNING t.token",
                ttl = plus_us!(1),
            ),
            // Every SET expression reads the row as it was: the last entry
            // expires the row and marks it released (count 0); an inner one
            // only counts down. The notification goes out when the
            // statement commits, only for a freed key. The commit does not
            // wait for its WAL flush (`synchronous_commit` off for this
            // transaction only): a release a crash undoes leaves the lock
            // held until its TTL, never shorter, and the next durable
            // commit — the next grant of the key, say — flushes it anyway.
            release: sql!(
                "WITH r AS (UPDATE {t} SET \
                 reentrant_count = CASE WHEN reentrant_count > 1 THEN reentrant_count - 1 ELSE 0 END, \
                 expire_at = CASE WHEN reentrant_count > 1 THEN expire_at ELSE clock_timestamp() END \
                 WHERE lock_key = $1 AND token = $2 AND owner = $3 \
                 AND expire_at > clock_timestamp() \
                 RETURNING lock_key, reentrant_count) \
                 SELECT reentrant_count, \
                 CASE WHEN reentrant_count = 0 THEN pg_notify($4, encode(lock_key, 'hex'))::text END, \
                 set_config('synchronous_commit', 'off', true) \
                 FROM r"
            ),
            force: sql!(
                "WITH r AS (UPDATE {t} SET reentrant_count = 0, expire_at = clock_timestamp() \
                 WHERE lock_key = $1 AND expire_at > clock_timestamp() RETURNING lock_key) \
                 SELECT pg_notify($2, encode(lock_key, 'hex'))::text FROM r"
            ),
        }
    }

    pub(crate) fn pool(&self) -> &PgPool {
        self.conns.pool()
    }

    /// Closes the pool, the hot connections first.
    pub(crate) async fn close(&self) {
        self.conns.close().await;
    }

    /// Runs one statement, on another connection when the pool handed out
    /// a dead one (see [`conn::on_live_connection`]).
    async fn live<T, F, Fut>(&self, op: F) -> std::result::Result<T, sqlx::Error>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = std::result::Result<T, sqlx::Error>>,
    {
        conn::on_live_connection(self.pool().options().get_max_connections(), op).await
    }

    /// Same owner already holds the key: re-enter or refuse.
    async fn same_owner(
        &self,
        key: &LockKey,
        opts: &LockOptions,
        owner: &Owner,
    ) -> Result<Option<i64>> {
        if opts.is_reentrant() {
            let row = self
                .live(|| {
                    self.conns.fetch_optional(
                        sqlx::query(self.reenter.clone())
                            .bind(micros(opts.ttl()))
                            .bind(key.as_bytes())
                            .bind(owner.as_str().as_bytes()),
                    )
                })
                .await
                .db()?;
            return row.map(|r| r.try_get::<i64, _>(0)).transpose().db();
        }
        let held = self
            .live(|| {
                self.conns.fetch_optional(
                    sqlx::query(self.held_by.clone())
                        .bind(key.as_bytes())
                        .bind(owner.as_str().as_bytes()),
                )
            })
            .await
            .db()?;
        if held.is_some() {
            return Err(Error::AlreadyHeld { key: key.clone() });
        }
        Ok(None)
    }

    pub(crate) async fn try_acquire(
        &self,
        key: &LockKey,
        opts: &LockOptions,
    ) -> Result<Option<Lease>> {
        let owner = opts.owner_or_random();
        let ttl = opts.ttl();
        let sent = Instant::now();
        let row = self
            .live(|| {
                self.conns.fetch_optional(
                    sqlx::query(self.acquire.clone())
                        .bind(key.as_bytes())
                        .bind(owner.as_str().as_bytes())
                        .bind(micros(ttl))
                        .bind(opts.label().map(Label::as_str)),
                )
            })
            .await
            .db()?;
        if let Some(row) = row {
            let t: i64 = row.try_get(0).db()?;
            tracing::debug!(key = %key, token = t, "lock acquired");
            return Ok(Some(Lease::new(key.clone(), owner, token(t), ttl, sent)));
        }
        if opts.owner().is_some() {
            let sent = Instant::now();
            if let Some(t) = self.same_owner(key, opts, &owner).await? {
                return Ok(Some(Lease::new(key.clone(), owner, token(t), ttl, sent)));
            }
        }
        Ok(None)
    }

    pub(crate) async fn extend(&self, lease: &Lease, ttl: Duration) -> Result<Lease> {
        let ttl = LockOptions::validate_ttl(ttl)?;
        let sent = Instant::now();
        let done = self
            .live(|| {
                self.conns.execute(
                    sqlx::query(self.extend.clone())
                        .bind(micros(ttl))
                        .bind(lease.key.as_bytes())
                        .bind(stored(lease.token))
                        .bind(lease.owner.as_str().as_bytes()),
                )
            })
            .await
            .db()?;
        if done.rows_affected() == 1 {
            Ok(lease.renewed(ttl, sent))
        } else {
            Err(fenced_sql::extend_refused(lease))
        }
    }

    /// One statement renewing `chunk` (arrays bind as one parameter each);
    /// `RETURNING` says exactly which rows.
    pub(crate) async fn extend_chunk(
        &self,
        chunk: &[&Lease],
        ttl: Duration,
    ) -> Result<ChunkVerdict> {
        let keys: Vec<&[u8]> = chunk.iter().map(|l| l.key.as_bytes()).collect();
        let tokens: Vec<i64> = chunk.iter().map(|l| stored(l.token)).collect();
        let owners: Vec<&[u8]> = chunk.iter().map(|l| l.owner.as_str().as_bytes()).collect();
        let rows = self
            .live(|| {
                self.conns.fetch_all(
                    sqlx::query(self.extend_batch.clone())
                        .bind(micros(ttl))
                        .bind(keys.clone())
                        .bind(tokens.clone())
                        .bind(owners.clone()),
                )
            })
            .await
            .db()?;
        let mut renewed = HashSet::with_capacity(rows.len());
        for row in rows {
            renewed.insert(token(row.try_get::<i64, _>(0).db()?));
        }
        Ok(ChunkVerdict::Exactly(renewed))
    }

    pub(crate) async fn release(&self, lease: &Lease) -> Result<Done<ReleaseOutcome>> {
        let row = self
            .live(|| {
                self.conns.fetch_optional(
                    sqlx::query(self.release.clone())
                        .bind(lease.key.as_bytes())
                        .bind(stored(lease.token))
                        .bind(lease.owner.as_str().as_bytes())
                        .bind(&self.channel),
                )
            })
            .await
            .db()?;
        let Some(row) = row else {
            return Ok(Done {
                outcome: ReleaseOutcome::NotHeld,
                freed: false,
            });
        };
        let left: i32 = row.try_get(0).db()?;
        Ok(if left > 0 {
            Done {
                outcome: ReleaseOutcome::StillHeld {
                    remaining: u32::try_from(left).unwrap_or(u32::MAX),
                },
                freed: false,
            }
        } else {
            Done {
                outcome: ReleaseOutcome::Released,
                freed: true,
            }
        })
    }

    /// Expires the key's row; the outcome is whether it had a live holder.
    pub(crate) async fn force_release(&self, key: &LockKey) -> Result<Done<bool>> {
        let row = self
            .live(|| {
                self.conns.fetch_optional(
                    sqlx::query(self.force.clone())
                        .bind(key.as_bytes())
                        .bind(&self.channel),
                )
            })
            .await
            .db()?;
        let removed = row.is_some();
        if removed {
            tracing::warn!(key = %key, "lock force-released");
        }
        Ok(Done {
            outcome: removed,
            freed: removed,
        })
    }
}

/// The `NOTIFY` channel of a table: `<base>_released` (an identifier of at
/// most 63 bytes: the base name is at most 48).
pub(crate) fn notify_channel(table: &TableName) -> String {
    format!("{}_released", table.as_str())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ttls_are_whole_microseconds_rounded_up() {
        assert_eq!(micros(Duration::from_millis(10)), 10_000);
        assert_eq!(micros(Duration::from_nanos(10_001)), 11);
        assert_eq!(micros(LockOptions::MAX_TTL), 86_400_000_000);
    }

    #[tokio::test]
    async fn statements_name_the_table_its_sequence_and_channel() {
        let table = TableName::new("jobs").unwrap();
        let pool = sqlx::postgres::PgPoolOptions::new()
            .connect_lazy("postgres://localhost/x")
            .unwrap();
        let rows = LeaseRows::new(pool, &table);
        assert_eq!(rows.channel, "jobs_released");
        let acquire = rows.acquire.as_str();
        assert!(
            acquire.starts_with("INSERT INTO \"jobs\" AS l"),
            "{acquire}"
        );
        // The takeover's token is taken in the DO UPDATE, under the row lock.
        let (_, update) = acquire.split_once("DO UPDATE").unwrap();
        assert!(
            update.contains("token = nextval('\"jobs_token\"')"),
            "{acquire}"
        );
        assert!(acquire.contains("clock_timestamp() + $3 * interval '1 microsecond'"));
        // Refusals commit without a WAL flush, grants with one.
        assert!(acquire.contains("(SELECT set_config('synchronous_commit', 'off', true))"));
        assert!(acquire.ends_with("RETURNING token, set_config('synchronous_commit', 'on', true)"));
        assert!(rows
            .release
            .as_str()
            .contains("pg_notify($4, encode(lock_key, 'hex'))"));
        let lease = Lease::new(
            LockKey::new("k").unwrap(),
            Owner::random(),
            FencingToken::new(u64::MAX),
            Duration::from_secs(1),
            Instant::now(),
        );
        assert_eq!(stored(lease.token), -1);
    }
}
