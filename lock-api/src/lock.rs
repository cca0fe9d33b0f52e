//! The `DistributedLock` trait: the per-store primitive, no policy.

use std::{sync::Arc, time::Duration};

use async_trait::async_trait;
use tokio_util::sync::CancellationToken;

use crate::{Capabilities, Lease, LockInfo, LockKey, LockOptions, ReleaseOutcome, Result};

/// A store that can grant leases on keys, with fencing tokens.
///
/// This is the small, object-safe primitive every backend implements
/// (`Arc<dyn DistributedLock>` is how applications hold one). Policy —
/// renewal, the safety margin, loss signals, per-holder reentrancy, `max_hold` — lives once in
/// [`LockClient`](crate::LockClient), which most code should use instead of
/// calling these methods directly.
///
/// ```
/// use std::time::Duration;
/// use fenced_api::{DistributedLock, LockKey, LockOptions, MemoryLock, ReleaseOutcome};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> fenced_api::Result<()> {
/// let store = MemoryLock::new();
/// let key = LockKey::new("order:1001")?;
/// let opts = LockOptions::builder().ttl(Duration::from_secs(10)).build()?;
///
/// let lease = store.try_acquire(&key, &opts).await?.expect("free key");
/// assert!(lease.token.get() >= 1);
/// // A second holder is refused at once: contention is `None`, not an error.
/// assert!(store.try_acquire(&key, &opts).await?.is_none());
/// assert_eq!(store.release(&lease).await?, ReleaseOutcome::Released);
/// # Ok(()) }
/// ```
///
/// # Contract
///
/// What every implementation guarantees, numbered as the
/// `fenced-conformance` suite numbers its cases (`c01_…` to `c20_…`); each
/// backend runs the whole suite on a real server. A lease is *current* from
/// its grant until it is released, force-released, or its TTL passes **on
/// the store's clock** — never the client's.
///
/// | # | behaviour |
/// |---|---|
/// | C1 | `try_acquire` on a free key returns a lease whose token is ≥ 1 |
/// | C2 | a second holder is refused at once: `Ok(None)`, one round trip, no sleeping |
/// | C3 | `release` frees the key; the next acquire succeeds immediately |
/// | C4 | `extend` and `release` act only when the lease's owner *and* token match the current holder: a stale or foreign lease gets [`NotHeld`](ReleaseOutcome::NotHeld) / [`LeaseLost`](crate::Error::LeaseLost) and changes nothing |
/// | C5 | a holder that stops renewing loses the key after its TTL, on the store's clock (etcd: on the holder client's clock while that client runs; etcd's lease removes the key at most one TTL later if the client dies) |
/// | C6 | `extend` keeps the lock alive past the original TTL |
/// | C7 | each grant of a key carries a token strictly greater than every earlier grant of that key: after release, expiry, a crash mid-transaction, force-release and (if [`Capabilities::is_durable`]) a store restart; re-entering keeps the token |
/// | C8 | a waiter gets the key promptly when the holder releases (a hand-off, not the next poll); a backend declaring [`Capabilities::is_fifo`] serves waiters in arrival order |
/// | C9 | `acquire` gives up with [`Timeout`](crate::Error::Timeout) close to its wait bound |
/// | C10 | N clients × M rounds on one key: never two holders, every round completes — also with many tasks sharing one [`LockClient`](crate::LockClient) |
/// | C11 | different keys never block each other |
/// | C12 | reentrancy is opt-in and counted: on the store per owner with reentrant options; through `LockClient` per acquiring task, hold scope or `LockGuard::reenter`, never for another task sharing the client; otherwise asking again is an immediate [`AlreadyHeld`](crate::Error::AlreadyHeld) |
/// | C13 | `LockClient` renews every ttl/3 and stops at `max_hold`, reporting the loss |
/// | C14 | `LockGuard::lost` resolves when the lock is gone — at the latest at the safe deadline, a [`SafetyMargin`](crate::SafetyMargin) before the store's expiry; `with_lock` cancels the work |
/// | C15 | a dropped guard frees the key promptly (a spawned release), at the TTL at the latest |
/// | C16 | a cancelled `acquire` leaves no lock behind longer than its TTL |
/// | C17 | `inspect` and `list` show the holder, token, remaining TTL and the holder's label |
/// | C18 | bad input is rejected before any I/O (keys and options are validated types; `extend` checks its TTL with [`LockOptions::validate_ttl`]); awkward keys (`%`, `_`, `\`, quotes, spaces, Unicode) are exact and distinct |
/// | C19 | an unreachable store fails within the backend's connect / operation timeout with a retryable [`Error::Backend`](crate::Error::Backend) — never a hang |
/// | C20 | two instances configured with different namespaces (table, key prefix…) never see each other's locks |
///
/// # Cancel safety
///
/// Dropping any returned future must never leave a lock that outlives its
/// TTL. A grant that raced with the drop may exist until its TTL passes; it is
/// never renewed. Backends with a native wait remove the waiter from the
/// store's queue when the future is dropped.
#[async_trait]
pub trait DistributedLock: Send + Sync + std::fmt::Debug {
    /// Tries once to take `key`; `Ok(None)` if someone else holds it.
    ///
    /// One round trip, no sleeping, ignores the wait policy in `opts`.
    ///
    /// The lease's deadline counts from the request's send time, so a reply
    /// delayed past the TTL yields a lease that is already expired: the
    /// store may have given the key to someone else since. Check
    /// [`Lease::is_expired`] before use, or go through
    /// [`LockClient`](crate::LockClient), which renews such a lease before
    /// handing it out (the same holds for [`acquire`](Self::acquire)).
    ///
    /// # Errors
    ///
    /// * [`Error::AlreadyHeld`](crate::Error::AlreadyHeld) if `opts` names an
    ///   owner that already holds the key and `opts` is not reentrant.
    /// * [`Error::Backend`](crate::Error::Backend) when the store fails.
    ///
    /// # Cancel safety
    ///
    /// The request may already have reached the store when the future is
    /// dropped: a grant it made then has no caller. That lock is never
    /// renewed and expires after its TTL; the key is free again by then, and
    /// nothing else is changed.
    async fn try_acquire(&self, key: &LockKey, opts: &LockOptions) -> Result<Option<Lease>>;

