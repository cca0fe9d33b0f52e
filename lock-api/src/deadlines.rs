//! Per-lock deadlines for stores whose locks live on a shared session:
//! [`Deadlines`], the locks one client holds, and its reaper.
//!
//! When many locks share one session (an etcd lease, a ZooKeeper session),
//! the session outlives each of them, so the TTL of a single lock must be
//! enforced by the client that holds it: at the lock's deadline — the same
//! instant its holder's [`Lease::deadline`](crate::Lease::deadline) names —
//! the reaper ([`Deadlines::run_reaper`]) has the backend delete it. The
//! holder stops trusting the lock at that same deadline, so no one else can
//! take it while the holder still may act.
//!
//! The table is keyed by the backend's lock id (`K`, e.g. entry path and
//! token) and carries the backend's per-lock data (`D`, e.g. the session a
//! lock is on). An extend in flight ([`Deadlines::begin_extend`] …
//! [`Deadlines::end_extend`]) keeps the reaper away from its lock; a session
//! that ends marks its locks lost ([`Deadlines::lose_where`]), and the next
//! extend of each says so. A deletion that fails is retried after a pause
//! that doubles per failure, while the lock keeps its own (passed)
//! deadline.
//!
//! ```
//! use std::time::Duration;
//! use fenced_api::deadlines::{Deadlines, Tracked};
//! use tokio::time::Instant;
//!
//! // Keyed by (path, token); the data is the session id.
//! let tracker = Deadlines::new(Duration::from_secs(1), Duration::from_secs(16));
//! let key = ("/lock/a".to_string(), 7_i64);
//! tracker.track(key.clone(), 42_i64, Instant::now() + Duration::from_secs(30));
//!
//! assert_eq!(tracker.begin_extend(&key), Tracked::Yes(42));
//! tracker.end_extend(&key, Some((Instant::now() + Duration::from_secs(60), 42)));
//!
//! tracker.lose_where(|_, &session| session == 42); // the session ended
//! assert_eq!(tracker.begin_extend(&key), Tracked::Lost);
//! ```

use std::{
    cmp::Reverse,
    collections::{BinaryHeap, HashMap},
    fmt,
    future::Future,
    hash::Hash,
    sync::{Arc, Mutex, MutexGuard, Weak},
    time::Duration,
};

use tokio::{sync::Notify, time::Instant};

/// One tracked lock: the backend's data and the tracker's bookkeeping.
#[derive(Debug)]
struct Held<D> {
    data: D,
    deadline: Instant,
    /// Extends in flight: the reaper leaves the lock alone meanwhile.
    extending: u32,
    /// The deadline passed: being (or to be) deleted.
    expired: bool,
    /// A deletion is in flight.
    reaping: bool,
    /// Failed deletions so far (for the retry backoff).
    failures: u32,
    /// When to try a failed deletion again. Kept apart from `deadline`,
    /// which stays the lock's own (passed) deadline: a remaining TTL read
    /// from it must never include the retry pause.
    retry_at: Option<Instant>,
    /// Its session ended (or the lock alone was found deleted).
    lost: bool,
}

struct State<K, D> {
    held: HashMap<K, Held<D>>,
    /// When the reaper looks at which lock; stale entries (a later
    /// deadline, a released lock) are skipped when they come due.
    due: BinaryHeap<Reverse<(Instant, K)>>,
}

/// What [`Deadlines::begin_extend`] finds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Tracked<D> {
    /// Not tracked here (held through another client, or forgotten).
    No,
    /// Tracked with this data; an extend is now in flight (end it with
    /// [`Deadlines::end_extend`]).
    Yes(D),
    /// Its deadline passed: it is lost (and being deleted).
    Expired,
    /// Its session ended or it was found deleted; it is forgotten now.
    Lost,
}

