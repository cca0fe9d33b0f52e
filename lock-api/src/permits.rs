//! Semaphores and reader-writer locks: one weighted, first-come-first-served
//! primitive per store ([`SemaphoreStore`]), and what a request asks of it
//! ([`Permits`]).
//!
//! A key of a semaphore store has a **capacity** and a line of entries —
//! holders and waiters — in arrival order. Every entry asks for a
//! **weight**; an entry is granted once the weights of all entries up to and
//! including it fit in the capacity:
//!
//! ```text
//! granted(e) ⇔ Σ weight(x) for x at or before e in the line ≤ capacity
//! ```
//!
//! * A semaphore of N permits is capacity N, weight 1: the first N entries
//!   hold, the rest wait in order.
//! * A reader-writer lock is capacity [`Permits::RW_CAPACITY`], a reader
//!   weight 1 and a writer the whole capacity. A writer is granted only
//!   when it is first in line (every earlier grant is gone), and a reader
//!   that arrives after a waiting writer waits behind it: writers are never
//!   starved by a stream of readers, and readers are never starved by
//!   writers either.
//!
//! Entries only ever leave the line (released, expired, given up), so a
//! granted entry stays granted, and grants follow arrival order. The store
//! numbers entries on arrival from its monotonic token counter and that
//! number is the grant's fencing token: every grant's token is greater than
//! the token of every grant made before it on that key. In particular a
//! writer's token is above every earlier reader's and writer's, so a
//! resource that remembers the highest token it has seen rejects any reader
//! or writer that came before the current writer.
//!
//! Semaphore keys live in a namespace of their own: the mutex `K` (a plain
//! [`LockClient::acquire`](crate::LockClient::acquire)) and the semaphore
//! or reader-writer lock `K` are independent locks.

use std::{fmt, sync::Arc, time::Duration};

use async_trait::async_trait;

use crate::{
    DistributedLock, Error, FencingToken, Lease, LockInfo, LockKey, LockOptions, Owner, Result,
};

/// What one acquisition asks of a key in a [`SemaphoreStore`]: the key's
/// capacity, which every holder of the key must agree on, and this request's
/// share of it.
///
/// ```
/// use fenced_api::Permits;
///
/// let pool = Permits::semaphore(4)?;
/// assert_eq!((pool.capacity(), pool.weight()), (4, 1));
/// assert!(Permits::write().is_exclusive());
/// assert!(!Permits::read().is_exclusive());
/// // Zero permits is a mistake, caught before any I/O.
/// assert!(Permits::semaphore(0).is_err());
/// # Ok::<(), fenced_api::Error>(())
/// ```
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Permits {
    capacity: u32,
    weight: u32,
}

impl Permits {
    /// The most permits a semaphore may have.
    pub const MAX_PERMITS: u32 = 1_000_000;

    /// The capacity of a reader-writer lock: readers take 1, a writer all
    /// of it. Above [`MAX_PERMITS`](Self::MAX_PERMITS), so a semaphore and a
    /// reader-writer lock never agree on a key.
    pub const RW_CAPACITY: u32 = 1 << 30;

    /// One permit of a semaphore of `permits`.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidOptions`] unless `1 ≤ permits ≤ MAX_PERMITS`.
    pub fn semaphore(permits: u32) -> Result<Self> {
        if permits == 0 || permits > Self::MAX_PERMITS {
            return Err(Error::invalid_options(format!(
                "a semaphore has 1 to {} permits, not {permits}",
                Self::MAX_PERMITS
            )));
        }
        Ok(Permits {
            capacity: permits,
            weight: 1,
        })
    }

    /// A reader of a reader-writer lock.
    pub const fn read() -> Self {
        Permits {
            capacity: Self::RW_CAPACITY,
            weight: 1,
        }
    }

    /// The writer of a reader-writer lock.
    pub const fn write() -> Self {
        Permits {
            capacity: Self::RW_CAPACITY,
            weight: Self::RW_CAPACITY,
        }
    }

