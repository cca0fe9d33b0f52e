//! A private `redis-server`: own port, own directory.

use std::{process::Command, time::Duration};

use fenced_api::Result;

use super::{
    fail, find_binary, free_port, proc::Proc, temp_dir, tls::install_crypto_provider, TlsFiles,
};

/// How a [`PrivateRedis`] persists data.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum RedisPersistence {
    /// `--save "" --appendonly no`: a restart forgets everything.
    #[default]
    None,
    /// `--appendonly yes --appendfsync everysec` (Redis's AOF default).
    AofEverySec,
    /// `--appendonly yes --appendfsync always`.
    AofAlways,
}

/// How to start a [`PrivateRedis`].
#[derive(Debug, Clone, Default)]
pub struct RedisOptions {
    /// Persistence mode.
    pub persistence: RedisPersistence,
    /// `--requirepass`: clients must AUTH with this password.
    pub password: Option<String>,
    /// Serve TLS only (`--port 0 --tls-port`), with these files; clients are
    /// not asked for certificates unless `tls_client_certificates`.
    pub tls: Option<TlsFiles>,
    /// With `tls`: demand a client certificate (`--tls-auth-clients yes`,
    /// Redis's own default).
    pub tls_client_certificates: bool,
    /// A read-only replica of the server on this port.
    pub replica_of: Option<u16>,
    /// A Redis Cluster node (`cluster-enabled yes`) owning no slots yet,
    /// alone in its cluster; [`PrivateRedis::cluster_bus`] is its bus port
    /// for `CLUSTER MEET`.
    pub cluster: bool,
}

/// A `redis-server` on a free loopback port. Killed and removed on drop.
#[derive(Debug)]
pub struct PrivateRedis {
    // First: fields drop in order, so the server is dead before its
    // directory is removed.
    proc: Proc,
    dir: tempfile::TempDir,
    port: u16,
    cluster_bus: Option<u16>,
    options: RedisOptions,
}

impl PrivateRedis {
    /// Starts the server and waits until it answers `PING`.
    ///
    /// # Errors
    ///
    /// When `redis-server` is missing (naming `scripts/services.sh`) or does not answer.
    pub async fn start(options: RedisOptions) -> Result<Self> {
        let server = PrivateRedis {
            dir: temp_dir("redis")?,
            port: free_port()?,
            cluster_bus: if options.cluster {
                Some(free_port()?)
            } else {
                None
            },
            options,
            proc: Proc::default(),
        };
        server.launch().await?;
        Ok(server)
    }

    /// The port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The cluster bus port of a cluster node ([`RedisOptions::cluster`]).
    pub fn cluster_bus(&self) -> Option<u16> {
        self.cluster_bus
    }

    /// `redis://[:password@]127.0.0.1:<port>`, or `rediss://127.0.0.1:<port>`
    /// for a TLS server (certificate verified: the client must trust the CA).
    pub fn url(&self) -> String {
        let auth = self
            .options
            .password
            .as_ref()
            .map(|p| format!(":{p}@"))
            .unwrap_or_default();
        let scheme = if self.options.tls.is_some() {
            "rediss"
        } else {
            "redis"
        };
        format!("{scheme}://{auth}127.0.0.1:{}", self.port)
    }

    /// A URL for admin connections: as [`url`](Self::url), but skipping
    /// certificate verification on a TLS server.
    pub fn admin_url(&self) -> String {
        if self.options.tls.is_some() {
            format!("{}/#insecure", self.url())
        } else {
            self.url()
        }
    }

    /// A plain admin connection (RESP2) for commands the lock never sends.
    ///
    /// # Errors
    ///
    /// When the server cannot be reached.
    pub async fn admin(&self) -> Result<redis::aio::MultiplexedConnection> {
        admin_connection(&self.admin_url()).await
    }

