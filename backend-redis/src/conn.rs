//! The connection and the settings every operation runs with, and the calls
//! that more than one operation makes over it (the acquire step, the
//! renewal): shared by the handle (`lock.rs`), the waiters (`wait.rs`) and
//! the listing (`list.rs`). Where a write that `WAIT` confirms runs is
//! [`lane`]'s.

use std::{
    future::Future,
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc, Mutex, RwLock,
    },
    time::Duration,
};

use fenced_api::{
    Error, FencingToken, Label, Lease, LockKey, LockOptions, Owner, ReleaseOutcome, Result,
};
use redis::{
    aio::{ConnectionLike, ConnectionManager, MultiplexedConnection},
    cluster_async::ClusterConnection,
    cluster_routing::{RoutingInfo, SingleNodeRoutingInfo},
    Cmd, ErrorKind, Pipeline, RedisError, RedisFuture, RedisResult, ServerErrorKind, Value,
};
use tokio::time::Instant;

use crate::{
    config::RedisConfig,
    error,
    keys::Keys,
    scripts::{self, millis_ceil, AcquireArgs, Attempt, Queued},
    sentinel::{self, Follow},
};

mod lane;

pub(crate) use lane::Lane;

/// One client's connection (a [`Link`]) and its configuration. Cheap to
/// clone: clones share the connection, and a switch to a new primary
/// (Sentinel) reaches them all.
#[derive(Clone)]
pub(crate) struct Conn {
    shared: Arc<Shared>,
}

struct Shared {
    /// Replaced only when Sentinel names another primary.
    primary: RwLock<Primary>,
    /// How many times it was replaced.
    generation: AtomicU64,
    /// Idle connections of their own for writes that `WAIT` confirms
    /// (`min_replicas` ≥ 1; see [`Lane`]), each with the generation it was
    /// opened in.
    lanes: Mutex<Vec<(u64, MultiplexedConnection)>>,
    /// The same for a Redis Cluster: idle cluster connections for writes
    /// sent with their `WAIT`.
    cluster_lanes: Mutex<Vec<ClusterConnection>>,
    config: RedisConfig,
    follow: Option<Follow>,
}

/// The primary this client talks to: the shared connection and, for one
/// server, the client that opens more connections to it.
struct Primary {
    link: Link,
    client: Option<redis::Client>,
}

/// The connection every call goes through (but a replicated write's, see
/// [`Lane`]). Both kinds reconnect on their own and speak RESP3, so one
/// connection carries the scripts and the hand-over subscriptions.
#[derive(Clone)]
pub(crate) enum Link {
    /// One server (or the primary Sentinel names): one multiplexed
    /// connection.
    Single(ConnectionManager),
    /// A Redis Cluster: a connection per node, each command sent to the node
    /// that serves its first key's slot (every script's keys share one hash
    /// tag, so one slot). The connection re-sends nothing by itself: after a
    /// broken connection a script may have run, so that is the caller's
    /// retryable error. A reply that says the command did not run (`MOVED`,
    /// `ASK`, `TRYAGAIN`, `CLUSTERDOWN`) is sent again after a short pause
    /// (the slot map is rebuilt meanwhile), within the call's bound.
    Cluster {
        /// Scripts and every other command.
        conn: ClusterConnection,
        /// The wake-up subscriptions only: a node ends a shard channel's
        /// subscription unasked when its slot moves, and that push must not
        /// land on a connection where it could be taken for a script's reply.
        subs: ClusterConnection,
        /// With `min_replicas`: opens the connections for the writes `WAIT`
        /// confirms, each sent with its `WAIT` on a connection used by one
        /// write at a time (see [`Lane`]), so that a `WAIT` held up by slow
        /// replicas holds up no other call.
        waits: Option<Arc<redis::cluster::ClusterClient>>,
    },
}

/// Whether a cluster node refused `e`'s command without running it, so
/// that sending it again cannot apply it twice.
fn not_run(e: &RedisError) -> bool {
    matches!(
        e.kind(),
        ErrorKind::Server(
            ServerErrorKind::Moved
                | ServerErrorKind::Ask
                | ServerErrorKind::TryAgain
                | ServerErrorKind::ClusterDown
        )
    )
}

