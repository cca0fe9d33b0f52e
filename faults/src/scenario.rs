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
use serde::Serialize;
use tokio::time::Instant;

use crate::{
    history::{belief_overlaps, Event, History, Op, Phase, ServerTruth},
    proxy::{Direction, FaultProxy},
    resource::{FencedResource, ResourceTotals, WriteOutcome},
    truth::Recorder,
};

/// A store under test.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
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

    /// The URL of this target in namespace `ns`, through `via` if given.
    fn url(
        self,
        ns: &str,
        via: Option<SocketAddr>,
        dir: &std::path::Path,
    ) -> Result<String, String> {
        let base = match self.server() {
            None => return Ok(format!("sqlite://{}", dir.join("faults.db").display())),
            Some((url, port)) => {
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
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
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
}

impl Fault {
    /// Every fault.
    pub const ALL: [Fault; 11] = [
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
        }
    }

    /// Whether the fault can be injected on `target` (network faults need a
    /// network).
    pub fn applies_to(self, target: Target) -> bool {
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
#[derive(Debug, Clone, Serialize)]
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
}

impl RunConfig {
    /// The default run of `fault` on `target`.
    pub fn new(target: Target, fault: Fault, seed: u64) -> Self {
        RunConfig {
            target,
            fault,
            seed,
            fencing: true,
            clients: 4,
            ttl: Duration::from_millis(if target == Target::Etcd { 2_000 } else { 600 }),
            injections: 1,
        }
    }
}

/// What one run found.
#[derive(Debug, Clone, Serialize)]
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
    until: Instant,
    loss_latency_ms: Arc<Mutex<Vec<f64>>>,
    errors: Arc<Mutex<Vec<String>>>,
    transient: Arc<std::sync::atomic::AtomicU64>,
}

/// Runs one seeded run. Errors are set-up failures (server unreachable, no
/// port); everything that happens during the run is in the result.
///
/// # Errors
///
/// A one-line description naming `scripts/services.sh` when a server is
/// unreachable.
pub async fn run(cfg: RunConfig) -> Result<RunResult, String> {
    let dir = tempfile::tempdir().map_err(|e| format!("temporary directory: {e}"))?;
    let ns = format!(
        "{}_{}",
        &uuid::Uuid::new_v4().simple().to_string()[..8],
        cfg.seed
    );
    let upstream = cfg.target.upstream()?;
    let admin_url = cfg.target.url(&ns, None, dir.path())?;
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
    let history = History::new();
    // Server truth: recorded by the store from here on (truth.rs).
    let recorder = Recorder::start(cfg.target, &admin_url, dir.path(), &history).await?;
    let resource = Arc::new(if cfg.fencing {
        FencedResource::fenced()
    } else {
        FencedResource::unfenced()
    });
    let key = format!("faults/{}", cfg.fault.name());
    let budget = cfg.ttl * 5 * cfg.injections.max(1) as u32 + cfg.ttl * 3;
    let until = Instant::now() + budget;
    let loss_latency_ms = Arc::new(Mutex::new(Vec::new()));
    let errors = Arc::new(Mutex::new(Vec::new()));
    let transient = Arc::new(std::sync::atomic::AtomicU64::new(0));
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
        let url = cfg
            .target
            .url(&ns, proxy.as_ref().map(|p| p.addr()), dir.path())?;
        proxies.push(proxy.clone());
        let ctx = Ctx {
            cfg: cfg.clone(),
            url,
            key: key.clone(),
            history: history.clone(),
            resource: Arc::clone(&resource),
            proxy,
            until,
            loss_latency_ms: Arc::clone(&loss_latency_ms),
            errors: Arc::clone(&errors),
            transient: Arc::clone(&transient),
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

    // Liveness: a fresh client, straight to the server, gets the key.
    let liveness_ms = liveness(&admin_url, &key, cfg.ttl).await;

    let events = history.events();
    let server_truth = recorder.finish(&events).await?;
    let overlaps = belief_overlaps(&events);
    let result = RunResult {
        acquisitions: count(&events, Op::Acquire, Phase::Ok),
        faults: events
            .iter()
            .filter(|e| e.op == Op::Fault && e.phase == Phase::Invoke)
            .count() as u64,
        belief_overlaps: overlaps.len(),
        belief_overlap_max_ms: overlaps
            .iter()
            .map(|o| o.ns as f64 / 1e6)
            .fold(0.0, f64::max),
        resource: resource.totals(),
        server_truth,
        non_owner_releases: non_owner_releases(&events),
        loss_latency_ms: std::mem::take(
            &mut *loss_latency_ms.lock().unwrap_or_else(|p| p.into_inner()),
        ),
        liveness_ms,
        errors: std::mem::take(&mut *errors.lock().unwrap_or_else(|p| p.into_inner())),
        transient_errors: transient.load(std::sync::atomic::Ordering::Relaxed),
        history: history.to_jsonl(),
        config: cfg,
    };
    cleanup(&admin_url).await;
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

async fn liveness(url: &str, key: &str, ttl: Duration) -> Option<f64> {
    let lock = fenced::connect(url).await.ok()?;
    let client = LockClient::builder(lock).ttl(ttl).build().ok()?;
    let start = Instant::now();
    let g = client
        .acquire_with(key, WaitPolicy::Timeout(ttl * 4))
        .await
        .ok()?;
    let ms = start.elapsed().as_secs_f64() * 1e3;
    let _ = g.release().await;
    Some(ms)
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
    let mut rng = fastrand::Rng::with_seed(cfg.seed.wrapping_mul(1_000_003).wrapping_add(p as u64));
    let lock = match fenced::connect(&ctx.url).await {
        Ok(l) => l,
        Err(e) => return ctx.error(format!("client {p}: connect: {e}")),
    };
    let client = match LockClient::builder(lock)
        .ttl(ttl)
        .wait(WaitPolicy::Timeout(ttl * 3))
        .build()
    {
        Ok(c) => c,
        Err(e) => return ctx.error(format!("client {p}: {e}")),
    };
    let victim = p == 0;
    let mut left = if victim { cfg.injections } else { 0 };
    // The victim lets the others warm up first; then it injects on every
    // hold until its injections are spent.
    if victim {
        tokio::time::sleep(ttl / 4).await;
    }
    while Instant::now() < ctx.until {
        let inject = left > 0;
        if inject {
            left -= 1;
            ctx.push(p, Op::Fault, Phase::Invoke, None, cfg.fault.name());
            before_acquire(p, &ctx, &client, &mut rng).await;
        }
        ctx.push(p, Op::Acquire, Phase::Invoke, None, "");
        let acquired = client.acquire(ctx.key.as_str()).await;
        if inject {
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
                let expected = inject
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
        if inject && while_holding(p, &ctx, &mut rng).await == Holding::Died {
            // The dead holder never writes, never releases, never renews;
            // and a dead process believes nothing any more.
            watcher.abort();
            ctx.push(p, Op::Lost, Phase::Ok, Some(token), "killed");
            let _ = guard.leak();
            return;
        }
        tokio::time::sleep(Duration::from_millis(rng.u64(1..=5))).await;
        let outcome = ctx.resource.write(token, read);
        let (phase, detail) = match outcome {
            WriteOutcome::Accepted => (Phase::Ok, "accepted"),
            WriteOutcome::Rejected => (Phase::Fail, "rejected: stale token"),
            WriteOutcome::AcceptedStale => (Phase::Ok, "ACCEPTED STALE"),
        };
        ctx.push(p, Op::Write, phase, Some(token), detail);
        release(p, &ctx, guard, token).await;
        watcher.abort();
        tokio::time::sleep(Duration::from_millis(rng.u64(0..=3))).await;
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

/// Faults that hit the holder between its read and its write.
async fn while_holding(_p: usize, ctx: &Ctx, rng: &mut fastrand::Rng) -> Holding {
    let ttl = ctx.cfg.ttl;
    match ctx.cfg.fault {
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
        | Fault::DroppedAcquires => {}
    }
    Holding::Alive
}
