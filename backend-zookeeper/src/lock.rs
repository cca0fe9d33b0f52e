//! `ZkLock`: the handle, its builder, and the `DistributedLock`
//! implementation — ephemeral sequential nodes, the creation zxid as token.

use std::{fmt, sync::Arc, time::Duration};

use async_trait::async_trait;
use fenced_api::{
    batch::{ChunkVerdict, ExtendChunk},
    deadlines::ReaperTask,
    permits::LineSemaphores,
    Capabilities, DistributedLock, Error, Lease, LockInfo, LockKey, LockOptions, ReleaseOutcome,
    Result, WaitPolicy,
};
use tokio::time::Instant;

use crate::{
    config::ZkConfig,
    entry,
    error::{self, kind, Kind},
    hold,
    keys::Keys,
    list::{self, Holder},
    permits::ZkPermits,
    queue::{Attempt, Parts, Place},
    session::{self, Sessions},
    track::{self, Node, Tracker},
    wait,
};

/// Leases per `multi` in [`DistributedLock::extend_many`]: 256 `setData`s
/// of at most a few hundred bytes each (a key is at most 255), well within
/// ZooKeeper's default 1 MiB request limit (`jute.maxbuffer`).
const EXTEND_CHUNK: usize = 256;

/// A lock store on ZooKeeper. Cheap to clone: clones share the sessions,
/// the reaper and the held-lock table (one *client*).
///
/// See the [crate docs](crate) for the design.
#[derive(Clone)]
pub struct ZkLock {
    inner: Arc<Inner>,
}

struct Inner {
    config: ZkConfig,
    keys: Keys,
    sessions: Arc<Sessions>,
    tracker: Arc<Tracker>,
    permits: ZkPermits,
    /// Shared with the semaphores, which keep it running after the lock
    /// handles are gone. Closing the sessions (when the last handle goes)
    /// deletes every node of theirs on the server.
    _reaper: Arc<ReaperTask>,
}

impl fmt::Debug for ZkLock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ZkLock")
            .field("config", &self.inner.config)
            .field("session_timeout", &self.inner.sessions.negotiated())
            .field("held", &self.inner.tracker.len())
            .finish()
    }
}

/// Builds a [`ZkLock`]: from a URL, then adjusted. Everything is
/// validated before anything is connected.
#[derive(Debug, Clone)]
#[must_use]
pub struct ZkLockBuilder {
    config: ZkConfig,
}

impl ZkLockBuilder {
    /// Starts from a URL (see [`ZkConfig::from_url`]).
    ///
    /// # Errors
    ///
    /// [`Error::Config`] for a malformed URL.
    pub fn from_url(url: &str) -> Result<Self> {
        Ok(ZkLockBuilder {
            config: ZkConfig::from_url(url)?,
        })
    }

    /// The namespace: the znode path every lock lives under (see
    /// [`ZkConfig::from_url`] for the rules).
    pub fn namespace(mut self, namespace: impl Into<String>) -> Self {
        self.config.namespace = namespace.into();
        self
    }

    /// The session timeout asked of the server (default 30 s): how long a
    /// dead client's locks may linger, and the longest TTL the base session
    /// carries (longer TTLs get a session of their own; see the crate docs).
    pub fn session_timeout(mut self, d: Duration) -> Self {
        self.config.session_timeout = d;
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

    /// Connects: establishes the session.
    ///
    /// # Errors
    ///
    /// [`Error::Config`] for an invalid setting (nothing is connected then);
    /// [`Error::Backend`] (retryable) when no server grants a session within
    /// the connect timeout.
    pub async fn connect(self) -> Result<ZkLock> {
        self.config.validate()?;
        ZkLock::connect_with(self.config).await
    }
}

impl ZkLock {
    /// A builder from a URL.
    ///
    /// # Errors
    ///
    /// [`Error::Config`] for a malformed URL.
    pub fn builder(url: &str) -> Result<ZkLockBuilder> {
        ZkLockBuilder::from_url(url)
    }

    /// Connects to the servers of `url` (see [`ZkConfig::from_url`]).
    ///
    /// # Errors
    ///
    /// As [`ZkLockBuilder::connect`].
    pub async fn connect(url: &str) -> Result<ZkLock> {
        ZkLock::builder(url)?.connect().await
    }

