//! `EtcdLock`: the handle, its builder, and the `DistributedLock`
//! implementation — locks on session leases, the create revision as token.

use std::{fmt, sync::Arc, time::Duration};

use async_trait::async_trait;
use etcd_client::{Compare, CompareOp, PutOptions, Txn, TxnOp};
use fenced_api::{
    deadlines::ReaperTask, permits::LineSemaphores, Capabilities, DistributedLock, Error, Lease,
    LockInfo, LockKey, LockOptions, ReleaseOutcome, Result, WaitPolicy,
};
use tokio::time::Instant;

use crate::{
    batch::Batches,
    client::{first_kv, revision, Etcd},
    config::EtcdConfig,
    entry, error,
    hold::Holds,
    keys::{oldest, Keys},
    list,
    permits::{EtcdPermits, Shared},
    session::{RefreshError, Sessions},
    track::{self, Tracker},
    wait::{self, Attempt, Parts, WatchHub},
};

/// A lock store on etcd. Cheap to clone: clones share one gRPC channel, the
/// session leases, the reaper and the watch stream (one *client*).
///
/// See the [crate docs](crate) for the design.
#[derive(Clone)]
pub struct EtcdLock {
    inner: Arc<Inner>,
}

struct Inner {
    config: EtcdConfig,
    etcd: Etcd,
    keys: Keys,
    sessions: Arc<Sessions>,
    tracker: Arc<Tracker>,
    batches: Arc<Batches>,
    watches: WatchHub,
    permits: EtcdPermits,
    /// Shared with the semaphores, which keep it running after the lock
    /// handles are gone. Locks still held when the last handle goes expire
    /// with their session leases, which nothing refreshes then: one TTL
    /// after the last use.
    _reaper: Arc<ReaperTask>,
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

/// Builds an [`EtcdLock`]: from a URL, then adjusted. Everything is
/// validated before anything is connected.
#[derive(Debug, Clone)]
#[must_use]
pub struct EtcdLockBuilder {
    config: EtcdConfig,
}

impl EtcdLockBuilder {
    /// Starts from a URL (see [`EtcdConfig::from_url`]).
    ///
    /// # Errors
    ///
    /// [`Error::Config`] for a malformed URL.
    pub fn from_url(url: &str) -> Result<Self> {
        Ok(EtcdLockBuilder {
            config: EtcdConfig::from_url(url)?,
        })
    }

    /// The key prefix — the namespace: two prefixes never see each other's
    /// locks (1 to 128 bytes, no control characters).
    pub fn prefix(mut self, prefix: impl Into<String>) -> Self {
        self.config.prefix = prefix.into();
        self
    }

    /// Bound on connecting (default 5 s; above zero, at most 1 h).
    pub fn connect_timeout(mut self, d: Duration) -> Self {
        self.config.connect_timeout = d;
        self
    }

    /// Bound on each request (default 5 s; above zero, at most 1 h).
    pub fn operation_timeout(mut self, d: Duration) -> Self {
        self.config.operation_timeout = d;
        self
    }

    /// Connects and checks that a member answers.
    ///
    /// # Errors
    ///
    /// [`Error::Config`] for an invalid setting (nothing is connected then);
    /// [`Error::Backend`] (retryable) when no member answers within the
    /// connect timeout.
    pub async fn connect(self) -> Result<EtcdLock> {
        self.config.validate()?;
        EtcdLock::connect_with(self.config).await
    }
}

impl EtcdLock {
    /// A builder from a URL.
    ///
    /// # Errors
    ///
    /// [`Error::Config`] for a malformed URL.
    pub fn builder(url: &str) -> Result<EtcdLockBuilder> {
        EtcdLockBuilder::from_url(url)
    }

    /// Connects to the endpoints of `url` (see [`EtcdConfig::from_url`]) and
    /// checks that a member answers.
    ///
    /// # Errors
    ///
    /// As [`EtcdLockBuilder::connect`].
    pub async fn connect(url: &str) -> Result<EtcdLock> {
        EtcdLock::builder(url)?.connect().await
    }

