//! How stores without a native wait make waiters wait: [`Polling`].
//!
//! Polling a store in a tight loop loads it with queries that mostly fail,
//! and a fixed 100 ms sleep wastes most of each hand-off. This helper backs off
//! exponentially with jitter, never sleeps past the caller's wait bound, and is
//! woken at once when a release of the same key happens *in the same process*
//! (through [`notify_released`]), so local hand-offs cost no sleep at all.
//! Waiters of one process queue in a FIFO line per key and only the head
//! polls, so many local waiters cost the store no more than one, and they
//! are served in arrival order.

use std::{
    collections::{HashMap, VecDeque},
    sync::{Arc, Mutex, OnceLock},
    time::Duration,
};

use tokio::{sync::Notify, time::Instant};

use crate::{
    DistributedLock, Error, Lease, LockKey, LockOptions, ReleaseOutcome, Result, WaitPolicy,
};

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

    /// Delays doubling from `initial` up to `max`.
    pub const fn new(initial: Duration, max: Duration) -> Self {
        Backoff { initial, max }
    }

    /// The pause before retry number `attempt` (0 for the first retry):
    /// uniformly drawn from `[d/2, d]`, `d = initial × 2^attempt` capped at
    /// `max` (both clamped to 1 ms ..= 10 s).
    pub fn delay(&self, attempt: u32) -> Duration {
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

/// The in-process waiting line of one (scope, key).
///
/// Waiters of this process queue here in arrival order and only the head
/// talks to the store, so `n` local waiters cost the store the polling of one
/// and a release by a local holder goes to the longest-waiting local task
/// instead of whichever poll happens to land first.
#[derive(Default)]
pub(crate) struct Line {
    state: Mutex<LineState>,
    /// Signalled when the head leaves the line or the key is released locally.
    pub(crate) changed: Notify,
}

#[derive(Default)]
struct LineState {
    waiting: VecDeque<u64>,
    next_ticket: u64,
    /// Local deadline of a lease granted through this line and not yet
    /// released here: while it runs, the head waits for the release signal
    /// instead of polling a key that a task of this very process holds.
    held_until: Option<Instant>,
}

impl Line {
    fn state(&self) -> std::sync::MutexGuard<'_, LineState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// A place in a [`Line`]; leaving it (grant, timeout, error or a dropped
/// future) hands the head position on.
struct Ticket {
    line: Arc<Line>,
    id: u64,
}

impl Ticket {
    fn join(line: Arc<Line>) -> Self {
        let id = {
            let mut st = line.state();
            let id = st.next_ticket;
            st.next_ticket = st.next_ticket.wrapping_add(1);
            st.waiting.push_back(id);
            id
        };
        Ticket { line, id }
    }

    fn is_head(&self) -> bool {
        self.line.state().waiting.front() == Some(&self.id)
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        let was_head = {
            let mut st = self.line.state();
            let was_head = st.waiting.front() == Some(&self.id);
            st.waiting.retain(|t| *t != self.id);
            was_head
        };
        if was_head {
            self.line.changed.notify_waiters();
        }
    }
}

/// Lines by (scope, key). Lines nobody waits in and no local lease holds are
/// pruned when the map has doubled since the last prune (amortised O(1)).
#[derive(Default)]
struct Registry {
    lines: HashMap<(String, LockKey), Arc<Line>>,
    prune_at: usize,
}

fn registry() -> &'static Mutex<Registry> {
    static REGISTRY: OnceLock<Mutex<Registry>> = OnceLock::new();
    REGISTRY.get_or_init(Default::default)
}

/// The in-process line for `key` in `scope`.
///
/// `scope` identifies the store and namespace (e.g. `"mysql://db1/test#locks"`):
/// instances that share a store must use the same scope so that a release by
/// one wakes the waiters of another.
pub(crate) fn line(scope: &str, key: &LockKey) -> Arc<Line> {
    let mut reg = registry().lock().unwrap_or_else(|p| p.into_inner());
    let id = (scope.to_owned(), key.clone());
    if let Some(l) = reg.lines.get(&id) {
        return Arc::clone(l);
    }
    if reg.lines.len() >= reg.prune_at {
        let now = Instant::now();
        reg.lines.retain(|_, l| {
            Arc::strong_count(l) > 1 || l.state().held_until.is_some_and(|u| u > now)
        });
        reg.prune_at = (reg.lines.len() * 2).max(64);
    }
    let l = Arc::new(Line::default());
    reg.lines.insert(id, Arc::clone(&l));
    l
}

/// Tells this process's waiters that `key` in `scope` was released: the
/// head of the line tries at once.
///
/// Backends call it after a successful release or force-release.
pub fn notify_released(scope: &str, key: &LockKey) {
    let line = {
        let reg = registry().lock().unwrap_or_else(|p| p.into_inner());
        reg.lines.get(&(scope.to_owned(), key.clone())).cloned()
    };
    if let Some(l) = line {
        l.state().held_until = None;
        l.changed.notify_waiters();
    }
}

/// The waiting half of a store without a native wait.
///
/// One value per store handle owns what waiting needs: the *scope* (which
/// store and namespace; handles that share a store must use the same scope,
/// e.g. `"mysql://db1:3306/test#fenced_locks"`, so a release through one
/// wakes the waiters of another), the [`Backoff`], and the release signal.
/// A backend calls [`acquire`](Polling::acquire) from its
/// `DistributedLock::acquire` and passes every release and force-release
/// outcome through [`released`](Polling::released) and
/// [`force_released`](Polling::force_released) — or calls
/// [`freed`](Polling::freed) where it knows by other means that the key was
/// freed — so a local hand-off costs no sleep.
///
/// ```
/// use fenced_api::{wait::Polling, LockKey, ReleaseOutcome};
/// let polling = Polling::new("sqlite:///var/lib/app/locks.db#fenced_locks");
/// let key = LockKey::new("job")?;
/// // In `release`: the outcome passes through, waking local waiters when the key was freed.
/// assert_eq!(polling.released(&key, ReleaseOutcome::Released), ReleaseOutcome::Released);
/// # Ok::<(), fenced_api::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct Polling {
    scope: Arc<str>,
    backoff: Backoff,
}

