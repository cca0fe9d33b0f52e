//! The matrix runner: one time-bounded cell per implementation × scenario.

use std::{
    fmt,
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc,
    },
    time::Duration,
};

use async_trait::async_trait;
use tokio::time::Instant;

use crate::{
    stats::{self, CellResult, Kind, ManyKeys, Rec, Server, Servers},
    BenchError, Scenario, ScenarioKind,
};

/// Whether a many-keys cell has run in this process (see [`many_keys`]).
static MANY_KEYS_MEASURED: std::sync::atomic::AtomicBool =
    std::sync::atomic::AtomicBool::new(false);

/// How long tasks may still wait after a cell's deadline before giving up
/// (waits that give up then are counted as `abandoned`, not as errors).
pub(crate) const DRAIN: Duration = Duration::from_secs(3);

/// Extra time a whole cell may take beyond its nominal duration before it is
/// cut off and reported as an error (a hang is a finding, not a stuck run).
const CELL_SLACK: Duration = Duration::from_secs(60);

/// One task's handle on a lock implementation: its own client and connection.
#[async_trait]
pub trait Locker: Send {
    /// Takes `key`, waiting at most until `give_up`.
    ///
    /// `Ok(true)` when held, `Ok(false)` when the wait gave up.
    ///
    /// # Errors
    ///
    /// Whatever the store reports (counted, not fatal).
    async fn acquire(&mut self, key: &str, give_up: Instant) -> Result<bool, BenchError>;

    /// Gives `key` back.
    ///
    /// # Errors
    ///
    /// Whatever the store reports, or a lock found lost at release.
    async fn release(&mut self, key: &str) -> Result<(), BenchError>;

    /// Takes `key` as `role` (a permit of a semaphore, a reader or the
    /// writer), waiting at most until `give_up`; [`release`](Self::release)
    /// gives it back. Only implementations that run family scenarios
    /// ([`Scenario::is_family`]) have it.
    ///
    /// # Errors
    ///
    /// Whatever the store reports; by default that the implementation has
    /// no semaphores.
    async fn acquire_as(
        &mut self,
        key: &str,
        role: Role,
        give_up: Instant,
    ) -> Result<bool, BenchError> {
        let _ = (key, give_up);
        Err(BenchError::new(format!(
            "this implementation cannot take a lock as {role:?}"
        )))
    }

    /// How many of the currently held locks this locker knows are lost
    /// (implementations with renewal); 0 otherwise.
    fn lost(&self) -> usize {
        0
    }

    /// Takes each of `keys` (the many-keys scenario), waiting at most until
    /// `give_up` for each: one result per key, in order. By default one
    /// after another; a locker whose client takes concurrent calls may have
    /// several in flight ([`in_flight`](Self::in_flight)).
    async fn acquire_each(
        &mut self,
        keys: &[String],
        give_up: Duration,
    ) -> Vec<Result<bool, BenchError>> {
        let mut out = Vec::with_capacity(keys.len());
        for key in keys {
            out.push(self.acquire(key, Instant::now() + give_up).await);
        }
        out
    }

    /// Gives each of `keys` back, as [`acquire_each`](Self::acquire_each)
    /// took them.
    async fn release_each(&mut self, keys: &[String]) -> Vec<Result<(), BenchError>> {
        let mut out = Vec::with_capacity(keys.len());
        for key in keys {
            out.push(self.release(key).await);
        }
        out
    }

    /// How many calls [`acquire_each`](Self::acquire_each) and
    /// [`release_each`](Self::release_each) have in flight at once.
    fn in_flight(&self) -> usize {
        1
    }
}

/// Takes `key`'s entry out of a locker's held locks, for its release.
///
/// # Errors
///
/// When `key` is not held (a release without its acquire).
pub(crate) fn take_held<T>(
    held: &mut std::collections::HashMap<String, T>,
    key: &str,
) -> Result<T, BenchError> {
    held.remove(key)
        .ok_or_else(|| BenchError::new(format!("release of `{key}`, which is not held")))
}

