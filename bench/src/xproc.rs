//! Cross-process cells: every task in a process of its own, so that every
//! hand-off goes through the store from one process to another (what a
//! store's in-process shortcuts, such as waking a waiter of the same
//! process at once, cannot help with).
//!
//! The parent starts the running executable again, once per task, with the
//! same arguments and [`ENV`] set to the task ([`ChildTask`], JSON); the
//! binary that embeds the runner hands control to [`child_main`] first thing
//! (the `fenced bench` command does). A child builds its implementation from
//! the [`ChildSpec`] (the same namespace as the parent's), connects, says
//! it is ready on stdout, waits for the parent's start time on stdin, runs
//! the task loop of the in-process cells, and prints its acquisitions.
//!
//! Times cross the process boundary as `CLOCK_MONOTONIC` nanoseconds: one
//! clock for every process of the machine (an `Instant` of one process
//! means nothing in another). Each process converts between its `Instant`s
//! and that clock through one pair of readings taken back to back
//! ([`Clock`]); on Linux `Instant` is that clock, so the pair is off by the
//! time between its two readings, well under a microsecond.
//!
//! Mutual exclusion is checked on the merged timeline: sorted by grant
//! time, no acquisition may start (be granted) before every earlier one
//! ended (its release started).

use std::{
    ffi::OsString,
    io::Write as _,
    path::PathBuf,
    process::Stdio,
    sync::{atomic::AtomicUsize, OnceLock},
    time::Duration,
};

use fenced_api::Driver;
use serde::{Deserialize, Serialize};
use tokio::{
    io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader},
    process::{Child, ChildStdin, Command},
    sync::mpsc,
    task::JoinHandle,
    time::Instant,
};

use crate::{
    runner::{task_loop, ChildSpec, Implementation, DRAIN},
    stats::{self, CellResult, Rec, Servers},
    BenchError, Scenario,
};

/// The environment variable that makes a process a child: its value is the
/// child's task (its implementation, scenario and place) as JSON.
pub const ENV: &str = "FENCED_BENCH_CHILD";

/// Prefix of the protocol's lines on a child's stdout (anything else there
/// is ignored).
const TAG: &str = "FENCED-BENCH-CHILD ";

/// Bound on every child starting, connecting and saying it is ready.
const READY_BOUND: Duration = Duration::from_secs(30);

/// Between the start message and the start time: every child has read it
/// by then.
const LEAD: Duration = Duration::from_millis(200);

/// Bound on the children's results after the last wait gave up.
const RESULT_SLACK: Duration = Duration::from_secs(20);

/// How much of a failed child's stderr goes into the cell's error.
const STDERR_TAIL: usize = 1500;

/// The executable (and its arguments) children are started from.
static LAUNCHER: OnceLock<Launcher> = OnceLock::new();

#[derive(Debug)]
struct Launcher {
    program: PathBuf,
    args: Vec<OsString>,
}

/// One child's task.
#[derive(Debug, Serialize, Deserialize)]
struct ChildTask {
    spec: ChildSpec,
    scenario: Scenario,
    key: String,
    task: usize,
}

/// The parent's start message: the task loop's times, in
/// `CLOCK_MONOTONIC` nanoseconds.
#[derive(Debug, Serialize, Deserialize)]
struct Go {
    start_ns: u64,
    deadline_ns: u64,
    give_up_ns: u64,
}

/// What a child reports on stdout.
#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
enum Msg {
    /// Connected; waiting for [`Go`].
    Ready,
    /// The loop ended: its acquisitions and failures.
    Done(ChildOutcome),
    /// The child could not run.
    Failed(String),
}

#[derive(Debug, Serialize, Deserialize)]
struct ChildOutcome {
    /// Per acquisition: attempt, granted, release started, release done
    /// (`CLOCK_MONOTONIC` ns).
    recs: Vec<[u64; 4]>,
    errors: u64,
    error_sample: Option<String>,
    abandoned: u64,
    violations: u64,
}