impl Polling {
    /// Waiting in `scope` with the default [`Backoff`].
    pub fn new(scope: impl Into<Arc<str>>) -> Self {
        Polling {
            scope: scope.into(),
            backoff: Backoff::default(),
        }
    }

    /// With another backoff between polls.
    pub fn with_backoff(mut self, backoff: Backoff) -> Self {
        self.backoff = backoff;
        self
    }

    /// The scope.
    pub fn scope(&self) -> &str {
        &self.scope
    }

    /// The backoff between polls.
    pub fn backoff(&self) -> Backoff {
        self.backoff
    }

    /// `DistributedLock::acquire` for `lock`, by polling its `try_acquire`
    /// (see [`acquire_polling`]).
    ///
    /// # Errors
    ///
    /// As [`acquire_polling`].
    pub async fn acquire<L: DistributedLock + ?Sized>(
        &self,
        lock: &L,
        key: &LockKey,
        opts: &LockOptions,
    ) -> Result<Lease> {
        acquire_polling(lock, &self.scope, key, opts, self.backoff).await
    }

    /// A release's outcome, passed through: when the key was freed, this
    /// process's waiters for it try at once.
    pub fn released(&self, key: &LockKey, outcome: ReleaseOutcome) -> ReleaseOutcome {
        if outcome == ReleaseOutcome::Released {
            notify_released(&self.scope, key);
        }
        outcome
    }

    /// A force-release's outcome (whether a holder was removed), passed
    /// through; wakes this process's waiters when one was.
    pub fn force_released(&self, key: &LockKey, removed: bool) -> bool {
        if removed {
            notify_released(&self.scope, key);
        }
        removed
    }

    /// Tells this process's waiters that `key` was freed some other way
    /// (a reaper removing an expired row, a migration).
    pub fn freed(&self, key: &LockKey) {
        notify_released(&self.scope, key);
    }
}