/// Runs `call` until it gives an answer other than [`not_run`], pausing
/// 10 ms, then twice as long each time up to 200 ms. The caller bounds it.
async fn until_run<T, F, Fut>(mut call: F) -> RedisResult<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = RedisResult<T>>,
{
    let mut pause = Duration::from_millis(10);
    loop {
        match call().await {
            Err(e) if not_run(&e) => {
                tracing::debug!(error = %e, "the cluster did not run a command; sending it again");
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(Duration::from_millis(200));
            }
            other => return other,
        }
    }
}

impl Link {
    /// Subscribes to a wake-up channel: `SUBSCRIBE` on one server,
    /// `SSUBSCRIBE` (sharded, on the node serving the channel's slot) in a
    /// Cluster. Either is renewed by the connection after a reconnect.
    pub(crate) async fn subscribe(&mut self, channel: &str) -> RedisResult<()> {
        self.subscription(channel, true).await
    }

    /// Ends a subscription made with [`subscribe`](Self::subscribe).
    pub(crate) async fn unsubscribe(&mut self, channel: &str) -> RedisResult<()> {
        self.subscription(channel, false).await
    }

    async fn subscription(&mut self, channel: &str, on: bool) -> RedisResult<()> {
        match self {
            Link::Single(m) if on => m.subscribe(channel).await,
            Link::Single(m) => m.unsubscribe(channel).await,
            Link::Cluster { subs, .. } => {
                until_run(|| {
                    let mut subs = subs.clone();
                    async move {
                        if on {
                            subs.ssubscribe(channel).await
                        } else {
                            subs.sunsubscribe(channel).await
                        }
                    }
                })
                .await
            }
        }
    }

    /// The primaries, each as a connection to that node alone (for `SCAN`
    /// and `CONFIG GET`, which are per node): the one server, or every
    /// Cluster primary as `CLUSTER SLOTS` names it.
    pub(crate) async fn primaries(&self) -> RedisResult<Vec<Node>> {
        match self {
            Link::Single(m) => Ok(vec![Node::Single(m.clone())]),
            Link::Cluster { conn: c, .. } => {
                let slots = c
                    .clone()
                    .route_command(
                        redis::cmd("CLUSTER").arg("SLOTS").clone(),
                        RoutingInfo::SingleNode(SingleNodeRoutingInfo::Random),
                    )
                    .await?;
                let mut nodes: Vec<(String, u16)> = cluster_primaries(&slots)?;
                nodes.sort();
                nodes.dedup();
                Ok(nodes
                    .into_iter()
                    .map(|(host, port)| Node::Cluster {
                        conn: c.clone(),
                        host,
                        port,
                    })
                    .collect())
            }
        }
    }
}

impl ConnectionLike for Link {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Link::Single(m) => m.req_packed_command(cmd),
            Link::Cluster { conn, .. } => Box::pin(until_run(move || {
                let mut c = conn.clone();
                async move { c.req_packed_command(cmd).await }
            })),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Link::Single(m) => m.req_packed_commands(pipeline, offset, count),
            Link::Cluster { conn, .. } => conn.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Link::Single(m) => m.get_db(),
            Link::Cluster { conn, .. } => conn.get_db(),
        }
    }
}

/// One primary, as a connection that sends everything to it.
#[derive(Clone)]
pub(crate) enum Node {
    Single(ConnectionManager),
    Cluster {
        conn: ClusterConnection,
        host: String,
        port: u16,
    },
}

impl Node {
    fn route(host: &str, port: u16) -> SingleNodeRoutingInfo {
        SingleNodeRoutingInfo::ByAddress {
            host: host.to_owned(),
            port,
        }
    }
}

impl std::fmt::Display for Node {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Node::Single(_) => f.write_str("the server"),
            Node::Cluster { host, port, .. } => write!(f, "node {host}:{port}"),
        }
    }
}

impl ConnectionLike for Node {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Node::Single(m) => m.req_packed_command(cmd),
            Node::Cluster { conn, host, port } => {
                let route = RoutingInfo::SingleNode(Node::route(host, *port));
                Box::pin(conn.route_command(cmd.clone(), route))
            }
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Node::Single(m) => m.req_packed_commands(pipeline, offset, count),
            Node::Cluster { conn, host, port } => {
                let route = Node::route(host, *port);
                Box::pin(conn.route_pipeline(pipeline.clone(), offset, count, route))
            }
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Node::Single(m) => m.get_db(),
            Node::Cluster { .. } => 0,
        }
    }
}