    /// Takes `key`, waiting as `opts.wait()` allows.
    ///
    /// Backends without a native wait use [`wait::Polling`](crate::wait::Polling):
    /// a FIFO line of the waiters in this process whose head alone polls, with
    /// backoff and jitter, woken early by releases in the same process.
    ///
    /// # Errors
    ///
    /// * [`Error::Timeout`](crate::Error::Timeout) when the wait bound passes
    ///   (immediately for [`WaitPolicy::NoWait`](crate::WaitPolicy::NoWait)).
    /// * The errors of [`try_acquire`](Self::try_acquire).
    ///
    /// # Cancel safety
    ///
    /// Dropping the future stops waiting; the waiter leaves the queue. A grant
    /// that completed concurrently with the drop is not renewed and expires
    /// after its TTL.
    async fn acquire(&self, key: &LockKey, opts: &LockOptions) -> Result<Lease>;

    /// Pushes the expiry of a current lease to `ttl` from now (store clock).
    ///
    /// Returns the lease with its new TTL and local deadline.
    ///
    /// # Errors
    ///
    /// * [`Error::LeaseLost`](crate::Error::LeaseLost) if the lease is no
    ///   longer current; nothing is changed.
    /// * [`Error::InvalidOptions`](crate::Error::InvalidOptions) for a TTL out of bounds.
    /// * [`Error::Backend`](crate::Error::Backend) when the store fails; the
    ///   lease may still be current.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future leaves the lease renewed or not — the caller cannot
    /// tell which. Either way it expires: at its old deadline, or `ttl` after
    /// the store handled the request; nothing else is changed. Extend again
    /// (or [`inspect`](Self::inspect)) to know where it stands: a renewal that
    /// went through is harmless to repeat.
    async fn extend(&self, lease: &Lease, ttl: Duration) -> Result<Lease>;

    /// Renews several leases at once, as [`extend`](Self::extend) would each:
    /// one result per lease, in the order given.
    ///
    /// [`LockClient`](crate::LockClient) sends its watchdogs' renewals
    /// through this, batched, so a client holding thousands of locks renews
    /// them in a few round trips per interval instead of one each. The
    /// default calls `extend` for each lease, up to
    /// [`EXTEND_MANY_CONCURRENCY`] at a time; SQL stores override it with one
    /// statement per batch (through [`batch::extend_in_chunks`](crate::batch::extend_in_chunks)).
    ///
    /// # Errors
    ///
    /// Per lease, those of [`extend`](Self::extend). An overriding store that
    /// cannot tell which leases of a batch were renewed retries them one by
    /// one, so a lost lease never reads as renewed.
    ///
    /// # Cancel safety
    ///
    /// As [`extend`](Self::extend), for each lease of the batch: dropping the
    /// future leaves each one renewed or not (so expiring at its old deadline
    /// or `ttl` after the store handled it), and releases none. No further
    /// renewal is sent once it is dropped.
    async fn extend_many(&self, leases: &[Lease], ttl: Duration) -> Vec<Result<Lease>> {
        crate::batch::extend_each(self, leases, ttl).await
    }

    /// Gives the lease back.
    ///
    /// Returns [`ReleaseOutcome::NotHeld`] (and changes nothing) when the
    /// lease is no longer current, so releasing twice is harmless.
    ///
    /// # Errors
    ///
    /// [`Error::Backend`](crate::Error::Backend) when the store fails; the lock
    /// then expires after its TTL at the latest.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future releases the lock or not, depending on whether the
    /// request reached the store; if not, the lock expires after the rest of
    /// its TTL. Releasing again with the same lease is harmless
    /// ([`ReleaseOutcome::NotHeld`] if the first release went through).
    async fn release(&self, lease: &Lease) -> Result<ReleaseOutcome>;

