//! `optimistic`: one permanent row per key taken with a conditional UPDATE,
//! its version the fencing token.
//!
//! * acquire = one `UPDATE` of the key's row whose assignments decide from
//!   the old holder and expiry: a free or expired row is taken
//!   (`version = LAST_INSERT_ID(version + 1)`), a held one is left untouched
//!   with `LAST_INSERT_ID(0)`. The OK packet's insert id is the new version —
//!   the fencing token — or 0 for "held": acquired, refused or taken over, one
//!   statement. Only a key's first acquisition finds no row (0 rows matched)
//!   and creates it with `INSERT IGNORE` before trying again.
//! * release clears the holder (matching holder **and** version); the row
//!   stays, so the table never grows with traffic, only with distinct keys.
//! * the holder's label is a column of the row, set by the `UPDATE` that
//!   takes the key (NULL without one) and cleared with the holder; a re-entry
//!   keeps the first entry's label.

use fenced_api::{wait::Polling, Lease, LockKey, LockOptions, Owner, Result};
use sqlx::{MySqlPool, SqlStr};
use tokio::time::Instant;

use super::rows::{granted, Polled, Query, RowStrategy, Rows, Statements, Table, LIVE};
use super::{label_param, micros};
use crate::error::SqlResultExt;
use crate::sql::sql;

#[derive(Debug)]
pub(crate) struct Optimistic {
    rows: Rows,
    take: SqlStr,
    create_row: SqlStr,
    force: SqlStr,
}

impl Optimistic {
    pub(crate) fn new(pool: MySqlPool, table: String, polling: Polling) -> Polled<Self> {
        let t = &table;
        let held = format!("holder IS NOT NULL AND {LIVE}");
        let table = Table {
            name: t,
            holder: "holder",
            token: "version",
            held: &held,
            lease: &format!("lock_key = ? AND holder = ? AND version = ? AND {LIVE}"),
            batch_by: "lock_key",
            batch_check: "version = ? AND holder = ?",
            free: &format!(
                "UPDATE {t} SET holder = NULL, label = NULL, expire_time = NULL, reentrant_count = 0"
            ),
        };
        // Only the current hold is locked: the second column is always 1.
        let lock_own = sql!(
            "SELECT reentrant_count, 1 FROM {t} WHERE lock_key = ? AND holder = ? \
             AND version = ? AND {LIVE} FOR UPDATE"
        );
        // The last entry of the current hold: `release_last` under the row lock.
        let release_own = sql!(
            "{} WHERE {} AND reentrant_count <= 1",
            table.free,
            table.lease
        );
        let rows = Statements::new(&table, lock_own, release_own);
        Polled(Optimistic {
            rows: Rows::new(pool, polling, rows),
            create_row: sql!("INSERT IGNORE INTO {t} (lock_key, version) VALUES (?, 0)"),
            // `version` decides (from the old holder and expiry) and leaves
            // its verdict in LAST_INSERT_ID() — the new version (>= 1) if
            // taken, 0 if not — which the later assignments read. They read
            // nothing else that an earlier assignment changes, so the result
            // is the same whether assignments see earlier ones (MySQL, MariaDB
            // by default) or all see the old row (MariaDB's sql_mode
            // SIMULTANEOUS_ASSIGNMENT, part of sql_mode=ORACLE): comparing
            // `version` itself there would read the old version and never
            // set the holder of a row it had just taken. A held row is left
            // unchanged; the OK packet's insert id is the verdict.
            take: sql!(
                "UPDATE {t} SET \
                 version = IF(holder IS NULL OR expire_time <= UTC_TIMESTAMP(6), \
                 LAST_INSERT_ID(version + 1), version + LAST_INSERT_ID(0)), \
                 reentrant_count = IF(LAST_INSERT_ID() > 0, 1, reentrant_count), \
                 holder = IF(LAST_INSERT_ID() > 0, ?, holder), \
                 label = IF(LAST_INSERT_ID() > 0, ?, label), \
                 expire_time = IF(LAST_INSERT_ID() > 0, \
                 UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND, expire_time) \
                 WHERE lock_key = ?"
            ),
            force: sql!(
                "UPDATE {t} SET holder = NULL, label = NULL, expire_time = NULL, reentrant_count = 0 \
                 WHERE lock_key = ? AND {held}"
            ),
        })
    }

    /// One try: `Some(token)` if taken, `None` if held. Creates the key's
    /// row first if it has none (its first acquisition ever).
    async fn take(&self, key: &LockKey, owner: &Owner, opts: &LockOptions) -> Result<Option<u64>> {
        let query = || {
            sqlx::query(self.take.clone())
                .bind(owner.as_str().as_bytes())
                .bind(label_param(opts))
                .bind(micros(opts.ttl()))
                .bind(key.as_bytes())
        };
        let mut deadlocks = 0;
        let mut created = false;
        loop {
            match self.rows.take(&mut deadlocks, query).await? {
                Some(done) if done.last_insert_id() > 0 => return Ok(Some(done.last_insert_id())),
                // Matched (found rows): held.
                Some(done) if done.rows_affected() > 0 => return Ok(None),
                Some(_) if !created => {
                    let create = sqlx::query(self.create_row.clone()).bind(key.as_bytes());
                    self.rows.conns.execute(create).await.db()?;
                    created = true;
                }
                Some(_) | None => return Ok(None),
            }
        }
    }
}

impl RowStrategy for Optimistic {
    fn rows(&self) -> &Rows {
        &self.rows
    }

    const NAME: &'static str = "mysql/optimistic";

    /// `lock_key`, `holder` and `version` (the token).
    fn bind_lease<'q>(query: Query<'q>, lease: &'q Lease) -> Query<'q> {
        query
            .bind(lease.key.as_bytes())
            .bind(lease.owner.as_str().as_bytes())
            .bind(lease.token.get())
    }

    async fn try_acquire(&self, key: &LockKey, opts: &LockOptions) -> Result<Option<Lease>> {
        let owner = opts.owner_or_random();
        let sent = Instant::now();
        if let Some(version) = self.take(key, &owner, opts).await? {
            return Ok(Some(granted(key, &owner, version, opts, sent)));
        }
        self.rows.same_owner(key, opts, &owner).await
    }

    async fn force_release(&self, key: &LockKey) -> Result<bool> {
        let force = sqlx::query(self.force.clone()).bind(key.as_bytes());
        let removed = self.rows.conns.execute(force).await.db()?.rows_affected() > 0;
        if removed {
            tracing::warn!(key = %key, "lock force-released");
        }
        Ok(self.rows.polling.force_released(key, removed))
    }

    /// A key twice in the chunk (two tokens of one key) cannot be checked
    /// by the per-key `CASE` (it would check only one): one by one then.
    fn batchable(chunk: &[&Lease]) -> bool {
        let mut keys = std::collections::HashSet::with_capacity(chunk.len());
        chunk.iter().all(|l| keys.insert(&l.key))
    }

    /// The key list (primary key) finds the rows; the `CASE` on the key
    /// checks each row's version (the token) and holder.
    fn bind_batch<'q>(query: Query<'q>, leases: &[&'q Lease]) -> Query<'q> {
        let query = leases.iter().fold(query, |q, l| q.bind(l.key.as_bytes()));
        leases.iter().fold(query, |q, l| {
            q.bind(l.key.as_bytes())
                .bind(l.token.get())
                .bind(l.owner.as_str().as_bytes())
        })
    }
}