/// Call first thing in a binary that runs the bench.
///
/// In a child process started by a cross-process cell (the environment
/// names its task), runs that task and returns the exit code the process
/// should end with. Otherwise registers this executable and its arguments
/// as the one cross-process cells start, and returns `None`: without that,
/// cross-process cells report an error instead of running.
pub async fn child_main(drivers: &[Driver]) -> Option<u8> {
    match std::env::var(ENV) {
        Ok(task) => Some(child(drivers, &task).await),
        Err(_) => {
            if let Ok(program) = std::env::current_exe() {
                let _ = LAUNCHER.set(Launcher {
                    program,
                    args: std::env::args_os().skip(1).collect(),
                });
            }
            None
        }
    }
}

/// Converts between this process's `Instant`s and `CLOCK_MONOTONIC`.
#[derive(Debug, Clone, Copy)]
struct Clock {
    at: Instant,
    ns: u64,
}

fn monotonic_ns() -> Result<u64, BenchError> {
    let ts = nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC)
        .map_err(|e| BenchError::new(format!("clock_gettime(CLOCK_MONOTONIC): {e}")))?;
    let secs = u64::try_from(ts.tv_sec()).unwrap_or(0);
    let nanos = u64::try_from(ts.tv_nsec()).unwrap_or(0);
    Ok(secs * 1_000_000_000 + nanos)
}

fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

impl Clock {
    fn now() -> Result<Clock, BenchError> {
        let at = Instant::now();
        let ns = monotonic_ns()?;
        Ok(Clock { at, ns })
    }

    fn ns(&self, i: Instant) -> u64 {
        if i >= self.at {
            self.ns.saturating_add(nanos(i - self.at))
        } else {
            self.ns.saturating_sub(nanos(self.at - i))
        }
    }

    fn instant(&self, ns: u64) -> Instant {
        if ns >= self.ns {
            self.at + Duration::from_nanos(ns - self.ns)
        } else {
            self.at
                .checked_sub(Duration::from_nanos(self.ns - ns))
                .unwrap_or(self.at)
        }
    }
}

/// Writes one protocol line on stdout.
fn send(msg: &Msg) {
    let line = serde_json::to_string(msg).unwrap_or_else(|e| {
        serde_json::to_string(&Msg::Failed(format!("unprintable result: {e}"))).unwrap_or_default()
    });
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{TAG}{line}");
    let _ = out.flush();
}

/// A child process: runs its task, reports on stdout; the exit code.
async fn child(drivers: &[Driver], task: &str) -> u8 {
    match child_task(drivers, task).await {
        Ok(outcome) => {
            send(&Msg::Done(outcome));
            0
        }
        Err(e) => {
            send(&Msg::Failed(e.0));
            1
        }
    }
}

async fn child_task(drivers: &[Driver], task: &str) -> Result<ChildOutcome, BenchError> {
    let task: ChildTask = serde_json::from_str(task)
        .map_err(|e| BenchError::new(format!("{ENV} is not a child task: {e}")))?;
    let servers = Servers::from_env();
    let imp = build(drivers, &servers, &task.spec)?;
    let mut locker = imp.locker(&task.scenario).await?;
    send(&Msg::Ready);
    let line = tokio::task::spawn_blocking(|| {
        let mut line = String::new();
        std::io::stdin().read_line(&mut line).map(|_| line)
    })
    .await
    .map_err(|e| BenchError::new(format!("reading the start message: {e}")))??;
    let go: Go = serde_json::from_str(line.trim())
        .map_err(|e| BenchError::new(format!("no start message from the parent ({e})")))?;
    let clock = Clock::now()?;
    tokio::time::sleep_until(clock.instant(go.start_ns)).await;
    let counter = AtomicUsize::new(0);
    let s = &task.scenario;
    let outcome = task_loop(
        locker.as_mut(),
        &task.key,
        task.task,
        (s.hold, s.think),
        (clock.instant(go.deadline_ns), clock.instant(go.give_up_ns)),
        &counter,
    )
    .await;
    drop(locker);
    imp.child_done().await;
    Ok(ChildOutcome {
        recs: outcome
            .recs
            .iter()
            .map(|r| [r.t0, r.t1, r.t2, r.t3].map(|t| clock.ns(t)))
            .collect(),
        errors: outcome.errors,
        error_sample: outcome.error_sample,
        abandoned: outcome.abandoned,
        violations: outcome.violations,
    })
}