    /// Rebuilds a request from a store's record (for backend implementors).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidOptions`] for a pair no constructor makes.
    pub fn from_parts(capacity: u32, weight: u32) -> Result<Self> {
        let p = Permits { capacity, weight };
        match (capacity, weight) {
            (Self::RW_CAPACITY, 1) | (Self::RW_CAPACITY, Self::RW_CAPACITY) => Ok(p),
            (1..=Self::MAX_PERMITS, 1) => Ok(p),
            _ => Err(Error::invalid_options(format!(
                "no lock has capacity {capacity} and weight {weight}"
            ))),
        }
    }

    /// The key's capacity.
    pub const fn capacity(&self) -> u32 {
        self.capacity
    }

    /// This request's share of the capacity.
    pub const fn weight(&self) -> u32 {
        self.weight
    }

    /// Whether this is a reader-writer lock's request (reader or writer).
    pub const fn is_rw(&self) -> bool {
        self.capacity == Self::RW_CAPACITY
    }

    /// Whether a grant excludes every other holder (a writer; or a
    /// semaphore of one permit).
    pub const fn is_exclusive(&self) -> bool {
        self.weight == self.capacity
    }

    /// What kind of lock a key of this capacity is, for messages: `a
    /// semaphore of 4 permits`, `a reader-writer lock`.
    pub fn describe_capacity(capacity: u32) -> String {
        match capacity {
            Self::RW_CAPACITY => "a reader-writer lock".to_owned(),
            1 => "a semaphore of 1 permit".to_owned(),
            n => format!("a semaphore of {n} permits"),
        }
    }

    /// The role of a holder with this request: `permit`, `reader`, `writer`.
    pub const fn role(&self) -> &'static str {
        match (self.is_rw(), self.is_exclusive()) {
            (false, _) => "permit",
            (true, false) => "reader",
            (true, true) => "writer",
        }
    }

    /// The error for a request whose capacity differs from the key's.
    pub fn mismatch(&self, key: &LockKey, key_capacity: u32) -> Error {
        Error::KindMismatch {
            key: key.clone(),
            held_as: Self::describe_capacity(key_capacity),
            asked_as: Self::describe_capacity(self.capacity),
        }
    }
}

impl fmt::Debug for Permits {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (self.is_rw(), self.is_exclusive()) {
            (true, true) => f.write_str("Permits::write()"),
            (true, false) => f.write_str("Permits::read()"),
            (false, _) => write!(f, "Permits::semaphore({})", self.capacity),
        }
    }
}

/// One holder of a semaphore or reader-writer lock, as
/// [`SemaphoreStore::holders`] shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct PermitHolder {
    /// Owner, token, remaining TTL and label, as for a mutex.
    pub info: LockInfo,
    /// What the holder asked for (reader or writer; a semaphore's permit).
    pub permits: Permits,
}

impl PermitHolder {
    /// Builds a holder description (for backend implementors).
    pub fn new(info: LockInfo, permits: Permits) -> Self {
        PermitHolder { info, permits }
    }
}

/// Everyone on a semaphore or reader-writer key: its capacity, the holders
/// in grant order, and how many wait.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct KeyHolders {
    /// The key.
    pub key: LockKey,
    /// The capacity every holder agreed on.
    pub capacity: u32,
    /// The current holders, oldest grant first.
    pub holders: Vec<PermitHolder>,
    /// Entries in line that are not granted yet (0 where the store cannot tell).
    pub waiting: usize,
}

impl KeyHolders {
    /// Builds a description (for backend implementors).
    pub fn new(key: LockKey, capacity: u32, holders: Vec<PermitHolder>, waiting: usize) -> Self {
        KeyHolders {
            key,
            capacity,
            holders,
            waiting,
        }
    }

    /// `a semaphore of 4 permits`, `a reader-writer lock`.
    pub fn kind(&self) -> String {
        Permits::describe_capacity(self.capacity)
    }
}

