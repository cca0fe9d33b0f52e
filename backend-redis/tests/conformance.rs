//! The shared conformance suite on the Redis that `scripts/services.sh`
//! starts (`FENCED_TEST_REDIS_URL` overrides).

mod common;

use common::RedisHarness;

fenced_conformance::conformance_tests!(RedisHarness::new().await, skips = [
    c07_tokens_increase_after_restart: "the shared Redis keeps nothing on disk (not durable); tests/restart.rs runs this case on a private AOF server",
]);
