//! The fault scenarios and the runner of one seeded run.
//!
//! A run: `clients` lock clients contend for one key on one backend, each on
//! its own OS thread with its own single-threaded tokio runtime, each
//! talking to the store through its own [`FaultProxy`]. Holders do a read –
//! work – write on a [`FencedResource`]. Client 0 is the *victim*: while it
//! holds the lock it suffers the run's fault. Because the victim's runtime
//! is its own thread, freezing that thread freezes its watchdog too — the
//! in-process equivalent of a SIGSTOP (the network side of the same fault
//! is a blackhole, which the proxy provides).
//!
//! Afterwards a fresh client must get the key (liveness after the fault),
//! and the history is checked: client-belief overlaps (counted, measured),
//! stale writes accepted and lost updates (must be 0 with fencing), releases
//! the store accepted from a holder that had already been overtaken (must be
//! 0).

use std::{
    net::SocketAddr,
    sync::{Arc, Mutex},
    time::Duration,
};

use fenced_api::{Error, LockClient, WaitPolicy};
use serde::{Deserialize, Serialize};
use tokio::time::Instant;

use crate::{
    history::{belief_overlaps, Event, History, Op, Phase, ServerTruth},
    mutant::Mutant,
    proxy::{Direction, FaultProxy},
    resource::{FencedResource, ResourceTotals, WriteOutcome},
    servers::PrivateStore,
    truth::Recorder,
};

/// A store under test.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Target {
    /// The embedded SQLite file (no network: only process faults apply).
    Sqlite,
    /// MySQL/MariaDB, unique-key strategy.
    MySqlUniqueKey,
    /// MySQL/MariaDB, row-lock strategy.
    MySqlRowLock,
    /// MySQL/MariaDB, optimistic strategy.
    MySqlOptimistic,
    /// Redis.
    Redis,
    /// etcd.
    Etcd,
}

impl Target {
    /// Every target.
    pub const ALL: [Target; 6] = [
        Target::Sqlite,
        Target::MySqlUniqueKey,
        Target::MySqlRowLock,
        Target::MySqlOptimistic,
        Target::Redis,
        Target::Etcd,
    ];

    /// Its name in reports.
    pub fn name(self) -> &'static str {
        match self {
            Target::Sqlite => "sqlite",
            Target::MySqlUniqueKey => "mysql-unique_key",
            Target::MySqlRowLock => "mysql-row_lock",
            Target::MySqlOptimistic => "mysql-optimistic",
            Target::Redis => "redis",
            Target::Etcd => "etcd",
        }
    }

    fn networked(self) -> bool {
        self != Target::Sqlite
    }

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
        }
    }

    /// The URL of this target in namespace `ns`, through `via` if given;
    /// on the private server at `private` (its base URL) if given.
    pub(crate) fn url(
        self,
        ns: &str,
        via: Option<SocketAddr>,
        dir: &std::path::Path,
        private: Option<&str>,
    ) -> Result<String, String> {
        let base = match (self.server(), private) {
            (None, _) => return Ok(format!("sqlite://{}", dir.join("faults.db").display())),
            (Some(_), Some(p)) => p.to_owned(),
            (Some((url, port)), None) => {
                let hp = fenced_conformance::services::host_port(&url, port)?;
                match via {
                    Some(a) => url.replacen(&hp, &a.to_string(), 1),
                    None => url,
                }
            }
        };
        Ok(match self {
            Target::Sqlite => unreachable!("handled above"),
            Target::MySqlUniqueKey => format!("{base}?strategy=unique_key&table=ff_{ns}"),
            Target::MySqlRowLock => format!("{base}?strategy=row_lock&table=ff_{ns}"),
            Target::MySqlOptimistic => format!("{base}?strategy=optimistic&table=ff_{ns}"),
            Target::Redis => format!("{base}?prefix=ff{ns}"),
            Target::Etcd => {
                let hp = base
                    .trim_start_matches("http://")
                    .trim_start_matches("etcd://")
                    .trim_end_matches('/');
                format!("etcd://{hp}/fenced-faults-{ns}")
            }
        })
    }

    fn upstream(self) -> Result<Option<SocketAddr>, String> {
        let Some((url, port)) = self.server() else {
            return Ok(None);
        };
        let hp = fenced_conformance::services::host_port(&url, port)?;
        let hp = hp.replace("localhost", "127.0.0.1");
        hp.parse()
            .map(Some)
            .map_err(|e| format!("{} server address `{hp}`: {e}", self.name()))
    }
}

