//! The shared conformance suite on MySQL/MariaDB's semaphores (one
//! implementation for every strategy, run here through a `unique_key`
//! handle): the mutex cases check the semaphore of one permit (its line,
//! per-key tokens, expiry on the server's clock, waiting, cancellation), the
//! family cases run as on the mutex stores.

mod common;

use common::MySqlHarness;
use fenced_conformance::SemaphoresAsMutex;
use fenced_mysql::Strategy;

fenced_conformance::conformance_tests!(
    SemaphoresAsMutex(MySqlHarness::new(Strategy::UniqueKey).await),
    skips = []
);