    /// Connects with an explicit configuration.
    ///
    /// # Errors
    ///
    /// As [`connect`](Self::connect).
    pub async fn connect_with(config: ZkConfig) -> Result<ZkLock> {
        config.validate()?;
        let tracker = Arc::new(track::tracker());
        let sessions = Arc::new(Sessions::connect(config.clone(), Arc::clone(&tracker)).await?);
        let reaper = ReaperTask::spawn(track::reaper(
            Arc::clone(&tracker),
            Arc::downgrade(&sessions),
        ));
        let keys = Keys::new(&config.namespace);
        let scope = format!(
            "zk:{}#{}#permits",
            config.hosts().join(","),
            config.namespace()
        );
        let permits = ZkPermits::new(
            Arc::clone(&sessions),
            keys.clone(),
            Arc::clone(&tracker),
            Arc::clone(&reaper),
            scope,
            capabilities(),
        );
        Ok(ZkLock {
            inner: Arc::new(Inner {
                keys,
                config,
                sessions,
                tracker,
                permits,
                _reaper: reaper,
            }),
        })
    }

    /// The configuration (password redacted in `Debug`).
    pub fn config(&self) -> &ZkConfig {
        &self.inner.config
    }

    /// The session timeout the server granted to the current base session.
    pub fn negotiated_session_timeout(&self) -> Option<Duration> {
        self.inner.sessions.negotiated()
    }

    fn parts(&self) -> Parts<'_> {
        Parts {
            sessions: &self.inner.sessions,
            keys: &self.inner.keys,
            tracker: &self.inner.tracker,
        }
    }

    /// The tracked node of `lease`: the one with its token as creation
    /// zxid, in its key's queue.
    fn tracked(&self, lease: &Lease) -> Option<(String, i64)> {
        hold::tracked_in(
            &self.inner.tracker,
            &self.inner.keys.queue(&lease.key),
            lease,
        )
    }

    /// The node of `lease` if it is still current (`None` when it is gone
    /// or belongs to another grant), read through the base session.
    async fn current(&self, lease: &Lease) -> Result<Option<Holder>> {
        let inner = &self.inner;
        let s = inner.sessions.get().await?;
        let token = lease.token.get() as i64;
        let read = match self.tracked(lease) {
            Some(node) => match s.run("get", s.client().get_data(&node.0)).await? {
                Ok((data, stat)) => Some(Holder {
                    path: node.0,
                    data,
                    stat,
                }),
                Err(e) if kind(&e) == Kind::NoNode => {
                    inner.tracker.lose(&node);
                    None
                }
                Err(e) => return Err(error::map(e)),
            },
            None => list::holder(&s, &inner.keys, &lease.key).await?,
        };
        Ok(read.filter(|h| {
            h.stat.czxid == token && entry::owner_bytes(&h.data) == lease.owner.as_str().as_bytes()
        }))
    }

    /// Extends a lease this client does not track: read its node, and
    /// rewrite its TTL (guarded by the version read) through the node's own
    /// session — the write keeps that session alive on the server at least
    /// one negotiated timeout past its send time. A node on a session of
    /// this client is tracked from then on.
    async fn extend_untracked(&self, lease: &Lease, ttl: Duration) -> Result<Lease> {
        let token = lease.token.get() as i64;
        for _ in 0..3 {
            let Some(h) = self.current(lease).await? else {
                tracing::debug!(key = %lease.key, token = %lease.token, "extend refused: the lock is gone");
                return Err(Error::lease_lost(
                    &lease.key,
                    lease.token,
                    "its node was deleted, expired or belongs to another grant",
                ));
            };
            let Some(s) = self.inner.sessions.by_id(h.stat.ephemeral_owner) else {
                return Err(Error::Unsupported {
                    backend: error::BACKEND,
                    what: "extending a ZooKeeper lock through a client other than the one \
                           whose session holds it (only that session can keep the node alive)"
                        .into(),
                });
            };
            let ttl = session::granted(ttl, s.negotiated());
            let label = entry::decode(&h.data).label;
            let fresh = entry::data(&lease.owner, ttl, label.as_ref());
            let sent = Instant::now();
            match s
                .run(
                    "set",
                    s.client().set_data(&h.path, &fresh, Some(h.stat.version)),
                )
                .await?
            {
                Ok(_) => {
                    let renewed = lease.renewed(ttl, sent);
                    let node = Node {
                        session: s.id(),
                        owner: lease.owner.clone(),
                        label,
                    };
                    self.inner
                        .tracker
                        .track((h.path, token), node, renewed.deadline);
                    return Ok(renewed);
                }
                Err(e) if kind(&e) == Kind::BadVersion => continue,
                Err(e) if kind(&e) == Kind::NoNode => continue,
                Err(e) => return Err(error::map(e)),
            }
        }
        Err(Error::backend(
            error::BACKEND,
            true,
            "the lock node changed three times during an extend",
        ))
    }
}

