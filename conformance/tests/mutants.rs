//! The suite must be able to fail: deliberately broken wrappers of
//! `MemoryLock` ("mutants") must be caught by the cases that guard against
//! their bug, while the healthy cases keep passing on them.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::{
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc, Mutex,
    },
    time::Duration,
};

use async_trait::async_trait;
use fenced_api::{
    Capabilities, DistributedLock, FencingToken, Lease, LockInfo, LockKey, LockOptions, MemoryLock,
    ReleaseOutcome, Result,
};
use fenced_conformance::{run_case, Harness, MemoryHarness, Outcome};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Bug {
    /// `release` frees whoever holds the key (no owner/token check).
    ReleaseIgnoresOwner,
    /// Tokens decrease with every acquisition.
    TokensDecrease,
    /// The TTL is never honoured: locks live for a day.
    TtlIgnored,
    /// `try_acquire` takes the key even when it is held (NX dropped).
    NoExclusion,
    /// Declares fifo but serves waiters last come, first served.
    Lifo,
    /// `inspect` shows the label of the key's first grant, ever: a store
    /// that never clears a label when the holder changes.
    StaleLabel,
}

#[derive(Debug)]
struct Mutant {
    inner: MemoryLock,
    bug: Bug,
    /// The waiters of every client of the harness, newest last (`Lifo`).
    stack: Arc<Mutex<Vec<u64>>>,
    /// The first label seen per key (`StaleLabel`).
    labels: Arc<Mutex<std::collections::HashMap<LockKey, fenced_api::Label>>>,
}

static WAITER_IDS: AtomicU64 = AtomicU64::new(0);

impl Mutant {
    /// `Lifo`'s acquire: only the newest waiter polls the key.
    async fn acquire_lifo(&self, key: &LockKey, opts: &LockOptions) -> Result<Lease> {
        struct Leave<'a>(&'a Mutex<Vec<u64>>, u64);
        impl Drop for Leave<'_> {
            fn drop(&mut self) {
                self.0.lock().unwrap().retain(|w| *w != self.1);
            }
        }
        let id = WAITER_IDS.fetch_add(1, Ordering::Relaxed);
        self.stack.lock().unwrap().push(id);
        let _leave = Leave(&self.stack, id);
        loop {
            if self.stack.lock().unwrap().last() == Some(&id) {
                if let Some(lease) = self.inner.try_acquire(key, opts).await? {
                    return Ok(lease);
                }
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
}

const FLIP: u64 = 1_000_000_000;

impl Mutant {
    /// Lease as the outside sees it → lease as the inner store knows it.
    fn inner_lease(&self, lease: &Lease) -> Lease {
        match self.bug {
            Bug::TokensDecrease => {
                let mut l = lease.clone();
                l.token = FencingToken::new(FLIP.wrapping_sub(lease.token.get()));
                l
            }
            _ => lease.clone(),
        }
    }

    fn outer_lease(&self, mut lease: Lease, requested_ttl: Duration) -> Lease {
        match self.bug {
            Bug::TokensDecrease => {
                lease.token = FencingToken::new(FLIP.wrapping_sub(lease.token.get()))
            }
            Bug::TtlIgnored => {
                lease = lease.renewed(requested_ttl, tokio::time::Instant::now());
            }
            _ => {}
        }
        lease
    }

    fn inner_opts(&self, opts: &LockOptions) -> Result<LockOptions> {
        match self.bug {
            Bug::TtlIgnored => opts.to_builder().ttl(LockOptions::MAX_TTL).build(),
            _ => Ok(opts.clone()),
        }
    }
}

#[async_trait]
impl DistributedLock for Mutant {
    async fn try_acquire(&self, key: &LockKey, opts: &LockOptions) -> Result<Option<Lease>> {
        if self.bug == Bug::NoExclusion {
            self.inner.force_release(key).await?;
        }
        let lease = self.inner.try_acquire(key, &self.inner_opts(opts)?).await?;
        Ok(lease.map(|l| self.outer_lease(l, opts.ttl())))
    }

    async fn acquire(&self, key: &LockKey, opts: &LockOptions) -> Result<Lease> {
        if self.bug == Bug::NoExclusion {
            self.inner.force_release(key).await?;
        }
        if self.bug == Bug::Lifo {
            return self.acquire_lifo(key, opts).await;
        }
        let lease = self.inner.acquire(key, &self.inner_opts(opts)?).await?;
        Ok(self.outer_lease(lease, opts.ttl()))
    }

    async fn extend(&self, lease: &Lease, ttl: Duration) -> Result<Lease> {
        let inner_ttl = match self.bug {
            Bug::TtlIgnored => LockOptions::validate_ttl(ttl).map(|_| LockOptions::MAX_TTL)?,
            _ => ttl,
        };
        let renewed = self
            .inner
            .extend(&self.inner_lease(lease), inner_ttl)
            .await?;
        Ok(self.outer_lease(renewed, ttl))
    }

    async fn release(&self, lease: &Lease) -> Result<ReleaseOutcome> {
        if self.bug == Bug::ReleaseIgnoresOwner {
            return match self.inner.inspect(&lease.key).await? {
                Some(info) => {
                    let theirs = Lease::new(
                        info.key,
                        info.owner,
                        info.token,
                        lease.ttl,
                        tokio::time::Instant::now(),
                    );
                    self.inner.release(&theirs).await
                }
                None => Ok(ReleaseOutcome::NotHeld),
            };
        }
        self.inner.release(&self.inner_lease(lease)).await
    }

    async fn inspect(&self, key: &LockKey) -> Result<Option<LockInfo>> {
        let info = self.inner.inspect(key).await?;
        Ok(info.map(|mut i| {
            if self.bug == Bug::TokensDecrease {
                i.token = FencingToken::new(FLIP.wrapping_sub(i.token.get()));
            }
            if self.bug == Bug::StaleLabel {
                let mut labels = self.labels.lock().unwrap();
                if let Some(l) = &i.label {
                    labels.entry(i.key.clone()).or_insert_with(|| l.clone());
                }
                i.label = labels.get(&i.key).cloned();
            }
            i
        }))
    }

    async fn force_release(&self, key: &LockKey) -> Result<bool> {
        self.inner.force_release(key).await
    }

    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }
}

