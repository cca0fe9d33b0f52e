//! `RedisLock`: the handle, its builder, and the `DistributedLock` implementation.

use std::{fmt, sync::Arc, time::Duration};

use async_trait::async_trait;
use fenced_api::{
    batch::{ChunkVerdict, ExtendChunk},
    url::check_duration,
    Capabilities, DistributedLock, Error, Lease, LockInfo, LockKey, LockOptions, ReleaseOutcome,
    Result,
};
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use tokio::time::Instant;

use crate::{
    config::{check_recheck, ClusterSettings, Prefix, RedisConfig},
    conn::{granted, Conn, Link},
    error::{self, BACKEND},
    list,
    permits::RedisPermits,
    persistence::{self, Persistence},
    scripts::{self, Attempt},
    sentinel::Follow,
    wait::{self, Router},
};

/// A lock store on one Redis server, the primary Sentinel names, or a Redis
/// Cluster.
///
/// Every instance has its own connection — a RESP3 [`ConnectionManager`]
/// (one server) or cluster connection (a connection per node) that
/// reconnects on its own and carries both the scripts and the release
/// subscriptions — so two instances behave like two nodes. Clones share it.
/// See the [crate docs](crate) for the design and its limits.
#[derive(Clone)]
pub struct RedisLock {
    inner: Arc<Inner>,
}

struct Inner {
    conn: Conn,
    router: Arc<Router>,
    persistence: Persistence,
    permits: RedisPermits,
}

impl fmt::Debug for RedisLock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisLock")
            .field("config", self.config())
            .field("persistence", &self.inner.persistence)
            .finish()
    }
}

/// Builds a [`RedisLock`]: from a URL, then adjusted.
#[derive(Debug, Clone)]
#[must_use]
pub struct RedisLockBuilder {
    config: RedisConfig,
    prefix: Option<String>,
}

impl RedisLockBuilder {
    /// Starts from a URL (see [`RedisConfig::from_url`]).
    ///
    /// # Errors
    ///
    /// [`Error::Config`] for a malformed URL.
    pub fn from_url(url: &str) -> Result<Self> {
        Ok(RedisLockBuilder {
            config: RedisConfig::from_url(url)?,
            prefix: None,
        })
    }

    /// The key prefix — the namespace: two prefixes never see each other's
    /// locks (see [`Prefix`] for the rules).
    pub fn prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = Some(prefix.into());
        self
    }

    /// Bound on connecting (default 5 s).
    pub fn connect_timeout(mut self, d: Duration) -> Self {
        self.config.connect_timeout = d;
        self
    }

    /// Bound on each command's reply (default 5 s).
    pub fn operation_timeout(mut self, d: Duration) -> Self {
        self.config.operation_timeout = d;
        self
    }

    /// Longest sleep of a waiter between two checks when no hand-over message
    /// reaches it (default 1 s; 10 ms to 10 s). Each check refreshes the
    /// waiter's place in the queue, which lapses after three missed checks
    /// plus a second.
    pub fn recheck_interval(mut self, d: Duration) -> Self {
        self.config.recheck_interval = d;
        self
    }

    /// Replicas that must acknowledge every grant and renewal (default 0:
    /// none; at most [`MAX_MIN_REPLICAS`](crate::MAX_MIN_REPLICAS)): after
    /// each, the client sends `WAIT n replica_timeout` (in a Redis Cluster,
    /// in one pipeline with the write, counting the replicas of the key's
    /// shard); a grant that fewer
    /// acknowledged is given back and reported as a retryable
    /// [`Error::Backend`], a renewal as a retryable error while the lease
    /// stays extended on the primary. See "Replicas" in the crate docs for
    /// what this does and does not protect against.
    pub fn min_replicas(mut self, n: u32) -> Self {
        self.config.min_replicas = n;
        self
    }

    /// How long a grant or renewal waits for its replicas (default 50 ms;
    /// from 1 ms, below the operation timeout).
    pub fn replica_timeout(mut self, d: Duration) -> Self {
        self.config.replica_timeout = d;
        self
    }

    fn validated(mut self) -> Result<RedisConfig> {
        if let Some(p) = self.prefix.take() {
            self.config.prefix = Prefix::new(&p)?;
        }
        let c = &self.config;
        check_duration("connect_timeout", c.connect_timeout)?;
        check_duration("operation_timeout", c.operation_timeout)?;
        check_recheck(c.recheck_interval)?;
        c.check_replicas()?;
        Ok(self.config)
    }

    /// Connects and reads the server's persistence settings.
    ///
    /// # Errors
    ///
    /// * [`Error::Config`] for invalid settings or a server without RESP3.
    /// * [`Error::Backend`] (retryable) when the server cannot be reached
    ///   within the connect timeout.
    pub async fn connect(self) -> Result<RedisLock> {
        let config = self.validated()?;
        #[cfg(feature = "tls")]
        if config.tls {
            // Picks ring for rustls unless the application installed a provider.
            let _ = rustls::crypto::ring::default_provider().install_default();
        }
        let router = Arc::new(Router::new(
            &config.prefix,
            uuid::Uuid::new_v4().simple().to_string(),
            config.cluster.is_some(),
        ));
        let weak = Arc::downgrade(&router);
        let push = move |info: redis::PushInfo| {
            if let Some(router) = weak.upgrade() {
                router.on_push(info);
            }
            Ok::<(), ()>(())
        };
        let (link, client, follow) = match &config.cluster {
            Some(cluster) => (connect_cluster(&config, cluster, push).await?, None, None),
            None => {
                let (manager, client, follow) = connect_single(&config, push).await?;
                (Link::Single(manager), Some(client), follow)
            }
        };
        // On one server the first command opens the connection: bounded by
        // the connect timeout plus one short round trip, so an unreachable
        // or silent server fails within about the connect timeout.
        let persistence = persistence::probe_primaries(
            &link,
            config.connect_timeout + config.operation_timeout.min(Duration::from_millis(500)),
            &config.display_url,
        )
        .await
        .map_err(|e| e.connecting(&config.display_url))?;
        tracing::debug!(server = %config.display_url, prefix = %config.prefix, %persistence, "connected");
        let conn = Conn::new(link, client, config, follow);
        router.attach(conn.clone());
        // After a switch to a new primary every waiter looks again (and
        // subscribes there).
        let weak = Arc::downgrade(&router);
        conn.on_switch(move || {
            if let Some(router) = weak.upgrade() {
                router.wake_all();
            }
        });
        let permits = RedisPermits::new(conn.clone(), capabilities_for(&persistence));
        Ok(RedisLock {
            inner: Arc::new(Inner {
                conn,
                router,
                persistence,
                permits,
            }),
        })
    }
}

