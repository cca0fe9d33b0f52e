//! The shared conformance suite on a temporary SQLite file: every client is
//! a separate `SqliteLock` (own pool) on that file, as separate processes
//! would be. The restart case uses a private file whose connections are all
//! closed and reopened.

mod common;

use common::SqliteHarness;

fenced_conformance::conformance_tests!(SqliteHarness::new().await, skips = [
    c08_waiters_served_in_order: "SQLite has no native wait: waiters poll and declare no fifo",
]);
