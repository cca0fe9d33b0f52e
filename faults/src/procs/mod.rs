//! Faults on real client processes: SIGSTOP past the TTL, SIGKILL while
//! holding, and clocks skewed by libfaketime.
//!
//! The clients are `fenced-faults-client` processes. They share the fenced
//! resource and the history through a small line-based TCP *hub* in the
//! parent (loopback only): every step a client takes is announced to the hub
//! and answered before the client takes it, so the hub's single clock stamps
//! the history in causal order. The hub also injects the fault: when the
//! victim reads the resource (it holds the lock and is about to work), the
//! hub signals the process and only then answers — so a stopped holder has
//! read, and writes only after it is continued.
//!
//! Wire protocol (one line each way):
//!
//! ```text
//! HELLO <id> <wall clock ms> <pid>       -> OK
//! EV <op> <phase> <token|-> <detail>     -> OK | END (acquire invoke: the run is over)
//! ERR <retryable 0|1> <message>          -> OK
//! READ <token>                           -> VAL <value> <version> | STALE
//! WRITE <token> <value> <version>        -> DONE
//! RREAD <token>                          -> VAL <value> <version> | STALE   (a reader)
//! RDONE <token> <value> <version>        -> DONE                            (its validation)
//! PERMIT <token>                         -> VAL 0 0          (a permit holder, before its check)
//! ENTER <token> / LEAVE <token>          -> DONE / OK        (its use of one of N places)
//! REFUSED <token>                        -> OK               (its permit was past its deadline)
//! ```

mod child;

use std::{
    collections::HashMap,
    path::PathBuf,
    sync::{
        atomic::{AtomicBool, AtomicU64, Ordering},
        Arc, Mutex,
    },
    time::Duration,
};

pub use child::{main as client_main, ClientArgs};
use tokio::{
    io::{AsyncBufReadExt, AsyncWriteExt, BufReader},
    net::{TcpListener, TcpStream},
    time::Instant,
};

use crate::{
    history::{History, Op, Phase},
    model::{Fault, RunConfig, RunResult},
    private::send_signal,
    resource::{FencedResource, Read, WriteOutcome},
    run::{finish, start_recorder, Collected, Prepared},
};

/// What the hub does to a client when it next reads the resource.
#[derive(Debug, Clone, Copy)]
enum Action {
    Stop(Duration),
    Kill,
}

struct Hub {
    history: History,
    resource: Arc<FencedResource>,
    key: String,
    holding: Mutex<HashMap<usize, u64>>,
    pids: Mutex<HashMap<usize, u32>>,
    /// Client wall clock minus ours, ms, as reported at HELLO.
    clocks: Mutex<HashMap<usize, i64>>,
    hooks: Mutex<HashMap<usize, Action>>,
    fired: AtomicU64,
    over: AtomicBool,
    transient: AtomicU64,
    errors: Mutex<Vec<String>>,
    evidence: Mutex<Vec<String>>,
    confirmed: AtomicU64,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn wall_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

fn parse_op(s: &str) -> Option<Op> {
    Some(match s {
        "acquire" => Op::Acquire,
        "release" => Op::Release,
        "write" => Op::Write,
        "lost" => Op::Lost,
        "fault" => Op::Fault,
        _ => return None,
    })
}

fn parse_phase(s: &str) -> Option<Phase> {
    Some(match s {
        "invoke" => Phase::Invoke,
        "ok" => Phase::Ok,
        "fail" => Phase::Fail,
        "unknown" => Phase::Unknown,
        _ => return None,
    })
}

/// The process state letter from `/proc/<pid>/stat` (`None`: gone).
fn proc_state(pid: u32) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat.rsplit_once(')')?.1.trim_start().chars().next()
}

