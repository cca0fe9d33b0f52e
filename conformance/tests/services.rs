//! The shared test servers that `scripts/services.sh` starts must answer;
//! later backend suites depend on them. A down server fails here with a
//! message naming the script — never a silent skip.

use fenced_conformance::services::{
    etcd_url, mysql_url, probe_etcd, probe_mysql, probe_redis, redis_url,
};

fn must(result: Result<(), String>) {
    if let Err(message) = result {
        panic!("{message}");
    }
}

#[tokio::test]
async fn mariadb_answers() {
    must(probe_mysql(&mysql_url()).await);
}

#[tokio::test]
async fn redis_answers() {
    must(probe_redis(&redis_url()).await);
}

#[tokio::test]
async fn etcd_answers() {
    must(probe_etcd(&etcd_url()).await);
}

#[tokio::test]
async fn a_down_server_fails_with_a_message_naming_the_script() {
    // Port 1 on loopback: nothing listens there.
    for result in [
        probe_mysql("mysql://root@127.0.0.1:1/test").await,
        probe_redis("redis://127.0.0.1:1").await,
        probe_etcd("http://127.0.0.1:1").await,
    ] {
        let message = result.expect_err("nothing listens on port 1");
        assert!(message.contains("scripts/services.sh"), "{message}");
    }
}
