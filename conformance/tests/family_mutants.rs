//! The family's case lists must be able to fail: broken semaphore stores and
//! broken mutexes under the multi-lock and election ("mutants") are caught
//! by the cases that guard against their bug, while the other cases of the
//! list keep passing on them.

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
    Capabilities, DistributedLock, FencingToken, KeyHolders, Lease, LockInfo, LockKey, LockOptions,
    MemoryLock, MemorySemaphores, Permits, ReleaseOutcome, Result, SemaphoreStore,
};
use fenced_conformance::{run_case, Harness, MemoryHarness, Outcome};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Bug {
    /// Every request is granted as if the key had a million permits (or
    /// every reader-writer request were a reader).
    NoBound,
    /// A request with another capacity is served with the key's capacity
    /// instead of being refused.
    NoAgreement,
    /// Tokens decrease with every grant.
    TokensDecrease,
    /// Permits live for a day whatever the TTL.
    TtlIgnored,
    /// Writers never take a place in line: they poll, so readers overtake them.
    WritersPoll,
    /// A waiter's `acquire` goes on in a task of its own: dropping it does
    /// not take the waiter out of line, and what it gets it holds for long.
    WaiterNeverLeaves,
    /// `release` frees the key's oldest holder, whoever asks.
    ReleaseAny,
    /// `holders` shows only the oldest holder, without its label.
    HoldersBlind,
    /// Waiters are served last come, first served (only the newest polls).
    Lifo,
    /// Mutexes: a grant whatever the key's holder (`force_release` first).
    NoExclusion,
    /// Mutexes and permits: renewals always succeed, so no loss is noticed.
    RenewalsNeverFail,
    /// Mutexes: `inspect` never sees a holder.
    InspectBlind,
}

const FLIP: u64 = 1_000_000_000;

#[derive(Debug, Clone)]
struct Sem {
    inner: MemorySemaphores,
    bug: Bug,
    /// The waiters of every client, newest last (`Lifo`).
    stack: Arc<Mutex<Vec<u64>>>,
}

static WAITER_IDS: AtomicU64 = AtomicU64::new(0);

impl Sem {
    fn outer(&self, mut lease: Lease, asked: Duration) -> Lease {
        match self.bug {
            Bug::TokensDecrease => lease.token = FencingToken::new(FLIP - lease.token.get()),
            Bug::TtlIgnored => lease = lease.renewed(asked, tokio::time::Instant::now()),
            _ => {}
        }
        lease
    }

    fn inner_lease(&self, lease: &Lease) -> Lease {
        let mut l = lease.clone();
        if self.bug == Bug::TokensDecrease {
            l.token = FencingToken::new(FLIP - lease.token.get());
        }
        l
    }

    fn opts(&self, opts: &LockOptions) -> Result<LockOptions> {
        match self.bug {
            Bug::TtlIgnored => opts.to_builder().ttl(LockOptions::MAX_TTL).build(),
            Bug::WaiterNeverLeaves => opts.to_builder().ttl(opts.ttl() * 30).build(),
            _ => Ok(opts.clone()),
        }
    }

    fn permits(&self, p: Permits) -> Permits {
        match self.bug {
            Bug::NoBound if p.is_rw() => Permits::read(),
            Bug::NoBound => Permits::semaphore(Permits::MAX_PERMITS).unwrap(),
            _ => p,
        }
    }

    async fn agreed(&self, key: &LockKey, p: Permits) -> Result<Permits> {
        if self.bug != Bug::NoAgreement {
            return Ok(p);
        }
        Ok(match self.inner.holders(key).await? {
            Some(k) if k.capacity != p.capacity() => {
                Permits::from_parts(k.capacity, p.weight().min(k.capacity))
                    .unwrap_or(Permits::read())
            }
            _ => p,
        })
    }
}

