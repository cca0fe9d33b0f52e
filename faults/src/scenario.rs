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
    sync::{Arc, Mutex},
    time::Duration,
};

use fenced_api::{Error, LockClient, WaitPolicy};
use tokio::time::Instant;

pub use crate::model::{
    Fault, FaultKind, Primitive, RunConfig, RunResult, Target, SEMAPHORE_PERMITS, STORM_BUDGET,
    ZOOKEEPER_TICK_MS,
};
pub use crate::run::{family_non_owner_releases, non_owner_releases, SERVER_FAULT_REASON};
use crate::{
    family::{self, Role},
    history::{History, Op, Phase},
    mutant::Mutant,
    proxy::{Direction, FaultProxy},
    resource::{FencedResource, WriteOutcome},
    run::{finish, prepare, start_recorder, Collected},
    servers::PrivateStore,
};

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
    // Private servers are reached directly; shared ones through a proxy
    // each, and so is a private Sentinel group's primary when the proxy is
    // the fault (the sentinel itself is asked directly).
    let upstreams = match &prep.private {
        Some(p) if cfg.fault.needs_proxy() => p.proxied_upstreams().await?,
        Some(_) => Vec::new(),
        None => cfg.target.upstreams().await?,
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
        let proxy = if upstreams.is_empty() {
            None
        } else {
            Some(Arc::new(
                FaultProxy::start_many(&upstreams)
                    .await
                    .map_err(|e| format!("fault proxy: {e}"))?,
            ))
        };
        let url = prep.url(&cfg, proxy.as_ref().map(|p| p.routes()))?;
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

    /// The Redis state key of the run's lock (`{prefix/key}:l`; the prefix
    /// is the URL's), which names its Cluster slot.
    fn state_key(&self) -> String {
        let prefix = self
            .url
            .split("prefix=")
            .nth(1)
            .and_then(|p| p.split('&').next())
            .unwrap_or_default();
        format!("{{{prefix}/{}}}:l", self.key)
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
            ctx.push(
                p,
                Op::Fault,
                Phase::Invoke,
                None,
                cfg.fault.name(cfg.target),
            );
            before_acquire(p, &ctx, &client, &mut rng).await;
        }
        let role = Role::pick(cfg.primitive, inject && hits_holder, cfg.seed, &mut rng);
        ctx.push(p, Op::Acquire, Phase::Invoke, None, "");
        let acquired = family::acquire(&client, &ctx.key, cfg.primitive, role).await;
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
        ctx.push(
            p,
            Op::Acquire,
            Phase::Ok,
            Some(token),
            role.detail(cfg.primitive),
        );
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
        let begun = match role {
            Role::Exclusive => ctx.resource.read(token),
            Role::Shared => ctx.resource.begin_shared(token),
            // A semaphore holder touches the resource only once it has
            // checked its permit, after the fault (below).
            Role::Permit => Some(crate::resource::Read {
                value: 0,
                version: 0,
            }),
        };
        let Some(read) = begun else {
            ctx.push(p, Op::Write, Phase::Fail, Some(token), "stale read refused");
            release(p, &ctx, guard, token).await;
            watcher.abort();
            continue;
        };
        let hit = inject && hits_holder;
        if hit {
            left -= 1;
            ctx.push(
                p,
                Op::Fault,
                Phase::Invoke,
                Some(token),
                cfg.fault.name(cfg.target),
            );
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
        } else if role == Role::Permit {
            if !family::permit_still_held(&guard, cfg.fencing) {
                ctx.resource.refused_by_holder();
                ctx.push(
                    p,
                    Op::Write,
                    Phase::Fail,
                    Some(token),
                    "refused by the holder: permit past its safe deadline",
                );
                release(p, &ctx, guard, token).await;
                watcher.abort();
                continue;
            }
            let outcome = ctx.resource.enter(token, family::capacity());
            // The faulted hold uses the resource a while (a quarter TTL):
            // long enough that a use it should not have made meets the
            // others' uses, whichever moment it starts.
            let work = if hit {
                ttl / 4
            } else {
                Duration::from_millis(rng.u64(1..=5))
            };
            tokio::time::sleep(work).await;
            ctx.resource.leave(token);
            push_outcome(p, &ctx, token, outcome);
            release(p, &ctx, guard, token).await;
            watcher.abort();
            tokio::time::sleep(Duration::from_millis(rng.u64(0..=3))).await;
            continue;
        } else {
            tokio::time::sleep(Duration::from_millis(rng.u64(1..=5))).await;
        }
        let outcome = if role == Role::Shared {
            ctx.resource.end_shared(token, read)
        } else {
            ctx.resource.write(token, read)
        };
        push_outcome(p, &ctx, token, outcome);
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

/// Records what the resource did with a holder's step.
fn push_outcome(p: usize, ctx: &Ctx, token: u64, outcome: WriteOutcome) {
    let (phase, detail) = match outcome {
        WriteOutcome::Accepted => (Phase::Ok, "accepted"),
        WriteOutcome::Rejected => (Phase::Fail, "rejected: stale token"),
        WriteOutcome::AcceptedStale => (Phase::Ok, "ACCEPTED STALE"),
    };
    ctx.push(p, Op::Write, phase, Some(token), detail);
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
        Fault::LeaderKill => server.kill_leader(&ctx.state_key()).await,
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
        Err(e) => ctx.error(format!("{}: {e}", ctx.cfg.fault.name(ctx.cfg.target))),
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
