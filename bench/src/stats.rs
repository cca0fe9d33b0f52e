//! Per-cell measurements, and the server-side counters read around a cell.

use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::TcpStream,
    time::Instant,
};

use crate::Scenario;

/// What an implementation is, for the tables.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Kind {
    /// A fenced backend / strategy, through `fenced::connect`.
    Fenced,
    /// A lock users would pick instead (bench-only baseline).
    Peer,
    /// The raw round trip of a server: what no lock on it can beat.
    Floor,
}

/// One acquisition: attempt started, acquired, release started, release done.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Rec {
    pub(crate) task: usize,
    pub(crate) t0: Instant,
    pub(crate) t1: Instant,
    pub(crate) t2: Instant,
    pub(crate) t3: Instant,
}

/// The many-keys scenario's own numbers.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ManyKeys {
    /// Locks asked for.
    pub keys: usize,
    /// Locks obtained.
    pub held: usize,
    /// Seconds to take them all ([`in_flight`](Self::in_flight) at a time).
    pub acquire_s: f64,
    /// Acquisitions in flight at once while taking them (1: one after
    /// another). Absent in results of runs before it was recorded.
    #[serde(default = "one")]
    pub in_flight: usize,
    /// Seconds they were all held (renewal had to keep up meanwhile).
    pub held_s: f64,
    /// Seconds to release them all.
    pub release_s: f64,
    /// Locks found lost after the hold (renewal did not keep up).
    pub lost: usize,
    /// Resident memory of the bench process before, KiB (Linux only).
    pub rss_kib_before: Option<u64>,
    /// Resident memory while all were held, KiB.
    pub rss_kib_held: Option<u64>,
    /// Clients connected to the server before (all clients, not only ours).
    pub server_connections_before: Option<u64>,
    /// Clients connected to the server while all were held.
    pub server_connections_held: Option<u64>,
    /// Requests the server handled during the hold — this client's renewals,
    /// plus whatever other clients sent (on Redis, script runs: its command
    /// counts include the commands scripts run inside).
    #[serde(default)]
    pub hold_requests: Option<u64>,
}

fn one() -> usize {
    1
}

impl ManyKeys {
    /// Requests per second the server handled during the hold: the
    /// renewals' cost to the store.
    pub fn hold_requests_per_s(&self) -> Option<f64> {
        let n = self.hold_requests?;
        (self.held_s > 0.0).then(|| n as f64 / self.held_s)
    }

    /// The client's resident memory per held lock, bytes.
    pub fn bytes_per_lock(&self) -> Option<f64> {
        let (before, held) = (self.rss_kib_before?, self.rss_kib_held?);
        (self.held > 0).then(|| held.saturating_sub(before) as f64 * 1024.0 / self.held as f64)
    }
}