/// The implementation a child runs, in the parent's namespace.
fn build(
    drivers: &[Driver],
    servers: &Servers,
    spec: &ChildSpec,
) -> Result<Box<dyn Implementation>, BenchError> {
    match &spec.url {
        Some(url) => crate::fenced_impl::for_child(drivers, servers, spec, url),
        None => crate::peers::peers(servers, &spec.id)
            .into_iter()
            .find(|p| p.name() == spec.name)
            .ok_or_else(|| BenchError::new(format!("no implementation {} here", spec.name))),
    }
}

/// A started child, as the parent sees it.
struct Running {
    child: Child,
    stdin: Option<ChildStdin>,
    stderr: JoinHandle<String>,
}

impl Running {
    /// The end of the child's stderr (it is killed first if still running).
    async fn stderr_tail(self) -> String {
        let Running {
            mut child, stderr, ..
        } = self;
        let _ = child.start_kill();
        let text = tokio::time::timeout(Duration::from_secs(2), stderr)
            .await
            .ok()
            .and_then(Result::ok)
            .unwrap_or_default();
        let text = text.trim();
        let cut = text
            .char_indices()
            .rev()
            .nth(STDERR_TAIL)
            .map_or(0, |(i, _)| i);
        text[cut..].to_owned()
    }
}

/// A cross-process cell: `s.tasks` children on one key.
pub(crate) async fn cell(imp: &dyn Implementation, s: &Scenario, servers: &Servers) -> CellResult {
    let mut r = CellResult::empty(imp.name(), imp.kind(), s);
    if let Err(e) = measure(imp, s, servers, &mut r).await {
        r.errors += 1;
        r.error_sample = Some(e.0);
    }
    r
}

/// What a child's stdout reader forwards: a message, or `None` at its end.
type Event = (usize, Option<Msg>);

fn start(
    launcher: &Launcher,
    task: &ChildTask,
    events: &mpsc::UnboundedSender<Event>,
) -> Result<Running, BenchError> {
    let env =
        serde_json::to_string(task).map_err(|e| BenchError::new(format!("child task: {e}")))?;
    let mut child = Command::new(&launcher.program)
        .args(&launcher.args)
        .env(ENV, env)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .map_err(|e| {
            BenchError::new(format!(
                "cannot start a child process ({}): {e}",
                launcher.program.display()
            ))
        })?;
    let (Some(stdout), Some(mut stderr)) = (child.stdout.take(), child.stderr.take()) else {
        return Err(BenchError::new("a child process without its pipes"));
    };
    let (i, tx) = (task.task, events.clone());
    tokio::spawn(async move {
        let mut lines = BufReader::new(stdout).lines();
        while let Ok(Some(line)) = lines.next_line().await {
            if let Some(json) = line.strip_prefix(TAG) {
                let msg = serde_json::from_str(json).unwrap_or_else(|e| {
                    Msg::Failed(format!("unreadable message from the child ({e}): {json}"))
                });
                let _ = tx.send((i, Some(msg)));
            }
        }
        let _ = tx.send((i, None));
    });
    let stderr = tokio::spawn(async move {
        let mut buf = Vec::new();
        let _ = stderr.read_to_end(&mut buf).await;
        String::from_utf8_lossy(&buf).into_owned()
    });
    Ok(Running {
        stdin: child.stdin.take(),
        child,
        stderr,
    })
}

