//! The shared conformance suite on ZooKeeper's semaphores: the mutex cases
//! check the semaphore of one permit (its line of sequential nodes,
//! creation zxids as tokens, each entry's TTL on shared sessions, waiting
//! and cancellation), the family cases run as on the mutex store.

mod common;

use common::ZkHarness;
use fenced_conformance::SemaphoresAsMutex;

fenced_conformance::conformance_tests!(SemaphoresAsMutex(ZkHarness::new().await), skips = [
    c12_reentrant_owner_counts: "ZooKeeper offers no reentrancy by owner (reentrant: false); LockClient reentrancy, c12_client_reentrancy, runs",
]);
