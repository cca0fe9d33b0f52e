//! `fenced bench`: fenced's backends side by side with the locks users would
//! pick instead (see `fenced-bench` and BENCHMARKS.md).

use std::{io::IsTerminal, path::PathBuf};

use clap::Args;
use fenced_bench::{MachineInfo, Profile, Servers};

use super::{print, say, EXIT_CONFIG, EXIT_STORE};

#[derive(Debug, Args)]
pub(crate) struct BenchArgs {
    /// Run the tiny smoke subset (about 10 s) instead of the full matrix (under 10 min).
    #[arg(long)]
    pub(crate) smoke: bool,
    /// Directory for results.jsonl and the SVG plots.
    #[arg(long, default_value = "bench/results")]
    pub(crate) out: PathBuf,
    /// Only implementations whose name contains one of these (comma-separated),
    /// e.g. `redis`, `mysql`, `fenced/`, `peer/rslock`. Default: all.
    #[arg(long, value_delimiter = ',')]
    pub(crate) only: Vec<String>,
    /// Only scenarios whose name contains one of these (comma-separated),
    /// e.g. `many-keys` or `uncontended,c16`.
    #[arg(long, value_delimiter = ',')]
    pub(crate) scenario: Vec<String>,
    /// Also write a markdown report (BENCHMARKS.md) here.
    #[arg(long)]
    pub(crate) markdown: Option<PathBuf>,
    /// Hand-written analysis appended to the markdown report.
    #[arg(long, default_value = "bench/NOTES.md")]
    pub(crate) notes: PathBuf,
}

pub(crate) async fn bench(args: BenchArgs) -> u8 {
    let servers = Servers::from_env();
    let drivers = fenced::drivers();
    let impls = match fenced_bench::implementations(&drivers, &servers, &args.only).await {
        Ok(i) if i.is_empty() => {
            say("no implementation matches --only");
            return EXIT_CONFIG;
        }
        Ok(i) => i,
        Err(e) => {
            say(&e.to_string());
            return EXIT_STORE;
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
        say("no scenario matches --scenario");
        return EXIT_CONFIG;
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
    let results = fenced_bench::run(&impls, &scenarios, &servers, &mut on_progress).await;
    if let Some(b) = &bar {
        b.finish_and_clear();
    }
    if let Err(e) = std::fs::create_dir_all(&args.out) {
        say(&format!("cannot create {}: {e}", args.out.display()));
        return EXIT_CONFIG;
    }
    let jsonl = args.out.join("results.jsonl");
    if let Err(e) = fenced_bench::write_jsonl(&jsonl, &results) {
        say(&format!("cannot write {}: {e}", jsonl.display()));
        return EXIT_CONFIG;
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
    if let Some(md) = &args.markdown {
        let machine = MachineInfo::collect(&servers).await;
        let notes = std::fs::read_to_string(&args.notes).unwrap_or_default();
        let body = fenced_bench::markdown(&results, &machine, &plots, &notes);
        if let Err(e) = std::fs::write(md, body) {
            say(&format!("cannot write {}: {e}", md.display()));
            return EXIT_CONFIG;
        }
        print(&format!("wrote {}\n", md.display()));
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
