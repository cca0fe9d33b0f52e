//! Per-lock deadlines on shared leases: the locks this client holds, and
//! the reaper that deletes each one when its own TTL passes without an
//! extend.
//!
//! A session lease outlives the locks on it (others keep it alive), so the
//! TTL of a single lock is enforced here: at the lock's deadline — the same
//! instant its holder's [`Lease::deadline`](fenced_api::Lease::deadline)
//! names — the reaper deletes the key, guarded by its create revision. The
//! holder's own clock decides, and the holder stops trusting the lock at that
//! same deadline, so no one else can take it while the holder still may act.
//! If this client dies, its leases stop being refreshed and the store removes
//! the keys one TTL after the last use.

use std::{
    cmp::Reverse,
    collections::{BinaryHeap, HashMap},
    sync::{Arc, Mutex, Weak},
    time::Duration,
};

use etcd_client::{Compare, CompareOp, Txn, TxnOp, TxnOpResponse};
use fenced_api::Owner;
use tokio::{sync::Notify, time::Instant};

use crate::batch::{Batches, Kind};

/// First retry pause for a deletion etcd did not answer; doubles up to `REAP_RETRY_MAX`.
const REAP_RETRY: Duration = Duration::from_secs(1);
const REAP_RETRY_MAX: Duration = Duration::from_secs(16);

/// One lock held through this client (tracked by its entry path and token).
#[derive(Debug, Clone)]
pub(crate) struct Held {
    pub(crate) owner: Owner,
    /// The session lease the key is on.
    pub(crate) lease: i64,
    pub(crate) deadline: Instant,
    extending: u32,
    /// The deadline passed: being (or to be) deleted.
    expired: bool,
    /// A deletion is in flight.
    reaping: bool,
    /// Failed deletions so far (for the retry backoff).
    reap_failures: u32,
    /// When to try a failed deletion again. Kept apart from `deadline`,
    /// which stays the lock's own (passed) deadline: `inspect` through this
    /// client must never report the retry pause as remaining TTL.
    retry_at: Option<Instant>,
    /// Its session lease is gone, and the key with it (or the key alone was
    /// found deleted).
    lost: bool,
}

impl Held {
    pub(crate) fn new(owner: Owner, lease: i64, deadline: Instant) -> Self {
        Held {
            owner,
            lease,
            deadline,
            extending: 0,
            expired: false,
            reaping: false,
            reap_failures: 0,
            retry_at: None,
            lost: false,
        }
    }
}

/// What `extend` finds in the tracker.
#[derive(Debug)]
pub(crate) enum Tracked {
    /// Not held through this client (another client's lease, or forgotten).
    No,
    /// Held here on `lease`; an extend is now in flight (see [`Tracker::end_extend`]).
    Yes { lease: i64 },
    /// Its deadline passed: it is lost (and being deleted).
    Expired,
    /// Its session lease ended (or its entry was found deleted).
    Lost,
}

type PathToken = (Vec<u8>, i64);

#[derive(Default)]
struct State {
    held: HashMap<PathToken, Held>,
    due: BinaryHeap<Reverse<(Instant, Vec<u8>, i64)>>,
}

/// The locks held through one client, by (lock path, token).
#[derive(Default)]
pub(crate) struct Tracker {
    state: Mutex<State>,
    wake: Notify,
}

impl Tracker {
    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn schedule(&self, st: &mut State, at: Instant, path: Vec<u8>, token: i64) {
        let earliest = st
            .due
            .peek()
            .is_none_or(|Reverse((first, _, _))| at < *first);
        st.due.push(Reverse((at, path, token)));
        if earliest {
            self.wake.notify_one();
        }
    }

    pub(crate) fn track(&self, path: Vec<u8>, token: i64, held: Held) {
        let mut st = self.state();
        let at = held.deadline;
        st.held.insert((path.clone(), token), held);
        self.schedule(&mut st, at, path, token);
    }

    pub(crate) fn forget(&self, path: &[u8], token: i64) {
        self.state().held.remove(&(path.to_vec(), token));
    }

