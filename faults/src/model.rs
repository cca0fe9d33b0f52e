//! The plain data of the fault suite: the stores under test ([`Target`]),
//! the faults ([`Fault`], [`FaultKind`]), one run's settings
//! ([`RunConfig`]) and what it found ([`RunResult`]), and the cell of the
//! report matrix a run belongs to.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::{history::ServerTruth, mutant::Mutant, resource::ResourceTotals};

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
    /// ZooKeeper.
    ZooKeeper,
    /// PostgreSQL, `lease` strategy (a lease row per key, tokens from a
    /// sequence).
    PostgresLease,
    /// PostgreSQL, `advisory` strategy (a session-level advisory lock on a
    /// connection held per lock).
    PostgresAdvisory,
    /// Redis Cluster (`redis+cluster://`): the shared 3+3 cluster of
    /// `scripts/services.sh`, or a private one for the failover. Each
    /// client's proxy has a port per node, and its URL maps every node's
    /// announced address to that port (`address_map`).
    RedisCluster,
    /// A Redis primary found and followed through Sentinel
    /// (`redis+sentinel://`), on a private primary, replica and sentinel:
    /// the failover only.
    RedisSentinel,
}

impl Target {
    /// Every target.
    /// New targets go last: recorded runs name their cell by index.
    pub const ALL: [Target; 11] = [
        Target::Sqlite,
        Target::MySqlUniqueKey,
        Target::MySqlRowLock,
        Target::MySqlOptimistic,
        Target::Redis,
        Target::Etcd,
        Target::ZooKeeper,
        Target::PostgresLease,
        Target::PostgresAdvisory,
        Target::RedisCluster,
        Target::RedisSentinel,
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
            Target::ZooKeeper => "zookeeper",
            Target::PostgresLease => "postgres-lease",
            Target::PostgresAdvisory => "postgres-advisory",
            Target::RedisCluster => "redis-cluster",
            Target::RedisSentinel => "redis-sentinel",
        }
    }

    /// Whether this is one of the PostgreSQL strategies.
    pub fn is_postgres(self) -> bool {
        matches!(self, Target::PostgresLease | Target::PostgresAdvisory)
    }

    /// Whether this is one of the MySQL/MariaDB strategies.
    pub fn is_mysql(self) -> bool {
        matches!(
            self,
            Target::MySqlUniqueKey | Target::MySqlRowLock | Target::MySqlOptimistic
        )
    }

    /// Whether each client's traffic goes through a proxy of its own, which
    /// the network faults (blackhole, cuts, delays, lost replies) act on.
    pub(crate) fn proxied(self) -> bool {
        self != Target::Sqlite
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
    /// The leader of a private 3-member cluster (etcd, or a ZooKeeper
    /// ensemble) is SIGKILLed while a client holds. Named per store
    /// ([`Fault::name`]): `etcd-leader-kill`, `zk-leader-kill`.
    LeaderKill,
    /// The server ends the session that holds the lock: `KILL <id>` of the
    /// MySQL `row_lock` holder's connection, `pg_terminate_backend(<pid>)`
    /// of the PostgreSQL `advisory` holder's backend. Named per store
    /// ([`Fault::name`]): `server-kill-connection`,
    /// `server-terminate-backend`.
    KillConnection,
    /// 16 clients on one key on a MariaDB with `innodb_lock_wait_timeout = 1`,
    /// every third holder dying, and a conflict injector that makes fenced's
    /// statements deadlock victims (1213) and lets them time out (1205):
    /// neither must ever read as a grant, a renewal or a release.
    LockStorm,
}

/// How long a [`Fault::LockStorm`] run contends (other faults: from the TTL).
pub const STORM_BUDGET: Duration = Duration::from_secs(8);

