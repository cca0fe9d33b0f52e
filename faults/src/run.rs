//! The stages every run shares, whether its clients are threads of this
//! process or separate processes: where a target's clients reach it, the
//! set-up of the store, the start of the store's own record, and liveness,
//! the checks and the cleanup once the clients are done.

use std::{net::SocketAddr, sync::Arc, time::Duration};

use fenced_api::{LockClient, WaitPolicy};
use tokio::time::Instant;

use crate::{
    history::{belief_overlaps, Event, History, Op, Phase},
    model::{FaultKind, Primitive, RunConfig, RunResult, Target},
    resource::FencedResource,
    servers::PrivateStore,
    truth::Recorder,
};

impl Target {
    /// The shared server's URL and `host:port` (from the test environment).
    fn server(self) -> Option<(String, u16)> {
        use fenced_conformance::services;
        match self {
            Target::Sqlite => None,
            Target::MySqlUniqueKey | Target::MySqlRowLock | Target::MySqlOptimistic => Some((
                // The private MariaDB with a binary log, while one is in use (server truth).
                crate::truth::binlog::server_url().unwrap_or_else(services::mysql_url),
                3306,
            )),
            Target::Redis => Some((services::redis_url(), 6379)),
            Target::Etcd => Some((services::etcd_url(), 2379)),
            Target::ZooKeeper => Some((
                // The private ZooKeeper whose transaction log this process
                // reads, while one is in use (server truth).
                crate::truth::zookeeper::server_url().unwrap_or_else(services::zookeeper_url),
                2181,
            )),
            // Server truth needs no server of its own here: the audit is a
            // table the runner adds to the run's namespace (truth/postgres.rs).
            Target::PostgresLease | Target::PostgresAdvisory => {
                Some((services::postgres_url(), 5432))
            }
            Target::RedisCluster => Some((services::redis_cluster_url(), 7000)),
            // Always a private primary, replica and sentinel.
            Target::RedisSentinel => None,
        }
    }

    /// The URL of this target in namespace `ns`, through `via` if given
    /// (each upstream and the proxy port in front of it: one for a server,
    /// one per node for a Redis Cluster, whose nodes' announced addresses
    /// the URL then maps to their proxies);
    /// on the private server at `private` (its base URL) if given. `ttl` is
    /// the runs' lock TTL: ZooKeeper clients ask for a session that long.
    pub(crate) fn url(
        self,
        ns: &str,
        via: Option<&[(SocketAddr, SocketAddr)]>,
        dir: &std::path::Path,
        private: Option<&str>,
        ttl: Duration,
    ) -> Result<String, String> {
        if self == Target::Sqlite {
            return Ok(format!("sqlite://{}", dir.join("faults.db").display()));
        }
        let base = match (self.server(), private) {
            // A Sentinel group's primary through the proxy: the sentinel
            // names the primary's own address, which the URL maps.
            (_, Some(p)) if self == Target::RedisSentinel && via.is_some() => {
                let map: Vec<String> = via
                    .unwrap_or_default()
                    .iter()
                    .map(|(up, px)| format!("{up}>{px}"))
                    .collect();
                return Ok(format!("{p}?prefix=ff{ns}&address_map={}", map.join(",")));
            }
            (_, Some(p)) => p.to_owned(),
            (None, None) => return Err(format!("{}: its runs need a private server", self.name())),
            (Some((url, port)), None) => match via {
                Some(routes) if self == Target::RedisCluster => {
                    let seed = routes.first().ok_or("a cluster proxy without routes")?.1;
                    let map: Vec<String> =
                        routes.iter().map(|(up, px)| format!("{up}>{px}")).collect();
                    return Ok(format!(
                        "redis+cluster://{seed}?prefix=ff{ns}&address_map={}",
                        map.join(",")
                    ));
                }
                Some(routes) => {
                    let hp = fenced_conformance::services::host_port(&url, port)?;
                    let px = routes.first().ok_or("a proxy without routes")?.1;
                    url.replacen(&hp, &px.to_string(), 1)
                }
                None => url,
            },
        };
        Ok(match self {
            Target::Sqlite => unreachable!("handled above"),
            Target::MySqlUniqueKey => format!("{base}?strategy=unique_key&table=ff_{ns}"),
            Target::MySqlRowLock => format!("{base}?strategy=row_lock&table=ff_{ns}"),
            Target::MySqlOptimistic => format!("{base}?strategy=optimistic&table=ff_{ns}"),
            Target::Redis | Target::RedisCluster | Target::RedisSentinel => {
                format!("{base}?prefix=ff{ns}")
            }
            Target::Etcd => {
                let hp = base
                    .trim_start_matches("http://")
                    .trim_start_matches("etcd://")
                    .trim_end_matches('/');
                format!("etcd://{hp}/fenced-faults-{ns}")
            }
            Target::ZooKeeper => {
                // A session as long as the TTL: the session is what frees
                // the key of a holder that cannot delete its node (dead,
                // frozen, cut off), so a session timeout equal to the TTL
                // keeps those takeovers as quick as the store allows while
                // never shorter than a lock (a lock may not outlive its
                // session).
                let rest = base.split_once("://").map_or(base.as_str(), |(_, r)| r);
                let hosts = rest.split(['/', '?']).next().unwrap_or(rest);
                format!(
                    "zk://{hosts}/fenced-faults-{ns}?session_timeout={}ms",
                    ttl.as_millis()
                )
            }
            // Plain TCP on loopback, as every other store here: through
            // TLS a reply the proxy drops would break the record stream
            // (a MAC error) instead of going missing.
            Target::PostgresLease | Target::PostgresAdvisory => {
                let strategy = if self == Target::PostgresLease {
                    "lease"
                } else {
                    "advisory"
                };
                let sep = if base.contains('?') { '&' } else { '?' };
                format!("{base}{sep}strategy={strategy}&table=ff_{ns}&sslmode=disable")
            }
        })
    }