/// How a family scenario's task takes its key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// One permit of a semaphore of this many.
    Permit(u32),
    /// A reader of a reader-writer lock.
    Read,
    /// The writer of a reader-writer lock.
    Write,
}

/// A lock implementation under test.
#[async_trait]
pub trait Implementation: Send + Sync + fmt::Debug {
    /// Unique name in the tables (`fenced/redis`, `peer/rslock`).
    fn name(&self) -> &str;
    /// Fenced backend, peer or floor.
    fn kind(&self) -> Kind;
    /// The server it talks to, for command counting.
    fn server(&self) -> Server;
    /// What one acquire + release is: statements or requests, round trips,
    /// how it waits. Shown beside the tables.
    fn note(&self) -> &str {
        ""
    }
    /// Whether it takes part in `scenario`.
    fn runs(&self, scenario: &Scenario) -> bool;
    /// What a child process needs to build this implementation's lockers
    /// (cross-process cells); `None` when it cannot run in another process.
    fn child_spec(&self) -> Option<ChildSpec> {
        None
    }
    /// Run by a child process after its last release, before it exits:
    /// waits for work the process must not cut short (nothing by default).
    async fn child_done(&self) {}
    /// A new locker with its own client / connection, for one task of `scenario`.
    ///
    /// # Errors
    ///
    /// When the store cannot be reached or set up.
    async fn locker(&self, scenario: &Scenario) -> Result<Box<dyn Locker>, BenchError>;
    /// Removes what the implementation created on the server (tables, keys).
    ///
    /// # Errors
    ///
    /// When the store cannot be reached.
    async fn cleanup(&self) -> Result<(), BenchError> {
        Ok(())
    }
}

/// How a child process rebuilds an implementation of its parent: its name,
/// the run's namespace id and, for fenced backends, the store URL.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ChildSpec {
    /// [`Implementation::name`].
    pub name: String,
    /// The run's namespace id (tables, prefixes).
    pub id: String,
    /// The store URL of a `fenced/*` implementation.
    pub url: Option<String>,
}

/// Progress report, once before each cell and once at the end.
#[derive(Debug, Clone)]
pub struct Progress {
    /// Cells finished.
    pub done: usize,
    /// Cells in the run.
    pub total: usize,
    /// `implementation × scenario` about to run (empty at the end).
    pub cell: String,
}

/// Runs every implementation on every scenario it takes part in — each
/// scenario for every implementation, in order, before the next scenario —
/// then cleans up each implementation. Never fails: a cell that cannot run is
/// reported with its error.
pub async fn run(
    impls: &[Box<dyn Implementation>],
    scenarios: &[Scenario],
    servers: &Servers,
    progress: &mut (dyn FnMut(Progress) + Send),
) -> Vec<CellResult> {
    // Scenario by scenario: the cells a target compares (fenced beside its
    // peer and floor) run minutes apart at most, not a whole matrix apart,
    // on a machine whose disk and CPUs are shared and drift.
    let cells: Vec<(usize, &Scenario)> = scenarios
        .iter()
        .flat_map(|s| {
            impls
                .iter()
                .enumerate()
                .filter(move |(_, imp)| imp.runs(s))
                .map(move |(i, _)| (i, s))
        })
        .collect();
    let total = cells.len();
    let mut out = Vec::with_capacity(total);
    for (done, (i, s)) in cells.into_iter().enumerate() {
        let imp = &impls[i];
        progress(Progress {
            done,
            total,
            cell: format!("{} × {}", imp.name(), s.name),
        });
        // Taking and giving back many keys takes time of its own: up to two
        // milliseconds per key (the slowest rows take ≈ 1 000 a second and
        // give them back at ≈ 2 500).
        let per_key = match s.kind {
            ScenarioKind::ManyKeys { keys } => Duration::from_millis(2 * keys as u64),
            _ => Duration::ZERO,
        };
        let limit = s.duration + s.hold + CELL_SLACK + per_key;
        let mut result = match tokio::time::timeout(limit, run_cell(imp.as_ref(), s, servers)).await
        {
            Ok(r) => r,
            Err(_) => {
                let mut r = CellResult::empty(imp.name(), imp.kind(), s);
                r.errors = 1;
                r.error_sample = Some(format!("cell did not finish within {limit:?}"));
                r
            }
        };
        if !imp.note().is_empty() {
            result.note = Some(imp.note().to_owned());
        }
        out.push(result);
    }
    for imp in impls {
        if let Err(e) = imp.cleanup().await {
            tracing_free_warn(&format!("cleanup of {} failed: {e}", imp.name()));
        }
    }
    progress(Progress {
        done: total,
        total,
        cell: String::new(),
    });
    out
}

