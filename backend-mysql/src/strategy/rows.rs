//! What `unique_key` and `optimistic` share.
//!
//! Both keep each hold in a row of their table, answer every operation
//! with one statement on a hot connection ([`Conns`]) and have no native
//! wait: their waiters poll ([`Polling`], built in `wait.rs`). A strategy
//! says how it takes a key, how a lease names its row, how a release that
//! its fast path did not decide and a force-release go, and how a batch
//! renewal lists its leases ([`RowStrategy`]). [`Polled`] is the one
//! `DistributedLock` over either: it runs what the two do alike — re-entry
//! and the same-owner check, extend, the fast path of release, inspect,
//! list, the batch renewal's statement — and passes every release outcome
//! through the polling's release signal.

use std::{future::Future, time::Duration};

use async_trait::async_trait;
use fenced_api::{
    batch::{ChunkVerdict, ExtendChunk},
    wait::Polling,
    Capabilities, DistributedLock, Error, FencingToken, Lease, LockInfo, LockKey, LockOptions,
    Owner, ReleaseOutcome, Result,
};
use sqlx::{
    mysql::{MySqlArguments, MySqlQueryResult},
    MySql, MySqlConnection, MySqlPool, Row, SqlStr,
};
use tokio::time::Instant;

use super::{micros, retry_lock_conflicts};
use crate::conn::Conns;
use crate::error::{self, SqlResultExt};
use crate::list::{info_from_row, infos_from_rows, sql_limit};
use crate::sql::sql;

/// A prepared statement with its parameters.
pub(crate) type Query<'q> = sqlx::query::Query<'q, MySql, MySqlArguments>;

/// The statements both strategies have, each written for its own table.
#[derive(Debug)]
pub(crate) struct Statements {
    /// Re-enters a live hold: binds (TTL µs, key, owner); the token comes
    /// back as the OK packet's insert id.
    pub(crate) reenter: SqlStr,
    /// Finds a live hold: binds (key, owner).
    pub(crate) held_by: SqlStr,
    /// Extends a live hold: binds (TTL µs, TTL µs), then the lease
    /// ([`RowStrategy::bind_lease`]).
    pub(crate) extend: SqlStr,
    /// `extend` for many leases, up to the `(` of its list: binds (TTL µs,
    /// TTL µs), then the list ([`Statements::extend_batch`] completes it).
    pub(crate) extend_batch: String,
    /// The column the list names the rows by.
    batch_by: String,
    /// One lease's branch of the batch's per-row `CASE`.
    batch_when: String,
    /// Frees a live hold that is not re-entered: binds the lease.
    pub(crate) release_last: SqlStr,
    /// The slow release's row lock on the lease's row, as
    /// `(reentrant_count, current)`: binds the lease.
    pub(crate) lock_own: SqlStr,
    /// Counts one entry of a re-entered hold down: binds the lease.
    pub(crate) release_one: SqlStr,
    /// Ends the lease's row under that row lock (the last entry of a current
    /// hold, or the lease's own dead row): binds the lease.
    pub(crate) release_own: SqlStr,
    /// The live hold of a key as `(owner, token, hold_count, remaining_us,
    /// label)`: binds (key).
    pub(crate) inspect: SqlStr,
    /// The first live holds in key order, rows as `inspect`'s plus
    /// `lock_key`: binds (limit).
    pub(crate) list: SqlStr,
}

/// A hold whose expiry (server clock) is still ahead.
pub(crate) const LIVE: &str = "expire_time > UTC_TIMESTAMP(6)";

/// How a strategy's table keeps its holds, for [`Statements::new`]: every
/// part is SQL written in this crate, except the validated, quoted table
/// name.
pub(crate) struct Table<'a> {
    /// The quoted table name.
    pub(crate) name: &'a str,
    /// The holder's column.
    pub(crate) holder: &'a str,
    /// The token's column (an `AUTO_INCREMENT` id or a version).
    pub(crate) token: &'a str,
    /// The condition of a row that is held now (`inspect`, `list`).
    pub(crate) held: &'a str,
    /// The condition of one lease's live hold, with the placeholders
    /// [`RowStrategy::bind_lease`] binds.
    pub(crate) lease: &'a str,
    /// The column a batch renewal lists its leases by (their primary key).
    pub(crate) batch_by: &'a str,
    /// What a batch renewal checks of the row of each listed lease (all
    /// of [`Table::lease`] but the list's own column and the liveness), with
    /// the placeholders [`RowStrategy::bind_batch`] binds after that column.
    pub(crate) batch_check: &'a str,
    /// The statement that frees a row, up to its `WHERE`.
    pub(crate) free: &'a str,
}

