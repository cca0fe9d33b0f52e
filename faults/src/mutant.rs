//! Deliberately broken locks ("mutants") for the fault suite's control
//! runs: each wraps a real backend and removes one safety mechanism (the
//! owner check, NX, expiry on the store's clock). A fault run on a mutant
//! must come out unsafe — the proof that the suite's checks catch that
//! class of bug on a real store, the way `conformance/tests/mutants.rs`
//! proves it for the conformance cases.
//!
//! * [`Mutant::OwnerCheckRemoved`] — `release` frees whoever holds the key;
//! * [`Mutant::NxDropped`] — acquiring takes the key even when it is held;
//! * [`Mutant::ClientClockExpiry`] — a contender judges a holder's expiry by
//!   an expiry the *holder's* wall clock computed, compared with its own
//!   wall clock (the classic `expire_time = client_now + ttl` bug). Shared
//!   through files in a directory, so separate processes — one of them
//!   under a skewed clock — see each other's expiries.

use std::{
    path::{Path, PathBuf},
    sync::Arc,
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use async_trait::async_trait;
use fenced_api::{
    Capabilities, DistributedLock, Error, Lease, LockInfo, LockKey, LockOptions, ReleaseOutcome,
    Result, WaitPolicy,
};
use serde::{Deserialize, Serialize};

/// The class of bug a mutant carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Mutant {
    /// `release` does not check owner and token.
    OwnerCheckRemoved,
    /// `SET NX` dropped: acquiring overwrites a current holder.
    NxDropped,
    /// Expiry computed on the client's wall clock.
    ClientClockExpiry,
}

impl Mutant {
    /// Every mutant.
    pub const ALL: [Mutant; 3] = [
        Mutant::OwnerCheckRemoved,
        Mutant::NxDropped,
        Mutant::ClientClockExpiry,
    ];

    /// Its name in reports and on the client binary's command line.
    pub fn name(self) -> &'static str {
        match self {
            Mutant::OwnerCheckRemoved => "owner-check-removed",
            Mutant::NxDropped => "nx-dropped",
            Mutant::ClientClockExpiry => "client-clock-expiry",
        }
    }

    /// The mutant called `name`.
    pub fn from_name(name: &str) -> Option<Mutant> {
        Mutant::ALL.into_iter().find(|m| m.name() == name)
    }

    /// Wraps `inner`; `dir` is shared by every client of the run.
    pub fn wrap(self, inner: Arc<dyn DistributedLock>, dir: &Path) -> Arc<dyn DistributedLock> {
        Arc::new(MutantLock {
            inner,
            kind: self,
            dir: dir.to_owned(),
        })
    }
}

#[derive(Debug)]
struct MutantLock {
    inner: Arc<dyn DistributedLock>,
    kind: Mutant,
    dir: PathBuf,
}

fn wall_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

impl MutantLock {
    fn expiry_file(&self, key: &LockKey) -> PathBuf {
        let h = key
            .as_bytes()
            .iter()
            .fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
                (h ^ u64::from(*b)).wrapping_mul(0x0000_0100_0000_01b3)
            });
        self.dir.join(format!("expiry-{h:016x}"))
    }

    /// The holder writes "token expiry" from its own wall clock.
    fn record(&self, lease: &Lease) {
        if self.kind == Mutant::ClientClockExpiry {
            let line = format!(
                "{} {}",
                lease.token.get(),
                wall_ms() + lease.ttl.as_millis() as u64
            );
            let _ = std::fs::create_dir_all(&self.dir);
            let _ = std::fs::write(self.expiry_file(&lease.key), line);
        }
    }

    /// What the mutant does before it tries to take `key`.
    async fn before_acquire(&self, key: &LockKey) -> Result<()> {
        match self.kind {
            Mutant::NxDropped => {
                self.inner.force_release(key).await?;
            }
            Mutant::ClientClockExpiry => {
                let Some(info) = self.inner.inspect(key).await? else {
                    return Ok(());
                };
                let recorded = std::fs::read_to_string(self.expiry_file(key)).unwrap_or_default();
                let mut it = recorded.split_whitespace().map(str::parse::<u64>);
                if let (Some(Ok(token)), Some(Ok(expiry))) = (it.next(), it.next()) {
                    // "Expired" by the holder's clock as read on mine.
                    if token == info.token.get() && expiry < wall_ms() {
                        self.inner.force_release(key).await?;
                    }
                }
            }
            Mutant::OwnerCheckRemoved => {}
        }
        Ok(())
    }
}

#[async_trait]
impl DistributedLock for MutantLock {
    async fn try_acquire(&self, key: &LockKey, opts: &LockOptions) -> Result<Option<Lease>> {
        self.before_acquire(key).await?;
        let lease = self.inner.try_acquire(key, opts).await?;
        if let Some(l) = &lease {
            self.record(l);
        }
        Ok(lease)
    }

    async fn acquire(&self, key: &LockKey, opts: &LockOptions) -> Result<Lease> {
        if self.kind == Mutant::OwnerCheckRemoved {
            return self.inner.acquire(key, opts).await;
        }
        // Poll, so that the mutant's own judgement runs on every attempt.
        let start = tokio::time::Instant::now();
        let deadline = match opts.wait() {
            WaitPolicy::NoWait => Some(start),
            WaitPolicy::Timeout(d) => start.checked_add(d),
            WaitPolicy::Forever => None,
        };
        loop {
            if let Some(l) = self.try_acquire(key, opts).await? {
                return Ok(l);
            }
            if deadline.is_some_and(|d| tokio::time::Instant::now() >= d) {
                return Err(Error::Timeout {
                    key: key.clone(),
                    waited: start.elapsed(),
                });
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    async fn extend(&self, lease: &Lease, ttl: Duration) -> Result<Lease> {
        let renewed = self.inner.extend(lease, ttl).await?;
        self.record(&renewed);
        Ok(renewed)
    }

    async fn release(&self, lease: &Lease) -> Result<ReleaseOutcome> {
        if self.kind == Mutant::OwnerCheckRemoved {
            // Frees whatever is there: the current holder's lock included.
            return Ok(if self.inner.force_release(&lease.key).await? {
                ReleaseOutcome::Released
            } else {
                ReleaseOutcome::NotHeld
            });
        }
        self.inner.release(lease).await
    }

    async fn inspect(&self, key: &LockKey) -> Result<Option<LockInfo>> {
        self.inner.inspect(key).await
    }

    async fn force_release(&self, key: &LockKey) -> Result<bool> {
        self.inner.force_release(key).await
    }

    /// Forwarded unchanged: no mutant alters listing.
    async fn list(&self, limit: usize) -> Result<Vec<LockInfo>> {
        self.inner.list(limit).await
    }

    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }
}