#[async_trait]
impl SemaphoreStore for Sem {
    async fn try_acquire_permits(
        &self,
        key: &LockKey,
        permits: Permits,
        opts: &LockOptions,
    ) -> Result<Option<Lease>> {
        let p = self.agreed(key, self.permits(permits)).await?;
        let lease = self
            .inner
            .try_acquire_permits(key, p, &self.opts(opts)?)
            .await?;
        Ok(lease.map(|l| self.outer(l, opts.ttl())))
    }

    async fn acquire_permits(
        &self,
        key: &LockKey,
        permits: Permits,
        opts: &LockOptions,
    ) -> Result<Lease> {
        let p = self.agreed(key, self.permits(permits)).await?;
        let inner_opts = self.opts(opts)?;
        if self.bug == Bug::WritersPoll && p.is_exclusive() {
            let deadline =
                fenced_api::wait::wait_deadline(opts.wait(), tokio::time::Instant::now());
            loop {
                if let Some(l) = self.inner.try_acquire_permits(key, p, &inner_opts).await? {
                    return Ok(l);
                }
                if deadline.is_some_and(|d| tokio::time::Instant::now() >= d) {
                    return Err(fenced_api::Error::Timeout {
                        key: key.clone(),
                        waited: Duration::ZERO,
                    });
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }
        if self.bug == Bug::Lifo {
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
                    if let Some(l) = self.inner.try_acquire_permits(key, p, &inner_opts).await? {
                        return Ok(l);
                    }
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }
        if self.bug == Bug::WaiterNeverLeaves {
            let (inner, key) = (self.inner.clone(), key.clone());
            let task =
                tokio::spawn(async move { inner.acquire_permits(&key, p, &inner_opts).await });
            return task.await.expect("waiter task");
        }
        let lease = self.inner.acquire_permits(key, p, &inner_opts).await?;
        Ok(self.outer(lease, opts.ttl()))
    }

    async fn holders(&self, key: &LockKey) -> Result<Option<KeyHolders>> {
        let seen = self.inner.holders(key).await?;
        Ok(seen.map(|mut k| {
            if self.bug == Bug::TokensDecrease {
                for h in &mut k.holders {
                    h.info.token = FencingToken::new(FLIP - h.info.token.get());
                }
            }
            if self.bug == Bug::HoldersBlind {
                k.holders.truncate(1);
                for h in &mut k.holders {
                    h.info.label = None;
                }
            }
            k
        }))
    }
}

#[async_trait]
impl DistributedLock for Sem {
    async fn try_acquire(&self, key: &LockKey, opts: &LockOptions) -> Result<Option<Lease>> {
        self.try_acquire_permits(key, Permits::semaphore(1)?, opts)
            .await
    }

    async fn acquire(&self, key: &LockKey, opts: &LockOptions) -> Result<Lease> {
        self.acquire_permits(key, Permits::semaphore(1)?, opts)
            .await
    }

    async fn extend(&self, lease: &Lease, ttl: Duration) -> Result<Lease> {
        if self.bug == Bug::RenewalsNeverFail {
            return Ok(lease.renewed(ttl, tokio::time::Instant::now()));
        }
        let inner_ttl = match self.bug {
            Bug::TtlIgnored => LockOptions::MAX_TTL,
            _ => ttl,
        };
        let renewed = self
            .inner
            .extend(&self.inner_lease(lease), inner_ttl)
            .await?;
        Ok(self.outer(renewed, ttl))
    }

    async fn release(&self, lease: &Lease) -> Result<ReleaseOutcome> {
        if self.bug == Bug::ReleaseAny {
            let Some(first) = self
                .inner
                .holders(&lease.key)
                .await?
                .and_then(|k| k.holders.into_iter().next())
            else {
                return Ok(ReleaseOutcome::NotHeld);
            };
            let theirs = Lease::new(
                lease.key.clone(),
                first.info.owner,
                first.info.token,
                lease.ttl,
                tokio::time::Instant::now(),
            );
            return self.inner.release(&theirs).await;
        }
        self.inner.release(&self.inner_lease(lease)).await
    }

    async fn inspect(&self, key: &LockKey) -> Result<Option<LockInfo>> {
        self.inner.inspect(key).await
    }

    async fn force_release(&self, key: &LockKey) -> Result<bool> {
        self.inner.force_release(key).await
    }

    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }

    fn semaphores(&self) -> Option<Arc<dyn SemaphoreStore>> {
        Some(Arc::new(self.clone()))
    }
}

/// The mutex side: `MemoryLock` with the mutex bugs, whose semaphores are `Sem`.
#[derive(Debug)]
struct Lock {
    inner: MemoryLock,
    bug: Bug,
    stack: Arc<Mutex<Vec<u64>>>,
}

#[async_trait]
impl fenced_api::WrapLock for Lock {
    fn inner(&self) -> &dyn DistributedLock {
        &self.inner
    }

