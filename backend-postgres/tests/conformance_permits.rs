//! The shared conformance suite on PostgreSQL's semaphores (one
//! implementation for both strategies, run here through a `lease` handle):
//! the mutex cases check the semaphore of one permit (its line, tokens from
//! the sequence, expiry on the server's clock, waiting woken by NOTIFY,
//! cancellation), the family cases run as on the mutex stores.

mod common;

use common::PgHarness;
use fenced_conformance::SemaphoresAsMutex;
use fenced_postgres::Strategy;

fenced_conformance::conformance_tests!(
    SemaphoresAsMutex(PgHarness::new(Strategy::Lease).await),
    skips = []
);
