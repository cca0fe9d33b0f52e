//! `unique_key`: INSERT a row per held key, DELETE it on release.
//!
//! * acquire = one autocommit `INSERT … ON DUPLICATE KEY UPDATE`: inserted
//!   means acquired; on a duplicate the update clause changes nothing of a
//!   live row and only reports, in the same round trip, whether the existing
//!   row has expired (it bumps the dead row's `reentrant_count`, so the
//!   affected-row count says 2). A refused try is therefore one statement.
//!   Only an expired row (crashed holder) costs more: it is deleted — only
//!   if still expired — and the INSERT retried once, so a takeover needs no
//!   reaper.
//! * the row's `AUTO_INCREMENT` id is the fencing token: it only grows, and
//!   since MariaDB 10.2.4 / MySQL 8.0 it survives restarts. But an id is
//!   allocated when the INSERT *starts*: an INSERT that then waits for a row
//!   lock (another holder's DELETE in flight, or a refused contender's
//!   duplicate check) can be granted its old id after a later-allocated,
//!   higher id was granted and released — a token going backwards, and the
//!   release of that lower token then succeeds. Measured here with eight
//!   clients on one key (`tests/regressions.rs`
//!   `tokens_never_go_backwards_under_contention`): `INSERT … VALUES … ON
//!   DUPLICATE KEY UPDATE` about 6 inversions per 15 s. Written as `INSERT …
//!   SELECT … FROM DUAL`, the INSERT is a "bulk insert", for which InnoDB
//!   holds the table's AUTO-INC lock until the statement ends
//!   (`innodb_autoinc_lock_mode` 0 or 1; 1 is MariaDB's default): no other id
//!   is allocated while it waits, so ids are granted in allocation order;
//!   none of those runs showed an inversion. With `innodb_autoinc_lock_mode =
//!   2` (MySQL 8's default) InnoDB takes no such lock and inversions remain
//!   (measured: 2 per 15 s on MariaDB started with mode 2), so
//!   [`MySqlLock::connect`](crate::MySqlLock::connect) refuses `unique_key`
//!   there with [`Error::Config`]: set the mode to 1 (a startup option), or
//!   use `optimistic` or `row_lock`, whose tokens are taken under the row
//!   lock and never depend on it.
//! * the verdict of a grant comes from the statement's own OK packet, never
//!   from the connection's earlier state: the acquiring statement evaluates
//!   `LAST_INSERT_ID(0)` on every path that does not insert, so its insert
//!   id is either the id it just inserted or 0 — also on a connection whose
//!   previous statement left another value in `LAST_INSERT_ID()` (tested in
//!   `tests/regressions.rs`, `verdicts_never_come_from_a_previous_statement`).
//!   The affected-row count (sqlx sets `CLIENT_FOUND_ROWS`: found, not
//!   changed rows) only tells a live holder (1) from an expired one (2).
//!   Triggers on fenced's tables are not supported: a trigger that inserts a
//!   row changes the OK packet's insert id.
//! * release / extend match `id` **and** `owner` (and, for extend, that the
//!   row has not expired on the server's clock).
//! * the holder's label is a column of the row, written by the granting
//!   INSERT (NULL without one); a re-entry keeps the first entry's label. An
//!   expired row is deleted before the key is granted again, so a label never
//!   outlives its grant.

use std::time::Duration;

use fenced_api::{wait::Polling, Error, Lease, LockKey, LockOptions, Owner, Result};
use sqlx::{MySqlPool, Row, SqlStr};
use tokio::time::Instant;

use super::rows::{granted, Polled, Query, RowStrategy, Rows, Statements, Table, LIVE};
use super::{label_param, micros};
use crate::error::{self, SqlResultExt};
use crate::sql::sql;

/// The key under which reapers of one table exclude each other (reserved:
/// do not use `fenced:reaper` as an application key) — using the
/// table's own lock, so no extra mechanism (and no `GET_LOCK`, which Galera lacks).
pub(crate) const REAPER_KEY: &str = "fenced:reaper";

/// What one bounded reaper pass did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Pass {
    pub(crate) reaped: u64,
    /// False when the pass stopped at its time bound with rows possibly left.
    pub(crate) finished: bool,
}

