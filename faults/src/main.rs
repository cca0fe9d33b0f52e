//! `fenced-faults`: runs the fault matrix and writes RELIABILITY.md.
//!
//! ```text
//! fenced-faults [--runs N] [--seed S] [--only redis,kill] [--jobs J]
//! ```
//!
//! Run it through `scripts/faults.sh`, which starts the services first.

// A command-line tool: its output is its job.
#![allow(clippy::print_stdout, clippy::print_stderr)]

use std::{io::Write as _, path::PathBuf};

use clap::Parser;
use fenced_faults::{
    mutant::Mutant,
    report,
    scenario::{run, Fault, Primitive, RunConfig, RunResult, Target},
};

#[derive(Debug, Parser)]
#[command(about = "Inject faults into real stores and check that fenced's locks stay safe")]
struct Args {
    /// Seeded runs per store × fault cell.
    #[arg(long, default_value_t = 100)]
    runs: u64,
    /// First seed; run i of a cell uses seed + i.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Only cells whose `store × fault` name contains one of these (comma-separated).
    #[arg(long, value_delimiter = ',')]
    only: Vec<String>,
    /// Cells run at once (each has its own key and namespace).
    #[arg(long, default_value_t = 2)]
    jobs: usize,
    /// Where the report goes.
    #[arg(long, default_value = "RELIABILITY.md")]
    out: PathBuf,
    /// Where every run's summary goes (JSON lines); histories of unsafe runs go beside it.
    #[arg(long, default_value = "faults/results/runs.jsonl")]
    jsonl: PathBuf,
    /// Run the MySQL cells against the shared server (no binary log, so no
    /// server truth) instead of a private MariaDB with a binary log.
    #[arg(long)]
    shared_mysql: bool,
    /// Keep the runs already in `--jsonl` and run only the missing ones; the
    /// report covers both. Each row names the commit it ran on, so a profile
    /// spread over several sittings says which code each part tested.
    #[arg(long)]
    resume: bool,
    /// Start no new run after this many minutes (those in flight finish);
    /// with `--resume`, a long profile can be run in sittings.
    #[arg(long, value_name = "MINUTES")]
    budget_min: Option<u64>,
}

/// What makes two runs the same run: a resumed profile skips a config whose
/// key is already in the file.
fn run_key(c: &RunConfig) -> String {
    let primitive = match c.primitive {
        // Runs recorded before the family cells have no primitive: mutex.
        Primitive::Mutex => String::new(),
        p => format!("/{p:?}"),
    };
    format!(
        "{:?}/{:?}/{}/{}/{:?}{primitive}",
        c.target, c.fault, c.seed, c.fencing, c.mutant
    )
}

/// The runs already recorded in `path` (resume). Lines that do not parse
/// (a run cut off mid-write) are dropped and re-run.
fn recorded(path: &std::path::Path) -> Result<Vec<RunResult>, String> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(format!("reading {}: {e}", path.display())),
    };
    let mut out = Vec::new();
    let mut bad = 0;
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        match serde_json::from_str::<RunResult>(line) {
            Ok(r) => out.push(r),
            Err(_) => bad += 1,
        }
    }
    if bad > 0 {
        eprintln!(
            "{}: {bad} line(s) unreadable, their runs will be run again",
            path.display()
        );
    }
    Ok(out)
}

