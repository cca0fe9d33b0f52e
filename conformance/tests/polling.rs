//! The shared waiting helper (`fenced_api::wait`) under the full suite: a
//! backend with no native wait — `MemoryLock` with its waiting hidden —
//! implements `acquire` with `acquire_polling` and must still pass every
//! case, hand-off (C8) and cancellation (C16) included.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::{sync::Arc, time::Duration};

use async_trait::async_trait;
use fenced_api::{
    wait::{acquire_polling, notify_released, Backoff},
    Capabilities, DistributedLock, Lease, LockInfo, LockKey, LockOptions, MemoryLock,
    ReleaseOutcome, Result, WrapLock,
};
use fenced_conformance::{Harness, MemoryHarness};
use tokio::time::Instant;

/// A poll-only backend: only `try_acquire` reaches the store.
#[derive(Debug)]
struct PollingLock {
    inner: MemoryLock,
    scope: String,
}

#[async_trait]
impl DistributedLock for PollingLock {
    async fn try_acquire(&self, key: &LockKey, opts: &LockOptions) -> Result<Option<Lease>> {
        self.inner.try_acquire(key, opts).await
    }

    async fn acquire(&self, key: &LockKey, opts: &LockOptions) -> Result<Lease> {
        acquire_polling(self, &self.scope, key, opts, Backoff::default()).await
    }

    async fn extend(&self, lease: &Lease, ttl: Duration) -> Result<Lease> {
        self.inner.extend(lease, ttl).await
    }

    async fn release(&self, lease: &Lease) -> Result<ReleaseOutcome> {
        let out = self.inner.release(lease).await?;
        if out == ReleaseOutcome::Released {
            notify_released(&self.scope, &lease.key);
        }
        Ok(out)
    }

    async fn inspect(&self, key: &LockKey) -> Result<Option<LockInfo>> {
        self.inner.inspect(key).await
    }

    async fn force_release(&self, key: &LockKey) -> Result<bool> {
        let removed = self.inner.force_release(key).await?;
        if removed {
            notify_released(&self.scope, key);
        }
        Ok(removed)
    }

    fn capabilities(&self) -> Capabilities {
        self.inner
            .capabilities()
            .backend("memory-polling")
            .native_wait(false)
            .fifo(false)
    }
}

struct PollingHarness {
    inner: MemoryHarness,
    scope: String,
}

impl PollingHarness {
    fn new() -> Self {
        PollingHarness {
            inner: MemoryHarness::new(),
            scope: format!("polling-{}", uuid::Uuid::new_v4()),
        }
    }
}

#[async_trait]
impl Harness for PollingHarness {
    async fn client(&self) -> Result<Arc<dyn DistributedLock>> {
        Ok(Arc::new(PollingLock {
            inner: self.inner.memory_client(),
            scope: self.scope.clone(),
        }))
    }

    async fn client_in_namespace(&self, suffix: &str) -> Result<Arc<dyn DistributedLock>> {
        self.inner.client_in_namespace(suffix).await
    }

    async fn unreachable_client(&self) -> Option<Result<Arc<dyn DistributedLock>>> {
        self.inner.unreachable_client().await
    }

    fn connect_timeout(&self) -> Duration {
        self.inner.connect_timeout()
    }

    fn base_ttl(&self) -> Duration {
        self.inner.base_ttl()
    }
}

fenced_conformance::conformance_tests!(PollingHarness::new(), skips = [
    c07_tokens_increase_after_restart: "the polling wrapper is MemoryLock underneath: not durable",
    c08_waiters_served_in_order: "a poll-only store declares no fifo: waiters across processes race for the key",
], without_semaphores = "this store exists to test the mutex's Polling helper; semaphores wait through LineStore, tested on SQLite");

/// With time paused, a waiter deep in its backoff is granted the key at the
/// very instant of a local release — not at its next poll.
#[tokio::test(start_paused = true)]
async fn local_release_wakes_a_backed_off_waiter_at_once() {
    let h = PollingHarness::new();
    let (a, b) = (h.client().await.unwrap(), h.client().await.unwrap());
    let key = LockKey::new("handoff").unwrap();
    let opts = long_opts();
    let held = a.try_acquire(&key, &opts).await.unwrap().unwrap();
    let waiter = {
        let key = key.clone();
        let opts = opts.clone();
        tokio::spawn(async move { (b.acquire(&key, &opts).await, Instant::now()) })
    };
    // Long enough for the backoff to reach its 200 ms cap.
    tokio::time::sleep(Duration::from_millis(2_013)).await;
    let released_at = Instant::now();
    a.release(&held).await.unwrap();
    let (lease, got_at) = waiter.await.unwrap();
    assert!(lease.unwrap().token > held.token);
    assert_eq!(got_at, released_at, "the waiter slept on after the release");
}

