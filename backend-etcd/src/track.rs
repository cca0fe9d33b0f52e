//! Per-lock deadlines on shared leases: the locks this client holds, and
//! the reaper that deletes each one when its own TTL passes without an
//! extend — a [`Deadlines`] table keyed by (entry path, token).
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
    sync::{Arc, Weak},
    time::Duration,
};

use etcd_client::{Compare, CompareOp, Txn, TxnOp, TxnOpResponse};
use fenced_api::{
    deadlines::{Deadlines, Reaped},
    Owner,
};

use crate::batch::{Batches, Kind};

/// First retry pause for a deletion etcd did not answer; doubles up to `REAP_RETRY_MAX`.
const REAP_RETRY: Duration = Duration::from_secs(1);
const REAP_RETRY_MAX: Duration = Duration::from_secs(16);

/// What this client knows of one lock it holds.
#[derive(Debug, Clone)]
pub(crate) struct Held {
    pub(crate) owner: Owner,
    /// The session lease the key is on.
    pub(crate) lease: i64,
}

/// The locks held through one client, by (entry path, token = create
/// revision); a lease that ends loses every lock on it
/// (`lose_where(|_, h| h.lease == id)`).
pub(crate) type Tracker = Deadlines<(Vec<u8>, i64), Held>;

/// An empty tracker with etcd's retry pauses.
pub(crate) fn tracker() -> Tracker {
    Deadlines::new(REAP_RETRY, REAP_RETRY_MAX)
}

/// The reaper: one task per client, asleep until the next lock deadline;
/// it ends when the client's batches are gone (the client was dropped).
pub(crate) async fn reaper(tracker: Arc<Tracker>, batches: Weak<Batches>) {
    tracker
        .run_reaper(batches, |batches, (path, token), held| {
            reap(batches, path, token, held)
        })
        .await;
}

/// Deletes a lock whose TTL passed, guarded by its create revision (a
/// batched write); a failure is retried later through the reaper.
async fn reap(batches: Arc<Batches>, path: Vec<u8>, token: i64, held: Held) -> Reaped {
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
            Reaped::Done
        }
        Err(e) => {
            tracing::debug!(token, error = %e, "deleting an expired lock failed; retrying later");
            Reaped::Failed
        }
    }
}