/// A store's semaphores and reader-writer locks (see the [module
/// docs](crate::permits) for the model), reached through
/// [`DistributedLock::semaphores`].
///
/// It is a [`DistributedLock`] too: `extend`, `extend_many`, `release`,
/// `force_release`, `list` and `loss_signal` act on permit leases exactly as
/// on mutex leases (owner- and token-checked, one permit at a time;
/// `force_release` frees every holder of the key and drops its waiters),
/// `inspect` shows the oldest holder, and `try_acquire`/`acquire` take a
/// semaphore of one permit — so the whole mutex contract (C1–C20) holds for
/// it, and the conformance suite checks that it does.
///
/// # Contract
///
/// Besides C1–C20 for the one-permit case, numbered as the
/// `fenced-conformance` suite numbers its `s…` and `rw…` cases:
///
/// | # | behaviour |
/// |---|---|
/// | S1 | never more than the capacity is granted at once: N permit holders, or readers only, or one writer |
/// | S2 | a request whose capacity differs from the one the key's live entries agreed on fails with [`Error::KindMismatch`] and changes nothing |
/// | S3 | every grant's token is greater than the token of every grant made before it on that key (a writer's above all earlier readers' and writers') |
/// | S4 | waiters are granted in arrival order where the store declares [`Capabilities::is_fifo`](crate::Capabilities::is_fifo); on every store a waiting writer holds back readers that arrive after it |
/// | S5 | a holder that stops renewing loses its permit after its TTL, and the next in line gets it; a waiter that stops waiting (its future dropped, its process dead) leaves the line, at the latest after its TTL |
/// | S6 | releasing or renewing one permit never touches another holder's |
/// | S7 | [`holders`](Self::holders) shows every holder with its token, remaining TTL, label and role |
#[async_trait]
pub trait SemaphoreStore: DistributedLock {
    /// Tries once to take `permits` of `key`; `Ok(None)` when they do not
    /// fit now (or others are already waiting: no overtaking).
    ///
    /// # Errors
    ///
    /// * [`Error::KindMismatch`] when the key's holders agreed on another capacity.
    /// * [`Error::AlreadyHeld`] if `opts` names an owner that already holds
    ///   the key and `opts` is not reentrant.
    /// * [`Error::Backend`] when the store fails.
    ///
    /// # Cancel safety
    ///
    /// As [`DistributedLock::try_acquire`].
    async fn try_acquire_permits(
        &self,
        key: &LockKey,
        permits: Permits,
        opts: &LockOptions,
    ) -> Result<Option<Lease>>;

    /// Takes `permits` of `key`, waiting in line as `opts.wait()` allows.
    ///
    /// # Errors
    ///
    /// * [`Error::Timeout`] when the wait bound passes (the entry leaves the line).
    /// * The errors of [`try_acquire_permits`](Self::try_acquire_permits).
    ///
    /// # Cancel safety
    ///
    /// Dropping the future takes the entry out of the line (at the latest
    /// after its TTL, on stores where leaving needs a round trip); a grant
    /// that raced with the drop is never renewed and expires after its TTL.
    async fn acquire_permits(
        &self,
        key: &LockKey,
        permits: Permits,
        opts: &LockOptions,
    ) -> Result<Lease>;

    /// Everyone on `key`; `None` when nobody holds or waits.
    ///
    /// # Errors
    ///
    /// [`Error::Backend`] when the store fails.
    async fn holders(&self, key: &LockKey) -> Result<Option<KeyHolders>>;
}

/// The TTL a waiting entry is kept alive by, and how often: a waiter renews
/// its place every third of its TTL, so one that stops (its process frozen
/// or gone) leaves the line after at most one TTL.
pub fn waiter_refresh(ttl: Duration) -> Duration {
    (ttl / 3).max(Duration::from_millis(1))
}

