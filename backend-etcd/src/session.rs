//! Session leases: one etcd lease per distinct TTL (whole seconds) per
//! client, shared by every lock and queue entry of that TTL — etcd's
//! `concurrency.Session`, but kept alive only by use.
//!
//! A class lease is refreshed (one keep-alive message on its own stream) by
//! acquisitions, extends and waiters, at most once per eighth of its TTL: a
//! lock taken or extended reports the deadline the last keep-alive bought
//! (`valid_until`), which is at most an eighth of a TTL short of a fresh one.
//! Nothing refreshes an idle class, so when the client stops (crash, freeze,
//! drop) the store expires everything on it one TTL after the last use — on
//! the store's clock. Per-lock expiry while the client runs is the reaper's
//! job (module `track`).

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
    time::Duration,
};

use etcd_client::{Client, LeaseKeepAliveStream, LeaseKeeper, Txn, TxnResponse};
use fenced_api::{Error, FencingToken, Lease, LockKey, Owner, Result};
use tokio::time::Instant;

use crate::{
    client::Etcd,
    error::{self, bounded},
    track::{Held, Tracker},
};

/// What a lease TTL becomes: etcd leases are whole seconds.
pub(crate) fn ttl_secs(ttl: Duration) -> i64 {
    (ttl.as_micros().div_ceil(1_000_000) as i64).max(1)
}

/// What this client knows about a class lease.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct View {
    /// The etcd lease id.
    pub(crate) id: i64,
    /// Its granted TTL (etcd rounds small TTLs up to its minimum).
    pub(crate) ttl: Duration,
    /// Send time of the last successful grant / keep-alive + TTL: the store
    /// keeps the lease at least until then.
    pub(crate) valid_until: Instant,
}

impl View {
    /// Refreshed recently enough that a lock taken now loses at most an
    /// eighth of its TTL by using this view's deadline.
    pub(crate) fn is_fresh(&self, now: Instant) -> bool {
        self.valid_until >= now + self.ttl - self.ttl / 8
    }

    /// The send time of the request that bought `valid_until`.
    pub(crate) fn sent_at(&self) -> Instant {
        self.valid_until
            .checked_sub(self.ttl)
            .unwrap_or(self.valid_until)
    }
}

/// A refresh found the lease gone: every key on it went with it.
#[derive(Debug)]
pub(crate) enum RefreshError {
    /// etcd does not know the lease: it expired or was revoked.
    Gone,
    /// The keep-alive could not be sent or answered; the lease may live.
    Failed(Error),
}

/// One class: the lease for one TTL.
pub(crate) struct Class {
    secs: i64,
    view: Mutex<Option<View>>,
    /// The keep-alive stream; its lock also serialises grants and refreshes.
    keeper: tokio::sync::Mutex<Option<(LeaseKeeper, LeaseKeepAliveStream)>>,
}

impl Class {
    pub(crate) fn view(&self) -> Option<View> {
        *self.view.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn set_view(&self, v: Option<View>) {
        *self.view.lock().unwrap_or_else(|p| p.into_inner()) = v;
    }

    /// Forgets lease `id` (etcd refused it): the next use grants a new one.
    pub(crate) fn invalidate(&self, id: i64) {
        let mut view = self.view.lock().unwrap_or_else(|p| p.into_inner());
        if view.is_some_and(|v| v.id == id) {
            *view = None;
        }
    }
}

/// The classes of one client, and what keeps them: the transport, and the
/// locks on them (every lock on a lease that ends is lost).
pub(crate) struct Sessions {
    etcd: Etcd,
    tracker: Arc<Tracker>,
    classes: Mutex<HashMap<i64, Arc<Class>>>,
}

impl Sessions {
    pub(crate) fn new(etcd: Etcd, tracker: Arc<Tracker>) -> Sessions {
        Sessions {
            etcd,
            tracker,
            classes: Mutex::new(HashMap::new()),
        }
    }

    /// The transport the leases are kept over.
    pub(crate) fn etcd(&self) -> &Etcd {
        &self.etcd
    }

    /// The locks held on these leases.
    pub(crate) fn tracker(&self) -> &Arc<Tracker> {
        &self.tracker
    }

    fn class(&self, secs: i64) -> Arc<Class> {
        let mut map = self.classes.lock().unwrap_or_else(|p| p.into_inner());
        Arc::clone(map.entry(secs).or_insert_with(|| {
            Arc::new(Class {
                secs,
                view: Mutex::new(None),
                keeper: tokio::sync::Mutex::new(None),
            })
        }))
    }

