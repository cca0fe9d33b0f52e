//! `DualLock`: hold every key in two stores during a live migration.

use std::{
    collections::HashMap,
    fmt,
    sync::{Arc, Mutex},
    time::Duration,
};

use async_trait::async_trait;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::{
    wait::wait_deadline, Capabilities, DistributedLock, Error, Lease, LockInfo, LockKey,
    LockOptions, ReleaseOutcome, Result, WaitPolicy,
};

/// The two underlying leases of each hold, by (key, owner, reported token).
type Holds = HashMap<(LockKey, String, u64), (Lease, Lease)>;

/// Which store's fencing token a [`DualLock`] reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TokenSource {
    /// The old store's token (phase 2: some nodes still use only the old store).
    #[default]
    Old,
    /// The new store's token (phase 3: some nodes already use only the new store).
    New,
}

/// Moves locks from one store to another while every node keeps running.
///
/// A `DualLock` takes each key in the **old** store, then in the **new** one,
/// and releases in reverse order. Nodes still on the old store, nodes on a
/// `DualLock`, and nodes already on the new store therefore exclude each
/// other in every mix that a rolling deployment produces:
///
/// | phase | nodes run | token reported |
/// |---|---|---|
/// | 1. old | `old` | old store's |
/// | 2. dual, old tokens | `old` and `DualLock::new(old, new)` | old store's ([`TokenSource::Old`]) |
/// | 3. dual, new tokens | `DualLock::new(old, new).tokens(TokenSource::New)` | new store's |
/// | 4. new | `DualLock` (phase 3) and `new` | new store's |
/// | 5. done | `new` | new store's |
///
/// Each phase starts only when the previous one is deployed everywhere.
/// Within phases 1–2 all tokens come from the old store, within 3–5 from the
/// new store, so they increase as long as **the new store's tokens exceed the
/// old store's** — "seed" the new store above the old one if its counters start
/// lower (Redis tokens are server-clock microseconds and are already far
/// above any MySQL id or etcd revision). A `DualLock` checks this on every
/// acquisition and refuses, in [`TokenSource::New`] mode, to hand out a new
/// token that is not above the old one for the same hold.
///
/// During the roll from phase 2 to 3, a node still reporting old tokens can
/// acquire after one reporting new tokens; its (lower) token is then
/// rejected by the protected resource. That costs a retry, never safety: no
/// stale write is accepted at any point.
///
/// ```
/// use std::sync::Arc;
/// use fenced_api::{DistributedLock, DualLock, LockKey, LockOptions, MemoryLock, TokenSource};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> fenced_api::Result<()> {
/// let (old, new) = (Arc::new(MemoryLock::new()), Arc::new(MemoryLock::new()));
/// let dual = DualLock::new(old.clone(), new.clone());
/// let key = LockKey::new("job")?;
/// let lease = dual.try_acquire(&key, &LockOptions::default()).await?.unwrap();
/// // Held in both stores: nodes on either one are excluded.
/// assert!(old.try_acquire(&key, &LockOptions::default()).await?.is_none());
/// assert!(new.try_acquire(&key, &LockOptions::default()).await?.is_none());
/// dual.release(&lease).await?;
/// # Ok(()) }
/// ```
///
/// It migrates mutexes only: [`semaphores`](DistributedLock::semaphores) is
/// `None`, so semaphores and reader-writer locks are refused during a
/// migration ([`Error::Unsupported`](crate::Error::Unsupported)) rather than
/// held in one store while the other nodes look in the other.
pub struct DualLock {
    old: Arc<dyn DistributedLock>,
    new: Arc<dyn DistributedLock>,
    tokens: TokenSource,
    /// The two underlying leases of each hold made here.
    holds: Mutex<Holds>,
}

impl fmt::Debug for DualLock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DualLock")
            .field("old", &self.old)
            .field("new", &self.new)
            .field("tokens", &self.tokens)
            .finish_non_exhaustive()
    }
}

impl DualLock {
    /// Holds keys in `old` then `new`, reporting the old store's tokens.
    pub fn new(old: Arc<dyn DistributedLock>, new: Arc<dyn DistributedLock>) -> Self {
        DualLock {
            old,
            new,
            tokens: TokenSource::Old,
            holds: Mutex::default(),
        }
    }

    /// Chooses whose tokens are reported (phase 2: [`TokenSource::Old`],
    /// phase 3: [`TokenSource::New`]).
    #[must_use]
    pub fn tokens(mut self, source: TokenSource) -> Self {
        self.tokens = source;
        self
    }

