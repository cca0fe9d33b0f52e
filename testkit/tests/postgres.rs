//! The shared PostgreSQL lets the tests in. A private PostgreSQL keeps committed data through a crash and restart,
//! a hot standby of it streams its writes and reports itself in recovery,
//! and promoting the standby makes it a primary. Run with
//! `cargo test -p fenced-testkit --features postgres`; without the server
//! binaries it fails naming `scripts/services.sh`.

#![cfg(feature = "postgres")]
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use fenced_testkit::private::{PostgresOptions, PrivatePostgres};
use sqlx::{Connection, PgConnection};

async fn count(url: &str, sql: &'static str) -> i64 {
    let mut conn = PgConnection::connect(url).await.unwrap();
    sqlx::query_scalar(sql).fetch_one(&mut conn).await.unwrap()
}

/// Whether something still listens on `port` of 127.0.0.1.
fn listening(port: u16) -> bool {
    std::net::TcpStream::connect_timeout(
        &std::net::SocketAddr::from(([127, 0, 0, 1], port)),
        Duration::from_secs(1),
    )
    .is_ok()
}

#[tokio::test]
async fn the_shared_server_lets_the_tests_in() {
    let url = fenced_testkit::shared::require_postgres().await;
    let mut conn = PgConnection::connect(&url).await.unwrap();
    let can_create: bool =
        sqlx::query_scalar("SELECT has_database_privilege(current_database(), 'CREATE')")
            .fetch_one(&mut conn)
            .await
            .unwrap();
    assert!(can_create, "{url}: the test role cannot create tables");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_restart_standby_and_promotion() {
    let primary = PrivatePostgres::start(PostgresOptions::default())
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let db = primary.create_database("fenced_t").await.unwrap();
    let mut conn = PgConnection::connect(&db).await.unwrap();
    sqlx::raw_sql("CREATE TABLE t (id int PRIMARY KEY); INSERT INTO t VALUES (1), (2)")
        .execute(&mut conn)
        .await
        .unwrap();
    drop(conn);

    // A crash: committed rows come back from the WAL.
    let before = primary.pid().unwrap();
    primary.kill();
    assert_eq!(primary.pid(), None);
    assert!(!listening(primary.port()));
    primary.restart().await.unwrap();
    assert_ne!(primary.pid(), Some(before));
    assert_eq!(count(&db, "SELECT count(*) FROM t").await, 2);

    let standby = PrivatePostgres::standby_of(&primary).await.unwrap();
    assert_ne!(standby.port(), primary.port());
    assert!(standby.in_recovery().await.unwrap());
    assert!(!primary.in_recovery().await.unwrap());
    let replica = standby.url_for("fenced_t");
    assert_eq!(count(&replica, "SELECT count(*) FROM t").await, 2);
    // It streams: a row written on the primary after the backup arrives.
    let mut conn = PgConnection::connect(&db).await.unwrap();
    sqlx::raw_sql("INSERT INTO t VALUES (3)")
        .execute(&mut conn)
        .await
        .unwrap();
    drop(conn);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while count(&replica, "SELECT count(*) FROM t").await != 3 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the standby did not receive the row"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // A clean stop leaves the primary down; the promoted standby writes.
    primary.stop().await.unwrap();
    assert!(!listening(primary.port()));
    standby.promote().await.unwrap();
    assert!(!standby.in_recovery().await.unwrap());
    let mut conn = PgConnection::connect(&replica).await.unwrap();
    sqlx::raw_sql("INSERT INTO t VALUES (4)")
        .execute(&mut conn)
        .await
        .unwrap();
    drop(conn);

    let (port, data) = (standby.port(), standby.data_dir());
    drop(standby);
    assert!(!listening(port));
    assert!(!data.exists());
}
