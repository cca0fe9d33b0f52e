//! The shared conformance suite on the ZooKeeper that `scripts/services.sh`
//! starts (`FENCED_TEST_ZOOKEEPER_URL` overrides).

mod common;

use common::ZkHarness;

fenced_conformance::conformance_tests!(ZkHarness::new().await, skips = [
    c12_reentrant_owner_counts: "ZooKeeper locks offer no reentrancy by owner (reentrant: false); LockClient reentrancy, c12_client_reentrancy, runs",
]);