/// The commit being run, with `+dirty` when the work tree has changes.
fn current_commit() -> Option<String> {
    let git = |args: &[&str]| {
        std::process::Command::new("git")
            .args(args)
            .output()
            .ok()
            .filter(|o| o.status.success())
            .and_then(|o| String::from_utf8(o.stdout).ok())
    };
    let head = git(&["rev-parse", "--short=12", "HEAD"])?;
    let dirty = git(&["status", "--porcelain", "--untracked-files=no"])
        .is_some_and(|s| !s.trim().is_empty());
    Some(format!(
        "{}{}",
        head.trim(),
        if dirty { "+dirty" } else { "" }
    ))
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let args = Args::parse();
    let wanted =
        |name: &str| args.only.is_empty() || args.only.iter().any(|o| name.contains(o.as_str()));
    // Seed-major: every cell gets its run i before any gets run i + 1, so a
    // profile stopped (and later resumed) at any point is even across cells.
    let mut configs = Vec::new();
    for i in 0..args.runs {
        for target in Target::ALL {
            for fault in Fault::ALL {
                let name = format!("{} × {}", target.name(), fault.name(target));
                if fault.applies_to(target) && wanted(&name) {
                    configs.push(RunConfig::new(target, fault, args.seed + i));
                }
            }
            // The family: semaphores and reader-writer locks under the
            // faults `Primitive::runs` names, and their pause without
            // fencing as a control.
            for primitive in [Primitive::Semaphore, Primitive::ReadWrite] {
                for fault in Fault::ALL {
                    let name =
                        format!("{} × {}", primitive.store_label(target), fault.name(target));
                    if primitive.runs(fault) && fault.applies_to(target) && wanted(&name) {
                        let mut c = RunConfig::new(target, fault, args.seed + i);
                        c.primitive = primitive;
                        configs.push(c);
                    }
                }
                let name = format!("{} × control", primitive.store_label(target));
                if i < 10 && Fault::PausePastTtl.applies_to(target) && wanted(&name) {
                    let mut c = RunConfig::new(target, Fault::PausePastTtl, args.seed + i);
                    c.primitive = primitive;
                    c.fencing = false;
                    configs.push(c);
                }
            }
            // Control: the same pause without fencing must be caught (where
            // the pause is a cell).
            if i < 10
                && Fault::PausePastTtl.applies_to(target)
                && wanted(&format!("{} × control", target.name()))
            {
                let mut c = RunConfig::new(target, Fault::PausePastTtl, args.seed + i);
                c.fencing = false;
                configs.push(c);
            }
            // Controls: a lock with one safety mechanism removed must be
            // caught by the fault that exposes it.
            for (mutant, fault) in [
                (Mutant::NxDropped, Fault::Contention),
                (Mutant::OwnerCheckRemoved, Fault::PausePastTtl),
                (Mutant::ClientClockExpiry, Fault::ClockSkew),
            ] {
                let name = format!("{} × mutant {}", target.name(), mutant.name());
                if i < 3 && fault.applies_to(target) && wanted(&name) {
                    let mut c = RunConfig::new(target, fault, args.seed + i);
                    c.mutant = Some(mutant);
                    configs.push(c);
                }
            }
        }
    }
    if configs.is_empty() {
        eprintln!("no cell matches --only {:?}", args.only);
        return std::process::ExitCode::from(78);
    }
    // Resume: keep what is recorded, run the rest. Without it the file
    // starts empty; either way each run is appended as it ends, so a profile
    // stopped half-way keeps its finished runs.
    let mut results: Vec<RunResult> = if args.resume {
        match recorded(&args.jsonl) {
            Ok(r) => r,
            Err(e) => {
                eprintln!("error: {e}");
                return std::process::ExitCode::from(74);
            }
        }
    } else {
        Vec::new()
    };
    let done: std::collections::HashSet<String> =
        results.iter().map(|r| run_key(&r.config)).collect();
    let planned = configs.len();
    configs.retain(|c| !done.contains(&run_key(c)));
    if let Some(dir) = args.jsonl.parent() {
        let _ = std::fs::create_dir_all(dir);
    }
    let mut sink = {
        let mut lines = String::new();
        for r in &results {
            if let Ok(l) = serde_json::to_string(r) {
                lines.push_str(&l);
                lines.push('\n');
            }
        }
        // Rewritten whole, so unreadable lines go and the kept ones stay.
        match std::fs::write(&args.jsonl, lines)
            .and_then(|()| std::fs::OpenOptions::new().append(true).open(&args.jsonl))
        {
            Ok(f) => f,
            Err(e) => {
                eprintln!("error: writing {}: {e}", args.jsonl.display());
                return std::process::ExitCode::from(74);
            }
        }
    };
    // MySQL server truth needs a binary log: a private MariaDB for the run.
    let mysql = configs.iter().any(|c| {
        matches!(
            c.target,
            Target::MySqlUniqueKey | Target::MySqlRowLock | Target::MySqlOptimistic
        )
    });
    let _binlog_server = if mysql && !args.shared_mysql {
        match fenced_faults::truth::binlog::private_server().await {
            Ok(db) => Some(db),
            Err(e) => {
                eprintln!("error: {e}");
                return std::process::ExitCode::from(69);
            }
        }
    } else {
        None
    };
    // ZooKeeper server truth reads a transaction log: a private ZooKeeper
    // whose data directory this process owns.
    let zookeeper = configs.iter().any(|c| c.target == Target::ZooKeeper);
    let _txn_log_server = if zookeeper {
        match fenced_faults::truth::zookeeper::private_server().await {
            Ok(zk) => Some(zk),
            Err(e) => {
                eprintln!("error: {e}");
                return std::process::ExitCode::from(69);
            }
        }
    } else {
        None
    };
    let total = configs.len();
    let commit = current_commit();
    eprintln!(
        "{total} runs to do ({} of {planned} already recorded), {} at a time, commit {}",
        planned - total,
        args.jobs.max(1),
        commit.as_deref().unwrap_or("unknown")
    );
    // At most `jobs` runs in flight, started in order (seed-major), each
    // recorded the moment it ends: a profile stopped at any point keeps
    // every finished run.
    let stop_starting = args
        .budget_min
        .map(|m| std::time::Instant::now() + std::time::Duration::from_secs(m.saturating_mul(60)));
    let mut pending = configs.into_iter();
    let mut running = tokio::task::JoinSet::new();
    let mut setup_errors = Vec::new();
    let mut finished = 0usize;
    let mut skipped = 0usize;
    loop {
        while running.len() < args.jobs.max(1) {
            if stop_starting.is_some_and(|t| std::time::Instant::now() >= t) {
                skipped = pending.len();
                pending = Vec::new().into_iter();
            }
            let Some(cfg) = pending.next() else { break };
            running.spawn(async move {
                let started = std::time::Instant::now();
                run(cfg).await.map(|mut r| {
                    r.elapsed_s = Some(started.elapsed().as_secs_f64());
                    r
                })
            });
        }
        let Some(done) = running.join_next().await else {
            break;
        };
        finished += 1;
        if finished.is_multiple_of(10) || finished == total {
            eprintln!("{finished}/{total}");
        }
        match done {
            Ok(Ok(mut r)) => {
                r.commit.clone_from(&commit);
                if let Ok(l) = serde_json::to_string(&r) {
                    if let Err(e) = writeln!(sink, "{l}") {
                        eprintln!("error: writing {}: {e}", args.jsonl.display());
                    }
                }
                if !r.config.is_control() && !r.is_safe() {
                    let p = args.jsonl.with_file_name(format!(
                        "unsafe-{}-{}-{}.jsonl",
                        r.config
                            .primitive
                            .store_label(r.config.target)
                            .replace(' ', "-"),
                        r.config.fault.name(r.config.target),
                        r.config.seed
                    ));
                    let _ = std::fs::write(p, &r.history);
                }
                results.push(r);
            }
            Ok(Err(e)) => setup_errors.push(e),
            Err(e) => setup_errors.push(format!("a run panicked: {e}")),
        }
    }
    if skipped > 0 {
        eprintln!("time budget spent: {skipped} runs not started; `--resume` runs them later");
    }
    for e in setup_errors.iter().take(5) {
        eprintln!("error: {e}");
    }
    let command = format!(
        "scripts/faults.sh --runs {} --seed {}{}{}",
        args.runs,
        args.seed,
        if args.resume { " --resume" } else { "" },
        if args.only.is_empty() {
            String::new()
        } else {
            format!(" --only {}", args.only.join(","))
        }
    );
    let machine = std::process::Command::new("date")
        .arg("-u")
        .arg("+%Y-%m-%d")
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .map(|d| {
            format!(
                "{} ({} CPUs, loopback servers)",
                d.trim(),
                std::thread::available_parallelism().map_or(0, |n| n.get())
            )
        })
        .unwrap_or_else(|| "this machine".into());
    let md = report::markdown(&results, &command, &machine);
    if let Err(e) = std::fs::write(&args.out, &md) {
        eprintln!("error: writing {}: {e}", args.out.display());
        return std::process::ExitCode::from(74);
    }
    println!("{md}");
    let unsafe_runs = results
        .iter()
        .filter(|r| !r.config.is_control() && !r.is_safe())
        .count();
    if unsafe_runs > 0 || !setup_errors.is_empty() {
        eprintln!(
            "{unsafe_runs} unsafe runs, {} set-up errors",
            setup_errors.len()
        );
        return std::process::ExitCode::FAILURE;
    }
    std::process::ExitCode::SUCCESS
}
