//! Housekeeping: `unique_key`'s batched reaper of expired rows and purge,
//! and the background task that also publishes every strategy's table size.

use std::time::Duration;

use fenced_api::{DistributedLock, Error, LockKey, LockOptions, Result};

use crate::config::Strategy;
use crate::error::BACKEND;
use crate::lock::MySqlLock;
use crate::strategy::unique_key::{UniqueKey, REAPER_KEY};

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

const BATCH: u32 = 500;
/// TTL of the reaper's guard lock.
const GUARD_TTL: Duration = Duration::from_secs(60);

impl MySqlLock {
    fn unique_key_only(&self, what: &str) -> Result<&UniqueKey> {
        self.unique_key().ok_or_else(|| Error::Unsupported {
            backend: BACKEND,
            what: format!(
                "{what} with strategy {} (only unique_key rows expire in place)",
                self.config().strategy()
            ),
        })
    }

    /// One reaper pass: deletes expired rows in batches of 500. Only one node
    /// reaps a table at a time: the pass first takes the table's own
    /// `fenced:reaper` lock (TTL 60 s) and returns `Ok(None)` if another
    /// node holds it.
    ///
    /// A pass stops starting batches once half the guard's TTL has gone by
    /// (each batch is bounded by the operation timeout, 10 s by default), so
    /// the guard cannot lapse while this node still deletes and a second
    /// node start a pass of its own; what is left goes to the next pass.
    /// The guard's own row is never among the deleted rows.
    ///
    /// # Errors
    ///
    /// [`Error::Unsupported`] unless the strategy is `unique_key`;
    /// [`Error::Backend`] when the server fails.
    pub async fn reap_expired(&self) -> Result<Option<u64>> {
        let uk = self.unique_key_only("the reaper")?;
        let key = LockKey::new(REAPER_KEY)?;
        let opts = LockOptions::builder().ttl(GUARD_TTL).build()?;
        let Some(guard) = self.try_acquire(&key, &opts).await? else {
            return Ok(None);
        };
        // Half the guard's TTL, counted from when its INSERT was sent: the
        // last batch may start just before it and then run for at most the
        // operation timeout, which must fit in the other half.
        let stop_at = guard.deadline - GUARD_TTL / 2;
        let pass = uk
            .reap(BATCH, stop_at, self.config().operation_timeout)
            .await;
        self.release(&guard).await?;
        let pass = pass?;
        if pass.reaped > 0 {
            crate::stats::reaped(self, pass.reaped);
            tracing::info!(table = %self.config().table(), reaped = pass.reaped, "reaper removed expired lock rows");
        }
        if !pass.finished {
            tracing::info!(
                table = %self.config().table(),
                reaped = pass.reaped,
                "reaper pass stopped at its time bound (half the guard's TTL); the next pass continues"
            );
        }
        Ok(Some(pass.reaped))
    }

    /// Deletes rows that expired more than `older_than` ago, in batches — a
    /// purge for a quiet hour (daily, say). Unlike
    /// [`reap_expired`](Self::reap_expired) it is not guarded: deletes of
    /// long-dead rows are idempotent.
    ///
    /// # Errors
    ///
    /// As [`reap_expired`](Self::reap_expired).
    pub async fn purge_stale(&self, older_than: Duration) -> Result<u64> {
        self.unique_key_only("purge")?
            .purge(older_than, BATCH)
            .await
    }

