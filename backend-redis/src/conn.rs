//! The connection and the settings every operation runs with, and the calls
//! that more than one operation makes over it (the acquire step, the
//! renewal): shared by the handle (`lock.rs`), the waiters (`wait.rs`) and
//! the listing (`list.rs`).

use std::{
    future::Future,
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc, Mutex, OnceLock, RwLock,
    },
    time::Duration,
};

use fenced_api::{
    Error, FencingToken, Label, Lease, LockKey, LockOptions, Owner, ReleaseOutcome, Result,
};
use redis::{
    aio::{ConnectionManager, ConnectionManagerConfig},
    sentinel::SentinelClient,
};
use tokio::time::Instant;

use crate::{
    config::RedisConfig,
    error,
    keys::Keys,
    scripts::{self, millis_ceil, AcquireArgs, Attempt, Queued},
};

/// One client's connection (a RESP3 [`ConnectionManager`] that reconnects on
/// its own) and its configuration. Cheap to clone: clones share the
/// connection, and a switch to a new primary (Sentinel) reaches them all.
#[derive(Clone)]
pub(crate) struct Conn {
    shared: Arc<Shared>,
}

struct Shared {
    /// Replaced only when Sentinel names another primary.
    manager: RwLock<ConnectionManager>,
    /// How many times it was replaced.
    generation: AtomicU64,
    config: RedisConfig,
    follow: Option<Follow>,
}

/// Following a primary that Sentinel manages.
pub(crate) struct Follow {
    /// Asks the sentinels for the primary; one lookup at a time.
    sentinel: tokio::sync::Mutex<SentinelClient>,
    /// The primary's address the connection goes to.
    primary: Mutex<String>,
    /// For the connection to a new primary (same push sender).
    manager_config: ConnectionManagerConfig,
    /// Run after a switch (the router wakes its waiters).
    on_switch: OnceLock<Box<dyn Fn() + Send + Sync>>,
}

impl Follow {
    pub(crate) fn new(
        sentinel: SentinelClient,
        primary: String,
        manager_config: ConnectionManagerConfig,
    ) -> Self {
        Follow {
            sentinel: tokio::sync::Mutex::new(sentinel),
            primary: Mutex::new(primary),
            manager_config,
            on_switch: OnceLock::new(),
        }
    }
}

impl Conn {
    pub(crate) fn new(
        manager: ConnectionManager,
        config: RedisConfig,
        follow: Option<Follow>,
    ) -> Self {
        Conn {
            shared: Arc::new(Shared {
                manager: RwLock::new(manager),
                generation: AtomicU64::new(0),
                config,
                follow,
            }),
        }
    }

    pub(crate) fn config(&self) -> &RedisConfig {
        &self.shared.config
    }

    /// A handle on the connection, for one call.
    pub(crate) fn manager(&self) -> ConnectionManager {
        self.manager_and_generation().0
    }

    /// The connection and how many times it was replaced, read together.
    pub(crate) fn manager_and_generation(&self) -> (ConnectionManager, u64) {
        let m = self
            .shared
            .manager
            .read()
            .unwrap_or_else(|p| p.into_inner());
        (m.clone(), self.shared.generation.load(Ordering::Acquire))
    }

    /// How many times the connection was replaced by one to a new primary.
    pub(crate) fn generation(&self) -> u64 {
        self.shared.generation.load(Ordering::Acquire)
    }

    /// Sets what runs after a switch to a new primary (once).
    pub(crate) fn on_switch(&self, f: impl Fn() + Send + Sync + 'static) {
        if let Some(follow) = &self.shared.follow {
            let _ = follow.on_switch.set(Box::new(f));
        }
    }

    /// The Redis names of `key` under this client's prefix.
    pub(crate) fn keys(&self, key: &LockKey) -> Keys {
        Keys::new(&self.shared.config.prefix, key)
    }

    /// The bound on one call.
    pub(crate) fn timeout(&self) -> Duration {
        self.shared.config.operation_timeout
    }

