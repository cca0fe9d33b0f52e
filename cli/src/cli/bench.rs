//! `fenced bench`: fenced's backends side by side with the locks users would
//! pick instead (see `fenced-bench` and BENCHMARKS.md).

use std::{io::IsTerminal, path::PathBuf};

use clap::Args;
use fenced_bench::{CellResult, MachineInfo, Profile, Servers};

use super::{print, say, EXIT_CONFIG, EXIT_STORE};

#[derive(Debug, Args)]
pub(crate) struct BenchArgs {
    /// Run the tiny smoke subset (about 10 s) instead of the full matrix (about an hour on 2 cores).
    #[arg(long)]
    pub(crate) smoke: bool,
    /// Directory for results.jsonl and the SVG plots.
    #[arg(long, default_value = "bench/results")]
    pub(crate) out: PathBuf,
    /// Only these implementations (comma-separated): a whole name selects
    /// that one (`fenced/redis`, not also `fenced/redis-cluster`), any other
    /// string every name that contains it, e.g. `redis`, `mysql`, `fenced/`,
    /// `zookeeper,zk-` (every ZooKeeper row). Default: all.
    #[arg(long, value_delimiter = ',')]
    pub(crate) only: Vec<String>,
    /// Only scenarios whose name contains one of these (comma-separated),
    /// e.g. `many-keys` or `uncontended,contended-16`. Names: `uncontended`,
    /// `parallel-16`, `contended-<tasks>-h<hold ms>-t<think ms>`,
    /// `xproc-<processes>-…` (waiters in other processes),
    /// `semaphore-<permits>-<tasks>-…`, `rw-<reads %>r-<tasks>-…`
    /// (reader-writer), `many-keys-<locks>`; `--smoke` runs small ones of
    /// each.
    #[arg(long, value_delimiter = ',')]
    pub(crate) scenario: Vec<String>,
    /// Also write a markdown report (BENCHMARKS.md) here.
    #[arg(long)]
    pub(crate) markdown: Option<PathBuf>,
    /// Run nothing: redraw the plots and rewrite the report from the
    /// `results.jsonl` (and `machine.json`) of an earlier run in this
    /// directory, e.g. after editing the notes.
    #[arg(long, value_name = "DIR", conflicts_with_all = ["smoke", "only", "scenario"])]
    pub(crate) from: Option<PathBuf>,
    /// Also replace the summary block of this README (between the markers
    /// `fenced_bench::README_MARKERS`) with this run's headline numbers.
    #[arg(long, value_name = "README")]
    pub(crate) readme: Option<PathBuf>,
    /// Hand-written analysis appended to the markdown report.
    #[arg(long, default_value = "bench/NOTES.md")]
    pub(crate) notes: PathBuf,
}

