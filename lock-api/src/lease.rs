//! What a successful acquisition hands back: the lease and its fencing token.

use std::{fmt, time::Duration};

use tokio::time::Instant;

use crate::{Label, LockKey, Owner};

/// A number that strictly increases for a key across every acquisition.
///
/// Pass it to the resource the lock protects and have that resource reject
/// any token lower than the highest it has seen. That turns a paused or
/// partitioned ex-holder, which still *believes* it holds the lock, into a
/// harmless one. Tokens are always ≥ 1; comparing tokens of different keys is
/// meaningless.
///
/// ```
/// use fenced_api::FencingToken;
/// assert!(FencingToken::new(7) > FencingToken::new(3));
/// assert_eq!(FencingToken::new(7).get(), 7);
/// ```
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct FencingToken(u64);

impl FencingToken {
    /// Wraps a raw token.
    pub const fn new(token: u64) -> Self {
        FencingToken(token)
    }

    /// The raw value, e.g. to store beside the protected data.
    pub const fn get(self) -> u64 {
        self.0
    }
}

impl fmt::Display for FencingToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.0, f)
    }
}

impl fmt::Debug for FencingToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "FencingToken({})", self.0)
    }
}

impl From<FencingToken> for u64 {
    fn from(t: FencingToken) -> u64 {
        t.0
    }
}

/// A granted lock, as plain data: no connection, no background task.
///
/// The `deadline` is local and monotonic: `ttl` counted from the moment the
/// acquire (or extend) request was **sent**, so time spent in flight — or in a
/// pause after the reply arrived — is already subtracted. The store's own
/// expiry is at or after it; past the deadline the holder must assume the lock
/// is gone.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Lease {
    /// The locked key.
    pub key: LockKey,
    /// The holder identity the store compares on release and extend.
    pub owner: Owner,
    /// The fencing token of this acquisition.
    pub token: FencingToken,
    /// The effective TTL granted by the store: rounded up from the request
    /// where the store counts coarser (etcd: whole seconds), shortened where
    /// it cannot hold a lock that long (ZooKeeper: a lock lives no longer
    /// than its session's timeout). `LockClient` renews by this TTL.
    pub ttl: Duration,
    /// Local monotonic instant after which the lease must be considered lost.
    pub deadline: Instant,
}

impl Lease {
    /// Builds a lease; `sent_at` is when the request that granted it was sent.
    pub fn new(
        key: LockKey,
        owner: Owner,
        token: FencingToken,
        ttl: Duration,
        sent_at: Instant,
    ) -> Self {
        Lease {
            key,
            owner,
            token,
            ttl,
            deadline: deadline_after(sent_at, ttl),
        }
    }

    /// The same lease with a new TTL counted from `sent_at` (after an extend).
    pub fn renewed(&self, ttl: Duration, sent_at: Instant) -> Self {
        Lease {
            ttl,
            deadline: deadline_after(sent_at, ttl),
            ..self.clone()
        }
    }

    /// Time left before the local deadline (zero once passed).
    pub fn remaining(&self) -> Duration {
        self.deadline.saturating_duration_since(Instant::now())
    }

    /// Whether the local deadline has passed.
    pub fn is_expired(&self) -> bool {
        Instant::now() >= self.deadline
    }
}

/// `start + d`, saturating far in the future instead of panicking on overflow.
pub(crate) fn deadline_after(start: Instant, d: Duration) -> Instant {
    start
        .checked_add(d)
        .unwrap_or_else(|| start + Duration::from_secs(100 * 365 * 24 * 3600))
}

/// What [`release`](crate::DistributedLock::release) did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum ReleaseOutcome {
    /// The lease was current and the key is now free.
    Released,
    /// The lease was current but re-entered; the hold count went down and the
    /// key stays held by this owner.
    StillHeld {
        /// Holds left on the key.
        remaining: u32,
    },
    /// The lease was no longer current (expired, force-released, or the key
    /// belongs to someone else). Nothing was changed. Releasing twice returns this.
    NotHeld,
}

/// What [`inspect`](crate::DistributedLock::inspect) sees for a held key.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct LockInfo {
    /// The key.
    pub key: LockKey,
    /// The current holder.
    pub owner: Owner,
    /// The current holder's fencing token.
    pub token: FencingToken,
    /// Time to expiry as computed by the store's clock (at the time of the read).
    pub remaining_ttl: Duration,
    /// How many times the holder has entered the key (1 unless reentrant).
    pub hold_count: u32,
    /// The holder's human-readable label, when it gave one (see
    /// [`Label`]); `None` for holders that gave none and for stores that
    /// do not keep labels.
    pub label: Option<Label>,
}

impl LockInfo {
    /// Builds a lock description (for backend implementors).
    pub fn new(
        key: LockKey,
        owner: Owner,
        token: FencingToken,
        remaining_ttl: Duration,
        hold_count: u32,
    ) -> Self {
        LockInfo {
            key,
            owner,
            token,
            remaining_ttl,
            hold_count,
            label: None,
        }
    }

    /// The same description with the holder's label (for backend implementors).
    #[must_use]
    pub fn with_label(mut self, label: Option<Label>) -> Self {
        self.label = label;
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn deadline_counts_from_send_time() {
        let sent = Instant::now();
        tokio::time::advance(Duration::from_millis(300)).await;
        let lease = Lease::new(
            LockKey::new("k").unwrap(),
            Owner::random(),
            FencingToken::new(1),
            Duration::from_secs(1),
            sent,
        );
        assert_eq!(lease.remaining(), Duration::from_millis(700));
        assert!(!lease.is_expired());
        tokio::time::advance(Duration::from_millis(700)).await;
        assert!(lease.is_expired());
        assert_eq!(lease.remaining(), Duration::ZERO);
        let renewed = lease.renewed(Duration::from_secs(2), Instant::now());
        assert_eq!(renewed.remaining(), Duration::from_secs(2));
        assert_eq!(renewed.token, lease.token);
    }

    #[test]
    fn huge_durations_do_not_panic() {
        let now = Instant::now();
        assert!(deadline_after(now, Duration::MAX) > now);
    }
}