/// Ends an extend in flight when dropped: see [`Deadlines::extending`].
#[derive(Debug)]
pub struct Extending<'a, K, D>
where
    K: Clone + Eq + Hash + Ord,
    D: Clone,
{
    tracker: &'a Deadlines<K, D>,
    key: Option<K>,
    renewed: Option<(Instant, D)>,
}

impl<K, D> Extending<'_, K, D>
where
    K: Clone + Eq + Hash + Ord,
    D: Clone,
{
    /// Whether an extend is in flight (the lock was tracked here).
    pub fn is_active(&self) -> bool {
        self.key.is_some()
    }

    /// The extend succeeded: the lock's new deadline and data.
    pub fn renewed(&mut self, deadline: Instant, data: D) {
        self.renewed = Some((deadline, data));
    }
}

impl<K, D> Drop for Extending<'_, K, D>
where
    K: Clone + Eq + Hash + Ord,
    D: Clone,
{
    fn drop(&mut self) {
        if let Some(key) = self.key.take() {
            self.tracker.end_extend(&key, self.renewed.take());
        }
    }
}

/// How a deletion the reaper asked for went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reaped {
    /// Deleted, or found gone already: the lock is forgotten.
    Done,
    /// The store did not answer or refused: retried after a pause.
    Failed,
}

/// The locks held through one client, by the backend's lock id `K`, each
/// with the backend's data `D` and its own deadline. See the
/// [module docs](self).
pub struct Deadlines<K, D> {
    state: Mutex<State<K, D>>,
    wake: Notify,
    retry: Duration,
    retry_max: Duration,
}

impl<K, D> fmt::Debug for Deadlines<K, D> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        f.debug_struct("Deadlines")
            .field("held", &st.held.len())
            .field("retry", &self.retry)
            .field("retry_max", &self.retry_max)
            .finish()
    }
}

