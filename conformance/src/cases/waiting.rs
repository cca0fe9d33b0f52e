//! C8 and C9: waiting for a held key.

use std::{
    sync::{Arc, Mutex},
    time::Duration,
};

use fenced_api::{DistributedLock, Error, FencingToken, LockOptions};
use tokio::time::Instant;

use super::{expiry_slack, fresh_key, held_with, one_of_two_holds, rises};
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
    rises(got.token, lease.token, "of the hand-off")?;
    ensure!(
        gap < HANDOFF_BOUND,
        "the waiter got the key {gap:?} after the release"
    );
    b.release(&got).await?;
    Ok(Outcome::Passed)
}

/// C8/C5: a waiter gets the lock once a crashed holder's TTL runs out.
pub async fn waiter_gets_lock_on_expiry(h: &dyn Harness) -> CaseResult {
    let (_a, b, key, _short, crashed) = one_of_two_holds(h, "c08e", h.base_ttl()).await?;
    let wait = LockOptions::builder()
        .ttl(h.base_ttl() * 10)
        .wait_timeout(expiry_slack(crashed.ttl) * 2)
        .build()?;
    let start = Instant::now();
    let got = b.acquire(&key, &wait).await?;
    rises(got.token, crashed.token, "after the crashed holder")?;
    ensure!(
        start.elapsed() <= expiry_slack(crashed.ttl),
        "the waiter got the key only {:?} later (ttl {:?})",
        start.elapsed(),
        crashed.ttl
    );
    b.release(&got).await?;
    Ok(Outcome::Passed)
}

/// C8 with a declared `fifo` capability: three waiters that start, one
/// after the other, on a held key are granted it in that order.
///
/// Skipped unless [`Capabilities::is_fifo`](fenced_api::Capabilities::is_fifo).
/// Each waiter starts well after the previous one has sent its `acquire`
/// (the larger of 500 ms and 20 times a fresh client's first try on the
/// held key), so arrival order is known; nothing is decided on speed.
pub async fn waiters_served_in_order(h: &dyn Harness) -> CaseResult {
    let holder = h.client().await?;
    if !holder.capabilities().is_fifo() {
        return Ok(Outcome::Skipped(
            "the backend declares no fifo order for waiters".into(),
        ));
    }
    let key = fresh_key("c08f");
    // TTLs and wait bounds far above the whole case: only releases hand the
    // key on, and no waiter gives up.
    let opts = LockOptions::builder()
        .ttl(h.base_ttl() * 20)
        .wait_timeout(h.base_ttl() * 30)
        .build()?;
    let held = some(holder.try_acquire(&key, &opts).await?, "a free key")?;
    // Timed on a fresh client, as each waiter is one: its first request may
    // carry set-up (etcd grants a session lease first).
    let prober = h.client().await?;
    let probe = Instant::now();
    ensure!(
        prober.try_acquire(&key, &opts).await?.is_none(),
        "a held key granted to another client"
    );
    let gap = (probe.elapsed() * 20).max(Duration::from_millis(500));

    let granted: Arc<Mutex<Vec<(usize, FencingToken)>>> = Arc::default();
    let mut waiters = Vec::new();
    for i in 0..3 {
        let lock = h.client().await?;
        let (key, opts, granted) = (key.clone(), opts.clone(), Arc::clone(&granted));
        let waiter = tokio::spawn(async move {
            let lease = lock.acquire(&key, &opts).await?;
            // Recorded before the release: the next grant cannot come earlier.
            granted
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push((i, lease.token));
            lock.release(&lease).await?;
            Ok::<(), Failure>(())
        });
        tokio::time::sleep(gap).await;
        ensure!(
            !waiter.is_finished(),
            "waiter {i} finished while the key was held"
        );
        waiters.push(waiter);
    }
    holder.release(&held).await?;
    let bound = expiry_slack(opts.ttl()) * 2;
    for (i, waiter) in waiters.into_iter().enumerate() {
        match tokio::time::timeout(bound, waiter).await {
            Err(_) => fail!("waiter {i} still waited {bound:?} after the holder released"),
            Ok(Err(e)) => fail!("waiter {i} panicked: {e}"),
            Ok(Ok(result)) => result?,
        }
    }
    let granted = granted.lock().unwrap_or_else(|p| p.into_inner()).clone();
    let order: Vec<usize> = granted.iter().map(|(i, _)| *i).collect();
    ensure!(
        order == [0, 1, 2],
        "waiters that arrived in the order 0, 1, 2 were granted the key in the order {order:?}"
    );
    let mut last = held.token;
    for (i, token) in granted {
        ensure!(token > last, "waiter {i} got token {token} after {last}");
        last = token;
    }
    Ok(Outcome::Passed)
}

/// C9: `acquire` gives up with `Timeout` close to its wait bound.
pub async fn acquire_times_out_near_bound(h: &dyn Harness) -> CaseResult {
    let (a, b, key, long, lease) = one_of_two_holds(h, "c09", h.base_ttl() * 20).await?;
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
    held_with(
        &*a,
        &key,
        lease.token,
        "the timed-out waiter disturbed the holder",
    )
    .await?;
    a.release(&lease).await?;
    Ok(Outcome::Passed)
}