/// The primaries' addresses in a `CLUSTER SLOTS` reply: per slot range
/// `[start, end, [host, port, id, …], replicas…]`.
fn cluster_primaries(reply: &Value) -> RedisResult<Vec<(String, u16)>> {
    let bad = || {
        RedisError::from((
            ErrorKind::UnexpectedReturnType,
            "an unexpected CLUSTER SLOTS reply",
        ))
    };
    let Value::Array(ranges) = reply else {
        return Err(bad());
    };
    ranges
        .iter()
        .map(|range| {
            let Value::Array(fields) = range else {
                return Err(bad());
            };
            let Some(Value::Array(primary)) = fields.get(2) else {
                return Err(bad());
            };
            let host = primary.first().and_then(scripts::text).ok_or_else(bad)?;
            let port = match primary.get(1) {
                Some(Value::Int(p)) => u16::try_from(*p).map_err(|_| bad())?,
                _ => return Err(bad()),
            };
            Ok((host, port))
        })
        .collect()
}

impl Conn {
    pub(crate) fn new(
        link: Link,
        client: Option<redis::Client>,
        config: RedisConfig,
        follow: Option<Follow>,
    ) -> Self {
        Conn {
            shared: Arc::new(Shared {
                primary: RwLock::new(Primary { link, client }),
                generation: AtomicU64::new(0),
                lanes: Mutex::new(Vec::new()),
                cluster_lanes: Mutex::new(Vec::new()),
                config,
                follow,
            }),
        }
    }

    pub(crate) fn config(&self) -> &RedisConfig {
        &self.shared.config
    }

    /// A handle on the connection, for one call.
    pub(crate) fn manager(&self) -> Link {
        self.manager_and_generation().0
    }

    /// The connection and how many times it was replaced, read together.
    pub(crate) fn manager_and_generation(&self) -> (Link, u64) {
        self.read_primary(|p| p.link.clone())
    }

    /// `read` of the primary, and the generation, under one read guard.
    fn read_primary<T>(&self, read: impl FnOnce(&Primary) -> T) -> (T, u64) {
        let p = self
            .shared
            .primary
            .read()
            .unwrap_or_else(|p| p.into_inner());
        (read(&p), self.shared.generation.load(Ordering::Acquire))
    }

    /// How this client finds its servers: see [`error::map_with`].
    fn topology(&self) -> error::Topology {
        if self.shared.config.cluster.is_some() {
            error::Topology::Cluster
        } else if self.shared.follow.is_some() {
            error::Topology::Sentinel
        } else {
            error::Topology::Fixed
        }
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
        self.bounded_by(self.timeout(), what, call).await
    }