/// Polls until the process is in one of `states` (or gone, if `None` is
/// accepted), for up to 2 s.
async fn wait_state(pid: u32, ok: impl Fn(Option<char>) -> bool) -> Option<Option<char>> {
    let end = Instant::now() + Duration::from_secs(2);
    loop {
        let s = proc_state(pid);
        if ok(s) {
            return Some(s);
        }
        if Instant::now() > end {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

impl Hub {
    fn push(&self, p: usize, op: Op, phase: Phase, token: Option<u64>, detail: impl Into<String>) {
        self.history.push(p, op, phase, &self.key, token, detail);
    }

    fn error(&self, e: String) {
        let mut v = lock(&self.errors);
        if v.len() < 20 {
            v.push(e);
        }
    }

    fn confirm(&self, evidence: String) {
        lock(&self.evidence).push(evidence);
        self.confirmed.fetch_add(1, Ordering::Relaxed);
    }

    /// One request; the reply and what to do to the client before the
    /// reply is sent (see `serve`).
    fn handle(&self, id: &mut usize, line: &str) -> (String, Option<Action>) {
        let mut it = line.splitn(5, ' ');
        let ok = || ("OK".to_owned(), None);
        match it.next() {
            Some("HELLO") => {
                let n = it.next().and_then(|s| s.parse().ok()).unwrap_or(usize::MAX);
                *id = n;
                if let Some(w) = it.next().and_then(|s| s.parse::<i64>().ok()) {
                    lock(&self.clocks).insert(n, w - wall_ms());
                }
                // The client's own pid: under faketime the spawned process
                // is the wrapper, which a signal must not be sent to.
                if let Some(pid) = it.next().and_then(|s| s.parse::<u32>().ok()) {
                    lock(&self.pids).insert(n, pid);
                }
                ok()
            }
            Some("EV") => {
                let (Some(op), Some(phase)) = (
                    it.next().and_then(parse_op),
                    it.next().and_then(parse_phase),
                ) else {
                    self.error(format!("client {id}: bad event `{line}`"));
                    return ok();
                };
                let token = it.next().and_then(|t| t.parse::<u64>().ok());
                let detail = it.next().unwrap_or("").to_owned();
                if (op, phase) == (Op::Acquire, Phase::Invoke) && self.over.load(Ordering::SeqCst) {
                    return ("END".into(), None);
                }
                match (op, phase) {
                    (Op::Acquire, Phase::Ok) => {
                        if let Some(t) = token {
                            lock(&self.holding).insert(*id, t);
                        }
                    }
                    (Op::Release, Phase::Invoke) | (Op::Lost, _) => {
                        lock(&self.holding).remove(id);
                    }
                    _ => {}
                }
                self.push(*id, op, phase, token, detail);
                ok()
            }
            Some("ERR") => {
                let retryable = it.next() == Some("1");
                let rest: Vec<&str> = it.collect();
                if retryable {
                    self.transient.fetch_add(1, Ordering::Relaxed);
                } else {
                    self.error(rest.join(" "));
                }
                ok()
            }
            Some(begin @ ("READ" | "RREAD" | "PERMIT")) => {
                let token = it.next().and_then(|t| t.parse().ok()).unwrap_or(0);
                let begun = match begin {
                    "READ" => self.resource.read(token),
                    "RREAD" => self.resource.begin_shared(token),
                    // A permit holder touches the resource only at ENTER,
                    // once it has checked its permit.
                    _ => Some(Read {
                        value: 0,
                        version: 0,
                    }),
                };
                match begun {
                    None => {
                        self.push(
                            *id,
                            Op::Write,
                            Phase::Fail,
                            Some(token),
                            "stale read refused",
                        );
                        ("STALE".into(), None)
                    }
                    Some(r) => {
                        let action = lock(&self.hooks).remove(id);
                        (format!("VAL {} {}", r.value, r.version), action)
                    }
                }
            }
            Some(end @ ("WRITE" | "RDONE" | "ENTER")) => {
                let mut n = || it.next().and_then(|t| t.parse::<u64>().ok()).unwrap_or(0);
                let (token, value, version) = (n(), n(), n());
                let read = Read { value, version };
                let outcome = match end {
                    "WRITE" => self.resource.write(token, read),
                    "RDONE" => self.resource.end_shared(token, read),
                    _ => self.resource.enter(token, crate::family::capacity()),
                };
                let (phase, detail) = match outcome {
                    WriteOutcome::Accepted => (Phase::Ok, "accepted"),
                    WriteOutcome::Rejected => (Phase::Fail, "rejected: stale token"),
                    WriteOutcome::AcceptedStale => (Phase::Ok, "ACCEPTED STALE"),
                };
                self.push(*id, Op::Write, phase, Some(token), detail);
                ("DONE".into(), None)
            }
            Some("LEAVE") => {
                let token = it.next().and_then(|t| t.parse().ok()).unwrap_or(0);
                self.resource.leave(token);
                ok()
            }
            Some("REFUSED") => {
                let token = it.next().and_then(|t| t.parse().ok());
                self.resource.refused_by_holder();
                self.push(
                    *id,
                    Op::Write,
                    Phase::Fail,
                    token,
                    "refused by the holder: permit past its safe deadline",
                );
                ok()
            }
            _ => {
                self.error(format!("client {id}: bad request `{line}`"));
                ok()
            }
        }
    }

    /// Signals client `id` as `action` says, and confirms it took effect.
    async fn act(self: &Arc<Self>, id: usize, action: Action) {
        let Some(pid) = lock(&self.pids).get(&id).copied() else {
            return self.error(format!("client {id}: no pid to signal"));
        };
        let token = lock(&self.holding).get(&id).copied();
        self.fired.fetch_add(1, Ordering::SeqCst);
        match action {
            Action::Stop(d) => {
                self.push(
                    id,
                    Op::Fault,
                    Phase::Invoke,
                    token,
                    format!("SIGSTOP pid {pid}"),
                );
                if let Err(e) = send_signal(Some(pid), "STOP") {
                    return self.error(format!("SIGSTOP {pid}: {e}"));
                }
                match wait_state(pid, |s| s == Some('T')).await {
                    Some(_) => self.confirm(format!(
                        "client {id} (pid {pid}) stopped holding token {token:?}: /proc state T"
                    )),
                    None => self.error(format!("client {id} (pid {pid}) never showed as stopped")),
                }
                let hub = Arc::clone(self);
                let stopped_at = hub.history.now_ns();
                tokio::spawn(async move {
                    tokio::time::sleep(d).await;
                    // Stay stopped until a successor wrote (bounded), so
                    // that the late write always meets a higher token.
                    let more = Instant::now() + d * 4;
                    while Instant::now() < more
                        && !hub.history.events().iter().any(|e| {
                            e.t_ns > stopped_at
                                && e.process != id
                                && e.op == Op::Write
                                && e.phase == Phase::Ok
                        })
                    {
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                    hub.push(
                        id,
                        Op::Fault,
                        Phase::Ok,
                        token,
                        format!("SIGCONT pid {pid}"),
                    );
                    if let Err(e) = send_signal(Some(pid), "CONT") {
                        hub.error(format!("SIGCONT {pid}: {e}"));
                    }
                });
            }
            Action::Kill => {
                self.push(
                    id,
                    Op::Fault,
                    Phase::Invoke,
                    token,
                    format!("SIGKILL pid {pid}"),
                );
                // A process being killed believes nothing any more (and
                // does nothing: it waits for its read's reply, before its write).
                self.push(id, Op::Lost, Phase::Ok, token, "killed");
                lock(&self.holding).remove(&id);
                if let Err(e) = send_signal(Some(pid), "KILL") {
                    return self.error(format!("SIGKILL {pid}: {e}"));
                }
                match wait_state(pid, |s| matches!(s, None | Some('Z') | Some('X'))).await {
                    Some(_) => self.confirm(format!(
                        "client {id} (pid {pid}) killed holding token {token:?}: /proc shows it dead"
                    )),
                    None => self.error(format!("client {id} (pid {pid}) survived SIGKILL")),
                }
            }
        }
    }
}

async fn serve(hub: Arc<Hub>, stream: TcpStream) {
    let (r, mut w) = stream.into_split();
    let mut lines = BufReader::new(r).lines();
    let mut id = usize::MAX;
    while let Ok(Some(line)) = lines.next_line().await {
        let (reply, action) = hub.handle(&mut id, &line);
        // The fault lands before the reply, so always between the victim's
        // read (done by `handle`) and its write: replying first let a victim
        // that writes 50 ms after its read race the external `kill`, and a
        // write that won went in while its lease was still valid.
        if let Some(a) = action {
            hub.act(id, a).await;
        }
        if w.write_all(format!("{reply}\n").as_bytes()).await.is_err() {
            break;
        }
    }
}

/// The client binary: `cfg.client_bin`, else `fenced-faults-client` next
/// to the running executable (or one directory up, from `deps/`).
fn client_binary(cfg: &RunConfig) -> Result<PathBuf, String> {
    let how = "build it with `cargo build -p fenced-faults` (scripts/faults.sh does)";
    if let Some(p) = &cfg.client_bin {
        return if p.exists() {
            Ok(p.clone())
        } else {
            Err(format!("client binary {} not found; {how}", p.display()))
        };
    }
    let exe = std::env::current_exe().map_err(|e| format!("current executable: {e}"))?;
    let mut dir = exe.parent();
    for _ in 0..2 {
        if let Some(d) = dir {
            let c = d.join("fenced-faults-client");
            if c.exists() {
                return Ok(c);
            }
            dir = d.parent();
        }
    }
    Err(format!(
        "fenced-faults-client not found near {}; {how}",
        exe.display()
    ))
}

/// One client process's part in the run.
struct Role {
    skew: Option<&'static str>,
    work_ms: (u64, u64),
    rest_ms: u64,
}

fn roles(cfg: &RunConfig) -> Vec<Role> {
    let ttl = cfg.ttl.as_millis() as u64;
    (0..cfg.clients)
        .map(|i| match (cfg.fault, i) {
            // A short stretch between read and write, as real work has; the
            // signal lands before the read's reply (see `serve`).
            (Fault::ProcessStop | Fault::ProcessKill, 0) => Role {
                skew: None,
                work_ms: (50, 60),
                rest_ms: 0,
            },
            // Holds through several renewals: an expiry taken from its
            // clock (an hour behind) would let the others in at once.
            (Fault::ClockSkew, 0) => Role {
                skew: Some("-1h"),
                work_ms: (ttl * 2, ttl * 2),
                rest_ms: ttl * 2,
            },
            (Fault::ClockSkew, 1) => Role {
                skew: Some("+1h"),
                work_ms: (50, 60),
                rest_ms: 0,
            },
            _ => Role {
                skew: None,
                work_ms: (1, 5),
                rest_ms: 0,
            },
        })
        .collect()
}

/// Runs a process fault: spawns the clients, injects, ends the run, checks.
pub(crate) async fn run(cfg: RunConfig, prep: Prepared) -> Result<RunResult, String> {
    let bin = client_binary(&cfg)?;
    let roles = roles(&cfg);
    let faketime = if roles.iter().any(|r| r.skew.is_some()) {
        Some(
            crate::private::find_binary(&["faketime"], "faketime (libfaketime)")
                .map_err(|e| e.to_string())?,
        )
    } else {
        None
    };
    let listener = TcpListener::bind("127.0.0.1:0")
        .await
        .map_err(|e| format!("hub: {e}"))?;
    let addr = listener.local_addr().map_err(|e| format!("hub: {e}"))?;
    let hub = Arc::new(Hub {
        history: History::new(),
        resource: Arc::new(if cfg.fencing {
            FencedResource::fenced()
        } else {
            FencedResource::unfenced()
        }),
        key: prep.key.clone(),
        holding: Mutex::default(),
        pids: Mutex::default(),
        clocks: Mutex::default(),
        hooks: Mutex::default(),
        fired: AtomicU64::new(0),
        over: AtomicBool::new(false),
        transient: AtomicU64::new(0),
        errors: Mutex::default(),
        evidence: Mutex::default(),
        confirmed: AtomicU64::new(0),
    });
    let recorder = start_recorder(&cfg, &prep, &hub.history).await?;
    let accept = {
        let hub = Arc::clone(&hub);
        tokio::spawn(async move {
            while let Ok((s, _)) = listener.accept().await {
                tokio::spawn(serve(Arc::clone(&hub), s));
            }
        })
    };
    let url = prep.url(&cfg, None)?;
    let mut children = Vec::new();
    for (i, role) in roles.iter().enumerate() {
        let mut cmd = match (&faketime, role.skew) {
            (Some(ft), Some(skew)) => {
                let mut c = tokio::process::Command::new(ft);
                // Only the wall clock moves: tokio's timers keep real time.
                c.env("FAKETIME_DONT_FAKE_MONOTONIC", "1")
                    .arg("-f")
                    .arg(skew)
                    .arg(&bin);
                c
            }
            _ => tokio::process::Command::new(&bin),
        };
        cmd.arg("--url")
            .arg(&url)
            .arg("--key")
            .arg(&prep.key)
            .arg("--id")
            .arg(i.to_string())
            .arg("--hub")
            .arg(addr.to_string())
            .arg("--ttl-ms")
            .arg(cfg.ttl.as_millis().to_string())
            .arg("--work-min-ms")
            .arg(role.work_ms.0.to_string())
            .arg("--work-max-ms")
            .arg(role.work_ms.1.to_string())
            .arg("--seed")
            .arg(cfg.seed.to_string())
            .arg("--rest-ms")
            .arg(role.rest_ms.to_string())
            .arg("--primitive")
            .arg(cfg.primitive.arg());
        if !cfg.fencing {
            cmd.arg("--no-permit-check");
        }
        if let Some(m) = cfg.mutant {
            cmd.arg("--mutant")
                .arg(m.name())
                .arg("--mutant-dir")
                .arg(prep.mutant_dir());
        }
        let log = std::fs::File::create(prep.dir.path().join(format!("client-{i}.log")))
            .map_err(|e| format!("client log: {e}"))?;
        cmd.stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(log)
            .env("FENCED_LOG", "error")
            .kill_on_drop(true);
        let child = cmd
            .spawn()
            .map_err(|e| format!("starting {}: {e}", bin.display()))?;
        children.push(child);
    }

    let result = drive(&cfg, &hub, &roles).await;
    hub.over.store(true, Ordering::SeqCst);
    // Every client finishes its current hold and exits; the hang bound is
    // generous (a waiting acquire gives up after 3 × TTL).
    let bound = cfg.ttl * 8 + Duration::from_secs(20);
    for (i, mut c) in children.into_iter().enumerate() {
        match tokio::time::timeout(bound, c.wait()).await {
            Ok(Ok(status)) if status.success() => {}
            Ok(Ok(status)) => {
                let killed = lock(&hub.evidence)
                    .iter()
                    .any(|e| e.starts_with(&format!("client {i} ")) && e.contains("killed"));
                if !killed {
                    let log =
                        std::fs::read_to_string(prep.dir.path().join(format!("client-{i}.log")))
                            .unwrap_or_default();
                    hub.error(format!("client {i} exited with {status}: {}", log.trim()));
                }
            }
            Ok(Err(e)) => hub.error(format!("client {i}: wait: {e}")),
            Err(_) => {
                let _ = c.kill().await;
                hub.error(format!(
                    "client {i} still running {bound:?} after the end (killed)"
                ));
            }
        }
    }
    // Under faketime the client is a child of the wrapper: make sure none
    // outlives the run.
    for pid in lock(&hub.pids).values() {
        if matches!(proc_state(*pid), Some(s) if s != 'Z' && s != 'X') {
            let _ = send_signal(Some(*pid), "KILL");
        }
    }
    accept.abort();
    if let Err(e) = result {
        hub.error(e);
    }
    let collected = Collected {
        history: hub.history.clone(),
        recorder,
        resource: Arc::clone(&hub.resource),
        loss_latency_ms: Vec::new(),
        errors: std::mem::take(&mut *lock(&hub.errors)),
        transient: hub.transient.load(Ordering::Relaxed),
        evidence: std::mem::take(&mut *lock(&hub.evidence)),
        confirmed: hub.confirmed.load(Ordering::Relaxed),
        lock_conflicts: None,
    };
    finish(cfg, prep, collected).await
}

/// Waits for every client, arms the fault, waits until it fired and the
/// others had time to take over, then returns (the caller ends the run).
async fn drive(cfg: &RunConfig, hub: &Arc<Hub>, roles: &[Role]) -> Result<(), String> {
    let ttl = cfg.ttl;
    let hello_by = Instant::now() + Duration::from_secs(30);
    while lock(&hub.clocks).len() < cfg.clients {
        if Instant::now() > hello_by {
            return Err(format!(
                "only {} of {} client processes reported within 30 s",
                lock(&hub.clocks).len(),
                cfg.clients
            ));
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    for (i, r) in roles.iter().enumerate() {
        let Some(skew) = r.skew else { continue };
        let expect: i64 = if skew.starts_with('-') {
            -3_600_000
        } else {
            3_600_000
        };
        let seen = lock(&hub.clocks).get(&i).copied().unwrap_or(0);
        if (seen - expect).abs() < 300_000 {
            lock(&hub.evidence).push(format!(
                "client {i} runs with its wall clock {:+} s off",
                seen / 1000
            ));
        } else {
            hub.error(format!(
                "client {i} should run {skew} but its clock is {:+} ms off",
                seen
            ));
        }
    }
    // Warm up, then arm the fault for the victim's next read.
    tokio::time::sleep(ttl / 2).await;
    let (victim, action, after) = match cfg.fault {
        Fault::ProcessStop => (0, Action::Stop(ttl * 2), ttl * 5),
        Fault::ProcessKill => (0, Action::Kill, ttl * 4),
        Fault::ClockSkew => (1, Action::Kill, ttl * 4),
        other => return Err(format!("{} is not a process fault", other.name(cfg.target))),
    };
    lock(&hub.hooks).insert(victim, action);
    // Generous: a polling store does not queue, and a loaded machine can
    // keep one client from winning for a while.
    let by = Instant::now() + ttl * 10 + Duration::from_secs(30);
    while hub.fired.load(Ordering::SeqCst) == 0 {
        if Instant::now() > by {
            lock(&hub.hooks).clear();
            return Err(format!(
                "client {victim} never held the lock to suffer {}",
                cfg.fault.name(cfg.target)
            ));
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    tokio::time::sleep(after).await;
    if cfg.fault == Fault::ClockSkew {
        // The slow client (−1 h) must have completed a long hold.
        let deadline = Instant::now() + ttl * 6;
        while !hub
            .history
            .events()
            .iter()
            .any(|e| e.process == 0 && e.op == Op::Write && e.detail == "accepted")
            && Instant::now() < deadline
        {
            tokio::time::sleep(ttl / 4).await;
        }
        let long_holds = hub
            .history
            .events()
            .iter()
            .filter(|e| e.process == 0 && e.op == Op::Write && e.detail == "accepted")
            .count();
        lock(&hub.evidence).push(format!(
            "client 0 (-1 h) kept the key through renewals for {long_holds} hold(s) of 2 x TTL"
        ));
    }
    Ok(())
}
