//! The short profile of the fault matrix (CI): every fault on every store
//! where it applies, one seeded run each, plus the control runs with fencing
//! off that prove the effects check can fail. The full profile (`scripts/faults.sh`)
//! runs the same cells many times and writes RELIABILITY.md.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use fenced_faults::scenario::{run, Fault, RunConfig, RunResult, Target};

async fn cell(target: Target, fault: Fault, seed: u64) -> RunResult {
    let r = run(RunConfig::new(target, fault, seed))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let name = format!("{} × {} (seed {seed})", target.name(), fault.name());
    assert!(
        r.is_safe(),
        "{name} broke safety: {:?}, server truth {:?}, non-owner releases {}\n{}",
        r.resource,
        r.server_truth,
        r.non_owner_releases,
        r.history
    );
    assert!(
        r.acquisitions > 0,
        "{name}: nobody got the lock: errors {:?}, {} retryable\n{}",
        r.errors,
        r.transient_errors,
        r.history.lines().take(20).collect::<Vec<_>>().join("\n")
    );
    assert_eq!(r.faults, 1, "{name}: the fault was not injected");
    assert!(
        r.liveness_ms.is_some(),
        "{name}: the key was not free again within 4 × TTL after the run"
    );
    assert!(r.errors.is_empty(), "{name}: errors {:?}", r.errors);
    // Server truth: every store keeps a record (MySQL through the private
    // binlog server every_fault_on holds); every client grant is in it.
    let t = r
        .server_truth
        .unwrap_or_else(|| panic!("{name}: no server truth was recorded"));
    assert!(
        t.grants as u64 >= r.acquisitions,
        "{name}: the store's record shows {} grants for {} acquisitions",
        t.grants,
        r.acquisitions
    );
    assert_eq!(
        (t.overlaps, t.token_regressions, t.unmatched_client_grants),
        (0, 0, 0),
        "{name}: server truth {t:?}\n{}",
        r.history
    );
    assert_eq!(
        t.overlaps_unjudged.is_some(),
        target == Target::MySqlRowLock,
        "{name}: overlaps are judged on every store but row_lock"
    );
    r
}

async fn every_fault_on(target: Target) {
    // The MySQL cells run on a private MariaDB with a binary log (server truth).
    let _binlog = match target {
        Target::MySqlUniqueKey | Target::MySqlRowLock | Target::MySqlOptimistic => Some(
            fenced_faults::truth::binlog::private_server()
                .await
                .unwrap_or_else(|e| panic!("{e}")),
        ),
        _ => None,
    };
    for fault in Fault::ALL {
        if fault.applies_to(target) {
            cell(target, fault, 1).await;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_keeps_safety_under_every_fault() {
    every_fault_on(Target::Sqlite).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_unique_key_keeps_safety_under_every_fault() {
    every_fault_on(Target::MySqlUniqueKey).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_row_lock_keeps_safety_under_every_fault() {
    every_fault_on(Target::MySqlRowLock).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_optimistic_keeps_safety_under_every_fault() {
    every_fault_on(Target::MySqlOptimistic).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_keeps_safety_under_every_fault() {
    every_fault_on(Target::Redis).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_keeps_safety_under_every_fault() {
    every_fault_on(Target::Etcd).await;
}

/// The checker can fail: without fencing, a holder paused past its TTL
/// writes over its successor's update, and the effects check sees it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_fencing_a_paused_holder_corrupts_the_resource() {
    for target in [Target::Sqlite, Target::Redis] {
        let mut cfg = RunConfig::new(target, Fault::PausePastTtl, 7);
        cfg.fencing = false;
        let r = run(cfg).await.unwrap_or_else(|e| panic!("{e}"));
        assert!(
            !r.is_safe() && r.resource.accepted_stale > 0,
            "{}: a pause past the TTL without fencing went unnoticed: {:?}\n{}",
            target.name(),
            r.resource,
            r.history
        );
        assert!(
            r.belief_overlaps > 0,
            "{}: no belief overlap recorded",
            target.name()
        );
    }
}
