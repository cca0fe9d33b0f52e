//! Metrics emitted by [`LockClient`](crate::LockClient), through the
//! [`metrics`](https://docs.rs/metrics) facade: install any recorder
//! (Prometheus, StatsD…) and they appear; without one they cost nothing.
//!
//! | name | kind | labels | meaning |
//! |---|---|---|---|
//! | `fenced_acquire_wait_seconds` | histogram | `backend`, `outcome` (`acquired`, `contended`, `timeout`, `error`) | time from the call to its result |
//! | `fenced_acquire_contended_total` | counter | `backend` | attempts that found the key held (`try_acquire` → `None`, or a wait that timed out) |
//! | `fenced_hold_seconds` | histogram | `backend` | time from the grant to the release |
//! | `fenced_renewals_total` | counter | `backend` | successful watchdog renewals |
//! | `fenced_renewal_failures_total` | counter | `backend` | renewals that failed and will be retried |
//! | `fenced_locks_lost_total` | counter | `backend`, `reason` (`deadline_passed`, `renewal_refused`, `max_hold_exceeded`) | locks reported lost |
//! | `fenced_releases_total` | counter | `backend`, `outcome` (`released`, `not_held`, `error`) | releases, explicit or on drop |
//!
//! Backends add metrics of their own store through the same facade, with
//! the same `backend` label (constants in the backend crate):
//!
//! | name | kind | labels | emitted by | meaning |
//! |---|---|---|---|---|
//! | `fenced_table_rows` | gauge | `backend`, `table` | fenced-mysql: each pass of `MySqlLock::spawn_reaper` (every strategy) and `MySqlLock::record_table_stats` | rows in one of the store's tables: growth means skipped releases or per-request keys |
//! | `fenced_table_expired_rows` | gauge | `backend`, `table` | as above | of those, rows whose lease has expired (`unique_key`: waiting for takeover or the reaper) |
//! | `fenced_reaped_rows_total` | counter | `backend`, `table` | fenced-mysql: the `unique_key` reaper | expired rows the reaper deleted |

use std::time::Duration;

use crate::LossReason;

/// `fenced_acquire_wait_seconds`.
pub const ACQUIRE_WAIT: &str = "fenced_acquire_wait_seconds";
/// `fenced_acquire_contended_total`.
pub const ACQUIRE_CONTENDED: &str = "fenced_acquire_contended_total";
/// `fenced_hold_seconds`.
pub const HOLD: &str = "fenced_hold_seconds";
/// `fenced_renewals_total`.
pub const RENEWALS: &str = "fenced_renewals_total";
/// `fenced_renewal_failures_total`.
pub const RENEWAL_FAILURES: &str = "fenced_renewal_failures_total";
/// `fenced_locks_lost_total`.
pub const LOSSES: &str = "fenced_locks_lost_total";
/// `fenced_releases_total`.
pub const RELEASES: &str = "fenced_releases_total";

pub(crate) fn acquire(backend: &'static str, outcome: &'static str, waited: Duration) {
    metrics::histogram!(ACQUIRE_WAIT, "backend" => backend, "outcome" => outcome)
        .record(waited.as_secs_f64());
    if matches!(outcome, "contended" | "timeout") {
        metrics::counter!(ACQUIRE_CONTENDED, "backend" => backend).increment(1);
    }
}

pub(crate) fn renewed(backend: &'static str) {
    metrics::counter!(RENEWALS, "backend" => backend).increment(1);
}

pub(crate) fn renewal_failed(backend: &'static str) {
    metrics::counter!(RENEWAL_FAILURES, "backend" => backend).increment(1);
}

pub(crate) fn lost(backend: &'static str, reason: LossReason) {
    let reason = match reason {
        LossReason::DeadlinePassed => "deadline_passed",
        LossReason::RenewalRefused => "renewal_refused",
        LossReason::MaxHoldExceeded => "max_hold_exceeded",
        LossReason::StoreReported => "store_reported",
    };
    metrics::counter!(LOSSES, "backend" => backend, "reason" => reason).increment(1);
}

pub(crate) fn released(backend: &'static str, outcome: &'static str, held: Duration) {
    metrics::counter!(RELEASES, "backend" => backend, "outcome" => outcome).increment(1);
    metrics::histogram!(HOLD, "backend" => backend).record(held.as_secs_f64());
}