/// The fault the victim suffers while it holds the lock.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Fault {
    /// None: heavy contention only.
    Contention,
    /// The holder's whole runtime freezes for 2 × TTL (SIGSTOP), then resumes
    /// and writes as if nothing happened.
    PausePastTtl,
    /// Four freezes of 0.5 × TTL: renewals are late but in time.
    ShortStalls,
    /// The holder's network vanishes (no RST) for 2 × TTL while it keeps
    /// working, then comes back.
    BlackholePastTtl,
    /// The holder's connections are cut once, mid-hold (shorter than TTL).
    ConnectionCut,
    /// The reply to the holder's acquire arrives 1.5 × TTL late.
    ReplyDelayedPastTtl,
    /// Every request of the holder (renewals) travels 0.6 × TTL late.
    RenewalsDelayed,
    /// The store grants the acquire but the reply is lost.
    LostAcquireAck,
    /// The holder dies holding the lock (no release, no more traffic).
    KillHolder,
    /// A storm of acquire futures dropped mid-flight.
    DroppedAcquires,
    /// A busy loop starves the holder's runtime (and its watchdog) for
    /// 1.5 × TTL.
    StarvedWatchdog,
    /// Real client processes; the holder is SIGSTOPped for 2 × TTL mid
    /// read–write, then SIGCONTed (its write must be refused).
    ProcessStop,
    /// Real client processes; the holder is SIGKILLed mid-hold (the others
    /// must get the key, after the TTL at the latest).
    ProcessKill,
    /// Real client processes under libfaketime: one at −1 h holds through
    /// renewals (nobody may take it early), one at +1 h is SIGKILLed
    /// holding (the key must not stay taken for its clock's hour).
    ClockSkew,
    /// The server (private) is SIGKILLed and restarted while a client holds.
    ServerRestart,
    /// As [`Fault::ServerRestart`], on a Redis with AOF `appendfsync always`.
    ServerRestartAof,
    /// The leader of a private 3-member etcd cluster is SIGKILLed while a
    /// client holds.
    LeaderKill,
    /// `KILL <id>` of the `row_lock` holder's connection on the server.
    KillConnection,
    /// 16 clients on one key on a MariaDB with `innodb_lock_wait_timeout = 1`,
    /// every third holder dying, and a conflict injector that makes fenced's
    /// statements deadlock victims (1213) and lets them time out (1205):
    /// neither must ever read as a grant, a renewal or a release.
    LockStorm,
}

/// How long a [`Fault::LockStorm`] run contends (other faults: from the TTL).
pub const STORM_BUDGET: Duration = Duration::from_secs(8);

/// Where a fault's clients run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultKind {
    /// Threads of this process, against the shared servers, through proxies.
    InProcess,
    /// Separate client processes (the `fenced-faults-client` binary).
    Processes,
    /// Threads of this process against a private server the fault breaks.
    Server,
}

impl Fault {
    /// Every fault.
    pub const ALL: [Fault; 19] = [
        Fault::Contention,
        Fault::PausePastTtl,
        Fault::ShortStalls,
        Fault::BlackholePastTtl,
        Fault::ConnectionCut,
        Fault::ReplyDelayedPastTtl,
        Fault::RenewalsDelayed,
        Fault::LostAcquireAck,
        Fault::KillHolder,
        Fault::DroppedAcquires,
        Fault::StarvedWatchdog,
        Fault::ProcessStop,
        Fault::ProcessKill,
        Fault::ClockSkew,
        Fault::ServerRestart,
        Fault::ServerRestartAof,
        Fault::LeaderKill,
        Fault::KillConnection,
        Fault::LockStorm,
    ];

    /// Its name in reports.
    pub fn name(self) -> &'static str {
        match self {
            Fault::Contention => "contention",
            Fault::PausePastTtl => "pause-past-ttl",
            Fault::ShortStalls => "short-stalls",
            Fault::BlackholePastTtl => "blackhole-past-ttl",
            Fault::ConnectionCut => "connection-cut",
            Fault::ReplyDelayedPastTtl => "reply-delayed-past-ttl",
            Fault::RenewalsDelayed => "renewals-delayed",
            Fault::LostAcquireAck => "lost-acquire-ack",
            Fault::KillHolder => "kill-holder",
            Fault::DroppedAcquires => "dropped-acquires",
            Fault::StarvedWatchdog => "starved-watchdog",
            Fault::ProcessStop => "process-sigstop",
            Fault::ProcessKill => "process-sigkill",
            Fault::ClockSkew => "client-clock-skew",
            Fault::ServerRestart => "server-restart",
            Fault::ServerRestartAof => "server-restart-aof-always",
            Fault::LeaderKill => "etcd-leader-kill",
            Fault::KillConnection => "server-kill-connection",
            Fault::LockStorm => "lock-conflict-storm",
        }
    }

    /// Whether the fault hits a holder (between its read and its write)
    /// rather than an acquire: such a fault waits for the victim's next
    /// hold, and an acquire that fails does not spend it.
    pub fn hits_a_holder(self) -> bool {
        // Exhaustive, like `while_holding`: a new fault must be placed.
        match self {
            Fault::PausePastTtl
            | Fault::ShortStalls
            | Fault::StarvedWatchdog
            | Fault::BlackholePastTtl
            | Fault::ConnectionCut
            | Fault::RenewalsDelayed
            | Fault::KillHolder
            | Fault::ServerRestart
            | Fault::ServerRestartAof
            | Fault::LeaderKill
            | Fault::KillConnection => true,
            Fault::Contention
            | Fault::ReplyDelayedPastTtl
            | Fault::LostAcquireAck
            | Fault::DroppedAcquires
            | Fault::LockStorm
            | Fault::ProcessStop
            | Fault::ProcessKill
            | Fault::ClockSkew => false,
        }
    }

    /// Where its clients run.
    pub fn kind(self) -> FaultKind {
        match self {
            Fault::ProcessStop | Fault::ProcessKill | Fault::ClockSkew => FaultKind::Processes,
            Fault::ServerRestart
            | Fault::ServerRestartAof
            | Fault::LeaderKill
            | Fault::KillConnection
            | Fault::LockStorm => FaultKind::Server,
            _ => FaultKind::InProcess,
        }
    }

    /// Whether the run needs a private server.
    pub fn needs_private_server(self) -> bool {
        self.kind() == FaultKind::Server
    }

    /// Whether two clients believing they hold the key at once is a
    /// violation under this fault on `target`: nobody is frozen or cut off,
    /// or the store keeps its locks through the fault. (Under a pause, a
    /// partition, or a Redis restart that forgets locks, such overlaps are
    /// what fencing is for; they are counted, not forbidden.)
    pub fn forbids_overlap(self, target: Target) -> bool {
        match self {
            Fault::Contention | Fault::ClockSkew | Fault::LockStorm => true,
            // Durable stores keep the lease through a restart; a row_lock
            // transaction dies with the server (the holder learns at its
            // next renewal) and a Redis without persistence forgets.
            Fault::ServerRestart => matches!(
                target,
                Target::MySqlUniqueKey | Target::MySqlOptimistic | Target::Etcd
            ),
            Fault::ServerRestartAof | Fault::LeaderKill => true,
            _ => false,
        }
    }

    /// Whether the fault can be injected on `target` (network faults need a
    /// network).
    pub fn applies_to(self, target: Target) -> bool {
        let mysql = matches!(
            target,
            Target::MySqlUniqueKey | Target::MySqlRowLock | Target::MySqlOptimistic
        );
        match self {
            Fault::ServerRestart => return target != Target::Sqlite,
            Fault::ServerRestartAof => return target == Target::Redis,
            Fault::LeaderKill => return target == Target::Etcd,
            Fault::KillConnection => return target == Target::MySqlRowLock,
            Fault::LockStorm => return mysql,
            // SQLite's clock is the calling process's wall clock (the store
            // runs inside the client): a client with a skewed clock *is* a
            // store with a skewed clock. Documented in fenced-sqlite; the
            // short profile shows it as a control.
            Fault::ClockSkew => return target != Target::Sqlite,
            _ => {}
        }
        !matches!(
            self,
            Fault::BlackholePastTtl
                | Fault::ConnectionCut
                | Fault::ReplyDelayedPastTtl
                | Fault::RenewalsDelayed
                | Fault::LostAcquireAck
        ) || target.networked()
    }
}

