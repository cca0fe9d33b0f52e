//! `LockClient` / `LockGuard` policy on the in-memory store, with tokio's
//! clock paused so renewal, deadlines and `max_hold` are checked exactly.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::{sync::Arc, time::Duration};

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use fenced_api::{
    DistributedLock, Error, Lease, LockClient, LockClientBuilder, LockGuard, LockKey, LockOptions,
    LossReason, MemoryLock, WaitPolicy, WrapLock,
};
use tokio::time::{advance, sleep, Instant};

const TTL: Duration = Duration::from_secs(3);
/// The default safety margin at `TTL`: its floor, 100 ms (1 % would be 30 ms).
const MARGIN: Duration = Duration::from_millis(100);

fn key(k: &str) -> LockKey {
    LockKey::new(k).unwrap()
}

/// A client builder over `store` with the tests' TTL.
fn builder(store: impl DistributedLock + 'static) -> LockClientBuilder {
    LockClient::builder(Arc::new(store)).ttl(TTL)
}

fn client(store: &MemoryLock) -> LockClient {
    builder(store.clone()).build().unwrap()
}

/// Whether the store itself grants `k` to a newcomer right now (it then
/// holds it for that newcomer).
async fn store_grants_k(store: &MemoryLock) -> bool {
    let opts = LockOptions::builder().ttl(TTL).build().unwrap();
    store.try_acquire(&key("k"), &opts).await.unwrap().is_some()
}

/// Lets spawned tasks (watchdog, release on drop) run.
async fn settle() {
    for _ in 0..10 {
        tokio::task::yield_now().await;
    }
}

#[tokio::test(start_paused = true)]
async fn watchdog_keeps_lock_for_many_ttls() {
    let store = MemoryLock::new();
    let guard = client(&store).acquire("k").await.unwrap();
    sleep(TTL * 10).await;
    assert!(!guard.is_lost());
    assert!(!store_grants_k(&store).await);
    // Renewed every ttl/3, so at least two thirds of the TTL (less the
    // safety margin) are always left.
    assert!(
        guard.valid_for() >= TTL * 2 / 3 - MARGIN - Duration::from_millis(1),
        "{:?}",
        guard.valid_for()
    );
    guard.release().await.unwrap();
    assert!(store.inspect(&key("k")).await.unwrap().is_none());
}

