//! The whole suite on the in-memory store's semaphores: the mutex cases
//! check its semaphore of one permit, the family cases run as on any store.

use fenced_conformance::{MemoryHarness, SemaphoresAsMutex};

fenced_conformance::conformance_tests!(SemaphoresAsMutex(MemoryHarness::new()), skips = [
    c07_tokens_increase_after_restart: "MemoryLock keeps nothing across a restart of its process (not durable)",
]);
