//! `fenced-faults`: runs the fault matrix and writes RELIABILITY.md.
//!
//! ```text
//! fenced-faults [--runs N] [--seed S] [--only redis,kill] [--jobs J]
//! ```
//!
//! Run it through `scripts/faults.sh`, which starts the services first.

// A command-line tool: its output is its job.
#![allow(clippy::print_stdout, clippy::print_stderr)]

use std::{path::PathBuf, sync::Arc};

use clap::Parser;
use fenced_faults::{
    mutant::Mutant,
    report,
    scenario::{run, Fault, RunConfig, RunResult, Target},
};
use tokio::sync::Semaphore;

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
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let args = Args::parse();
    let wanted =
        |name: &str| args.only.is_empty() || args.only.iter().any(|o| name.contains(o.as_str()));
    let mut configs = Vec::new();
    for target in Target::ALL {
        for fault in Fault::ALL {
            let name = format!("{} × {}", target.name(), fault.name());
            if fault.applies_to(target) && wanted(&name) {
                for i in 0..args.runs {
                    configs.push(RunConfig::new(target, fault, args.seed + i));
                }
            }
        }
        // Control: the same pause without fencing must be caught.
        if wanted(&format!("{} × control", target.name())) {
            for i in 0..args.runs.min(10) {
                let mut c = RunConfig::new(target, Fault::PausePastTtl, args.seed + i);
                c.fencing = false;
                configs.push(c);
            }
        }
        // Controls: a lock with one safety mechanism removed must be caught
        // by the fault that exposes it.
        for (mutant, fault) in [
            (Mutant::NxDropped, Fault::Contention),
            (Mutant::OwnerCheckRemoved, Fault::PausePastTtl),
            (Mutant::ClientClockExpiry, Fault::ClockSkew),
        ] {
            let name = format!("{} × mutant {}", target.name(), mutant.name());
            if fault.applies_to(target) && wanted(&name) {
                for i in 0..args.runs.min(3) {
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
    let total = configs.len();
    eprintln!("{total} runs, {} at a time", args.jobs.max(1));
    let gate = Arc::new(Semaphore::new(args.jobs.max(1)));
    let mut tasks = Vec::new();
    for cfg in configs {
        let gate = Arc::clone(&gate);
        tasks.push(tokio::spawn(async move {
            let _permit = gate.acquire_owned().await;
            run(cfg).await
        }));
    }
    let mut results: Vec<RunResult> = Vec::new();
    let mut setup_errors = Vec::new();
    for (i, t) in tasks.into_iter().enumerate() {
        match t.await {
            Ok(Ok(r)) => {
                if (i + 1) % 10 == 0 || i + 1 == total {
                    eprintln!("{}/{total}", i + 1);
                }
                results.push(r);
            }
            Ok(Err(e)) => setup_errors.push(e),
            Err(e) => setup_errors.push(format!("a run panicked: {e}")),
        }
    }
    for e in setup_errors.iter().take(5) {
        eprintln!("error: {e}");
    }
    if let Some(dir) = args.jsonl.parent() {
        let _ = std::fs::create_dir_all(dir);
    }
    let mut lines = String::new();
    for r in &results {
        if let Ok(l) = serde_json::to_string(r) {
            lines.push_str(&l);
            lines.push('\n');
        }
        if !r.config.is_control() && !r.is_safe() {
            let p = args.jsonl.with_file_name(format!(
                "unsafe-{}-{}-{}.jsonl",
                r.config.target.name(),
                r.config.fault.name(),
                r.config.seed
            ));
            let _ = std::fs::write(p, &r.history);
        }
    }
    if let Err(e) = std::fs::write(&args.jsonl, lines) {
        eprintln!("error: writing {}: {e}", args.jsonl.display());
    }
    let command = format!(
        "scripts/faults.sh --runs {} --seed {}{}",
        args.runs,
        args.seed,
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
