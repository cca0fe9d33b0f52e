//! The short profile of the fault matrix (CI): every fault on every store
//! where it applies, one seeded run each, plus the control runs with fencing
//! off that prove the effects check can fail. The full profile (`scripts/faults.sh`)
//! runs the same cells many times and writes RELIABILITY.md.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use fenced_faults::{
    mutant::Mutant,
    scenario::{run, Fault, FaultKind, RunConfig, RunResult, Target},
};

/// A run of `fault` on `target`, with the client processes built for this test.
fn config(target: Target, fault: Fault, seed: u64) -> RunConfig {
    let mut cfg = RunConfig::new(target, fault, seed);
    cfg.client_bin = Some(env!("CARGO_BIN_EXE_fenced-faults-client").into());
    cfg
}

async fn cell(target: Target, fault: Fault, seed: u64) -> RunResult {
    let r = run(config(target, fault, seed))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let name = format!("{} × {} (seed {seed})", target.name(), fault.name(target));
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
    assert_eq!(
        r.faults, 1,
        "{name}: the fault was not injected: errors {:?}, evidence {:?}",
        r.errors, r.evidence
    );
    assert_eq!(
        r.confirmed_faults, 1,
        "{name}: the fault was not seen to happen: {:?}",
        r.evidence
    );
    assert_eq!(
        (r.token_regressions, r.forbidden_overlaps),
        (0, 0),
        "{name}: tokens went backwards or two holders overlapped where the store allows none\n{}",
        r.history
    );
    assert!(
        r.liveness_ms.is_some(),
        "{name}: the key was not free again within 4 × TTL after the run: errors {:?}, evidence {:?}",
        r.errors,
        r.evidence
    );
    assert!(r.errors.is_empty(), "{name}: errors {:?}", r.errors);
    if fault.kind() == FaultKind::Server && !target.is_postgres() {
        // Server faults: their private servers are restarted or killed and
        // keep no binary log (scenario::SERVER_FAULT_REASON). PostgreSQL's
        // audit table is data the fault leaves behind: checked below.
        assert!(r.server_truth.is_none(), "{name}: unexpected server record");
        return r;
    }
    // Server truth: every store keeps a record (MySQL and ZooKeeper through
    // the private server the caller holds, see `truth_server`; PostgreSQL
    // in an audit table of the run's namespace); every client grant is in
    // it.
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
    // Overlaps are judged on every store with a record but row_lock, whose
    // lock is an open transaction's row lock (truth::binlog).
    assert_eq!(
        t.overlaps_unjudged.is_some(),
        target == Target::MySqlRowLock,
        "{name}: overlaps_unjudged {:?}",
        t.overlaps_unjudged
    );
    r
}

/// While the returned guard lives, the MySQL cells run on a private
/// MariaDB with a binary log, and the ZooKeeper cells on a private
/// ZooKeeper whose transaction log the recorder reads (server truth).
async fn truth_server(target: Target) -> Option<Box<dyn std::any::Any + Send + Sync>> {
    match target {
        Target::MySqlUniqueKey | Target::MySqlRowLock | Target::MySqlOptimistic => Some(Box::new(
            fenced_faults::truth::binlog::private_server()
                .await
                .unwrap_or_else(|e| panic!("{e}")),
        )),
        Target::ZooKeeper => Some(Box::new(
            fenced_faults::truth::zookeeper::private_server()
                .await
                .unwrap_or_else(|e| panic!("{e}")),
        )),
        _ => None,
    }
}

