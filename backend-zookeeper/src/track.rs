//! Per-lock deadlines: the locks this client holds, and the reaper that
//! deletes each one when its own TTL passes without an extend.
//!
//! A session outlives the locks on it, so the TTL of a single lock is
//! enforced here: at the lock's deadline — the same instant its holder's
//! [`Lease::deadline`](fenced_api::Lease::deadline) names — the reaper
//! deletes the node. The holder stops trusting the lock at that same
//! deadline, so no one else can take it while the holder still may act. A
//! session that ends takes every lock on it at once ([`Tracker::session_lost`]);
//! if this client dies, the server deletes its nodes when the session
//! expires.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex, Weak},
    time::Duration,
};

use tokio::{sync::Notify, time::Instant};

use crate::error::{bounded, kind, Kind};
use crate::session::Sessions;

/// Pause before retrying a deletion ZooKeeper did not answer.
const REAP_RETRY: Duration = Duration::from_secs(1);

/// One lock held through this client, by its node path.
#[derive(Debug, Clone)]
pub(crate) struct Held {
    /// The node's creation zxid: the lease's token.
    pub(crate) czxid: i64,
    /// The session the node is ephemeral on.
    pub(crate) session: i64,
    pub(crate) deadline: Instant,
    extending: u32,
    /// The deadline passed: being (or to be) deleted.
    expired: bool,
    /// The session ended or the node was found gone.
    lost: bool,
    retry_at: Option<Instant>,
}

/// What an extend finds when it starts.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Tracked {
    /// Not tracked here (taken through another client, or released).
    No,
    /// Its deadline passed: it is (being) deleted.
    Expired,
    /// Its session ended or its node vanished.
    Lost,
    /// Current as far as this client knows; an extend is now in flight.
    Yes,
}

/// The locks of one client.
#[derive(Debug, Default)]
pub(crate) struct Tracker {
    held: Mutex<HashMap<String, Held>>,
    wake: Notify,
}

