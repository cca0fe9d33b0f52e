//! Each private server kind starts, answers, survives a hard restart and is
//! gone once dropped. Run with the server kinds' features
//! (`cargo test -p fenced-testkit --all-features`).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

/// Whether something still listens on `port` of 127.0.0.1.
#[allow(dead_code)]
fn listening(port: u16) -> bool {
    std::net::TcpStream::connect_timeout(
        &std::net::SocketAddr::from(([127, 0, 0, 1], port)),
        Duration::from_secs(1),
    )
    .is_ok()
}

#[cfg(feature = "mysql")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_with_extra_options() {
    use fenced_testkit::{
        private::{MariaDbOptions, PrivateMariaDb},
        services::probe_mysql,
    };

    let db = PrivateMariaDb::start(MariaDbOptions {
        extra: vec!["--innodb-lock-wait-timeout=7".into()],
        ..MariaDbOptions::default()
    })
    .await
    .unwrap();
    probe_mysql(&db.url()).await.unwrap();
    let before = db.pid();
    db.restart().await.unwrap();
    assert_ne!(before, db.pid());
    db.set_read_only(true).await.unwrap();
    db.admin("SET GLOBAL innodb_lock_wait_timeout = 8")
        .await
        .unwrap();
    let port = db.port();
    drop(db);
    assert!(!listening(port));
}

#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_cluster_node_and_restart() {
    use fenced_testkit::private::{PrivateRedis, RedisOptions};

    let node = PrivateRedis::start(RedisOptions {
        cluster: true,
        ..RedisOptions::default()
    })
    .await
    .unwrap();
    let bus = node.cluster_bus().expect("a bus port");
    assert_ne!(bus, node.port());
    let mut admin = node.admin().await.unwrap();
    let info: String = redis::cmd("CLUSTER")
        .arg("INFO")
        .query_async(&mut admin)
        .await
        .unwrap();
    assert!(info.contains("cluster_state"), "{info}");
    node.restart().await.unwrap();
    node.admin().await.unwrap();
    let port = node.port();
    drop(node);
    assert!(!listening(port));
}

#[cfg(all(feature = "redis", feature = "tls"))]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_tls_only() {
    use fenced_testkit::private::{temp_dir, PrivateRedis, RedisOptions, TestCa};

    let dir = temp_dir("testkit-tls").unwrap();
    let files = TestCa::new("testkit CA")
        .unwrap()
        .issue_server(dir.path())
        .unwrap();
    let server = PrivateRedis::start(RedisOptions {
        tls: Some(files),
        ..RedisOptions::default()
    })
    .await
    .unwrap();
    assert!(server.url().starts_with("rediss://"), "{}", server.url());
    assert!(server.admin_url().ends_with("/#insecure"));
    server.admin().await.unwrap();
}

#[cfg(feature = "etcd")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_member_kill_and_restart() {
    use fenced_testkit::private::{EtcdOptions, PrivateEtcd};

    let etcd = PrivateEtcd::start(EtcdOptions::default()).await.unwrap();
    assert_eq!(etcd.members().len(), 1);
    etcd.kill(0);
    assert_eq!(etcd.member_pid(0), None);
    etcd.start_member(0).await.unwrap();
    etcd.restart().await.unwrap();
    etcd.admin_client(0).await.unwrap().status().await.unwrap();
    assert!(etcd.url("p").starts_with("etcd://127.0.0.1:"));
}
