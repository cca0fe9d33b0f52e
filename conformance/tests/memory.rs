//! The whole suite on the in-memory reference backend.

use fenced_conformance::MemoryHarness;

fenced_conformance::conformance_tests!(MemoryHarness::new(), skips = [
    c07_tokens_increase_after_restart: "MemoryLock keeps nothing across a restart of its process (not durable)",
]);