impl Tracker {
    fn state(&self) -> std::sync::MutexGuard<'_, HashMap<String, Held>> {
        self.held.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Starts tracking the node at `path` (creation zxid `czxid`, on
    /// `session`) until `deadline`.
    pub(crate) fn track(&self, path: String, czxid: i64, session: i64, deadline: Instant) {
        let held = Held {
            czxid,
            session,
            deadline,
            extending: 0,
            expired: false,
            lost: false,
            retry_at: None,
        };
        self.state().insert(path, held);
        self.wake.notify_one();
    }

    pub(crate) fn forget(&self, path: &str) {
        self.state().remove(path);
    }

    /// The tracked lock at `path`, if it has creation zxid `czxid`.
    pub(crate) fn get(&self, path: &str, czxid: i64) -> Option<Held> {
        self.state().get(path).filter(|h| h.czxid == czxid).cloned()
    }

    /// The tracked path of the lock with creation zxid `czxid`.
    pub(crate) fn path_of(&self, czxid: i64) -> Option<String> {
        self.state()
            .iter()
            .find(|(_, h)| h.czxid == czxid)
            .map(|(p, _)| p.clone())
    }

    /// Starts an extend: the reaper leaves the lock alone until
    /// [`end_extend`](Self::end_extend).
    pub(crate) fn begin_extend(&self, path: &str, czxid: i64) -> Tracked {
        let mut st = self.state();
        let Some(h) = st.get_mut(path).filter(|h| h.czxid == czxid) else {
            return Tracked::No;
        };
        if h.lost {
            st.remove(path);
            return Tracked::Lost;
        }
        if h.expired || h.deadline <= Instant::now() {
            h.expired = true;
            self.wake.notify_one();
            return Tracked::Expired;
        }
        h.extending += 1;
        Tracked::Yes
    }

    /// Ends an extend: `Some(deadline)` after a success, `None` otherwise
    /// (the old deadline stands).
    pub(crate) fn end_extend(&self, path: &str, renewed: Option<Instant>) {
        let mut st = self.state();
        if let Some(h) = st.get_mut(path) {
            h.extending = h.extending.saturating_sub(1);
            if let Some(d) = renewed {
                h.deadline = h.deadline.max(d);
            }
        }
        self.wake.notify_one();
    }

    /// A session ended: every lock on it is gone.
    pub(crate) fn session_lost(&self, session: i64) {
        for h in self.state().values_mut().filter(|h| h.session == session) {
            h.lost = true;
        }
    }

    /// The node of one lock was found gone.
    pub(crate) fn node_lost(&self, path: &str) {
        if let Some(h) = self.state().get_mut(path) {
            h.lost = true;
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.state().len()
    }

    /// The earliest instant the reaper has something to do.
    fn next_due(&self) -> Option<Instant> {
        self.state()
            .values()
            .filter(|h| h.extending == 0)
            .map(|h| h.retry_at.unwrap_or(h.deadline))
            .min()
    }

    /// Locks whose deadline passed with no extend in flight; lost ones are
    /// dropped (the server deleted them).
    fn take_due(&self, now: Instant) -> Vec<String> {
        let mut st = self.state();
        st.retain(|_, h| !(h.lost && h.extending == 0));
        let mut out = Vec::new();
        for (path, h) in st.iter_mut() {
            if h.extending == 0 && h.retry_at.unwrap_or(h.deadline) <= now {
                h.expired = true;
                h.retry_at = Some(now + REAP_RETRY);
                out.push(path.clone());
            }
        }
        out
    }
}

/// The reaper: one task per client, asleep until the next lock deadline;
/// it ends when the client's sessions are gone (the client was dropped).
pub(crate) async fn reaper(tracker: Arc<Tracker>, sessions: Weak<Sessions>) {
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
        let Some(sessions) = sessions.upgrade() else {
            return;
        };
        for path in due {
            let (tracker, sessions) = (Arc::clone(&tracker), Arc::clone(&sessions));
            tokio::spawn(async move {
                let Ok(session) = sessions.get().await else {
                    return; // retried after REAP_RETRY
                };
                let deleted = bounded(
                    "delete",
                    session.timeout(),
                    session.client().delete(&path, None),
                );
                match deleted.await {
                    Ok(Ok(())) => {
                        tracing::warn!(
                            path,
                            "lock expired: its TTL passed without an extend; deleted"
                        );
                        tracker.forget(&path);
                    }
                    Ok(Err(e)) if kind(&e) == Kind::NoNode => tracker.forget(&path),
                    Ok(Err(e)) => {
                        tracing::debug!(path, error = %e, "deleting an expired lock failed; retrying");
                    }
                    Err(e) => {
                        tracing::debug!(path, error = %e, "deleting an expired lock failed; retrying")
                    }
                }
            });
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;

    #[test]
    fn lost_and_expired_locks_refuse_extends() {
        let t = Tracker::default();
        let later = Instant::now() + Duration::from_secs(60);
        t.track("/a".into(), 7, 1, later);
        t.track("/b".into(), 8, 2, later);
        t.track("/c".into(), 9, 2, Instant::now());
        t.session_lost(1);
        assert_eq!(t.begin_extend("/a", 7), Tracked::Lost);
        assert_eq!(t.begin_extend("/b", 99), Tracked::No);
        assert_eq!(t.begin_extend("/b", 8), Tracked::Yes);
        assert_eq!(t.begin_extend("/c", 9), Tracked::Expired);
        t.end_extend("/b", Some(later + Duration::from_secs(1)));
        assert_eq!(
            t.get("/b", 8).unwrap().deadline,
            later + Duration::from_secs(1)
        );
        assert_eq!(t.take_due(Instant::now()), ["/c"]);
        assert_eq!(t.path_of(8).as_deref(), Some("/b"));
    }
}
