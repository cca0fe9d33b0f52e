//! The shared conformance suite on the Redis Cluster that
//! `scripts/services.sh` forms on 127.0.0.1:7000-7005
//! (`FENCED_TEST_REDIS_CLUSTER_URL` overrides): every lock lives on the
//! shard of its key's slot, and the suite's keys spread over all three.

mod common;

use common::RedisHarness;

fenced_conformance::conformance_tests!(RedisHarness::cluster().await, skips = [
    c07_tokens_increase_after_restart: "the shared cluster keeps nothing on disk (not durable); tests/restart.rs runs this case on a private AOF server",
]);
