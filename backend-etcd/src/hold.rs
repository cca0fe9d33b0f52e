//! Extend and release of one held entry, wherever its line lives (a
//! lock's, or a semaphore's): the entry is named by its path (which names
//! the owner) and its create revision (the token).
//!
//! * **extend** = a guarded read of the entry (same create revision, owner
//!   and session lease; batched with other reads) plus the coalesced
//!   keep-alive of the session lease; a different TTL, or an entry on
//!   another lease, is moved onto that TTL's lease by a put (which keeps the
//!   create revision, so the token and the place in line stay).
//! * **release** = a delete guarded by the create revision (batched).
//!
//! Both keep the client's [`Tracker`] (the reaper's deadlines) in step.

use std::{sync::Arc, time::Duration};

use etcd_client::{Compare, CompareOp, PutOptions, Txn, TxnOp, TxnOpResponse};
use fenced_api::{deadlines::Tracked, Error, Lease, LockOptions, ReleaseOutcome, Result};

use crate::{
    batch::{Batches, KeyState, Kind},
    entry, error,
    session::Sessions,
    track::{Held, Tracker},
};

/// The parts of a client that extend and release use.
#[derive(Clone, Copy)]
pub(crate) struct Holds<'a> {
    pub(crate) sessions: &'a Arc<Sessions>,
    pub(crate) tracker: &'a Arc<Tracker>,
    pub(crate) batches: &'a Arc<Batches>,
}

/// The guard of extend/release: the entry at `path` (whose path names the
/// owner) is from this exact acquisition.
pub(crate) fn is_current(path: &[u8], lease: &Lease) -> [Compare; 1] {
    [Compare::create_revision(
        path.to_vec(),
        CompareOp::Equal,
        lease.token.get() as i64,
    )]
}

impl Holds<'_> {
    /// Extends the entry at `path` held by `lease` for `ttl`: its lease
    /// runs to the deadline the session lease's keep-alive bought, which
    /// is also the reaper's deadline for it.
    pub(crate) async fn extend(
        &self,
        path: Vec<u8>,
        lease: &Lease,
        ttl: Duration,
    ) -> Result<Lease> {
        LockOptions::validate_ttl(ttl)?;
        let lost = |why: &str| Error::lease_lost(&lease.key, lease.token, why);
        let token = lease.token.get() as i64;
        let tracker = self.tracker;
        let tracked = (path.clone(), token);
        let on = match tracker.begin_extend(&tracked) {
            Tracked::Expired => return Err(lost("its TTL passed without an extend")),
            Tracked::Lost => return Err(lost("its session lease ended or its entry was deleted")),
            Tracked::No => None,
            Tracked::Yes(held) => Some(held.lease),
        };
        let mut ending = tracker.extending(on.map(|_| tracked.clone()));
        let held = |id| Held {
            owner: lease.owner.clone(),
            lease: id,
        };
        let refused = |e: &Error| {
            if matches!(e, Error::LeaseLost { .. }) {
                tracing::debug!(key = %lease.key, token = %lease.token, "extend refused: the lock is gone");
                tracker.forget(&tracked);
            }
        };
        if let Some(on) = on {
            if let Some(renewed) = self
                .extend_in_place(&path, lease, ttl, on)
                .await
                .inspect_err(refused)?
            {
                ending.renewed(renewed.deadline, held(on));
                return Ok(renewed);
            }
        }
        let (renewed, on) = self
            .extend_by_moving(&path, lease, ttl)
            .await
            .inspect_err(refused)?;
        if ending.is_active() {
            ending.renewed(renewed.deadline, held(on));
        } else {
            tracker.track(tracked.clone(), held(on), renewed.deadline);
        }
        Ok(renewed)
    }

    /// Extend of an entry this client tracks on its current session lease:
    /// one batched ownership check, plus a keep-alive if the lease is due.
    /// `Ok(None)`: the entry is still this holder's but on another lease.
    async fn extend_in_place(
        &self,
        path: &[u8],
        lease: &Lease,
        ttl: Duration,
        on: i64,
    ) -> Result<Option<Lease>> {
        let lost = |why: &str| Error::lease_lost(&lease.key, lease.token, why);
        let (class, view) = self.sessions.session(ttl).await?;
        if view.id != on {
            return Ok(None);
        }
        let (state, fresh) = tokio::join!(
            self.batches.check(path),
            self.sessions.freshen(&class, view)
        );
        match state? {
            Some(KeyState {
                create_revision,
                value,
                lease: on_lease,
            }) if create_revision == lease.token.get() as i64
                && entry::owner_bytes(&value) == lease.owner.as_str().as_bytes() =>
            {
                if on_lease != view.id {
                    return Ok(None);
                }
            }
            _ => return Err(lost("the key was deleted, expired or re-created")),
        }
        let fresh = match fresh {
            Ok(v) => v,
            Err(_) => return Err(lost("the session lease ended")),
        };
        Ok(Some(lease.renewed(fresh.ttl, fresh.sent_at())))
    }

    /// Puts a current entry on this client's session lease for `ttl`: a new
    /// TTL, or an entry taken through another client. A put keeps the
    /// create revision, so the token (and the place in line) stays, and
    /// keeps the value (owner and label, which the lease does not carry).
    async fn extend_by_moving(
        &self,
        path: &[u8],
        lease: &Lease,
        ttl: Duration,
    ) -> Result<(Lease, i64)> {
        let lost = |why: &str| Error::lease_lost(&lease.key, lease.token, why);
        for _ in 0..2 {
            let (class, view) = self.sessions.session(ttl).await?;
            let txn = Txn::new()
                .when(is_current(path, lease))
                .and_then([TxnOp::put(
                    path.to_vec(),
                    Vec::new(),
                    Some(PutOptions::new().with_ignore_value().with_lease(view.id)),
                )]);
            let sent = self.sessions.txn_on(&class, view, "extend txn", txn);
            let Some((resp, fresh)) = sent.await? else {
                continue;
            };
            if !resp.succeeded() {
                return Err(lost("the key was deleted, expired or re-created"));
            }
            let fresh = fresh.map_err(|_| lost("the session lease ended"))?;
            return Ok((lease.renewed(fresh.ttl, fresh.sent_at()), fresh.id));
        }
        Err(Error::backend(
            error::BACKEND,
            true,
            "the session lease vanished twice in a row",
        ))
    }

    /// Deletes the entry at `path` if `lease` still holds it (a batched
    /// write) and stops tracking it; on an error the entry stays tracked,
    /// and the reaper deletes it at its deadline.
    pub(crate) async fn release(&self, path: Vec<u8>, lease: &Lease) -> Result<ReleaseOutcome> {
        let op = TxnOp::txn(
            Txn::new()
                .when(is_current(&path, lease))
                .and_then([TxnOp::delete(path.clone(), None)]),
        );
        let resp = self.batches.batched(Kind::Writes, &path, op).await?;
        let token = lease.token.get() as i64;
        self.tracker.forget(&(path, token));
        if !matches!(resp, TxnOpResponse::Txn(t) if t.succeeded()) {
            tracing::warn!(key = %lease.key, token = %lease.token, "release of a lease that was not held");
            return Ok(ReleaseOutcome::NotHeld);
        }
        Ok(ReleaseOutcome::Released)
    }
}