/// The library logs nothing by itself; cleanup failures go to stderr.
fn tracing_free_warn(msg: &str) {
    #[allow(clippy::print_stderr)]
    {
        eprintln!("fenced-bench: {msg}");
    }
}

async fn run_cell(imp: &dyn Implementation, s: &Scenario, servers: &Servers) -> CellResult {
    if s.kind == ScenarioKind::CrossProcess {
        return crate::xproc::cell(imp, s, servers).await;
    }
    if s.is_family() {
        return crate::family::cell(imp, s, servers).await;
    }
    let (mut lockers, key_base) = match setup(imp, s).await {
        Ok(v) => v,
        Err(r) => return r,
    };
    match s.kind {
        ScenarioKind::ManyKeys { keys } => {
            let mut r = CellResult::empty(imp.name(), imp.kind(), s);
            if let Some(l) = lockers.pop() {
                many_keys(l, &key_base, keys, s, imp.server(), servers, &mut r).await;
            }
            r
        }
        _ => loop_cell(imp, lockers, &key_base, s, servers).await,
    }
}

async fn loop_cell(
    imp: &dyn Implementation,
    lockers: Vec<Box<dyn Locker>>,
    key_base: &str,
    s: &Scenario,
    servers: &Servers,
) -> CellResult {
    let shared = s.kind == ScenarioKind::Contended;
    let n_keys = if shared { 1 } else { s.tasks };
    let counters: Vec<Arc<AtomicUsize>> =
        (0..n_keys).map(|_| Arc::new(AtomicUsize::new(0))).collect();
    let cmds_before = stats::commands(imp.server(), servers).await;
    let start = Instant::now();
    let deadline = start + s.duration;
    let give_up = deadline + DRAIN;
    let mut handles = Vec::with_capacity(s.tasks);
    for (task, mut locker) in lockers.into_iter().enumerate() {
        let key = if shared {
            key_base.to_owned()
        } else {
            format!("{key_base}-{task}")
        };
        let counter = Arc::clone(&counters[if shared { 0 } else { task }]);
        let (hold, think) = (s.hold, s.think);
        handles.push(tokio::spawn(async move {
            task_loop(
                locker.as_mut(),
                &key,
                task,
                (hold, think),
                (deadline, give_up),
                &counter,
            )
            .await
        }));
    }
    let mut all = TaskOutcome::default();
    for h in handles {
        match h.await {
            Ok(t) => all.merge(t),
            Err(e) => all.error(BenchError::new(format!("task panicked: {e}"))),
        }
    }
    let cmds_after = stats::commands(imp.server(), servers).await;
    let mut r = CellResult::empty(imp.name(), imp.kind(), s);
    finish(&mut r, all, s, (start, deadline), (cmds_before, cmds_after));
    r
}