impl Statements {
    /// The statements written the same way for both strategies, with the
    /// two that differ in shape: the slow release's row lock `lock_own` and
    /// its end `release_own`.
    pub(crate) fn new(t: &Table<'_>, lock_own: SqlStr, release_own: SqlStr) -> Self {
        let Table {
            name,
            holder,
            token,
            held,
            lease,
            batch_by,
            batch_check,
            free,
        } = t;
        // Re-entered holds never have their expiry cut by one entry's extend.
        let renew = format!(
            "UPDATE {name} SET expire_time = IF(reentrant_count > 1, \
             GREATEST(expire_time, UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND), \
             UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND)"
        );
        let columns = format!(
            "{holder}, {token}, reentrant_count, \
             TIMESTAMPDIFF(MICROSECOND, UTC_TIMESTAMP(6), expire_time), label"
        );
        Statements {
            // `{token} = LAST_INSERT_ID({token})` hands the token back in the
            // OK packet: re-entering costs one round trip.
            reenter: sql!(
                "UPDATE {name} SET reentrant_count = reentrant_count + 1, \
                 {token} = LAST_INSERT_ID({token}), \
                 expire_time = GREATEST(expire_time, UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND) \
                 WHERE lock_key = ? AND {holder} = ? AND {LIVE}"
            ),
            held_by: sql!("SELECT 1 FROM {name} WHERE lock_key = ? AND {holder} = ? AND {LIVE}"),
            extend: sql!("{renew} WHERE {lease}"),
            extend_batch: format!("{renew} WHERE {LIVE} AND {batch_by} IN ("),
            batch_by: batch_by.to_string(),
            batch_when: format!(" WHEN ? THEN {batch_check}"),
            release_last: sql!("{free} WHERE {lease} AND reentrant_count <= 1"),
            lock_own,
            release_one: sql!(
                "UPDATE {name} SET reentrant_count = LAST_INSERT_ID(reentrant_count - 1) \
                 WHERE {lease} AND reentrant_count > 1"
            ),
            release_own,
            inspect: sql!("SELECT {columns} FROM {name} WHERE lock_key = ? AND {held}"),
            // lock_key is the primary key: the rows come in key (byte)
            // order, and the scan stops after `limit` held ones.
            list: sql!(
                "SELECT {columns}, lock_key FROM {name} WHERE {held} ORDER BY lock_key LIMIT ?"
            ),
        }
    }
}

/// The state both strategies share.
#[derive(Debug)]
pub(crate) struct Rows {
    pub(crate) conns: Conns,
    pub(crate) polling: Polling,
    sql: Statements,
}

impl Rows {
    pub(crate) fn new(pool: MySqlPool, polling: Polling, sql: Statements) -> Self {
        Rows {
            conns: Conns::new(pool),
            polling,
            sql,
        }
    }