/// Polling never overshoots the wait bound, even mid-backoff.
#[tokio::test(start_paused = true)]
async fn polling_times_out_exactly_at_the_bound() {
    let h = PollingHarness::new();
    let (a, b) = (h.client().await.unwrap(), h.client().await.unwrap());
    let key = LockKey::new("bound").unwrap();
    let opts = long_opts()
        .to_builder()
        .wait_timeout(Duration::from_millis(1_234))
        .build()
        .unwrap();
    let _held = a.try_acquire(&key, &opts).await.unwrap().unwrap();
    let start = Instant::now();
    let err = b.acquire(&key, &opts).await.unwrap_err();
    assert!(matches!(err, fenced_api::Error::Timeout { .. }), "{err}");
    assert_eq!(start.elapsed(), Duration::from_millis(1_234));
}

/// A `PollingLock` client that counts the tries reaching the store.
#[derive(Debug)]
struct Counted {
    inner: Arc<dyn DistributedLock>,
    scope: String,
    tries: Arc<std::sync::atomic::AtomicU64>,
}

#[async_trait]
impl WrapLock for Counted {
    fn inner(&self) -> &dyn DistributedLock {
        &*self.inner
    }
    async fn try_acquire(&self, key: &LockKey, opts: &LockOptions) -> Result<Option<Lease>> {
        self.tries
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.inner.try_acquire(key, opts).await
    }
    async fn acquire(&self, key: &LockKey, opts: &LockOptions) -> Result<Lease> {
        acquire_polling(self, &self.scope, key, opts, Backoff::default()).await
    }
}
fenced_api::wrap_lock!(Counted);

/// A counted client; `tries` may be shared between clients.
fn counted(h: &PollingHarness, inner: Arc<dyn DistributedLock>, tries: &Tries) -> Arc<Counted> {
    Arc::new(Counted {
        inner,
        scope: h.scope.clone(),
        tries: Arc::clone(tries),
    })
}

type Tries = Arc<std::sync::atomic::AtomicU64>;

fn tries_of(t: &Tries) -> u64 {
    t.load(std::sync::atomic::Ordering::Relaxed)
}

fn long_opts() -> LockOptions {
    LockOptions::builder()
        .ttl(Duration::from_secs(60))
        .build()
        .unwrap()
}

