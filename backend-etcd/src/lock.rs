//! `EtcdLock`: locks on session leases, the create revision as token.

use std::{fmt, future::Future, sync::Arc, time::Duration};

use async_trait::async_trait;
use etcd_client::{
    Client, Compare, CompareOp, ConnectOptions, GetOptions, PutOptions, Txn, TxnOp, TxnOpResponse,
    TxnResponse,
};
use fenced_api::{
    Capabilities, DistributedLock, Error, FencingToken, Lease, LockInfo, LockKey, LockOptions,
    Owner, ReleaseOutcome, Result,
};
use tokio::{task::JoinHandle, time::Instant};

use crate::{
    batch::{Batches, Kind},
    config::EtcdConfig,
    entry, error,
    queue::Attempt,
    session::{RefreshError, Sessions, View},
    track::{self, Held, KeyState, Tracked, Tracker},
    watch::WatchHub,
};

/// A lock store on etcd. Cheap to clone: clones share one gRPC channel, the
/// session leases, the reaper and the watch stream (one *client*).
///
/// See the crate documentation for the design.
#[derive(Clone)]
pub struct EtcdLock {
    pub(crate) inner: Arc<Inner>,
}

pub(crate) struct Inner {
    pub(crate) client: Client,
    pub(crate) config: EtcdConfig,
    pub(crate) sessions: Sessions,
    pub(crate) tracker: Arc<Tracker>,
    pub(crate) batches: Batches,
    pub(crate) watches: WatchHub,
    reaper: JoinHandle<()>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        // Locks still held expire with their session leases, which nothing
        // refreshes any more: one TTL after the last use.
        self.reaper.abort();
    }
}

impl fmt::Debug for EtcdLock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EtcdLock")
            .field("config", &self.inner.config)
            .field("session_leases", &self.inner.sessions.len())
            .field("held", &self.inner.tracker.len())
            .finish()
    }
}

/// What a lease TTL becomes: etcd leases are whole seconds.
pub(crate) fn ttl_secs(ttl: Duration) -> i64 {
    (ttl.as_micros().div_ceil(1_000_000) as i64).max(1)
}

/// A request that failed: etcd's answer, or no answer in time.
#[derive(Debug)]
pub(crate) enum CallError {
    Etcd(etcd_client::Error),
    Timeout(Duration),
}

impl CallError {
    pub(crate) fn into_error(self, what: &str) -> Error {
        match self {
            CallError::Etcd(e) => error::map(e),
            CallError::Timeout(after) => error::timed_out(what, after),
        }
    }
}

impl EtcdLock {
    /// Connects to the endpoints of `url` (see [`EtcdConfig::from_url`]) and
    /// checks that a member answers.
    ///
    /// # Errors
    ///
    /// [`Error::Config`] for a bad URL; [`Error::Backend`] (retryable) when no
    /// member answers within the connect timeout.
    pub async fn connect(url: &str) -> Result<EtcdLock> {
        EtcdLock::connect_with(EtcdConfig::from_url(url)?).await
    }

    /// Connects with an explicit configuration.
    ///
    /// # Errors
    ///
    /// As [`connect`](Self::connect).
    pub async fn connect_with(config: EtcdConfig) -> Result<EtcdLock> {
        if config.tls && !cfg!(feature = "tls") {
            return Err(Error::config(
                "etcds:// needs fenced-etcd built with the `tls` cargo feature",
            ));
        }
        let mut opts = ConnectOptions::new()
            .with_connect_timeout(config.connect_timeout)
            .with_timeout(config.op_timeout);
        #[cfg(feature = "tls")]
        if config.tls {
            opts = opts.with_tls(tls_options(&config)?);
        }
        if let Some((user, password)) = &config.user {
            opts = opts.with_user(user.clone(), password.clone());
        }
        let at = config.endpoints.join(",");
        EtcdLock::open(config, opts)
            .await
            .map_err(|e| e.connecting(&at))
    }

