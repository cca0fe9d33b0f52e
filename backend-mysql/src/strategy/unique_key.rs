//! `unique_key`: INSERT a row per held key (the seeds' "posture one").
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
//!   release of that lower token then succeeds (the fault suite's "834 after
//!   835"). Measured here with eight clients on one key (`tests/regressions.rs`
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

use async_trait::async_trait;
use fenced_api::{
    batch::{ChunkVerdict, ExtendChunk},
    wait::{acquire_polling, notify_released, Backoff},
    Capabilities, DistributedLock, Error, FencingToken, Lease, LockInfo, LockKey, LockOptions,
    Owner, ReleaseOutcome, Result,
};
use sqlx::{MySqlConnection, MySqlPool, Row, SqlStr};
use tokio::time::Instant;

use super::{info_from_row, infos_from_rows, label_param, micros, retry_lock_conflicts, sql_limit};
use crate::conn::Conns;
use crate::error::{self, SqlResultExt};
use crate::reaper::{Pass, REAPER_KEY};
use crate::sql;

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
    conns: Conns,
    scope: String,
    insert: SqlStr,
    delete_expired: SqlStr,
    reenter: SqlStr,
    held_by: SqlStr,
    extend: SqlStr,
    /// `extend` for many ids of one owner: this, then `?, ?, …)`.
    extend_batch: String,
    release_last: SqlStr,
    release_one: SqlStr,
    delete_own: SqlStr,
    lock_own: SqlStr,
    inspect: SqlStr,
    list: SqlStr,
    force_current: SqlStr,
    force_any: SqlStr,
    reap: SqlStr,
    purge: SqlStr,
}

impl UniqueKey {
    pub(crate) fn new(pool: MySqlPool, table: String, scope: String) -> Self {
        let t = &table;
        UniqueKey {
            conns: Conns::new(pool),
            scope,
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
            extend_batch: format!(
                "UPDATE {t} SET expire_time = IF(reentrant_count > 1, \
                 GREATEST(expire_time, UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND), \
                 UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND) \
                 WHERE owner = ? AND expire_time > UTC_TIMESTAMP(6) AND id IN ("
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
                 TIMESTAMPDIFF(MICROSECOND, UTC_TIMESTAMP(6), expire_time), label \
                 FROM {t} WHERE lock_key = ? AND expire_time > UTC_TIMESTAMP(6)"
            ),
            // lock_key is the primary key: the rows come in key (byte)
            // order, and the scan stops after `limit` unexpired ones.
            list: sql!(
                "SELECT owner, id, reentrant_count, \
                 TIMESTAMPDIFF(MICROSECOND, UTC_TIMESTAMP(6), expire_time), label, lock_key \
                 FROM {t} WHERE expire_time > UTC_TIMESTAMP(6) ORDER BY lock_key LIMIT ?"
            ),
            force_current: sql!(
                "DELETE FROM {t} WHERE lock_key = ? AND expire_time > UTC_TIMESTAMP(6)"
            ),
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
            }
    }

    async fn insert(&self, key: &LockKey, owner: &Owner, opts: &LockOptions) -> Result<Insert> {
        let mut deadlocks = 0;
        loop {
            let res = self
                .conns
                .execute(
                    sqlx::query(self.insert.clone())
                        .bind(key.as_bytes())
                        .bind(owner.as_str().as_bytes())
                        .bind(micros(opts.ttl()))
                        .bind(label_param(opts)),
                )
                .await;
            return match res {
                Ok(done) if done.last_insert_id() > 0 => {
                    Ok(Insert::Acquired(done.last_insert_id()))
                }
                Ok(done) if done.rows_affected() >= 2 => Ok(Insert::Expired),
                Ok(_) => Ok(Insert::Held),
                // Chosen as a deadlock victim by concurrent inserts or
                // deletes — of other keys too (gap locks): rolled back,
                // changed nothing, says nothing about this key. Try again.
                Err(e) if error::number(&e) == Some(error::code::DEADLOCK) && deadlocks < 3 => {
                    deadlocks += 1;
                    continue;
                }
                // A lock wait while racing other inserters: not acquired.
                Err(e) if error::is_lock_conflict(&e) => Ok(Insert::Held),
                Err(e) => Err(error::map(e)),
            };
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
            let done = self
                .conns
                .execute(
                    sqlx::query(self.reenter.clone())
                        .bind(micros(opts.ttl()))
                        .bind(key.as_bytes())
                        .bind(owner.as_str().as_bytes()),
                )
                .await
                .db()?;
            return Ok((done.rows_affected() == 1).then(|| done.last_insert_id()));
        }
        let held = self
            .conns
            .fetch_optional(
                sqlx::query(self.held_by.clone())
                    .bind(key.as_bytes())
                    .bind(owner.as_str().as_bytes()),
            )
            .await
            .db()?;
        if held.is_some() {
            return Err(Error::AlreadyHeld { key: key.clone() });
        }
        Ok(None)
    }

    /// One expired-row cleanup for the key; true if a row was removed.
    async fn take_over_expired(&self, key: &LockKey) -> Result<bool> {
        let done = self
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
            let delete = self.conns.execute(
                sqlx::query(self.reap.clone())
                    .bind(REAPER_KEY.as_bytes())
                    .bind(batch),
            );
            let n = match tokio::time::timeout(op_timeout, delete).await {
                Ok(r) => r.db()?.rows_affected(),
                Err(_) => {
                    return Err(Error::backend(
                        error::BACKEND,
                        true,
                        format!("reaper batch: no answer from the server within {op_timeout:?}"),
                    ))
                }
            };
            reaped += n;
            if n < u64::from(batch) {
                return Ok(Pass {
                    reaped,
                    finished: true,
                });
            }
            if Instant::now() >= stop_at {
                return Ok(Pass {
                    reaped,
                    finished: false,
                });
            }
        }
    }

    /// Deletes rows expired for more than `older_than`, in batches.
    pub(crate) async fn purge(&self, older_than: Duration, batch: u32) -> Result<u64> {
        let mut total = 0;
        loop {
            let n = self
                .conns
                .execute(
                    sqlx::query(self.purge.clone())
                        .bind(older_than.as_secs())
                        .bind(batch),
                )
                .await
                .db()?
                .rows_affected();
            total += n;
            if n < u64::from(batch) {
                return Ok(total);
            }
        }
    }

    /// The connections (for statements outside the lock operations).
    pub(crate) fn conns(&self) -> &Conns {
        &self.conns
    }
}

