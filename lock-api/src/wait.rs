//! The shared waiting helper for backends without a native wait.
//!
//! Polling a store in a tight loop hurts it (the source articles' "大量轮询会拖垮数据库")
//! and a fixed 100 ms sleep wastes most of each hand-off. This helper backs off
//! exponentially with jitter, never sleeps past the caller's wait bound, and is
//! woken at once when a release of the same key happens *in the same process*
//! (through [`notify_released`]), so local hand-offs cost no sleep at all.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex, OnceLock, Weak},
    time::Duration,
};

use tokio::{sync::Notify, time::Instant};

use crate::{DistributedLock, Error, Lease, LockKey, LockOptions, Result, WaitPolicy};

/// Exponential backoff with "equal jitter": each delay is uniformly drawn from
/// `[d/2, d]`, where `d` doubles from `initial` up to `max`. Values are
/// clamped to 1 ms ..= 10 s when used, so no setting can spin or overflow.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backoff {
    /// First delay bound.
    pub initial: Duration,
    /// Largest delay bound.
    pub max: Duration,
}

impl Default for Backoff {
    /// 5 ms doubling to 200 ms: quick hand-offs when a holder is short, about
    /// five store round trips per second per waiter when it is long.
    fn default() -> Self {
        Backoff {
            initial: Duration::from_millis(5),
            max: Duration::from_millis(200),
        }
    }
}

impl Backoff {
    /// Bounds applied to any configuration: at least 1 ms (no tight loop
    /// against the store), at most 10 s (no overflow, no hour-long naps).
    const FLOOR: Duration = Duration::from_millis(1);
    const CEILING: Duration = Duration::from_secs(10);

    fn delay(&self, attempt: u32) -> Duration {
        let initial = self.initial.clamp(Self::FLOOR, Self::CEILING);
        let max = self.max.clamp(initial, Self::CEILING);
        let factor = 1u32.checked_shl(attempt.min(20)).unwrap_or(u32::MAX);
        let bound = initial.saturating_mul(factor).min(max);
        let half = bound / 2;
        let jitter_ns = fastrand::u64(0..=half.as_nanos().min(u64::MAX as u128) as u64);
        half + Duration::from_nanos(jitter_ns)
    }
}

/// The monotonic instant at which a wait policy gives up (`None` = never).
pub fn wait_deadline(policy: WaitPolicy, start: Instant) -> Option<Instant> {
    match policy {
        WaitPolicy::NoWait => Some(start),
        WaitPolicy::Timeout(d) => start.checked_add(d),
        WaitPolicy::Forever => None,
    }
}

/// Wake-up channels by (scope, key); entries whose waiters are all gone are
/// pruned when the map has doubled since the last prune (amortised O(1)).
#[derive(Default)]
struct Registry {
    channels: HashMap<(String, LockKey), Weak<Notify>>,
    prune_at: usize,
}

fn registry() -> &'static Mutex<Registry> {
    static REGISTRY: OnceLock<Mutex<Registry>> = OnceLock::new();
    REGISTRY.get_or_init(Default::default)
}

/// The in-process wake-up channel for `key` in `scope`.
///
/// `scope` identifies the store and namespace (e.g. `"mysql://db1/test#locks"`):
/// instances that share a store must use the same scope so that a release by
/// one wakes the waiters of another.
fn subscribe(scope: &str, key: &LockKey) -> Arc<Notify> {
    let mut reg = registry().lock().unwrap_or_else(|p| p.into_inner());
    let id = (scope.to_owned(), key.clone());
    if let Some(n) = reg.channels.get(&id).and_then(Weak::upgrade) {
        return n;
    }
    if reg.channels.len() >= reg.prune_at {
        reg.channels.retain(|_, w| w.strong_count() > 0);
        reg.prune_at = (reg.channels.len() * 2).max(64);
    }
    let n = Arc::new(Notify::new());
    reg.channels.insert(id, Arc::downgrade(&n));
    n
}

/// Wakes every waiter of this process that is polling `key` in `scope`.
///
/// Backends call it after a successful release or force-release.
pub fn notify_released(scope: &str, key: &LockKey) {
    let reg = registry().lock().unwrap_or_else(|p| p.into_inner());
    if let Some(n) = reg
        .channels
        .get(&(scope.to_owned(), key.clone()))
        .and_then(Weak::upgrade)
    {
        n.notify_waiters();
    }
}

