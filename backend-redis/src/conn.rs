//! The connection and the settings every operation runs with, and the calls
//! that more than one operation makes over it (the acquire step, the
//! renewal): shared by the handle (`lock.rs`), the waiters (`wait.rs`) and
//! the listing (`list.rs`).

use std::{future::Future, sync::Arc, time::Duration};

use fenced_api::{Error, FencingToken, Label, Lease, LockKey, LockOptions, Owner, Result};
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