impl UniqueKey {
    async fn release_once(
        &self,
        lease: &Lease,
    ) -> std::result::Result<ReleaseOutcome, sqlx::Error> {
        let id = lease.token.get();
        let owner = lease.owner.as_str().as_bytes();
        let mut c = self.conns.get().await?;
        let done = sqlx::query(self.release_last.clone())
            .bind(id)
            .bind(owner)
            .execute(c.conn())
            .await;
        let done = match done {
            Ok(d) => d,
            Err(e) => {
                c.settle(Some(&e));
                return Err(e);
            }
        };
        if done.rows_affected() == 1 {
            c.settle(None);
            notify_released(&self.scope, &lease.key);
            return Ok(ReleaseOutcome::Released);
        }
        // Slow path (re-entered, expired or foreign lease): decide under a row
        // lock, so concurrent releases of re-entered entries never race
        // (separate statements could delete a row another entry just re-took).
        // On any failure the connection is closed, never reused mid-transaction.
        let outcome = self.release_slow(c.conn(), id, owner).await?;
        c.settle(None);
        if !matches!(outcome, ReleaseOutcome::StillHeld { .. }) {
            notify_released(&self.scope, &lease.key);
        }
        if outcome == ReleaseOutcome::NotHeld {
            tracing::warn!(key = %lease.key, token = %lease.token, "release of a lease that was no longer held");
        }
        Ok(outcome)
    }

    async fn release_slow(
        &self,
        conn: &mut MySqlConnection,
        id: u64,
        owner: &[u8],
    ) -> std::result::Result<ReleaseOutcome, sqlx::Error> {
        let mut tx = sqlx::Connection::begin(conn).await?;
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
            let expired = match self.insert(key, &owner, opts).await? {
                Insert::Acquired(id) => {
                    return Ok(Some(Lease::new(
                        key.clone(),
                        owner,
                        FencingToken::new(id),
                        ttl,
                        sent,
                    )))
                }
                Insert::Held => false,
                Insert::Expired => true,
            };
            if !expired && opts.owner().is_some() {
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
            // A crashed holder's expired row is removed right here (only
            // while still expired), then the INSERT is retried once. A live
            // holder costs nothing more: the refusal was one statement.
            if !(attempt == 0 && expired && self.take_over_expired(key).await?) {
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
        let done = self
            .conns
            .execute(
                sqlx::query(self.extend.clone())
                    .bind(micros(ttl))
                    .bind(micros(ttl))
                    .bind(lease.token.get())
                    .bind(lease.owner.as_str().as_bytes()),
            )
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
        let row = self
            .conns
            .fetch_optional(sqlx::query(self.inspect.clone()).bind(key.as_bytes()))
            .await
            .db()?;
        row.map(|r| info_from_row(key, &r)).transpose()
    }

    /// The unexpired rows (server clock), first `limit` in key order: one
    /// `SELECT` walking the primary key (`lock_key`), which holds only held
    /// locks and expired rows not yet taken over or reaped. The reaper's
    /// guard row (`fenced:reaper`) is listed while a reaper pass runs: it is
    /// a lock like any other.
    async fn list(&self, limit: usize) -> Result<Vec<LockInfo>> {
        if limit == 0 {
            return Ok(Vec::new());
        }
        let rows = self
            .conns
            .fetch_all(sqlx::query(self.list.clone()).bind(sql_limit(limit)))
            .await
            .db()?;
        infos_from_rows(&rows)
    }

    async fn force_release(&self, key: &LockKey) -> Result<bool> {
        let current = self
            .conns
            .execute(sqlx::query(self.force_current.clone()).bind(key.as_bytes()))
            .await
            .db()?
            .rows_affected()
            > 0;
        self.conns
            .execute(sqlx::query(self.force_any.clone()).bind(key.as_bytes()))
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

#[async_trait]
impl ExtendChunk for UniqueKey {
    /// One UPDATE on the ids (primary key) of the chunk. Found rows (sqlx
    /// sets CLIENT_FOUND_ROWS) equal to the chunk's size means every lease
    /// was renewed; fewer, and MySQL cannot say which (no `RETURNING` on
    /// UPDATE): the chunk is renewed again one by one.
    async fn extend_chunk(
        &self,
        owner: &Owner,
        chunk: &[&Lease],
        ttl: Duration,
    ) -> Result<ChunkVerdict> {
        let places = fenced_api::batch::padded_len(chunk.len());
        let mut text = self.extend_batch.clone();
        text.push_str(&vec!["?"; places].join(", "));
        text.push(')');
        let mut query = sqlx::query(sql!("{text}"))
            .bind(micros(ttl))
            .bind(micros(ttl))
            .bind(owner.as_str().as_bytes());
        for p in 0..places {
            query = query.bind(chunk[p.min(chunk.len() - 1)].token.get());
        }
        let done = self.conns.execute(query).await.db()?;
        Ok(if done.rows_affected() == chunk.len() as u64 {
            ChunkVerdict::All
        } else {
            ChunkVerdict::Unknown
        })
    }
}