/// One JSON line: one implementation on one scenario.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CellResult {
    /// Implementation name.
    pub implementation: String,
    /// Fenced, peer or floor.
    pub kind: Kind,
    /// What one acquire + release of the implementation is (statements,
    /// round trips); absent from runs before it was recorded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
    /// The scenario.
    pub scenario: Scenario,
    /// Acquisitions completed inside the measured window.
    pub acquisitions: u64,
    /// Acquisitions per second of the window.
    pub acq_per_s: f64,
    /// Σ measured hold time (clipped to the window) / window; summed over
    /// keys, so it can exceed 1 for parallel keys.
    pub efficiency: f64,
    /// Acquire + release, p50 (ms).
    pub cycle_p50_ms: f64,
    /// Acquire + release, p99 (ms).
    pub cycle_p99_ms: f64,
    /// Wait (attempt start → acquired) p50 (ms).
    pub wait_p50_ms: f64,
    /// Wait p99 (ms).
    pub wait_p99_ms: f64,
    /// Longest wait (ms).
    pub wait_max_ms: f64,
    /// Hand-offs to a different, already waiting task: release start →
    /// acquired, p50 (ms). Contended scenarios only.
    pub handoff_p50_ms: Option<f64>,
    /// Hand-off gap p99 (ms).
    pub handoff_p99_ms: Option<f64>,
    /// How many hand-offs were measured.
    pub handoff_samples: usize,
    /// Hand-off gap percentiles 0, 1, …, 100 (ms), for the CDF plot.
    pub handoff_cdf_ms: Vec<f64>,
    /// Of the releases while another task was waiting, the share re-acquired
    /// by the releasing task (barging).
    pub barging_share: Option<f64>,
    /// Acquisitions per task inside the window.
    pub per_task: Vec<u64>,
    /// Fewest acquisitions of one task.
    pub per_task_min: u64,
    /// Most acquisitions of one task.
    pub per_task_max: u64,
    /// Jain fairness index of `per_task` (1 = equal, 1/n = one task got all).
    pub jain: Option<f64>,
    /// Server commands per acquisition (all clients of the server count:
    /// shared servers make this an upper bound).
    pub server_cmds_per_acq: Option<f64>,
    /// Failed operations (acquire, release, setup).
    pub errors: u64,
    /// The first error's message.
    pub error_sample: Option<String>,
    /// Waits that gave up after the window closed (not errors).
    pub abandoned: u64,
    /// Times the in-process holder count was already ≥ 1 at an acquisition. Must be 0.
    pub violations: u64,
    /// Many-keys numbers.
    pub many: Option<ManyKeys>,
    /// Reader-writer cells: the writers' wait p99 (ms), beside `wait_p99_ms`
    /// of every acquisition — how long a writer waits among readers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub write_wait_p99_ms: Option<f64>,
}