    fn command(&self) -> Result<Command> {
        let mut cmd = Command::new(find_binary(&["redis-server"], "Redis")?);
        cmd.arg("--port")
            .arg(self.port.to_string())
            .args(["--bind", "127.0.0.1", "--daemonize", "no", "--save", ""])
            .arg("--dir")
            .arg(self.dir.path());
        if let Some(primary) = self.options.replica_of {
            cmd.args(["--replicaof", "127.0.0.1"])
                .arg(primary.to_string());
        }
        if let Some(bus) = self.cluster_bus {
            // A node that misses pings for 1 s is failing: failovers in
            // tests take seconds, not Redis's default 15 s.
            cmd.args(["--cluster-enabled", "yes"])
                .args(["--cluster-config-file", "nodes.conf"])
                .args(["--cluster-node-timeout", "1000"])
                .arg("--cluster-port")
                .arg(bus.to_string());
        }
        if let Some(pw) = &self.options.password {
            cmd.arg("--requirepass").arg(pw);
        }
        if let Some(tls) = &self.options.tls {
            cmd.args(["--port", "0", "--tls-port"])
                .arg(self.port.to_string())
                .arg("--tls-cert-file")
                .arg(&tls.cert)
                .arg("--tls-key-file")
                .arg(&tls.key)
                .arg("--tls-ca-cert-file")
                .arg(&tls.ca)
                .arg("--tls-auth-clients")
                .arg(if self.options.tls_client_certificates {
                    "yes"
                } else {
                    "no"
                })
                // Replication and, for a cluster node, the cluster bus
                // over TLS too: the server listens for nothing else.
                .args(["--tls-replication", "yes"]);
            if self.cluster_bus.is_some() {
                cmd.args(["--tls-cluster", "yes"]);
            }
        }
        match self.options.persistence {
            RedisPersistence::None => cmd.args(["--appendonly", "no"]),
            RedisPersistence::AofEverySec => {
                cmd.args(["--appendonly", "yes", "--appendfsync", "everysec"])
            }
            RedisPersistence::AofAlways => {
                cmd.args(["--appendonly", "yes", "--appendfsync", "always"])
            }
        };
        Ok(cmd)
    }

    async fn launch(&self) -> Result<()> {
        self.proc.spawn(self.command()?, "redis-server")?;
        if self.options.tls_client_certificates {
            // No client of the kit has a certificate to PING with: up once
            // the port accepts connections.
            let port = self.port;
            return self
                .proc
                .wait_until_up("redis-server", || async move {
                    tokio::net::TcpStream::connect(("127.0.0.1", port))
                        .await
                        .map(drop)
                        .map_err(|e| e.to_string())
                })
                .await;
        }
        let url = self.admin_url();
        self.proc.wait_until_up("redis-server", || ping(&url)).await
    }

    process_controls!();
}

/// A Redis Sentinel (`redis-server <conf> --sentinel`) on a free loopback
/// port, watching one primary as `mymaster` with a quorum of 1, quick to act:
/// the primary is down after 500 ms of silence, a failover may take 2 s.
/// Killed and removed on drop.
#[derive(Debug)]
pub struct PrivateSentinel {
    proc: Proc,
    dir: tempfile::TempDir,
    port: u16,
    primary: u16,
}

impl PrivateSentinel {
    /// The name the sentinel knows the primary by.
    pub const MASTER: &'static str = "mymaster";

    /// Starts a sentinel watching the server on `primary_port`.
    ///
    /// # Errors
    ///
    /// When `redis-server` is missing (naming `scripts/services.sh`) or the
    /// sentinel does not answer.
    pub async fn start(primary_port: u16) -> Result<Self> {
        let sentinel = PrivateSentinel {
            dir: temp_dir("redis-sentinel")?,
            port: free_port()?,
            primary: primary_port,
            proc: Proc::default(),
        };
        sentinel.launch().await?;
        Ok(sentinel)
    }

    /// The port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `redis+sentinel://127.0.0.1:<port>/mymaster`.
    pub fn url(&self) -> String {
        format!("redis+sentinel://127.0.0.1:{}/{}", self.port, Self::MASTER)
    }

    /// A plain connection to the sentinel itself.
    ///
    /// # Errors
    ///
    /// When the sentinel cannot be reached.
    pub async fn admin(&self) -> Result<redis::aio::MultiplexedConnection> {
        admin_connection(&format!("redis://127.0.0.1:{}", self.port)).await
    }

    fn command(&self) -> Result<Command> {
        // The sentinel rewrites its configuration file: it lives in the
        // sentinel's own directory.
        let conf = self.dir.path().join("sentinel.conf");
        let text = format!(
            "port {port}\nbind 127.0.0.1\ndaemonize no\ndir {dir}\n\
             sentinel monitor {m} 127.0.0.1 {primary} 1\n\
             sentinel down-after-milliseconds {m} 500\n\
             sentinel failover-timeout {m} 2000\n\
             sentinel parallel-syncs {m} 1\n",
            port = self.port,
            dir = self.dir.path().display(),
            m = Self::MASTER,
            primary = self.primary,
        );
        std::fs::write(&conf, text).map_err(|e| fail(format!("sentinel.conf: {e}")))?;
        let mut cmd = Command::new(find_binary(&["redis-server"], "Redis")?);
        cmd.arg(conf).arg("--sentinel");
        Ok(cmd)
    }