/// One `multi` per chunk of leases this client tracks on one session (see
/// `hold::extend_tracked_chunk`); anything else one by one.
#[async_trait]
impl ExtendChunk for ZkLock {
    async fn extend_chunk(&self, chunk: &[&Lease], ttl: Duration) -> Result<ChunkVerdict> {
        let mut nodes = Vec::with_capacity(chunk.len());
        for &lease in chunk {
            match self.tracked(lease) {
                Some(node) => nodes.push((lease, node)),
                None => return Ok(ChunkVerdict::Unknown),
            }
        }
        let inner = &self.inner;
        hold::extend_tracked_chunk(&inner.sessions, &inner.tracker, &nodes, ttl).await
    }
}

#[async_trait]
impl DistributedLock for ZkLock {
    async fn try_acquire(&self, key: &LockKey, opts: &LockOptions) -> Result<Option<Lease>> {
        let owner = opts.owner_or_random();
        let mut attempt =
            Attempt::enter(self.parts(), key, &owner, opts.ttl(), opts.label()).await?;
        let (place, sent) = attempt.place().await?;
        match place {
            Place::First => {
                let lease = attempt.grant(&self.inner.tracker, key, owner, sent);
                Ok(Some(lease.await?))
            }
            Place::Behind { holder, .. } => {
                let holder = match opts.owner() {
                    Some(_) => attempt.data_of(&holder).await?,
                    None => None,
                };
                attempt.leave();
                entry::check_reentry(key, opts, holder.as_deref())?;
                Ok(None)
            }
            Place::Gone => Err(Error::backend(
                error::BACKEND,
                true,
                "the new queue entry vanished (the session ended?)",
            )),
        }
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

    /// One write for a lock this client holds: its node's path, owner,
    /// label and session are tracked, so the TTL is rewritten without
    /// reading the node first (a node path names one grant for good: a
    /// nonce and a sequence). A lease this client does not track is read
    /// first and extended only if its node lives on one of this client's
    /// sessions.
    async fn extend(&self, lease: &Lease, ttl: Duration) -> Result<Lease> {
        LockOptions::validate_ttl(ttl)?;
        let inner = &self.inner;
        if let Some(node) = self.tracked(lease) {
            let extended =
                hold::extend_tracked(&inner.sessions, &inner.tracker, node, lease, ttl).await?;
            if let Some(renewed) = extended {
                return Ok(renewed);
            }
        }
        self.extend_untracked(lease, ttl).await
    }

    /// Up to 256 leases per `multi` of `setData`s (a
    /// `LockClient`'s renewals of many held locks): the chunks of locks this
    /// client holds on one session are one write each; the rest, and a
    /// chunk whose `multi` fails, are renewed one by one.
    async fn extend_many(&self, leases: &[Lease], ttl: Duration) -> Vec<Result<Lease>> {
        fenced_api::batch::extend_in_chunks(self, leases, ttl, EXTEND_CHUNK).await
    }

    /// One delete for a lock this client holds (its owner checked against
    /// the tracked one); a lease this client does not track is read first.
    async fn release(&self, lease: &Lease) -> Result<ReleaseOutcome> {
        let inner = &self.inner;
        let tracked = self
            .tracked(lease)
            .and_then(|node| inner.tracker.data(&node).map(|held| (node.0, held)));
        let path = match tracked {
            Some((path, held)) if held.owner == lease.owner => Some(path),
            Some(_) => None,
            None => self.current(lease).await?.map(|h| h.path),
        };
        let Some(path) = path else {
            tracing::warn!(key = %lease.key, token = %lease.token, "release of a lease that was not held");
            return Ok(ReleaseOutcome::NotHeld);
        };
        let token = lease.token.get() as i64;
        hold::delete(&inner.sessions, &inner.tracker, path, token).await
    }

    async fn inspect(&self, key: &LockKey) -> Result<Option<LockInfo>> {
        let inner = &self.inner;
        let s = inner.sessions.get().await?;
        let holder = list::holder(&s, &inner.keys, key).await?;
        Ok(holder.map(|h| list::info(&inner.tracker, key.clone(), &h)))
    }

    /// The holders under this client's namespace, first `limit` in key
    /// order: the namespace's children, then per queue its lowest entry
    /// (waiters are not listed). Token = the node's creation zxid, hold
    /// count 1.
    async fn list(&self, limit: usize) -> Result<Vec<LockInfo>> {
        let inner = &self.inner;
        let s = inner.sessions.get().await?;
        list::list(&s, &inner.keys, &inner.tracker, limit).await
    }

    async fn force_release(&self, key: &LockKey) -> Result<bool> {
        let inner = &self.inner;
        let s = inner.sessions.get().await?;
        let Some(h) = list::holder(&s, &inner.keys, key).await? else {
            return Ok(false);
        };
        let removed = match s.run("delete", s.client().delete(&h.path, None)).await? {
            Ok(()) => true,
            Err(e) if kind(&e) == Kind::NoNode => false,
            Err(e) => return Err(error::map(e)),
        };
        if removed {
            tracing::warn!(key = %key, "lock force-released");
        }
        Ok(removed)
    }

    /// Native (watch) wait, FIFO, durable, monotonic fencing (creation
    /// zxids survive restarts and leader changes).
    ///
    /// A lock's own TTL is enforced by this client's reaper while the
    /// client runs, with the session as the backstop when it dies: a lock
    /// whose holder stopped extending can outlive its deadline by up to its
    /// session's timeout if the whole client dies first.
    fn capabilities(&self) -> Capabilities {
        capabilities()
    }

    /// Semaphores and reader-writer locks in lines of their own (see the
    /// crate docs): FIFO, creation zxids as tokens, waiting by polling.
    fn semaphores(&self) -> Option<Arc<dyn fenced_api::SemaphoreStore>> {
        Some(Arc::new(LineSemaphores::new(self.inner.permits.clone())))
    }
}

fn capabilities() -> Capabilities {
    Capabilities::none()
        .backend("zookeeper")
        .native_wait(true)
        .fifo(true)
        .durable(true)
        .fencing(true)
        .min_ttl(Duration::from_secs(1))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;

    #[test]
    fn the_builder_keeps_what_it_is_given() {
        let b = ZkLock::builder("zk://h1,h2:2182/from-url?timeout=7s")
            .unwrap()
            .namespace("/billing")
            .session_timeout(Duration::from_secs(6))
            .connect_timeout(Duration::from_millis(1500))
            .operation_timeout(Duration::from_secs(2));
        assert_eq!(b.config.namespace(), "/billing");
        assert_eq!(b.config.hosts(), ["h1:2181", "h2:2182"]);
        assert_eq!(b.config.session_timeout, Duration::from_secs(6));
        assert_eq!(b.config.connect_timeout, Duration::from_millis(1500));
        assert_eq!(b.config.operation_timeout, Duration::from_secs(2));
        assert!(b.config.validate().is_ok());
    }

    /// Nothing listens on port 1: a builder that tried to connect before
    /// checking would answer with a (retryable) connection error.
    #[tokio::test]
    async fn the_builder_checks_everything_before_connecting() {
        let b = || ZkLock::builder("zk://127.0.0.1:1/p?connect_timeout=10s").unwrap();
        let started = Instant::now();
        for (builder, says) in [
            (b().namespace("/"), "namespace"),
            (b().namespace("/a//b"), "namespace"),
            (b().namespace("/zookeeper"), "namespace"),
            (b().session_timeout(Duration::ZERO), "session_timeout"),
            (b().connect_timeout(Duration::ZERO), "connect_timeout"),
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
        assert!(started.elapsed() < Duration::from_secs(5));
    }
}