impl CellResult {
    pub(crate) fn empty(implementation: &str, kind: Kind, scenario: &Scenario) -> Self {
        CellResult {
            implementation: implementation.to_owned(),
            kind,
            note: None,
            scenario: scenario.clone(),
            acquisitions: 0,
            acq_per_s: 0.0,
            efficiency: 0.0,
            cycle_p50_ms: 0.0,
            cycle_p99_ms: 0.0,
            wait_p50_ms: 0.0,
            wait_p99_ms: 0.0,
            wait_max_ms: 0.0,
            handoff_p50_ms: None,
            handoff_p99_ms: None,
            handoff_samples: 0,
            handoff_cdf_ms: Vec::new(),
            barging_share: None,
            per_task: Vec::new(),
            per_task_min: 0,
            per_task_max: 0,
            jain: None,
            server_cmds_per_acq: None,
            errors: 0,
            error_sample: None,
            abandoned: 0,
            violations: 0,
            many: None,
            write_wait_p99_ms: None,
        }
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// The `p` quantile (0..=1) of a sorted slice, nearest rank.
pub(crate) fn quantile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

fn sorted(mut v: Vec<f64>) -> Vec<f64> {
    v.sort_by(f64::total_cmp);
    v
}

/// Jain's fairness index: (Σx)² / (n·Σx²).
pub(crate) fn jain(xs: &[u64]) -> Option<f64> {
    let sum: f64 = xs.iter().map(|&x| x as f64).sum();
    let sq: f64 = xs.iter().map(|&x| (x as f64) * (x as f64)).sum();
    (sq > 0.0).then(|| sum * sum / (xs.len() as f64 * sq))
}

pub(crate) fn analyze(
    r: &mut CellResult,
    mut recs: Vec<Rec>,
    s: &Scenario,
    start: Instant,
    deadline: Instant,
) {
    let window = deadline - start;
    recs.sort_by_key(|x| x.t1);
    let mut per_task = vec![0u64; s.tasks];
    let mut held = Duration::ZERO;
    for x in &recs {
        if x.t1 < deadline {
            per_task[x.task] += 1;
        }
        let a = x.t1.max(start);
        let b = x.t2.min(deadline);
        if b > a {
            held += b - a;
        }
    }
    r.acquisitions = per_task.iter().sum();
    r.acq_per_s = r.acquisitions as f64 / window.as_secs_f64();
    r.efficiency = held.as_secs_f64() / window.as_secs_f64();
    let cycles = sorted(recs.iter().map(|x| ms(x.t3 - x.t0)).collect());
    let waits = sorted(recs.iter().map(|x| ms(x.t1 - x.t0)).collect());
    r.cycle_p50_ms = quantile(&cycles, 0.5);
    r.cycle_p99_ms = quantile(&cycles, 0.99);
    r.wait_p50_ms = quantile(&waits, 0.5);
    r.wait_p99_ms = quantile(&waits, 0.99);
    r.wait_max_ms = waits.last().copied().unwrap_or(0.0);
    r.per_task_min = per_task.iter().copied().min().unwrap_or(0);
    r.per_task_max = per_task.iter().copied().max().unwrap_or(0);
    r.jain = jain(&per_task);
    r.per_task = per_task;
    if s.shares_one_key() {
        handoffs(r, &recs);
    } else if s.is_family() {
        slot_handoffs(r, &recs);
    }
}

/// The hand-off columns from the gaps (ms).
fn set_handoffs(r: &mut CellResult, gaps: Vec<f64>) {
    let gaps = sorted(gaps);
    r.handoff_samples = gaps.len();
    if !gaps.is_empty() {
        r.handoff_p50_ms = Some(quantile(&gaps, 0.5));
        r.handoff_p99_ms = Some(quantile(&gaps, 0.99));
        r.handoff_cdf_ms = (0..=100)
            .map(|p| quantile(&gaps, p as f64 / 100.0))
            .collect();
    }
}

/// The writers' wait p99 (ms) of a reader-writer cell.
pub(crate) fn write_wait_p99(waits: Vec<Duration>) -> Option<f64> {
    let waits = sorted(waits.into_iter().map(ms).collect());
    (!waits.is_empty()).then(|| quantile(&waits, 0.99))
}

/// Hand-off gaps where several tasks hold one key at once (semaphores,
/// reader-writer locks), from acquisitions sorted by acquire time: an
/// acquisition that was already waiting when another task began a release
/// is paired with the latest such release not yet paired (each release
/// frees one place), and its gap is release start → acquired. With one
/// permit this is the mutex's hand-off. Barging is not judged here.
fn slot_handoffs(r: &mut CellResult, recs: &[Rec]) {
    let mut releases: Vec<(Instant, usize)> = recs.iter().map(|x| (x.t2, x.task)).collect();
    releases.sort();
    let mut next = 0;
    let mut open: Vec<(Instant, usize)> = Vec::new();
    let mut gaps = Vec::new();
    for g in recs {
        while next < releases.len() && releases[next].0 <= g.t1 {
            open.push(releases[next]);
            next += 1;
        }
        // The latest unpaired release by another task while `g` waited.
        if let Some(at) = open
            .iter()
            .rposition(|(t2, task)| *task != g.task && *t2 >= g.t0)
        {
            let (t2, _) = open.remove(at);
            gaps.push(ms(g.t1.saturating_duration_since(t2)));
        }
    }
    set_handoffs(r, gaps);
}

/// Hand-off gaps and barging, from acquisitions sorted by acquire time.
fn handoffs(r: &mut CellResult, recs: &[Rec]) {
    let n = recs.len();
    if n < 2 {
        return;
    }
    // next_other[i]: the first later acquisition by a task other than recs[i]'s.
    let mut next_other = vec![None; n];
    for i in (0..n - 1).rev() {
        next_other[i] = if recs[i + 1].task != recs[i].task {
            Some(i + 1)
        } else {
            next_other[i + 1]
        };
    }
    let mut gaps = Vec::new();
    let (mut contested, mut barged) = (0u64, 0u64);
    for i in 0..n - 1 {
        let (a, b) = (&recs[i], &recs[i + 1]);
        // Was another task already waiting when `a` released?
        let other_waiting = next_other[i].is_some_and(|j| recs[j].t0 <= a.t2);
        if !other_waiting {
            continue;
        }
        contested += 1;
        if b.task == a.task {
            barged += 1;
        } else if b.t0 <= a.t2 {
            gaps.push(ms(b.t1.saturating_duration_since(a.t2)));
        }
    }
    if contested > 0 {
        r.barging_share = Some(barged as f64 / contested as f64);
    }
    set_handoffs(r, gaps);
}

/// Which server an implementation talks to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Server {
    /// Embedded (SQLite): nothing to count.
    None,
    /// MariaDB / MySQL.
    MySql,
    /// Redis.
    Redis,
    /// A Redis Cluster: counts are summed over its primaries.
    RedisCluster,
    /// etcd.
    Etcd,
    /// ZooKeeper.
    ZooKeeper,
    /// PostgreSQL.
    Postgres,
}

/// Where the servers are (the test services by default).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Servers {
    /// `mysql://…/db`.
    pub mysql: String,
    /// `redis://host:port`.
    pub redis: String,
    /// `redis+cluster://host:port,…` (the seeds of a Redis Cluster).
    pub redis_cluster: String,
    /// `http://host:port` of etcd.
    pub etcd: String,
    /// `zk://[user:password@]host:port[,host:port…]` of ZooKeeper (a path
    /// or query in it is ignored: every implementation picks its own root).
    pub zookeeper: String,
    /// `postgres://…/db` (its query parameters, e.g. `sslmode`, are kept
    /// and fenced's added to them).
    pub postgres: String,
}