    /// Runs one round trip within the operation timeout. Following Sentinel,
    /// a failure that a failover explains (the server unreachable or silent,
    /// no longer the primary) sends this client to ask the sentinels for the
    /// primary, and switches to it if it moved; the error still goes back to
    /// the caller, who tries again.
    pub(crate) async fn bounded<T>(
        &self,
        what: &str,
        call: impl Future<Output = redis::RedisResult<T>>,
    ) -> Result<T> {
        let config = &self.shared.config;
        let following = self.shared.follow.is_some();
        let res = error::bounded(self.timeout(), what, &config.display_url, following, call).await;
        if following && res.as_ref().is_err_and(Error::is_retryable) {
            self.follow_primary().await;
        }
        res
    }

    /// Asks the sentinels where the primary is and, if it moved, replaces
    /// the connection with one to it (bounded by the connect timeout; a
    /// lookup already under way is not repeated).
    async fn follow_primary(&self) {
        let Some(follow) = &self.shared.follow else {
            return;
        };
        let Ok(mut sentinel) = follow.sentinel.try_lock() else {
            return;
        };
        let client = match ask_sentinels(&mut sentinel, &self.shared.config).await {
            Ok(client) => client,
            Err(e) => {
                tracing::debug!(error = %e, "asking the sentinels for the primary failed");
                return;
            }
        };
        let addr = client.get_connection_info().addr().to_string();
        {
            let mut primary = follow.primary.lock().unwrap_or_else(|p| p.into_inner());
            if *primary == addr {
                return;
            }
            let manager = match ConnectionManager::new_lazy_with_config(
                client,
                follow.manager_config.clone(),
            ) {
                Ok(m) => m,
                Err(e) => {
                    tracing::warn!(primary = %addr, error = %e, "cannot set up a connection to the new primary");
                    return;
                }
            };
            tracing::warn!(from = %primary, to = %addr, "Sentinel names a new primary: switching to it");
            // The generation moves under the write guard, so a reader never
            // sees the new connection with the old generation.
            let mut current = self
                .shared
                .manager
                .write()
                .unwrap_or_else(|p| p.into_inner());
            *current = manager;
            self.shared.generation.fetch_add(1, Ordering::AcqRel);
            drop(current);
            *primary = addr;
        }
        if let Some(f) = follow.on_switch.get() {
            f();
        }
    }

    /// One run of the acquire script; `queued` queues the caller when busy.
    pub(crate) async fn attempt(
        &self,
        keys: &Keys,
        opts: &LockOptions,
        owner: &Owner,
        queued: Option<Queued<'_>>,
    ) -> Result<Attempt> {
        let args = AcquireArgs {
            owner: owner.as_str(),
            label: opts.label().map_or("", Label::as_str),
            ttl_ms: millis_ceil(opts.ttl()),
            reentrant: opts.is_reentrant(),
            queued,
        };
        let mut conn = self.manager();
        let reply = self
            .bounded(
                "the acquire script",
                scripts::acquire(&mut conn, keys, &args),
            )
            .await?;
        scripts::parse_acquire(reply)
    }

    /// Renews `lease` for `ttl` (rounded up to whole milliseconds) if it is
    /// still current: [`DistributedLock::extend`](fenced_api::DistributedLock::extend).
    pub(crate) async fn extend(&self, lease: &Lease, ttl: Duration) -> Result<Lease> {
        let ttl = Duration::from_millis(millis_ceil(LockOptions::validate_ttl(ttl)?));
        let keys = self.keys(&lease.key);
        let mut conn = self.manager();
        let sent = Instant::now();
        let extended: i64 = self
            .bounded(
                "the extend script",
                scripts::EXTEND
                    .key(&keys.lock)
                    .arg(lease.owner.as_str())
                    .arg(lease.token.get())
                    .arg(millis_ceil(ttl))
                    .invoke_async(&mut conn),
            )
            .await?;
        if extended == 1 {
            tracing::trace!(key = %lease.key, token = %lease.token, "renewed");
            // Extended on the primary either way; short of replicas, the
            // caller hears of it and renews again (a watchdog retries).
            self.replicated(&lease.key, "renewal").await?;
            Ok(lease.renewed(ttl, sent))
        } else {
            Err(Error::lease_lost(
                &lease.key,
                lease.token,
                "redis no longer has this lease (expired, released, force-released, or lost in a restart)",
            ))
        }
    }
}

