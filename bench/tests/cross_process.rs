#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stderr)]
//! The smoke profile's cross-process cell against the real services: every
//! task in a child process (this executable started again, which is why
//! this test has its own `main`), no errors, no mutual-exclusion violation
//! on the merged timeline, and hand-offs between processes measured.

use fenced_bench::{Kind, Profile, ScenarioKind, Servers};

fn main() {
    // `cargo test -- --list` and filters: one test, run whatever the filter.
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a runtime");
    let code = runtime.block_on(async {
        let drivers = fenced::drivers();
        if let Some(code) = fenced_bench::child_main(&drivers).await {
            return i32::from(code);
        }
        cross_process_cells_run_clean(&drivers).await;
        eprintln!("test cross_process_cells_run_clean ... ok");
        0
    });
    runtime.shutdown_timeout(std::time::Duration::from_millis(100));
    std::process::exit(code);
}

async fn cross_process_cells_run_clean(drivers: &[fenced_api::Driver]) {
    let servers = Servers::from_env();
    let only: Vec<String> = [
        "fenced/postgres",
        "peer/pg-advisory",
        "peer/sqlx-advisory",
        "peer/shedlock-pg",
        "fenced/redis",
        "fenced/sqlite",
        "fenced/mysql-row_lock",
    ]
    .map(String::from)
    .into();
    let impls = fenced_bench::implementations(drivers, &servers, &only)
        .await
        .unwrap_or_else(|e| {
            panic!("setting up the benchmark failed ({e}); are the services up? run scripts/services.sh")
        });
    let scenarios: Vec<_> = Profile::Smoke
        .scenarios()
        .into_iter()
        .filter(|s| s.kind == ScenarioKind::CrossProcess)
        .collect();
    assert_eq!(scenarios.len(), 1, "{scenarios:?}");
    let results = fenced_bench::run(&impls, &scenarios, &servers, &mut |_| {}).await;
    let table = fenced_bench::summary_table(&results);
    eprintln!("{table}");
    // One result per implementation that runs the cell: the filter above
    // also matches implementations of other scenarios (the family peers'
    // names start with a mutex peer's), which the runner skips.
    let running = impls.iter().filter(|i| i.runs(&scenarios[0])).count();
    assert!(running >= 8, "only {running} implementations run the cell");
    assert_eq!(results.len(), running, "{table}");
    for r in &results {
        assert_eq!(r.violations, 0, "mutual exclusion violated:\n{table}");
        assert_eq!(
            r.errors, 0,
            "{} × {} had errors ({:?}):\n{table}",
            r.implementation, r.scenario.name, r.error_sample
        );
        assert!(
            r.acquisitions > 0,
            "{} acquired nothing:\n{table}",
            r.implementation
        );
        // Every task is its own process: each acquired, from a line of
        // processes that hand the key to one another.
        assert_eq!(r.per_task.len(), r.scenario.tasks, "{table}");
        if r.kind == Kind::Fenced {
            assert!(
                r.handoff_samples > 0,
                "{}: no hand-off between processes measured:\n{table}",
                r.implementation
            );
        }
    }
    for must in ["fenced/postgres-lease", "peer/shedlock-pg", "fenced/redis"] {
        assert!(
            results.iter().any(|r| r.implementation == must),
            "{must} did not run:\n{table}"
        );
    }
    // PostgreSQL's transaction count per acquisition (pg_stat_database).
    for r in results
        .iter()
        .filter(|r| r.implementation.contains("postgres"))
    {
        assert!(
            r.server_cmds_per_acq.is_some(),
            "{}: no count",
            r.implementation
        );
    }
}