    /// The deadline of a lock held here.
    pub(crate) fn deadline(&self, path: &[u8], token: i64) -> Option<Instant> {
        self.state()
            .held
            .get(&(path.to_vec(), token))
            .map(|h| h.deadline)
    }

    /// Whether this client holds the entry at `path` (any token).
    pub(crate) fn holds(&self, path: &[u8]) -> bool {
        self.state()
            .held
            .iter()
            .any(|((p, _), h)| p == path && !h.expired)
    }

    /// Starts an extend: the reaper leaves the lock alone until
    /// [`end_extend`](Self::end_extend).
    pub(crate) fn begin_extend(&self, path: &[u8], token: i64) -> Tracked {
        let mut st = self.state();
        let now = Instant::now();
        let key = (path.to_vec(), token);
        let Some(h) = st.held.get_mut(&key) else {
            return Tracked::No;
        };
        if h.lost {
            st.held.remove(&key);
            return Tracked::Lost;
        }
        if h.expired || h.deadline <= now {
            h.expired = true;
            let deadline = h.deadline;
            if h.extending == 0 {
                self.schedule(&mut st, deadline.min(now), key.0, token);
            }
            return Tracked::Expired;
        }
        h.extending += 1;
        Tracked::Yes { lease: h.lease }
    }

    /// Ends an extend begun with [`begin_extend`](Self::begin_extend):
    /// `Some(deadline)` after a success, `None` otherwise (the old deadline stands).
    pub(crate) fn end_extend(&self, path: &[u8], token: i64, renewed: Option<(Instant, i64)>) {
        let mut st = self.state();
        let key = (path.to_vec(), token);
        let Some(h) = st.held.get_mut(&key) else {
            return;
        };
        h.extending = h.extending.saturating_sub(1);
        if let Some((deadline, lease)) = renewed {
            if deadline > h.deadline {
                h.deadline = deadline;
            }
            h.lease = lease;
        }
        let at = h.deadline;
        self.schedule(&mut st, at, key.0, token);
    }

    /// A session lease ended: its locks are gone with it.
    pub(crate) fn lease_lost(&self, lease: i64) {
        let mut st = self.state();
        for h in st.held.values_mut().filter(|h| h.lease == lease) {
            h.lost = true;
        }
    }

    /// The entry of one lock was found gone: the lock is lost (its next
    /// extend says so), as if its session lease had ended.
    pub(crate) fn entry_lost(&self, path: &[u8], token: i64) {
        if let Some(h) = self.state().held.get_mut(&(path.to_vec(), token)) {
            h.lost = true;
        }
    }

    fn next_due(&self) -> Option<Instant> {
        self.state().due.peek().map(|Reverse((at, _, _))| *at)
    }

    /// Locks whose deadline passed with no extend in flight.
    fn take_due(&self, now: Instant) -> Vec<(Vec<u8>, i64, Held)> {
        let mut st = self.state();
        let mut out = Vec::new();
        while st.due.peek().is_some_and(|Reverse((at, _, _))| *at <= now) {
            let Some(Reverse((_, path, token))) = st.due.pop() else {
                break;
            };
            let key = (path, token);
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
            out.push((key.0, key.1, h.clone()));
        }
        out
    }

    /// A deletion failed: try again later (backing off), unless released meanwhile.
    fn reap_failed(&self, path: Vec<u8>, token: i64) {
        let mut st = self.state();
        let Some(h) = st.held.get_mut(&(path.clone(), token)) else {
            return;
        };
        h.reaping = false;
        h.reap_failures += 1;
        let pause = REAP_RETRY
            .saturating_mul(1 << h.reap_failures.min(8))
            .min(REAP_RETRY_MAX);
        let at = Instant::now() + pause;
        h.retry_at = Some(at);
        self.schedule(&mut st, at, path, token);
    }

    pub(crate) fn len(&self) -> usize {
        self.state().held.len()
    }
}