    fn holds(&self) -> std::sync::MutexGuard<'_, Holds> {
        self.holds.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Both stores must see the same owner, so that releases and reentrancy
    /// match in each.
    fn with_owner(opts: &LockOptions) -> Result<LockOptions> {
        match opts.owner() {
            Some(_) => Ok(opts.clone()),
            None => opts
                .to_builder()
                .owner(crate::Owner::random().as_str())
                .build(),
        }
    }

    /// Combines the two grants into the lease this lock reports.
    fn combine(&self, old: Lease, new: Lease) -> Result<Lease> {
        if new.token <= old.token {
            let msg = format!(
                "the new store's token {} is not above the old store's {} for `{}`: seed the new \
                 store's counters above the old ones before reporting new tokens",
                new.token, old.token, old.key
            );
            if self.tokens == TokenSource::New {
                return Err(Error::config(msg));
            }
            tracing::warn!(key = %old.key, "{msg}");
        }
        let token = match self.tokens {
            TokenSource::Old => old.token,
            TokenSource::New => new.token,
        };
        let mut lease = old.clone();
        lease.token = token;
        lease.ttl = old.ttl.min(new.ttl);
        lease.deadline = old.deadline.min(new.deadline);
        let mut holds = self.holds();
        if holds.len() > 4096 {
            // Holds that were never released (crashed callers) expire.
            let now = Instant::now();
            holds.retain(|_, (o, n)| o.deadline.max(n.deadline) > now);
        }
        holds.insert(
            (
                lease.key.clone(),
                lease.owner.as_str().to_owned(),
                token.get(),
            ),
            (old, new),
        );
        Ok(lease)
    }

    fn lookup(&self, lease: &Lease) -> Option<(Lease, Lease)> {
        self.holds()
            .get(&(
                lease.key.clone(),
                lease.owner.as_str().to_owned(),
                lease.token.get(),
            ))
            .cloned()
    }

    fn forget(&self, lease: &Lease) {
        self.holds().remove(&(
            lease.key.clone(),
            lease.owner.as_str().to_owned(),
            lease.token.get(),
        ));
    }

    /// What `inspect` reports from the two stores' views of one key.
    fn merge(&self, old: Option<LockInfo>, new: Option<LockInfo>) -> Option<LockInfo> {
        match (old, new) {
            (Some(o), Some(n)) => {
                let (mut info, other) = match self.tokens {
                    TokenSource::Old => (o.clone(), n.label),
                    TokenSource::New => (n.clone(), o.label),
                };
                info.remaining_ttl = o.remaining_ttl.min(n.remaining_ttl);
                // One of the stores may keep no labels (a third-party backend).
                info.label = info.label.or(other);
                Some(info)
            }
            // Held by a node that uses only one of the stores.
            (Some(one), None) | (None, Some(one)) => Some(one),
            (None, None) => None,
        }
    }

    /// Gives back an old-store lease after the new store refused or failed.
    async fn undo(&self, old: &Lease) {
        if let Err(e) = self.old.release(old).await {
            tracing::warn!(key = %old.key, error = %e, "could not give back the old-store lock; it expires after its ttl");
        }
    }
}

#[async_trait]
impl DistributedLock for DualLock {
    async fn try_acquire(&self, key: &LockKey, opts: &LockOptions) -> Result<Option<Lease>> {
        let opts = Self::with_owner(opts)?;
        let Some(old) = self.old.try_acquire(key, &opts).await? else {
            return Ok(None);
        };
        match self.new.try_acquire(key, &opts).await {
            Ok(Some(new)) => match self.combine(old.clone(), new.clone()) {
                Ok(lease) => Ok(Some(lease)),
                Err(e) => {
                    let _ = self.new.release(&new).await;
                    self.undo(&old).await;
                    Err(e)
                }
            },
            Ok(None) => {
                self.undo(&old).await;
                Ok(None)
            }
            Err(e) => {
                self.undo(&old).await;
                Err(e)
            }
        }
    }

    async fn acquire(&self, key: &LockKey, opts: &LockOptions) -> Result<Lease> {
        let opts = Self::with_owner(opts)?;
        let start = Instant::now();
        let deadline = wait_deadline(opts.wait(), start);
        let old = self.old.acquire(key, &opts).await?;
        // The new store gets what is left of the wait bound.
        let rest = match deadline {
            Some(d) => WaitPolicy::Timeout(d.saturating_duration_since(Instant::now())),
            None => WaitPolicy::Forever,
        };
        let new_opts = opts.to_builder().wait(rest).build()?;
        match self.new.acquire(key, &new_opts).await {
            Ok(new) => match self.combine(old.clone(), new.clone()) {
                Ok(lease) => Ok(lease),
                Err(e) => {
                    let _ = self.new.release(&new).await;
                    self.undo(&old).await;
                    Err(e)
                }
            },
            Err(Error::Timeout { .. }) => {
                self.undo(&old).await;
                Err(Error::Timeout {
                    key: key.clone(),
                    waited: start.elapsed(),
                })
            }
            Err(e) => {
                self.undo(&old).await;
                Err(e)
            }
        }
    }