    async fn launch(&self) -> Result<()> {
        self.proc.spawn(self.command()?, "redis-sentinel")?;
        let url = format!("redis://127.0.0.1:{}", self.port);
        self.proc
            .wait_until_up("redis-sentinel", || ping(&url))
            .await
    }

    process_controls!();
}

/// A Redis Cluster on loopback: `primaries` nodes sharing the 16384 slots
/// in equal ranges, each with `replicas` replicas; the node timeout is 1 s,
/// so a killed primary's replica takes over within seconds. Every node is
/// killed and removed on drop.
#[derive(Debug)]
pub struct PrivateRedisCluster {
    primaries: Vec<PrivateRedis>,
    /// `replicas[i]`: the replicas of `primaries[i]` at start.
    replicas: Vec<Vec<PrivateRedis>>,
}

impl PrivateRedisCluster {
    /// Starts the nodes, assigns the slots, joins them, makes the replicas
    /// and waits (up to 60 s) until every node sees the cluster as `ok`
    /// with every replica in sync.
    ///
    /// # Errors
    ///
    /// When `redis-server` is missing (naming `scripts/services.sh`) or the
    /// cluster does not form.
    pub async fn start(primaries: usize, replicas: usize) -> Result<Self> {
        Self::start_with(primaries, replicas, None).await
    }

    /// [`start`](Self::start) for a cluster that speaks TLS only — to
    /// clients, between replicas and primaries, and on the cluster bus —
    /// with these files (clients are not asked for certificates).
    ///
    /// # Errors
    ///
    /// As [`start`](Self::start).
    pub async fn start_tls(primaries: usize, replicas: usize, tls: TlsFiles) -> Result<Self> {
        Self::start_with(primaries, replicas, Some(tls)).await
    }

    async fn start_with(primaries: usize, replicas: usize, tls: Option<TlsFiles>) -> Result<Self> {
        let node = || {
            PrivateRedis::start(RedisOptions {
                cluster: true,
                tls: tls.clone(),
                ..RedisOptions::default()
            })
        };
        let mut cluster = PrivateRedisCluster {
            primaries: Vec::new(),
            replicas: Vec::new(),
        };
        for _ in 0..primaries.max(1) {
            cluster.primaries.push(node().await?);
            let mut mine = Vec::new();
            for _ in 0..replicas {
                mine.push(node().await?);
            }
            cluster.replicas.push(mine);
        }
        let n = cluster.primaries.len();
        for (i, p) in cluster.primaries.iter().enumerate() {
            let (lo, hi) = (16384 * i / n, 16384 * (i + 1) / n - 1);
            let mut c = p.admin().await?;
            cmd_ok(
                redis::cmd("CLUSTER").arg("ADDSLOTSRANGE").arg(lo).arg(hi),
                &mut c,
            )
            .await?;
        }
        let mut first = cluster.primaries[0].admin().await?;
        for other in cluster.nodes().skip(1) {
            let bus = other
                .cluster_bus()
                .ok_or_else(|| fail("a cluster node without a bus port"))?;
            cmd_ok(
                redis::cmd("CLUSTER")
                    .arg("MEET")
                    .arg("127.0.0.1")
                    .arg(other.port())
                    .arg(bus),
                &mut first,
            )
            .await?;
        }
        let total = cluster.nodes().count();
        cluster
            .wait_for(
                Duration::from_secs(30),
                "every node to know the others",
                |info, _| info.contains(&format!("cluster_known_nodes:{total}")),
            )
            .await?;
        for (p, reps) in cluster.primaries.iter().zip(&cluster.replicas) {
            let id: String = redis::cmd("CLUSTER")
                .arg("MYID")
                .query_async(&mut p.admin().await?)
                .await
                .map_err(|e| fail(format!("CLUSTER MYID: {e}")))?;
            for r in reps {
                cmd_ok(
                    redis::cmd("CLUSTER").arg("REPLICATE").arg(&id),
                    &mut r.admin().await?,
                )
                .await?;
            }
        }
        cluster
            .wait_for(
                Duration::from_secs(60),
                "the cluster to be ok with every replica in sync",
                |info, replication| {
                    info.contains("cluster_state:ok")
                        && (replication.contains("role:master")
                            || replication.contains("master_link_status:up"))
                },
            )
            .await?;
        Ok(cluster)
    }