impl<K, D> Deadlines<K, D>
where
    K: Clone + Eq + Hash + Ord,
    D: Clone,
{
    /// An empty tracker. A deletion that fails for the `n`-th time in a
    /// row is retried after `retry × 2^n`, at most `retry_max` (equal
    /// values give a fixed pause).
    pub fn new(retry: Duration, retry_max: Duration) -> Self {
        Deadlines {
            state: Mutex::new(State {
                held: HashMap::new(),
                due: BinaryHeap::new(),
            }),
            wake: Notify::new(),
            retry,
            retry_max,
        }
    }

    fn state(&self) -> MutexGuard<'_, State<K, D>> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Queues a look at `key` at `at`, waking the reaper if that is now the
    /// earliest thing it has to do.
    fn schedule(&self, st: &mut State<K, D>, at: Instant, key: K) {
        let earliest = st.due.peek().is_none_or(|Reverse((first, _))| at < *first);
        st.due.push(Reverse((at, key)));
        if earliest {
            self.wake.notify_one();
        }
    }

    /// Starts tracking `key` (a lock just granted, or extended through a
    /// client that did not track it) until `deadline`. A key tracked
    /// already gets the new data and keeps the later deadline.
    pub fn track(&self, key: K, data: D, deadline: Instant) {
        let mut st = self.state();
        if let Some(h) = st.held.get_mut(&key) {
            // Tracked already (two extends of one lease racing): the data is
            // the latest, the deadline never moves back.
            h.data = data;
            h.deadline = h.deadline.max(deadline);
            let at = h.deadline;
            self.schedule(&mut st, at, key);
            return;
        }
        let held = Held {
            data,
            deadline,
            extending: 0,
            expired: false,
            reaping: false,
            failures: 0,
            retry_at: None,
            lost: false,
        };
        st.held.insert(key.clone(), held);
        self.schedule(&mut st, deadline, key);
    }

    /// Stops tracking `key` (released, or found gone).
    pub fn forget(&self, key: &K) {
        self.state().held.remove(key);
    }

    /// The deadline of the lock `key`, if tracked (a passed one stays until
    /// the lock is deleted).
    pub fn deadline(&self, key: &K) -> Option<Instant> {
        self.state().held.get(key).map(|h| h.deadline)
    }

    /// The data of the lock `key`, if tracked.
    pub fn data(&self, key: &K) -> Option<D> {
        self.state().held.get(key).map(|h| h.data.clone())
    }

    /// The first tracked key that `matches` (e.g. by token alone).
    pub fn find(&self, matches: impl Fn(&K) -> bool) -> Option<K> {
        self.state().held.keys().find(|k| matches(k)).cloned()
    }

    /// Whether a lock that `matches` is tracked with its deadline not yet
    /// found passed.
    pub fn holds(&self, matches: impl Fn(&K) -> bool) -> bool {
        self.state()
            .held
            .iter()
            .any(|(k, h)| matches(k) && !h.expired)
    }

    /// How many locks are tracked.
    pub fn len(&self) -> usize {
        self.state().held.len()
    }

    /// Whether no lock is tracked.
    pub fn is_empty(&self) -> bool {
        self.state().held.is_empty()
    }

    /// Starts an extend of `key`: the reaper leaves the lock alone until
    /// [`end_extend`](Self::end_extend). A lost lock is forgotten here; one
    /// whose deadline passed is marked expired (and its deletion queued).
    pub fn begin_extend(&self, key: &K) -> Tracked<D> {
        let mut st = self.state();
        let now = Instant::now();
        let Some(h) = st.held.get_mut(key) else {
            return Tracked::No;
        };
        if h.lost {
            st.held.remove(key);
            return Tracked::Lost;
        }
        if h.expired || h.deadline <= now {
            h.expired = true;
            let deadline = h.deadline;
            if h.extending == 0 {
                self.schedule(&mut st, deadline.min(now), key.clone());
            }
            return Tracked::Expired;
        }
        h.extending += 1;
        Tracked::Yes(h.data.clone())
    }

    /// Ends an extend begun with [`begin_extend`](Self::begin_extend):
    /// `Some((deadline, data))` after a success (a deadline never moves
    /// back), `None` otherwise (the old deadline stands).
    pub fn end_extend(&self, key: &K, renewed: Option<(Instant, D)>) {
        let mut st = self.state();
        let Some(h) = st.held.get_mut(key) else {
            return;
        };
        h.extending = h.extending.saturating_sub(1);
        if let Some((deadline, data)) = renewed {
            h.deadline = h.deadline.max(deadline);
            h.data = data;
        }
        let at = h.deadline;
        self.schedule(&mut st, at, key.clone());
    }

    /// A guard that ends the extend of `key` begun with
    /// [`begin_extend`](Self::begin_extend) when dropped — also when the
    /// extend's future is dropped half way — with what
    /// [`Extending::renewed`] recorded. `None` (no extend in flight) gives
    /// a guard that does nothing.
    pub fn extending(&self, key: Option<K>) -> Extending<'_, K, D> {
        Extending {
            tracker: self,
            key,
            renewed: None,
        }
    }

    /// Marks the lock `key` lost (its entry was found deleted): its next
    /// extend says so.
    pub fn lose(&self, key: &K) {
        if let Some(h) = self.state().held.get_mut(key) {
            h.lost = true;
        }
    }

    /// Marks every lock that `matches` lost, e.g. every lock on a session
    /// that ended.
    pub fn lose_where(&self, matches: impl Fn(&K, &D) -> bool) {
        let mut st = self.state();
        for (_, h) in st.held.iter_mut().filter(|(k, h)| matches(k, &h.data)) {
            h.lost = true;
        }
    }

    /// The earliest instant the reaper may have something to do.
    pub fn next_due(&self) -> Option<Instant> {
        self.state().due.peek().map(|Reverse((at, _))| *at)
    }

    /// The locks to delete at `now`: deadline (or retry pause) passed, no
    /// extend and no deletion in flight. Each is marked expired and its
    /// deletion in flight until [`forget`](Self::forget) or
    /// [`reap_failed`](Self::reap_failed); lost ones are forgotten instead
    /// (the store deleted them with their session).
    pub fn take_due(&self, now: Instant) -> Vec<(K, D)> {
        let mut st = self.state();
        let mut out = Vec::new();
        while st.due.peek().is_some_and(|Reverse((at, _))| *at <= now) {
            let Some(Reverse((_, key))) = st.due.pop() else {
                break;
            };
            let Some(h) = st.held.get_mut(&key) else {
                continue;
            };
            if h.extending > 0
                || h.reaping
                || h.deadline > now
                || h.retry_at.is_some_and(|r| r > now)
            {
                continue; // an extend or a deletion is in flight, or a later entry exists
            }
            if h.lost {
                st.held.remove(&key);
                continue;
            }
            h.expired = true;
            h.reaping = true;
            out.push((key, h.data.clone()));
        }
        out
    }

    /// A deletion from [`take_due`](Self::take_due) failed: try again after
    /// a pause (backing off), unless the lock is forgotten meanwhile.
    pub fn reap_failed(&self, key: &K) {
        let mut st = self.state();
        let Some(h) = st.held.get_mut(key) else {
            return;
        };
        h.reaping = false;
        h.failures += 1;
        let pause = self
            .retry
            .saturating_mul(1 << h.failures.min(8))
            .min(self.retry_max);
        let at = Instant::now() + pause;
        h.retry_at = Some(at);
        self.schedule(&mut st, at, key.clone());
    }
}

