//! `optimistic`: one permanent row per key taken with a conditional UPDATE
//! (the seeds' "乐观锁版本号" posture).
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
use crate::sql;

#[derive(Debug)]
pub(crate) struct Optimistic {
    conns: Conns,
    scope: String,
    take: SqlStr,
    create_row: SqlStr,
    reenter: SqlStr,
    held_by: SqlStr,
    extend: SqlStr,
    /// `extend` for many keys of one holder: this, then the key list and
    /// the per-key version check (see `extend_chunk`).
    extend_batch: String,
    release_last: SqlStr,
    release_one: SqlStr,
    lock_own: SqlStr,
    inspect: SqlStr,
    list: SqlStr,
    force: SqlStr,
}

impl Optimistic {
    /// The connections (for statements outside the lock operations).
    pub(crate) fn conns(&self) -> &Conns {
        &self.conns
    }
}

impl Optimistic {
    pub(crate) fn new(pool: MySqlPool, table: String, scope: String) -> Self {
        let t = &table;
        let current = "holder = ? AND version = ? AND expire_time > UTC_TIMESTAMP(6)";
        Optimistic {
            conns: Conns::new(pool),
            scope,
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
            reenter: sql!(
                "UPDATE {t} SET reentrant_count = reentrant_count + 1, version = LAST_INSERT_ID(version), \
                 expire_time = GREATEST(expire_time, UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND) \
                 WHERE lock_key = ? AND holder = ? AND expire_time > UTC_TIMESTAMP(6)"
            ),
            held_by: sql!(
                "SELECT 1 FROM {t} WHERE lock_key = ? AND holder = ? AND expire_time > UTC_TIMESTAMP(6)"
            ),
            // Re-entered holds never have their expiry cut by one entry's extend.
            extend: sql!(
                "UPDATE {t} SET expire_time = IF(reentrant_count > 1, \
                 GREATEST(expire_time, UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND), \
                 UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND) \
                 WHERE lock_key = ? AND {current}"
            ),
            extend_batch: format!(
                "UPDATE {t} SET expire_time = IF(reentrant_count > 1, \
                 GREATEST(expire_time, UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND), \
                 UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND) \
                 WHERE holder = ? AND expire_time > UTC_TIMESTAMP(6) AND lock_key IN ("
            ),
            release_last: sql!(
                "UPDATE {t} SET holder = NULL, label = NULL, expire_time = NULL, reentrant_count = 0 \
                 WHERE lock_key = ? AND {current} AND reentrant_count <= 1"
            ),
            release_one: sql!(
                "UPDATE {t} SET reentrant_count = LAST_INSERT_ID(reentrant_count - 1) \
                 WHERE lock_key = ? AND {current} AND reentrant_count > 1"
            ),
            lock_own: sql!(
                "SELECT reentrant_count FROM {t} WHERE lock_key = ? AND {current} FOR UPDATE"
            ),
            inspect: sql!(
                "SELECT holder, version, reentrant_count, \
                 TIMESTAMPDIFF(MICROSECOND, UTC_TIMESTAMP(6), expire_time), label \
                 FROM {t} WHERE lock_key = ? AND holder IS NOT NULL AND expire_time > UTC_TIMESTAMP(6)"
            ),
            // Walks the primary key (lock_key) in order, skipping free and
            // expired rows, until `limit` held ones.
            list: sql!(
                "SELECT holder, version, reentrant_count, \
                 TIMESTAMPDIFF(MICROSECOND, UTC_TIMESTAMP(6), expire_time), label, lock_key \
                 FROM {t} WHERE holder IS NOT NULL AND expire_time > UTC_TIMESTAMP(6) \
                 ORDER BY lock_key LIMIT ?"
            ),
            force: sql!(
                "UPDATE {t} SET holder = NULL, label = NULL, expire_time = NULL, reentrant_count = 0 \
                 WHERE lock_key = ? AND holder IS NOT NULL AND expire_time > UTC_TIMESTAMP(6)"
            ),
        }
    }

    /// One try: `Some(token)` if taken, `None` if held. Creates the key's
    /// row first if it has none (its first acquisition ever).
    async fn take(&self, key: &LockKey, owner: &Owner, opts: &LockOptions) -> Result<Option<u64>> {
        let mut deadlocks = 0;
        let mut created = false;
        loop {
            let res = self
                .conns
                .execute(
                    sqlx::query(self.take.clone())
                        .bind(owner.as_str().as_bytes())
                        .bind(label_param(opts))
                        .bind(micros(opts.ttl()))
                        .bind(key.as_bytes()),
                )
                .await;
            match res {
                Ok(done) if done.last_insert_id() > 0 => return Ok(Some(done.last_insert_id())),
                // Matched (found rows): held.
                Ok(done) if done.rows_affected() > 0 => return Ok(None),
                Ok(_) if created => return Ok(None),
                Ok(_) => {
                    self.conns
                        .execute(sqlx::query(self.create_row.clone()).bind(key.as_bytes()))
                        .await
                        .db()?;
                    created = true;
                }
                // A deadlock victim was rolled back and says nothing about
                // this key: try again.
                Err(e) if error::number(&e) == Some(error::code::DEADLOCK) && deadlocks < 3 => {
                    deadlocks += 1;
                }
                Err(e) if error::is_lock_conflict(&e) => return Ok(None),
                Err(e) => return Err(error::map(e)),
            }
        }
    }

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
}