    async fn try_acquire(&self, key: &LockKey, opts: &LockOptions) -> Result<Option<Lease>> {
        if self.bug == Bug::NoExclusion {
            self.inner.force_release(key).await?;
        }
        self.inner.try_acquire(key, opts).await
    }

    async fn acquire(&self, key: &LockKey, opts: &LockOptions) -> Result<Lease> {
        if self.bug == Bug::NoExclusion {
            self.inner.force_release(key).await?;
        }
        self.inner.acquire(key, opts).await
    }

    async fn extend(&self, lease: &Lease, ttl: Duration) -> Result<Lease> {
        if self.bug == Bug::RenewalsNeverFail {
            return Ok(lease.renewed(ttl, tokio::time::Instant::now()));
        }
        self.inner.extend(lease, ttl).await
    }

    async fn extend_many(&self, leases: &[Lease], ttl: Duration) -> Vec<Result<Lease>> {
        let mut out = Vec::new();
        for l in leases {
            out.push(fenced_api::WrapLock::extend(self, l, ttl).await);
        }
        out
    }

    async fn inspect(&self, key: &LockKey) -> Result<Option<LockInfo>> {
        if self.bug == Bug::InspectBlind {
            return Ok(None);
        }
        self.inner.inspect(key).await
    }

    fn semaphores(&self) -> Option<Arc<dyn SemaphoreStore>> {
        Some(Arc::new(Sem {
            inner: self.inner.memory_semaphores(),
            bug: self.bug,
            stack: Arc::clone(&self.stack),
        }))
    }
}
fenced_api::wrap_lock!(Lock);

struct MutantHarness {
    inner: MemoryHarness,
    bug: Bug,
    stack: Arc<Mutex<Vec<u64>>>,
}

#[async_trait]
impl Harness for MutantHarness {
    async fn client(&self) -> Result<Arc<dyn DistributedLock>> {
        Ok(Arc::new(Lock {
            inner: self.inner.memory_client(),
            bug: self.bug,
            stack: Arc::clone(&self.stack),
        }))
    }

    async fn client_in_namespace(&self, suffix: &str) -> Result<Arc<dyn DistributedLock>> {
        Ok(Arc::new(Lock {
            inner: self
                .inner
                .memory_client()
                .with_namespace(format!("ns-{suffix}")),
            bug: self.bug,
            stack: Arc::clone(&self.stack),
        }))
    }