    /// Where each client's proxy forwards to: the server, or every node of
    /// the shared Redis Cluster (as the cluster names them, replicas
    /// included: a failover may promote one). Empty: no proxy.
    pub(crate) async fn upstreams(self) -> Result<Vec<SocketAddr>, String> {
        if !self.proxied() {
            return Ok(Vec::new());
        }
        let Some((url, port)) = self.server() else {
            return Ok(Vec::new());
        };
        if self == Target::RedisCluster {
            return crate::truth::redis::cluster_nodes(&url).await;
        }
        let hp = fenced_conformance::services::host_port(&url, port)?;
        let hp = hp.replace("localhost", "127.0.0.1");
        hp.parse()
            .map(|a| vec![a])
            .map_err(|e| format!("{} server address `{hp}`: {e}", self.name()))
    }
}

/// What every run sets up before its clients start: a namespace, the
/// migrated store.
pub(crate) struct Prepared {
    pub(crate) dir: tempfile::TempDir,
    pub(crate) ns: String,
    pub(crate) admin_url: String,
    pub(crate) private: Option<Arc<PrivateStore>>,
    pub(crate) key: String,
}

impl Prepared {
    /// The store URL for a client (through `via` if given).
    pub(crate) fn url(
        &self,
        cfg: &RunConfig,
        via: Option<&[(SocketAddr, SocketAddr)]>,
    ) -> Result<String, String> {
        let base = self.private.as_ref().map(|p| p.base_url());
        cfg.target
            .url(&self.ns, via, self.dir.path(), base.as_deref(), cfg.ttl)
    }

    /// Where mutants share what they share.
    pub(crate) fn mutant_dir(&self) -> std::path::PathBuf {
        self.dir.path().join("mutant")
    }
}

pub(crate) async fn prepare(cfg: &RunConfig) -> Result<Prepared, String> {
    let dir = tempfile::tempdir().map_err(|e| format!("temporary directory: {e}"))?;
    let ns = format!(
        "{}_{}",
        &uuid::Uuid::new_v4().simple().to_string()[..8],
        cfg.seed
    );
    let private = PrivateStore::for_run(cfg.target, cfg.fault)
        .await?
        .map(Arc::new);
    let base = private.as_ref().map(|p| p.base_url());
    let admin_url = cfg
        .target
        .url(&ns, None, dir.path(), base.as_deref(), cfg.ttl)?;
    let setup = async {
        fenced::migrate(&admin_url).await?;
        fenced::connect(&admin_url).await.map(drop)
    };
    setup.await.map_err(|e| {
        format!(
            "{}: setting up failed ({e}); are the services up? run scripts/services.sh",
            cfg.target.name()
        )
    })?;
    Ok(Prepared {
        dir,
        ns,
        admin_url,
        private,
        key: format!("faults/{}", cfg.fault.name(cfg.target)),
    })
}

/// Starts the store's own record of the run (server truth, truth.rs);
/// before the clients start.
pub(crate) async fn start_recorder(
    cfg: &RunConfig,
    prep: &Prepared,
    history: &History,
) -> Result<Recorder, String> {
    if cfg.fault.kind() == FaultKind::Server && !cfg.target.is_postgres() {
        // Restarts and kills break a MONITOR stream or a watch; the
        // private servers of these faults keep no binary log, and a leader
        // kill leaves a ZooKeeper transaction log spread over the members.
        // PostgreSQL's audit is committed with the lock rows it records,
        // so it survives a crash and a terminated session as they do.
        return Ok(Recorder::None(SERVER_FAULT_REASON));
    }
    if cfg.primitive != Primitive::Mutex {
        return crate::truth::holders::Sampler::start(
            &prep.admin_url,
            &prep.key,
            cfg.primitive,
            history,
        )
        .await
        .map(|s| Recorder::Holders(Box::new(s)));
    }
    Recorder::start(
        cfg.target,
        &prep.admin_url,
        &prep.key,
        prep.dir.path(),
        history,
    )
    .await
}