impl<K, D> Deadlines<K, D>
where
    K: Clone + Eq + Hash + Ord + Send + Sync + 'static,
    D: Clone + Send + Sync + 'static,
{
    /// The reaper: one task per client, asleep until the next deadline. It
    /// spawns `delete(context, key, data)` for each lock that comes due —
    /// the backend's deletion, guarded by the lock's own token — and
    /// forgets the lock or retries it later by the answer. It ends when
    /// `context` is gone (the client was dropped).
    pub async fn run_reaper<C, F, Fut>(self: Arc<Self>, context: Weak<C>, delete: F)
    where
        C: Send + Sync + 'static,
        F: Fn(Arc<C>, K, D) -> Fut,
        Fut: Future<Output = Reaped> + Send + 'static,
    {
        loop {
            match self.next_due() {
                Some(at) if at <= Instant::now() => {}
                Some(at) => {
                    tokio::select! {
                        _ = tokio::time::sleep_until(at) => {}
                        _ = self.wake.notified() => continue,
                    }
                }
                None => {
                    self.wake.notified().await;
                    continue;
                }
            }
            let due = self.take_due(Instant::now());
            if due.is_empty() {
                continue;
            }
            let Some(context) = context.upgrade() else {
                return;
            };
            for (key, data) in due {
                let deleted = delete(Arc::clone(&context), key.clone(), data);
                let tracker = Arc::clone(&self);
                tokio::spawn(async move {
                    match deleted.await {
                        Reaped::Done => tracker.forget(&key),
                        Reaped::Failed => tracker.reap_failed(&key),
                    }
                });
            }
        }
    }
}

/// A client's reaper task, shared by every handle that needs it alive (a
/// lock store and its semaphores): aborted when the last one is dropped.
#[derive(Debug)]
pub struct ReaperTask(tokio::task::JoinHandle<()>);

impl ReaperTask {
    /// Spawns `reaper` (e.g. a [`Deadlines::run_reaper`]) on the current
    /// tokio runtime.
    ///
    /// # Panics
    ///
    /// Outside a tokio runtime, as `tokio::spawn`.
    pub fn spawn(reaper: impl Future<Output = ()> + Send + 'static) -> Arc<ReaperTask> {
        Arc::new(ReaperTask(tokio::spawn(reaper)))
    }
}

impl Drop for ReaperTask {
    fn drop(&mut self) {
        self.0.abort();
    }
}

#[cfg(test)]
mod tests;
