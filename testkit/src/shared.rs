//! The shared test services, checked before use.
//!
//! Server-backed tests never skip when their server is down: they fail with
//! the probe's message, which names `scripts/services.sh`. The plain
//! functions return that message as their error; the `require_` ones are
//! for tests and fail (panic) with it.

use crate::services;

/// The shared MariaDB/MySQL URL (`FENCED_TEST_MYSQL_URL`) once it answers.
///
/// # Errors
///
/// The probe's message (naming `scripts/services.sh`) when it does not.
pub async fn mysql() -> Result<String, String> {
    let url = services::mysql_url();
    services::probe_mysql(&url).await.map(|()| url)
}

/// The shared Redis URL (`FENCED_TEST_REDIS_URL`) once it answers `PING`.
///
/// # Errors
///
/// The probe's message (naming `scripts/services.sh`) when it does not.
pub async fn redis() -> Result<String, String> {
    let url = services::redis_url();
    services::probe_redis(&url).await.map(|()| url)
}

/// The shared Redis Cluster's URL (`FENCED_TEST_REDIS_CLUSTER_URL`,
/// `redis+cluster://…`) once its first seed sees the cluster as ok.
///
/// # Errors
///
/// The probe's message (naming `scripts/services.sh`) when it does not.
pub async fn redis_cluster() -> Result<String, String> {
    let url = services::redis_cluster_url();
    services::probe_redis_cluster(&url).await.map(|()| url)
}

/// [`redis_cluster()`], for a test.
///
/// # Panics
///
/// With the probe's message when the cluster does not answer.
pub async fn require_redis_cluster() -> String {
    required(redis_cluster().await)
}

/// `host:port` of the shared etcd (`FENCED_TEST_ETCD_URL`, an `http://`
/// URL) once it reports itself healthy.
///
/// # Errors
///
/// The probe's message (naming `scripts/services.sh`) when it does not, or
/// when the URL names no host.
pub async fn etcd_hostport() -> Result<String, String> {
    let url = services::etcd_url();
    services::probe_etcd(&url).await?;
    services::host_port(&url, 2379)
}

/// The shared ZooKeeper URL (`FENCED_TEST_ZOOKEEPER_URL`, `zk://…`) once it
/// serves requests.
///
/// # Errors
///
/// The probe's message (naming `scripts/services.sh`) when it does not.
pub async fn zookeeper() -> Result<String, String> {
    let url = services::zookeeper_url();
    services::probe_zookeeper(&url).await.map(|()| url)
}

/// The shared PostgreSQL URL (`FENCED_TEST_POSTGRES_URL`,
/// `postgres://…/fenced_test`) once role and database let a client in and
/// `SELECT 1` answers.
///
/// # Errors
///
/// The probe's message (naming `scripts/services.sh`) when they do not.
#[cfg(feature = "postgres")]
pub async fn postgres() -> Result<String, String> {
    let url = services::postgres_url();
    services::probe_postgres(&url).await.map(|()| url)
}

/// [`postgres()`], for a test.
///
/// # Panics
///
/// With the probe's message when the server does not answer.
#[cfg(feature = "postgres")]
pub async fn require_postgres() -> String {
    required(postgres().await)
}

/// [`zookeeper()`], for a test.
///
/// # Panics
///
/// With the probe's message when the server does not answer.
pub async fn require_zookeeper() -> String {
    required(zookeeper().await)
}

/// [`mysql`], for a test.
///
/// # Panics
///
/// With the probe's message when the server does not answer.
pub async fn require_mysql() -> String {
    required(mysql().await)
}

/// [`redis()`], for a test.
///
/// # Panics
///
/// With the probe's message when the server does not answer.
pub async fn require_redis() -> String {
    required(redis().await)
}

/// [`etcd_hostport`], for a test.
///
/// # Panics
///
/// With the probe's message when the server does not answer.
pub async fn require_etcd_hostport() -> String {
    required(etcd_hostport().await)
}

fn required(checked: Result<String, String>) -> String {
    checked.unwrap_or_else(|message| panic!("{message}"))
}