struct MutantHarness {
    inner: MemoryHarness,
    bug: Bug,
    stack: Arc<Mutex<Vec<u64>>>,
    labels: Arc<Mutex<std::collections::HashMap<LockKey, fenced_api::Label>>>,
}

#[async_trait]
impl Harness for MutantHarness {
    async fn client(&self) -> Result<Arc<dyn DistributedLock>> {
        Ok(Arc::new(Mutant {
            inner: self.inner.memory_client(),
            bug: self.bug,
            stack: Arc::clone(&self.stack),
            labels: Arc::clone(&self.labels),
        }))
    }

    async fn client_in_namespace(&self, suffix: &str) -> Result<Arc<dyn DistributedLock>> {
        // The harness's store is its own, so any namespace name is unique.
        Ok(Arc::new(Mutant {
            inner: self
                .inner
                .memory_client()
                .with_namespace(format!("ns-{suffix}")),
            bug: self.bug,
            stack: Arc::clone(&self.stack),
            labels: Arc::clone(&self.labels),
        }))
    }

    fn base_ttl(&self) -> Duration {
        self.inner.base_ttl()
    }
}

/// Runs `must_fail` (each must report a failure) and `must_pass` (each must
/// pass: the mutant is otherwise healthy, so failures are attributed right).
async fn check(bug: Bug, must_fail: &[&str], must_pass: &[&str]) {
    let h = MutantHarness {
        inner: MemoryHarness::new(),
        bug,
        stack: Arc::default(),
        labels: Arc::default(),
    };
    for name in must_fail {
        let result = run_case(&h, name).await;
        assert!(
            result.is_err(),
            "{bug:?} was not caught by {name}: {result:?}"
        );
    }
    for name in must_pass {
        let result = run_case(&h, name).await;
        assert_eq!(
            result,
            Ok(Outcome::Passed),
            "{bug:?} should not affect {name}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn release_ignoring_owner_is_caught() {
    check(
        Bug::ReleaseIgnoresOwner,
        &[
            "c04_stale_lease_never_touches_new_holder",
            "c04_forged_lease_rejected",
            "c03_double_release_is_not_held",
        ],
        &[
            "c01_free_key_grants_token",
            "c07_tokens_increase_after_release",
        ],
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decreasing_tokens_are_caught() {
    check(
        Bug::TokensDecrease,
        &[
            "c07_tokens_increase_after_release",
            "c07_tokens_increase_after_expiry",
            "c07_tokens_increase_after_force_release",
            "c10_mutual_exclusion_under_contention",
        ],
        &["c03_release_frees_key", "c04_forged_lease_rejected"],
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ignored_ttl_is_caught() {
    check(
        Bug::TtlIgnored,
        &[
            "c05_expiry_frees_key",
            "c07_tokens_increase_after_expiry",
            "c08_waiter_gets_lock_on_expiry",
        ],
        &["c03_release_frees_key", "c06_extend_keeps_lock"],
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_exclusion_is_caught() {
    check(
        Bug::NoExclusion,
        &[
            "c02_held_key_refused_at_once",
            "c10_mutual_exclusion_under_contention",
            "c18_awkward_keys_distinct_and_exact",
        ],
        &[
            "c01_free_key_grants_token",
            "c11_different_keys_independent",
        ],
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiters_served_out_of_order_are_caught() {
    check(
        Bug::Lifo,
        &["c08_waiters_served_in_order"],
        &[
            "c01_free_key_grants_token",
            "c08_waiter_gets_lock_on_release",
        ],
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stale_labels_are_caught() {
    check(
        Bug::StaleLabel,
        &["c17_inspect_shows_the_label"],
        &["c17_inspect_shows_holder", "c01_free_key_grants_token"],
    )
    .await;
}

#[tokio::test]
async fn unknown_case_name_is_an_error() {
    let h = MemoryHarness::new();
    assert!(run_case(&h, "no_such_case").await.is_err());
}

#[test]
fn the_list_covers_every_contract_item() {
    let cases = fenced_conformance::CASES;
    assert!(cases.len() >= 25, "only {} cases", cases.len());
    for n in 1..=20 {
        let item = format!("C{n}");
        assert!(
            cases
                .iter()
                .any(|c| c.contract.split(", ").any(|x| x == item)),
            "no case covers {item}"
        );
    }
    let mut names: Vec<_> = cases.iter().map(|c| c.name).collect();
    names.sort_unstable();
    names.dedup();
    assert_eq!(names.len(), cases.len(), "duplicate case names");
}