    /// Sends a statement that tries to take a key: `Some` with its result,
    /// `None` when it lost a lock wait to other contenders (held).
    ///
    /// A deadlock victim — of concurrent inserts or deletes, of other keys
    /// too (gap locks) — was rolled back, changed nothing and says nothing
    /// about this key: it is sent again (`query` builds it anew), up to three
    /// times per acquisition attempt, which `deadlocks` counts.
    pub(crate) async fn take<'q>(
        &self,
        deadlocks: &mut u32,
        query: impl Fn() -> Query<'q>,
    ) -> Result<Option<MySqlQueryResult>> {
        loop {
            match self.conns.execute(query()).await {
                Ok(done) => return Ok(Some(done)),
                Err(e) if error::number(&e) == Some(error::code::DEADLOCK) && *deadlocks < 3 => {
                    *deadlocks += 1;
                }
                Err(e) if error::is_lock_conflict(&e) => return Ok(None),
                Err(e) => return Err(error::map(e)),
            }
        }
    }

    /// After a take refused for an explicit owner: that owner's live hold
    /// re-entered (reentrant options) or [`Error::AlreadyHeld`] (not
    /// reentrant); `None` when the owner holds nothing here, or none was
    /// given.
    pub(crate) async fn same_owner(
        &self,
        key: &LockKey,
        opts: &LockOptions,
        owner: &Owner,
    ) -> Result<Option<Lease>> {
        if opts.owner().is_none() {
            return Ok(None);
        }
        let sent = Instant::now();
        if opts.is_reentrant() {
            let done = self
                .conns
                .execute(
                    sqlx::query(self.sql.reenter.clone())
                        .bind(micros(opts.ttl()))
                        .bind(key.as_bytes())
                        .bind(owner.as_str().as_bytes()),
                )
                .await
                .db()?;
            return Ok((done.rows_affected() == 1)
                .then(|| granted(key, owner, done.last_insert_id(), opts, sent)));
        }
        let held = self
            .conns
            .fetch_optional(
                sqlx::query(self.sql.held_by.clone())
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
}

/// The lease of a grant whose statement was sent at `sent`.
pub(crate) fn granted(
    key: &LockKey,
    owner: &Owner,
    token: u64,
    opts: &LockOptions,
    sent: Instant,
) -> Lease {
    Lease::new(
        key.clone(),
        owner.clone(),
        FencingToken::new(token),
        opts.ttl(),
        sent,
    )
}

/// What is particular to one row strategy (see the module docs).
pub(crate) trait RowStrategy: Send + Sync + std::fmt::Debug {
    /// The shared state.
    fn rows(&self) -> &Rows;

    /// The backend name in [`Capabilities`] (`mysql/<strategy>`).
    const NAME: &'static str;

    /// Whether a release that finds its lease not held wakes this
    /// process's waiters for the key: where the slow release deletes the
    /// lease's own dead row, the key may be free right then.
    const NOT_HELD_FREES: bool = false;

    /// Binds what names `lease`'s row and holder, in the order the
    /// strategy's lease statements (extend and the release statements)
    /// expect.
    fn bind_lease<'q>(query: Query<'q>, lease: &'q Lease) -> Query<'q>;

    /// `DistributedLock::try_acquire`.
    fn try_acquire(
        &self,
        key: &LockKey,
        opts: &LockOptions,
    ) -> impl Future<Output = Result<Option<Lease>>> + Send;

    /// `DistributedLock::force_release`.
    fn force_release(&self, key: &LockKey) -> impl Future<Output = Result<bool>> + Send;

    /// Whether one batch statement can renew exactly these leases.
    fn batchable(_chunk: &[&Lease]) -> bool {
        true
    }

    /// Binds a batch renewal's list and its `CASE` for `leases` (the chunk,
    /// padded by repeating its last lease), after (TTL µs, TTL µs): each
    /// lease's [`Table::batch_by`] value, then per lease that value again
    /// and what [`Table::batch_check`] checks.
    fn bind_batch<'q>(query: Query<'q>, leases: &[&'q Lease]) -> Query<'q>;
}

/// The `DistributedLock` of a row strategy.
#[derive(Debug)]
pub(crate) struct Polled<S>(pub(crate) S);

impl<S: RowStrategy> Polled<S> {
    /// The connections (for statements outside the lock operations).
    pub(crate) fn conns(&self) -> &Conns {
        &self.0.rows().conns
    }

    async fn release_once(
        &self,
        lease: &Lease,
    ) -> std::result::Result<ReleaseOutcome, sqlx::Error> {
        let rows = self.0.rows();
        let mut c = rows.conns.get().await?;
        let done = S::bind_lease(sqlx::query(rows.sql.release_last.clone()), lease)
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
            return Ok(rows.polling.released(&lease.key, ReleaseOutcome::Released));
        }
        // On any failure of the slow path the connection is closed, never
        // reused mid-transaction.
        let outcome = self.release_slow(c.conn(), lease).await?;
        c.settle(None);
        if outcome == ReleaseOutcome::NotHeld {
            tracing::warn!(key = %lease.key, token = %lease.token, "release of a lease that was not held (expired or taken over)");
            if S::NOT_HELD_FREES {
                rows.polling.freed(&lease.key);
            }
        }
        Ok(rows.polling.released(&lease.key, outcome))
    }

    /// A release that the fast path did not decide — a re-entered, expired
    /// or foreign lease — decided in a transaction under a row lock, so
    /// that concurrent releases of re-entered entries never race (separate
    /// statements could delete a row another entry just re-took).
    async fn release_slow(
        &self,
        conn: &mut MySqlConnection,
        lease: &Lease,
    ) -> std::result::Result<ReleaseOutcome, sqlx::Error> {
        let sql = &self.0.rows().sql;
        let mut tx = sqlx::Connection::begin(conn).await?;
        let row = S::bind_lease(sqlx::query(sql.lock_own.clone()), lease)
            .fetch_optional(&mut *tx)
            .await?;
        let outcome = match row {
            None => ReleaseOutcome::NotHeld,
            Some(r) => {
                let count: u32 = r.try_get(0)?;
                let current = r.try_get::<i64, _>(1)? != 0;
                let (end, outcome) = match (current, count) {
                    (true, 2..) => {
                        let remaining = count - 1;
                        (&sql.release_one, ReleaseOutcome::StillHeld { remaining })
                    }
                    (true, _) => (&sql.release_own, ReleaseOutcome::Released),
                    // The lease's own dead row: cleaned up.
                    (false, _) => (&sql.release_own, ReleaseOutcome::NotHeld),
                };
                S::bind_lease(sqlx::query(end.clone()), lease)
                    .execute(&mut *tx)
                    .await?;
                outcome
            }
        };
        tx.commit().await?;
        Ok(outcome)
    }
}

#[async_trait]
impl<S: RowStrategy> DistributedLock for Polled<S> {
    async fn try_acquire(&self, key: &LockKey, opts: &LockOptions) -> Result<Option<Lease>> {
        self.0.try_acquire(key, opts).await
    }

    async fn acquire(&self, key: &LockKey, opts: &LockOptions) -> Result<Lease> {
        self.0.rows().polling.acquire(self, key, opts).await
    }

    async fn extend(&self, lease: &Lease, ttl: Duration) -> Result<Lease> {
        let ttl = LockOptions::validate_ttl(ttl)?;
        let rows = self.0.rows();
        let sent = Instant::now();
        let extend = sqlx::query(rows.sql.extend.clone())
            .bind(micros(ttl))
            .bind(micros(ttl));
        let done = rows
            .conns
            .execute(S::bind_lease(extend, lease))
            .await
            .db()?;
        // sqlx sets CLIENT_FOUND_ROWS, so this counts matched rows, not only
        // changed ones: an unchanged expire_time still reads as 1.
        if done.rows_affected() == 1 {
            return Ok(lease.renewed(ttl, sent));
        }
        tracing::debug!(key = %lease.key, token = %lease.token, "extend refused: the lease expired or was taken over");
        let reason = "the row expired or belongs to another holder";
        Err(Error::lease_lost(&lease.key, lease.token, reason))
    }

    async fn release(&self, lease: &Lease) -> Result<ReleaseOutcome> {
        retry_lock_conflicts(|| self.release_once(lease)).await
    }

    async fn inspect(&self, key: &LockKey) -> Result<Option<LockInfo>> {
        let rows = self.0.rows();
        let row = rows
            .conns
            .fetch_optional(sqlx::query(rows.sql.inspect.clone()).bind(key.as_bytes()))
            .await
            .db()?;
        row.map(|r| info_from_row(key, &r)).transpose()
    }

    /// The first `limit` live holds in key order: one `SELECT` walking the
    /// primary key (`lock_key`). What it reads besides depends on the
    /// strategy: `unique_key`'s table holds only held keys and expired rows
    /// not yet taken over or reaped (and lists the reaper's guard row
    /// `fenced:reaper` while a pass runs: a lock like any other);
    /// `optimistic` keeps a row per key ever locked and has no index on
    /// `expire_time`, so its scan reads free rows too — O(rows read until
    /// `limit` held ones are found), at worst the table.
    async fn list(&self, limit: usize) -> Result<Vec<LockInfo>> {
        if limit == 0 {
            return Ok(Vec::new());
        }
        let rows = self.0.rows();
        let found = rows
            .conns
            .fetch_all(sqlx::query(rows.sql.list.clone()).bind(sql_limit(limit)))
            .await
            .db()?;
        infos_from_rows(&found)
    }

    async fn force_release(&self, key: &LockKey) -> Result<bool> {
        self.0.force_release(key).await
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities::none()
            .backend(S::NAME)
            .durable(true)
            .fencing(true)
            .reentrant(true)
    }
}

#[async_trait]
impl<S: RowStrategy> ExtendChunk for Polled<S> {
    /// One UPDATE on the chunk's rows (found through the primary key), a
    /// `CASE` checking each row against its own lease (owner, token): the
    /// leases of a chunk have different owners as a rule. Found rows (sqlx
    /// sets CLIENT_FOUND_ROWS) equal to the chunk's size means every lease
    /// was renewed; fewer, and MySQL cannot say which (no `RETURNING` on
    /// UPDATE): the chunk is renewed again one by one.
    async fn extend_chunk(&self, chunk: &[&Lease], ttl: Duration) -> Result<ChunkVerdict> {
        if chunk.is_empty() {
            return Ok(ChunkVerdict::All);
        }
        if !S::batchable(chunk) {
            return Ok(ChunkVerdict::Unknown);
        }
        let places = fenced_api::batch::padded_len(chunk.len());
        let padded: Vec<&Lease> = (0..places).map(|p| chunk[p.min(chunk.len() - 1)]).collect();
        let rows = self.0.rows();
        let sql = &rows.sql;
        let text = format!(
            "{}{}) AND CASE {}{} ELSE FALSE END",
            sql.extend_batch,
            vec!["?"; places].join(", "),
            sql.batch_by,
            sql.batch_when.repeat(places)
        );
        let query = sqlx::query(sql!("{text}"))
            .bind(micros(ttl))
            .bind(micros(ttl));
        let done = rows
            .conns
            .execute(S::bind_batch(query, &padded))
            .await
            .db()?;
        Ok(if done.rows_affected() == chunk.len() as u64 {
            ChunkVerdict::All
        } else {
            ChunkVerdict::Unknown
        })
    }
}