/// The tick of the ZooKeeper cells' private servers, ms. A holder that
/// cannot delete its own node (frozen, cut off, dead) keeps the key until
/// the server expires its session: one session timeout (the TTL, see
/// `Target::url`) after the last request, rounded up to the next tick. With
/// 500 ms that is at most 2.5 s, well inside the shortest freeze of the
/// suite (1.5 × TTL = 3 s), so the key changes hands during a freeze as on
/// the other stores. With the shared server's 1 s tick the takeover can
/// come at 3 s, just as a starved victim wakes, and its forced stale write
/// can land between the successor's read and write (a lost update the
/// resource cannot refuse: it learns a token when it is written).
pub const ZOOKEEPER_TICK_MS: u32 = 500;

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

    /// Its name in reports, on `target`. Only two faults' names depend on
    /// the store: the leader kill says which kind of cluster lost its
    /// leader (`etcd-leader-kill`, `zk-leader-kill`; a Redis primary:
    /// `cluster-primary-kill`, `sentinel-primary-kill`), and the session kill
    /// says how the server ended the holder's session (MySQL's `KILL`:
    /// `server-kill-connection`; PostgreSQL's `pg_terminate_backend`:
    /// `server-terminate-backend`).
    pub fn name(self, target: Target) -> &'static str {
        match self {
            Fault::LeaderKill if target == Target::ZooKeeper => "zk-leader-kill",
            Fault::LeaderKill if target == Target::RedisCluster => "cluster-primary-kill",
            Fault::LeaderKill if target == Target::RedisSentinel => "sentinel-primary-kill",
            Fault::KillConnection if target.is_postgres() => "server-terminate-backend",
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

    /// Whether the fault is injected by each client's proxy (so the client
    /// must reach its store through one).
    pub fn needs_proxy(self) -> bool {
        matches!(
            self,
            Fault::BlackholePastTtl
                | Fault::ConnectionCut
                | Fault::ReplyDelayedPastTtl
                | Fault::RenewalsDelayed
                | Fault::LostAcquireAck
        )
    }

    /// Whether two clients believing they hold the key at once is a
    /// violation under this fault on `target`: nobody is frozen or cut off,
    /// or the store keeps its locks through the fault. (Under a pause, a
    /// partition, or a Redis restart that forgets locks, such overlaps are
    /// what fencing is for; they are counted, not forbidden.)
    pub fn forbids_overlap(self, target: Target) -> bool {
        match self {
            Fault::Contention | Fault::ClockSkew | Fault::LockStorm => true,
            // Durable stores keep the lease through a restart (ZooKeeper
            // reloads its sessions and gives each a full timeout from the
            // moment it serves again, so a holder's node outlives the
            // holder's deadline; a PostgreSQL lease row is committed data);
            // a row_lock transaction and a PostgreSQL advisory lock die with
            // the server's sessions (the holder learns at its next renewal,
            // or at once from its held connection) and a Redis without
            // persistence forgets.
            Fault::ServerRestart => matches!(
                target,
                Target::MySqlUniqueKey
                    | Target::MySqlOptimistic
                    | Target::Etcd
                    | Target::ZooKeeper
                    | Target::PostgresLease
            ),
            // A Redis failover keeps what the promoted replica had:
            // replication is asynchronous, so the lock may be lost.
            Fault::LeaderKill => !matches!(target, Target::RedisCluster | Target::RedisSentinel),
            Fault::ServerRestartAof => true,
            _ => false,
        }
    }

    /// Whether the fault can be injected on `target` (network faults need a
    /// network).
    pub fn applies_to(self, target: Target) -> bool {
        // Sentinel's cells each run on a private primary, replica and
        // sentinel (slow to start): the failover, and the contention, pause
        // and blackhole that the other stores' profiles start from.
        if target == Target::RedisSentinel {
            return matches!(
                self,
                Fault::Contention
                    | Fault::PausePastTtl
                    | Fault::BlackholePastTtl
                    | Fault::LeaderKill
            );
        }
        match self {
            Fault::ServerRestart => {
                return !matches!(target, Target::Sqlite | Target::RedisCluster)
            }
            Fault::ServerRestartAof => return target == Target::Redis,
            Fault::LeaderKill => {
                return matches!(
                    target,
                    Target::Etcd | Target::ZooKeeper | Target::RedisCluster
                )
            }
            // Only where a lock lives in a server session: a `row_lock`
            // transaction, a PostgreSQL advisory lock. Elsewhere the lock
            // is data (a row, a key) and a killed connection is the
            // connection-cut cell's business; a PostgreSQL lease holder's
            // pool connections carry no lock of their own.
            Fault::KillConnection => {
                return matches!(target, Target::MySqlRowLock | Target::PostgresAdvisory)
            }
            // The conflict injector is InnoDB's (shared next-key locks,
            // deadlock victims chosen by undo size, INNODB_METRICS).
            Fault::LockStorm => return target.is_mysql(),
            // SQLite's clock is the calling process's wall clock (the store
            // runs inside the client): a client with a skewed clock *is* a
            // store with a skewed clock. Documented in fenced-sqlite; the
            // short profile shows it as a control.
            Fault::ClockSkew => return target != Target::Sqlite,
            _ => {}
        }
        !self.needs_proxy() || target.proxied()
    }
}

