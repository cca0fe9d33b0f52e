//! The shared conformance suite on Redis's semaphores: the mutex cases
//! check the semaphore of one permit (its line, tokens, expiry on the
//! server's clock, waiting, cancellation), the family cases run as on the
//! mutex store.

mod common;

use common::RedisHarness;
use fenced_conformance::SemaphoresAsMutex;

fenced_conformance::conformance_tests!(SemaphoresAsMutex(RedisHarness::new().await), skips = [
    c07_tokens_increase_after_restart: "the shared Redis keeps nothing on disk (not durable)",
]);
