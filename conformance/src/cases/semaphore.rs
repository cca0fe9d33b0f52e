//! S1–S7: semaphores (the weighted line of `fenced_api::permits`, one
//! weight per holder), on the store's `SemaphoreStore`.

use std::{
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc,
    },
    time::Duration,
};

use fenced_api::{
    DistributedLock, Error, Lease, LockClient, LockOptions, Permits, ReleaseOutcome,
    SemaphoreStore, WaitPolicy,
};
use tokio::time::Instant;

use super::{expiry_slack, fresh_key, rises};
use crate::{
    check::{ensure, fail, some, CaseResult, Failure, Outcome},
    Harness,
};

/// The semaphores of a new client of the store, or the skip that says the
/// store has none.
pub(crate) async fn semaphores(h: &dyn Harness) -> Result<Arc<dyn SemaphoreStore>, CaseResult> {
    let lock = h.client().await.map_err(|e| Err(e.into()))?;
    lock.semaphores().ok_or_else(|| {
        Ok(Outcome::Skipped(format!(
            "the {} store has no semaphores",
            lock.capabilities().backend_name()
        )))
    })
}

/// `let s = store!(h);` — the semaphores of a new client, or return the skip.
macro_rules! store {
    ($h:expr) => {
        match $crate::cases::semaphore::semaphores($h).await {
            Ok(s) => s,
            Err(skip) => return skip,
        }
    };
}
pub(crate) use store;