    /// Connects with an explicit configuration.
    ///
    /// # Errors
    ///
    /// As [`connect`](Self::connect).
    pub async fn connect_with(config: EtcdConfig) -> Result<EtcdLock> {
        let etcd = Etcd::connect(&config).await?;
        let tracker = Arc::new(track::tracker());
        let batches = Arc::new(Batches::new(etcd.clone()));
        let reaper = ReaperTask::spawn(track::reaper(
            Arc::clone(&tracker),
            Arc::downgrade(&batches),
        ));
        let keys = Keys::new(&config.prefix);
        let sessions = Arc::new(Sessions::new(etcd.clone(), Arc::clone(&tracker)));
        let scope = format!(
            "etcd:{}#{}#permits",
            config.endpoints().join(","),
            config.prefix()
        );
        let permits = EtcdPermits::new(
            Shared {
                etcd: &etcd,
                keys: &keys,
                sessions: &sessions,
                tracker: &tracker,
                batches: &batches,
                reaper: &reaper,
            },
            scope,
            capabilities(),
        );
        let inner = Inner {
            keys,
            config,
            sessions,
            tracker,
            batches,
            watches: WatchHub::new(etcd.clone()),
            permits,
            etcd,
            _reaper: reaper,
        };
        Ok(EtcdLock {
            inner: Arc::new(inner),
        })
    }

    /// The configuration (password redacted in `Debug`).
    pub fn config(&self) -> &EtcdConfig {
        &self.inner.config
    }

    /// What waiting uses of this client.
    fn parts(&self) -> Parts<'_> {
        let inner = &self.inner;
        Parts {
            etcd: &inner.etcd,
            keys: &inner.keys,
            sessions: &inner.sessions,
            tracker: &inner.tracker,
            watches: &inner.watches,
        }
    }

    /// The entry of a lease's owner in the line of its key.
    fn entry_of(&self, lease: &Lease) -> Vec<u8> {
        self.inner
            .keys
            .entry(&lease.key, lease.owner.as_str().as_bytes())
    }

    /// The holder of `key` — the oldest entry of its line: (value, token,
    /// lease); the value is decoded by [`entry`].
    async fn holder(&self, key: &LockKey) -> Result<Option<(Vec<u8>, i64, i64)>> {
        let line = self.inner.keys.line(key);
        let resp = self
            .inner
            .etcd
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

    /// What extend and release use.
    fn holds(&self) -> Holds<'_> {
        let inner = &self.inner;
        Holds {
            sessions: &inner.sessions,
            tracker: &inner.tracker,
            batches: &inner.batches,
        }
    }
}