/// The error of child `i`, with the end of its stderr.
async fn child_failed(children: &mut [Option<Running>], i: usize, what: &str) -> BenchError {
    let tail = match children.get_mut(i).and_then(Option::take) {
        Some(c) => c.stderr_tail().await,
        None => String::new(),
    };
    if tail.is_empty() {
        BenchError::new(format!("child process {i}: {what}"))
    } else {
        BenchError::new(format!(
            "child process {i}: {what}; its stderr ends: {tail}"
        ))
    }
}

async fn measure(
    imp: &dyn Implementation,
    s: &Scenario,
    servers: &Servers,
    r: &mut CellResult,
) -> Result<(), BenchError> {
    let spec = imp
        .child_spec()
        .ok_or_else(|| BenchError::new("this implementation cannot run in other processes"))?;
    let launcher = LAUNCHER.get().ok_or_else(|| {
        BenchError::new(
            "cross-process cells start this executable again: it must call \
             fenced_bench::child_main first",
        )
    })?;
    let tag = uuid::Uuid::new_v4().simple().to_string();
    let key = format!("{}-{}", s.name, &tag[..8]);
    let (tx, mut events) = mpsc::unbounded_channel();
    let mut children: Vec<Option<Running>> = Vec::with_capacity(s.tasks);
    for task in 0..s.tasks {
        let t = ChildTask {
            spec: spec.clone(),
            scenario: s.clone(),
            key: key.clone(),
            task,
        };
        children.push(Some(start(launcher, &t, &tx)?));
    }
    drop(tx);
    let bound = Instant::now() + READY_BOUND;
    let mut ready = vec![false; s.tasks];
    while ready.iter().any(|r| !r) {
        match tokio::time::timeout_at(bound, events.recv()).await {
            Ok(Some((i, Some(Msg::Ready)))) => ready[i] = true,
            Ok(Some((i, Some(Msg::Failed(e))))) => {
                return Err(child_failed(&mut children, i, &e).await)
            }
            Ok(Some((i, _))) => {
                return Err(child_failed(&mut children, i, "ended before it was ready").await)
            }
            Ok(None) => return Err(BenchError::new("every child process ended")),
            Err(_) => {
                let i = ready.iter().position(|r| !r).unwrap_or(0);
                let what = format!("not ready within {READY_BOUND:?}");
                return Err(child_failed(&mut children, i, &what).await);
            }
        }
    }
    let cmds_before = stats::commands(imp.server(), servers).await;
    let clock = Clock::now()?;
    let start = Instant::now() + LEAD;
    let deadline = start + s.duration;
    let give_up = deadline + DRAIN;
    let go = serde_json::to_string(&Go {
        start_ns: clock.ns(start),
        deadline_ns: clock.ns(deadline),
        give_up_ns: clock.ns(give_up),
    })
    .map_err(|e| BenchError::new(format!("start message: {e}")))?;
    for c in children.iter_mut().flatten() {
        if let Some(stdin) = c.stdin.as_mut() {
            stdin.write_all(format!("{go}\n").as_bytes()).await?;
            stdin.flush().await?;
        }
    }
    let mut outcomes: Vec<Option<ChildOutcome>> = (0..s.tasks).map(|_| None).collect();
    let bound = give_up + s.hold + RESULT_SLACK;
    while outcomes.iter().any(Option::is_none) {
        match tokio::time::timeout_at(bound, events.recv()).await {
            Ok(Some((i, Some(Msg::Done(o))))) => outcomes[i] = Some(o),
            Ok(Some((i, Some(Msg::Failed(e))))) => {
                return Err(child_failed(&mut children, i, &e).await)
            }
            Ok(Some((_, Some(Msg::Ready)))) => {}
            Ok(Some((i, None))) => {
                if outcomes[i].is_none() {
                    let what = "ended without its results";
                    return Err(child_failed(&mut children, i, what).await);
                }
            }
            Ok(None) => return Err(BenchError::new("every child process ended")),
            Err(_) => {
                let i = outcomes.iter().position(Option::is_none).unwrap_or(0);
                let what = "no results after the cell's last wait gave up";
                return Err(child_failed(&mut children, i, what).await);
            }
        }
    }
    // Their connections close as they exit: the server's counters of the
    // cell are complete only then.
    for c in children.iter_mut().flatten() {
        let _ = tokio::time::timeout(Duration::from_secs(10), c.child.wait()).await;
    }
    let cmds_after = stats::commands(imp.server(), servers).await;
    let mut recs = Vec::new();
    for (task, o) in outcomes.into_iter().enumerate() {
        let Some(o) = o else { continue };
        r.errors += o.errors;
        if r.error_sample.is_none() {
            r.error_sample = o.error_sample;
        }
        r.abandoned += o.abandoned;
        r.violations += o.violations;
        recs.extend(o.recs.iter().map(|t| Rec {
            task,
            t0: clock.instant(t[0]),
            t1: clock.instant(t[1]),
            t2: clock.instant(t[2]),
            t3: clock.instant(t[3]),
        }));
    }
    r.violations += overlaps(&mut recs);
    let total = recs.len();
    stats::analyze(r, recs, s, start, deadline);
    if let (Some(a), Some(b)) = (cmds_before, cmds_after) {
        if total > 0 {
            r.server_cmds_per_acq = Some(b.saturating_sub(a) as f64 / total as f64);
        }
    }
    Ok(())
}