async fn every_fault_on(target: Target) {
    let _truth = truth_server(target).await;
    for fault in Fault::ALL {
        // The process and server faults have tests of their own below.
        if fault.applies_to(target) && fault.kind() == FaultKind::InProcess {
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

/// On the shared Redis Cluster, each client through a proxy port per node
/// (its URL maps the nodes' announced addresses to them).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_cluster_keeps_safety_under_every_fault() {
    every_fault_on(Target::RedisCluster).await;
}

/// On a private primary, replica and sentinel per run; in the blackhole
/// cell each client reaches the primary through its own proxy (its URL maps
/// the address the sentinel names to it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_sentinel_keeps_safety_under_every_fault() {
    every_fault_on(Target::RedisSentinel).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_keeps_safety_under_every_fault() {
    every_fault_on(Target::Etcd).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zookeeper_keeps_safety_under_every_fault() {
    every_fault_on(Target::ZooKeeper).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_lease_keeps_safety_under_every_fault() {
    every_fault_on(Target::PostgresLease).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_advisory_keeps_safety_under_every_fault() {
    every_fault_on(Target::PostgresAdvisory).await;
}

/// The checker can fail: without fencing, a holder paused past its TTL
/// writes over its successor's update, and the effects check sees it. On
/// ZooKeeper the successor gets in once the paused holder's session expired.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_fencing_a_paused_holder_corrupts_the_resource() {
    for target in [Target::Sqlite, Target::Redis, Target::ZooKeeper] {
        let _truth = truth_server(target).await;
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

/// Real client processes: the holder is SIGSTOPped between its read and its
/// write for 2 × TTL, then SIGCONTed. Others must get the key meanwhile, and
/// its late write must be refused by the fence.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigstopped_client_processes_are_fenced_off() {
    for target in Target::ALL {
        if !Fault::ProcessStop.applies_to(target) {
            continue;
        }
        let _truth = truth_server(target).await;
        let r = cell(target, Fault::ProcessStop, 1).await;
        let name = format!("{} × process-sigstop", target.name());
        assert!(
            r.evidence.iter().any(|e| e.contains("/proc state T")),
            "{name}: the process was not seen stopped: {:?}",
            r.evidence
        );
        assert!(
            r.belief_overlaps > 0,
            "{name}: nobody took the key while the holder was stopped\n{}",
            r.history
        );
        assert!(
            r.resource.rejected > 0 && r.victim_noticed_loss == Some(true),
            "{name}: the stopped holder's write was not refused ({:?}, noticed {:?})\n{}",
            r.resource,
            r.victim_noticed_loss,
            r.history
        );
    }
}

/// Real client processes: the holder is SIGKILLed holding. The others get
/// the key — at the TTL at the latest (hang bound: 4 × TTL + 2 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkilled_holders_free_the_key_by_the_ttl() {
    for target in Target::ALL {
        if !Fault::ProcessKill.applies_to(target) {
            continue;
        }
        let _truth = truth_server(target).await;
        let r = cell(target, Fault::ProcessKill, 1).await;
        let bound = (r.config.ttl * 4).as_secs_f64() * 1e3 + 2_000.0;
        assert!(
            r.takeover_ms.is_some_and(|t| t < bound),
            "{}: after the SIGKILL nobody got the key within {bound} ms ({:?})\n{}",
            target.name(),
            r.takeover_ms,
            r.history
        );
    }
}

/// A client an hour behind holds through renewals (nobody may take it
/// early), one an hour ahead is SIGKILLed holding (its key must not stay
/// taken for its clock's hour). Expiry is the store's business.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_skewed_client_clock_changes_no_expiry() {
    for target in Target::ALL {
        if !Fault::ClockSkew.applies_to(target) {
            continue;
        }
        let _truth = truth_server(target).await;
        let r = cell(target, Fault::ClockSkew, 1).await;
        let name = format!("{} × client-clock-skew", target.name());
        for skew in ["-3600 s off", "+3600 s off"] {
            assert!(
                r.evidence
                    .iter()
                    .any(|e| e.contains(skew) || e.contains(&skew.replace("3600", "3599"))),
                "{name}: no client ran with its clock {skew}: {:?}",
                r.evidence
            );
        }
        assert!(
            r.evidence
                .iter()
                .any(|e| e.contains("kept the key through renewals") && !e.contains("for 0 hold")),
            "{name}: the slow-clock client never completed a long hold: {:?}\n{}",
            r.evidence,
            r.history
        );
        let bound = (r.config.ttl * 4).as_secs_f64() * 1e3 + 2_000.0;
        assert!(
            r.takeover_ms.is_some_and(|t| t < bound),
            "{name}: the fast-clock holder's key stayed taken ({:?} ms)",
            r.takeover_ms
        );
    }
}

/// The skew check can fail: SQLite's clock is the client process's own wall
/// clock (documented in fenced-sqlite), so a client an hour behind writes
/// expiries the others read as past, and one an hour ahead keeps a dead
/// holder's key for an hour.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_expiry_follows_the_client_clock_the_check_sees_it() {
    let r = run(config(Target::Sqlite, Fault::ClockSkew, 1))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(
        !r.is_safe() || r.liveness_ms.is_none() || r.takeover_ms.is_none(),
        "sqlite × client-clock-skew: a skewed clock went unnoticed: {:?}\n{}",
        r.evidence,
        r.history
    );
}

/// Mutants: a lock with one safety mechanism removed must be caught by the
/// fault that exposes it — owner check removed (a paused holder's release
/// frees its successor), NX dropped (contention), expiry from the client
/// clock (a client an hour behind).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutant_locks_are_caught_by_the_fault_suite() {
    for (mutant, fault) in [
        (Mutant::OwnerCheckRemoved, Fault::PausePastTtl),
        (Mutant::NxDropped, Fault::Contention),
        (Mutant::ClientClockExpiry, Fault::ClockSkew),
    ] {
        let mut cfg = config(Target::Redis, fault, 3);
        cfg.mutant = Some(mutant);
        let r = run(cfg).await.unwrap_or_else(|e| panic!("{e}"));
        assert!(
            !r.is_safe(),
            "redis × {} with the {} mutant passed: the suite cannot see that bug\n{:?} non-owner releases {} forbidden overlaps {}",
            fault.name(Target::Redis),
            mutant.name(),
            r.resource,
            r.non_owner_releases,
            r.forbidden_overlaps
        );
    }
}

/// The server restarts (SIGKILL, same data) while a client holds: no token
/// goes backwards, no two holders overlap where the store keeps its locks,
/// the holder learns its loss where the store forgets (Redis without
/// persistence), and the key is live afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_restarts_while_held() {
    for (target, fault) in [
        (Target::Redis, Fault::ServerRestart),
        (Target::Redis, Fault::ServerRestartAof),
        (Target::Etcd, Fault::ServerRestart),
        (Target::MySqlRowLock, Fault::ServerRestart),
        (Target::MySqlUniqueKey, Fault::ServerRestart),
        (Target::ZooKeeper, Fault::ServerRestart),
        (Target::PostgresLease, Fault::ServerRestart),
        (Target::PostgresAdvisory, Fault::ServerRestart),
    ] {
        let r = cell(target, fault, 1).await;
        assert!(
            r.evidence
                .iter()
                .any(|e| e.starts_with("server restarted: pid")),
            "{} × {}: no restart seen: {:?}",
            target.name(),
            fault.name(target),
            r.evidence
        );
        // Stores that lose the lock with the server's memory or sessions.
        if (target, fault) == (Target::Redis, Fault::ServerRestart)
            || matches!(target, Target::MySqlRowLock | Target::PostgresAdvisory)
        {
            assert_eq!(
                r.victim_noticed_loss,
                Some(true),
                "{} × {}: the store forgot the lock but the holder never noticed\n{}",
                target.name(),
                fault.name(target),
                r.history
            );
        }
    }
}