/// The reaper: one task per client, asleep until the next lock deadline;
/// it ends when the client's batches are gone (the client was dropped).
pub(crate) async fn reaper(tracker: Arc<Tracker>, batches: Weak<Batches>) {
    loop {
        match tracker.next_due() {
            Some(at) if at <= Instant::now() => {}
            Some(at) => {
                tokio::select! {
                    _ = tokio::time::sleep_until(at) => {}
                    _ = tracker.wake.notified() => continue,
                }
            }
            None => {
                tracker.wake.notified().await;
                continue;
            }
        }
        let due = tracker.take_due(Instant::now());
        if due.is_empty() {
            continue;
        }
        let Some(batches) = batches.upgrade() else {
            return;
        };
        for (path, token, held) in due {
            let (tracker, batches) = (Arc::clone(&tracker), Arc::clone(&batches));
            tokio::spawn(reap(tracker, batches, path, token, held));
        }
    }
}

/// Deletes a lock whose TTL passed, guarded by its create revision (a
/// batched write); a failure is retried later through the reaper.
async fn reap(tracker: Arc<Tracker>, batches: Arc<Batches>, path: Vec<u8>, token: i64, held: Held) {
    let op = TxnOp::txn(
        Txn::new()
            .when([Compare::create_revision(
                path.clone(),
                CompareOp::Equal,
                token,
            )])
            .and_then([TxnOp::delete(path.clone(), None)]),
    );
    match batches.batched(Kind::Writes, &path, op).await {
        Ok(r) => {
            if matches!(r, TxnOpResponse::Txn(t) if t.succeeded()) {
                tracing::warn!(token, owner = %held.owner, "lock expired: its TTL passed without an extend; deleted");
            }
            tracker.forget(&path, token);
        }
        Err(e) => {
            tracing::debug!(token, error = %e, "deleting an expired lock failed; retrying later");
            tracker.reap_failed(path, token);
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;

    /// A deletion of an expired lock that etcd did not answer is retried
    /// after a pause — without moving the lock's deadline, which `inspect`
    /// through the holder's client reports as the remaining TTL.
    #[test]
    fn a_failed_deletion_keeps_the_passed_deadline() {
        let tracker = Tracker::default();
        let path = b"p\0lock\0k\0me".to_vec();
        let deadline = Instant::now()
            .checked_sub(Duration::from_millis(10))
            .unwrap();
        let held = Held::new(Owner::new("me").unwrap(), 1, deadline);
        tracker.track(path.clone(), 7, held);
        let now = Instant::now();
        assert_eq!(tracker.take_due(now).len(), 1, "due at its deadline");
        tracker.reap_failed(path.clone(), 7);

        assert_eq!(
            tracker.deadline(&path, 7),
            Some(deadline),
            "the retry pause must not become remaining TTL"
        );
        assert!(matches!(tracker.begin_extend(&path, 7), Tracked::Expired));
        // Retried after the pause, not before.
        assert!(tracker.next_due().unwrap() <= now + REAP_RETRY_MAX);
        assert!(tracker.take_due(Instant::now()).is_empty());
        let later = Instant::now() + REAP_RETRY_MAX + Duration::from_secs(1);
        assert_eq!(tracker.take_due(later).len(), 1, "retried after the pause");
    }

    /// A lock whose entry was found gone (a waiter's announcement failed)
    /// is refused at its next extend.
    #[test]
    fn a_lock_whose_entry_is_gone_is_lost() {
        let tracker = Tracker::default();
        let path = b"p\0lock\0k\0me".to_vec();
        let deadline = Instant::now() + Duration::from_secs(60);
        let held = Held::new(Owner::new("me").unwrap(), 1, deadline);
        tracker.track(path.clone(), 7, held.clone());
        tracker.track(path.clone(), 8, held);
        tracker.entry_lost(&path, 7);
        assert!(matches!(tracker.begin_extend(&path, 7), Tracked::Lost));
        assert!(matches!(
            tracker.begin_extend(&path, 8),
            Tracked::Yes { lease: 1 }
        ));
    }
}