/// What the clients of a run hold: the lock (mutex) or one of the family.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum Primitive {
    /// The lock: one holder at a time; the resource checks tokens.
    #[default]
    Mutex,
    /// A semaphore of [`SEMAPHORE_PERMITS`] permits. Its tokens cannot tell
    /// a resource which of more than N users is stale (each permit is its
    /// own lease; a later token does not end an earlier permit), so here the
    /// holder itself checks its permit's safe deadline
    /// ([`LeaseHandle::valid_for`](fenced_api::LeaseHandle::valid_for))
    /// before it uses the resource, and the resource counts uses beyond N
    /// at once; "fencing off" skips that check.
    Semaphore,
    /// A reader-writer lock: writers do the counter's read – work – write
    /// as under the mutex; readers read, work and have the read validated
    /// at the end; the resource refuses any step whose token is below the
    /// highest token a writer has written with (a writer's token exceeds
    /// every grant before it).
    ReadWrite,
}

/// Permits of the semaphore cells (4 clients contend for them).
pub const SEMAPHORE_PERMITS: u32 = 2;

impl Primitive {
    /// Every primitive, in report order.
    pub const ALL: [Primitive; 3] = [Primitive::Mutex, Primitive::Semaphore, Primitive::ReadWrite];

    /// Its name in reports and `--only` filters (`""` for the mutex, whose
    /// rows carry the store's name alone).
    pub fn name(self) -> &'static str {
        match self {
            Primitive::Mutex => "",
            Primitive::Semaphore => "semaphore-2",
            Primitive::ReadWrite => "rw",
        }
    }

    /// Whether it is the mutex (left out of stored runs, which read back
    /// as mutex runs: the lines of runs recorded before the family stay
    /// as they were).
    pub fn is_mutex(&self) -> bool {
        *self == Primitive::Mutex
    }

    /// Its value of `fenced-faults-client --primitive`.
    pub fn arg(self) -> &'static str {
        match self {
            Primitive::Mutex => "mutex",
            Primitive::Semaphore => "semaphore",
            Primitive::ReadWrite => "rw",
        }
    }

    /// The primitive `fenced-faults-client --primitive` names.
    pub fn from_arg(s: &str) -> Option<Primitive> {
        Primitive::ALL.into_iter().find(|p| p.arg() == s)
    }

    /// The store column of a report row: `redis`, `redis semaphore-2`.
    pub fn store_label(self, target: Target) -> String {
        match self {
            Primitive::Mutex => target.name().to_owned(),
            p => format!("{} {}", target.name(), p.name()),
        }
    }

    /// The faults the family cells run: a holder paused past its TTL, a
    /// blackhole, a holder that dies (in the process, and a SIGKILLed
    /// client process). Every fault for the mutex.
    pub fn runs(self, fault: Fault) -> bool {
        self == Primitive::Mutex
            || matches!(
                fault,
                Fault::PausePastTtl
                    | Fault::BlackholePastTtl
                    | Fault::KillHolder
                    | Fault::ProcessKill
            )
    }
}

/// One run's settings.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RunConfig {
    /// The store.
    pub target: Target,
    /// What the clients hold (runs recorded before the family cells are
    /// mutex runs).
    #[serde(default, skip_serializing_if = "Primitive::is_mutex")]
    pub primitive: Primitive,
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
            primitive: Primitive::Mutex,
            fault,
            seed,
            fencing: true,
            clients: if fault == Fault::LockStorm { 16 } else { 4 },
            ttl: Duration::from_millis(match (target, fault) {
                // etcd leases are whole seconds. ZooKeeper: the clients'
                // session timeout is the TTL (`Target::url`), and 2 s is the
                // shortest session the shared server (tickTime 1 s) grants.
                (Target::Etcd | Target::ZooKeeper, _) => 2_000,
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

/// A run's variant: 0 the real lock with fencing, 1 fencing off, 2 + i the
/// i-th mutant (control runs are the variants above 0).
pub fn variant(r: &RunResult) -> usize {
    match r.config.mutant {
        Some(m) => 2 + Mutant::ALL.iter().position(|x| *x == m).unwrap_or(0),
        None => usize::from(!r.config.fencing),
    }
}

/// A report cell: (variant, index in [`Primitive::ALL`], index in
/// [`Target::ALL`], index in [`Fault::ALL`]).
pub type CellKey = (usize, usize, usize, usize);

/// A run's cell.
pub fn cell_key(r: &RunResult) -> CellKey {
    let p = Primitive::ALL
        .iter()
        .position(|p| *p == r.config.primitive)
        .unwrap_or(0);
    let t = Target::ALL
        .iter()
        .position(|t| *t == r.config.target)
        .unwrap_or(0);
    let f = Fault::ALL
        .iter()
        .position(|f| *f == r.config.fault)
        .unwrap_or(0);
    (variant(r), p, t, f)
}