/// What a store with no native wait does on the first look at a line:
/// see [`LineStore`].
#[derive(Debug)]
pub enum Arrival {
    /// Granted at once (or re-entered): the lease.
    Granted(Lease),
    /// An entry was put at the end of the line with this token; it is not
    /// granted yet.
    Queued(FencingToken),
    /// Not granted, and not queued (the caller asked not to).
    Busy,
}

/// What a later look at a queued entry finds: see [`LineStore`].
#[derive(Debug)]
pub enum Look {
    /// The entry is granted; its lease starts with this look.
    Granted(Lease),
    /// Still waiting (its place renewed if asked).
    Waiting,
    /// The entry is gone: its place expired or was force-released.
    Gone,
}

/// The steps of the line model for stores without a native wait (the SQL
/// stores): [`acquire_in_line`] and [`try_acquire_in_line`] build
/// `SemaphoreStore`'s acquisitions from them, polling with backoff and woken
/// early by releases in the same process.
///
/// Each step must be atomic on the store: `arrive` decides the grant (no
/// entry may be added before an earlier one it did not count) and `look`
/// may rely on entries before a granted one only ever leaving.
#[async_trait]
pub trait LineStore: Send + Sync {
    /// Purges the key's expired entries, checks the capacity and re-entry,
    /// and grants `permits` if everything in line plus them fits; otherwise
    /// queues an entry when `queue`.
    async fn arrive(
        &self,
        key: &LockKey,
        permits: Permits,
        opts: &LockOptions,
        owner: &Owner,
        queue: bool,
    ) -> Result<Arrival>;

    /// Looks at the entry `token` of `owner`: granted (its lease starts
    /// now, for `opts.ttl()`), waiting (its place renewed for `opts.ttl()`
    /// when `renew`), or gone.
    async fn look(
        &self,
        key: &LockKey,
        opts: &LockOptions,
        owner: &Owner,
        token: FencingToken,
        renew: bool,
    ) -> Result<Look>;

    /// Takes a waiting entry out of the line (timeout, cancellation).
    async fn leave(&self, key: &LockKey, owner: &Owner, token: FencingToken) -> Result<()>;
}

/// One entry of a key's line as a [`LineStore`] read it, in line order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LineEntry {
    /// The capacity the entry was made with.
    pub capacity: u32,
    /// Its weight.
    pub weight: u32,
    /// Whether its owner is the one now asking.
    pub mine: bool,
}

/// What an arrival does, decided from the live entries of the line (see
/// [`decide`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// The asker holds entry number `at` (granted, same weight) and may
    /// re-enter it.
    Reenter {
        /// Its index in the line.
        at: usize,
    },
    /// Put a granted entry at the end.
    Grant,
    /// Put a waiting entry at the end.
    Queue,
    /// Neither: it does not fit and the asker does not queue.
    Busy,
}

/// The arrival rule of the line model, for stores that read the line and
/// then write (inside one transaction, or under a lock on the key):
/// refuses another capacity ([`Error::KindMismatch`]) and a second entry
/// of the same owner ([`Error::AlreadyHeld`], unless `opts` is reentrant
/// and that entry is granted with the same weight), and grants when the
/// whole line plus `permits` fits.
///
/// # Errors
///
/// [`Error::KindMismatch`], [`Error::AlreadyHeld`], as above.
pub fn decide(
    key: &LockKey,
    line: &[LineEntry],
    permits: Permits,
    opts: &LockOptions,
    queue: bool,
) -> Result<Decision> {
    let mut total = 0u64;
    let mut mine = None;
    for (at, e) in line.iter().enumerate() {
        if e.capacity != permits.capacity() {
            return Err(permits.mismatch(key, e.capacity));
        }
        total += u64::from(e.weight);
        if e.mine {
            mine = Some((at, total <= u64::from(e.capacity), e.weight));
        }
    }
    if let Some((at, granted, weight)) = mine {
        if opts.is_reentrant() && granted && weight == permits.weight() {
            return Ok(Decision::Reenter { at });
        }
        return Err(Error::AlreadyHeld { key: key.clone() });
    }
    Ok(
        if total + u64::from(permits.weight()) <= u64::from(permits.capacity()) {
            Decision::Grant
        } else if queue {
            Decision::Queue
        } else {
            Decision::Busy
        },
    )
}