/// Refuses a server that allocates AUTO_INCREMENT ids without the AUTO-INC
/// lock (`innodb_autoinc_lock_mode = 2`): there a waiting INSERT can be
/// granted an id lower than one already granted (see the module docs), and
/// fencing tokens would go backwards.
pub(crate) async fn check_autoinc_mode(pool: &MySqlPool, server: &str) -> Result<()> {
    let mode: i64 = sqlx::query("SELECT @@innodb_autoinc_lock_mode")
        .fetch_one(pool)
        .await
        .db()?
        .try_get(0)
        .db()?;
    if mode == 2 {
        tracing::error!(
            server,
            "innodb_autoinc_lock_mode = 2: refusing strategy unique_key (its tokens could go backwards)"
        );
        return Err(Error::config(
            "strategy unique_key needs innodb_autoinc_lock_mode 0 or 1 (this server runs 2, MySQL 8's \
             default: a waiting INSERT can be granted an id lower than one already granted, so fencing \
             tokens could go backwards); start the server with innodb_autoinc_lock_mode=1, or use \
             ?strategy=optimistic or ?strategy=row_lock",
        ));
    }
    Ok(())
}

/// What the acquiring statement found.
enum Insert {
    /// The row is ours; the token.
    Acquired(u64),
    /// A live holder.
    Held,
    /// A holder whose row has expired on the server's clock.
    Expired,
}

/// SQL for one base table, built once.
#[derive(Debug)]
pub(crate) struct UniqueKey {
    rows: Rows,
    insert: SqlStr,
    delete_expired: SqlStr,
    force_current: SqlStr,
    force_any: SqlStr,
    reap: SqlStr,
    purge: SqlStr,
}

impl UniqueKey {
    pub(crate) fn new(pool: MySqlPool, table: String, polling: Polling) -> Polled<Self> {
        let t = &table;
        let table = Table {
            name: t,
            holder: "owner",
            token: "id",
            held: LIVE,
            lease: &format!("id = ? AND owner = ? AND {LIVE}"),
            batch_by: "id",
            batch_check: "owner = ?",
            free: &format!("DELETE FROM {t}"),
        };
        let lock_own = sql!(
            "SELECT reentrant_count, CAST({LIVE} AS SIGNED) \
             FROM {t} WHERE id = ? AND owner = ? FOR UPDATE"
        );
        // Current and last, or this owner's own dead row: deleted.
        let release_own = sql!("DELETE FROM {t} WHERE id = ? AND owner = ?");
        let rows = Statements::new(&table, lock_own, release_own);
        Polled(UniqueKey {
            rows: Rows::new(pool, polling, rows),
            // `SELECT … FROM DUAL`, not `VALUES`: a bulk insert keeps the
            // AUTO-INC lock to the end of the statement, so its id cannot be
            // overtaken while it waits (see the module docs). On a duplicate,
            // `LAST_INSERT_ID(0)` makes the OK packet's insert id 0 (never a
            // real id), and a dead row's count is bumped so the affected-row
            // count (found rows: 1 unchanged, 2 changed) tells an expired
            // holder from a live one. A live row is left as it is.
            insert: sql!(
                "INSERT INTO {t} (lock_key, owner, reentrant_count, expire_time, create_time, label) \
                 SELECT ?, ?, 1, UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND, UTC_TIMESTAMP(6), ? \
                 FROM DUAL \
                 ON DUPLICATE KEY UPDATE reentrant_count = \
                 IF(expire_time <= UTC_TIMESTAMP(6), reentrant_count + 1, reentrant_count) + LAST_INSERT_ID(0)"
            ),
            delete_expired: sql!(
                "DELETE FROM {t} WHERE lock_key = ? AND expire_time <= UTC_TIMESTAMP(6)"
            ),
            force_current: sql!("DELETE FROM {t} WHERE lock_key = ? AND {LIVE}"),
            // Only rows already expired: a holder that inserted after the
            // first statement keeps its fresh lock.
            force_any: sql!("DELETE FROM {t} WHERE lock_key = ? AND expire_time <= UTC_TIMESTAMP(6)"),
            // Never the reaper's own guard row: were the guard ever to lapse
            // mid-pass (it cannot, see `reap`), deleting it would let a
            // second reaper in while this one still runs.
            reap: sql!(
                "DELETE FROM {t} WHERE expire_time < UTC_TIMESTAMP(6) AND lock_key <> ? \
                 ORDER BY expire_time LIMIT ?"
            ),
            purge: sql!(
                "DELETE FROM {t} WHERE expire_time < UTC_TIMESTAMP(6) - INTERVAL ? SECOND LIMIT ?"
            ),
        })
    }

    async fn insert(&self, key: &LockKey, owner: &Owner, opts: &LockOptions) -> Result<Insert> {
        let query = || {
            sqlx::query(self.insert.clone())
                .bind(key.as_bytes())
                .bind(owner.as_str().as_bytes())
                .bind(micros(opts.ttl()))
                .bind(label_param(opts))
        };
        Ok(match self.rows.take(&mut 0, query).await? {
            Some(done) if done.last_insert_id() > 0 => Insert::Acquired(done.last_insert_id()),
            Some(done) if done.rows_affected() >= 2 => Insert::Expired,
            Some(_) | None => Insert::Held,
        })
    }