    async fn extend(&self, lease: &Lease, ttl: Duration) -> Result<Lease> {
        let ttl = LockOptions::validate_ttl(ttl)?;
        let Some((old, new)) = self.lookup(lease) else {
            return Err(Error::lease_lost(
                &lease.key,
                lease.token,
                "not a current hold of this DualLock",
            ));
        };
        let old = self.old.extend(&old, ttl).await?;
        let new = self.new.extend(&new, ttl).await?;
        let mut renewed = lease.clone();
        renewed.ttl = old.ttl.min(new.ttl);
        renewed.deadline = old.deadline.min(new.deadline);
        self.holds().insert(
            (
                lease.key.clone(),
                lease.owner.as_str().to_owned(),
                lease.token.get(),
            ),
            (old, new),
        );
        Ok(renewed)
    }

    async fn release(&self, lease: &Lease) -> Result<ReleaseOutcome> {
        let Some((old, new)) = self.lookup(lease) else {
            return Ok(ReleaseOutcome::NotHeld);
        };
        // Reverse order: new first, then old — the old store even when the
        // new one failed, so that it is not left held until its TTL. The
        // first error is returned and the hold is kept, so a retry of the
        // release reaches the store that failed.
        let new_out = self.new.release(&new).await;
        let old_out = self.old.release(&old).await;
        let (new_out, old_out) = match (new_out, old_out) {
            (Ok(n), Ok(o)) => (n, o),
            (Err(e), Ok(_)) | (Ok(_), Err(e)) => return Err(e),
            (Err(e), Err(second)) => {
                tracing::warn!(key = %lease.key, error = %second, "the old store's release failed too; it expires after its ttl");
                return Err(e);
            }
        };
        let outcome = match (old_out, new_out) {
            (ReleaseOutcome::StillHeld { remaining }, ReleaseOutcome::StillHeld { .. }) => {
                ReleaseOutcome::StillHeld { remaining }
            }
            (ReleaseOutcome::Released, ReleaseOutcome::Released) => ReleaseOutcome::Released,
            _ => ReleaseOutcome::NotHeld,
        };
        if !matches!(outcome, ReleaseOutcome::StillHeld { .. }) {
            self.forget(lease);
        }
        Ok(outcome)
    }

    async fn inspect(&self, key: &LockKey) -> Result<Option<LockInfo>> {
        let (old, new) = (self.old.inspect(key).await?, self.new.inspect(key).await?);
        Ok(self.merge(old, new))
    }

    async fn list(&self, limit: usize) -> Result<Vec<LockInfo>> {
        let old = self.old.list(limit).await?;
        let new = self.new.list(limit).await?;
        // A store that returned `limit` locks may hold more: a key listed by
        // only the other store is then inspected there, so that its merged
        // view is the one `inspect` gives.
        let (old_full, new_full) = (old.len() >= limit, new.len() >= limit);
        let mut both: std::collections::BTreeMap<LockKey, (Option<LockInfo>, Option<LockInfo>)> =
            std::collections::BTreeMap::new();
        for info in old {
            let key = info.key.clone();
            both.entry(key).or_default().0 = Some(info);
        }
        for info in new {
            let key = info.key.clone();
            both.entry(key).or_default().1 = Some(info);
        }
        let mut held = Vec::new();
        for (key, (mut o, mut n)) in both {
            if held.len() >= limit {
                break;
            }
            if o.is_none() && old_full {
                o = self.old.inspect(&key).await?;
            }
            if n.is_none() && new_full {
                n = self.new.inspect(&key).await?;
            }
            held.extend(self.merge(o, n));
        }
        Ok(held)
    }

    async fn force_release(&self, key: &LockKey) -> Result<bool> {
        let new = self.new.force_release(key).await?;
        let old = self.old.force_release(key).await?;
        Ok(new || old)
    }

    /// One store's signal: the old store's when it has one, else the new
    /// one's. A loss in the other store shows at the next renewal (joining
    /// two signals would need a task per hold that outlives neither).
    fn loss_signal(&self, lease: &Lease) -> Option<CancellationToken> {
        let (old, new) = self.lookup(lease)?;
        self.old
            .loss_signal(&old)
            .or_else(|| self.new.loss_signal(&new))
    }