/// Why server faults have no server truth (but on PostgreSQL, whose audit
/// table is part of the data the fault leaves behind).
pub const SERVER_FAULT_REASON: &str =
    "server faults run on a private server that the fault restarts or kills (which breaks a MONITOR stream or a watch), and neither the binary log of a MariaDB nor the transaction logs of a ZooKeeper is kept or read there";

/// What the clients of a run collected, however they ran.
pub(crate) struct Collected {
    pub(crate) history: History,
    /// The store's own record of the run (started before the clients).
    pub(crate) recorder: Recorder,
    pub(crate) resource: Arc<FencedResource>,
    pub(crate) loss_latency_ms: Vec<f64>,
    pub(crate) errors: Vec<String>,
    pub(crate) transient: u64,
    pub(crate) evidence: Vec<String>,
    pub(crate) confirmed: u64,
    pub(crate) lock_conflicts: Option<(u64, u64)>,
}

/// Liveness, the checks and the cleanup after the clients are done.
pub(crate) async fn finish(
    cfg: RunConfig,
    prep: Prepared,
    mut c: Collected,
) -> Result<RunResult, String> {
    // Liveness: a fresh client, straight to the server, gets the key.
    let liveness_ms = match liveness(&prep.admin_url, &prep.key, cfg.ttl, cfg.primitive).await {
        Ok(ms) => Some(ms),
        Err(e) => {
            c.errors.push(e);
            None
        }
    };
    let events = c.history.events();
    // Server truth: what the store itself recorded (truth.rs).
    let recorder = std::mem::replace(&mut c.recorder, Recorder::None(""));
    let server_truth = recorder.finish(&events).await?;
    // Beliefs beyond what the key allows: pairs under the mutex, spans
    // beyond the permits or a writer beside anyone in the family (ns).
    let overlaps: Vec<u64> = match cfg.primitive {
        Primitive::Mutex => belief_overlaps(&events).iter().map(|o| o.ns).collect(),
        p => crate::checks::family_belief_excess(&events, p),
    };
    let faults = events
        .iter()
        .filter(|e| e.op == Op::Fault && e.phase == Phase::Invoke)
        .count() as u64;
    let result = RunResult {
        acquisitions: count(&events, Op::Acquire, Phase::Ok),
        faults,
        belief_overlaps: overlaps.len(),
        belief_overlap_max_ms: overlaps
            .iter()
            .map(|ns| *ns as f64 / 1e6)
            .fold(0.0, f64::max),
        resource: c.resource.totals(),
        server_truth,
        non_owner_releases: match cfg.primitive {
            Primitive::Mutex => non_owner_releases(&events),
            p => family_non_owner_releases(&events, p),
        },
        loss_latency_ms: c.loss_latency_ms,
        liveness_ms,
        errors: c.errors,
        transient_errors: c.transient,
        confirmed_faults: if cfg.fault.kind() == FaultKind::InProcess {
            faults
        } else {
            c.confirmed
        },
        evidence: c.evidence,
        token_regressions: crate::checks::token_regressions(&events),
        forbidden_overlaps: if cfg.fault.forbids_overlap(cfg.target) {
            overlaps.len()
        } else {
            0
        },
        victim_noticed_loss: crate::checks::victim_noticed_loss(&events),
        takeover_ms: crate::checks::family_takeover_ms(&events, cfg.primitive),
        lock_conflicts: c.lock_conflicts,
        commit: None,
        elapsed_s: None,
        history: c.history.to_jsonl(),
        config: cfg,
    };
    cleanup(&prep.admin_url).await;
    Ok(result)
}

fn count(events: &[Event], op: Op, phase: Phase) -> u64 {
    events
        .iter()
        .filter(|e| e.op == op && e.phase == phase)
        .count() as u64
}

/// Releases the store confirmed although a later token had been granted on
/// the key before the release was even sent: the store freed a lock that
/// was no longer the releaser's.
pub fn non_owner_releases(events: &[Event]) -> usize {
    overtaken_releases(events, |_, _| true)
}

