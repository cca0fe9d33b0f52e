//! The shared conformance suite on the etcd that `scripts/services.sh`
//! starts (`FENCED_TEST_ETCD_URL` overrides).

mod common;

use common::EtcdHarness;

fenced_conformance::conformance_tests!(EtcdHarness::new().await, skips = [
    c12_reentrant_owner_counts: "etcd offers no reentrancy by owner (reentrant: false); LockClient reentrancy, c12_client_reentrancy, runs",
]);
