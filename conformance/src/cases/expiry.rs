//! C5, C6, C15, C16: TTL expiry, extension, and what dropped guards and
//! cancelled futures leave behind.

use std::time::Duration;

use fenced_api::{DistributedLock, LockClient, ReleaseOutcome};
use tokio::time::Instant;

use super::{acquire_within, expiry_slack, fresh_key, ttl_opts};
use crate::{
    check::{ensure, some, CaseResult, Outcome},
    Harness,
};

/// C5: a holder that stops renewing keeps the key for its TTL, then loses it
/// to another client.
pub async fn expiry_frees_key(h: &dyn Harness) -> CaseResult {
    let (a, b) = (h.client().await?, h.client().await?);
    let key = fresh_key("c05");
    let opts = ttl_opts(h.base_ttl())?;
    let lease = some(a.try_acquire(&key, &opts).await?, "a lease on a free key")?;
    let (taken, after) = acquire_within(&b, &key, &opts, expiry_slack(lease.ttl)).await?;
    ensure!(
        taken.token > lease.token,
        "token after expiry {} ≤ {}",
        taken.token,
        lease.token
    );
    // The grant must not come long before the TTL (the store honours it).
    ensure!(
        after + Duration::from_millis(100) >= lease.ttl / 2,
        "the key was taken over after {after:?}, well before its ttl {:?}",
        lease.ttl
    );
    b.release(&taken).await?;
    Ok(Outcome::Passed)
}

/// C5: the key stays held for (most of) its TTL: no early expiry.
pub async fn held_until_ttl(h: &dyn Harness) -> CaseResult {
    let (a, b) = (h.client().await?, h.client().await?);
    let key = fresh_key("c05h");
    let opts = ttl_opts(h.base_ttl() * 2)?;
    let lease = some(a.try_acquire(&key, &opts).await?, "a lease on a free key")?;
    let checkpoint = lease.deadline - lease.ttl / 4;
    while Instant::now() < checkpoint {
        ensure!(
            b.try_acquire(&key, &opts).await?.is_none(),
            "the key was free {:?} before the end of its ttl",
            lease.remaining()
        );
        tokio::time::sleep(lease.ttl / 8).await;
    }
    let info = some(b.inspect(&key).await?, "the still-valid lock")?;
    ensure!(
        info.token == lease.token,
        "inspect shows token {}",
        info.token
    );
    a.release(&lease).await?;
    Ok(Outcome::Passed)
}

/// C6: `extend` keeps the lock alive well past the original TTL while a
/// contender keeps failing; the extended lease is still the holder's.
pub async fn extend_keeps_lock(h: &dyn Harness) -> CaseResult {
    let (a, b) = (h.client().await?, h.client().await?);
    let key = fresh_key("c06");
    let ttl = h.base_ttl();
    let opts = ttl_opts(ttl)?;
    let mut lease = some(a.try_acquire(&key, &opts).await?, "a lease on a free key")?;
    let first_token = lease.token;
    let until = Instant::now() + lease.ttl * 3;
    while Instant::now() < until {
        tokio::time::sleep(lease.ttl / 3).await;
        lease = a.extend(&lease, ttl).await?;
        ensure!(lease.token == first_token, "extend changed the token");
        ensure!(
            b.try_acquire(&key, &opts).await?.is_none(),
            "a contender got an extended lock"
        );
    }
    ensure!(
        a.release(&lease).await? == ReleaseOutcome::Released,
        "release after extending"
    );
    Ok(Outcome::Passed)
}

/// C15: dropping a `LockGuard` without `release` frees the key promptly
/// (the release is spawned), and at the TTL at the latest.
pub async fn dropped_guard_frees_key(h: &dyn Harness) -> CaseResult {
    let key = fresh_key("c15");
    let ttl = h.base_ttl() * 10;
    let client = LockClient::builder(h.client().await?).ttl(ttl).build()?;
    let other = h.client().await?;
    let guard = client.acquire(&key).await?;
    let token = guard.token();
    drop(guard);
    let opts = ttl_opts(ttl)?;
    // Well under the 10×base TTL: proves the spawned release, not expiry.
    let (lease, _) = acquire_within(&other, &key, &opts, h.base_ttl() * 5).await?;
    ensure!(
        lease.token > token,
        "token after drop {} ≤ {}",
        lease.token,
        token
    );
    other.release(&lease).await?;
    Ok(Outcome::Passed)
}

/// C16: an `acquire` future dropped mid-wait leaves no lock behind (at most
/// until its TTL): once the holder releases, another client gets the key.
pub async fn cancelled_acquire_leaves_no_lock(h: &dyn Harness) -> CaseResult {
    let (a, b, c) = (h.client().await?, h.client().await?, h.client().await?);
    let key = fresh_key("c16");
    let long = ttl_opts(h.base_ttl() * 20)?;
    let held = some(a.try_acquire(&key, &long).await?, "a lease on a free key")?;
    let waiter_opts = ttl_opts(h.base_ttl())?;
    let waited = tokio::time::timeout(h.base_ttl() / 2, b.acquire(&key, &waiter_opts)).await;
    ensure!(
        waited.is_err(),
        "the waiter finished ({waited:?}) while the key was held"
    );
    a.release(&held).await?;
    let (lease, _) = acquire_within(&c, &key, &long, expiry_slack(waiter_opts.ttl())).await?;
    c.release(&lease).await?;
    Ok(Outcome::Passed)
}

/// C16: a storm of cancelled acquires (some mid-wait, some racing the
/// release) leaves the key free within one TTL.
pub async fn cancellation_storm_leaves_no_lock(h: &dyn Harness) -> CaseResult {
    let key = fresh_key("c16s");
    let holder = h.client().await?;
    let long = ttl_opts(h.base_ttl() * 20)?;
    let held = some(
        holder.try_acquire(&key, &long).await?,
        "a lease on a free key",
    )?;
    let waiter_opts = ttl_opts(h.base_ttl())?;
    let mut tasks = Vec::new();
    for i in 0..12u32 {
        let lock = h.client().await?;
        let (key, opts) = (key.clone(), waiter_opts.clone());
        // Staggered deadlines so some cancellations race the release below.
        let cancel_after = Duration::from_millis(20 * u64::from(i));
        tasks.push(tokio::spawn(async move {
            match tokio::time::timeout(cancel_after, lock.acquire(&key, &opts)).await {
                // Won the race with its own cancellation: give it back.
                Ok(Ok(lease)) => {
                    let _ = lock.release(&lease).await;
                    Some(lease.ttl)
                }
                _ => None,
            }
        }));
    }
    tokio::time::sleep(Duration::from_millis(120)).await;
    holder.release(&held).await?;
    let mut longest = waiter_opts.ttl();
    for t in tasks {
        if let Ok(Some(ttl)) = t.await {
            longest = longest.max(ttl);
        }
    }
    let probe = h.client().await?;
    let (lease, _) = acquire_within(&probe, &key, &long, expiry_slack(longest)).await?;
    probe.release(&lease).await?;
    Ok(Outcome::Passed)
}
