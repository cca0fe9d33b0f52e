//! The shared conformance suite, once per strategy, on the PostgreSQL that
//! `scripts/services.sh` starts (`FENCED_TEST_POSTGRES_URL` overrides).
//! Every client is a `PostgresLock` of its own (own pool, own listener), as
//! separate processes would have; the restart case uses a private server.

mod common;

mod lease {
    use super::common::PgHarness;
    use fenced_postgres::Strategy;
    fenced_conformance::conformance_tests!(PgHarness::new(Strategy::Lease).await, skips = [
        c08_waiters_served_in_order: "lease waiters of different processes race for a freed key (no fifo)",
    ]);
}

mod advisory {
    use super::common::PgHarness;
    use fenced_postgres::Strategy;
    fenced_conformance::conformance_tests!(PgHarness::new(Strategy::Advisory).await, skips = [
        c07_tokens_increase_after_restart: "an advisory lock lives in its session: a restart ends every session and its lock (not durable; the token sequence is, see tests/advisory.rs)",
    ]);
}
