//! The `lease` reaper: deletes rows that expired longer ago than a grace,
//! in batches, one reaper at a time across processes.
//!
//! Why rows stay at all, and why the grace: a released or expired row is
//! kept so that the key's next grant is an `UPDATE` under that row's lock
//! (a HOT update: no index entry, no bloat) whose token is taken under the
//! lock. The reaper only bounds the table's size, one row per key used in
//! the last grace period. A grant whose statement took its token in
//! `VALUES` (a key without a row) commits within the operation timeout,
//! which is also the sessions' `statement_timeout`; a grace far longer than
//! any statement means no row the reaper deletes can be one such a grant
//! raced with, and tokens keep rising after deletions anyway (they come
//! from the sequence, not from the rows).
//!
//! Each batch is one autocommit statement that first takes a
//! transaction-level advisory lock of the table
//! (`pg_try_advisory_xact_lock(<"fenc">, hashtext('reaper:<base>'))`): a
//! second reaper — in this process or another — that finds it taken stops
//! its pass at once instead of deleting beside the first. The lock ends
//! with the batch's transaction, so a reaper that dies leaves nothing
//! behind. Rows are picked `FOR UPDATE SKIP LOCKED` and re-checked, so a
//! batch never waits for, nor deletes, a row a grant is taking over.

use std::time::Duration;

use fenced_api::{Error, Result};
use fenced_sql::sql;
use sqlx::{Row, SqlStr};

use crate::{
    conn, error::SqlResultExt, lock::PostgresLock, schema::GUARD_CLASS, strategy::lease::micros,
};

/// How long after its expiry a row may be deleted by default: 5 minutes,
/// thirty times the default operation timeout.
pub const DEFAULT_REAP_GRACE: Duration = Duration::from_secs(5 * 60);
/// The shortest grace accepted: 1 minute.
pub const MIN_REAP_GRACE: Duration = Duration::from_secs(60);
/// Rows deleted per statement.
const BATCH: i64 = 500;

/// Stops the background reaper when dropped (or with [`ReaperHandle::stop`]).
#[derive(Debug)]
pub struct ReaperHandle {
    task: tokio::task::JoinHandle<()>,
}

impl ReaperHandle {
    /// Stops the reaper.
    pub fn stop(self) {}
}

impl Drop for ReaperHandle {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// One batch: whether the guard was free, and the rows deleted.
fn batch_sql(lock: &PostgresLock) -> SqlStr {
    let t = lock.config().table().quoted("");
    sql!(
        "WITH g AS (SELECT pg_try_advisory_xact_lock($1, hashtext($2)) AS got), \
         d AS (DELETE FROM {t} WHERE lock_key IN (\
         SELECT lock_key FROM {t} \
         WHERE (SELECT got FROM g) \
         AND expire_at < clock_timestamp() - $3 * interval '1 microsecond' \
         LIMIT $4 FOR UPDATE SKIP LOCKED) \
         AND expire_at < clock_timestamp() - $3 * interval '1 microsecond' \
         RETURNING 1) \
         SELECT (SELECT got FROM g), (SELECT count(*) FROM d)"
    )
}

impl PostgresLock {
    /// One reaper pass with [`DEFAULT_REAP_GRACE`]: see
    /// [`reap_expired_older_than`](Self::reap_expired_older_than).
    ///
    /// # Errors
    ///
    /// As [`reap_expired_older_than`](Self::reap_expired_older_than).
    pub async fn reap_expired(&self) -> Result<Option<u64>> {
        self.reap_expired_older_than(DEFAULT_REAP_GRACE).await
    }

    /// One reaper pass: deletes the rows that expired more than `grace`
    /// ago, 500 per statement, until none is left; returns `Ok(Some(n))`
    /// with the rows deleted. When another reaper of this table (in any
    /// process) is deleting, this pass stops and leaves the rest to it:
    /// `Ok(None)` if it had deleted nothing yet.
    ///
    /// # Errors
    ///
    /// * [`Error::Unsupported`] unless the strategy is `lease` (an
    ///   `advisory` row describes a key's holder and stays).
    /// * [`Error::InvalidOptions`] for a grace under [`MIN_REAP_GRACE`].
    /// * [`Error::Backend`] when the server fails (each statement is
    ///   bounded by the operation timeout).
    pub async fn reap_expired_older_than(&self, grace: Duration) -> Result<Option<u64>> {
        if self.engine().lease().is_none() {
            return Err(Error::Unsupported {
                backend: crate::error::BACKEND,
                what: format!(
                    "the reaper with strategy {} (only lease rows expire in place)",
                    self.config().strategy()
                ),
            });
        }
        if grace < MIN_REAP_GRACE {
            return Err(Error::invalid_options(format!(
                "the reaper's grace must be at least {MIN_REAP_GRACE:?}, got {grace:?}"
            )));
        }
        let statement = batch_sql(self);
        let guard = format!("reaper:{}", self.config().table());
        let mut reaped = 0u64;
        loop {
            let row = self
                .bounded("the reaper", async {
                    let pool = self.engine().pool();
                    conn::on_live_connection(pool.options().get_max_connections(), || {
                        sqlx::query(statement.clone())
                            .bind(GUARD_CLASS)
                            .bind(&guard)
                            .bind(micros(grace))
                            .bind(BATCH)
                            .fetch_one(pool)
                    })
                    .await
                    .db()
                })
                .await?;
            let got: bool = row.try_get(0).db()?;
            let deleted: i64 = row.try_get(1).db()?;
            if !got {
                tracing::debug!(table = %self.config().table(), reaped, "another reaper is running; this pass stops");
                return Ok((reaped > 0).then_some(reaped));
            }
            reaped += u64::try_from(deleted).unwrap_or(0);
            if deleted < BATCH {
                break;
            }
        }
        if reaped > 0 {
            tracing::info!(table = %self.config().table(), reaped, "reaper removed expired lock rows");
        }
        Ok(Some(reaped))
    }

    /// Runs [`reap_expired`](Self::reap_expired) every `every` in the
    /// background until the handle is dropped. Failures are logged, not
    /// fatal. Several processes may each run one: their batches never run
    /// at once.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidOptions`] for an interval under 10 ms;
    /// [`Error::Unsupported`] unless the strategy is `lease`.
    pub fn start_reaper(&self, every: Duration) -> Result<ReaperHandle> {
        if every < Duration::from_millis(10) {
            return Err(Error::invalid_options(
                "the reaper interval must be at least 10ms",
            ));
        }
        if self.engine().lease().is_none() {
            return Err(Error::Unsupported {
                backend: crate::error::BACKEND,
                what: format!(
                    "the reaper with strategy {} (only lease rows expire in place)",
                    self.config().strategy()
                ),
            });
        }
        let lock = self.clone();
        let task = tokio::spawn(async move {
            let mut tick = tokio::time::interval(every);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                if let Err(e) = lock.reap_expired().await {
                    tracing::warn!(error = %e, "lock reaper pass failed");
                }
            }
        });
        Ok(ReaperHandle { task })
    }
}
