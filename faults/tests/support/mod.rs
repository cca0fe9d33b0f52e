//! Helpers shared by the `bad_inputs` and `security` test binaries: the
//! shared servers, URL building, time bounds and a throw-away MariaDB user.

use std::time::Duration;

use fenced::mysql::sqlx::{self, AssertSqlSafe};
use fenced_conformance::services;

/// Generous upper bound for anything that must not hang (never a timing assertion).
pub(crate) const HANG: Duration = Duration::from_secs(30);

/// `n` random hex digits, for names no other run uses.
pub(crate) fn hex(n: usize) -> String {
    uuid::Uuid::new_v4().simple().to_string()[..n].to_owned()
}

/// `fut`, failing the test naming `what` if it takes longer than [`HANG`].
pub(crate) async fn bounded<T>(what: &str, fut: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(HANG, fut)
        .await
        .unwrap_or_else(|_| panic!("{what} did not finish within {HANG:?}"))
}

/// `url` with the query parameters `params` added.
pub(crate) fn with_params(url: &str, params: &str) -> String {
    let sep = if url.contains('?') { '&' } else { '?' };
    format!("{url}{sep}{params}")
}

/// The URL of the shared MariaDB; a server that is down fails the test
/// naming `scripts/services.sh`.
pub(crate) async fn mysql_server() -> String {
    let url = services::mysql_url();
    if let Err(message) = services::probe_mysql(&url).await {
        panic!("{message}");
    }
    url
}

/// The URL of the shared Redis, as [`mysql_server`].
pub(crate) async fn redis_server() -> String {
    let url = services::redis_url();
    if let Err(message) = services::probe_redis(&url).await {
        panic!("{message}");
    }
    url
}

/// `host:port` of the shared etcd, as [`mysql_server`].
pub(crate) async fn etcd_server() -> String {
    let url = services::etcd_url();
    if let Err(message) = services::probe_etcd(&url).await {
        panic!("{message}");
    }
    services::host_port(&url, 2379).unwrap_or_else(|e| panic!("{e}"))
}

/// Drops `<table>` and every `<table>_…` the schema has today (best effort).
pub(crate) async fn drop_mysql_namespace(server: &str, table: &str) {
    let Ok(pool) = sqlx::MySqlPool::connect(server).await else {
        return;
    };
    let names: Vec<String> = sqlx::query_scalar(
        "SELECT table_name FROM information_schema.tables \
         WHERE table_schema = DATABASE() AND (table_name = ? OR table_name LIKE ?)",
    )
    .bind(table)
    .bind(format!("{}\\_%", table.replace('_', "\\_")))
    .fetch_all(&pool)
    .await
    .unwrap_or_default();
    for t in names {
        let sql = format!("DROP TABLE IF EXISTS `{t}`");
        let _ = sqlx::query(AssertSqlSafe(sql)).execute(&pool).await;
    }
    pool.close().await;
}

/// A MariaDB user on the shared server for one test, dropped when this
/// guard goes — also when the test panics.
pub(crate) struct TempMysqlUser {
    server: String,
    pub(crate) name: String,
    /// The namespace of the lock tables this user's test creates, dropped
    /// with it (see [`drop_mysql_namespace`]).
    table: Option<String>,
}

impl TempMysqlUser {
    /// Creates the user `<prefix>_<random>` with `password` and `grant` on
    /// the `test` database; with `table`, the lock tables of that namespace
    /// are dropped with the user.
    pub(crate) async fn create(
        server: &str,
        prefix: &str,
        password: &str,
        grant: &str,
        table: Option<String>,
    ) -> Self {
        let name = format!("{prefix}_{}", hex(10));
        let pool = sqlx::MySqlPool::connect(server).await.expect("admin pool");
        for sql in [
            format!("CREATE USER '{name}'@'%' IDENTIFIED BY '{password}'"),
            format!("GRANT {grant} ON test.* TO '{name}'@'%'"),
        ] {
            sqlx::query(AssertSqlSafe(sql.clone()))
                .execute(&pool)
                .await
                .unwrap_or_else(|e| panic!("{sql}: {e}"));
        }
        pool.close().await;
        TempMysqlUser {
            server: server.to_owned(),
            name,
            table,
        }
    }
}

impl Drop for TempMysqlUser {
    fn drop(&mut self) {
        let (server, name, table) = (self.server.clone(), self.name.clone(), self.table.take());
        // Own thread and runtime: works from any context, panics included.
        let _ = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            rt.block_on(async {
                if let Ok(pool) = sqlx::MySqlPool::connect(&server).await {
                    let _ = sqlx::query(AssertSqlSafe(format!("DROP USER IF EXISTS '{name}'@'%'")))
                        .execute(&pool)
                        .await;
                    pool.close().await;
                }
                if let Some(table) = table {
                    drop_mysql_namespace(&server, &table).await;
                }
            });
            Ok::<(), std::io::Error>(())
        })
        .join();
    }
}