/// The leader of a 3-member etcd cluster is SIGKILLed while a client holds:
/// safety, increasing tokens, a new leader, and the key live afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_leader_killed_while_held() {
    let r = cell(Target::Etcd, Fault::LeaderKill, 1).await;
    assert!(
        r.evidence.iter().any(|e| e.contains("new leader")),
        "no new leader: {:?}",
        r.evidence
    );
}

/// The same on a 3-member ZooKeeper ensemble: the survivors elect a new
/// leader, the sessions (and with them the locks) move over, zxids — the
/// tokens — keep rising across the new epoch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zookeeper_leader_killed_while_held() {
    let r = cell(Target::ZooKeeper, Fault::LeaderKill, 1).await;
    assert!(
        r.evidence.iter().any(|e| e.contains("new leader")),
        "no new leader: {:?}",
        r.evidence
    );
}

/// The primary serving the lock's slot in a private Redis Cluster (three
/// primaries, a replica each, node timeout 1 s) is SIGKILLed while a client
/// holds; its replica takes over. Replication is asynchronous, so the lock
/// may be lost (overlaps are counted, not forbidden): no stale write lands,
/// tokens never go back, the key is live afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_cluster_primary_killed_while_held() {
    let r = cell(Target::RedisCluster, Fault::LeaderKill, 1).await;
    assert!(
        r.evidence.iter().any(|e| e.contains("serves it now")),
        "no new primary: {:?}",
        r.evidence
    );
}