/// The connection to one server: the one in the URL, or the primary the
/// sentinels name (then with what it takes to follow a failover).
async fn connect_single(
    config: &RedisConfig,
    push: impl Fn(redis::PushInfo) -> std::result::Result<(), ()> + Send + Sync + 'static,
) -> Result<(ConnectionManager, redis::Client, Option<Follow>)> {
    // Through Sentinel: the sentinels name the primary first.
    let (client, named) = match &config.sentinel {
        Some(_) => {
            let found = crate::sentinel::ask_sentinels(config).await?;
            (found.client, Some(found.named))
        }
        None => {
            let client = redis::Client::open((*config.connection).clone()).map_err(|e| {
                Error::config(format!(
                    "invalid redis settings for {}: {e}",
                    config.display_url
                ))
            })?;
            (client, None)
        }
    };
    let manager = ConnectionManagerConfig::new()
        .set_connection_timeout(Some(config.connect_timeout))
        .set_response_timeout(Some(config.operation_timeout))
        // One quick retry per reconnect; each operation is bounded anyway,
        // and the next one triggers a new attempt.
        .set_number_of_retries(1)
        .set_min_delay(Duration::from_millis(50))
        .set_max_delay(Duration::from_millis(500))
        .set_push_sender(push)
        .set_automatic_resubscription();
    let follow = named.map(|primary| Follow::new(primary, manager.clone()));
    let manager =
        ConnectionManager::new_lazy_with_config(client.clone(), manager).map_err(error::map)?;
    Ok((manager, client, follow))
}

