//! The shared conformance suite, once per strategy, on the MariaDB that
//! `scripts/services.sh` starts (`FENCED_TEST_MYSQL_URL` overrides).

mod common;

mod unique_key {
    use super::common::MySqlHarness;
    use fenced_mysql::Strategy;
    fenced_conformance::conformance_tests!(MySqlHarness::new(Strategy::UniqueKey).await, skips = [
        c08_waiters_served_in_order: "unique_key waiters poll and declare no fifo",

    ]);
}

mod row_lock {
    use super::common::MySqlHarness;
    use fenced_mysql::Strategy;
    fenced_conformance::conformance_tests!(MySqlHarness::new(Strategy::RowLock).await, skips = [
        c07_tokens_increase_after_restart: "a row lock is an open transaction: it ends with the server (not durable)",
        c08_waiters_served_in_order: "InnoDB grants row-lock waits in no promised order (no fifo)",

    ]);
}

/// `row_lock` with the portable two-statement grant (MySQL's path; on
/// MariaDB the default takes the lock and its token in one statement).
mod row_lock_two_statements {
    use super::common::MySqlHarness;
    use fenced_mysql::Strategy;
    fenced_conformance::conformance_tests!(
        MySqlHarness::with(Strategy::RowLock, "&row_lock_one_statement=false").await,
        skips = [
            c07_tokens_increase_after_restart: "a row lock is an open transaction: it ends with the server (not durable)",
            c08_waiters_served_in_order: "InnoDB grants row-lock waits in no promised order (no fifo)",

    ]);
}

mod optimistic {
    use super::common::MySqlHarness;
    use fenced_mysql::Strategy;
    fenced_conformance::conformance_tests!(MySqlHarness::new(Strategy::Optimistic).await, skips = [
        c08_waiters_served_in_order: "optimistic waiters poll and declare no fifo",

    ]);
}
