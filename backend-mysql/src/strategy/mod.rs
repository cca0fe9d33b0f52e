//! The three strategies, each a `DistributedLock` over the shared pool.

use std::time::Duration;

use fenced_api::{wait::Backoff, Result};

use crate::error;

pub(crate) mod optimistic;
pub(crate) mod row_lock;
pub(crate) mod rows;
pub(crate) mod unique_key;

/// A TTL as whole microseconds, for `UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND`.
/// TTLs are validated (≤ 24 h), so this cannot overflow.
pub(crate) fn micros(ttl: Duration) -> u64 {
    ttl.as_micros().min(u128::from(u64::MAX)) as u64
}

/// The label to store for an acquisition: NULL without one.
pub(crate) fn label_param(opts: &fenced_api::LockOptions) -> Option<&[u8]> {
    opts.label().map(|l| l.as_str().as_bytes())
}

/// How long a release keeps retrying statements that lost a deadlock or a
/// lock wait (it stays within the operation timeout the caller bounds it by).
const CONFLICT_RETRY_FOR: Duration = Duration::from_secs(3);

/// The pause between those retries: short, jittered, growing to 20 ms.
const CONFLICT_BACKOFF: Backoff = Backoff::new(Duration::from_millis(1), Duration::from_millis(20));

/// Runs a statement (or transaction) that may lose a deadlock or a lock wait
/// to a concurrent one — concurrent releases of re-entered entries do, and
/// so does a holder's DELETE against contenders whose refused
/// `INSERT … ON DUPLICATE KEY UPDATE` locks the same row — and retries it,
/// with a short jittered pause, for up to 3 s: the loser was rolled back
/// and changed nothing, and a release that gave up would leave the key
/// taken until its TTL.
pub(crate) async fn retry_lock_conflicts<T, F, Fut>(mut op: F) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = std::result::Result<T, sqlx::Error>>,
{
    let start = tokio::time::Instant::now();
    let mut attempt = 0;
    loop {
        match op().await {
            Err(e) if error::is_lock_conflict(&e) && start.elapsed() < CONFLICT_RETRY_FOR => {
                tokio::time::sleep(CONFLICT_BACKOFF.delay(attempt)).await;
                attempt += 1;
            }
            other => return other.map_err(error::map),
        }
    }
}