#[tokio::test(start_paused = true)]
async fn outage_longer_than_ttl_reports_loss_at_the_deadline() {
    let store = MemoryLock::new();
    let guard = client(&store).acquire("k").await.unwrap();
    let deadline = guard.handle().lease().deadline;
    store.set_available(false);
    let reason = guard.lost().await;
    assert_eq!(reason, LossReason::DeadlinePassed);
    // Reported no later than the deadline of the last successful request —
    // i.e. before the store could have handed the key to anyone else.
    assert!(
        Instant::now() <= deadline,
        "lost at {:?}, deadline {:?}",
        Instant::now(),
        deadline
    );
    assert_eq!(guard.valid_for(), Duration::ZERO);
    store.set_available(true);
    sleep(TTL).await;
    let other = client(&store).acquire("k").await.unwrap();
    assert!(other.token() > guard.token());
    assert!(matches!(
        guard.release().await,
        Err(Error::LeaseLost { .. })
    ));
    other.release().await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn short_outage_is_ridden_out_by_retries() {
    let store = MemoryLock::new();
    let guard = client(&store).acquire("k").await.unwrap();
    sleep(TTL / 3 - Duration::from_millis(10)).await;
    store.set_available(false);
    // Shorter than ttl − interval: a retry succeeds before the deadline.
    sleep(TTL / 3).await;
    store.set_available(true);
    sleep(TTL * 3).await;
    assert!(!guard.is_lost());
    guard.release().await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn max_hold_stops_renewal_and_reports_loss_on_time() {
    let store = MemoryLock::new();
    let c = builder(store.clone()).max_hold(TTL * 2).build().unwrap();
    let start = Instant::now();
    let guard = c.acquire("k").await.unwrap();
    assert_eq!(guard.lost().await, LossReason::MaxHoldExceeded);
    assert_eq!(start.elapsed(), TTL * 2);
    // Not renewed any more: the store frees the key within one TTL.
    sleep(TTL).await;
    assert!(store_grants_k(&store).await);
}

#[tokio::test(start_paused = true)]
async fn without_watchdog_the_lock_is_lost_at_its_deadline() {
    let store = MemoryLock::new();
    let c = builder(store.clone()).watchdog(false).build().unwrap();
    let start = Instant::now();
    let guard = c.acquire("k").await.unwrap();
    assert_eq!(guard.lost().await, LossReason::DeadlinePassed);
    // The safety margin before the store's expiry.
    assert_eq!(start.elapsed(), TTL - MARGIN);
}

#[tokio::test(start_paused = true)]
async fn loss_is_reported_a_safety_margin_before_the_store_expires_the_lease() {
    let store = MemoryLock::new();
    let sent = Instant::now();
    let guard = client(&store).acquire("k").await.unwrap();
    let safe = guard.deadline().unwrap();
    assert_eq!(safe, sent + TTL - MARGIN);
    assert_eq!(guard.handle().lease().deadline, safe);
    store.set_available(false);
    assert_eq!(guard.lost().await, LossReason::DeadlinePassed);
    assert_eq!(Instant::now(), safe);
    assert_eq!(guard.valid_for(), Duration::ZERO);
    assert_eq!(guard.deadline(), None);
    assert!(guard.handle().lost_token().is_cancelled());
    // The store still holds the lease for the whole margin: nobody else
    // can have the key while the holder still believes it holds it.
    store.set_available(true);
    sleep(MARGIN - Duration::from_millis(1)).await;
    assert!(!store_grants_k(&store).await);
    sleep(Duration::from_millis(2)).await;
    assert!(store_grants_k(&store).await);
}

#[tokio::test(start_paused = true)]
async fn the_margin_is_configurable_and_scales_with_the_ttl() {
    use fenced_api::SafetyMargin;
    let store = MemoryLock::new();
    let ttl = Duration::from_secs(60);
    let c = LockClient::builder(Arc::new(store.clone()))
        .ttl(ttl)
        .watchdog(false)
        .build()
        .unwrap();
    // 1 % of 60 s is above the floor.
    assert_eq!(c.margin(), Duration::from_millis(600));
    let start = Instant::now();
    let g = c.acquire("a").await.unwrap();
    g.lost().await;
    assert_eq!(start.elapsed(), ttl - Duration::from_millis(600));

    let c = builder(store.clone())
        .watchdog(false)
        .safety_margin(SafetyMargin::new(0.1, Duration::from_millis(10)).unwrap())
        .build()
        .unwrap();
    assert_eq!(c.margin(), TTL / 10);
    let start = Instant::now();
    let g = c.acquire("b").await.unwrap();
    g.lost().await;
    assert_eq!(start.elapsed(), TTL - TTL / 10);

    let c = builder(store)
        .watchdog(false)
        .safety_margin(SafetyMargin::NONE)
        .build()
        .unwrap();
    let start = Instant::now();
    let g = c.acquire("c").await.unwrap();
    g.lost().await;
    assert_eq!(start.elapsed(), TTL);
    assert!(SafetyMargin::new(-0.1, Duration::ZERO).is_err());
    assert!(SafetyMargin::new(f64::NAN, Duration::ZERO).is_err());
}

#[tokio::test(start_paused = true)]
async fn expiring_resolves_lead_before_the_safe_deadline_only_when_renewals_fail() {
    let store = MemoryLock::new();
    let guard = client(&store).acquire("k").await.unwrap();
    let lead = Duration::from_millis(800);
    // Renewing normally: the deadline keeps moving and it never resolves.
    assert!(
        tokio::time::timeout(TTL * 5, guard.expiring(lead))
            .await
            .is_err(),
        "expiring resolved while every renewal succeeded"
    );
    assert!(!guard.is_lost());
    // Renewals fail from now on: it resolves `lead` before the safe deadline
    // of the last successful renewal, while the lock is still held.
    store.set_available(false);
    let safe = guard.deadline().unwrap();
    guard.expiring(lead).await;
    assert_eq!(Instant::now(), safe - lead);
    assert!(!guard.is_lost());
    assert_eq!(guard.valid_for(), lead);
    // A renewal that succeeds again moves the deadline: not expiring any more.
    store.set_available(true);
    sleep(TTL / 12).await; // the next retry (every interval / 4)
    assert!(guard.deadline().unwrap() > safe);
    assert!(tokio::time::timeout(TTL, guard.expiring(lead))
        .await
        .is_err());
    // Once lost it resolves at once; after a normal release it never does.
    store.force_release(&key("k")).await.unwrap();
    guard.lost().await;
    assert!(tokio::time::timeout(Duration::ZERO, guard.expiring(lead))
        .await
        .is_ok());
    let other = client(&store).acquire("k").await.unwrap();
    let handle = other.handle().clone();
    other.release().await.unwrap();
    assert!(tokio::time::timeout(TTL * 3, handle.expiring(lead))
        .await
        .is_err());
}

#[tokio::test(start_paused = true)]
async fn a_renewal_answered_after_the_safe_deadline_does_not_revive_the_guard() {
    let store = MemoryLock::new();
    // Each renewal is applied by the store at once but answered 2.95 s later
    // (of a 3 s TTL): past the safe deadline of the lease it renews.
    let slow = Bent::slow_extend(store.clone(), TTL - Duration::from_millis(50));
    let c = builder(slow).build().unwrap();
    let guard = c.acquire("k").await.unwrap();
    assert_eq!(guard.lost().await, LossReason::DeadlinePassed);
    let lost_at = Instant::now();
    sleep(TTL * 2).await;
    assert!(guard.is_lost(), "a late renewal revived a lost guard");
    assert_eq!(guard.valid_for(), Duration::ZERO);
    assert!(guard.deadline().is_none());
    assert!(lost_at.elapsed() >= TTL * 2);
}

#[tokio::test(start_paused = true)]
async fn force_release_is_noticed_at_the_next_renewal() {
    let store = MemoryLock::new();
    let guard = client(&store).acquire("k").await.unwrap();
    let start = Instant::now();
    assert!(store.force_release(&key("k")).await.unwrap());
    assert_eq!(guard.lost().await, LossReason::RenewalRefused);
    // The next renewal: a third of the TTL, plus at most 10 ms that its
    // batch waits for others.
    assert!(start.elapsed() <= TTL / 3 + Duration::from_millis(10));
    assert!(guard.handle().lost_token().is_cancelled());
}

#[tokio::test(start_paused = true)]
async fn dropping_a_guard_releases_promptly() {
    let store = MemoryLock::new();
    let guard = client(&store).acquire("k").await.unwrap();
    drop(guard);
    settle().await;
    assert!(store.inspect(&key("k")).await.unwrap().is_none());
}

#[tokio::test(start_paused = true)]
async fn leaked_guard_is_neither_released_nor_renewed() {
    let store = MemoryLock::new();
    let lease = client(&store).acquire("k").await.unwrap().leak();
    settle().await;
    assert_eq!(
        store.inspect(&key("k")).await.unwrap().unwrap().token,
        lease.token
    );
    advance(TTL).await;
    settle().await;
    assert!(store.inspect(&key("k")).await.unwrap().is_none());
}

#[tokio::test(start_paused = true)]
async fn reentrant_client_counts_holds() {
    let store = MemoryLock::new();
    let c = builder(store.clone()).reentrant(true).build().unwrap();
    let g1 = c.acquire("k").await.unwrap();
    let (g2, g3) = g1
        .scope(async {
            let g2 = c.acquire("k").await.unwrap();
            let g3 = c.try_acquire("k").await.unwrap().unwrap();
            (g2, g3)
        })
        .await;
    assert_eq!(g1.token(), g3.token());
    assert_eq!(g2.token(), g3.token());
    drop(g2);
    g1.release().await.unwrap();
    settle().await;
    assert!(
        store.inspect(&key("k")).await.unwrap().is_some(),
        "one hold is left"
    );
    sleep(TTL * 2).await;
    assert!(!g3.is_lost(), "the remaining hold is still renewed");
    g3.release().await.unwrap();
    assert!(store.inspect(&key("k")).await.unwrap().is_none());
}

#[tokio::test(start_paused = true)]
async fn non_reentrant_client_fails_fast_and_a_lost_hold_does_not_block() {
    let store = MemoryLock::new();
    let c = builder(store.clone())
        .wait(WaitPolicy::Forever)
        .build()
        .unwrap();
    let g = c.acquire("k").await.unwrap();
    assert!(matches!(
        c.acquire("k").await,
        Err(Error::AlreadyHeld { .. })
    ));
    store.force_release(&key("k")).await.unwrap();
    g.lost().await;
    // The hold is lost, so this client may take the key again.
    let again = c.acquire("k").await.unwrap();
    assert!(again.token() > g.token());
}

#[tokio::test(start_paused = true)]
async fn with_lock_returns_the_value_and_releases() {
    let store = MemoryLock::new();
    let c = client(&store);
    let v = c
        .with_lock("k", |lease| async move {
            sleep(TTL * 2).await; // longer than the TTL: renewed meanwhile
            lease.token().get() * 10
        })
        .await
        .unwrap();
    assert!(v >= 10);
    assert!(store.inspect(&key("k")).await.unwrap().is_none());
}

#[tokio::test(start_paused = true)]
async fn acquire_waits_and_times_out_as_configured() {
    let store = MemoryLock::new();
    let holder = client(&store).acquire("k").await.unwrap();
    let c = builder(store.clone())
        .wait(WaitPolicy::Timeout(Duration::from_secs(2)))
        .build()
        .unwrap();
    let start = Instant::now();
    match c.acquire("k").await {
        Err(Error::Timeout { waited, .. }) => assert_eq!(waited, Duration::from_secs(2)),
        other => panic!("expected a timeout, got {other:?}"),
    }
    assert_eq!(start.elapsed(), Duration::from_secs(2));
    assert!(c.try_acquire("k").await.unwrap().is_none());
    holder.release().await.unwrap();
    assert!(c.acquire_with("k", WaitPolicy::NoWait).await.is_ok());
}

#[tokio::test(start_paused = true)]
async fn the_guards_lost_token_is_cancelled_on_loss_only() {
    let store = MemoryLock::new();
    let c = client(&store);
    // Released normally: never cancelled.
    let g = c.acquire("k").await.unwrap();
    let token = g.lost_token();
    g.release().await.unwrap();
    settle().await;
    assert!(!token.is_cancelled(), "a release is not a loss");
    // Cancelling the returned token neither marks the lock lost nor frees it.
    let g = c.acquire("k").await.unwrap();
    g.lost_token().cancel();
    assert!(!g.is_lost());
    assert!(store.inspect(&key("k")).await.unwrap().is_some());
    // Lost: cancelled.
    let token = g.lost_token();
    store.force_release(&key("k")).await.unwrap();
    tokio::time::timeout(TTL, token.cancelled())
        .await
        .expect("the token is cancelled by the next renewal after a force release");
    assert!(g.is_lost());
}

#[test]
fn builder_rejects_bad_policy() {
    let lock: Arc<dyn DistributedLock> = Arc::new(MemoryLock::new());
    let bad = [
        LockClient::builder(lock.clone()).ttl(Duration::ZERO),
        LockClient::builder(lock.clone()).ttl(Duration::MAX),
        LockClient::builder(lock.clone()).renew_interval(Duration::ZERO),
        LockClient::builder(lock.clone())
            .ttl(TTL)
            .renew_interval(TTL),
        LockClient::builder(lock.clone()).max_hold(Duration::ZERO),
        LockClient::builder(lock.clone())
            .ttl(TTL)
            .renew_interval(TTL * 2 / 3),
    ];
    for b in bad {
        let dbg = format!("{b:?}");
        assert!(
            matches!(b.build(), Err(Error::InvalidOptions { .. })),
            "{dbg} was accepted"
        );
    }
    assert!(LockClient::builder(lock)
        .ttl(TTL)
        .renew_interval(TTL / 2)
        .build()
        .is_ok());
}

#[tokio::test]
async fn invalid_keys_fail_before_io() {
    let store = MemoryLock::new();
    store.set_available(false); // any I/O would fail with Backend instead
    let c = client(&store);
    for bad in ["", "a\nb"] {
        assert!(matches!(
            c.acquire(bad).await,
            Err(Error::InvalidKey { .. })
        ));
        assert!(matches!(
            c.try_acquire(bad).await,
            Err(Error::InvalidKey { .. })
        ));
    }
}

#[tokio::test(start_paused = true)]
async fn max_hold_counts_from_the_grant_not_from_the_wait() {
    let store = MemoryLock::new();
    let holder = client(&store).acquire("k").await.unwrap();
    let c = builder(store.clone())
        .max_hold(Duration::from_secs(6))
        .build()
        .unwrap();
    let waiter = tokio::spawn(async move { c.acquire("k").await });
    sleep(Duration::from_secs(5)).await;
    holder.release().await.unwrap();
    let guard = waiter.await.unwrap().unwrap();
    let granted = Instant::now();
    assert_eq!(guard.lost().await, LossReason::MaxHoldExceeded);
    assert_eq!(granted.elapsed(), Duration::from_secs(6));
}

#[tokio::test(start_paused = true)]
async fn an_unbounded_max_hold_keeps_renewing() {
    let store = MemoryLock::new();
    let c = builder(store.clone())
        .max_hold(Duration::MAX)
        .build()
        .unwrap();
    let guard = c.acquire("k").await.unwrap();
    sleep(TTL * 5).await;
    assert!(!guard.is_lost());
    assert!(!store_grants_k(&store).await);
}

#[tokio::test(start_paused = true)]
async fn a_handle_is_not_valid_after_release() {
    let store = MemoryLock::new();
    let guard = client(&store).acquire("k").await.unwrap();
    let handle = guard.handle().clone();
    assert!(handle.valid_for() > Duration::ZERO);
    guard.release().await.unwrap();
    assert_eq!(handle.valid_for(), Duration::ZERO);
    assert!(!handle.is_lost(), "released, not lost");
}

/// A store over a `MemoryLock` whose replies the tests bend; made with
/// [`Bent::over`] it passes every call straight through.
#[derive(Debug)]
struct Bent {
    inner: MemoryLock,
    /// `extend` answers only after this (the request itself is applied at
    /// once, as a slow network would behave).
    extend_delay: Duration,
    /// How many `extend` calls reached the store.
    extends: Arc<AtomicUsize>,
    /// With `batched`, `extend_many` records the size of every batch in
    /// `batches` and answers each after [`BATCH_DELAY`] — with `short`, only
    /// half of each batch (a buggy override), which the client must survive.
    /// Without, it is one `extend` (this store's) per lease.
    batched: bool,
    short: bool,
    batches: Arc<std::sync::Mutex<Vec<usize>>>,
    /// While `late` is set, the next grant reaches the caller late: after
    /// `late_delay` (a stalled process or network), with the deadline the
    /// store computed from the send time. With `stale_deadline` the grant
    /// arrives at once but its deadline is already over while the store
    /// still has the lock (a clock stall between the store's reply and the
    /// caller).
    late: AtomicBool,
    late_delay: Duration,
    stale_deadline: bool,
}

const BATCH_DELAY: Duration = Duration::from_millis(50);

impl Bent {
    fn over(inner: MemoryLock) -> Self {
        Bent {
            inner,
            extend_delay: Duration::ZERO,
            extends: Arc::default(),
            batched: false,
            short: false,
            batches: Arc::default(),
            late: AtomicBool::new(false),
            late_delay: Duration::ZERO,
            stale_deadline: false,
        }
    }

    fn slow_extend(inner: MemoryLock, delay: Duration) -> Self {
        Bent {
            extend_delay: delay,
            ..Bent::over(inner)
        }
    }

    fn batched(short: bool) -> Self {
        Bent {
            batched: true,
            short,
            ..Bent::over(MemoryLock::new())
        }
    }

    /// Only the first grant is late.
    fn late_grant(inner: MemoryLock, delay: Duration, stale_deadline: bool) -> Self {
        Bent {
            late: AtomicBool::new(true),
            late_delay: delay,
            stale_deadline,
            ..Bent::over(inner)
        }
    }

    async fn deliver(&self, mut lease: Lease) -> Lease {
        if self.late.swap(false, Ordering::SeqCst) {
            if self.stale_deadline {
                lease.deadline = Instant::now() - Duration::from_millis(1);
            } else {
                sleep(self.late_delay).await;
            }
        }
        lease
    }
}

#[fenced_api::async_trait]
impl WrapLock for Bent {
    fn inner(&self) -> &dyn DistributedLock {
        &self.inner
    }
    async fn try_acquire(&self, k: &LockKey, o: &LockOptions) -> fenced_api::Result<Option<Lease>> {
        match self.inner.try_acquire(k, o).await? {
            Some(l) => Ok(Some(self.deliver(l).await)),
            None => Ok(None),
        }
    }
    async fn acquire(&self, k: &LockKey, o: &LockOptions) -> fenced_api::Result<Lease> {
        let l = self.inner.acquire(k, o).await?;
        Ok(self.deliver(l).await)
    }
    async fn extend(&self, l: &Lease, ttl: Duration) -> fenced_api::Result<Lease> {
        self.extends.fetch_add(1, Ordering::Relaxed);
        let r = self.inner.extend(l, ttl).await;
        if !self.extend_delay.is_zero() {
            sleep(self.extend_delay).await;
        }
        r
    }
    async fn extend_many(&self, leases: &[Lease], ttl: Duration) -> Vec<fenced_api::Result<Lease>> {
        if !self.batched {
            return fenced_api::batch::extend_each(self, leases, ttl).await;
        }
        self.batches.lock().unwrap().push(leases.len());
        let mut r = self.inner.extend_many(leases, ttl).await;
        if self.short {
            r.truncate(leases.len() / 2);
        }
        sleep(BATCH_DELAY).await;
        r
    }
}
fenced_api::wrap_lock!(Bent);

#[tokio::test(start_paused = true)]
async fn slow_renewal_replies_do_not_push_renewals_past_the_deadline() {
    let store = MemoryLock::new();
    // Each renewal reply takes 0.9 s of a 3 s TTL renewed every 1 s: the next
    // renewal must be scheduled from the send time, not from the reply.
    let slow = Bent::slow_extend(store.clone(), Duration::from_millis(900));
    let c = builder(slow).build().unwrap();
    let guard = c.acquire("k").await.unwrap();
    sleep(TTL * 6).await;
    assert!(!guard.is_lost(), "lost despite every renewal succeeding");
}

/// Takes `n` keys through a client over [`Bent::batched`] and lets the
/// watchdogs renew them for four TTLs: none may be lost (`what` names the
/// renewals in the message). Returns the store, the client and its guards.
async fn hold_batched(
    short: bool,
    n: usize,
    what: &str,
) -> (Arc<Bent>, LockClient, Vec<LockGuard>) {
    let store = Arc::new(Bent::batched(short));
    let c = builder(Arc::clone(&store)).build().unwrap();
    let mut guards = Vec::new();
    for i in 0..n {
        guards.push(c.acquire(format!("k{i}")).await.unwrap());
    }
    sleep(TTL * 4).await;
    assert!(guards.iter().all(|g| !g.is_lost()), "{what} lost a lock");
    (store, c, guards)
}

#[tokio::test(start_paused = true)]
async fn renewals_of_many_held_locks_go_out_in_batches() {
    // 1 000 locks held by one client: while a batch is in flight the other
    // watchdogs' renewals queue up, so the store sees a few calls per
    // interval instead of 1 000 — and no lock is lost.
    let (store, _c, guards) = hold_batched(false, 1_000, "a batched renewal").await;
    let b = store.batches.lock().unwrap().clone();
    let renewals: usize = b.iter().sum();
    // Every 1 s for 12 s: about 12 000 renewals.
    assert!(renewals >= 10_000, "only {renewals} renewals");
    assert!(
        b.len() * 20 <= renewals,
        "{} extend_many calls for {renewals} renewals: not batched",
        b.len()
    );
    for g in guards {
        g.release().await.unwrap();
    }
}

#[tokio::test(start_paused = true)]
async fn a_store_answering_part_of_a_batch_does_not_lose_locks() {
    let (store, _c, _guards) = hold_batched(true, 100, "a short batch answer").await;
    // The unanswered half was renewed one by one.
    assert!(
        store.extends.load(Ordering::Relaxed) > 0,
        "no fallback extend"
    );
}

/// The documented metrics are emitted (checked with a debugging recorder).
#[test]
fn metrics_are_emitted_with_the_documented_names() {
    use fenced_api::telemetry;
    use metrics_util::debugging::{DebugValue, DebuggingRecorder};

    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    metrics::with_local_recorder(&recorder, || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .start_paused(true)
            .build()
            .unwrap();
        rt.block_on(async {
            let store = MemoryLock::new();
            let a = client(&store);
            let b = client(&store);
            let g = a.acquire("m").await.unwrap();
            assert!(b.try_acquire("m").await.unwrap().is_none());
            sleep(TTL).await; // two renewals
            g.release().await.unwrap();
            let g = a.acquire("m").await.unwrap();
            store.force_release(&key("m")).await.unwrap();
            g.lost().await;
        });
    });
    let counters: std::collections::HashMap<String, u64> = snapshotter
        .snapshot()
        .into_vec()
        .into_iter()
        .filter_map(|(k, _, _, v)| match v {
            DebugValue::Counter(n) => Some((k.key().name().to_owned(), n)),
            _ => None,
        })
        .fold(Default::default(), |mut m, (name, n)| {
            *m.entry(name).or_default() += n;
            m
        });
    assert_eq!(
        counters.get(telemetry::ACQUIRE_CONTENDED),
        Some(&1),
        "{counters:?}"
    );
    assert!(
        counters.get(telemetry::RENEWALS).copied().unwrap_or(0) >= 2,
        "{counters:?}"
    );
    assert_eq!(counters.get(telemetry::RELEASES), Some(&1), "{counters:?}");
    assert_eq!(counters.get(telemetry::LOSSES), Some(&1), "{counters:?}");
}

/// Takes `k` directly on the store once the late grant has expired there,
/// and holds it for `hold`: the grant's reply is then about a lock that
/// belongs to someone else.
fn rival(store: &MemoryLock, hold: Duration) -> tokio::task::JoinHandle<u64> {
    let store = store.clone();
    tokio::spawn(async move {
        sleep(TTL + Duration::from_millis(50)).await;
        let opts = LockOptions::builder().ttl(TTL * 10).build().unwrap();
        let l = store
            .try_acquire(&LockKey::new("k").unwrap(), &opts)
            .await
            .unwrap()
            .expect("the late grant had expired on the store");
        sleep(hold).await;
        store.release(&l).await.unwrap();
        l.token.get()
    })
}

#[tokio::test(start_paused = true)]
async fn a_grant_that_arrives_after_its_deadline_is_never_handed_out() {
    let store = MemoryLock::new();
    let late = Bent::late_grant(store.clone(), TTL + Duration::from_millis(100), false);
    let c = builder(late).build().unwrap();
    let rival = rival(&store, TTL);
    // The store granted the key, but the reply came after the lease's
    // deadline and someone else holds the key by then.
    assert!(
        c.try_acquire("k").await.unwrap().is_none(),
        "an expired grant was handed out as a held lock"
    );
    rival.await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn a_waiting_acquire_whose_grant_arrives_too_late_waits_on() {
    let store = MemoryLock::new();
    let late = Bent::late_grant(store.clone(), TTL + Duration::from_millis(100), false);
    let c = builder(late)
        .wait(WaitPolicy::Timeout(TTL * 10))
        .build()
        .unwrap();
    let rival = rival(&store, TTL);
    let guard = c.acquire("k").await.unwrap();
    let rival_token = rival.await.unwrap();
    assert!(
        guard.token().get() > rival_token,
        "the guard carries the expired grant's token {} (the rival held {rival_token})",
        guard.token()
    );
    assert!(guard.valid_for() > Duration::ZERO);
}

/// `try_acquire("k")` through [`Bent::late_grant`] over `store`, which
/// still holds the lock: returns the client, its guard and how many
/// `extend` calls reached the store.
async fn take_late_grant(
    store: &MemoryLock,
    delay: Duration,
    stale_deadline: bool,
) -> (LockClient, LockGuard, usize) {
    let late = Bent::late_grant(store.clone(), delay, stale_deadline);
    let extends = Arc::clone(&late.extends);
    let c = builder(late).build().unwrap();
    let guard = c
        .try_acquire("k")
        .await
        .unwrap()
        .expect("still held on the store");
    let extends = extends.load(Ordering::Relaxed);
    (c, guard, extends)
}

#[tokio::test(start_paused = true)]
async fn a_late_grant_the_store_still_holds_is_renewed_before_use() {
    let store = MemoryLock::new();
    let (_c, guard, extends) = take_late_grant(&store, Duration::ZERO, true).await;
    assert_eq!(extends, 1);
    assert!(
        guard.valid_for() > TTL / 2,
        "handed out with {:?} left",
        guard.valid_for()
    );
    let info = store
        .inspect(&LockKey::new("k").unwrap())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(info.token, guard.token());
}

#[tokio::test(start_paused = true)]
async fn a_grant_arriving_inside_the_safety_margin_is_renewed_before_use() {
    let store = MemoryLock::new();
    // The reply comes 50 ms before the lease's deadline: past its safe
    // deadline (100 ms before), so it must be confirmed first.
    let (_c, guard, extends) =
        take_late_grant(&store, TTL - Duration::from_millis(50), false).await;
    assert_eq!(
        extends, 1,
        "a grant inside the margin was handed out without a renewal"
    );
    assert!(guard.valid_for() > TTL / 2, "{:?}", guard.valid_for());
}

/// A store that grants at most `cap` (like ZooKeeper, whose locks live no
/// longer than their session's timeout).
#[derive(Debug)]
struct Capped {
    inner: MemoryLock,
    cap: Duration,
}

#[fenced_api::async_trait]
impl fenced_api::WrapLock for Capped {
    fn inner(&self) -> &dyn DistributedLock {
        &self.inner
    }
    async fn try_acquire(
        &self,
        key: &LockKey,
        opts: &LockOptions,
    ) -> fenced_api::Result<Option<Lease>> {
        let capped = opts.to_builder().ttl(opts.ttl().min(self.cap)).build()?;
        self.inner.try_acquire(key, &capped).await
    }
    async fn acquire(&self, key: &LockKey, opts: &LockOptions) -> fenced_api::Result<Lease> {
        let capped = opts.to_builder().ttl(opts.ttl().min(self.cap)).build()?;
        self.inner.acquire(key, &capped).await
    }
    async fn extend(&self, lease: &Lease, ttl: Duration) -> fenced_api::Result<Lease> {
        self.inner.extend(lease, ttl.min(self.cap)).await
    }
    async fn extend_many(&self, leases: &[Lease], ttl: Duration) -> Vec<fenced_api::Result<Lease>> {
        self.inner.extend_many(leases, ttl.min(self.cap)).await
    }
}
fenced_api::wrap_lock!(Capped);

#[tokio::test(start_paused = true)]
async fn a_lease_granted_shorter_than_asked_is_renewed_by_its_granted_ttl() {
    let store = MemoryLock::new();
    let capped = Capped {
        inner: store.clone(),
        cap: TTL / 3,
    };
    // Renewing every TTL/3 by the client's TTL would be exactly at the
    // granted lease's deadline, past its safe deadline: lost at once.
    let guard = builder(capped).build().unwrap().acquire("k").await.unwrap();
    assert_eq!(guard.handle().lease().ttl, TTL / 3);
    sleep(TTL * 5).await;
    assert!(!guard.is_lost());
    assert!(!store_grants_k(&store).await);
    assert!(guard.handle().lease().ttl <= TTL / 3);
}

/// A store that can tell its holders their lock is gone, through a token
/// the test cancels (as a PostgreSQL backend does when the holding
/// connection's session ends).
#[derive(Debug)]
struct Telling {
    inner: MemoryLock,
    gone: fenced_api::CancellationToken,
}

impl fenced_api::WrapLock for Telling {
    fn inner(&self) -> &dyn DistributedLock {
        &self.inner
    }
    fn loss_signal(&self, _: &Lease) -> Option<fenced_api::CancellationToken> {
        Some(self.gone.clone())
    }
}
fenced_api::wrap_lock!(Telling);

#[tokio::test(start_paused = true)]
async fn a_loss_the_store_reports_is_the_guards_at_once() {
    let gone = fenced_api::CancellationToken::new();
    let store = Telling {
        inner: MemoryLock::new(),
        gone: gone.clone(),
    };
    let guard = builder(store).build().unwrap().acquire("k").await.unwrap();
    sleep(TTL / 10).await;
    assert!(!guard.is_lost(), "nothing reported yet");
    let reported = Instant::now();
    gone.cancel();
    assert_eq!(guard.lost().await, LossReason::StoreReported);
    // Not at the next renewal (TTL/3) nor at the deadline: at once.
    assert_eq!(reported.elapsed(), Duration::ZERO);
    assert!(guard.handle().lost_token().is_cancelled());
}

#[tokio::test(start_paused = true)]
async fn a_store_without_a_loss_signal_keeps_its_holders() {
    // The default `loss_signal` is `None`: a guard on such a store is lost
    // only by renewal or deadline, never by a signal nobody sends.
    let store = MemoryLock::new();
    assert!(store
        .loss_signal(&Lease::new(
            key("k"),
            fenced_api::Owner::new("o").unwrap(),
            fenced_api::FencingToken::new(1),
            TTL,
            Instant::now(),
        ))
        .is_none());
    let guard = builder(store).build().unwrap().acquire("k").await.unwrap();
    sleep(TTL * 3).await;
    assert!(!guard.is_lost());
}