pub(crate) async fn bench(args: BenchArgs) -> u8 {
    // A child process of a cross-process cell (this binary started again
    // with the same arguments) runs its task and nothing else.
    if let Some(code) = fenced_bench::child_main(&fenced::drivers()).await {
        return code;
    }
    let servers = Servers::from_env();
    let (results, machine) = match &args.from {
        Some(dir) => match earlier_run(dir) {
            Ok(r) => r,
            Err(e) => {
                say(&e);
                return EXIT_CONFIG;
            }
        },
        None => match measure(&args, &servers).await {
            Ok(results) => (results, None),
            Err(code) => return code,
        },
    };
    if let Err(e) = std::fs::create_dir_all(&args.out) {
        say(&format!("cannot create {}: {e}", args.out.display()));
        return EXIT_CONFIG;
    }
    let jsonl = args.out.join("results.jsonl");
    // `--from` the output directory: the data is already there, byte for
    // byte (a rewrite would only move float digits around).
    let same_dir = args
        .from
        .as_ref()
        .is_some_and(|from| from.canonicalize().ok() == args.out.canonicalize().ok());
    if !same_dir {
        if let Err(e) = fenced_bench::write_jsonl(&jsonl, &results) {
            say(&format!("cannot write {}: {e}", jsonl.display()));
            return EXIT_CONFIG;
        }
    }
    let plots = match fenced_bench::write_plots(&args.out, &results) {
        Ok(p) => p,
        Err(e) => {
            say(&format!("cannot write plots: {e}"));
            return EXIT_CONFIG;
        }
    };
    print(&fenced_bench::summary_table(&results));
    print(&format!("\nwrote {}", jsonl.display()));
    for p in &plots {
        print(&format!(", {}", args.out.join(p).display()));
    }
    print("\n");
    let machine = match (machine, args.markdown.is_some() || args.readme.is_some()) {
        (Some(m), _) => Some(m),
        (None, true) => Some(MachineInfo::collect(&servers).await),
        (None, false) => None,
    };
    if let (Some(md), Some(machine)) = (&args.markdown, &machine) {
        // Kept beside the results, so `--from` can rewrite the report later.
        if args.from.is_none() {
            if let Ok(m) = serde_json::to_string_pretty(&machine) {
                let _ = std::fs::write(args.out.join("machine.json"), m);
            }
        }
        let notes = std::fs::read_to_string(&args.notes).unwrap_or_default();
        let body = fenced_bench::markdown(&results, machine, &plots, &notes);
        if let Err(e) = std::fs::write(md, body) {
            say(&format!("cannot write {}: {e}", md.display()));
            return EXIT_CONFIG;
        }
        print(&format!("wrote {}\n", md.display()));
    }
    if let (Some(readme), Some(machine)) = (&args.readme, &machine) {
        let summary = fenced_bench::readme_summary(&results, machine);
        let updated = std::fs::read_to_string(readme)
            .map_err(|e| format!("cannot read {}: {e}", readme.display()))
            .and_then(|text| fenced_bench::replace_readme_summary(&text, &summary))
            .and_then(|text| {
                std::fs::write(readme, text)
                    .map_err(|e| format!("cannot write {}: {e}", readme.display()))
            });
        match updated {
            Ok(()) => print(&format!("wrote the summary in {}\n", readme.display())),
            Err(e) => {
                say(&e);
                return EXIT_CONFIG;
            }
        }
    }
    // A violation anywhere is fatal; errors count only for fenced's own rows:
    // the peers' errors (e.g. the naive lock's InnoDB deadlocks) are data.
    let broken = results
        .iter()
        .any(|r| r.violations > 0 || (r.errors > 0 && r.implementation.starts_with("fenced/")));
    if broken {
        say("some fenced cells had errors, or a cell had mutual-exclusion violations (see the table)");
        1
    } else {
        0
    }
}

/// The results and machine of an earlier run (`--from`).
fn earlier_run(dir: &std::path::Path) -> Result<(Vec<CellResult>, Option<MachineInfo>), String> {
    let jsonl = dir.join("results.jsonl");
    let results = fenced_bench::read_jsonl(&jsonl)
        .map_err(|e| format!("cannot read {}: {e}", jsonl.display()))?;
    if results.is_empty() {
        return Err(format!("{} holds no results", jsonl.display()));
    }
    let machine = std::fs::read_to_string(dir.join("machine.json"))
        .ok()
        .and_then(|m| serde_json::from_str(&m).ok());
    Ok((results, machine))
}

/// Runs the matrix (or the `--only` / `--scenario` part of it).
async fn measure(args: &BenchArgs, servers: &Servers) -> Result<Vec<CellResult>, u8> {
    let drivers = fenced::drivers();
    let impls = match fenced_bench::implementations(&drivers, servers, &args.only).await {
        Ok(i) if i.is_empty() => {
            say("no implementation matches --only");
            return Err(EXIT_CONFIG);
        }
        Ok(i) => i,
        Err(e) => {
            say(&e.to_string());
            return Err(EXIT_STORE);
        }
    };
    let profile = if args.smoke {
        Profile::Smoke
    } else {
        Profile::Full
    };
    let scenarios: Vec<_> = profile
        .scenarios()
        .into_iter()
        .filter(|s| {
            args.scenario.is_empty() || args.scenario.iter().any(|w| s.name.contains(w.as_str()))
        })
        .collect();
    if scenarios.is_empty() {
        let names: Vec<String> = profile.scenarios().into_iter().map(|s| s.name).collect();
        say(&format!(
            "no scenario matches --scenario; this profile's: {}",
            names.join(", ")
        ));
        return Err(EXIT_CONFIG);
    }
    let bar = std::io::stderr().is_terminal().then(|| {
        let b = indicatif::ProgressBar::new(0);
        if let Ok(style) = indicatif::ProgressStyle::with_template(
            "{elapsed_precise} [{bar:30}] {pos}/{len} {msg}",
        ) {
            b.set_style(style.progress_chars("=> "));
        }
        b
    });
    let mut on_progress = |p: fenced_bench::Progress| {
        if let Some(b) = &bar {
            b.set_length(p.total as u64);
            b.set_position(p.done as u64);
            b.set_message(p.cell);
        }
    };
    let results = fenced_bench::run(&impls, &scenarios, servers, &mut on_progress).await;
    if let Some(b) = &bar {
        b.finish_and_clear();
    }
    Ok(results)
}