    /// How many class leases this client has (for `Debug`).
    pub(crate) fn len(&self) -> usize {
        self.classes.lock().unwrap_or_else(|p| p.into_inner()).len()
    }
}

impl Sessions {
    /// The class lease for `ttl`, ready for a request: granted if there is
    /// none, refreshed first if it has not been used for half a TTL (it may
    /// have expired). Otherwise no request is made; see [`Self::freshen`].
    pub(crate) async fn session(self: &Arc<Self>, ttl: Duration) -> Result<(Arc<Class>, View)> {
        let class = self.class(ttl_secs(ttl));
        if let Some(v) = class.view() {
            if v.valid_until > Instant::now() + v.ttl / 2 {
                return Ok((class, v));
            }
        }
        match self.refresh(&class, true).await {
            Ok(v) => Ok((class, v)),
            // Unanswered, but still valid for a while: use it as it is.
            Err(RefreshError::Failed(e)) => match class.view() {
                Some(v) if v.valid_until > Instant::now() + v.ttl / 8 => Ok((class, v)),
                _ => Err(e),
            },
            Err(RefreshError::Gone) => Err(Error::backend(
                error::BACKEND,
                true,
                "a freshly granted lease vanished",
            )),
        }
    }

    /// Runs alongside a request that uses `view`: refreshes the class lease
    /// if `view` is not fresh. A failed keep-alive keeps the old view (still
    /// valid until its `valid_until`); only a lease etcd does not know is
    /// an error.
    pub(crate) async fn freshen(
        self: &Arc<Self>,
        class: &Arc<Class>,
        view: View,
    ) -> std::result::Result<View, RefreshError> {
        if view.is_fresh(Instant::now()) {
            return Ok(view);
        }
        match self.refresh(class, false).await {
            Ok(v) if v.id == view.id => Ok(v),
            Ok(_) | Err(RefreshError::Gone) => Err(RefreshError::Gone),
            Err(RefreshError::Failed(e)) => {
                tracing::debug!(lease = view.id, error = %e, "lease keep-alive failed; the lease stays valid until its last deadline");
                Ok(view)
            }
        }
    }

    /// Sends `txn`, which puts keys on the lease of `view`, with a
    /// [`freshen`](Self::freshen) of that lease beside it. `Ok(None)` when
    /// etcd refused the transaction because the lease does not exist: the
    /// class forgets it, and the next use grants a new one.
    pub(crate) async fn txn_on(
        self: &Arc<Self>,
        class: &Arc<Class>,
        view: View,
        what: &str,
        txn: Txn,
    ) -> Result<Option<(TxnResponse, std::result::Result<View, RefreshError>)>> {
        let (resp, fresh) = tokio::join!(self.etcd.txn(what, txn), self.freshen(class, view));
        match resp? {
            Some(resp) => Ok(Some((resp, fresh))),
            None => {
                class.invalidate(view.id);
                Ok(None)
            }
        }
    }

    /// One keep-alive for the class lease unless another caller just sent
    /// one; `or_grant`: grant a new lease when there is none or it is gone.
    /// Runs in its own task, so a cancelled caller never leaves the
    /// keep-alive stream half-read.
    pub(crate) async fn refresh(
        self: &Arc<Self>,
        class: &Arc<Class>,
        or_grant: bool,
    ) -> std::result::Result<View, RefreshError> {
        let task = tokio::spawn(refresh_task(Arc::clone(self), Arc::clone(class), or_grant));
        match task.await {
            Ok(r) => r,
            Err(e) => Err(RefreshError::Failed(Error::backend(
                error::BACKEND,
                true,
                format!("lease refresh task failed: {e}"),
            ))),
        }
    }

    /// Asks etcd whether lease `id` of `class` still exists, after a key
    /// on it vanished unexpectedly. If etcd does not know it (revoked or
    /// expired), the class forgets it and every lock on it is marked lost,
    /// as a failed keep-alive would. One request; only on that rare path.
    pub(crate) async fn confirm_lease(&self, class: &Class, id: i64) {
        match self.etcd.lease_ttl(id).await {
            Ok(ttl) if ttl < 0 => {
                tracing::warn!(lease = id, "session lease gone; every lock on it is lost");
                class.invalidate(id);
                self.tracker.lose_where(|_, h| h.lease == id);
            }
            Ok(_) => {}
            Err(e) => {
                tracing::debug!(lease = id, error = %e, "checking the session lease failed; the next request tells");
            }
        }
    }