/// Implements [`DistributedLock::acquire`] on top of `try_acquire`.
///
/// Waiters of one process (per `scope` and key) form a FIFO line and only
/// the head tries the store: it tries at once, then sleeps with [`Backoff`]
/// and tries again, until granted or its wait bound passes. While the key is
/// held by a lease this helper granted in this process, the head does not
/// poll at all: it waits for that lease's release (signalled by
/// [`notify_released`]) or its local deadline, whichever comes first. The
/// last attempt happens at the bound, so a release just before it still wins.
///
/// Fairness is therefore first-come first-served among the waiters of one
/// process; against other processes each process's head competes by polling.
/// A reentrant request tries once before queueing, so an owner that already
/// holds the key is never stuck behind waiters that wait for it.
///
/// # Errors
///
/// [`Error::Timeout`] when the bound passes; any error of `try_acquire`
/// (a backend error ends the wait: retrying it is the caller's decision).
///
/// # Cancel safety
///
/// Cancel safe as far as `try_acquire` is: dropping the future leaves the
/// line (the next waiter becomes head) and leaves nothing in the store.
pub async fn acquire_polling<L: DistributedLock + ?Sized>(
    lock: &L,
    scope: &str,
    key: &LockKey,
    opts: &LockOptions,
    backoff: Backoff,
) -> Result<Lease> {
    let start = Instant::now();
    let deadline = wait_deadline(opts.wait(), start);
    let timeout = || Error::Timeout {
        key: key.clone(),
        waited: start.elapsed(),
    };
    if opts.wait() == WaitPolicy::NoWait || opts.is_reentrant() {
        if let Some(lease) = lock.try_acquire(key, opts).await? {
            return Ok(lease);
        }
        if opts.wait() == WaitPolicy::NoWait {
            return Err(timeout());
        }
    }
    let line = line(scope, key);
    let ticket = Ticket::join(Arc::clone(&line));

    // Wait for the head position without touching the store.
    loop {
        // Register for the signal *before* looking, so a change between the
        // look and the sleep is not missed.
        let changed = line.changed.notified();
        tokio::pin!(changed);
        changed.as_mut().enable();
        if ticket.is_head() {
            break;
        }
        match deadline {
            Some(d) => {
                tokio::select! {
                    _ = &mut changed => {}
                    _ = tokio::time::sleep_until(d) => return Err(timeout()),
                }
            }
            None => changed.await,
        }
    }

    let mut attempt = 0u32;
    let mut last_try = Instant::now();
    loop {
        let changed = line.changed.notified();
        tokio::pin!(changed);
        changed.as_mut().enable();

        let now = Instant::now();
        // A task of this process holds the key: its release wakes us and
        // its local deadline is when the store may free it by expiry, so
        // polling in between would only load the store. A slow re-check
        // still catches a release this process cannot see (an admin's
        // force-release elsewhere).
        let held_locally = line.state().held_until.filter(|u| *u > now);
        let at_bound = deadline.is_some_and(|d| now >= d);
        let wake = match held_locally {
            Some(until) if !at_bound && now < last_try + LOCAL_HOLDER_RECHECK => {
                until.min(last_try + LOCAL_HOLDER_RECHECK)
            }
            _ => {
                if let Some(lease) = lock.try_acquire(key, opts).await? {
                    if attempt > 0 {
                        tracing::debug!(key = %key, attempts = attempt + 1, waited_ms = start.elapsed().as_millis() as u64, "acquired after waiting");
                    }
                    line.state().held_until = Some(lease.deadline);
                    drop(ticket);
                    return Ok(lease);
                }
                last_try = Instant::now();
                if deadline.is_some_and(|d| last_try >= d) {
                    return Err(timeout());
                }
                attempt = attempt.saturating_add(1);
                match held_locally {
                    Some(until) => until.min(last_try + LOCAL_HOLDER_RECHECK),
                    None => last_try + backoff.delay(attempt - 1),
                }
            }
        };
        let wake = deadline.map_or(wake, |d| wake.min(d));
        tokio::select! {
            _ = &mut changed => attempt = 0,
            _ = tokio::time::sleep_until(wake) => {}
        }
    }
}

/// How often the head of a line re-checks a key held by a task of its own
/// process (whose release it would otherwise be told about).
const LOCAL_HOLDER_RECHECK: Duration = Duration::from_secs(1);

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
    async fn release_signal_reaches_the_line_of_same_scope_and_key_only() {
        let k = LockKey::new("k").unwrap();
        let a = line("s1", &k);
        let b = line("s1", &k);
        assert!(Arc::ptr_eq(&a, &b));
        let other = line("s2", &k);
        assert!(!Arc::ptr_eq(&a, &other));
        a.state().held_until = Some(Instant::now() + Duration::from_secs(60));
        let n = a.changed.notified();
        tokio::pin!(n);
        n.as_mut().enable();
        let o = other.changed.notified();
        tokio::pin!(o);
        o.as_mut().enable();
        notify_released("s1", &k);
        tokio::time::timeout(Duration::from_secs(1), n)
            .await
            .unwrap();
        assert!(
            a.state().held_until.is_none(),
            "release clears the local holder"
        );
        assert!(
            tokio::time::timeout(Duration::from_millis(20), o)
                .await
                .is_err(),
            "another scope was woken"
        );
    }

    #[test]
    fn tickets_queue_in_order_and_hand_the_head_on_when_dropped() {
        let l = Arc::new(Line::default());
        let t1 = Ticket::join(Arc::clone(&l));
        let t2 = Ticket::join(Arc::clone(&l));
        let t3 = Ticket::join(Arc::clone(&l));
        assert!(t1.is_head() && !t2.is_head() && !t3.is_head());
        drop(t2); // leaving from the middle keeps the order of the rest
        assert!(t1.is_head() && !t3.is_head());
        drop(t1);
        assert!(t3.is_head());
        drop(t3);
        assert!(l.state().waiting.is_empty());
    }
}