    /// Runs housekeeping every `every` in the background until the handle
    /// is dropped. Failures are logged, not fatal.
    ///
    /// Each pass, for every strategy, publishes the table size
    /// ([`record_table_stats`](Self::record_table_stats): the
    /// `fenced_table_rows` / `fenced_table_expired_rows` gauges and a
    /// `tracing` event). For `unique_key` it first runs
    /// [`reap_expired`](Self::reap_expired). The other strategies have
    /// nothing to delete — an `optimistic` row's `version` is its key's
    /// fencing token and a `row_lock` row is what gets locked — so their
    /// passes only measure. Because the strategy comes from the URL, the
    /// same call works whatever an operator configures.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidOptions`] for an interval under 10 ms.
    pub fn spawn_reaper(&self, every: Duration) -> Result<ReaperHandle> {
        if every < Duration::from_millis(10) {
            return Err(Error::invalid_options(
                "the reaper interval must be at least 10ms",
            ));
        }
        let lock = self.clone();
        let task = tokio::spawn(async move {
            let mut tick = tokio::time::interval(every);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                lock.housekeeping_pass().await;
            }
        });
        Ok(ReaperHandle { task })
    }

    /// One background pass: reap (`unique_key`), then measure and publish.
    async fn housekeeping_pass(&self) {
        if self.config().strategy() == Strategy::UniqueKey {
            if let Err(e) = self.reap_expired().await {
                tracing::warn!(error = %e, "lock reaper pass failed");
            }
        }
        if let Err(e) = self.record_table_stats().await {
            tracing::warn!(error = %e, "measuring the lock tables failed");
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use sqlx::Row;
    use tokio::time::Instant;

    use super::*;
    use crate::strategy::unique_key::Pass;

    /// A pass ends at its time bound (after at least one batch), and never
    /// deletes the reaper's own guard row, even an expired one.
    #[tokio::test]
    async fn a_pass_stops_at_its_bound_and_spares_the_guard_row() {
        let server = fenced_conformance::services::mysql_url();
        let base = format!(
            "fenced_reap_{}",
            &uuid::Uuid::new_v4().simple().to_string()[..12]
        );
        let url = format!("{server}?table={base}&strategy=unique_key");
        MySqlLock::migrate(&url).await.unwrap();
        let lock = MySqlLock::connect(&url).await.unwrap();
        let pool = sqlx::MySqlPool::connect(&server).await.unwrap();
        // Dead rows, seconds since they expired; the guard row expired
        // longest ago: first in the reaper's order.
        let dead = [
            (REAPER_KEY, 100),
            ("a", 50),
            ("b", 40),
            ("c", 30),
            ("d", 20),
            ("e", 10),
        ];
        let values: Vec<String> = dead
            .iter()
            .map(|(key, ago)| {
                format!("('{key}', 'dead', 1, UTC_TIMESTAMP(6) - INTERVAL {ago} SECOND, UTC_TIMESTAMP(6))")
            })
            .collect();
        let insert = format!(
            "INSERT INTO `{base}` (lock_key, owner, reentrant_count, expire_time, create_time) VALUES {}",
            values.join(", ")
        );
        sqlx::raw_sql(sqlx::AssertSqlSafe(insert))
            .execute(&pool)
            .await
            .unwrap();
        let uk = lock.unique_key().unwrap();
        let op = Duration::from_secs(10);
        // Bound already passed: exactly one batch.
        let pass = uk.reap(2, Instant::now(), op).await.unwrap();
        assert_eq!(
            pass,
            Pass {
                reaped: 2,
                finished: false
            }
        );
        let far = Instant::now() + Duration::from_secs(60);
        let pass = uk.reap(2, far, op).await.unwrap();
        assert_eq!(
            pass,
            Pass {
                reaped: 3,
                finished: true
            }
        );
        let select = format!("SELECT lock_key FROM `{base}`");
        let left = sqlx::query(sqlx::AssertSqlSafe(select))
            .fetch_all(&pool)
            .await
            .unwrap();
        let left: Vec<Vec<u8>> = left.iter().map(|r| r.get(0)).collect();
        assert_eq!(left, vec![REAPER_KEY.as_bytes().to_vec()]);
        // A full pass through the guard: takes over the dead guard row
        // (inline takeover), reaps nothing else, releases.
        assert_eq!(lock.reap_expired().await.unwrap(), Some(0));
        let tables: Vec<String> = ["", "_optimistic", "_rows", "_fence", "_live", "_migrations"]
            .iter()
            .map(|suffix| format!("`{base}{suffix}`"))
            .collect();
        let drop = format!("DROP TABLE {}", tables.join(", "));
        sqlx::query(sqlx::AssertSqlSafe(drop))
            .execute(&pool)
            .await
            .unwrap();
    }
}