    /// Starts tracking a lock just granted on the session lease `view`
    /// (its entry, create revision `token`) and returns its lease: deadline
    /// and TTL from the session lease's view.
    pub(crate) fn hold(
        &self,
        entry: Vec<u8>,
        key: &LockKey,
        owner: Owner,
        token: i64,
        view: View,
    ) -> Lease {
        let held = Held {
            owner: owner.clone(),
            lease: view.id,
        };
        self.tracker.track((entry, token), held, view.valid_until);
        Lease::new(
            key.clone(),
            owner,
            FencingToken::new(token as u64),
            view.ttl,
            view.sent_at(),
        )
    }

    async fn grant(&self, secs: i64) -> Result<View> {
        let sent = Instant::now();
        let r = self
            .etcd
            .call("lease grant", |mut c| async move {
                c.lease_grant(secs, None).await
            })
            .await?;
        // etcd raises TTLs below its minimum silently: report what was granted.
        let ttl = Duration::from_secs(r.ttl().max(1) as u64);
        Ok(View {
            id: r.id(),
            ttl,
            valid_until: sent + ttl,
        })
    }
}

async fn refresh_task(
    sessions: Arc<Sessions>,
    class: Arc<Class>,
    or_grant: bool,
) -> std::result::Result<View, RefreshError> {
    let mut keeper = class.keeper.lock().await;
    let current = class.view();
    if let Some(v) = current.filter(|v| v.is_fresh(Instant::now())) {
        return Ok(v);
    }
    if current.is_none() && !or_grant {
        // Invalidated by another caller: the lease this caller used is gone.
        return Err(RefreshError::Gone);
    }
    if let Some(v) = current {
        let sent = Instant::now();
        match keep_alive(&sessions.etcd, &mut keeper, v).await {
            Ok(ttl) if ttl > 0 => {
                let ttl = Duration::from_secs(ttl as u64);
                let fresh = View {
                    id: v.id,
                    ttl,
                    valid_until: sent + ttl,
                };
                class.set_view(Some(fresh));
                return Ok(fresh);
            }
            Ok(_) => {
                tracing::warn!(lease = v.id, "session lease gone; every lock on it is lost");
                *keeper = None;
                class.invalidate(v.id);
                sessions.tracker.lose_where(|_, h| h.lease == v.id);
                if !or_grant {
                    return Err(RefreshError::Gone);
                }
            }
            Err(e) => {
                *keeper = None;
                if !or_grant || v.valid_until > Instant::now() {
                    return Err(RefreshError::Failed(e));
                }
                // Not answered and past its known deadline: start over.
                class.invalidate(v.id);
            }
        }
    }
    let fresh = sessions
        .grant(class.secs)
        .await
        .map_err(RefreshError::Failed)?;
    *keeper = None;
    class.set_view(Some(fresh));
    Ok(fresh)
}

/// One keep-alive on the class's stream (opened on first use; opening it is
/// itself a keep-alive). Returns the TTL etcd reports (≤ 0: gone).
async fn keep_alive(
    etcd: &Etcd,
    keeper: &mut Option<(LeaseKeeper, LeaseKeepAliveStream)>,
    view: View,
) -> Result<i64> {
    let id = view.id;
    if let Some((k, stream)) = keeper.as_mut() {
        let once = async {
            k.keep_alive().await?;
            Ok::<_, etcd_client::Error>(stream.message().await?.map(|r| r.ttl()))
        };
        match bounded("lease keep-alive", etcd.timeout(), once).await? {
            Ok(Some(ttl)) => return Ok(ttl),
            // An ended stream says nothing about the lease: reopen it.
            Ok(None) => {
                tracing::debug!(lease = id, "keep-alive stream ended; reopening");
            }
            Err(e) => {
                tracing::debug!(lease = id, error = %e, "keep-alive stream broken; reopening");
            }
        }
        *keeper = None;
    }
    let open = |mut c: Client| async move { c.lease_keep_alive(id).await };
    match etcd.request("lease keep-alive", open).await? {
        Ok(pair) => {
            *keeper = Some(pair);
            // The opening keep-alive succeeded (etcd-client checks TTL > 0
            // but keeps the reply): a keep-alive restores the granted TTL.
            Ok(view.ttl.as_secs() as i64)
        }
        Err(e) if error::lease_not_found(&e) => Ok(0),
        Err(e) => Err(error::map(e)),
    }
}