/// Implements [`DistributedLock::acquire`] on top of `try_acquire`.
///
/// Tries at once; then sleeps with [`Backoff`] (reset whenever a local release
/// wakes it) and tries again, until granted or the wait bound passes. The
/// last attempt happens at the bound, so a release just before it still wins.
///
/// # Errors
///
/// [`Error::Timeout`] when the bound passes; any error of `try_acquire`
/// (a backend error ends the wait: retrying it is the caller's decision).
///
/// # Cancel safety
///
/// Cancel safe as far as `try_acquire` is: dropping the future between
/// attempts leaves nothing behind.
pub async fn acquire_polling<L: DistributedLock + ?Sized>(
    lock: &L,
    scope: &str,
    key: &LockKey,
    opts: &LockOptions,
    backoff: Backoff,
) -> Result<Lease> {
    let start = Instant::now();
    let deadline = wait_deadline(opts.wait(), start);
    let signal = subscribe(scope, key);
    let mut attempt = 0u32;
    loop {
        // Register for the wake-up *before* trying, so a release between the
        // failed try and the sleep is not missed.
        let notified = signal.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();

        if let Some(lease) = lock.try_acquire(key, opts).await? {
            if attempt > 0 {
                tracing::debug!(key = %key, attempts = attempt + 1, waited_ms = start.elapsed().as_millis() as u64, "acquired after waiting");
            }
            return Ok(lease);
        }
        let now = Instant::now();
        if deadline.is_some_and(|d| now >= d) {
            return Err(Error::Timeout {
                key: key.clone(),
                waited: now - start,
            });
        }
        let mut wake = now + backoff.delay(attempt);
        if let Some(d) = deadline {
            wake = wake.min(d);
        }
        attempt = attempt.saturating_add(1);
        tokio::select! {
            _ = &mut notified => attempt = 0,
            _ = tokio::time::sleep_until(wake) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_grows_with_jitter_and_caps() {
        let b = Backoff::default();
        for attempt in 0..40 {
            let d = b.delay(attempt);
            let bound = (b.initial * 2u32.pow(attempt.min(20))).min(b.max);
            assert!(d >= bound / 2 && d <= bound, "attempt {attempt}: {d:?}");
        }
        assert!(b.delay(30) <= b.max);
    }

    #[test]
    fn extreme_backoff_settings_are_clamped() {
        let spin = Backoff {
            initial: Duration::ZERO,
            max: Duration::ZERO,
        };
        assert!(spin.delay(0) >= Duration::from_micros(500), "no tight loop");
        let huge = Backoff {
            initial: Duration::MAX,
            max: Duration::MAX,
        };
        for attempt in [0, 5, 40] {
            assert!(huge.delay(attempt) <= Duration::from_secs(10));
        }
    }

    #[test]
    fn deadlines() {
        let now = Instant::now();
        assert_eq!(wait_deadline(WaitPolicy::NoWait, now), Some(now));
        assert_eq!(wait_deadline(WaitPolicy::Forever, now), None);
        assert_eq!(
            wait_deadline(WaitPolicy::Timeout(Duration::from_secs(1)), now),
            Some(now + Duration::from_secs(1))
        );
        // Overflowing bounds mean "forever" rather than a panic.
        assert_eq!(wait_deadline(WaitPolicy::Timeout(Duration::MAX), now), None);
    }

    #[tokio::test]
    async fn notify_reaches_subscribers_of_same_scope_and_key_only() {
        let k = LockKey::new("k").unwrap();
        let a = subscribe("s1", &k);
        let b = subscribe("s1", &k);
        assert!(Arc::ptr_eq(&a, &b));
        let other = subscribe("s2", &k);
        assert!(!Arc::ptr_eq(&a, &other));
        let n = a.notified();
        tokio::pin!(n);
        n.as_mut().enable();
        notify_released("s1", &k);
        tokio::time::timeout(Duration::from_secs(1), n)
            .await
            .unwrap();
    }
}
