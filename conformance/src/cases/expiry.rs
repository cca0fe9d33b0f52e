//! C5, C6, C15, C16: TTL expiry, extension, and what dropped guards and
//! cancelled futures leave behind.

use std::time::Duration;

use fenced_api::{DistributedLock, Error, Lease, LockKey, Owner, ReleaseOutcome};
use tokio::time::Instant;

use super::{
    acquire_within, client_and_store, expiry_slack, fresh_key, one_of_two_holds, rises, ttl_opts,
};
use crate::{
    check::{ensure, fail, some, CaseResult, Outcome},
    Harness,
};

/// C5: a holder that stops renewing keeps the key for its TTL, then loses it
/// to another client.
pub async fn expiry_frees_key(h: &dyn Harness) -> CaseResult {
    let (_a, b, key, opts, lease) = one_of_two_holds(h, "c05", h.base_ttl()).await?;
    let (taken, after) = acquire_within(&b, &key, &opts, expiry_slack(lease.ttl)).await?;
    rises(taken.token, lease.token, "after expiry")?;
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
    let (a, b, key, opts, lease) = one_of_two_holds(h, "c05h", h.base_ttl() * 2).await?;
    // Probed every eighth of the TTL and last at three quarters of it, each
    // probe sent at least a quarter of the TTL before the deadline: room for
    // a slow store, so a failure means early expiry rather than a late probe.
    let checkpoint = lease.deadline - lease.ttl / 4;
    loop {
        let last = Instant::now() >= checkpoint;
        ensure!(
            b.try_acquire(&key, &opts).await?.is_none(),
            "the key was free {:?} before the end of its ttl",
            lease.remaining()
        );
        let info = some(b.inspect(&key).await?, "the still-valid lock")?;
        ensure!(
            info.token == lease.token,
            "inspect shows token {} {:?} before the end of the ttl",
            info.token,
            lease.remaining()
        );
        if last {
            break;
        }
        let next = Instant::now() + lease.ttl / 8;
        tokio::time::sleep_until(next.min(checkpoint)).await;
    }
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
        // A third of the TTL after the last extend was *sent* (deadline −
        // ttl), as the watchdog schedules it: the contender's probe below
        // does not eat into the margin, which stays two thirds of the TTL.
        tokio::time::sleep_until(lease.deadline - lease.ttl + lease.ttl / 3).await;
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

/// C6: `extend_many` is `extend` per lease: in one batch it renews the
/// current leases past their old TTL and refuses — each with `LeaseLost`, in
/// the order given — a released lease, a taken-over one and a forged one
/// (alone beside a current lease, and after its original), leaving those
/// keys' holders alone.
pub async fn extend_many_per_lease(h: &dyn Harness) -> CaseResult {
    let (a, b) = (h.client().await?, h.client().await?);
    let ttl = h.base_ttl();
    let short = ttl_opts(ttl)?;
    let long = ttl_opts(ttl * 20)?;
    let keys: Vec<LockKey> = (0..4).map(|i| fresh_key(&format!("c06m{i}"))).collect();
    let first = some(
        a.try_acquire(&keys[0], &short).await?,
        "a lease on a free key",
    )?;
    let second = some(
        a.try_acquire(&keys[1], &short).await?,
        "a lease on a free key",
    )?;
    let released = some(
        a.try_acquire(&keys[2], &short).await?,
        "a lease on a free key",
    )?;
    ensure!(
        a.release(&released).await? == ReleaseOutcome::Released,
        "release before the batch"
    );
    let overtaken = some(
        a.try_acquire(&keys[3], &short).await?,
        "a lease on a free key",
    )?;
    ensure!(
        b.force_release(&keys[3]).await?,
        "force release of a held key"
    );
    let current = some(b.try_acquire(&keys[3], &long).await?, "the key just freed")?;
    let forged = Lease::new(
        keys[1].clone(),
        Owner::random(),
        second.token,
        second.ttl,
        Instant::now(),
    );
    ensure!(
        a.extend_many(&[], ttl).await.is_empty(),
        "an empty batch returned results"
    );
    // All current: the one-statement path of the SQL stores.
    for (i, r) in a
        .extend_many(&[first.clone(), second.clone()], ttl * 20)
        .await
        .into_iter()
        .enumerate()
    {
        ensure!(
            r.as_ref().is_ok_and(|l| l.ttl >= ttl * 10),
            "current lease {i} in an all-current batch came back as {r:?}"
        );
    }
    // A forged lease (another owner, the current token) in the same
    // statement as a current lease on the SQL stores: each row is checked
    // against its own lease's owner, not one owner for the statement.
    let mixed = a
        .extend_many(&[first.clone(), forged.clone()], ttl * 20)
        .await;
    ensure!(
        matches!(mixed.as_slice(), [Ok(l), Err(Error::LeaseLost { .. })] if l.ttl >= ttl * 10),
        "a batch of a current lease and a forged one came back as {mixed:?}"
    );
    let batch = [first.clone(), released, second.clone(), overtaken, forged];
    let results = a.extend_many(&batch, ttl * 20).await;
    ensure!(
        results.len() == batch.len(),
        "{} results for a batch of {}",
        results.len(),
        batch.len()
    );
    for (i, (lease, result)) in batch.iter().zip(&results).enumerate() {
        let current_lease = i == 0 || i == 2;
        match result {
            Ok(renewed) if current_lease => ensure!(
                renewed.token == lease.token && renewed.ttl >= ttl * 10,
                "lease {i} renewed as {renewed:?}"
            ),
            Err(Error::LeaseLost { .. }) if !current_lease => {}
            other => fail!("lease {i} ({:?}) came back as {other:?}", lease.key),
        }
    }
    // Past the old TTL the renewed keys are still held, the others untouched.
    tokio::time::sleep(expiry_slack(ttl)).await;
    for key in &keys[..2] {
        ensure!(
            b.try_acquire(key, &short).await?.is_none(),
            "{key:?} was free after its batch renewal"
        );
    }
    let info = some(b.inspect(&keys[3]).await?, "the new holder's lock")?;
    ensure!(
        info.token == current.token && info.owner == current.owner,
        "the batch touched another holder's lock: {info:?}"
    );
    for (lease, result) in batch.iter().zip(results) {
        if let Ok(renewed) = result {
            ensure!(
                a.release(&renewed).await? == ReleaseOutcome::Released,
                "release of {:?} after the batch",
                lease.key
            );
        }
    }
    b.release(&current).await?;
    Ok(Outcome::Passed)
}

/// C15: dropping a `LockGuard` without `release` frees the key promptly
/// (the release is spawned), and at the TTL at the latest.
pub async fn dropped_guard_frees_key(h: &dyn Harness) -> CaseResult {
    let ttl = h.base_ttl() * 10;
    let (key, client, other) = client_and_store(h, "c15", ttl).await?;
    let guard = client.acquire(&key).await?;
    let token = guard.token();
    drop(guard);
    let opts = ttl_opts(ttl)?;
    // Well under the 10×base TTL: proves the spawned release, not expiry.
    let (lease, _) = acquire_within(&other, &key, &opts, h.base_ttl() * 5).await?;
    rises(lease.token, token, "after drop")?;
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