impl Servers {
    /// `FENCED_TEST_MYSQL_URL`, `FENCED_TEST_REDIS_URL`, `FENCED_TEST_ETCD_URL`,
    /// `FENCED_TEST_ZOOKEEPER_URL`, `FENCED_TEST_POSTGRES_URL`, else the
    /// local test services of `scripts/services.sh`
    /// (`mysql://root@127.0.0.1:3306/test`, `redis://127.0.0.1:6379`,
    /// `http://127.0.0.1:2379`, `zk://127.0.0.1:2181`,
    /// `postgres://postgres@127.0.0.1:5432/fenced_test`).
    pub fn from_env() -> Self {
        let env_or = |var: &str, default: &str| {
            std::env::var(var)
                .ok()
                .filter(|v| !v.is_empty())
                .unwrap_or_else(|| default.to_owned())
        };
        Servers {
            mysql: env_or("FENCED_TEST_MYSQL_URL", "mysql://root@127.0.0.1:3306/test"),
            redis: env_or("FENCED_TEST_REDIS_URL", "redis://127.0.0.1:6379"),
            redis_cluster: env_or(
                "FENCED_TEST_REDIS_CLUSTER_URL",
                "redis+cluster://127.0.0.1:7000,127.0.0.1:7001,127.0.0.1:7002",
            ),
            etcd: env_or("FENCED_TEST_ETCD_URL", "http://127.0.0.1:2379"),
            zookeeper: env_or("FENCED_TEST_ZOOKEEPER_URL", "zk://127.0.0.1:2181"),
            postgres: env_or(
                "FENCED_TEST_POSTGRES_URL",
                "postgres://postgres@127.0.0.1:5432/fenced_test",
            ),
        }
    }

    /// The PostgreSQL URL with `params` (`a=b&c=d`) added to its query.
    pub(crate) fn postgres_with(&self, params: &str) -> String {
        let sep = if self.postgres.contains('?') {
            '&'
        } else {
            '?'
        };
        format!("{}{sep}{params}", self.postgres)
    }

    /// The ZooKeeper URL's authority: `[user:password@]host:port,…`.
    fn zookeeper_authority(&self) -> &str {
        let rest = self
            .zookeeper
            .split_once("://")
            .map_or(self.zookeeper.as_str(), |(_, r)| r);
        rest.split(['/', '?', '#']).next().unwrap_or(rest)
    }