/// One run's settings.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RunConfig {
    /// The store.
    pub target: Target,
    /// The fault.
    pub fault: Fault,
    /// Seed of every random choice of the run.
    pub seed: u64,
    /// Whether the resource checks tokens (off only for the control runs).
    pub fencing: bool,
    /// Contending clients (the victim included).
    pub clients: usize,
    /// Lease TTL.
    pub ttl: Duration,
    /// How many times the victim suffers the fault.
    pub injections: usize,
    /// A deliberately broken lock instead of the real one (control runs).
    pub mutant: Option<Mutant>,
    /// The `fenced-faults-client` binary for the process faults (default:
    /// next to the running executable).
    #[serde(skip)]
    pub client_bin: Option<std::path::PathBuf>,
}

impl RunConfig {
    /// The default run of `fault` on `target`.
    pub fn new(target: Target, fault: Fault, seed: u64) -> Self {
        RunConfig {
            target,
            fault,
            seed,
            fencing: true,
            clients: if fault == Fault::LockStorm { 16 } else { 4 },
            ttl: Duration::from_millis(match (target, fault) {
                (Target::Etcd, _) => 2_000,
                (_, Fault::LockStorm) => 300,
                _ => 600,
            }),
            injections: 1,
            mutant: None,
            client_bin: None,
        }
    }

    /// Whether this is a control run (fencing off or a mutant): it must be
    /// caught, not pass.
    pub fn is_control(&self) -> bool {
        !self.fencing || self.mutant.is_some()
    }
}

/// What one run found.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RunResult {
    /// The settings.
    pub config: RunConfig,
    /// Acquisitions granted.
    pub acquisitions: u64,
    /// Faults injected.
    pub faults: u64,
    /// Pairs of clients that both believed they held the key.
    pub belief_overlaps: usize,
    /// The longest such overlap, ms.
    pub belief_overlap_max_ms: f64,
    /// The resource's totals (stale writes accepted must be 0 with fencing).
    pub resource: ResourceTotals,
    /// Grants as the store recorded them, checked (`None`: this store has
    /// no audit yet).
    pub server_truth: Option<ServerTruth>,
    /// Releases the store reported done for a holder already overtaken.
    pub non_owner_releases: usize,
    /// Loss signals: time from the lease's local deadline to the signal, ms
    /// (negative: noticed before the deadline).
    pub loss_latency_ms: Vec<f64>,
    /// How long a fresh client needed to get the key after the run, ms
    /// (`None`: it did not get it within 4 × TTL).
    pub liveness_ms: Option<f64>,
    /// Errors other than wait timeouts and retryable ones (sample).
    pub errors: Vec<String>,
    /// Acquires that failed with a retryable error (overload, a connection
    /// cut by the fault) — the caller's "try again".
    pub transient_errors: u64,
    /// Faults the run saw really happen (a process found stopped, a
    /// server with a new pid, a new etcd leader, a killed connection).
    pub confirmed_faults: u64,
    /// How each fault was confirmed, and what the victim saw.
    pub evidence: Vec<String>,
    /// Grants whose token did not exceed a token already granted (and
    /// acknowledged) before the grant was requested: must be 0.
    pub token_regressions: usize,
    /// Belief overlaps under a fault where none is allowed (see
    /// [`Fault::forbids_overlap`]): must be 0.
    pub forbidden_overlaps: usize,
    /// Whether the victim learnt that its lease was gone (a loss signal,
    /// a refused release or write) in the hold that suffered the fault.
    pub victim_noticed_loss: Option<bool>,
    /// From the kill of a holder to the next grant to another client, ms.
    pub takeover_ms: Option<f64>,
    /// Deadlocks (1213) and lock-wait timeouts (1205) the server counted
    /// during a storm.
    pub lock_conflicts: Option<(u64, u64)>,
    /// The commit of the code that ran (`fenced-faults` fills it in; runs
    /// of a resumed profile can come from several).
    #[serde(default)]
    pub commit: Option<String>,
    /// Wall time of the run, set-up and checks included, seconds.
    #[serde(default)]
    pub elapsed_s: Option<f64>,
    /// The history, as JSON lines.
    #[serde(skip)]
    pub history: String,
}