    /// One expired-row cleanup for the key; true if a row was removed.
    async fn take_over_expired(&self, key: &LockKey) -> Result<bool> {
        let done = self
            .rows
            .conns
            .execute(sqlx::query(self.delete_expired.clone()).bind(key.as_bytes()))
            .await;
        match done {
            Ok(d) => Ok(d.rows_affected() > 0),
            Err(e) if error::is_lock_conflict(&e) => Ok(false),
            Err(e) => Err(error::map(e)),
        }
    }

    /// Deletes expired rows in batches of `batch` until none is left or
    /// `stop_at` has passed (checked after each batch, so a pass always
    /// makes progress); each batch is bounded by `op_timeout`.
    pub(crate) async fn reap(
        &self,
        batch: u32,
        stop_at: Instant,
        op_timeout: Duration,
    ) -> Result<Pass> {
        let mut reaped = 0;
        loop {
            let delete = self.rows.conns.execute(
                sqlx::query(self.reap.clone())
                    .bind(REAPER_KEY.as_bytes())
                    .bind(batch),
            );
            let n = error::bounded("reaper batch", op_timeout, async { delete.await.db() })
                .await?
                .rows_affected();
            reaped += n;
            let finished = n < u64::from(batch);
            if finished || Instant::now() >= stop_at {
                return Ok(Pass { reaped, finished });
            }
        }
    }

    /// Deletes rows expired for more than `older_than`, in batches.
    pub(crate) async fn purge(&self, older_than: Duration, batch: u32) -> Result<u64> {
        let mut total = 0;
        loop {
            let purge = sqlx::query(self.purge.clone())
                .bind(older_than.as_secs())
                .bind(batch);
            let n = self.rows.conns.execute(purge).await.db()?.rows_affected();
            total += n;
            if n < u64::from(batch) {
                return Ok(total);
            }
        }
    }
}

impl RowStrategy for UniqueKey {
    fn rows(&self) -> &Rows {
        &self.rows
    }

    const NAME: &'static str = "mysql/unique_key";

    /// The slow release deletes the lease's own dead row, or finds it gone
    /// already: either way the key may be free.
    const NOT_HELD_FREES: bool = true;

    /// `id` (the token) and `owner`.
    fn bind_lease<'q>(query: Query<'q>, lease: &'q Lease) -> Query<'q> {
        query
            .bind(lease.token.get())
            .bind(lease.owner.as_str().as_bytes())
    }

    async fn try_acquire(&self, key: &LockKey, opts: &LockOptions) -> Result<Option<Lease>> {
        let owner = opts.owner_or_random();
        for attempt in 0..2 {
            let sent = Instant::now();
            let expired = match self.insert(key, &owner, opts).await? {
                Insert::Acquired(id) => return Ok(Some(granted(key, &owner, id, opts, sent))),
                Insert::Held => false,
                Insert::Expired => true,
            };
            if !expired {
                if let Some(lease) = self.rows.same_owner(key, opts, &owner).await? {
                    return Ok(Some(lease));
                }
            }
            // A crashed holder's expired row is removed right here (only
            // while still expired), then the INSERT is retried once. A live
            // holder costs nothing more: the refusal was one statement.
            if !(attempt == 0 && expired && self.take_over_expired(key).await?) {
                break;
            }
        }
        Ok(None)
    }

    async fn force_release(&self, key: &LockKey) -> Result<bool> {
        let conns = &self.rows.conns;
        let current = conns
            .execute(sqlx::query(self.force_current.clone()).bind(key.as_bytes()))
            .await
            .db()?
            .rows_affected()
            > 0;
        conns
            .execute(sqlx::query(self.force_any.clone()).bind(key.as_bytes()))
            .await
            .db()?;
        if current {
            tracing::warn!(key = %key, "lock force-released");
        }
        // Whatever the two deletes found, the key is free now: local
        // waiters look at once.
        self.rows.polling.freed(key);
        Ok(current)
    }

    /// The list is the ids (the primary key of the leases' rows); the
    /// `CASE` on the id checks each row's owner.
    fn bind_batch<'q>(query: Query<'q>, leases: &[&'q Lease]) -> Query<'q> {
        let query = leases.iter().fold(query, |q, l| q.bind(l.token.get()));
        leases.iter().fold(query, |q, l| {
            q.bind(l.token.get()).bind(l.owner.as_str().as_bytes())
        })
    }
}