    async fn open(config: EtcdConfig, opts: ConnectOptions) -> Result<EtcdLock> {
        let connect = Client::connect(config.endpoints.clone(), Some(opts));
        let mut client = match tokio::time::timeout(config.connect_timeout, connect).await {
            Ok(c) => c.map_err(error::map)?,
            Err(_) => return Err(error::timed_out("connecting", config.connect_timeout)),
        };
        // One member down must not fail the connect: a status request the
        // channel could not even send (connection refused by that member)
        // is tried again — on another member — until the connect timeout,
        // as `call_raw` does for every later request.
        // When no member ever answers, the last such error (e.g. connection
        // refused) is what the caller sees, not a bare timeout.
        let deadline = Instant::now() + config.connect_timeout;
        let mut unsent = None;
        loop {
            match tokio::time::timeout_at(deadline, client.status()).await {
                Ok(Ok(_)) => break,
                Ok(Err(e)) if error::never_sent(&e) && Instant::now() < deadline => {
                    tracing::debug!(error = %e, "etcd status not sent; trying another member");
                    unsent = Some(e);
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                Ok(Err(e)) => return Err(error::map(e)),
                Err(_) => {
                    return Err(match unsent {
                        Some(e) => error::map(e),
                        None => error::timed_out("status", config.connect_timeout),
                    })
                }
            }
        }
        let tracker = Arc::new(Tracker::default());
        let inner = Arc::new_cyclic(|weak| Inner {
            client,
            config,
            sessions: Sessions::default(),
            tracker: Arc::clone(&tracker),
            batches: Batches::default(),
            watches: WatchHub::default(),
            reaper: tokio::spawn(track::reaper(Arc::clone(&tracker), weak.clone())),
        });
        Ok(EtcdLock { inner })
    }

    /// The configuration (password redacted in `Debug`).
    pub fn config(&self) -> &EtcdConfig {
        &self.inner.config
    }

    /// A client handle for one call (clones share the channel).
    pub(crate) fn client(&self) -> Client {
        self.inner.client.clone()
    }

    /// Runs one request with the operation timeout. A request that could not
    /// even be sent (connection refused to one endpoint of several) is
    /// retried — the channel then tries another member — until the timeout;
    /// anything that may have reached the server is never retried here.
    pub(crate) async fn call_raw<T, F, Fut>(
        &self,
        what: &str,
        mut op: F,
    ) -> std::result::Result<T, CallError>
    where
        F: FnMut(Client) -> Fut,
        Fut: Future<Output = std::result::Result<T, etcd_client::Error>>,
    {
        let after = self.inner.config.op_timeout;
        let deadline = Instant::now() + after;
        loop {
            match tokio::time::timeout_at(deadline, op(self.client())).await {
                Ok(Ok(v)) => return Ok(v),
                Ok(Err(e)) if error::never_sent(&e) && Instant::now() < deadline => {
                    tracing::debug!(what, error = %e, "etcd request not sent; retrying on another member");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                Ok(Err(e)) => return Err(CallError::Etcd(e)),
                Err(_) => return Err(CallError::Timeout(after)),
            }
        }
    }

    /// [`call_raw`](Self::call_raw) with errors mapped.
    pub(crate) async fn call<T, F, Fut>(&self, what: &str, op: F) -> Result<T>
    where
        F: FnMut(Client) -> Fut,
        Fut: Future<Output = std::result::Result<T, etcd_client::Error>>,
    {
        self.call_raw(what, op)
            .await
            .map_err(|e| e.into_error(what))
    }

    /// Sends a transaction; `Ok(None)` when etcd refused it because a lease
    /// it puts keys on no longer exists.
    pub(crate) async fn txn(&self, what: &str, txn: Txn) -> Result<Option<TxnResponse>> {
        let sent = self
            .call_raw(what, |mut c| {
                let txn = txn.clone();
                async move { c.txn(txn).await }
            })
            .await;
        match sent {
            Ok(r) => Ok(Some(r)),
            Err(CallError::Etcd(e)) if error::lease_not_found(&e) => Ok(None),
            Err(e) => Err(e.into_error(what)),
        }
    }

    /// `<prefix>\0lock\0<key>\0`: the line of `key` — its holder and its
    /// waiters, one entry each, ordered by create revision. NUL cannot occur
    /// in keys, owners or prefixes, so `a` and `a/b` — or prefixes `x` and
    /// `x/lock` — never overlap.
    pub(crate) fn line_prefix(&self, key: &LockKey) -> Vec<u8> {
        let prefix = self.inner.config.prefix.as_bytes();
        let mut p = Vec::with_capacity(prefix.len() + key.as_bytes().len() + 7 + 36);
        p.extend_from_slice(prefix);
        p.extend_from_slice(b"\0lock\0");
        p.extend_from_slice(key.as_bytes());
        p.push(0);
        p
    }

    /// `<prefix>\0lock\0<key>\0<owner>`: the entry of one owner in the line.
    pub(crate) fn entry_path(&self, key: &LockKey, owner: &[u8]) -> Vec<u8> {
        let mut p = self.line_prefix(key);
        p.extend_from_slice(owner);
        p
    }

    /// Starts tracking a lock just granted and returns its lease: deadline
    /// and TTL from the session lease's view.
    pub(crate) fn hold(&self, key: &LockKey, owner: Owner, token: i64, view: View) -> Lease {
        let entry = self.entry_path(key, owner.as_str().as_bytes());
        self.inner.tracker.track(
            entry,
            token,
            Held::new(owner.clone(), view.id, view.valid_until),
        );
        Lease::new(
            key.clone(),
            owner,
            FencingToken::new(token as u64),
            view.ttl,
            view.sent_at(),
        )
    }

    /// The holder of `key` — the oldest entry of its line: (value, token,
    /// lease); the value is decoded by [`entry`](crate::entry).
    async fn holder(&self, key: &LockKey) -> Result<Option<(Vec<u8>, i64, i64)>> {
        let line = self.line_prefix(key);
        let resp = self
            .call("get", |mut c| {
                let line = line.clone();
                async move { c.get(line, Some(oldest())).await }
            })
            .await?;
        Ok(resp
            .kvs()
            .first()
            .map(|kv| (kv.value().to_vec(), kv.create_revision(), kv.lease())))
    }

    /// The guard of extend/release: this owner's entry (its path names the
    /// owner), from this exact acquisition (an entry is only ever a holder
    /// once it is the oldest, and stays the oldest until it is deleted).
    fn is_current(&self, lease: &Lease) -> [Compare; 1] {
        let entry = self.entry_path(&lease.key, lease.owner.as_str().as_bytes());
        [Compare::create_revision(
            entry,
            CompareOp::Equal,
            lease.token.get() as i64,
        )]
    }

    pub(crate) fn check_reentry(
        &self,
        key: &LockKey,
        opts: &LockOptions,
        holder: Option<&[u8]>,
    ) -> Result<()> {
        match (opts.owner(), holder.map(entry::owner_bytes)) {
            (Some(owner), Some(h)) if h == owner.as_str().as_bytes() => {
                if opts.is_reentrant() {
                    Err(Error::Unsupported {
                        backend: error::BACKEND,
                        what: "owner reentrancy (use LockClient::builder(..).reentrant(true))"
                            .into(),
                    })
                } else {
                    Err(Error::AlreadyHeld { key: key.clone() })
                }
            }
            _ => Ok(()),
        }
    }

    /// Extend of a lock this client tracks on its current session lease:
    /// one batched ownership check, plus a keep-alive if the lease is due.
    /// `Ok(None)`: the key is still this holder's but on another lease.
    async fn extend_in_place(
        &self,
        lease: &Lease,
        ttl: Duration,
        on: i64,
    ) -> Result<Option<Lease>> {
        let lost = |why: &str| Error::lease_lost(&lease.key, lease.token, why);
        let (class, view) = self.session(ttl).await?;
        if view.id != on {
            return Ok(None);
        }
        let entry = self.entry_path(&lease.key, lease.owner.as_str().as_bytes());
        let (state, fresh) = tokio::join!(self.check(&entry), self.freshen(&class, view));
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

    /// Puts a current lock on this client's session lease for `ttl`: a new
    /// TTL, or a lock taken through another client. A put keeps the create
    /// revision, so the token (and the place in line) stays, and keeps the
    /// value (owner and label, which the lease does not carry).
    async fn extend_by_moving(&self, lease: &Lease, ttl: Duration) -> Result<(Lease, i64)> {
        let lost = |why: &str| Error::lease_lost(&lease.key, lease.token, why);
        let entry = self.entry_path(&lease.key, lease.owner.as_str().as_bytes());
        for _ in 0..2 {
            let (class, view) = self.session(ttl).await?;
            let txn = Txn::new()
                .when(self.is_current(lease))
                .and_then([TxnOp::put(
                    entry.clone(),
                    Vec::new(),
                    Some(PutOptions::new().with_ignore_value().with_lease(view.id)),
                )]);
            let (resp, fresh) =
                tokio::join!(self.txn("extend txn", txn), self.freshen(&class, view));
            let Some(resp) = resp? else {
                class.invalidate(view.id);
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
}

/// The first key-value any `Get` of a transaction returned.
pub(crate) fn first_kv(resp: &TxnResponse) -> Option<etcd_client::KeyValue> {
    resp.op_responses().into_iter().find_map(|op| match op {
        TxnOpResponse::Get(g) => g.kvs().first().cloned(),
        _ => None,
    })
}

/// The store revision a response was produced at.
pub(crate) fn revision(resp: &TxnResponse) -> i64 {
    resp.header().map_or(0, |h| h.revision())
}

#[async_trait]
impl DistributedLock for EtcdLock {
    async fn try_acquire(&self, key: &LockKey, opts: &LockOptions) -> Result<Option<Lease>> {
        let owner = opts.owner_or_random();
        let line = self.line_prefix(key);
        let value = entry::value(&owner, opts.label());
        let entry = self.entry_path(key, owner.as_str().as_bytes());
        for _ in 0..2 {
            let (class, view) = self.session(opts.ttl()).await?;
            let attempt = Attempt::new(
                self,
                key,
                &owner,
                opts.label(),
                view.id,
                opts.owner().is_some(),
            );
            // An empty line: nobody holds or waits. Our entry is the lock.
            let txn = Txn::new()
                .when([Compare::create_revision(line.clone(), CompareOp::Equal, 0).with_prefix()])
                .and_then([TxnOp::put(
                    entry.clone(),
                    value.clone(),
                    Some(PutOptions::new().with_lease(view.id)),
                )])
                .or_else([TxnOp::get(line.clone(), Some(oldest()))]);
            let (resp, fresh) =
                tokio::join!(self.txn("acquire txn", txn), self.freshen(&class, view));
            let Some(resp) = resp? else {
                attempt.disarm();
                class.invalidate(view.id);
                continue;
            };
            if !resp.succeeded() {
                attempt.disarm();
                let holder = first_kv(&resp).map(|kv| kv.value().to_vec());
                self.check_reentry(key, opts, holder.as_deref())?;
                return Ok(None);
            }
            match fresh {
                Ok(v) => {
                    attempt.disarm();
                    return Ok(Some(self.hold(key, owner, revision(&resp), v)));
                }
                // The lease ended right after the grant (or was replaced):
                // make sure our entry is gone before trying again.
                Err(RefreshError::Gone | RefreshError::Failed(_)) => attempt.clean_now().await,
            }
        }
        Err(Error::backend(
            error::BACKEND,
            true,
            "the session lease vanished twice in a row",
        ))
    }

    async fn acquire(&self, key: &LockKey, opts: &LockOptions) -> Result<Lease> {
        crate::queue::acquire_fifo(self, key, opts).await
    }

    async fn extend(&self, lease: &Lease, ttl: Duration) -> Result<Lease> {
        LockOptions::validate_ttl(ttl)?;
        let lost = |why: &str| Error::lease_lost(&lease.key, lease.token, why);
        let path = self.entry_path(&lease.key, lease.owner.as_str().as_bytes());
        let token = lease.token.get() as i64;
        let tracker = &self.inner.tracker;
        let on = match tracker.begin_extend(&path, token) {
            Tracked::Expired => return Err(lost("its TTL passed without an extend")),
            Tracked::Lost => return Err(lost("its session lease ended or its entry was deleted")),
            Tracked::No => None,
            Tracked::Yes { lease } => Some(lease),
        };
        /// Ends the tracker's extend even if the future is dropped.
        struct Ending<'a>(&'a Tracker, &'a [u8], i64, Option<(Instant, i64)>, bool);
        impl Drop for Ending<'_> {
            fn drop(&mut self) {
                if self.4 {
                    self.0.end_extend(self.1, self.2, self.3);
                }
            }
        }
        let mut ending = Ending(tracker, &path, token, None, on.is_some());
        if let Some(on) = on {
            if let Some(renewed) = self.extend_in_place(lease, ttl, on).await.inspect_err(|e| {
                if matches!(e, Error::LeaseLost { .. }) {
                    tracing::warn!(key = %lease.key, token = %lease.token, "extend refused: the lock is gone");
                    tracker.forget(&path, token);
                }
            })? {
                ending.3 = Some((renewed.deadline, on));
                return Ok(renewed);
            }
        }
        match self.extend_by_moving(lease, ttl).await {
            Ok((renewed, on)) => {
                if ending.4 {
                    ending.3 = Some((renewed.deadline, on));
                } else {
                    let held = Held::new(lease.owner.clone(), on, renewed.deadline);
                    tracker.track(path.clone(), token, held);
                }
                Ok(renewed)
            }
            Err(e) => {
                if matches!(e, Error::LeaseLost { .. }) {
                    tracing::warn!(key = %lease.key, token = %lease.token, "extend refused: the lock is gone");
                    tracker.forget(&path, token);
                }
                Err(e)
            }
        }
    }

    async fn release(&self, lease: &Lease) -> Result<ReleaseOutcome> {
        let entry = self.entry_path(&lease.key, lease.owner.as_str().as_bytes());
        // Deleting the holder's entry hands the lock to the next in line.
        let op = TxnOp::txn(
            Txn::new()
                .when(self.is_current(lease))
                .and_then([TxnOp::delete(entry.clone(), None)]),
        );
        // On an error the lock stays tracked: the reaper deletes it at its deadline.
        let resp = self.batched(Kind::Writes, &entry, op).await?;
        self.inner.tracker.forget(&entry, lease.token.get() as i64);
        if !matches!(resp, TxnOpResponse::Txn(t) if t.succeeded()) {
            tracing::warn!(key = %lease.key, token = %lease.token, "release of a lease that was no longer held");
            return Ok(ReleaseOutcome::NotHeld);
        }
        Ok(ReleaseOutcome::Released)
    }

    async fn inspect(&self, key: &LockKey) -> Result<Option<LockInfo>> {
        let Some((value, rev, lease_id)) = self.holder(key).await? else {
            return Ok(None);
        };
        let owner = entry::owner_bytes(&value);
        // The store knows the session lease's TTL: the key is gone by then
        // unless its client refreshes it. A lock held through this client
        // also has its own, possibly earlier, deadline.
        let mut ttl = match self
            .call("lease ttl", |mut c| async move {
                c.lease_time_to_live(lease_id, None).await
            })
            .await
        {
            Ok(r) => Duration::from_secs(r.ttl().max(0) as u64),
            Err(_) => Duration::ZERO,
        };
        if let Some(deadline) = self
            .inner
            .tracker
            .deadline(&self.entry_path(key, owner), rev)
        {
            ttl = ttl.min(deadline.saturating_duration_since(Instant::now()));
        }
        let (owner, label) = entry::decode(key, &value);
        Ok(Some(
            LockInfo::new(key.clone(), owner, FencingToken::new(rev as u64), ttl, 1)
                .with_label(label),
        ))
    }

    /// The holders under this client's prefix, first `limit` in key order:
    /// the range `<prefix>\0lock\0…` read in pages of 500 entries at one
    /// revision, keeping the oldest entry of each line (waiters are not
    /// listed), then one `LeaseTimeToLive` per distinct session lease for
    /// the remaining TTL (capped by this client's own deadline, as
    /// `inspect`). Cost: O(entries read) — holders plus their waiters, up
    /// to the `limit`-th line — in pages, plus one lease request per
    /// holding client. Token = the entry's create revision, hold count 1.
    async fn list(&self, limit: usize) -> Result<Vec<LockInfo>> {
        self.list_held(limit).await
    }

    async fn force_release(&self, key: &LockKey) -> Result<bool> {
        let Some((value, rev, _)) = self.holder(key).await? else {
            return Ok(false);
        };
        // The session lease is shared: never revoke it; delete the holder's
        // entry (the next in line then holds).
        let entry = self.entry_path(key, entry::owner_bytes(&value));
        let txn = Txn::new()
            .when([Compare::create_revision(
                entry.clone(),
                CompareOp::Equal,
                rev,
            )])
            .and_then([TxnOp::delete(entry, None)]);
        let removed = self
            .call("force release txn", |mut c| {
                let txn = txn.clone();
                async move { c.txn(txn).await }
            })
            .await?
            .succeeded();
        if removed {
            tracing::warn!(key = %key, "lock force-released");
        }
        Ok(removed)
    }

    /// Native (watch) wait, FIFO, durable, monotonic fencing; a 2 s minimum
    /// TTL.
    ///
    /// Two limits these flags do not show (see the crate docs): etcd raises
    /// a TTL below its minimum — 3/2 of its election timeout in whole
    /// seconds, 2 s with etcd's default timing (measured on etcd 3.4.23; a
    /// cluster with a longer election timeout raises more) — and every lease
    /// reports the TTL etcd granted. And a lock's own TTL is enforced by this
    /// client's reaper while the client runs, with etcd's session lease as
    /// the backstop when it dies or freezes, not by the store's clock alone:
    /// a lock whose holder stopped extending can outlive its deadline by up
    /// to one TTL if the whole client dies before the deadline.
    fn capabilities(&self) -> Capabilities {
        Capabilities::none()
            .backend("etcd")
            .native_wait(true)
            .fifo(true)
            .durable(true)
            .fencing(true)
            .min_ttl(Duration::from_secs(2))
    }
}

/// The newest entry of a line created before `revision` (a waiter's predecessor).
/// Server verification (rustls): only the CA file of the `ca` parameter
/// when given, else the platform's roots (`SSL_CERT_FILE` / `SSL_CERT_DIR`
/// honoured).
#[cfg(feature = "tls")]
fn tls_options(config: &EtcdConfig) -> Result<etcd_client::TlsOptions> {
    let tls = etcd_client::TlsOptions::new();
    match &config.ca {
        Some(path) => {
            let pem = std::fs::read(path).map_err(|e| {
                Error::config(format!(
                    "cannot read the etcd CA file `{}` (url parameter `ca`): {e}",
                    path.display()
                ))
            })?;
            if !String::from_utf8_lossy(&pem).contains("-----BEGIN CERTIFICATE-----") {
                return Err(Error::config(format!(
                    "the etcd CA file `{}` (url parameter `ca`) holds no PEM certificate",
                    path.display()
                )));
            }
            Ok(tls.ca_certificate(etcd_client::Certificate::from_pem(pem)))
        }
        None => Ok(tls.with_native_roots()),
    }
}

pub(crate) fn newest_before(revision: i64) -> GetOptions {
    by_creation(etcd_client::SortOrder::Descend).with_max_create_revision(revision - 1)
}

/// The newest entry of a line (the last in line).
pub(crate) fn newest() -> GetOptions {
    by_creation(etcd_client::SortOrder::Descend)
}

/// The oldest entry of a line: the holder.
pub(crate) fn oldest() -> GetOptions {
    by_creation(etcd_client::SortOrder::Ascend)
}

fn by_creation(order: etcd_client::SortOrder) -> GetOptions {
    GetOptions::new()
        .with_prefix()
        .with_sort(etcd_client::SortTarget::Create, order)
        .with_limit(1)
}