impl RunResult {
    /// Whether the run kept every safety property.
    pub fn is_safe(&self) -> bool {
        self.resource.accepted_stale == 0
            && self.resource.lost_updates == 0
            && self.non_owner_releases == 0
            && self.token_regressions == 0
            && self.forbidden_overlaps == 0
            && self.server_truth.is_none_or(|t| {
                t.overlaps == 0 && t.token_regressions == 0 && t.unmatched_client_grants == 0
            })
    }
}

struct Ctx {
    cfg: RunConfig,
    url: String,
    key: String,
    history: History,
    resource: Arc<FencedResource>,
    proxy: Option<Arc<FaultProxy>>,
    until: Until,
    loss_latency_ms: Arc<Mutex<Vec<f64>>>,
    errors: Arc<Mutex<Vec<String>>>,
    transient: Arc<std::sync::atomic::AtomicU64>,
    server: Option<Arc<PrivateStore>>,
    evidence: Arc<Mutex<Vec<String>>>,
    confirmed: Arc<std::sync::atomic::AtomicU64>,
    mutant_dir: std::path::PathBuf,
}

/// The end of a run, which a server fault pushes back by the time the
/// server took to come back.
#[derive(Clone)]
struct Until(Arc<Mutex<Instant>>);

impl Until {
    fn get(&self) -> Instant {
        *self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn extend(&self, by: Duration) {
        let mut u = self.0.lock().unwrap_or_else(|p| p.into_inner());
        *u += by;
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
    pub(crate) fn url(&self, cfg: &RunConfig, via: Option<SocketAddr>) -> Result<String, String> {
        let base = self.private.as_ref().map(|p| p.base_url());
        cfg.target
            .url(&self.ns, via, self.dir.path(), base.as_deref())
    }

    /// Where mutants share what they share.
    pub(crate) fn mutant_dir(&self) -> std::path::PathBuf {
        self.dir.path().join("mutant")
    }
}

async fn prepare(cfg: &RunConfig) -> Result<Prepared, String> {
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
    let admin_url = cfg.target.url(&ns, None, dir.path(), base.as_deref())?;
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
        key: format!("faults/{}", cfg.fault.name()),
    })
}

/// Starts the store's own record of the run (server truth, truth.rs);
/// before the clients start.
pub(crate) async fn start_recorder(
    cfg: &RunConfig,
    prep: &Prepared,
    history: &History,
) -> Result<Recorder, String> {
    if cfg.fault.kind() == FaultKind::Server {
        // Restarts and kills break a MONITOR stream or a watch, and the
        // private servers of these faults keep no binary log.
        return Ok(Recorder::None(SERVER_FAULT_REASON));
    }
    Recorder::start(cfg.target, &prep.admin_url, prep.dir.path(), history).await
}

/// Why server faults have no server truth.
pub const SERVER_FAULT_REASON: &str =
    "server faults run on a private server that the fault restarts or kills (which breaks a MONITOR stream or a watch) and that keeps no binary log";

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
    let liveness_ms = match liveness(&prep.admin_url, &prep.key, cfg.ttl).await {
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
    let overlaps = belief_overlaps(&events);
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
            .map(|o| o.ns as f64 / 1e6)
            .fold(0.0, f64::max),
        resource: c.resource.totals(),
        server_truth,
        non_owner_releases: non_owner_releases(&events),
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
        takeover_ms: crate::checks::takeover_ms(&events),
        lock_conflicts: c.lock_conflicts,
        commit: None,
        elapsed_s: None,
        history: c.history.to_jsonl(),
        config: cfg,
    };
    cleanup(&prep.admin_url).await;
    Ok(result)
}