    fn capabilities(&self) -> Capabilities {
        let (o, n) = (self.old.capabilities(), self.new.capabilities());
        Capabilities::none()
            .backend("dual")
            .native_wait(o.has_native_wait() && n.has_native_wait())
            .durable(o.is_durable() && n.is_durable())
            .fifo(false)
            .fencing(o.has_fencing() && n.has_fencing())
            .reentrant(o.is_reentrant() && n.is_reentrant())
            .min_ttl(o.get_min_ttl().max(n.get_min_ttl()))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;
    use crate::MemoryLock;

    /// A memory store whose `release` always fails, like a store that went
    /// away between the acquire and the release.
    #[derive(Debug, Clone)]
    struct ReleaseFails(MemoryLock);

    #[async_trait]
    impl crate::WrapLock for ReleaseFails {
        fn inner(&self) -> &dyn DistributedLock {
            &self.0
        }
        async fn release(&self, _lease: &Lease) -> Result<ReleaseOutcome> {
            Err(Error::backend("memory", true, "connection reset"))
        }
    }
    crate::wrap_lock!(ReleaseFails);

    fn opts() -> LockOptions {
        LockOptions::builder()
            .ttl(Duration::from_secs(30))
            .build()
            .unwrap()
    }

    #[tokio::test]
    async fn a_failed_release_in_the_new_store_still_releases_the_old_one() {
        let old = MemoryLock::new();
        let new = MemoryLock::new();
        let dual = DualLock::new(Arc::new(old.clone()), Arc::new(ReleaseFails(new.clone())));
        let key = LockKey::new("job").unwrap();
        let lease = dual.try_acquire(&key, &opts()).await.unwrap().unwrap();
        let err = dual.release(&lease).await.unwrap_err();
        assert!(err.to_string().contains("connection reset"), "{err}");
        // The old store was released although the new one failed first.
        assert!(
            old.inspect(&key).await.unwrap().is_none(),
            "the old store stayed held after the new store's release failed"
        );
        assert!(new.inspect(&key).await.unwrap().is_some());
    }

    #[tokio::test]
    async fn a_failed_release_in_the_old_store_is_reported_after_the_new_one_is_freed() {
        let old = MemoryLock::new();
        let new = MemoryLock::new();
        let dual = DualLock::new(Arc::new(ReleaseFails(old.clone())), Arc::new(new.clone()));
        let key = LockKey::new("job").unwrap();
        let lease = dual.try_acquire(&key, &opts()).await.unwrap().unwrap();
        assert!(dual.release(&lease).await.is_err());
        assert!(new.inspect(&key).await.unwrap().is_none());
    }

    // Paused: the memory stores' clock stands still, so the remaining TTLs
    // that `list` and `inspect` report are equal.
    #[tokio::test(start_paused = true)]
    async fn list_merges_both_stores_like_inspect() {
        let old = MemoryLock::new();
        let new = MemoryLock::new();
        let dual = DualLock::new(Arc::new(old.clone()), Arc::new(new.clone()));
        let k = |s: &str| LockKey::new(s).unwrap();
        let both = dual.try_acquire(&k("b"), &opts()).await.unwrap().unwrap();
        let only_old = old.try_acquire(&k("a"), &opts()).await.unwrap().unwrap();
        let only_new = new.try_acquire(&k("c"), &opts()).await.unwrap().unwrap();
        let all = dual.list(10).await.unwrap();
        let keys: Vec<&str> = all.iter().map(|i| i.key.as_str()).collect();
        assert_eq!(keys, ["a", "b", "c"]);
        assert_eq!(all[0].token, only_old.token);
        assert_eq!(all[1].token, both.token);
        assert_eq!(all[2].token, only_new.token);
        for info in &all {
            assert_eq!(Some(info), dual.inspect(&info.key).await.unwrap().as_ref());
        }
        assert_eq!(dual.list(2).await.unwrap().len(), 2);
        // A store that cannot list makes the dual lock say so.
        let dual = DualLock::new(Arc::new(old.clone()), Arc::new(NoList(new.clone())));
        assert!(matches!(
            dual.list(10).await,
            Err(Error::Unsupported { .. })
        ));
    }

    /// A store that cannot list, as the trait's default `list` answers.
    #[derive(Debug)]
    struct NoList(MemoryLock);

    #[async_trait]
    impl crate::WrapLock for NoList {
        fn inner(&self) -> &dyn DistributedLock {
            &self.0
        }
        async fn list(&self, _limit: usize) -> Result<Vec<LockInfo>> {
            Err(Error::Unsupported {
                backend: "memory",
                what: "listing held locks yet; inspect the keys by name".into(),
            })
        }
    }
    crate::wrap_lock!(NoList);
}
