//! The shared conformance suite on the SQLite file's semaphores: the mutex
//! cases check the semaphore of one permit (its line, tokens, expiry,
//! waiting and cancellation), the family cases run as on the mutex store.

mod common;

use common::SqliteHarness;
use fenced_conformance::SemaphoresAsMutex;

fenced_conformance::conformance_tests!(SemaphoresAsMutex(SqliteHarness::new().await), skips = []);