/// One locker per task of `s` and a key (or key prefix) of the cell's own;
/// or, when a locker cannot be made, the cell's result saying so.
pub(crate) async fn setup(
    imp: &dyn Implementation,
    s: &Scenario,
) -> Result<(Vec<Box<dyn Locker>>, String), CellResult> {
    let mut lockers = Vec::with_capacity(s.tasks);
    for _ in 0..s.tasks {
        match imp.locker(s).await {
            Ok(l) => lockers.push(l),
            Err(e) => {
                let mut r = CellResult::empty(imp.name(), imp.kind(), s);
                r.errors = 1;
                r.error_sample = Some(format!("setup: {e}"));
                return Err(r);
            }
        }
    }
    let tag = uuid::Uuid::new_v4().simple().to_string();
    let key_base = format!("{}-{}", s.name, &tag[..8]);
    warm_up(imp, s, &mut lockers, &key_base).await?;
    Ok((lockers, key_base))
}

/// How long a warm-up acquisition may wait before the cell is failed.
const WARM_UP_BOUND: Duration = Duration::from_secs(10);

/// One untimed acquire and release by every locker, on a key of its own,
/// before the cell's window opens: the window measures a running client,
/// not its first connection, session or the store's first write to a fresh
/// data directory (on a just-started ZooKeeper one first acquisition has
/// taken half a second, longer than the smoke profile's whole window).
async fn warm_up(
    imp: &dyn Implementation,
    s: &Scenario,
    lockers: &mut [Box<dyn Locker>],
    key_base: &str,
) -> Result<(), CellResult> {
    let role = match s.kind {
        ScenarioKind::Semaphore { permits } => Some(Role::Permit(permits)),
        ScenarioKind::ReadWrite { .. } => Some(Role::Read),
        _ => None,
    };
    for (i, locker) in lockers.iter_mut().enumerate() {
        let key = format!("{key_base}-warmup-{i}");
        let give_up = Instant::now() + WARM_UP_BOUND;
        let taken = match role {
            Some(role) => locker.acquire_as(&key, role, give_up).await,
            None => locker.acquire(&key, give_up).await,
        };
        let outcome = match taken {
            Ok(true) => locker.release(&key).await,
            Ok(false) => Err(BenchError::new(format!(
                "a free key was not granted within {WARM_UP_BOUND:?}"
            ))),
            Err(e) => Err(e),
        };
        if let Err(e) = outcome {
            let mut r = CellResult::empty(imp.name(), imp.kind(), s);
            r.errors = 1;
            r.error_sample = Some(format!("warm-up: {e}"));
            return Err(r);
        }
    }
    Ok(())
}

/// Fills `r` from the tasks' outcome over the window `start..deadline`:
/// counts, the statistics, and the server's commands per acquisition from
/// its command counts before and after.
pub(crate) fn finish(
    r: &mut CellResult,
    all: TaskOutcome,
    s: &Scenario,
    (start, deadline): (Instant, Instant),
    (before, after): (Option<u64>, Option<u64>),
) {
    r.errors = all.errors;
    r.error_sample = all.error_sample;
    r.abandoned = all.abandoned;
    r.violations = all.violations;
    let total = all.recs.len();
    stats::analyze(r, all.recs, s, start, deadline);
    if let (Some(a), Some(b)) = (before, after) {
        if total > 0 {
            r.server_cmds_per_acq = Some(b.saturating_sub(a) as f64 / total as f64);
        }
    }
}