/// How many entries from the front of a line with these weights are
/// granted under `capacity`.
pub fn granted_count(weights: impl IntoIterator<Item = u32>, capacity: u32) -> usize {
    let mut sum = 0u64;
    weights
        .into_iter()
        .take_while(|w| {
            sum += u64::from(*w);
            sum <= u64::from(capacity)
        })
        .count()
}

/// `SemaphoreStore::try_acquire_permits` from a [`LineStore`].
///
/// # Errors
///
/// Those of [`LineStore::arrive`].
pub async fn try_acquire_in_line<L: LineStore + ?Sized>(
    store: &L,
    key: &LockKey,
    permits: Permits,
    opts: &LockOptions,
) -> Result<Option<Lease>> {
    let owner = opts.owner_or_random();
    match store.arrive(key, permits, opts, &owner, false).await? {
        Arrival::Granted(lease) => Ok(Some(lease)),
        Arrival::Queued(token) => {
            // A store that queued anyway: leave again, report contention.
            store.leave(key, &owner, token).await?;
            Ok(None)
        }
        Arrival::Busy => Ok(None),
    }
}

/// `SemaphoreStore::acquire_permits` from a [`LineStore`]: takes a place in
/// line, then looks again after each local release in `scope` (see
/// [`Polling`](crate::wait::Polling) for scopes) or after a backoff delay,
/// renewing the place every third of its TTL. A waiter that times out, or
/// whose future is dropped, leaves the line (dropped: by a spawned `leave`
/// inside a tokio runtime, else at its TTL).
///
/// # Errors
///
/// [`Error::Timeout`] at the wait bound; the errors of the store's steps
/// (the entry then expires after its TTL).
pub async fn acquire_in_line<L: LineStore + Clone + 'static>(
    store: &L,
    scope: &str,
    key: &LockKey,
    permits: Permits,
    opts: &LockOptions,
    backoff: crate::wait::Backoff,
) -> Result<Lease> {
    let start = tokio::time::Instant::now();
    let deadline = crate::wait::wait_deadline(opts.wait(), start);
    let timeout = || Error::Timeout {
        key: key.clone(),
        waited: start.elapsed(),
    };
    let owner = opts.owner_or_random();
    let queue = deadline.is_none_or(|d| d > start);
    let mut token = match store.arrive(key, permits, opts, &owner, queue).await? {
        Arrival::Granted(lease) => return Ok(lease),
        Arrival::Busy => return Err(timeout()),
        Arrival::Queued(token) => token,
    };
    let mut place = Place {
        store: store.clone(),
        key: key.clone(),
        owner: owner.clone(),
        token: Some(token),
    };
    let line = crate::wait::line(scope, key);
    let refresh = waiter_refresh(opts.ttl());
    let mut renewed_at = tokio::time::Instant::now();
    let mut attempt = 0u32;
    loop {
        let changed = line.changed.notified();
        tokio::pin!(changed);
        changed.as_mut().enable();
        let now = tokio::time::Instant::now();
        let renew = now >= renewed_at + refresh;
        match store.look(key, opts, &owner, token, renew).await? {
            Look::Granted(lease) => {
                place.token = None;
                return Ok(lease);
            }
            Look::Waiting => {
                if renew {
                    renewed_at = now;
                }
            }
            Look::Gone => {
                // Force-released (or not renewed in time): line up again.
                match store.arrive(key, permits, opts, &owner, true).await? {
                    Arrival::Granted(lease) => {
                        place.token = None;
                        return Ok(lease);
                    }
                    Arrival::Busy => return Err(timeout()),
                    Arrival::Queued(again) => {
                        token = again;
                        place.token = Some(again);
                        renewed_at = tokio::time::Instant::now();
                    }
                }
            }
        }
        let now = tokio::time::Instant::now();
        if deadline.is_some_and(|d| now >= d) {
            place.token = None;
            store.leave(key, &owner, token).await?;
            return Err(timeout());
        }
        let mut wake = (now + backoff.delay(attempt)).min(renewed_at + refresh);
        if let Some(d) = deadline {
            wake = wake.min(d);
        }
        attempt = attempt.saturating_add(1);
        tokio::select! {
            _ = &mut changed => attempt = 0,
            _ = tokio::time::sleep_until(wake) => {}
        }
    }
}