#[async_trait]
impl DistributedLock for EtcdLock {
    async fn try_acquire(&self, key: &LockKey, opts: &LockOptions) -> Result<Option<Lease>> {
        let inner = &self.inner;
        let owner = opts.owner_or_random();
        let line = inner.keys.line(key);
        let value = entry::value(&owner, opts.label());
        let entry = inner.keys.entry(key, owner.as_str().as_bytes());
        for _ in 0..2 {
            let (class, view) = inner.sessions.session(opts.ttl()).await?;
            let attempt = Attempt::new(
                self.parts(),
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
            let sent = inner.sessions.txn_on(&class, view, "acquire txn", txn);
            let Some((resp, fresh)) = sent.await? else {
                attempt.disarm();
                continue;
            };
            if !resp.succeeded() {
                attempt.disarm();
                let holder = first_kv(&resp).map(|kv| kv.value().to_vec());
                entry::check_reentry(key, opts, holder.as_deref())?;
                return Ok(None);
            }
            match fresh {
                Ok(v) => {
                    attempt.disarm();
                    let token = revision(&resp);
                    return Ok(Some(inner.sessions.hold(entry, key, owner, token, v)));
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
        if opts.wait() == WaitPolicy::NoWait {
            let start = Instant::now();
            return self.try_acquire(key, opts).await?.ok_or(Error::Timeout {
                key: key.clone(),
                waited: start.elapsed(),
            });
        }
        wait::acquire(self.parts(), key, opts).await
    }

    async fn extend(&self, lease: &Lease, ttl: Duration) -> Result<Lease> {
        self.holds().extend(self.entry_of(lease), lease, ttl).await
    }

    /// Deleting the holder's entry hands the lock to the next in line.
    async fn release(&self, lease: &Lease) -> Result<ReleaseOutcome> {
        self.holds().release(self.entry_of(lease), lease).await
    }

    async fn inspect(&self, key: &LockKey) -> Result<Option<LockInfo>> {
        let Some((value, rev, lease_id)) = self.holder(key).await? else {
            return Ok(None);
        };
        // The store knows the session lease's TTL: the key is gone by then
        // unless its client refreshes it. A lock held through this client
        // also has its own, possibly earlier, deadline.
        let inner = &self.inner;
        let ttl = list::lease_ttl(&inner.etcd, lease_id).await;
        let info = list::info(&inner.keys, &inner.tracker, key.clone(), &value, rev, ttl);
        Ok(Some(info))
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
        let inner = &self.inner;
        list::list(&inner.etcd, &inner.keys, &inner.tracker, limit).await
    }

    async fn force_release(&self, key: &LockKey) -> Result<bool> {
        let Some((value, rev, _)) = self.holder(key).await? else {
            return Ok(false);
        };
        // The session lease is shared: never revoke it; delete the holder's
        // entry (the next in line then holds).
        let entry = self.inner.keys.entry(key, entry::owner_bytes(&value));
        let txn = Txn::new()
            .when([Compare::create_revision(
                entry.clone(),
                CompareOp::Equal,
                rev,
            )])
            .and_then([TxnOp::delete(entry, None)]);
        let removed = self
            .inner
            .etcd
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
        capabilities()
    }

    /// Semaphores and reader-writer locks in lines of their own (see the
    /// crate docs): FIFO, tokens from create revisions, waiting by polling.
    fn semaphores(&self) -> Option<Arc<dyn fenced_api::SemaphoreStore>> {
        Some(Arc::new(LineSemaphores::new(self.inner.permits.clone())))
    }
}

fn capabilities() -> Capabilities {
    Capabilities::none()
        .backend("etcd")
        .native_wait(true)
        .fifo(true)
        .durable(true)
        .fencing(true)
        .min_ttl(Duration::from_secs(2))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_builder_keeps_what_it_is_given() {
        let b = EtcdLock::builder("etcd://h1,h2:2380/from-url?timeout=7s")
            .unwrap()
            .prefix("billing")
            .connect_timeout(Duration::from_millis(1500))
            .operation_timeout(Duration::from_secs(2));
        assert_eq!(b.config.prefix(), "billing");
        assert_eq!(b.config.endpoints(), ["http://h1:2379", "http://h2:2380"]);
        assert_eq!(b.config.connect_timeout, Duration::from_millis(1500));
        assert_eq!(b.config.operation_timeout, Duration::from_secs(2));
        assert!(b.config.validate().is_ok());
    }

    /// Nothing listens on port 1: a builder that tried to connect before
    /// checking would answer with a (retryable) connection error, after the
    /// connect timeout.
    #[tokio::test]
    async fn the_builder_checks_everything_before_connecting() {
        let url = "etcd://127.0.0.1:1/p?connect_timeout=10s";
        let b = || EtcdLock::builder(url).unwrap();
        let started = Instant::now();
        for (builder, says) in [
            (b().prefix(""), "prefix"),
            (b().prefix("a\nb"), "prefix"),
            (b().prefix("x".repeat(129)), "prefix"),
            (b().connect_timeout(Duration::ZERO), "connect_timeout"),
            (b().operation_timeout(Duration::ZERO), "operation_timeout"),
            (
                b().operation_timeout(Duration::from_secs(7200)),
                "operation_timeout",
            ),
        ] {
            let what = format!("{builder:?}");
            match builder.connect().await {
                Err(e @ Error::Config { .. }) => {
                    assert!(e.to_string().contains(says), "{what}: {e}")
                }
                other => panic!("{what}: {other:?}"),
            }
        }
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "nothing was connected: {:?}",
            started.elapsed()
        );
    }
}