    /// Who holds `key` right now, with token and remaining TTL; `None` when free.
    ///
    /// # Errors
    ///
    /// [`Error::Backend`](crate::Error::Backend) when the store fails.
    async fn inspect(&self, key: &LockKey) -> Result<Option<LockInfo>>;

    /// Administrative: frees `key` whoever holds it. Returns whether a current
    /// lock was removed. The evicted holder learns it at its next renewal.
    ///
    /// # Errors
    ///
    /// [`Error::Backend`](crate::Error::Backend) when the store fails.
    async fn force_release(&self, key: &LockKey) -> Result<bool>;

    /// Administrative: the locks currently held in this store's namespace,
    /// as [`inspect`](Self::inspect) would show each, sorted by key — at most
    /// `limit` of them (ask for one more than you show to learn whether there
    /// are more). When more are held, which ones come back is up to the
    /// backend: the SQL stores return the first in key order. This is what
    /// `fenced status` with no key prints.
    ///
    /// # Errors
    ///
    /// * [`Error::Unsupported`](crate::Error::Unsupported) from stores that
    ///   cannot list (the default): name the keys and call `inspect` instead.
    /// * [`Error::Backend`](crate::Error::Backend) when the store fails.
    async fn list(&self, limit: usize) -> Result<Vec<LockInfo>> {
        let _ = limit;
        Err(crate::Error::Unsupported {
            backend: self.capabilities().backend_name(),
            what: "listing held locks yet; inspect the keys by name".into(),
        })
    }

    /// A signal the store fires when it learns, before the lease's deadline,
    /// that `lease` is gone: the session or connection that held it ended
    /// (terminated by an operator, killed, expired on the server).
    ///
    /// `None`, the default, where the store has no such means: a holder
    /// then learns of the loss at its next renewal or at its safe deadline.
    /// [`LockClient`](crate::LockClient) watches the signal of every hold,
    /// so [`LockGuard::lost`](crate::LockGuard::lost) resolves the moment
    /// the store knows — e.g. a PostgreSQL advisory lock whose backend was
    /// terminated, rather than up to a renewal interval later.
    ///
    /// A backend cancels the token only when the loss is certain; it may
    /// return the same token for every lease of one session.
    fn loss_signal(&self, lease: &Lease) -> Option<CancellationToken> {
        let _ = lease;
        None
    }

    /// The store's semaphores and reader-writer locks, when it has them
    /// (see [`SemaphoreStore`](crate::SemaphoreStore)); `None`, the default,
    /// otherwise. Their keys are a namespace of their own, beside this
    /// store's mutex keys.
    ///
    /// [`LockClient::semaphore`](crate::LockClient::semaphore) and
    /// [`LockClient::rw_lock`](crate::LockClient::rw_lock) go through it.
    fn semaphores(&self) -> Option<Arc<dyn crate::SemaphoreStore>> {
        None
    }

    /// What this backend can promise.
    fn capabilities(&self) -> Capabilities;
}

/// How many `extend` calls the default [`DistributedLock::extend_many`] has
/// in flight at once.
pub const EXTEND_MANY_CONCURRENCY: usize = 16;

/// Forwards every trait method through a smart pointer, so `Arc<dyn
/// DistributedLock>`, `Box<…>` and `Arc<ConcreteLock>` are locks too.
/// `missing_trait_methods` keeps the forwarding complete when the trait grows.
macro_rules! forward_impl {
    ($($ptr:ident),*) => {$(
        #[deny(clippy::missing_trait_methods)]
        #[async_trait]
        impl<T: DistributedLock + ?Sized> DistributedLock for $ptr<T> {
            async fn try_acquire(&self, key: &LockKey, opts: &LockOptions) -> Result<Option<Lease>> {
                (**self).try_acquire(key, opts).await
            }
            async fn acquire(&self, key: &LockKey, opts: &LockOptions) -> Result<Lease> {
                (**self).acquire(key, opts).await
            }
            async fn extend(&self, lease: &Lease, ttl: Duration) -> Result<Lease> {
                (**self).extend(lease, ttl).await
            }
            async fn extend_many(&self, leases: &[Lease], ttl: Duration) -> Vec<Result<Lease>> {
                (**self).extend_many(leases, ttl).await
            }
            async fn release(&self, lease: &Lease) -> Result<ReleaseOutcome> {
                (**self).release(lease).await
            }
            async fn inspect(&self, key: &LockKey) -> Result<Option<LockInfo>> {
                (**self).inspect(key).await
            }
            async fn force_release(&self, key: &LockKey) -> Result<bool> {
                (**self).force_release(key).await
            }
            async fn list(&self, limit: usize) -> Result<Vec<LockInfo>> {
                (**self).list(limit).await
            }
            fn loss_signal(&self, lease: &Lease) -> Option<CancellationToken> {
                (**self).loss_signal(lease)
            }
            fn semaphores(&self) -> Option<Arc<dyn crate::SemaphoreStore>> {
                (**self).semaphores()
            }
            fn capabilities(&self) -> Capabilities {
                (**self).capabilities()
            }
        }
    )*};
}

forward_impl!(Arc, Box);
