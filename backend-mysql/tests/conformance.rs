//! The shared conformance suite, once per strategy, on the MariaDB that
//! `scripts/services.sh` starts (`FENCED_TEST_MYSQL_URL` overrides).

mod common;

mod unique_key {
    use super::common::MySqlHarness;
    use fenced_mysql::Strategy;
    fenced_conformance::conformance_tests!(MySqlHarness::new(Strategy::UniqueKey).await);
}

mod row_lock {
    use super::common::MySqlHarness;
    use fenced_mysql::Strategy;
    fenced_conformance::conformance_tests!(MySqlHarness::new(Strategy::RowLock).await);
}

/// `row_lock` with the portable two-statement grant (MySQL's path; on
/// MariaDB the default takes the lock and its token in one statement).
mod row_lock_two_statements {
    use super::common::MySqlHarness;
    use fenced_mysql::Strategy;
    fenced_conformance::conformance_tests!(
        MySqlHarness::with(Strategy::RowLock, "&row_lock_one_statement=false").await
    );
}

mod optimistic {
    use super::common::MySqlHarness;
    use fenced_mysql::Strategy;
    fenced_conformance::conformance_tests!(MySqlHarness::new(Strategy::Optimistic).await);
}