/// Waits (at most 10 s) until `key` has at least `n` entries waiting in
/// line: a case that needs a waiter queued before it goes on asks the
/// store instead of sleeping.
pub(crate) async fn until_waiting(
    store: &dyn SemaphoreStore,
    key: &fenced_api::LockKey,
    n: usize,
) -> Result<(), Failure> {
    let start = Instant::now();
    loop {
        let waiting = store.holders(key).await?.map_or(0, |k| k.waiting);
        if waiting >= n {
            return Ok(());
        }
        if start.elapsed() > Duration::from_secs(10) {
            fail!("`{key}` had {waiting} waiting after 10 s, expected {n}");
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

fn sem(n: u32) -> Result<Permits, Failure> {
    Ok(Permits::semaphore(n)?)
}

/// Options with `ttl` and a wait bound.
pub(crate) fn wait_opts(ttl: Duration, wait: Duration) -> Result<LockOptions, Failure> {
    Ok(LockOptions::builder().ttl(ttl).wait_timeout(wait).build()?)
}

/// S1: N permits are granted, the next asker is refused, and a release lets
/// it in; every permit has its own, rising token.
pub async fn permits_bound_holders(h: &dyn Harness) -> CaseResult {
    let s = store!(h);
    let other = store!(h);
    let key = fresh_key("s01");
    let opts = LockOptions::builder().ttl(h.base_ttl() * 10).build()?;
    let p = sem(3)?;
    let mut held: Vec<Lease> = Vec::new();
    for i in 0..3 {
        let store = if i % 2 == 0 { &s } else { &other };
        let lease = some(
            store.try_acquire_permits(&key, p, &opts).await?,
            &format!("permit {} of 3", i + 1),
        )?;
        if let Some(prev) = held.last() {
            rises(lease.token, prev.token, &format!("of permit {}", i + 1))?;
        }
        held.push(lease);
    }
    ensure!(
        other.try_acquire_permits(&key, p, &opts).await?.is_none(),
        "a fourth permit of a semaphore of 3 was granted"
    );
    ensure!(
        s.release(&held[1]).await? == ReleaseOutcome::Released,
        "a held permit's release was not Released"
    );
    let fourth = some(
        other.try_acquire_permits(&key, p, &opts).await?,
        "a permit once one of three was released",
    )?;
    rises(fourth.token, held[2].token, "of the permit after a release")?;
    ensure!(
        s.try_acquire_permits(&key, p, &opts).await?.is_none(),
        "a fourth permit was granted beside three holders"
    );
    for lease in [&held[0], &held[2], &fourth] {
        s.release(lease).await?;
    }
    Ok(Outcome::Passed)
}

/// S1 under contention: 6 clients × 4 rounds on a semaphore of 2, each
/// holding briefly; never more than 2 at once, every round completes.
pub async fn contention_never_exceeds_permits(h: &dyn Harness) -> CaseResult {
    const CLIENTS: usize = 6;
    const ROUNDS: usize = 4;
    let key = fresh_key("s01c");
    let p = sem(2)?;
    let inside = Arc::new(AtomicUsize::new(0));
    let most = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for _ in 0..CLIENTS {
        let s = store!(h);
        let (key, inside, most) = (key.clone(), Arc::clone(&inside), Arc::clone(&most));
        let opts = wait_opts(h.base_ttl() * 10, Duration::from_secs(60))?;
        tasks.push(tokio::spawn(async move {
            for _ in 0..ROUNDS {
                let lease = s.acquire_permits(&key, p, &opts).await?;
                let now = inside.fetch_add(1, Ordering::SeqCst) + 1;
                most.fetch_max(now, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(15)).await;
                inside.fetch_sub(1, Ordering::SeqCst);
                s.release(&lease).await?;
            }
            Ok::<(), Error>(())
        }));
    }
    for t in tasks {
        t.await
            .map_err(|e| Failure(format!("a client panicked: {e}")))??;
    }
    let most = most.load(Ordering::SeqCst);
    ensure!(most <= 2, "{most} holders at once on a semaphore of 2");
    Ok(Outcome::Passed)
}

/// S2: asking with another capacity (another N, or a reader-writer lock)
/// while the key is held fails with `KindMismatch` and changes nothing;
/// once the key is free, a new capacity is fine.
pub async fn capacity_mismatch_rejected(h: &dyn Harness) -> CaseResult {
    let s = store!(h);
    let other = store!(h);
    let key = fresh_key("s02");
    let opts = LockOptions::builder().ttl(h.base_ttl() * 10).build()?;
    let two = some(
        s.try_acquire_permits(&key, sem(2)?, &opts).await?,
        "a permit of a free key",
    )?;
    for (asked, what) in [
        (sem(3)?, "3 permits"),
        (sem(1)?, "1 permit"),
        (Permits::read(), "a reader"),
        (Permits::write(), "a writer"),
    ] {
        match other.try_acquire_permits(&key, asked, &opts).await {
            Err(Error::KindMismatch { key: k, .. }) if k == key => {}
            other => fail!("{what} on a semaphore of 2 gave {other:?}, not KindMismatch"),
        }
        let wait = wait_opts(h.base_ttl() * 10, Duration::from_millis(200))?;
        match other.acquire_permits(&key, asked, &wait).await {
            Err(Error::KindMismatch { .. }) => {}
            other => fail!("a waiting {what} on a semaphore of 2 gave {other:?}, not KindMismatch"),
        }
    }
    let seen = some(
        other.holders(&key).await?,
        "the holders of a held semaphore",
    )?;
    ensure!(
        seen.capacity == 2 && seen.holders.len() == 1 && seen.holders[0].info.token == two.token,
        "the refused requests changed the key: {seen:?}"
    );
    // The second permit is still there for whoever agrees.
    let second = some(
        other.try_acquire_permits(&key, sem(2)?, &opts).await?,
        "the second permit after the refused requests",
    )?;
    s.release(&two).await?;
    other.release(&second).await?;
    let three = some(
        other.try_acquire_permits(&key, sem(3)?, &opts).await?,
        "a permit of a new capacity once the key was free",
    )?;
    other.release(&three).await?;
    Ok(Outcome::Passed)
}

/// S3: tokens rise with every grant, also when holders overlap and leave
/// out of order.
pub async fn tokens_rise_with_every_grant(h: &dyn Harness) -> CaseResult {
    let s = store!(h);
    let key = fresh_key("s03");
    let opts = LockOptions::builder().ttl(h.base_ttl() * 10).build()?;
    let p = sem(2)?;
    let a = some(s.try_acquire_permits(&key, p, &opts).await?, "permit a")?;
    let b = some(s.try_acquire_permits(&key, p, &opts).await?, "permit b")?;
    rises(b.token, a.token, "of the second permit")?;
    s.release(&a).await?;
    let c = some(s.try_acquire_permits(&key, p, &opts).await?, "permit c")?;
    rises(c.token, b.token, "of a permit granted after another")?;
    s.release(&c).await?;
    s.release(&b).await?;
    let d = some(s.try_acquire_permits(&key, p, &opts).await?, "permit d")?;
    rises(d.token, c.token, "after every holder left")?;
    s.release(&d).await?;
    Ok(Outcome::Passed)
}

/// S4 with a declared `fifo` capability: on a semaphore of 1, three waiters
/// that start one after the other are granted in that order.
pub async fn waiters_granted_in_order(h: &dyn Harness) -> CaseResult {
    let s = store!(h);
    if !s.capabilities().is_fifo() {
        return Ok(Outcome::Skipped(
            "the store's semaphores declare no fifo order".into(),
        ));
    }
    let key = fresh_key("s04");
    let p = sem(1)?;
    let opts = wait_opts(h.base_ttl() * 10, Duration::from_secs(30))?;
    let first = some(
        s.try_acquire_permits(&key, p, &opts).await?,
        "a free permit",
    )?;
    let order = Arc::new(std::sync::Mutex::new(Vec::new()));
    let mut waiters = Vec::new();
    for i in 0..3 {
        let w = store!(h);
        let (k, opts, order) = (key.clone(), opts.clone(), Arc::clone(&order));
        waiters.push(tokio::spawn(async move {
            let lease = w.acquire_permits(&k, p, &opts).await?;
            order.lock().unwrap_or_else(|e| e.into_inner()).push(i);
            tokio::time::sleep(Duration::from_millis(30)).await;
            w.release(&lease).await?;
            Ok::<(), Error>(())
        }));
        // Each waiter is in line before the next starts.
        until_waiting(s.as_ref(), &key, i + 1).await?;
    }
    s.release(&first).await?;
    for w in waiters {
        w.await
            .map_err(|e| Failure(format!("a waiter panicked: {e}")))??;
    }
    let order = order.lock().unwrap_or_else(|e| e.into_inner()).clone();
    ensure!(
        order == [0, 1, 2],
        "waiters were granted in order {order:?}"
    );
    Ok(Outcome::Passed)
}

/// S5: a permit whose holder stops renewing comes back after its TTL, and
/// the waiter next in line gets it.
pub async fn dead_holder_permit_returns(h: &dyn Harness) -> CaseResult {
    let s = store!(h);
    let waiter = store!(h);
    let key = fresh_key("s05");
    let p = sem(2)?;
    let short = LockOptions::builder().ttl(h.base_ttl()).build()?;
    let long = LockOptions::builder().ttl(h.base_ttl() * 10).build()?;
    // One live holder and one that "crashes" (never renews).
    let live = some(s.try_acquire_permits(&key, p, &long).await?, "permit 1")?;
    let crashed = some(s.try_acquire_permits(&key, p, &short).await?, "permit 2")?;
    let wait = wait_opts(h.base_ttl() * 10, expiry_slack(crashed.ttl) * 2)?;
    let start = Instant::now();
    let got = waiter.acquire_permits(&key, p, &wait).await?;
    ensure!(
        start.elapsed() <= expiry_slack(crashed.ttl),
        "the waiter got the crashed holder's permit only {:?} later (ttl {:?})",
        start.elapsed(),
        crashed.ttl
    );
    rises(
        got.token,
        crashed.token,
        "of the permit after the crashed holder",
    )?;
    ensure!(
        s.extend(&live, h.base_ttl() * 10).await.is_ok(),
        "the live holder lost its permit when another expired"
    );
    waiter.release(&got).await?;
    s.release(&live).await?;
    Ok(Outcome::Passed)
}

/// S5: a waiter whose `acquire` is dropped leaves the line: the permit goes
/// to the asker after it at the latest one TTL later, not to nobody. (A drop
/// while the arrival's reply is still on its way leaves the entry to its
/// TTL: the waiter never learned its place.)
pub async fn cancelled_waiter_leaves_line(h: &dyn Harness) -> CaseResult {
    let s = store!(h);
    let key = fresh_key("s05c");
    let p = sem(1)?;
    let ttl = h.base_ttl();
    let bound = expiry_slack(ttl);
    let opts = wait_opts(ttl, Duration::from_secs(60))?;
    let holder = some(
        s.try_acquire_permits(&key, p, &opts).await?,
        "a free permit",
    )?;
    let quitter = store!(h);
    let gone = {
        let (key, opts) = (key.clone(), opts.clone());
        tokio::spawn(async move { quitter.acquire_permits(&key, p, &opts).await })
    };
    until_waiting(s.as_ref(), &key, 1).await?;
    gone.abort();
    let _ = gone.await;
    s.release(&holder).await?;
    let next = store!(h);
    let wait = wait_opts(ttl, expiry_slack(ttl) * 2)?;
    let start = Instant::now();
    let got = next.acquire_permits(&key, p, &wait).await?;
    ensure!(
        start.elapsed() <= bound,
        "the permit reached the next asker only {:?} after the release (bound {bound:?}, the \
         cancelled waiter's ttl {ttl:?}): its entry outlived its ttl",
        start.elapsed()
    );
    next.release(&got).await?;
    Ok(Outcome::Passed)
}

/// S6: releasing or renewing one permit never touches another's; a forged
/// lease (a holder's token with another owner) changes nothing.
pub async fn permits_are_released_one_by_one(h: &dyn Harness) -> CaseResult {
    let s = store!(h);
    let other = store!(h);
    let key = fresh_key("s06");
    let opts = LockOptions::builder().ttl(h.base_ttl() * 10).build()?;
    let p = sem(2)?;
    let a = some(s.try_acquire_permits(&key, p, &opts).await?, "permit a")?;
    let b = some(other.try_acquire_permits(&key, p, &opts).await?, "permit b")?;
    let mut forged = b.clone();
    forged.owner = a.owner.clone();
    ensure!(
        s.release(&forged).await? == ReleaseOutcome::NotHeld,
        "a forged lease released a permit"
    );
    ensure!(
        matches!(
            s.extend(&forged, h.base_ttl()).await,
            Err(Error::LeaseLost { .. })
        ),
        "a forged lease renewed a permit"
    );
    ensure!(
        s.release(&a).await? == ReleaseOutcome::Released,
        "a's release was not Released"
    );
    ensure!(
        s.release(&a).await? == ReleaseOutcome::NotHeld,
        "a second release of a was not NotHeld"
    );
    let seen = some(other.holders(&key).await?, "b still holding")?;
    ensure!(
        seen.holders.len() == 1 && seen.holders[0].info.token == b.token,
        "releasing a changed b's permit: {seen:?}"
    );
    ensure!(
        other.extend(&b, h.base_ttl() * 10).await.is_ok(),
        "b could not renew after a left"
    );
    other.release(&b).await?;
    ensure!(
        other
            .holders(&key)
            .await?
            .is_none_or(|k| k.holders.is_empty()),
        "holders remain after both released"
    );
    Ok(Outcome::Passed)
}

/// S7: `holders` shows every holder with token, remaining TTL, label and role.
pub async fn holders_shows_everyone(h: &dyn Harness) -> CaseResult {
    let s = store!(h);
    let key = fresh_key("s07");
    let ttl = h.base_ttl() * 10;
    let p = sem(3)?;
    let mut leases = Vec::new();
    for label in ["worker-a", "worker-b"] {
        let opts = LockOptions::builder().ttl(ttl).label(label).build()?;
        leases.push(some(
            s.try_acquire_permits(&key, p, &opts).await?,
            "a free permit",
        )?);
    }
    let seen = some(s.holders(&key).await?, "the holders")?;
    ensure!(
        seen.capacity == 3,
        "capacity {} for a semaphore of 3",
        seen.capacity
    );
    ensure!(
        seen.holders.len() == 2,
        "{} holders shown for 2",
        seen.holders.len()
    );
    for (holder, (lease, label)) in seen
        .holders
        .iter()
        .zip(leases.iter().zip(["worker-a", "worker-b"]))
    {
        ensure!(
            holder.info.token == lease.token && holder.info.owner == lease.owner,
            "holder {holder:?} is not the lease {lease:?} (oldest grant first)"
        );
        ensure!(
            holder.info.label.as_ref().map(|l| l.as_str()) == Some(label),
            "label {:?}, not {label}",
            holder.info.label
        );
        ensure!(
            holder.info.remaining_ttl <= ttl && holder.info.remaining_ttl > Duration::ZERO,
            "remaining ttl {:?} of a {ttl:?} lease",
            holder.info.remaining_ttl
        );
        ensure!(
            holder.permits.role() == "permit",
            "role {}",
            holder.permits.role()
        );
    }
    for lease in &leases {
        s.release(lease).await?;
    }
    Ok(Outcome::Passed)
}

/// S5 through `LockClient`: a semaphore guard learns of a force-release and
/// its permit is handed on.
pub async fn client_guard_learns_of_loss(h: &dyn Harness) -> CaseResult {
    let admin = store!(h);
    let lock = h.client().await?;
    let ttl = h.base_ttl() * 3;
    let client = LockClient::builder(lock).ttl(ttl).build()?;
    let key = fresh_key("s08");
    let pool = client.semaphore(key.clone(), 1)?;
    let guard = pool
        .acquire_with(WaitPolicy::Timeout(Duration::from_secs(10)))
        .await?;
    ensure!(
        admin.force_release(&key).await?,
        "force_release found no holder of a held semaphore"
    );
    let lost = tokio::time::timeout(expiry_slack(ttl), guard.lost()).await;
    ensure!(lost.is_ok(), "the guard did not learn of the force-release");
    ensure!(
        matches!(guard.release().await, Err(Error::LeaseLost { .. })),
        "releasing a lost permit was not LeaseLost"
    );
    // A task holding a permit asking again is told at once.
    let held = pool.acquire().await?;
    ensure!(
        matches!(pool.try_acquire().await, Err(Error::AlreadyHeld { .. })),
        "the holder asking again was not AlreadyHeld"
    );
    held.release().await?;
    Ok(Outcome::Passed)
}
