//! C8 and C9: waiting for a held key.

use std::time::Duration;

use fenced_api::{DistributedLock, Error, LockOptions};
use tokio::time::Instant;

use super::{expiry_slack, fresh_key, ttl_opts};
use crate::{
    check::{ensure, fail, some, CaseResult, Failure, Outcome},
    Harness,
};

/// Generous bound on a hand-off: catches a waiter that only notices the
/// release at its next long poll or at the TTL, not ordinary latency.
const HANDOFF_BOUND: Duration = Duration::from_millis(1500);

/// C8: a waiter gets the lock promptly when the holder releases mid-wait.
pub async fn waiter_gets_lock_on_release(h: &dyn Harness) -> CaseResult {
    let (a, b) = (h.client().await?, h.client().await?);
    let key = fresh_key("c08");
    // TTL far above the hand-off bound, so only the release can explain it.
    let opts = LockOptions::builder()
        .ttl(h.base_ttl() * 20)
        .wait_timeout(h.base_ttl() * 20)
        .build()?;
    let lease = some(a.try_acquire(&key, &opts).await?, "a free key")?;
    let waiter = {
        let (key, opts) = (key.clone(), opts.clone());
        tokio::spawn(async move {
            let l = b.acquire(&key, &opts).await;
            (l, Instant::now(), b)
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    ensure!(
        !waiter.is_finished(),
        "the waiter finished while the key was held"
    );
    let released_at = Instant::now();
    a.release(&lease).await?;
    let (got, at, b) = waiter
        .await
        .map_err(|e| Failure(format!("waiter panicked: {e}")))?;
    let got = got?;
    let gap = at.saturating_duration_since(released_at);
    ensure!(
        got.token > lease.token,
        "hand-off token {} ≤ {}",
        got.token,
        lease.token
    );
    ensure!(
        gap < HANDOFF_BOUND,
        "the waiter got the key {gap:?} after the release"
    );
    b.release(&got).await?;
    Ok(Outcome::Passed)
}

/// C8/C5: a waiter gets the lock once a crashed holder's TTL runs out.
pub async fn waiter_gets_lock_on_expiry(h: &dyn Harness) -> CaseResult {
    let (a, b) = (h.client().await?, h.client().await?);
    let key = fresh_key("c08e");
    let short = ttl_opts(h.base_ttl())?;
    let crashed = some(a.try_acquire(&key, &short).await?, "a free key")?;
    let wait = LockOptions::builder()
        .ttl(h.base_ttl() * 10)
        .wait_timeout(expiry_slack(crashed.ttl) * 2)
        .build()?;
    let start = Instant::now();
    let got = b.acquire(&key, &wait).await?;
    ensure!(
        got.token > crashed.token,
        "token {} ≤ crashed holder's {}",
        got.token,
        crashed.token
    );
    ensure!(
        start.elapsed() <= expiry_slack(crashed.ttl),
        "the waiter got the key only {:?} later (ttl {:?})",
        start.elapsed(),
        crashed.ttl
    );
    b.release(&got).await?;
    Ok(Outcome::Passed)
}

/// C9: `acquire` gives up with `Timeout` close to its wait bound.
pub async fn acquire_times_out_near_bound(h: &dyn Harness) -> CaseResult {
    let (a, b) = (h.client().await?, h.client().await?);
    let key = fresh_key("c09");
    let long = ttl_opts(h.base_ttl() * 20)?;
    let lease = some(a.try_acquire(&key, &long).await?, "a free key")?;
    let bound = Duration::from_millis(600);
    let opts = long.to_builder().wait_timeout(bound).build()?;
    let start = Instant::now();
    let res = b.acquire(&key, &opts).await;
    let took = start.elapsed();
    match res {
        Err(Error::Timeout { waited, .. }) => {
            ensure!(
                waited >= bound.mul_f32(0.9),
                "reported wait {waited:?} below the bound {bound:?}"
            );
        }
        other => fail!("acquire on a held key returned {other:?}, expected Timeout"),
    }
    ensure!(
        took + Duration::from_millis(20) >= bound,
        "gave up after {took:?}, before the bound {bound:?}"
    );
    ensure!(
        took < bound + Duration::from_millis(1500),
        "gave up only after {took:?} (bound {bound:?})"
    );
    ensure!(
        a.inspect(&key)
            .await?
            .is_some_and(|i| i.token == lease.token),
        "the timed-out waiter disturbed the holder"
    );
    a.release(&lease).await?;
    Ok(Outcome::Passed)
}
