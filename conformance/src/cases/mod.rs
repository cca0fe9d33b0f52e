//! The cases, grouped by theme. Each is `async fn(&dyn Harness) -> CaseResult`;
//! the one list that names them all is in `lib.rs` (`__with_cases!`).

use std::{sync::Arc, time::Duration};

use fenced_api::{DistributedLock, Lease, LockKey, LockOptions};
use tokio::time::Instant;

use crate::check::Failure;

pub mod basic;
pub mod client;
pub mod expiry;
pub mod fencing;
pub mod input;
pub mod label;
pub mod owner;
pub mod waiting;

/// A key unique to this case invocation, so cases never meet even when
/// several share a namespace.
pub(crate) fn fresh_key(tag: &str) -> LockKey {
    let id = uuid::Uuid::new_v4().simple().to_string();
    // Tags are ASCII and short; a failure here is a bug in the suite itself.
    LockKey::new(format!("{tag}/{}", &id[..12])).unwrap_or_else(|e| panic!("suite key: {e}"))
}

/// Options with the given TTL (bounded by the suite itself, so valid).
pub(crate) fn ttl_opts(ttl: Duration) -> Result<LockOptions, Failure> {
    Ok(LockOptions::builder().ttl(ttl).build()?)
}

/// Polls `try_acquire` every 20 ms until granted or `bound` passes.
/// Returns the lease and how long it took.
pub(crate) async fn acquire_within(
    lock: &Arc<dyn DistributedLock>,
    key: &LockKey,
    opts: &LockOptions,
    bound: Duration,
) -> Result<(Lease, Duration), Failure> {
    let start = Instant::now();
    loop {
        if let Some(lease) = lock.try_acquire(key, opts).await? {
            return Ok((lease, start.elapsed()));
        }
        if start.elapsed() > bound {
            return Err(Failure(format!(
                "`{key}` was still held {:?} later (bound {bound:?})",
                start.elapsed()
            )));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Slack added to TTL-based waits: store expiry is not instant (etcd's lessor
/// checks every 500 ms, for instance). Only an upper bound that catches hangs.
pub(crate) fn expiry_slack(ttl: Duration) -> Duration {
    ttl + Duration::from_secs(2)
}