/// Acquisitions granted while an earlier one was still held (sorted by
/// grant time: a grant before the latest release start seen so far).
fn overlaps(recs: &mut [Rec]) -> u64 {
    recs.sort_by_key(|x| x.t1);
    let mut held_until: Option<Instant> = None;
    let mut n = 0;
    for x in recs.iter() {
        if held_until.is_some_and(|u| x.t1 < u) {
            n += 1;
        }
        held_until = Some(held_until.map_or(x.t2, |u| u.max(x.t2)));
    }
    n
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn the_clock_converts_both_ways() {
        let c = Clock::now().unwrap();
        let later = c.at + Duration::from_micros(1500);
        assert_eq!(c.ns(later), c.ns + 1_500_000);
        assert_eq!(c.instant(c.ns(later)), later);
        let earlier = c.at.checked_sub(Duration::from_millis(3)).unwrap();
        assert_eq!(c.instant(c.ns(earlier)), earlier);
        // `Instant` is CLOCK_MONOTONIC: a second pair agrees with the first.
        let d = Clock::now().unwrap();
        let drift = c.ns(d.at).abs_diff(d.ns);
        assert!(drift < 1_000_000, "{drift} ns apart");
    }

    #[test]
    fn overlapping_holds_are_violations() {
        let t = Instant::now();
        let ms = |m: u64| t + Duration::from_millis(m);
        let rec = |task, a, b| Rec {
            task,
            t0: ms(0),
            t1: ms(a),
            t2: ms(b),
            t3: ms(b + 1),
        };
        let mut clean = vec![rec(1, 10, 20), rec(0, 0, 5), rec(2, 21, 30)];
        assert_eq!(overlaps(&mut clean), 0);
        // Task 1 granted at 4 while task 0 held until 5; task 2 inside task 1.
        let mut bad = vec![rec(0, 0, 5), rec(1, 4, 20), rec(2, 6, 8), rec(3, 20, 22)];
        assert_eq!(overlaps(&mut bad), 2);
    }

    #[test]
    fn messages_read_back() {
        let done = Msg::Done(ChildOutcome {
            recs: vec![[1, 2, 3, 4]],
            errors: 0,
            error_sample: None,
            abandoned: 1,
            violations: 0,
        });
        let text = serde_json::to_string(&done).unwrap();
        match serde_json::from_str::<Msg>(&text).unwrap() {
            Msg::Done(o) => assert_eq!((o.recs, o.abandoned), (vec![[1, 2, 3, 4]], 1)),
            other => panic!("{other:?}"),
        }
    }
}