/// One task's loop: acquire `key`, hold, release, think, until `deadline`
/// (a wait may last until `give_up`). `counter` counts the holders of the
/// key in this process: more than one at an acquisition is a violation.
pub(crate) async fn task_loop(
    locker: &mut dyn Locker,
    key: &str,
    task: usize,
    (hold, think): (Duration, Duration),
    (deadline, give_up): (Instant, Instant),
    counter: &AtomicUsize,
) -> TaskOutcome {
    let mut t = TaskOutcome::default();
    while Instant::now() < deadline {
        let t0 = Instant::now();
        match locker.acquire(key, give_up).await {
            Ok(true) => {}
            Ok(false) => {
                t.abandoned += 1;
                break;
            }
            Err(e) => {
                t.error(e);
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        }
        let t1 = Instant::now();
        if counter.fetch_add(1, Ordering::SeqCst) != 0 {
            t.violations += 1;
        }
        if t1 < deadline && !hold.is_zero() {
            tokio::time::sleep(hold).await;
        }
        let t2 = Instant::now();
        counter.fetch_sub(1, Ordering::SeqCst);
        if let Err(e) = locker.release(key).await {
            t.error(e);
        }
        let t3 = Instant::now();
        t.recs.push(Rec {
            task,
            t0,
            t1,
            t2,
            t3,
        });
        if !think.is_zero() && Instant::now() < deadline {
            tokio::time::sleep(think).await;
        }
    }
    t
}

#[derive(Debug, Default)]
pub(crate) struct TaskOutcome {
    pub(crate) recs: Vec<Rec>,
    pub(crate) errors: u64,
    pub(crate) error_sample: Option<String>,
    pub(crate) abandoned: u64,
    pub(crate) violations: u64,
}

impl TaskOutcome {
    pub(crate) fn error(&mut self, e: BenchError) {
        self.errors += 1;
        self.error_sample.get_or_insert(e.0);
    }

    pub(crate) fn merge(&mut self, o: TaskOutcome) {
        self.recs.extend(o.recs);
        self.errors += o.errors;
        if self.error_sample.is_none() {
            self.error_sample = o.error_sample;
        }
        self.abandoned += o.abandoned;
        self.violations += o.violations;
    }
}

async fn many_keys(
    mut locker: Box<dyn Locker>,
    key_base: &str,
    keys: usize,
    s: &Scenario,
    server: Server,
    servers: &Servers,
    r: &mut CellResult,
) {
    let mut t = TaskOutcome::default();
    let conns_before = stats::connections(server, servers).await;
    // Freed memory stays with the process (the allocator keeps it), so a
    // later many-keys cell reuses what an earlier one grew into: only the
    // first cell of a process measures memory per held lock.
    let first = !MANY_KEYS_MEASURED.swap(true, std::sync::atomic::Ordering::SeqCst);
    let rss_before = stats::rss_kib().filter(|_| first);
    let start = Instant::now();
    let names: Vec<String> = (0..keys).map(|i| format!("{key_base}-{i}")).collect();
    let got = locker.acquire_each(&names, Duration::from_secs(10)).await;
    let mut held = Vec::with_capacity(keys);
    for (key, got) in names.into_iter().zip(got) {
        match got {
            Ok(true) => held.push(key),
            Ok(false) => t.abandoned += 1,
            Err(e) => t.error(e),
        }
    }
    let acquire_s = start.elapsed().as_secs_f64();
    let rss_held = stats::rss_kib().filter(|_| first);
    let conns_held = stats::connections(server, servers).await;
    let requests_before = stats::requests(server, servers).await;
    tokio::time::sleep(s.hold).await;
    let hold_requests = match (requests_before, stats::requests(server, servers).await) {
        (Some(a), Some(b)) => Some(b.saturating_sub(a)),
        _ => None,
    };
    let lost = locker.lost();
    let released_at = Instant::now();
    for done in locker.release_each(&held).await {
        if let Err(e) = done {
            t.error(e);
        }
    }
    let release_s = released_at.elapsed().as_secs_f64();
    r.acquisitions = held.len() as u64;
    r.acq_per_s = if acquire_s > 0.0 {
        held.len() as f64 / acquire_s
    } else {
        0.0
    };
    r.errors = t.errors;
    r.error_sample = t.error_sample;
    r.abandoned = t.abandoned;
    r.many = Some(ManyKeys {
        keys,
        held: held.len(),
        acquire_s,
        held_s: s.hold.as_secs_f64(),
        release_s,
        lost,
        rss_kib_before: rss_before,
        rss_kib_held: rss_held,
        server_connections_before: conns_before,
        server_connections_held: conns_held,
        hold_requests,
        in_flight: locker.in_flight(),
    });
}