    /// [`bounded`](Self::bounded) within `limit`.
    async fn bounded_by<T>(
        &self,
        limit: Duration,
        what: &str,
        call: impl Future<Output = redis::RedisResult<T>>,
    ) -> Result<T> {
        let config = &self.shared.config;
        let res = error::bounded(limit, what, &config.display_url, self.topology(), call).await;
        if self.shared.follow.is_some() && res.as_ref().is_err_and(Error::is_retryable) {
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
        let Ok(_lookup) = follow.lookup.try_lock() else {
            return;
        };
        {
            let mut asked = follow.asked.lock().unwrap_or_else(|p| p.into_inner());
            if asked.is_some_and(|t| t.elapsed() < sentinel::MIN_LOOKUP_GAP) {
                return;
            }
            *asked = Some(Instant::now());
        }
        let (client, addr) = match sentinel::ask_sentinels(&self.shared.config).await {
            Ok(found) => (found.client, found.named),
            Err(e) => {
                tracing::debug!(error = %e, "asking the sentinels for the primary failed");
                return;
            }
        };
        {
            let mut primary = follow.primary.lock().unwrap_or_else(|p| p.into_inner());
            if *primary == addr {
                return;
            }
            let manager = match ConnectionManager::new_lazy_with_config(
                client.clone(),
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
                .primary
                .write()
                .unwrap_or_else(|p| p.into_inner());
            *current = Primary {
                link: Link::Single(manager),
                client: Some(client),
            };
            self.shared.generation.fetch_add(1, Ordering::AcqRel);
            drop(current);
            self.shared
                .lanes
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .clear();
            *primary = addr;
        }
        if let Some(f) = follow.on_switch.get() {
            f();
        }
    }

    /// One run of the acquire script on `lane`; `queued` queues the caller
    /// when busy. A grant is the caller's once [`confirm_grant`](Self::confirm_grant)
    /// on the same lane says so.
    pub(crate) async fn attempt(
        &self,
        lane: &mut Lane,
        key: &LockKey,
        keys: &Keys,
        opts: &LockOptions,
        owner: &Owner,
        queued: Option<Queued<'_>>,
    ) -> Result<Attempt> {
        if lane.answers_late() {
            // A grant (or a hand-over claimed) whose answer its caller did
            // not wait for: given back.
            let (conn, key, owner, opts) = (self.clone(), key.clone(), owner.clone(), opts.clone());
            lane.when_late(Arc::new(move |reply| {
                let (conn, key, owner, opts) = (conn.clone(), key.clone(), owner.clone(), opts.clone());
                Box::pin(async move {
                    if let Ok(Attempt::Granted { token, .. } | Attempt::HandedOver { token }) =
                        scripts::parse_acquire(reply)
                    {
                        tracing::warn!(key = %key, token = %token, "a grant answered after its caller left (dropped or timed out); giving it back");
                        let lease = granted(&key, owner, token, &opts, Instant::now());
                        conn.give_back(&lease).await;
                    }
                })
            }));
        }
        let args = AcquireArgs {
            owner: owner.as_str(),
            label: opts.label().map_or("", Label::as_str),
            ttl_ms: millis_ceil(opts.ttl()),
            reentrant: opts.is_reentrant(),
            queued,
        };
        let reply = lane
            .run("the acquire script", &scripts::acquire(keys, &args))
            .await?;
        scripts::parse_acquire(reply)
    }

    /// Renews `lease` for `ttl` (rounded up to whole milliseconds) if it is
    /// still current: [`DistributedLock::extend`](fenced_api::DistributedLock::extend).
    pub(crate) async fn extend(&self, lease: &Lease, ttl: Duration) -> Result<Lease> {
        let ttl = Duration::from_millis(millis_ceil(LockOptions::validate_ttl(ttl)?));
        let sent = Instant::now();
        let extended = self.extend_batch(&[lease], ttl).await?;
        if extended == [true] {
            Ok(lease.renewed(ttl, sent))
        } else {
            Err(Error::lease_lost(
                &lease.key,
                lease.token,
                "redis no longer has this lease (expired, released, force-released, or lost in a restart)",
            ))
        }
    }

    /// Renews each of `leases` (distinct keys, one shard: every key of a
    /// standalone server, one slot of a cluster) for `ttl`, already
    /// validated (the script gets it rounded up to whole milliseconds), with one run of the extend
    /// script: whether each was current and is renewed, in order.
    /// `min_replicas` confirms the batch as a whole; short of replicas the
    /// call fails while the renewals stay on the primary (the caller renews
    /// again).
    pub(crate) async fn extend_batch(&self, leases: &[&Lease], ttl: Duration) -> Result<Vec<bool>> {
        let mut call = scripts::EXTEND.prepare_invoke();
        call.arg(millis_ceil(ttl));
        for lease in leases {
            call.key(self.keys(&lease.key).lock)
                .arg(lease.owner.as_str())
                .arg(lease.token.get());
        }
        let mut lane = self.lane().await?;
        let replies: Vec<i64> = lane.run("the extend script", &call).await?;
        if replies.len() != leases.len() {
            return Err(error::protocol(format!(
                "the extend script answered {} times for {} leases",
                replies.len(),
                leases.len()
            )));
        }
        let extended: Vec<bool> = replies.iter().map(|&r| r == 1).collect();
        for (lease, _) in leases.iter().zip(&extended).filter(|(_, &e)| e) {
            tracing::trace!(key = %lease.key, token = %lease.token, "renewed");
        }
        if let Some((first, _)) = leases.iter().zip(&extended).find(|(_, &e)| e) {
            // Extended on the primary either way; short of replicas, the
            // caller hears of it and renews again (a watchdog retries).
            self.confirm(&mut lane, &first.key, "renewal").await?;
        }
        Ok(extended)
    }

    /// Whether this client talks to a Redis Cluster (where one script's
    /// keys must share a slot).
    pub(crate) fn is_cluster(&self) -> bool {
        self.topology() == error::Topology::Cluster
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