impl Conn {
    /// Gives `lease` back (the release script): the next live waiter gets
    /// the key.
    pub(crate) async fn release(&self, lease: &Lease) -> Result<ReleaseOutcome> {
        let keys = self.keys(&lease.key);
        let mut manager = self.manager();
        let reply = self
            .bounded(
                "the release script",
                scripts::RELEASE
                    .key(&keys.lock)
                    .key(&keys.queue)
                    .arg(lease.owner.as_str())
                    .arg(lease.token.get())
                    .invoke_async(&mut manager),
            )
            .await?;
        Ok(match scripts::parse_release(reply)? {
            Some(0) => ReleaseOutcome::Released,
            Some(remaining) => ReleaseOutcome::StillHeld { remaining },
            None => ReleaseOutcome::NotHeld,
        })
    }

    /// With `min_replicas` ≥ 1: waits (`WAIT`) until that many replicas
    /// acknowledged every write this connection made so far — `what` among
    /// them — or the replica timeout passed; fewer is a retryable error.
    ///
    /// `WAIT` counts the writes of the connection it is sent on, and every
    /// command of this client shares one connection in order, so the write
    /// it is about (sent before) is covered. While it waits, the server
    /// answers nothing else on that connection: at most the replica timeout.
    pub(crate) async fn replicated(&self, key: &LockKey, what: &str) -> Result<()> {
        let n = self.shared.config.min_replicas;
        if n == 0 {
            return Ok(());
        }
        let wait = self.shared.config.replica_timeout;
        let mut manager = self.manager();
        let acked: i64 = self
            .bounded(
                "WAIT",
                redis::cmd("WAIT")
                    .arg(n)
                    .arg(millis_ceil(wait))
                    .query_async(&mut manager),
            )
            .await?;
        if acked >= i64::from(n) {
            return Ok(());
        }
        tracing::warn!(key = %key, acked, min_replicas = n, "too few replicas acknowledged a {what}");
        Err(Error::backend(
            error::BACKEND,
            true,
            format!(
                "only {acked} of the {n} replicas asked for (min_replicas) acknowledged the {what} \
                 of `{key}` within {wait:?} at {}",
                self.shared.config.display_url
            ),
        ))
    }

    /// [`replicated`](Self::replicated) for a fresh grant: one that fell short
    /// is given back (best effort: otherwise it lapses after its TTL) before
    /// the error is returned, so the caller holds nothing it was not told of.
    pub(crate) async fn replicated_grant(&self, lease: &Lease) -> Result<()> {
        let Err(e) = self.replicated(&lease.key, "grant").await else {
            return Ok(());
        };
        if let Err(release) = self.release(lease).await {
            tracing::warn!(key = %lease.key, token = %lease.token, error = %release, "giving back a grant too few replicas acknowledged failed; it lapses after its TTL");
        }
        Err(e)
    }
}

/// The current primary as the sentinels name it (`ROLE`-checked), within
/// the connect timeout: at connect and after a failure a failover explains.
pub(crate) async fn ask_sentinels(
    sentinel: &mut SentinelClient,
    config: &RedisConfig,
) -> Result<redis::Client> {
    let limit = config.connect_timeout;
    match tokio::time::timeout(limit, sentinel.async_get_client()).await {
        Ok(Ok(client)) => Ok(client),
        Ok(Err(e)) => Err(error::map(e).connecting(&config.display_url)),
        Err(_) => Err(Error::backend(
            error::BACKEND,
            true,
            format!(
                "no sentinel of {} named the primary within {limit:?}",
                config.display_url
            ),
        )),
    }
}

/// The lease for a grant whose request was sent at `sent`.
pub(crate) fn granted(
    key: &LockKey,
    owner: Owner,
    token: FencingToken,
    opts: &LockOptions,
    sent: Instant,
) -> Lease {
    let ttl = Duration::from_millis(millis_ceil(opts.ttl()));
    tracing::debug!(key = %key, token = %token, ttl_ms = ttl.as_millis() as u64, "acquired");
    Lease::new(key.clone(), owner, token, ttl, sent)
}
