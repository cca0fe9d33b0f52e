#![allow(clippy::unwrap_used, clippy::expect_used)]
//! The smoke profile against the real services: it must complete with no
//! errors and no mutual-exclusion violations. No timing is asserted here;
//! timings belong in the benchmark output.

use fenced_bench::{Kind, Profile, ScenarioKind, Servers};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn smoke_profile_runs_clean_on_every_implementation() {
    let servers = Servers::from_env();
    let drivers = fenced::drivers();
    let impls = fenced_bench::implementations(&drivers, &servers, &[])
        .await
        .unwrap_or_else(|e| {
            panic!("setting up the benchmark failed ({e}); are the services up? run scripts/services.sh")
        });
    let names: Vec<String> = impls.iter().map(|i| i.name().to_owned()).collect();
    for must in [
        "fenced/sqlite",
        "fenced/mysql-unique_key",
        "fenced/redis",
        "peer/rslock",
        "peer/naive-insert",
        "fenced/zookeeper",
        "peer/zk-lock",
        "floor/zk-exists",
        "fenced/postgres-lease",
        "fenced/postgres-advisory",
        "floor/pg-select1",
        "peer/pg-advisory",
        "peer/sqlx-advisory",
        "peer/shedlock-pg",
    ] {
        assert!(
            names.iter().any(|n| n == must),
            "{must} missing from {names:?}"
        );
    }
    // The cross-process cell starts this executable again: it has a test of
    // its own (tests/cross_process.rs, with its own main).
    let scenarios: Vec<_> = Profile::Smoke
        .scenarios()
        .into_iter()
        .filter(|s| s.kind != ScenarioKind::CrossProcess)
        .collect();
    let results = fenced_bench::run(&impls, &scenarios, &servers, &mut |_| {}).await;
    let table = fenced_bench::summary_table(&results);
    assert!(!results.is_empty());
    for r in &results {
        assert_eq!(r.violations, 0, "mutual exclusion violated:\n{table}");
        assert_eq!(
            r.errors, 0,
            "{} × {} had errors ({:?}):\n{table}",
            r.implementation, r.scenario.name, r.error_sample
        );
        assert!(
            r.acquisitions > 0,
            "{} × {} acquired nothing:\n{table}",
            r.implementation,
            r.scenario.name
        );
    }
    // ZooKeeper's request count comes from `mntr` (a whitelisted four-letter
    // word), PostgreSQL's from pg_stat_database.
    for r in results.iter().filter(|r| {
        (r.implementation.contains("zookeeper")
            || r.implementation.contains("/zk-")
            || r.implementation.contains("postgres")
            || r.implementation.contains("/pg-"))
            && r.many.is_none()
    }) {
        assert!(
            r.server_cmds_per_acq.is_some(),
            "{} × {}: no request count from mntr or pg_stat_database",
            r.implementation,
            r.scenario.name
        );
    }
    // Every fenced implementation ran every smoke scenario it takes part in.
    let fenced_cells = results.iter().filter(|r| r.kind == Kind::Fenced).count();
    assert!(fenced_cells >= 2 * names.iter().filter(|n| n.starts_with("fenced/")).count());
    // The report renders from these results.
    let md = fenced_bench::markdown(
        &results,
        &fenced_bench::MachineInfo::collect(&servers).await,
        &[],
        "",
    );
    assert!(md.contains("## Targets"));
}
