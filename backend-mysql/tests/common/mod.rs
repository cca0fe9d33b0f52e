//! Test support shared by the MySQL test binaries: the conformance harness
//! over the shared MariaDB, and private MariaDB instances for destructive tests.

#![allow(dead_code, unreachable_pub, clippy::unwrap_used, clippy::expect_used)]

pub mod private;

use std::{sync::Arc, time::Duration};

use async_trait::async_trait;
use fenced_api::{DistributedLock, LockKey, LockOptions, Result};
use fenced_conformance::Harness;
use fenced_mysql::{MySqlLock, Strategy};

/// The shared server's URL (`FENCED_TEST_MYSQL_URL`) once it answers; a test whose
/// server is down fails with a message naming `scripts/services.sh`.
pub use fenced_testkit::shared::require_mysql as server_url;

/// A table name unique to this test process ("a fresh uuid namespace per run").
pub fn run_table() -> &'static str {
    fenced_testkit::run_name("fenced_t_")
}

pub fn url_for(server: &str, strategy: Strategy, table: &str) -> String {
    let sep = if server.contains('?') { '&' } else { '?' };
    format!("{server}{sep}strategy={strategy}&table={table}&max_connections=32&connect_timeout=5s")
}

/// Runs the suite against one strategy on one server.
pub struct MySqlHarness {
    server: String,
    strategy: Strategy,
    table: String,
    /// Extra URL parameters (`&k=v…`).
    extra: &'static str,
    private: Option<Arc<private::PrivateMariaDb>>,
}

impl MySqlHarness {
    /// On the shared server, in this run's table.
    pub async fn new(strategy: Strategy) -> Self {
        Self::with(strategy, "").await
    }

    /// With extra URL parameters (`"&row_lock_one_statement=false"`).
    pub async fn with(strategy: Strategy, extra: &'static str) -> Self {
        let server = server_url().await;
        let h = MySqlHarness {
            server,
            strategy,
            table: run_table().to_owned(),
            extra,
            private: None,
        };
        h.migrate(&h.table).await;
        h
    }

    fn url_of(&self, server: &str, table: &str) -> String {
        format!("{}{}", url_for(server, self.strategy, table), self.extra)
    }

    pub fn url(&self) -> String {
        self.url_of(&self.server, &self.table)
    }

    async fn migrate(&self, table: &str) {
        MySqlLock::migrate(&url_for(&self.server, self.strategy, table))
            .await
            .unwrap_or_else(|e| panic!("migrating `{table}` failed: {e}"));
    }

    pub async fn lock(&self) -> MySqlLock {
        MySqlLock::connect(&self.url()).await.unwrap()
    }
}

#[async_trait]
impl Harness for MySqlHarness {
    async fn client(&self) -> Result<Arc<dyn DistributedLock>> {
        Ok(Arc::new(MySqlLock::connect(&self.url()).await?))
    }

    async fn client_in_namespace(&self, suffix: &str) -> Result<Arc<dyn DistributedLock>> {
        let clean = fenced_testkit::namespace_suffix(suffix);
        let table = format!("{}_{clean}", self.table);
        self.migrate(&table).await;
        Ok(Arc::new(
            MySqlLock::connect(&self.url_of(&self.server, &table)).await?,
        ))
    }

    async fn unreachable_client(&self) -> Option<Result<Arc<dyn DistributedLock>>> {
        // Nothing listens on port 1.
        let url = format!(
            "mysql://root@127.0.0.1:1/test?strategy={}&connect_timeout=2s",
            self.strategy
        );
        Some(
            MySqlLock::connect(&url)
                .await
                .map(|l| Arc::new(l) as Arc<dyn DistributedLock>),
        )
    }

    fn connect_timeout(&self) -> Duration {
        Duration::from_secs(2)
    }

    async fn restart_store(&self) -> Option<Result<()>> {
        let server = self.private.as_ref()?;
        Some(server.restart().await)
    }

    async fn private_store(&self) -> Option<Result<Box<dyn Harness>>> {
        let server = match private::PrivateMariaDb::start().await {
            Ok(s) => Arc::new(s),
            Err(e) => return Some(Err(e)),
        };
        let h = MySqlHarness {
            server: server.url(),
            strategy: self.strategy,
            table: "fenced_private".into(),
            extra: self.extra,
            private: Some(server),
        };
        h.migrate(&h.table).await;
        Some(Ok(Box::new(h)))
    }

    fn base_ttl(&self) -> Duration {
        Duration::from_secs(1)
    }
}

/// A key unique to this run.
pub fn key(tag: &str) -> LockKey {
    LockKey::new(format!("{tag}/{}", uuid::Uuid::new_v4().simple())).unwrap()
}

/// Options with this TTL and nothing else.
pub fn ttl(d: Duration) -> LockOptions {
    LockOptions::builder().ttl(d).build().unwrap()
}

/// A row_lock store in tables of its own: its URL (with `extra` query
/// parameters appended) and its base table name.
pub async fn fresh(tag: &str, extra: &str) -> (String, String) {
    let server = server_url().await;
    let base = format!(
        "fenced_rl_{tag}_{}",
        &uuid::Uuid::new_v4().simple().to_string()[..10]
    );
    let url = format!("{}{extra}", url_for(&server, Strategy::RowLock, &base));
    MySqlLock::migrate(&url).await.unwrap();
    (url, base)
}

/// Two `MySqlLock` instances on one fresh row_lock store (see [`fresh`]),
/// and the store's base table name.
pub async fn fresh_pair(tag: &str, extra: &str) -> (MySqlLock, MySqlLock, String) {
    let (url, base) = fresh(tag, extra).await;
    (
        MySqlLock::connect(&url).await.unwrap(),
        MySqlLock::connect(&url).await.unwrap(),
        base,
    )
}

/// Drops the test's tables. Close the test's `MySqlLock`s first: a hold's
/// transaction has metadata locks on the tables that `DROP TABLE` waits for.
pub async fn drop_tables(base: &str) {
    let pool = sqlx::MySqlPool::connect(&server_url().await).await.unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "DROP TABLE IF EXISTS `{base}`, `{base}_optimistic`, `{base}_rows`, `{base}_fence`, \
         `{base}_live`, `{base}_migrations`"
    )))
    .execute(&pool)
    .await
    .unwrap();
}
