//! The cases, grouped by theme. Each is `async fn(&dyn Harness) -> CaseResult`;
//! the one list that names them all is in `lib.rs` (`__with_cases!`).

use std::{sync::Arc, time::Duration};

use fenced_api::{DistributedLock, FencingToken, Lease, LockClient, LockKey, LockOptions};
use tokio::time::Instant;

use crate::{
    check::{some, Failure},
    Harness,
};

pub mod basic;
pub mod client;
pub mod expiry;
pub mod fencing;
pub mod input;
pub mod label;
pub mod multi;
pub mod owner;
pub mod rwlock;
pub mod semaphore;
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

/// Two clients of the store under test, a fresh key tagged `tag`, options
/// with `ttl`, and the first client's lease on that key (a free key: it
/// must be granted).
pub(crate) async fn one_of_two_holds(
    h: &dyn Harness,
    tag: &str,
    ttl: Duration,
) -> Result<
    (
        Arc<dyn DistributedLock>,
        Arc<dyn DistributedLock>,
        LockKey,
        LockOptions,
        Lease,
    ),
    Failure,
> {
    let (a, b) = (h.client().await?, h.client().await?);
    let key = fresh_key(tag);
    let opts = ttl_opts(ttl)?;
    let lease = some(a.try_acquire(&key, &opts).await?, "a lease on a free key")?;
    Ok((a, b, key, opts, lease))
}

/// A fresh key tagged `tag`, a `LockClient` with `ttl` on one client of
/// the store under test, and another client of the store.
pub(crate) async fn client_and_store(
    h: &dyn Harness,
    tag: &str,
    ttl: Duration,
) -> Result<(LockKey, LockClient, Arc<dyn DistributedLock>), Failure> {
    let key = fresh_key(tag);
    let client = LockClient::builder(h.client().await?).ttl(ttl).build()?;
    let other = h.client().await?;
    Ok((key, client, other))
}

/// `next`, the token of a later grant, must be above `prev`; `when` says
/// which grant it is in the message.
pub(crate) fn rises(next: FencingToken, prev: FencingToken, when: &str) -> Result<(), Failure> {
    if next > prev {
        Ok(())
    } else {
        Err(Failure(format!("token {when}: {next} ≤ {prev}")))
    }
}

/// `lock.inspect(key)` must show the lease with `token`; `what` says what
/// disturbed it otherwise.
pub(crate) async fn held_with(
    lock: &dyn DistributedLock,
    key: &LockKey,
    token: FencingToken,
    what: &str,
) -> Result<(), Failure> {
    if lock.inspect(key).await?.is_some_and(|i| i.token == token) {
        Ok(())
    } else {
        Err(Failure(what.to_owned()))
    }
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
