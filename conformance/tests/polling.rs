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
    ReleaseOutcome, Result,
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

fenced_conformance::conformance_tests!(PollingHarness::new());

/// With time paused, a waiter deep in its backoff is granted the key at the
/// very instant of a local release — not at its next poll.
#[tokio::test(start_paused = true)]
async fn local_release_wakes_a_backed_off_waiter_at_once() {
    let h = PollingHarness::new();
    let (a, b) = (h.client().await.unwrap(), h.client().await.unwrap());
    let key = LockKey::new("handoff").unwrap();
    let opts = LockOptions::builder()
        .ttl(Duration::from_secs(60))
        .build()
        .unwrap();
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
    let opts = LockOptions::builder()
        .ttl(Duration::from_secs(60))
        .wait_timeout(Duration::from_millis(1_234))
        .build()
        .unwrap();
    let _held = a.try_acquire(&key, &opts).await.unwrap().unwrap();
    let start = Instant::now();
    let err = b.acquire(&key, &opts).await.unwrap_err();
    assert!(matches!(err, fenced_api::Error::Timeout { .. }), "{err}");
    assert_eq!(start.elapsed(), Duration::from_millis(1_234));
}
