//! `unique_key` housekeeping: the batched reaper of expired rows and table metrics.

use std::time::Duration;

use fenced_api::{DistributedLock, Error, LockKey, LockOptions, Result};

use crate::MySqlLock;

/// Rows in a `unique_key` lock table, for monitoring growth (the seeds'
/// "定期监控表大小": thousands of rows mean releases are being skipped).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct TableStats {
    /// All rows.
    pub rows: u64,
    /// Rows already expired and waiting for takeover or the reaper.
    pub expired: u64,
}

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
/// The key under which reapers of one table exclude each other (reserved:
/// do not use `fenced:reaper` as an application key) — using the
/// table's own lock, so no extra mechanism (and no `GET_LOCK`, which Galera lacks).
const REAPER_KEY: &str = "fenced:reaper";

impl MySqlLock {
    fn unique_key_only(&self, what: &str) -> Result<&crate::strategy::unique_key::UniqueKey> {
        self.unique_key().ok_or_else(|| Error::Unsupported {
            backend: "mysql",
            what: format!(
                "{what} with strategy {} (only unique_key rows expire in place)",
                self.config().strategy()
            ),
        })
    }

    /// One reaper pass: deletes expired rows in batches of 500. Only one node
    /// reaps a table at a time: the pass first takes the table's own
    /// `fenced:reaper` lock and returns `Ok(None)` if another node holds it.
    ///
    /// # Errors
    ///
    /// [`Error::Unsupported`] unless the strategy is `unique_key`;
    /// [`Error::Backend`] when the server fails.
    pub async fn reap_expired(&self) -> Result<Option<u64>> {
        let uk = self.unique_key_only("the reaper")?;
        let key = LockKey::new(REAPER_KEY)?;
        let opts = LockOptions::builder()
            .ttl(Duration::from_secs(60))
            .build()?;
        let Some(guard) = self.try_acquire(&key, &opts).await? else {
            return Ok(None);
        };
        let reaped = uk.reap(BATCH).await;
        self.release(&guard).await?;
        let reaped = reaped?;
        if reaped > 0 {
            tracing::info!(table = %self.config().table(), reaped, "reaper removed expired lock rows");
        }
        Ok(Some(reaped))
    }

    /// Deletes rows that expired more than `older_than` ago, in batches — the
    /// seeds' daily low-traffic purge. Unlike [`reap_expired`](Self::reap_expired)
    /// it is not guarded: deletes of long-dead rows are idempotent.
    ///
    /// # Errors
    ///
    /// As [`reap_expired`](Self::reap_expired).
    pub async fn purge_stale(&self, older_than: Duration) -> Result<u64> {
        self.unique_key_only("purge")?
            .purge(older_than, BATCH)
            .await
    }

    /// Row counts of the lock table.
    ///
    /// # Errors
    ///
    /// As [`reap_expired`](Self::reap_expired).
    pub async fn table_stats(&self) -> Result<TableStats> {
        let (rows, expired) = self.unique_key_only("table stats")?.table_size().await?;
        Ok(TableStats { rows, expired })
    }

    /// Runs [`reap_expired`](Self::reap_expired) every `every` in the
    /// background until the handle is dropped. Failures are logged, not fatal.
    ///
    /// # Errors
    ///
    /// [`Error::Unsupported`] unless the strategy is `unique_key`;
    /// [`Error::InvalidOptions`] for an interval under 10 ms.
    pub fn spawn_reaper(&self, every: Duration) -> Result<ReaperHandle> {
        self.unique_key_only("the reaper")?;
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
                if let Err(e) = lock.reap_expired().await {
                    tracing::warn!(error = %e, "lock reaper pass failed");
                }
            }
        });
        Ok(ReaperHandle { task })
    }
}