/// A queued entry that leaves the line when its `acquire` ends without a
/// grant, including when the future is dropped.
struct Place<L: LineStore + Clone + 'static> {
    store: L,
    key: LockKey,
    owner: Owner,
    token: Option<FencingToken>,
}

impl<L: LineStore + Clone + 'static> Drop for Place<L> {
    fn drop(&mut self) {
        let Some(token) = self.token.take() else {
            return;
        };
        // Without a runtime the entry expires after its TTL.
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            let (store, key, owner) = (self.store.clone(), self.key.clone(), self.owner.clone());
            rt.spawn(async move {
                if let Err(e) = store.leave(&key, &owner, token).await {
                    tracing::debug!(key = %key, error = %e, "a cancelled waiter could not leave the line; it expires after its ttl");
                }
            });
        }
    }
}

macro_rules! forward_semaphores {
    ($($ptr:ident),*) => {$(
        #[deny(clippy::missing_trait_methods)]
        #[async_trait]
        impl<T: SemaphoreStore + ?Sized> SemaphoreStore for $ptr<T> {
            async fn try_acquire_permits(
                &self,
                key: &LockKey,
                permits: Permits,
                opts: &LockOptions,
            ) -> Result<Option<Lease>> {
                (**self).try_acquire_permits(key, permits, opts).await
            }
            async fn acquire_permits(
                &self,
                key: &LockKey,
                permits: Permits,
                opts: &LockOptions,
            ) -> Result<Lease> {
                (**self).acquire_permits(key, permits, opts).await
            }
            async fn holders(&self, key: &LockKey) -> Result<Option<KeyHolders>> {
                (**self).holders(key).await
            }
        }
    )*};
}

forward_semaphores!(Arc, Box);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn constructors_and_parts_agree() {
        for p in [
            Permits::semaphore(1).unwrap(),
            Permits::semaphore(Permits::MAX_PERMITS).unwrap(),
            Permits::read(),
            Permits::write(),
        ] {
            assert_eq!(Permits::from_parts(p.capacity(), p.weight()).unwrap(), p);
        }
        assert!(Permits::semaphore(Permits::MAX_PERMITS + 1).is_err());
        assert!(Permits::from_parts(4, 2).is_err());
        assert!(Permits::from_parts(Permits::RW_CAPACITY, 7).is_err());
        assert!(Permits::from_parts(0, 0).is_err());
    }

    #[test]
    fn roles_and_descriptions() {
        assert_eq!(Permits::read().role(), "reader");
        assert_eq!(Permits::write().role(), "writer");
        assert_eq!(Permits::semaphore(3).unwrap().role(), "permit");
        assert!(Permits::semaphore(1).unwrap().is_exclusive());
        assert_eq!(
            Permits::describe_capacity(Permits::RW_CAPACITY),
            "a reader-writer lock"
        );
        assert_eq!(Permits::describe_capacity(4), "a semaphore of 4 permits");
        let key = LockKey::new("k").unwrap();
        let e = Permits::semaphore(3).unwrap().mismatch(&key, 4);
        assert!(e.to_string().contains("a semaphore of 4 permits"), "{e}");
        assert!(e.to_string().contains("a semaphore of 3 permits"), "{e}");
    }
}
