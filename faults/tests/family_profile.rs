//! The family's short profile (CI): semaphores and reader-writer locks on
//! every store, each under one of the faults their cells run (a holder
//! paused past its TTL, a blackhole, a holder dying in the process, a
//! SIGKILLed client process), rotated so that every fault meets every
//! primitive across the stores; and the controls without fencing, which
//! must be caught. The full family cells (`scripts/faults.sh --only
//! "semaphore-2 ×,rw ×"`) run every fault on every store many times.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use fenced_faults::scenario::{run, Fault, Primitive, RunConfig, RunResult, Target};

const FAULTS: [Fault; 4] = [
    Fault::PausePastTtl,
    Fault::BlackholePastTtl,
    Fault::KillHolder,
    Fault::ProcessKill,
];

fn config(target: Target, primitive: Primitive, fault: Fault, seed: u64) -> RunConfig {
    let mut cfg = RunConfig::new(target, fault, seed);
    cfg.primitive = primitive;
    cfg.client_bin = Some(env!("CARGO_BIN_EXE_fenced-faults-client").into());
    cfg
}

async fn family_cell(target: Target, primitive: Primitive, fault: Fault, seed: u64) -> RunResult {
    let r = run(config(target, primitive, fault, seed))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let name = format!(
        "{} × {} (seed {seed})",
        primitive.store_label(target),
        fault.name(target)
    );
    assert!(
        r.is_safe(),
        "{name} broke safety: {:?}, server truth {:?}, non-owner releases {}\n{}",
        r.resource,
        r.server_truth,
        r.non_owner_releases,
        r.history
    );
    assert!(r.acquisitions > 0, "{name}: nobody got in: {:?}", r.errors);
    assert_eq!(
        (r.faults, r.confirmed_faults),
        (1, 1),
        "{name}: the fault was not injected or not seen: {:?}",
        r.evidence
    );
    assert!(
        r.liveness_ms.is_some(),
        "{name}: the key was not free again within 4 × TTL: {:?}",
        r.errors
    );
    assert!(r.errors.is_empty(), "{name}: errors {:?}", r.errors);
    // The store's own list of holders, sampled all run long: every client
    // hold a look fell inside is listed, grants in line order, and it saw
    // the grants happen.
    let t = r
        .server_truth
        .unwrap_or_else(|| panic!("{name}: no server truth was recorded"));
    assert_eq!(
        (t.token_regressions, t.unmatched_client_grants),
        (0, 0),
        "{name}: the store's holders {t:?}\n{}",
        r.history
    );
    assert!(t.overlaps_unjudged.is_some(), "{name}: {t:?}");
    assert!(t.grants > 0, "{name}: the sampler saw no grant");
    if fault == Fault::PausePastTtl {
        // The frozen holder found its lease gone when it woke: a refused
        // step (a stale token, or its own check of its permit).
        assert_eq!(
            r.victim_noticed_loss,
            Some(true),
            "{name}: the paused holder went on as if it held\n{}",
            r.history
        );
    }
    r
}

async fn every_store(primitive: Primitive, shift: usize) {
    for (i, target) in Target::ALL.into_iter().enumerate() {
        // The next fault of the rotation that applies (SQLite has no
        // network to blackhole); Sentinel's only cell is the failover.
        let Some(fault) = (0..FAULTS.len())
            .map(|k| FAULTS[(i + shift + k) % FAULTS.len()])
            .find(|f| f.applies_to(target))
        else {
            assert_eq!(target, Target::RedisSentinel, "no family fault applies");
            continue;
        };
        // Seeds of both parities: a reader-writer victim is a writer on
        // even seeds, a reader on odd ones.
        family_cell(target, primitive, fault, 1 + i as u64).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn semaphores_keep_safety_on_every_store() {
    every_store(Primitive::Semaphore, 0).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reader_writer_locks_keep_safety_on_every_store() {
    every_store(Primitive::ReadWrite, 2).await;
}

/// The checks can fail: without fencing (a semaphore holder that does not
/// look at its permit before using the resource; a resource that takes any
/// reader's or writer's token), a holder paused past its TTL is one user
/// too many, or reads or writes across its successor's write.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_fencing_a_paused_family_holder_is_caught() {
    for (target, primitive, seed) in [
        (Target::Redis, Primitive::Semaphore, 2),
        (Target::PostgresLease, Primitive::ReadWrite, 2),
        (Target::Sqlite, Primitive::ReadWrite, 3),
    ] {
        let mut cfg = config(target, primitive, Fault::PausePastTtl, seed);
        cfg.fencing = false;
        let r = run(cfg).await.unwrap_or_else(|e| panic!("{e}"));
        assert!(
            !r.is_safe() && r.resource.accepted_stale > 0,
            "{} × pause without fencing went unnoticed: {:?}\n{}",
            primitive.store_label(target),
            r.resource,
            r.history
        );
        assert!(
            r.belief_overlaps > 0,
            "{}: no belief beyond the key's capacity recorded",
            primitive.store_label(target)
        );
    }
}