    /// A fenced ZooKeeper URL for the namespace `path` (`/…`), on the
    /// servers and credentials of [`Servers::zookeeper`].
    pub(crate) fn zookeeper_url(&self, path: &str) -> String {
        format!("zk://{}{path}", self.zookeeper_authority())
    }

    /// `host:port,…` of ZooKeeper (what `zookeeper-client` connects to) and
    /// the `user:password` of its URL, if any.
    pub(crate) fn zookeeper_hosts(&self) -> (String, Option<&str>) {
        let authority = self.zookeeper_authority();
        let (user, hosts) = match authority.rsplit_once('@') {
            Some((u, h)) => (Some(u), h),
            None => (None, authority),
        };
        let hosts = hosts
            .split(',')
            .map(|h| {
                let bare_v6 = h.starts_with('[') && h.ends_with(']');
                if h.contains(':') && !bare_v6 {
                    h.to_owned()
                } else {
                    format!("{h}:2181")
                }
            })
            .collect::<Vec<_>>()
            .join(",");
        (hosts, user)
    }

    /// The first ZooKeeper server: where the four-letter words go.
    fn zookeeper_first(&self) -> String {
        let (hosts, _) = self.zookeeper_hosts();
        hosts.split(',').next().unwrap_or_default().to_owned()
    }

    /// `host:port` of etcd.
    pub(crate) fn etcd_host_port(&self) -> String {
        let rest = self
            .etcd
            .split_once("://")
            .map_or(self.etcd.as_str(), |(_, r)| r);
        rest.split('/').next().unwrap_or(rest).to_owned()
    }
}

/// Requests clients sent that the server has handled so far (all clients),
/// if cheap to read: [`commands`], except on Redis, whose counts include
/// the commands scripts run inside; there it is the script runs
/// (`EVAL`/`EVALSHA`), which is every request fenced sends.
pub(crate) async fn requests(server: Server, servers: &Servers) -> Option<u64> {
    if !matches!(server, Server::Redis | Server::RedisCluster) {
        return commands(server, servers).await;
    }
    redis_sum(server, servers, "commandstats", |info| {
        info.lines()
            .filter_map(|l| {
                let (name, rest) = l.strip_prefix("cmdstat_")?.split_once(':')?;
                let calls = rest.split("calls=").nth(1)?.split(',').next()?;
                name.starts_with("eval")
                    .then(|| calls.parse::<u64>().ok())?
            })
            .sum()
    })
    .await
}

/// `count` of an `INFO` section of the Redis server, or summed over the
/// primaries of the Redis Cluster (their own clients' work: a replica
/// also counts what it replays).
async fn redis_sum(
    server: Server,
    servers: &Servers,
    section: &str,
    count: impl Fn(&str) -> u64,
) -> Option<u64> {
    if server != Server::RedisCluster {
        return Some(count(&redis_info(servers, section).await?));
    }
    let mut sum = 0;
    for node in cluster_primaries(servers).await.ok()? {
        sum += count(&redis_info_at(&node, section).await?);
    }
    Some(sum)
}

/// A `redis://` URL for every primary of the Redis Cluster, as its first
/// seed names them (`CLUSTER NODES`), with the cluster URL's credentials.
pub(crate) async fn cluster_primaries(servers: &Servers) -> Result<Vec<String>, String> {
    let url = &servers.redis_cluster;
    let rest = url.split_once("://").map_or(url.as_str(), |(_, r)| r);
    let authority = rest.split(['/', '?']).next().unwrap_or(rest);
    let (userinfo, hosts) = match authority.rsplit_once('@') {
        Some((u, h)) => (format!("{u}@"), h),
        None => (String::new(), authority),
    };
    let seed = hosts.split(',').next().unwrap_or(hosts);
    let client = redis::Client::open(format!("redis://{userinfo}{seed}"))
        .map_err(|e| format!("the Redis Cluster seed {seed}: {e}"))?;
    let mut conn = client
        .get_multiplexed_async_connection()
        .await
        .map_err(|e| format!("the Redis Cluster seed {seed}: {e}"))?;
    let nodes: String = redis::cmd("CLUSTER")
        .arg("NODES")
        .query_async(&mut conn)
        .await
        .map_err(|e| format!("CLUSTER NODES on {seed}: {e}"))?;
    let primaries: Vec<String> = nodes
        .lines()
        .filter_map(|l| {
            let mut f = l.split_whitespace();
            let addr = f.nth(1)?.split('@').next()?;
            let flags = f.next()?;
            let (host, port) = addr.rsplit_once(':')?;
            let primary = flags.split(',').any(|x| x == "master") && !flags.contains("fail");
            // A node without an address (`:0`) serves nothing.
            (primary && port != "0").then(|| {
                let host = if host.contains(':') {
                    format!("[{host}]")
                } else {
                    host.to_owned()
                };
                format!("redis://{userinfo}{host}:{port}")
            })
        })
        .collect();
    if primaries.is_empty() {
        return Err(format!("CLUSTER NODES on {seed} names no primaries"));
    }
    Ok(primaries)
}