/// The primary Sentinel watches is SIGKILLed while a client holds; the
/// sentinel promotes the replica and the clients follow.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_sentinel_primary_killed_while_held() {
    let r = cell(Target::RedisSentinel, Fault::LeaderKill, 1).await;
    assert!(
        r.evidence.iter().any(|e| e.contains("the sentinel names")),
        "no new primary: {:?}",
        r.evidence
    );
}

/// The server KILLs the row_lock holder's connection: the holder must learn
/// it lost the lock, its write must not land after a successor's, and the
/// others get the key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn row_lock_connection_killed_by_the_server() {
    let r = cell(Target::MySqlRowLock, Fault::KillConnection, 1).await;
    assert!(
        r.evidence
            .iter()
            .any(|e| e.starts_with("KILL of the holding connection")),
        "no KILL: {:?}",
        r.evidence
    );
    assert_eq!(
        r.victim_noticed_loss,
        Some(true),
        "the holder never noticed its connection was killed\n{}",
        r.history
    );
}

/// The server ends the PostgreSQL advisory holder's session
/// (`pg_terminate_backend`): the lock goes with it, the holder must learn
/// it lost the lock (its held connection reads the server's FATAL), its
/// write must not land after a successor's, and the others get the key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_advisory_backend_terminated_by_the_server() {
    let r = cell(Target::PostgresAdvisory, Fault::KillConnection, 1).await;
    assert!(
        r.evidence
            .iter()
            .any(|e| e.starts_with("pg_terminate_backend of the holding backend")),
        "no pg_terminate_backend: {:?}",
        r.evidence
    );
    assert_eq!(
        r.victim_noticed_loss,
        Some(true),
        "the holder never noticed its backend was terminated\n{}",
        r.history
    );
}

/// 16 clients on one key on a MariaDB with `innodb_lock_wait_timeout = 1`,
/// holders dying every third hold, and the conflict injector making fenced's
/// statements deadlock victims (1213) and letting them time out (1205), on
/// every MySQL strategy: every grant exclusive (no conflict read as a grant,
/// a renewal or a release), and the server saw the conflicts happen.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_lock_conflict_storm_grants_stay_exclusive() {
    for target in [
        Target::MySqlUniqueKey,
        Target::MySqlRowLock,
        Target::MySqlOptimistic,
    ] {
        let r = cell(target, Fault::LockStorm, 1).await;
        let (deadlocks, timeouts) = r.lock_conflicts.unwrap_or_else(|| {
            panic!(
                "{}: the server's lock counters were not read: {:?}",
                target.name(),
                r.evidence
            )
        });
        assert!(
            deadlocks > 0 && (timeouts > 0 || target == Target::MySqlRowLock),
            "{}: the storm raised {deadlocks} deadlocks and {timeouts} lock-wait timeouts \
             in fenced's statements: {:?}",
            target.name(),
            r.evidence
        );
    }
}
