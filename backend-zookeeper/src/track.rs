//! Per-lock deadlines: the locks this client holds, and the reaper that
//! deletes each one when its own TTL passes without an extend — a
//! [`Deadlines`] table keyed by (node path, creation zxid), with the
//! session each node is ephemeral on.
//!
//! A session outlives the locks on it, so the TTL of a single lock is
//! enforced here: at the lock's deadline — the same instant its holder's
//! [`Lease::deadline`](fenced_api::Lease::deadline) names — the reaper
//! deletes the node. The holder stops trusting the lock at that same
//! deadline, so no one else can take it while the holder still may act. A
//! session that ends takes every lock on it at once (`lose_where` on its
//! id); if this client dies, the server deletes its nodes when the session
//! expires.

use std::{
    sync::{Arc, Weak},
    time::Duration,
};

use fenced_api::{
    deadlines::{Deadlines, Reaped},
    Label, Owner,
};

use crate::error::{bounded, kind, Kind};
use crate::session::Sessions;

/// Pause before retrying a deletion ZooKeeper did not answer.
const REAP_RETRY: Duration = Duration::from_secs(1);

/// The locks of one client, by (node path, creation zxid = the token).
/// Node paths are never reused (a nonce and a sequence), so the path alone
/// names one grant; the zxid lets an extend find it by token.
pub(crate) type Tracker = Deadlines<(String, i64), Node>;

/// What this client knows of a node it holds: enough to extend and release
/// it without reading it first.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Node {
    /// The session the node is ephemeral on.
    pub(crate) session: i64,
    /// The owner written in its data.
    pub(crate) owner: Owner,
    /// The label written in its data.
    pub(crate) label: Option<Label>,
}

/// An empty tracker with ZooKeeper's retry pause.
pub(crate) fn tracker() -> Tracker {
    Deadlines::new(REAP_RETRY, REAP_RETRY)
}

/// The tracked node of the lock with creation zxid `czxid`.
pub(crate) fn node_of(tracker: &Tracker, czxid: i64) -> Option<(String, i64)> {
    tracker.find(|(_, c)| *c == czxid)
}

/// The reaper: one task per client, asleep until the next lock deadline;
/// it ends when the client's sessions are gone (the client was dropped).
pub(crate) async fn reaper(tracker: Arc<Tracker>, sessions: Weak<Sessions>) {
    tracker
        .run_reaper(sessions, |sessions, (path, _), _| reap(sessions, path))
        .await;
}

/// Deletes the node of a lock whose TTL passed (node paths are never
/// reused, so the path names exactly this grant); a failure is retried
/// after `REAP_RETRY`.
async fn reap(sessions: Arc<Sessions>, path: String) -> Reaped {
    let Ok(session) = sessions.get().await else {
        return Reaped::Failed;
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
            Reaped::Done
        }
        Ok(Err(e)) if kind(&e) == Kind::NoNode => Reaped::Done,
        Ok(Err(e)) => {
            tracing::debug!(path, error = %e, "deleting an expired lock failed; retrying");
            Reaped::Failed
        }
        Err(e) => {
            tracing::debug!(path, error = %e, "deleting an expired lock failed; retrying");
            Reaped::Failed
        }
    }
}
