//! The shared conformance suite on the Redis that `scripts/services.sh`
//! starts (`FENCED_TEST_REDIS_URL` overrides).

mod common;

use common::RedisHarness;

fenced_conformance::conformance_tests!(RedisHarness::new().await);