/// The connection to a Redis Cluster: the seed nodes name the others and
/// which slots each serves (within the connect timeout).
async fn connect_cluster(
    config: &RedisConfig,
    cluster: &ClusterSettings,
    push: impl Fn(redis::PushInfo) -> std::result::Result<(), ()> + Send + Sync + 'static,
) -> Result<Link> {
    // `[v6]` in a URL, a bare address to connect to and to match the
    // addresses nodes announce.
    let bare = |h: &str| h.trim_start_matches('[').trim_end_matches(']').to_owned();
    // The seeds speak TLS as the URL says (`rediss+cluster://`,
    // `#insecure`); the cluster client takes the TLS mode for the nodes it
    // discovers from the first seed.
    let node_addr = |host: &str, port: u16| match config.connection.addr() {
        redis::ConnectionAddr::TcpTls {
            insecure,
            tls_params,
            ..
        } => redis::ConnectionAddr::TcpTls {
            host: bare(host),
            port,
            insecure: *insecure,
            tls_params: tls_params.clone(),
        },
        _ => redis::ConnectionAddr::Tcp(bare(host), port),
    };
    let nodes = cluster.nodes.iter().map(|(host, port)| {
        (*config.connection)
            .clone()
            .set_addr(node_addr(host, *port))
    });
    let map = cluster
        .address_map
        .iter()
        .map(|((fh, fp), (th, tp))| {
            (
                redis::cluster::NodeAddress::new(bare(fh), *fp),
                redis::cluster::NodeAddress::new(bare(th), *tp),
            )
        })
        .collect();
    // No retries inside the cluster connection: it would send a script
    // again after a connection broke, when the first may have run (a grant
    // taken twice, a release applied twice). A broken connection comes back
    // as a retryable error and the caller decides; a reply saying the
    // command did not run (a redirection) is sent again by `Link` itself,
    // after the slot map is rebuilt.
    let client = redis::cluster::ClusterClientBuilder::new(nodes)
        .retries(0)
        .node_address_map(map)
        .use_protocol(redis::ProtocolVersion::RESP3)
        .connection_timeout(config.connect_timeout)
        .response_timeout(config.operation_timeout)
        .push_sender(push)
        .build()
        .map_err(|e| {
            Error::config(format!(
                "invalid cluster settings for {}: {e}",
                config.display_url
            ))
        })?;
    // Two connections: the subscriptions apart from the scripts; with
    // `min_replicas`, the client opens more for writes `WAIT` confirms (see
    // `Link::Cluster`).
    let paired = config.min_replicas > 0;
    let (conn, subs, waits) = fenced_api::bounded(
        BACKEND,
        format!("connecting to {}", config.display_url),
        config.connect_timeout + config.operation_timeout.min(Duration::from_millis(500)),
        async {
            // Side by side: each learns the layout and connects to every
            // node (a TLS handshake each), within the one bound.
            let (conn, subs) =
                tokio::try_join!(client.get_async_connection(), client.get_async_connection())
                    .map_err(error::map)?;
            Ok((conn, subs, paired.then(|| Arc::new(client.clone()))))
        },
    )
    .await
    .map_err(|e| e.connecting(&config.display_url))?;
    Ok(Link::Cluster { conn, subs, waits })
}

impl RedisLock {
    /// A builder from a URL.
    ///
    /// # Errors
    ///
    /// [`Error::Config`] for a malformed URL.
    pub fn builder(url: &str) -> Result<RedisLockBuilder> {
        RedisLockBuilder::from_url(url)
    }

    /// Connects with everything taken from the URL.
    ///
    /// # Errors
    ///
    /// As [`RedisLockBuilder::connect`].
    pub async fn connect(url: &str) -> Result<RedisLock> {
        RedisLockBuilder::from_url(url)?.connect().await
    }

    /// The configuration (password redacted in `Debug`).
    pub fn config(&self) -> &RedisConfig {
        self.inner.conn.config()
    }

    /// What the server persisted when this client connected (read once, never
    /// refreshed); decides [`Capabilities::is_durable`].
    pub fn persistence(&self) -> &Persistence {
        &self.inner.persistence
    }
}

/// Leases per run of the extend script: at most twice as many keys and
/// arguments, and a script run long enough (≈ 1 µs per lease) that other
/// clients' commands, which wait for it, barely notice.
const EXTEND_CHUNK: usize = 256;

/// Batch renewals on one server: the script answers for each lease.
#[async_trait]
impl ExtendChunk for RedisLock {
    async fn extend_chunk(&self, chunk: &[&Lease], ttl: Duration) -> Result<ChunkVerdict> {
        Ok(ChunkVerdict::Each(
            self.inner.conn.extend_batch(chunk, ttl).await?,
        ))
    }
}

#[async_trait]
impl DistributedLock for RedisLock {
    async fn try_acquire(&self, key: &LockKey, opts: &LockOptions) -> Result<Option<Lease>> {
        let owner = opts.owner_or_random();
        let keys = self.inner.conn.keys(key);
        let conn = &self.inner.conn;
        let mut lane = conn.lane().await?;
        let sent = Instant::now();
        match conn
            .attempt(&mut lane, key, &keys, opts, &owner, None)
            .await?
        {
            Attempt::Granted { token, .. } => {
                let lease = granted(key, owner, token, opts, sent);
                conn.confirm_grant(&mut lane, key, || conn.give_back(&lease))
                    .await?;
                Ok(Some(lease))
            }
            Attempt::Busy { .. } => Ok(None),
            Attempt::AlreadyHeld => Err(Error::AlreadyHeld { key: key.clone() }),
            Attempt::HandedOver { .. } => Err(error::protocol(
                "the acquire script handed a lease to a plain try",
            )),
        }
    }