/// Total commands the server has executed so far (all clients), if cheap to read.
pub(crate) async fn commands(server: Server, servers: &Servers) -> Option<u64> {
    match server {
        Server::None => None,
        Server::Redis | Server::RedisCluster => {
            redis_sum(server, servers, "commandstats", |info| {
                info.lines()
                    .filter_map(|l| l.split("calls=").nth(1))
                    .filter_map(|v| v.split(',').next()?.parse::<u64>().ok())
                    .sum()
            })
            .await
        }
        Server::MySql => mysql_status(servers, "Questions").await,
        Server::Etcd => {
            let body = http_get(&servers.etcd_host_port(), "/metrics").await?;
            Some(
                body.lines()
                    .filter(|l| l.starts_with("grpc_server_started_total{"))
                    .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
                    .sum::<f64>() as u64,
            )
        }
        // Every request a client sends is a packet (pings and session
        // handshakes too, which are few over a cell); ZooKeeper keeps no
        // per-operation counters without its metrics provider.
        Server::ZooKeeper => mntr(servers, "zk_packets_received").await,
        Server::Postgres => postgres_transactions(servers).await,
    }
}

/// Clients connected to the server (all clients), if cheap to read.
pub(crate) async fn connections(server: Server, servers: &Servers) -> Option<u64> {
    match server {
        Server::Redis | Server::RedisCluster => {
            redis_sum(server, servers, "clients", |info| {
                info.lines()
                    .find_map(|l| l.strip_prefix("connected_clients:")?.trim().parse().ok())
                    .unwrap_or(0)
            })
            .await
        }
        Server::MySql => mysql_status(servers, "Threads_connected").await,
        Server::ZooKeeper => mntr(servers, "zk_num_alive_connections").await,
        Server::Postgres => {
            postgres_count(
                servers,
                "SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend'",
            )
            .await
        }
        Server::None | Server::Etcd => None,
    }
}

/// One value of ZooKeeper's `mntr` (a four-letter word: it must be on the
/// server's `4lw.commands.whitelist`, as `scripts/services.sh` puts it).
async fn mntr(servers: &Servers, name: &str) -> Option<u64> {
    four_letter(&servers.zookeeper_first(), "mntr")
        .await?
        .lines()
        .find_map(|l| l.strip_prefix(name)?.trim().parse().ok())
}

/// ZooKeeper's version, from `srvr` (`3.8.0-…, built on …`).
pub(crate) async fn zookeeper_version(servers: &Servers) -> Option<String> {
    four_letter(&servers.zookeeper_first(), "srvr")
        .await?
        .lines()
        .find_map(|l| l.strip_prefix("Zookeeper version:"))
        .map(|v| v.trim().to_owned())
}

