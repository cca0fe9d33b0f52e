//! The connection and the settings every operation runs with, and the calls
//! that more than one operation makes over it (the acquire step, the
//! renewal): shared by the handle (`lock.rs`), the waiters (`wait.rs`) and
//! the listing (`list.rs`).

use std::{future::Future, sync::Arc, time::Duration};

use fenced_api::{
    Error, FencingToken, Label, Lease, LockKey, LockOptions, Owner, ReleaseOutcome, Result,
};
use redis::aio::ConnectionManager;
use tokio::time::Instant;

use crate::{
    config::RedisConfig,
    error,
    keys::Keys,
    scripts::{self, millis_ceil, AcquireArgs, Attempt, Queued},
};

/// One client's connection (a RESP3 [`ConnectionManager`] that reconnects on
/// its own) and its configuration. Cheap to clone.
#[derive(Clone)]
pub(crate) struct Conn {
    manager: ConnectionManager,
    config: Arc<RedisConfig>,
}

impl Conn {
    pub(crate) fn new(manager: ConnectionManager, config: RedisConfig) -> Self {
        Conn {
            manager,
            config: Arc::new(config),
        }
    }

    pub(crate) fn config(&self) -> &RedisConfig {
        &self.config
    }

    /// A handle on the connection, for one call.
    pub(crate) fn manager(&self) -> ConnectionManager {
        self.manager.clone()
    }

    /// The Redis names of `key` under this client's prefix.
    pub(crate) fn keys(&self, key: &LockKey) -> Keys {
        Keys::new(&self.config.prefix, key)
    }

    /// The bound on one call.
    pub(crate) fn timeout(&self) -> Duration {
        self.config.operation_timeout
    }

    /// Runs one round trip within the operation timeout.
    pub(crate) async fn bounded<T>(
        &self,
        what: &str,
        call: impl Future<Output = redis::RedisResult<T>>,
    ) -> Result<T> {
        error::bounded(self.timeout(), what, &self.config.display_url, call).await
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
        let n = self.config.min_replicas;
        if n == 0 {
            return Ok(());
        }
        let wait = self.config.replica_timeout;
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
                self.config.display_url
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
