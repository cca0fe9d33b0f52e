//! The shared conformance suite on the etcd that `scripts/services.sh`
//! starts (`FENCED_TEST_ETCD_URL` overrides).

mod common;

use common::EtcdHarness;

fenced_conformance::conformance_tests!(EtcdHarness::new().await);