/// ZooKeeper's answer to a four-letter word (the server closes the
/// connection after it).
async fn four_letter(host_port: &str, word: &str) -> Option<String> {
    let io = async {
        let mut s = TcpStream::connect(host_port).await.ok()?;
        s.write_all(word.as_bytes()).await.ok()?;
        let mut buf = Vec::new();
        s.read_to_end(&mut buf).await.ok()?;
        Some(String::from_utf8_lossy(&buf).into_owned())
    };
    tokio::time::timeout(Duration::from_secs(3), io)
        .await
        .ok()
        .flatten()
}

/// How long [`postgres_transactions`] waits for the server's statistics to
/// settle, and how often it looks.
const PG_SETTLE: (Duration, Duration) = (Duration::from_secs(3), Duration::from_millis(150));

/// Transactions committed and rolled back in the URL's database so far (all
/// clients): every statement outside `BEGIN … COMMIT` is one, so this
/// counts the autocommit statements of a cell.
///
/// PostgreSQL (15+) counts them in each backend and publishes them to
/// `pg_stat_database` at most once a second, and at once when the backend
/// exits. When a cell ends its connections close, so the counts of its
/// sessions arrive within milliseconds; this reads until two readings
/// 150 ms apart agree (within the reader's own statements), at most 3 s.
async fn postgres_transactions(servers: &Servers) -> Option<u64> {
    use sqlx::Connection;
    let mut conn = sqlx::PgConnection::connect(&servers.postgres).await.ok()?;
    let (bound, every) = PG_SETTLE;
    let until = Instant::now() + bound;
    let mut last = pg_transactions(&mut conn).await?;
    loop {
        tokio::time::sleep(every).await;
        let now = pg_transactions(&mut conn).await?;
        // This session's own statements are published once, at its first
        // reading; a handful more is noise, not a cell still arriving.
        if now.saturating_sub(last) <= 2 || Instant::now() >= until {
            let _ = conn.close().await;
            return Some(now);
        }
        last = now;
    }
}

/// One reading of [`postgres_transactions`]'s counter.
async fn pg_transactions(conn: &mut sqlx::PgConnection) -> Option<u64> {
    use sqlx::Row;
    let row = sqlx::query(
        "SELECT (xact_commit + xact_rollback)::bigint FROM pg_stat_database \
         WHERE datname = current_database()",
    )
    .fetch_one(conn)
    .await
    .ok()?;
    u64::try_from(row.try_get::<i64, _>(0).ok()?).ok()
}

/// One `bigint` from PostgreSQL, on a connection of its own.
async fn postgres_count(servers: &Servers, sql: &'static str) -> Option<u64> {
    use sqlx::{Connection, Row};
    let mut conn = sqlx::PgConnection::connect(&servers.postgres).await.ok()?;
    let row = sqlx::query(sql).fetch_one(&mut conn).await.ok()?;
    let v: i64 = row.try_get(0).ok()?;
    let _ = conn.close().await;
    u64::try_from(v).ok()
}

/// PostgreSQL's version (`SHOW server_version`).
pub(crate) async fn postgres_version(servers: &Servers) -> Option<String> {
    use sqlx::{Connection, Row};
    let mut conn = sqlx::PgConnection::connect(&servers.postgres).await.ok()?;
    let row = sqlx::query("SHOW server_version")
        .fetch_one(&mut conn)
        .await
        .ok()?;
    let v: String = row.try_get(0).ok()?;
    let _ = conn.close().await;
    Some(v)
}

pub(crate) async fn redis_info(servers: &Servers, section: &str) -> Option<String> {
    redis_info_at(&servers.redis, section).await
}

/// `INFO section` of the Redis server at `url`.
async fn redis_info_at(url: &str, section: &str) -> Option<String> {
    let client = redis::Client::open(url).ok()?;
    let mut conn = client.get_multiplexed_async_connection().await.ok()?;
    redis::cmd("INFO")
        .arg(section)
        .query_async::<String>(&mut conn)
        .await
        .ok()
}