impl Optimistic {
    async fn release_once(
        &self,
        lease: &Lease,
    ) -> std::result::Result<ReleaseOutcome, sqlx::Error> {
        let mut c = self.conns.get().await?;
        let done = self
            .bind(self.release_last.clone(), lease)
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
        // lock, so concurrent releases of re-entered entries never race. On
        // any failure the connection is closed, never reused mid-transaction.
        let outcome = self.release_slow(c.conn(), lease).await?;
        c.settle(None);
        match outcome {
            ReleaseOutcome::Released => notify_released(&self.scope, &lease.key),
            ReleaseOutcome::NotHeld => {
                tracing::warn!(key = %lease.key, token = %lease.token, "release of a lease that was no longer held")
            }
            _ => {}
        }
        Ok(outcome)
    }

    fn bind<'q>(
        &self,
        sql: SqlStr,
        lease: &'q Lease,
    ) -> sqlx::query::Query<'q, sqlx::MySql, sqlx::mysql::MySqlArguments> {
        sqlx::query(sql)
            .bind(lease.key.as_bytes())
            .bind(lease.owner.as_str().as_bytes())
            .bind(lease.token.get())
    }

    async fn release_slow(
        &self,
        conn: &mut MySqlConnection,
        lease: &Lease,
    ) -> std::result::Result<ReleaseOutcome, sqlx::Error> {
        let mut tx = sqlx::Connection::begin(conn).await?;
        let row = self
            .bind(self.lock_own.clone(), lease)
            .fetch_optional(&mut *tx)
            .await?;
        let outcome = match row {
            Some(r) => {
                let count: u32 = r.try_get(0)?;
                if count > 1 {
                    self.bind(self.release_one.clone(), lease)
                        .execute(&mut *tx)
                        .await?;
                    ReleaseOutcome::StillHeld {
                        remaining: count - 1,
                    }
                } else {
                    self.bind(self.release_last.clone(), lease)
                        .execute(&mut *tx)
                        .await?;
                    ReleaseOutcome::Released
                }
            }
            None => ReleaseOutcome::NotHeld,
        };
        tx.commit().await?;
        Ok(outcome)
    }
}

#[async_trait]
impl DistributedLock for Optimistic {
    async fn try_acquire(&self, key: &LockKey, opts: &LockOptions) -> Result<Option<Lease>> {
        let owner = opts.owner_or_random();
        let ttl = opts.ttl();
        let sent = Instant::now();
        if let Some(version) = self.take(key, &owner, opts).await? {
            return Ok(Some(Lease::new(
                key.clone(),
                owner,
                FencingToken::new(version),
                ttl,
                sent,
            )));
        }
        if opts.owner().is_some() {
            let sent = Instant::now();
            if let Some(version) = self.same_owner(key, opts, &owner).await? {
                return Ok(Some(Lease::new(
                    key.clone(),
                    owner,
                    FencingToken::new(version),
                    ttl,
                    sent,
                )));
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
                    .bind(lease.key.as_bytes())
                    .bind(lease.owner.as_str().as_bytes())
                    .bind(lease.token.get()),
            )
            .await
            .db()?;
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

    /// The rows with a holder whose expiry (server clock) is still ahead,
    /// first `limit` in key order: one `SELECT` walking the primary key
    /// (`lock_key`). Rows stay after release (one per key ever locked), and
    /// there is no index on `expire_time`, so the scan reads free rows too:
    /// O(rows read until `limit` held ones are found), at worst the table.
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
        let done = self
            .conns
            .execute(sqlx::query(self.force.clone()).bind(key.as_bytes()))
            .await
            .db()?;
        let removed = done.rows_affected() > 0;
        if removed {
            tracing::warn!(key = %key, "lock force-released");
            notify_released(&self.scope, key);
        }
        Ok(removed)
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities::none()
            .backend("mysql/optimistic")
            .durable(true)
            .fencing(true)
            .reentrant(true)
    }
}

#[async_trait]
impl ExtendChunk for Optimistic {
    /// One UPDATE: the key list (primary key) finds the rows, a `CASE` on
    /// the key checks each row's version (the token). Found rows equal to
    /// the chunk's size means all were renewed; fewer, or a key twice in the
    /// chunk (two tokens of one key: the `CASE` would check only one), and
    /// the chunk is renewed one by one.
    async fn extend_chunk(
        &self,
        owner: &Owner,
        chunk: &[&Lease],
        ttl: Duration,
    ) -> Result<ChunkVerdict> {
        let mut keys = std::collections::HashSet::with_capacity(chunk.len());
        if !chunk.iter().all(|l| keys.insert(&l.key)) {
            return Ok(ChunkVerdict::Unknown);
        }
        let places = fenced_api::batch::padded_len(chunk.len());
        let mut text = self.extend_batch.clone();
        text.push_str(&vec!["?"; places].join(", "));
        text.push_str(") AND CASE lock_key");
        text.push_str(&" WHEN ? THEN version = ?".repeat(places));
        text.push_str(" ELSE FALSE END");
        let mut query = sqlx::query(sql!("{text}"))
            .bind(micros(ttl))
            .bind(micros(ttl))
            .bind(owner.as_str().as_bytes());
        let at = |p: usize| chunk[p.min(chunk.len() - 1)];
        for p in 0..places {
            query = query.bind(at(p).key.as_bytes());
        }
        for p in 0..places {
            query = query.bind(at(p).key.as_bytes()).bind(at(p).token.get());
        }
        let done = self.conns.execute(query).await.db()?;
        Ok(if done.rows_affected() == chunk.len() as u64 {
            ChunkVerdict::All
        } else {
            ChunkVerdict::Unknown
        })
    }
}