    fn base_ttl(&self) -> Duration {
        self.inner.base_ttl()
    }
}

/// Every case of `must_fail` must fail on the mutant (within a bound: a
/// hang is a failure to catch), every case of `must_pass` must pass.
async fn check(bug: Bug, must_fail: &[&str], must_pass: &[&str]) {
    let h = MutantHarness {
        inner: MemoryHarness::new(),
        bug,
        stack: Arc::default(),
    };
    let bound = Duration::from_secs(120);
    for name in must_fail {
        let result = tokio::time::timeout(bound, run_case(&h, name))
            .await
            .unwrap_or_else(|_| panic!("{bug:?}: {name} hung instead of failing"));
        assert!(
            result.is_err(),
            "{bug:?} was not caught by {name}: {result:?}"
        );
    }
    for name in must_pass {
        let result = tokio::time::timeout(bound, run_case(&h, name))
            .await
            .unwrap_or_else(|_| panic!("{bug:?}: {name} hung"));
        assert_eq!(
            result,
            Ok(Outcome::Passed),
            "{bug:?} should not affect {name}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unbounded_permits_are_caught() {
    check(
        Bug::NoBound,
        &[
            "s01_permits_bound_holders",
            "s01_contention_never_exceeds_permits",
            "rw01_readers_share_writer_excludes",
            "rw06_client_rw_lock",
        ],
        &["s03_tokens_rise_with_every_grant"],
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn capacity_disagreement_is_caught() {
    check(
        Bug::NoAgreement,
        &["s02_capacity_mismatch_rejected", "rw06_client_rw_lock"],
        &[
            "s01_permits_bound_holders",
            "rw01_readers_share_writer_excludes",
        ],
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decreasing_permit_tokens_are_caught() {
    check(
        Bug::TokensDecrease,
        &[
            "s01_permits_bound_holders",
            "s03_tokens_rise_with_every_grant",
            "rw03_writer_token_above_every_earlier_grant",
        ],
        &["s02_capacity_mismatch_rejected"],
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ignored_permit_ttl_is_caught() {
    check(
        Bug::TtlIgnored,
        &["s05_dead_holder_permit_returns", "rw05_dead_writer_expires"],
        &["s01_permits_bound_holders"],
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writers_overtaken_by_readers_are_caught() {
    check(
        Bug::WritersPoll,
        &[
            "rw02_waiting_writer_holds_back_new_readers",
            "rw04_writer_not_starved_by_readers",
        ],
        &[
            "rw01_readers_share_writer_excludes",
            "rw03_writer_token_above_every_earlier_grant",
        ],
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiters_that_never_leave_are_caught() {
    check(
        Bug::WaiterNeverLeaves,
        &["s05_cancelled_waiter_leaves_line"],
        &["s01_permits_bound_holders"],
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn releasing_another_holders_permit_is_caught() {
    check(
        Bug::ReleaseAny,
        &["s06_permits_are_released_one_by_one"],
        &["s03_tokens_rise_with_every_grant"],
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiters_served_out_of_order_are_caught() {
    check(
        Bug::Lifo,
        &["s04_waiters_granted_in_order"],
        &["s01_permits_bound_holders"],
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blind_holders_are_caught() {
    check(
        Bug::HoldersBlind,
        &["s07_holders_shows_everyone"],
        &["s01_permits_bound_holders"],
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn multi_lock_and_election_without_exclusion_are_caught() {
    check(
        Bug::NoExclusion,
        &[
            "m01_multi_all_or_nothing",
            "m02_multi_opposite_orders_never_deadlock",
            "m03_multi_timeout_releases_taken_keys",
            "e01_election_one_leader_rising_terms",
        ],
        &["s01_permits_bound_holders"],
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unnoticed_losses_are_caught() {
    check(
        Bug::RenewalsNeverFail,
        &[
            "s08_client_guard_learns_of_loss",
            "m04_multi_lost_with_any_member",
            "e03_election_leader_learns_of_loss",
        ],
        &["m01_multi_all_or_nothing"],
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_blind_leader_lookup_is_caught() {
    check(
        Bug::InspectBlind,
        &[
            "e01_election_one_leader_rising_terms",
            "e02_election_observe_sees_changes",
        ],
        &["s01_permits_bound_holders"],
    )
    .await;
}

#[test]
fn every_family_case_has_a_mutant() {
    let file = include_str!("family_mutants.rs");
    let missing: Vec<&str> = fenced_conformance::CASES
        .iter()
        .map(|c| c.name)
        .filter(|n| !n.starts_with('c'))
        .filter(|n| !file.contains(&format!("\"{n}\"")))
        .collect();
    assert!(
        missing.is_empty(),
        "family cases no mutant is checked against: {missing:?}"
    );
}