async fn mysql_status(servers: &Servers, name: &str) -> Option<u64> {
    use sqlx::{Connection, Row};
    let mut conn = sqlx::MySqlConnection::connect(&servers.mysql).await.ok()?;
    let row = sqlx::query("SHOW GLOBAL STATUS WHERE Variable_name = ?")
        .bind(name)
        .fetch_one(&mut conn)
        .await
        .ok()?;
    let v: String = row.try_get(1).ok()?;
    let _ = conn.close().await;
    v.parse().ok()
}

pub(crate) async fn http_get(host_port: &str, path: &str) -> Option<String> {
    let io = async {
        let mut s = TcpStream::connect(host_port).await.ok()?;
        let req = format!("GET {path} HTTP/1.0\r\nHost: {host_port}\r\n\r\n");
        s.write_all(req.as_bytes()).await.ok()?;
        let mut buf = Vec::new();
        s.read_to_end(&mut buf).await.ok()?;
        let text = String::from_utf8_lossy(&buf).into_owned();
        text.split_once("\r\n\r\n").map(|(_, b)| b.to_owned())
    };
    tokio::time::timeout(Duration::from_secs(3), io)
        .await
        .ok()
        .flatten()
}

/// Resident set size of this process in KiB (Linux `/proc`), else `None`.
pub(crate) fn rss_kib() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn jain_bounds() {
        assert_eq!(jain(&[5, 5, 5, 5]), Some(1.0));
        let one = jain(&[10, 0, 0, 0]).unwrap_or(0.0);
        assert!((one - 0.25).abs() < 1e-9, "{one}");
        assert_eq!(jain(&[0, 0]), None);
    }

    #[test]
    fn zookeeper_addresses() {
        let mut servers = Servers::from_env();
        servers.zookeeper = "zk://127.0.0.1:2181".into();
        assert_eq!(servers.zookeeper_hosts(), ("127.0.0.1:2181".into(), None));
        assert_eq!(servers.zookeeper_url("/b"), "zk://127.0.0.1:2181/b");
        servers.zookeeper = "zookeeper://app:pw@h1,[::1],h2:2182/chroot?session_timeout=5s".into();
        assert_eq!(
            servers.zookeeper_hosts(),
            ("h1:2181,[::1]:2181,h2:2182".into(), Some("app:pw"))
        );
        assert_eq!(
            servers.zookeeper_url("/b"),
            "zk://app:pw@h1,[::1],h2:2182/b"
        );
        assert_eq!(servers.zookeeper_first(), "h1:2181");
    }

    /// Two permits: tasks 0 and 1 hold from 0 ms; task 2 waits from 1 ms
    /// and gets the place task 0 frees at 10 ms, at 13 ms (a 3 ms hand-off);
    /// task 1's release at 20 ms finds nobody waiting (no hand-off).
    #[test]
    fn slot_hand_offs_pair_a_waiter_with_the_release_it_waited_for() {
        let base = Instant::now();
        let at = |ms: u64| base + Duration::from_millis(ms);
        let rec = |task, t0, t1, t2, t3| Rec {
            task,
            t0: at(t0),
            t1: at(t1),
            t2: at(t2),
            t3: at(t3),
        };
        let recs = vec![
            rec(0, 0, 0, 10, 11),
            rec(1, 0, 0, 20, 21),
            rec(2, 1, 13, 30, 31),
        ];
        let s = crate::Profile::Smoke
            .scenarios()
            .into_iter()
            .find(Scenario::is_family)
            .expect("a family cell in the smoke profile");
        let mut r = CellResult::empty("x", Kind::Fenced, &s);
        slot_handoffs(&mut r, &recs);
        assert_eq!(r.handoff_samples, 1);
        assert_eq!(r.handoff_p50_ms, Some(3.0));
    }

    #[test]
    fn quantiles() {
        let v = [1.0, 2.0, 3.0, 4.0, 5.0];
        assert_eq!(quantile(&v, 0.0), 1.0);
        assert_eq!(quantile(&v, 0.5), 3.0);
        assert_eq!(quantile(&v, 1.0), 5.0);
        assert_eq!(quantile(&[], 0.5), 0.0);
    }
}