/// Runs one seeded run. Errors are set-up failures (server unreachable, no
/// port); everything that happens during the run is in the result.
///
/// # Errors
///
/// A one-line description naming `scripts/services.sh` when a server is
/// unreachable.
pub async fn run(cfg: RunConfig) -> Result<RunResult, String> {
    let prep = prepare(&cfg).await?;
    if cfg.fault.kind() == FaultKind::Processes {
        return crate::procs::run(cfg, prep).await;
    }
    // Private servers are reached directly; shared ones through a proxy each.
    let upstream = match prep.private {
        Some(_) => None,
        None => cfg.target.upstream()?,
    };
    let history = History::new();
    let recorder = start_recorder(&cfg, &prep, &history).await?;
    let resource = Arc::new(if cfg.fencing {
        FencedResource::fenced()
    } else {
        FencedResource::unfenced()
    });
    let budget = if cfg.fault == Fault::LockStorm {
        // Room for several cycles of the conflict injector (a timeout cycle
        // holds its locks 1.3 s).
        STORM_BUDGET
    } else {
        cfg.ttl * 5 * cfg.injections.max(1) as u32 + cfg.ttl * 3
    };
    let until = Until(Arc::new(Mutex::new(Instant::now() + budget)));
    let loss_latency_ms = Arc::new(Mutex::new(Vec::new()));
    let errors = Arc::new(Mutex::new(Vec::new()));
    let transient = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let evidence = Arc::new(Mutex::new(Vec::new()));
    let confirmed = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let conflicts_before = match (&prep.private, cfg.fault) {
        (Some(p), Fault::LockStorm) => Some(p.lock_conflicts().await?),
        _ => None,
    };
    let mut threads = Vec::new();
    let mut proxies = Vec::new();
    for i in 0..cfg.clients {
        let proxy = match upstream {
            Some(up) => Some(Arc::new(
                FaultProxy::start(up)
                    .await
                    .map_err(|e| format!("fault proxy: {e}"))?,
            )),
            None => None,
        };
        let url = prep.url(&cfg, proxy.as_ref().map(|p| p.addr()))?;
        proxies.push(proxy.clone());
        let ctx = Ctx {
            cfg: cfg.clone(),
            url,
            key: prep.key.clone(),
            history: history.clone(),
            resource: Arc::clone(&resource),
            proxy,
            until: until.clone(),
            loss_latency_ms: Arc::clone(&loss_latency_ms),
            errors: Arc::clone(&errors),
            transient: Arc::clone(&transient),
            server: prep.private.clone(),
            evidence: Arc::clone(&evidence),
            confirmed: Arc::clone(&confirmed),
            mutant_dir: prep.mutant_dir(),
        };
        threads.push(std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build();
            match rt {
                Ok(rt) => rt.block_on(client(i, ctx)),
                Err(e) => ctx.error(format!("runtime: {e}")),
            }
        }));
    }
    let injector = match (&prep.private, cfg.fault) {
        (Some(p), Fault::LockStorm) => {
            let (p, u, gap) = (Arc::clone(p), until.clone(), cfg.ttl);
            Some(tokio::spawn(async move {
                p.inject_lock_conflicts(move || u.get(), gap).await
            }))
        }
        _ => None,
    };
    let joined = tokio::task::spawn_blocking(move || {
        // Join every thread, even after a failed one.
        let joined: Vec<bool> = threads.into_iter().map(|t| t.join().is_ok()).collect();
        !joined.contains(&false)
    })
    .await
    .unwrap_or(false);
    if !joined {
        errors
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push("a client thread panicked".into());
    }
    drop(proxies);
    let interference = match injector {
        Some(h) => Some(h.await.map_err(|e| format!("conflict injector: {e}"))??),
        None => None,
    };
    let lock_conflicts = match (&prep.private, conflicts_before) {
        (Some(p), Some((d0, t0))) => {
            let (d1, t1) = p.lock_conflicts().await?;
            let own = interference.unwrap_or_default();
            // The server's counts, less the injector's own 1213/1205.
            let d = d1.saturating_sub(d0).saturating_sub(own.own_deadlocks);
            let t = t1.saturating_sub(t0).saturating_sub(own.own_timeouts);
            // What the clients saw of them: refusals, never grants.
            let seen = history
                .events()
                .iter()
                .filter(|e| e.op == Op::Acquire && matches!(e.phase, Phase::Fail | Phase::Unknown))
                .fold((0, 0, 0), |(dl, lw, to), e| {
                    let d = e.detail.to_ascii_lowercase();
                    if d.contains("1213") || d.contains("deadlock") {
                        (dl + 1, lw, to)
                    } else if d.contains("1205") || d.contains("lock wait") {
                        (dl, lw + 1, to)
                    } else {
                        (dl, lw, to + 1)
                    }
                });
            evidence.lock().unwrap_or_else(|p| p.into_inner()).push(format!(
                "the server counted {d} deadlocks (1213) and {t} lock-wait timeouts (1205); \
                 the clients saw {} deadlock and {} lock-wait errors and {} other refusals/timeouts",
                seen.0, seen.1, seen.2
            ));
            if let Some(i) = interference {
                evidence
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .push(format!(
                        "conflict injector: {} cycles found fenced statements waiting; \
                         {} asked for exclusive locks over them, {} held past the lock-wait \
                         timeout ({} deadlocks and {} timeouts of its own, not counted)",
                        i.cycles_with_waiters,
                        i.exclusive_requests,
                        i.timeout_holds,
                        i.own_deadlocks,
                        i.own_timeouts
                    ));
            }
            // The storm happened when fenced's statements got the answers
            // they can get: `row_lock` waits with a 50 s
            // `innodb_lock_wait_timeout` of its own and bounds shorter waits
            // on the client (the statement is killed), so only deadlocks
            // reach it; the other strategies' statements wait under the
            // server's 1 s and get both.
            let timeouts_reach_it = cfg.target != Target::MySqlRowLock;
            if d > 0 && (t > 0 || !timeouts_reach_it) {
                confirmed.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
            Some((d, t))
        }
        _ => None,
    };
    let take = |m: &Arc<Mutex<Vec<String>>>| {
        std::mem::take(&mut *m.lock().unwrap_or_else(|p| p.into_inner()))
    };
    let collected = Collected {
        history,
        recorder,
        resource,
        loss_latency_ms: std::mem::take(
            &mut *loss_latency_ms.lock().unwrap_or_else(|p| p.into_inner()),
        ),
        errors: take(&errors),
        transient: transient.load(std::sync::atomic::Ordering::Relaxed),
        evidence: take(&evidence),
        confirmed: confirmed.load(std::sync::atomic::Ordering::Relaxed),
        lock_conflicts,
    };
    finish(cfg, prep, collected).await
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
    let mut invoked: std::collections::HashMap<(usize, u64), u64> = Default::default();
    let mut n = 0;
    for e in events {
        match (e.op, e.phase, e.token) {
            (Op::Release, Phase::Invoke, Some(t)) => {
                invoked.insert((e.process, t), e.t_ns);
            }
            (Op::Release, Phase::Ok, Some(t)) => {
                let sent = invoked.get(&(e.process, t)).copied().unwrap_or(e.t_ns);
                let overtaken = events.iter().any(|o| {
                    o.op == Op::Acquire
                        && o.phase == Phase::Ok
                        && o.key == e.key
                        && o.token.is_some_and(|ot| ot > t)
                        && o.t_ns < sent
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

/// How long a fresh client needed for the key; why it could not get it.
async fn liveness(url: &str, key: &str, ttl: Duration) -> Result<f64, String> {
    let lock = fenced::connect(url)
        .await
        .map_err(|e| format!("liveness: connect: {e}"))?;
    let client = LockClient::builder(lock)
        .ttl(ttl)
        .build()
        .map_err(|e| format!("liveness: {e}"))?;
    let start = Instant::now();
    let g = client
        .acquire_with(key, WaitPolicy::Timeout(ttl * 4))
        .await
        .map_err(|e| format!("liveness: acquire: {e}"))?;
    let ms = start.elapsed().as_secs_f64() * 1e3;
    let _ = g.release().await;
    Ok(ms)
}

/// Drops the run's MySQL tables (Redis keys and etcd leases expire by
/// themselves; SQLite lives in a temporary directory).
async fn cleanup(url: &str) {
    use sqlx::Connection as _;
    let Some(table) = url.split("table=").nth(1) else {
        return;
    };
    let base = url.split('?').next().unwrap_or(url);
    if let Ok(mut c) = sqlx::MySqlConnection::connect(base).await {
        let _ = sqlx::query(sqlx::AssertSqlSafe(format!(
            "DROP TABLE IF EXISTS `{table}`, `{table}_migrations`, `{table}_audit`, \
             `{table}_optimistic`, `{table}_rows`, `{table}_fence`, `{table}_live`"
        )))
        .execute(&mut c)
        .await;
    }
}

impl Ctx {
    fn push(&self, p: usize, op: Op, phase: Phase, token: Option<u64>, detail: impl Into<String>) {
        self.history.push(p, op, phase, &self.key, token, detail);
    }

    fn error(&self, e: String) {
        let mut v = self.errors.lock().unwrap_or_else(|p| p.into_inner());
        if v.len() < 20 {
            v.push(e);
        }
    }

    fn proxy(&self) -> Option<&FaultProxy> {
        self.proxy.as_deref()
    }
}

async fn client(p: usize, ctx: Ctx) {
    let cfg = &ctx.cfg;
    let ttl = cfg.ttl;
    let storm = cfg.fault == Fault::LockStorm;
    let mut rng = fastrand::Rng::with_seed(cfg.seed.wrapping_mul(1_000_003).wrapping_add(p as u64));
    let lock = match fenced::connect(&ctx.url).await {
        Ok(l) => l,
        Err(e) => return ctx.error(format!("client {p}: connect: {e}")),
    };
    let lock = match cfg.mutant {
        Some(m) => m.wrap(lock, &ctx.mutant_dir),
        None => lock,
    };
    let client = match LockClient::builder(lock)
        .ttl(ttl)
        // A storm waits one TTL: on MariaDB that is a 1 s lock wait, which
        // the queue of long holds outlasts (1205).
        .wait(WaitPolicy::Timeout(if storm { ttl } else { ttl * 3 }))
        .build()
    {
        Ok(c) => c,
        Err(e) => return ctx.error(format!("client {p}: {e}")),
    };
    let victim = p == 0;
    let mut holds = 0u64;
    let mut left = if victim { cfg.injections } else { 0 };
    // The victim lets the others warm up first; then it injects on every
    // hold until its injections are spent.
    if victim {
        tokio::time::sleep(ttl / 4).await;
    }
    // A fault on the acquire path is spent on the next acquire; one that
    // hits a holder is spent (and recorded) only once the victim holds, so
    // an acquire that times out or fails never counts as a fault applied.
    let hits_holder = cfg.fault.hits_a_holder();
    while Instant::now() < ctx.until.get() {
        let inject = left > 0;
        let on_acquire = inject && !hits_holder;
        if on_acquire {
            left -= 1;
            ctx.push(p, Op::Fault, Phase::Invoke, None, cfg.fault.name());
            before_acquire(p, &ctx, &client, &mut rng).await;
        }
        ctx.push(p, Op::Acquire, Phase::Invoke, None, "");
        let acquired = client.acquire(ctx.key.as_str()).await;
        if on_acquire {
            if let Some(px) = ctx.proxy() {
                px.heal();
            }
        }
        let guard = match acquired {
            Ok(g) => g,
            Err(Error::Timeout { .. }) => {
                ctx.push(p, Op::Acquire, Phase::Fail, None, "timeout");
                continue;
            }
            Err(e) => {
                ctx.push(p, Op::Acquire, Phase::Unknown, None, e.to_string());
                let expected = on_acquire
                    && matches!(
                        cfg.fault,
                        Fault::LostAcquireAck | Fault::ReplyDelayedPastTtl
                    );
                if e.is_retryable() {
                    // The store said "try again" (overload, a connection
                    // the fault cut): counted, not an error of the lock.
                    ctx.transient
                        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                } else if !expected {
                    ctx.error(format!("client {p}: acquire: {e}"));
                }
                tokio::time::sleep(ttl / 10).await;
                continue;
            }
        };
        let token = guard.token().get();
        ctx.push(p, Op::Acquire, Phase::Ok, Some(token), "");
        let watcher = {
            let h = guard.handle().clone();
            let history = ctx.history.clone();
            let key = ctx.key.clone();
            let lat = Arc::clone(&ctx.loss_latency_ms);
            tokio::spawn(async move {
                let reason = h.lost().await;
                let now = Instant::now();
                let deadline = h.lease().deadline;
                let ms = if now >= deadline {
                    (now - deadline).as_secs_f64() * 1e3
                } else {
                    -(deadline - now).as_secs_f64() * 1e3
                };
                lat.lock().unwrap_or_else(|p| p.into_inner()).push(ms);
                history.push(
                    p,
                    Op::Lost,
                    Phase::Ok,
                    &key,
                    Some(token),
                    format!("{reason:?}"),
                );
            })
        };
        let Some(read) = ctx.resource.read(token) else {
            ctx.push(p, Op::Write, Phase::Fail, Some(token), "stale read refused");
            release(p, &ctx, guard, token).await;
            watcher.abort();
            continue;
        };
        let hit = inject && hits_holder;
        if hit {
            left -= 1;
            ctx.push(p, Op::Fault, Phase::Invoke, Some(token), cfg.fault.name());
        }
        if hit && while_holding(p, &ctx, &mut rng).await == Holding::Died {
            // The dead holder never writes, never releases, never renews;
            // and a dead process believes nothing any more.
            watcher.abort();
            ctx.push(p, Op::Lost, Phase::Ok, Some(token), "killed");
            let _ = guard.leak();
            return;
        }
        if storm {
            holds += 1;
            tokio::time::sleep(Duration::from_millis(rng.u64(0..=3))).await;
            if holds.is_multiple_of(3) {
                // A holder that dies: its row expires, and the next
                // acquirers race to take the expired lock over (deadlocks).
                ctx.push(p, Op::Lost, Phase::Ok, Some(token), "abandoned");
                watcher.abort();
                let _ = guard.leak();
                continue;
            }
        } else {
            tokio::time::sleep(Duration::from_millis(rng.u64(1..=5))).await;
        }
        let outcome = ctx.resource.write(token, read);
        let (phase, detail) = match outcome {
            WriteOutcome::Accepted => (Phase::Ok, "accepted"),
            WriteOutcome::Rejected => (Phase::Fail, "rejected: stale token"),
            WriteOutcome::AcceptedStale => (Phase::Ok, "ACCEPTED STALE"),
        };
        ctx.push(p, Op::Write, phase, Some(token), detail);
        if inject && cfg.mutant == Some(Mutant::OwnerCheckRemoved) {
            // The control must not depend on luck: a release that finds the
            // key free between two holders frees nothing, and polling stores
            // leave it free for a while at each hand-off (a successor's hold
            // can even end between the look and the release). So the stale
            // holder releases its old lease again each time a successor
            // holds the key, until the broken release frees someone's lock
            // (a correct store refuses every one of these releases).
            let stale = guard.leak();
            for _ in 0..20 {
                await_successor(&client, &ctx.key, token, ttl * 2).await;
                ctx.push(p, Op::Release, Phase::Invoke, Some(token), "");
                match client.lock().release(&stale).await {
                    Ok(fenced_api::ReleaseOutcome::NotHeld) => {
                        ctx.push(p, Op::Release, Phase::Fail, Some(token), "not held")
                    }
                    Ok(_) => {
                        ctx.push(p, Op::Release, Phase::Ok, Some(token), "");
                        break;
                    }
                    Err(e) => ctx.push(p, Op::Release, Phase::Unknown, Some(token), e.to_string()),
                }
            }
            watcher.abort();
            continue;
        }
        release(p, &ctx, guard, token).await;
        watcher.abort();
        tokio::time::sleep(Duration::from_millis(rng.u64(0..=3))).await;
    }
}

/// Waits (at most `bound`) until the store shows a holder with a token
/// above `token`: a successor of the lease that carries it.
async fn await_successor(client: &LockClient, key: &str, token: u64, bound: Duration) {
    let Ok(key) = fenced_api::LockKey::new(key) else {
        return;
    };
    let end = Instant::now() + bound;
    while Instant::now() < end {
        if let Ok(Some(info)) = client.lock().inspect(&key).await {
            if info.token.get() > token {
                return;
            }
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

async fn release(p: usize, ctx: &Ctx, guard: fenced_api::LockGuard, token: u64) {
    ctx.push(p, Op::Release, Phase::Invoke, Some(token), "");
    match guard.release().await {
        Ok(()) => ctx.push(p, Op::Release, Phase::Ok, Some(token), ""),
        Err(Error::LeaseLost { .. }) => {
            ctx.push(p, Op::Release, Phase::Fail, Some(token), "lease lost")
        }
        Err(e) => ctx.push(p, Op::Release, Phase::Unknown, Some(token), e.to_string()),
    }
}

/// Faults that act on the acquire itself.
async fn before_acquire(p: usize, ctx: &Ctx, client: &LockClient, rng: &mut fastrand::Rng) {
    let ttl = ctx.cfg.ttl;
    match ctx.cfg.fault {
        Fault::ReplyDelayedPastTtl => {
            if let Some(px) = ctx.proxy() {
                px.one_way_delay(Direction::Down, ttl * 3 / 2);
            }
        }
        Fault::LostAcquireAck => {
            if let Some(px) = ctx.proxy() {
                // The first or second request from now: depending on the
                // backend, the acquire is one of them.
                px.drop_reply_of(rng.u64(1..=2));
            }
        }
        Fault::DroppedAcquires => {
            for _ in 0..40 {
                let d = Duration::from_micros(rng.u64(100..=3_000));
                if let Ok(Ok(g)) = tokio::time::timeout(d, client.acquire(ctx.key.as_str())).await {
                    // Granted in time after all: a normal, short hold.
                    let token = g.token().get();
                    ctx.push(p, Op::Acquire, Phase::Ok, Some(token), "storm");
                    release(p, ctx, g, token).await;
                }
            }
        }
        _ => {}
    }
}

#[derive(PartialEq, Eq)]
enum Holding {
    Alive,
    Died,
}

/// The server faults, acted by the victim while it holds. The run's end
/// moves back by the time the server took, so that the others still
/// contend afterwards; then the victim waits a TTL before it writes, so that
/// a successor (if the store let one in) writes first.
async fn server_fault(ctx: &Ctx) {
    let Some(server) = ctx.server.as_deref() else {
        return ctx.error("a server fault without a private server".into());
    };
    let started = Instant::now();
    let done = match ctx.cfg.fault {
        Fault::ServerRestart | Fault::ServerRestartAof => server.restart().await,
        Fault::LeaderKill => server.kill_leader().await,
        Fault::KillConnection => server.kill_lock_connection().await,
        _ => return,
    };
    ctx.until.extend(started.elapsed());
    match done {
        Ok(evidence) => {
            ctx.evidence
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(evidence);
            ctx.confirmed
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        Err(e) => ctx.error(format!("{}: {e}", ctx.cfg.fault.name())),
    }
    tokio::time::sleep(ctx.cfg.ttl).await;
}

/// Faults that hit the holder between its read and its write: exactly
/// those [`Fault::hits_a_holder`] names (only they are spent here).
async fn while_holding(_p: usize, ctx: &Ctx, rng: &mut fastrand::Rng) -> Holding {
    let ttl = ctx.cfg.ttl;
    match ctx.cfg.fault {
        Fault::ServerRestart
        | Fault::ServerRestartAof
        | Fault::LeaderKill
        | Fault::KillConnection => server_fault(ctx).await,
        Fault::PausePastTtl => std::thread::sleep(ttl * 2),
        Fault::ShortStalls => {
            for _ in 0..4 {
                std::thread::sleep(ttl / 2);
                tokio::time::sleep(ttl / 5).await;
            }
        }
        Fault::StarvedWatchdog => {
            let end = std::time::Instant::now() + ttl * 3 / 2;
            let mut x = rng.u64(..);
            while std::time::Instant::now() < end {
                x = std::hint::black_box(x.rotate_left(7) ^ 0x9e37_79b9);
            }
        }
        Fault::BlackholePastTtl => {
            if let Some(px) = ctx.proxy() {
                px.blackhole(true);
                tokio::time::sleep(ttl * 2).await;
                px.blackhole(false);
            }
        }
        Fault::ConnectionCut => {
            if let Some(px) = ctx.proxy() {
                px.cut();
                tokio::time::sleep(ttl / 2).await;
            }
        }
        Fault::RenewalsDelayed => {
            if let Some(px) = ctx.proxy() {
                px.one_way_delay(Direction::Up, ttl * 3 / 5);
                tokio::time::sleep(ttl * 2).await;
                px.heal();
            }
        }
        Fault::KillHolder => {
            if let Some(px) = ctx.proxy() {
                px.refuse(true);
                px.cut();
            }
            return Holding::Died;
        }
        Fault::Contention
        | Fault::ReplyDelayedPastTtl
        | Fault::LostAcquireAck
        | Fault::DroppedAcquires
        | Fault::LockStorm
        | Fault::ProcessStop
        | Fault::ProcessKill
        | Fault::ClockSkew => {}
    }
    Holding::Alive
}