    /// Waits in the key's FIFO queue; a release hands the key over by
    /// message, with a bounded re-check behind it (see the crate docs).
    ///
    /// # Cancel safety
    ///
    /// Dropping the future leaves the queue and passes on a lease handed to
    /// it in the meantime (a best-effort script spawned on the current
    /// runtime; otherwise the entry lapses within seconds). A lease granted by
    /// the first, unqueued attempt racing the drop expires after its TTL.
    async fn acquire(&self, key: &LockKey, opts: &LockOptions) -> Result<Lease> {
        wait::acquire(&self.inner.conn, &self.inner.router, key, opts).await
    }

    async fn extend(&self, lease: &Lease, ttl: Duration) -> Result<Lease> {
        self.inner.conn.extend(lease, ttl).await
    }

    /// One run of the extend script per 256 leases on one
    /// server. A Redis Cluster renews one by one (up to
    /// [`EXTEND_MANY_CONCURRENCY`](fenced_api::EXTEND_MANY_CONCURRENCY) in
    /// flight): one script's keys must share a slot, and the keys of a batch
    /// rarely do.
    async fn extend_many(&self, leases: &[Lease], ttl: Duration) -> Vec<Result<Lease>> {
        if self.inner.conn.is_cluster() {
            return fenced_api::batch::extend_each(self, leases, ttl).await;
        }
        fenced_api::batch::extend_in_chunks(self, leases, ttl, EXTEND_CHUNK).await
    }

    async fn release(&self, lease: &Lease) -> Result<ReleaseOutcome> {
        let outcome = self.inner.conn.release(lease).await?;
        if outcome == ReleaseOutcome::Released {
            tracing::debug!(key = %lease.key, token = %lease.token, "released");
        }
        Ok(outcome)
    }

    async fn inspect(&self, key: &LockKey) -> Result<Option<LockInfo>> {
        let conn = &self.inner.conn;
        let keys = conn.keys(key);
        let mut manager = conn.manager();
        let reply = conn
            .bounded(
                "the inspect script",
                scripts::INSPECT.key(&keys.lock).invoke_async(&mut manager),
            )
            .await?;
        let Some(held) = scripts::parse_inspect(reply)? else {
            return Ok(None);
        };
        held.info(key, &keys.lock).map(Some)
    }

    /// The held locks under this prefix, sorted by key: `SCAN … MATCH
    /// {prefix/*}:l COUNT 1000` (never `KEYS`), each name found read with the
    /// `inspect` script (pipelined, one round trip per batch), stopping once
    /// `limit` held ones are found. Which ones come back when more are held
    /// is the order of the scan, not of the keys.
    ///
    /// Cost: `SCAN` walks the whole database's keyspace — every primary's,
    /// in a Redis Cluster — (its `MATCH` filters
    /// after the walk), so a full listing is O(keys in the database) in
    /// round trips of 1000 slots, plus one script per state key of this
    /// prefix — free keys' state is kept 7 days after their last use, so
    /// those are read too. Each round trip is bounded by the operation
    /// timeout, the listing as a whole is not. Not atomic: a lock taken or
    /// released during the scan may or may not be listed.
    async fn list(&self, limit: usize) -> Result<Vec<LockInfo>> {
        list::held(&self.inner.conn, limit).await
    }

    async fn force_release(&self, key: &LockKey) -> Result<bool> {
        let conn = &self.inner.conn;
        let keys = conn.keys(key);
        let mut manager = conn.manager();
        let removed: i64 = conn
            .bounded(
                "the force-release script",
                scripts::FORCE_RELEASE
                    .key(&keys.lock)
                    .key(&keys.queue)
                    .invoke_async(&mut manager),
            )
            .await?;
        if removed == 1 {
            tracing::warn!(key = %key, "lock force-released");
        }
        Ok(removed == 1)
    }

    fn capabilities(&self) -> Capabilities {
        capabilities_for(&self.inner.persistence)
    }

    fn semaphores(&self) -> Option<Arc<dyn fenced_api::SemaphoreStore>> {
        Some(Arc::new(fenced_api::permits::LineSemaphores::new(
            self.inner.permits.clone(),
        )))
    }
}

/// What a client on a server with `persistence` can promise.
fn capabilities_for(persistence: &Persistence) -> Capabilities {
    Capabilities::none()
        .backend(BACKEND)
        .native_wait(true)
        .fifo(true)
        .durable(persistence.is_durable())
        .fencing(true)
        .reentrant(true)
        .min_ttl(Duration::from_millis(1))
}