/// Waiters of one process are served in arrival order, however their
/// backoff timers happen to fall.
#[tokio::test(start_paused = true)]
async fn local_waiters_are_served_first_come_first_served() {
    let h = PollingHarness::new();
    let key = LockKey::new("fifo").unwrap();
    let holder = h.client().await.unwrap();
    let first = holder.acquire(&key, &long_opts()).await.unwrap();
    let order = Arc::new(std::sync::Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for i in 0..6 {
        let c = h.client().await.unwrap();
        let (key, order) = (key.clone(), Arc::clone(&order));
        tasks.push(tokio::spawn(async move {
            let lease = c.acquire(&key, &long_opts()).await.unwrap();
            order.lock().unwrap().push(i);
            tokio::time::sleep(Duration::from_millis(7)).await;
            c.release(&lease).await.unwrap();
        }));
        // Arrivals 37 ms apart: each waiter is at a different point of its backoff.
        tokio::time::sleep(Duration::from_millis(37)).await;
    }
    tokio::time::sleep(Duration::from_secs(3)).await;
    holder.release(&first).await.unwrap();
    for t in tasks {
        t.await.unwrap();
    }
    assert_eq!(*order.lock().unwrap(), vec![0, 1, 2, 3, 4, 5]);
}

/// Only the head of the line polls the store: eight waiters behind a holder
/// of another process cost about as many tries as one.
#[tokio::test(start_paused = true)]
async fn only_the_head_of_the_line_polls() {
    let h = PollingHarness::new();
    let key = LockKey::new("one-poller").unwrap();
    // The holder took the key with a bare try (as another process would):
    // this process knows nothing of it, so its head must poll.
    let holder = h.client().await.unwrap();
    let held = holder
        .try_acquire(&key, &long_opts())
        .await
        .unwrap()
        .unwrap();
    let tries = Tries::default();
    let mut tasks = Vec::new();
    for _ in 0..8 {
        let c = counted(&h, h.client().await.unwrap(), &tries);
        let key = key.clone();
        tasks.push(tokio::spawn(async move {
            let lease = c.acquire(&key, &long_opts()).await.unwrap();
            c.release(&lease).await.unwrap();
        }));
    }
    // 4 s of polling at the 200 ms backoff cap: ~25 tries for one poller,
    // ~200 if all eight polled.
    tokio::time::sleep(Duration::from_secs(4)).await;
    let during_hold = tries_of(&tries);
    assert!(
        during_hold <= 40,
        "{during_hold} tries while one holder held the key"
    );
    holder.release(&held).await.unwrap();
    for t in tasks {
        tokio::time::timeout(Duration::from_secs(60), t)
            .await
            .unwrap()
            .unwrap();
    }
}

/// While a task of this process holds the key, the waiters do not poll it
/// (beyond a slow re-check): they wait for its release.
#[tokio::test(start_paused = true)]
async fn a_local_holder_is_waited_for_not_polled() {
    let h = PollingHarness::new();
    let key = LockKey::new("local-holder").unwrap();
    let holder = h.client().await.unwrap();
    let tries = Tries::default();
    let waiter = counted(&h, h.client().await.unwrap(), &tries);
    let held = holder.acquire(&key, &long_opts()).await.unwrap();
    let task = {
        let key = key.clone();
        tokio::spawn(async move { waiter.acquire(&key, &long_opts()).await })
    };
    tokio::time::sleep(Duration::from_millis(5_500)).await;
    // One slow re-check a second (polling with backoff would be ~30).
    let during = tries_of(&tries);
    assert!(
        during <= 5,
        "the waiter polled a key held in its own process {during} times"
    );
    holder.release(&held).await.unwrap();
    let lease = task.await.unwrap().unwrap();
    assert!(lease.token > held.token);
    assert_eq!(
        tries_of(&tries),
        during + 1,
        "the release was not taken at once"
    );
}

/// A head that gives up (its future dropped) hands the turn on; an owner
/// that already holds a reentrant key is never queued behind waiters that
/// wait for it.
#[tokio::test(start_paused = true)]
async fn dropped_head_hands_on_and_reentry_skips_the_line() {
    let h = PollingHarness::new();
    let key = LockKey::new("handover").unwrap();
    let owner = fenced_api::Owner::random();
    let re = LockOptions::builder()
        .ttl(Duration::from_secs(60))
        .owner(owner.as_str())
        .reentrant(true)
        .build()
        .unwrap();
    let holder = h.client().await.unwrap();
    let held = holder.acquire(&key, &re).await.unwrap();
    let head = {
        let (c, key) = (h.client().await.unwrap(), key.clone());
        tokio::spawn(async move { c.acquire(&key, &long_opts()).await })
    };
    tokio::time::sleep(Duration::from_millis(50)).await;
    let second = {
        let (c, key) = (h.client().await.unwrap(), key.clone());
        tokio::spawn(async move { c.acquire(&key, &long_opts()).await })
    };
    tokio::time::sleep(Duration::from_millis(50)).await;
    // Re-entering while two waiters queue: granted at once, not after them.
    let again = tokio::time::timeout(Duration::from_secs(1), holder.acquire(&key, &re))
        .await
        .expect("re-entry queued behind waiters")
        .unwrap();
    assert_eq!(again.token, held.token);
    head.abort();
    assert!(head.await.unwrap_err().is_cancelled());
    holder.release(&again).await.unwrap();
    holder.release(&held).await.unwrap();
    let got = tokio::time::timeout(Duration::from_secs(10), second)
        .await
        .expect("the second waiter never got the turn")
        .unwrap()
        .unwrap();
    assert!(got.token > held.token);
}

/// A waiter behind a holder of its own process still times out at its
/// bound (with one last try there), and notices a release it was not told
/// about (an admin's force-release from elsewhere) within a second.
#[tokio::test(start_paused = true)]
async fn local_holder_wait_respects_the_bound_and_rechecks() {
    let h = PollingHarness::new();
    let key = LockKey::new("bounded-local").unwrap();
    let holder = h.client().await.unwrap();
    let held = holder.acquire(&key, &long_opts()).await.unwrap();
    let tries = Tries::default();
    let waiter = counted(&h, h.client().await.unwrap(), &tries);
    let bounded = LockOptions::builder()
        .ttl(Duration::from_secs(60))
        .wait_timeout(Duration::from_millis(2_500))
        .build()
        .unwrap();
    let start = Instant::now();
    let err = waiter.acquire(&key, &bounded).await.unwrap_err();
    assert!(matches!(err, fenced_api::Error::Timeout { .. }), "{err}");
    assert_eq!(start.elapsed(), Duration::from_millis(2_500));
    // Re-checks at 1 s and 2 s, the last try at the bound: no spinning.
    assert!(
        (2..=4).contains(&tries_of(&tries)),
        "{} tries",
        tries_of(&tries)
    );

    // A release this process is not told about (the inner store of another
    // client frees the key without the wake-up signal).
    let task = {
        let (w, key) = (Arc::clone(&waiter), key.clone());
        tokio::spawn(async move { w.acquire(&key, &long_opts()).await })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    // The same store, without the polling wrapper: no wake-up signal.
    let silent = h.inner.memory_client();
    assert!(silent.force_release(&key).await.unwrap());
    let got = tokio::time::timeout(Duration::from_secs(5), task)
        .await
        .expect("the waiter never noticed the release")
        .unwrap()
        .unwrap();
    assert!(got.token > held.token);
}