/// Releases confirmed although a grant with a later token that `overtakes`
/// (the releaser's acquire detail, the grant) had come before the release
/// was sent.
fn overtaken_releases(events: &[Event], overtakes: impl Fn(&str, &Event) -> bool) -> usize {
    let mut invoked: std::collections::HashMap<(usize, u64), u64> = Default::default();
    let mut roles: std::collections::HashMap<(usize, u64), &str> = Default::default();
    let mut n = 0;
    for e in events {
        match (e.op, e.phase, e.token) {
            (Op::Acquire, Phase::Ok, Some(t)) => {
                roles.insert((e.process, t), e.detail.as_str());
            }
            (Op::Release, Phase::Invoke, Some(t)) => {
                invoked.insert((e.process, t), e.t_ns);
            }
            (Op::Release, Phase::Ok, Some(t)) => {
                let sent = invoked.get(&(e.process, t)).copied().unwrap_or(e.t_ns);
                let role = roles.get(&(e.process, t)).copied().unwrap_or("");
                let overtaken = events.iter().any(|o| {
                    o.op == Op::Acquire
                        && o.phase == Phase::Ok
                        && o.key == e.key
                        && o.token.is_some_and(|ot| ot > t)
                        && o.t_ns < sent
                        && overtakes(role, o)
                });
                if overtaken {
                    n += 1;
                }
            }
            _ => {}
        }
    }
    n
}

/// The family's releases the store confirmed for a holder already
/// overtaken: on a reader-writer lock, a writer whose release was sent
/// after any later grant, a reader whose release was sent after a later
/// writer's grant. (A semaphore's later permits do not end earlier ones:
/// nothing to judge there.)
pub fn family_non_owner_releases(events: &[Event], primitive: Primitive) -> usize {
    if primitive != Primitive::ReadWrite {
        return 0;
    }
    overtaken_releases(events, |releaser, grant| {
        releaser != "read" || grant.detail == "write"
    })
}

/// How long a fresh client needed for the key; why it could not get it.
async fn liveness(
    url: &str,
    key: &str,
    ttl: Duration,
    primitive: Primitive,
) -> Result<f64, String> {
    let lock = fenced::connect(url)
        .await
        .map_err(|e| format!("liveness: connect: {e}"))?;
    let client = LockClient::builder(Arc::clone(&lock))
        .ttl(ttl)
        .build()
        .map_err(|e| format!("liveness: {e}"))?;
    let start = Instant::now();
    let wait = WaitPolicy::Timeout(ttl * 4);
    let held = match primitive {
        Primitive::Mutex => client.acquire_with(key, wait).await.map(|g| vec![g]),
        // The whole of a reader-writer lock: nobody left holding anything.
        Primitive::ReadWrite => match client.rw_lock(key) {
            Ok(rw) => rw.write_with(wait).await.map(|g| vec![g]),
            Err(e) => Err(e),
        },
        // Every permit, each through a client of its own (a client holds
        // a key once): a dead holder's permit must have come back too, not
        // only a free one.
        Primitive::Semaphore => {
            let mut all = Vec::new();
            for _ in 0..crate::model::SEMAPHORE_PERMITS {
                let acquired = match LockClient::builder(Arc::clone(&lock)).ttl(ttl).build() {
                    Ok(c) => match c.semaphore(key, crate::model::SEMAPHORE_PERMITS) {
                        Ok(s) => s.acquire_with(wait).await,
                        Err(e) => Err(e),
                    },
                    Err(e) => Err(e),
                };
                match acquired {
                    Ok(g) => all.push(g),
                    Err(e) => {
                        for g in all {
                            let _ = g.release().await;
                        }
                        return Err(format!("liveness: acquire: {e}"));
                    }
                }
            }
            Ok(all)
        }
    }
    .map_err(|e| format!("liveness: acquire: {e}"))?;
    let ms = start.elapsed().as_secs_f64() * 1e3;
    for g in held {
        let _ = g.release().await;
    }
    Ok(ms)
}

/// Drops the run's MySQL and PostgreSQL tables and ZooKeeper namespace
/// (Redis keys and etcd leases expire by themselves; SQLite lives in a
/// temporary directory).
async fn cleanup(url: &str) {
    use sqlx::Connection as _;
    if url.starts_with("zk://") {
        return crate::truth::zookeeper::remove_namespace(url).await;
    }
    if url.starts_with("postgres://") || url.starts_with("postgresql://") {
        return crate::truth::postgres::drop_namespace(url).await;
    }
    let Some(table) = url.split("table=").nth(1) else {
        return;
    };
    let base = url.split('?').next().unwrap_or(url);
    if let Ok(mut c) = sqlx::MySqlConnection::connect(base).await {
        let _ = sqlx::query(sqlx::AssertSqlSafe(format!(
            "DROP TABLE IF EXISTS `{table}`, `{table}_migrations`, `{table}_audit`, \
             `{table}_optimistic`, `{table}_rows`, `{table}_fence`, `{table}_live`, \
             `{table}_permits`, `{table}_permit_keys`"
        )))
        .execute(&mut c)
        .await;
    }
}