    /// Every node: primaries first (in slot order), then replicas.
    pub fn nodes(&self) -> impl Iterator<Item = &PrivateRedis> {
        self.primaries.iter().chain(self.replicas.iter().flatten())
    }

    /// The node that started as the primary of the `i`-th slot range.
    pub fn primary(&self, i: usize) -> &PrivateRedis {
        &self.primaries[i]
    }

    /// The nodes that started as replicas of [`primary(i)`](Self::primary).
    pub fn replicas_of(&self, i: usize) -> &[PrivateRedis] {
        &self.replicas[i]
    }

    /// `redis+cluster://127.0.0.1:<p>,…` naming every primary as a seed
    /// (`rediss+cluster://` for a TLS cluster, whose CA no client trusts:
    /// append `#insecure` after any query).
    pub fn url(&self) -> String {
        let seeds: Vec<String> = self
            .primaries
            .iter()
            .map(|p| format!("127.0.0.1:{}", p.port()))
            .collect();
        let tls = self.primaries.iter().any(|p| p.options.tls.is_some());
        let scheme = if tls {
            "rediss+cluster"
        } else {
            "redis+cluster"
        };
        format!("{scheme}://{}", seeds.join(","))
    }

    /// Waits until `ready(CLUSTER INFO, INFO replication)` holds on every
    /// node that is up (a killed node is skipped), polling every 100 ms.
    ///
    /// # Errors
    ///
    /// When it does not within `limit`, naming `what` and the last answers.
    pub async fn wait_for(
        &self,
        limit: Duration,
        what: &str,
        ready: impl Fn(&str, &str) -> bool,
    ) -> Result<()> {
        let start = std::time::Instant::now();
        loop {
            let mut last = String::new();
            let mut all = true;
            for node in self.nodes().filter(|n| n.pid().is_some()) {
                let (info, replication) = match node.admin().await {
                    Ok(mut c) => (
                        redis::cmd("CLUSTER")
                            .arg("INFO")
                            .query_async::<String>(&mut c)
                            .await
                            .unwrap_or_default(),
                        redis::cmd("INFO")
                            .arg("replication")
                            .query_async::<String>(&mut c)
                            .await
                            .unwrap_or_default(),
                    ),
                    Err(_) => Default::default(),
                };
                if !ready(&info, &replication) {
                    all = false;
                    last = format!("node {}: {info} {replication}", node.port());
                    break;
                }
            }
            if all {
                return Ok(());
            }
            if start.elapsed() > limit {
                return Err(fail(format!(
                    "the cluster did not reach {what} within {limit:?}: {last}"
                )));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

/// A primary, its replica and a sentinel watching them
/// ([`PrivateSentinel`]: quorum 1, down after 500 ms), ready to fail over:
/// the replica is in sync and the sentinel has found it.
#[derive(Debug)]
pub struct PrivateSentinelGroup {
    /// The primary at start.
    pub primary: PrivateRedis,
    /// Its replica.
    pub replica: PrivateRedis,
    /// The sentinel.
    pub sentinel: PrivateSentinel,
}

impl PrivateSentinelGroup {
    /// Starts the three and waits (up to 60 s) until a failover could run.
    ///
    /// # Errors
    ///
    /// When `redis-server` is missing (naming `scripts/services.sh`), or the
    /// replica does not sync or the sentinel does not find it in time.
    pub async fn start() -> Result<Self> {
        let primary = PrivateRedis::start(RedisOptions::default()).await?;
        let replica = PrivateRedis::start(RedisOptions {
            replica_of: Some(primary.port()),
            ..RedisOptions::default()
        })
        .await?;
        let sentinel = PrivateSentinel::start(primary.port()).await?;
        let group = PrivateSentinelGroup {
            primary,
            replica,
            sentinel,
        };
        let start = std::time::Instant::now();
        let port = group.replica.port().to_string();
        loop {
            let mut r = group.replica.admin().await?;
            let info: String = redis::cmd("INFO")
                .arg("replication")
                .query_async(&mut r)
                .await
                .unwrap_or_default();
            let mut s = group.sentinel.admin().await?;
            let replicas: redis::Value = redis::cmd("SENTINEL")
                .arg("REPLICAS")
                .arg(PrivateSentinel::MASTER)
                .query_async(&mut s)
                .await
                .unwrap_or(redis::Value::Nil);
            if info.contains("master_link_status:up") && format!("{replicas:?}").contains(&port) {
                return Ok(group);
            }
            if start.elapsed() > Duration::from_secs(60) {
                return Err(fail(format!(
                    "the sentinel group is not ready after 60 s: {info}"
                )));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// `redis+sentinel://127.0.0.1:<sentinel>/mymaster`.
    pub fn url(&self) -> String {
        self.sentinel.url()
    }

    /// The port of the primary the sentinel names now.
    ///
    /// # Errors
    ///
    /// When the sentinel cannot be asked.
    pub async fn named_primary(&self) -> Result<u16> {
        let mut s = self.sentinel.admin().await?;
        let addr: Vec<String> = redis::cmd("SENTINEL")
            .arg("GET-MASTER-ADDR-BY-NAME")
            .arg(PrivateSentinel::MASTER)
            .query_async(&mut s)
            .await
            .map_err(|e| fail(format!("SENTINEL GET-MASTER-ADDR-BY-NAME: {e}")))?;
        addr.get(1)
            .and_then(|p| p.parse().ok())
            .ok_or_else(|| fail(format!("the sentinel named no primary: {addr:?}")))
    }
}

/// The slot of the key `name` and the `(host, port)` of the primary that
/// serves it, as the node behind `conn` sees the cluster (`CLUSTER KEYSLOT`,
/// `CLUSTER SLOTS`).
///
/// # Errors
///
/// When the node cannot be asked, answers in an unexpected shape, or names
/// no primary for the slot.
pub async fn cluster_slot_owner(
    conn: &mut redis::aio::MultiplexedConnection,
    name: &str,
) -> Result<(u16, (String, u16))> {
    let slot: u16 = redis::cmd("CLUSTER")
        .arg("KEYSLOT")
        .arg(name)
        .query_async(conn)
        .await
        .map_err(|e| fail(format!("CLUSTER KEYSLOT: {e}")))?;
    let ranges: Vec<redis::Value> = redis::cmd("CLUSTER")
        .arg("SLOTS")
        .query_async(conn)
        .await
        .map_err(|e| fail(format!("CLUSTER SLOTS: {e}")))?;
    for range in ranges {
        // `[start, end, [host, port, id, …], replicas…]`
        let redis::Value::Array(f) = range else {
            continue;
        };
        let (
            Some(redis::Value::Int(lo)),
            Some(redis::Value::Int(hi)),
            Some(redis::Value::Array(p)),
        ) = (f.first(), f.get(1), f.get(2))
        else {
            continue;
        };
        if !(*lo..=*hi).contains(&i64::from(slot)) {
            continue;
        }
        let host: String = p
            .first()
            .and_then(|h| redis::from_redis_value(h.clone()).ok())
            .ok_or_else(|| fail("CLUSTER SLOTS names a primary without a host"))?;
        let port = match p.get(1) {
            Some(redis::Value::Int(port)) => u16::try_from(*port)
                .map_err(|_| fail(format!("CLUSTER SLOTS names port {port}")))?,
            _ => return Err(fail("CLUSTER SLOTS names a primary without a port")),
        };
        return Ok((slot, (host, port)));
    }
    Err(fail(format!("no primary serves slot {slot}")))
}

async fn cmd_ok(cmd: &redis::Cmd, conn: &mut redis::aio::MultiplexedConnection) -> Result<()> {
    cmd.query_async::<()>(conn)
        .await
        .map_err(|e| fail(format!("{cmd:?}: {e}")))
}

/// A plain admin connection (RESP2) to any Redis URL the `redis` crate accepts.
///
/// # Errors
///
/// When the server cannot be reached within 5 s.
pub async fn admin_connection(url: &str) -> Result<redis::aio::MultiplexedConnection> {
    install_crypto_provider();
    let client = redis::Client::open(url).map_err(|e| fail(format!("admin client: {e}")))?;
    match tokio::time::timeout(
        Duration::from_secs(5),
        client.get_multiplexed_async_connection(),
    )
    .await
    {
        Ok(Ok(c)) => Ok(c),
        Ok(Err(e)) => Err(fail(format!("admin connection: {e}"))),
        Err(_) => Err(fail("admin connection: no answer within 5s")),
    }
}

async fn ping(url: &str) -> std::result::Result<(), String> {
    let mut conn = admin_connection(url).await.map_err(|e| e.to_string())?;
    let pong: redis::RedisResult<String> = tokio::time::timeout(
        Duration::from_secs(2),
        redis::cmd("PING").query_async(&mut conn),
    )
    .await
    .map_err(|_| "no PONG within 2s".to_owned())?;
    match pong {
        Ok(p) if p == "PONG" => Ok(()),
        Ok(other) => Err(format!("PING answered {other:?}")),
        Err(e) => Err(e.to_string()),
    }
}
