//! `EtcdLock`: lease + transaction per lock, the create revision as token.

use std::{fmt, future::Future, sync::Arc, time::Duration};

use async_trait::async_trait;
use etcd_client::{
    Client, Compare, CompareOp, ConnectOptions, GetOptions, PutOptions, Txn, TxnOp, TxnOpResponse,
};
use fenced_api::{
    Capabilities, DistributedLock, Error, FencingToken, Lease, LockInfo, LockKey, LockOptions,
    Owner, ReleaseOutcome, Result,
};
use tokio::time::Instant;

use crate::{config::EtcdConfig, error};

/// A lock store on etcd. Cheap to clone (clones share one gRPC channel).
///
/// See the crate documentation for the design.
#[derive(Clone)]
pub struct EtcdLock {
    pub(crate) inner: Arc<Inner>,
}

pub(crate) struct Inner {
    pub(crate) client: Client,
    pub(crate) config: EtcdConfig,
}

impl fmt::Debug for EtcdLock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EtcdLock")
            .field("config", &self.inner.config)
            .finish()
    }
}

/// What a lease TTL becomes: etcd leases are whole seconds.
pub(crate) fn ttl_secs(ttl: Duration) -> i64 {
    (ttl.as_micros().div_ceil(1_000_000) as i64).max(1)
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
            // Server verification against the platform's roots (rustls).
            opts = opts.with_tls(etcd_client::TlsOptions::new());
        }
        if let Some((user, password)) = &config.user {
            opts = opts.with_user(user.clone(), password.clone());
        }
        let connect = Client::connect(config.endpoints.clone(), Some(opts));
        let mut client = match tokio::time::timeout(config.connect_timeout, connect).await {
            Ok(c) => c.map_err(error::map)?,
            Err(_) => return Err(error::timed_out("connecting", config.connect_timeout)),
        };
        match tokio::time::timeout(config.connect_timeout, client.status()).await {
            Ok(status) => {
                status.map_err(error::map)?;
            }
            Err(_) => return Err(error::timed_out("status", config.connect_timeout)),
        }
        Ok(EtcdLock {
            inner: Arc::new(Inner { client, config }),
        })
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
    pub(crate) async fn call<T, F, Fut>(&self, what: &str, mut op: F) -> Result<T>
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
                Ok(Err(e)) => return Err(error::map(e)),
                Err(_) => return Err(error::timed_out(what, after)),
            }
        }
    }

    /// `<prefix>\0lock\0<key>`: NUL cannot occur in keys or prefixes, so
    /// `a` and `a/b` — or prefixes `x` and `x/lock` — never overlap.
    pub(crate) fn lock_path(&self, key: &LockKey) -> Vec<u8> {
        let mut p = Vec::with_capacity(self.inner.config.prefix.len() + key.as_bytes().len() + 6);
        p.extend_from_slice(self.inner.config.prefix.as_bytes());
        p.extend_from_slice(b"\0lock\0");
        p.extend_from_slice(key.as_bytes());
        p
    }

    /// `<prefix>\0queue\0<key>\0`: the FIFO of waiters for `key`.
    pub(crate) fn queue_prefix(&self, key: &LockKey) -> Vec<u8> {
        let mut p = Vec::new();
        p.extend_from_slice(self.inner.config.prefix.as_bytes());
        p.extend_from_slice(b"\0queue\0");
        p.extend_from_slice(key.as_bytes());
        p.push(0);
        p
    }

    pub(crate) async fn grant(&self, ttl: Duration) -> Result<(i64, Duration)> {
        let r = self
            .call("lease grant", |mut c| async move {
                c.lease_grant(ttl_secs(ttl), None).await
            })
            .await?;
        // etcd raises TTLs below its minimum silently: report what was granted.
        Ok((r.id(), Duration::from_secs(r.ttl().max(1) as u64)))
    }

    /// Revokes in the background: cleanup whose outcome changes nothing.
    pub(crate) fn revoke_later(&self, lease: i64) {
        let lock = self.clone();
        tokio::spawn(async move {
            let revoke = |mut c: Client| async move { c.lease_revoke(lease).await };
            if let Err(e) = lock.call("lease revoke", revoke).await {
                tracing::debug!(lease, error = %e, "lease revoke failed; it expires on its own");
            }
        });
    }

    /// One keep-alive; returns the lease's TTL after it (≤ 0: the lease is gone).
    pub(crate) async fn keep_alive_once(&self, lease: i64) -> Result<i64> {
        let once = |mut c: Client| async move {
            let (mut keeper, mut stream) = c.lease_keep_alive(lease).await?;
            keeper.keep_alive().await?;
            let reply = stream.message().await?;
            Ok::<_, etcd_client::Error>(reply.map_or(0, |r| r.ttl()))
        };
        self.call("lease keep-alive", once).await
    }

    /// The transaction that takes a free key: create-revision 0 ⇒ put with our
    /// lease (and drop our queue entry, if any); otherwise read the holder.
    /// Returns the token (the key's create revision) or the current holder.
    pub(crate) async fn try_put(
        &self,
        path: &[u8],
        owner: &Owner,
        lease: i64,
        queue_entry: Option<&[u8]>,
    ) -> Result<std::result::Result<u64, (Option<Vec<u8>>, i64)>> {
        let mut then = vec![TxnOp::put(
            path.to_vec(),
            owner.as_str().as_bytes().to_vec(),
            Some(PutOptions::new().with_lease(lease)),
        )];
        if let Some(q) = queue_entry {
            then.push(TxnOp::delete(q.to_vec(), None));
        }
        let txn = Txn::new()
            .when([Compare::create_revision(path.to_vec(), CompareOp::Equal, 0)])
            .and_then(then)
            .or_else([TxnOp::get(path.to_vec(), None)]);
        let resp = self
            .call("acquire txn", |mut c| {
                let txn = txn.clone();
                async move { c.txn(txn).await }
            })
            .await?;
        let revision = resp.header().map_or(0, |h| h.revision());
        if resp.succeeded() {
            return Ok(Ok(revision as u64));
        }
        let holder = resp.op_responses().into_iter().find_map(|op| match op {
            TxnOpResponse::Get(g) => g.kvs().first().map(|kv| kv.value().to_vec()),
            _ => None,
        });
        Ok(Err((holder, revision)))
    }

    /// Reads the current holder row of `key`: (owner, create revision, lease).
    async fn holder(&self, key: &LockKey) -> Result<Option<(Vec<u8>, i64, i64)>> {
        let path = self.lock_path(key);
        let resp = self
            .call("get", |mut c| {
                let path = path.clone();
                async move { c.get(path, None).await }
            })
            .await?;
        Ok(resp
            .kvs()
            .first()
            .map(|kv| (kv.value().to_vec(), kv.create_revision(), kv.lease())))
    }

    /// The guard of extend/release: this exact creation, this owner.
    fn is_current(&self, lease: &Lease) -> [Compare; 2] {
        let path = self.lock_path(&lease.key);
        [
            Compare::create_revision(path.clone(), CompareOp::Equal, lease.token.get() as i64),
            Compare::value(
                path,
                CompareOp::Equal,
                lease.owner.as_str().as_bytes().to_vec(),
            ),
        ]
    }

    pub(crate) fn check_reentry(
        &self,
        key: &LockKey,
        opts: &LockOptions,
        holder: Option<&[u8]>,
    ) -> Result<()> {
        match (opts.owner(), holder) {
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
}

#[async_trait]
impl DistributedLock for EtcdLock {
    async fn try_acquire(&self, key: &LockKey, opts: &LockOptions) -> Result<Option<Lease>> {
        let owner = opts.owner_or_random();
        let sent = Instant::now();
        let (lease_id, granted) = self.grant(opts.ttl()).await?;
        match self
            .try_put(&self.lock_path(key), &owner, lease_id, None)
            .await
        {
            Ok(Ok(token)) => Ok(Some(Lease::new(
                key.clone(),
                owner,
                FencingToken::new(token),
                granted,
                sent,
            ))),
            Ok(Err((holder, _))) => {
                self.revoke_later(lease_id);
                self.check_reentry(key, opts, holder.as_deref())?;
                Ok(None)
            }
            Err(e) => {
                self.revoke_later(lease_id);
                Err(e)
            }
        }
    }

    async fn acquire(&self, key: &LockKey, opts: &LockOptions) -> Result<Lease> {
        crate::queue::acquire_fifo(self, key, opts).await
    }

    async fn extend(&self, lease: &Lease, ttl: Duration) -> Result<Lease> {
        LockOptions::validate_ttl(ttl)?;
        let lost = |why: &str| Error::lease_lost(&lease.key, lease.token, why);
        let txn = Txn::new()
            .when(self.is_current(lease))
            .and_then([TxnOp::get(self.lock_path(&lease.key), None)]);
        let resp = self
            .call("extend txn", |mut c| {
                let txn = txn.clone();
                async move { c.txn(txn).await }
            })
            .await?;
        if !resp.succeeded() {
            tracing::warn!(key = %lease.key, token = %lease.token, "extend refused: the key was deleted or re-created");
            return Err(lost("the key was deleted, expired or re-created"));
        }
        let lease_id = resp
            .op_responses()
            .into_iter()
            .find_map(|op| match op {
                TxnOpResponse::Get(g) => g.kvs().first().map(|kv| kv.lease()),
                _ => None,
            })
            .ok_or_else(|| lost("the key vanished during extend"))?;
        let sent = Instant::now();
        let ttl_left = self.keep_alive_once(lease_id).await?;
        if ttl_left <= 0 {
            return Err(lost("the etcd lease expired"));
        }
        // A keep-alive restores the lease's granted TTL; it cannot change it.
        Ok(lease.renewed(Duration::from_secs(ttl_left as u64), sent))
    }

    async fn release(&self, lease: &Lease) -> Result<ReleaseOutcome> {
        let path = self.lock_path(&lease.key);
        let txn = Txn::new()
            .when(self.is_current(lease))
            .and_then([TxnOp::get(path.clone(), None), TxnOp::delete(path, None)]);
        let resp = self
            .call("release txn", |mut c| {
                let txn = txn.clone();
                async move { c.txn(txn).await }
            })
            .await?;
        if !resp.succeeded() {
            tracing::warn!(key = %lease.key, token = %lease.token, "release of a lease that was no longer held");
            return Ok(ReleaseOutcome::NotHeld);
        }
        let lease_id = resp.op_responses().into_iter().find_map(|op| match op {
            TxnOpResponse::Get(g) => g.kvs().first().map(|kv| kv.lease()),
            _ => None,
        });
        if let Some(id) = lease_id.filter(|id| *id != 0) {
            self.revoke_later(id);
        }
        Ok(ReleaseOutcome::Released)
    }

    async fn inspect(&self, key: &LockKey) -> Result<Option<LockInfo>> {
        let Some((owner, rev, lease_id)) = self.holder(key).await? else {
            return Ok(None);
        };
        let ttl = match self
            .call("lease ttl", |mut c| async move {
                c.lease_time_to_live(lease_id, None).await
            })
            .await
        {
            Ok(r) => r.ttl().max(0) as u64,
            Err(_) => 0,
        };
        let owner = Owner::new(String::from_utf8_lossy(&owner)).unwrap_or_else(|_| Owner::random());
        Ok(Some(LockInfo::new(
            key.clone(),
            owner,
            FencingToken::new(rev as u64),
            Duration::from_secs(ttl),
            1,
        )))
    }

    async fn force_release(&self, key: &LockKey) -> Result<bool> {
        let Some((_, rev, lease_id)) = self.holder(key).await? else {
            return Ok(false);
        };
        let path = self.lock_path(key);
        let txn = Txn::new()
            .when([Compare::create_revision(
                path.clone(),
                CompareOp::Equal,
                rev,
            )])
            .and_then([TxnOp::delete(path, None)]);
        let removed = self
            .call("force release txn", |mut c| {
                let txn = txn.clone();
                async move { c.txn(txn).await }
            })
            .await?
            .succeeded();
        if removed {
            self.revoke_later(lease_id);
            tracing::warn!(key = %key, "lock force-released");
        }
        Ok(removed)
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities::none()
            .backend("etcd")
            .native_wait(true)
            .fifo(true)
            .durable(true)
            .fencing(true)
            .min_ttl(Duration::from_secs(1))
    }
}

/// Options for a prefix range read sorted by creation (used by the queue).
pub(crate) fn oldest_before(revision: i64) -> GetOptions {
    GetOptions::new()
        .with_prefix()
        .with_max_create_revision(revision - 1)
        .with_sort(
            etcd_client::SortTarget::Create,
            etcd_client::SortOrder::Descend,
        )
        .with_limit(1)
}
