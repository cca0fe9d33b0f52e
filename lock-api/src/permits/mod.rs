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

use std::{fmt, sync::Arc};

use async_trait::async_trait;

use crate::{DistributedLock, Error, Lease, LockInfo, LockKey, LockOptions, Result};

mod line;

pub use line::{
    acquire_in_line, decide, granted_count, try_acquire_in_line, waiter_refresh, Arrival, Decision,
    LineEntry, LineRow, LineSemaphores, LineStore, Look,
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
