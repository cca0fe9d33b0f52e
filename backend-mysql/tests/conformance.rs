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

mod optimistic {
    use super::common::MySqlHarness;
    use fenced_mysql::Strategy;
    fenced_conformance::conformance_tests!(MySqlHarness::new(Strategy::Optimistic).await);
}
