//! Test support shared by the PostgreSQL test binaries: the conformance
//! harness over the shared server, private servers for restarts, and fresh
//! tables for the store-specific tests.

#![allow(dead_code, unreachable_pub, clippy::unwrap_used, clippy::expect_used)]

use std::{sync::Arc, time::Duration};

use async_trait::async_trait;
use fenced_api::{DistributedLock, LockKey, LockOptions, Result};
use fenced_conformance::Harness;
use fenced_postgres::{PostgresLock, Strategy};
use fenced_testkit::private::{PostgresOptions, PrivatePostgres};

/// The shared server's URL (`FENCED_TEST_POSTGRES_URL`) once it answers; a
/// test whose server is down fails with a message naming `scripts/services.sh`.
pub use fenced_testkit::shared::require_postgres as server_url;

/// A table name unique to this test process and strategy: the runs of
/// other processes (and the other strategy's cases) never meet it.
pub fn run_table(strategy: Strategy) -> String {
    format!("{}_{strategy}", fenced_testkit::run_name("fenced_t_"))
}

/// `server` with fenced's parameters.
pub fn url_for(server: &str, strategy: Strategy, table: &str) -> String {
    let sep = if server.contains('?') { '&' } else { '?' };
    format!("{server}{sep}strategy={strategy}&table={table}&max_connections=8&connect_timeout=5s")
}

/// Runs the suite against one strategy on one server.
pub struct PgHarness {
    server: String,
    strategy: Strategy,
    table: String,
    private: Option<Arc<PrivatePostgres>>,
}

impl PgHarness {
    /// On the shared server, in this run's table (created by the first
    /// connect).
    pub async fn new(strategy: Strategy) -> Self {
        PgHarness {
            server: server_url().await,
            strategy,
            table: run_table(strategy),
            private: None,
        }
    }

    fn url_of(&self, table: &str) -> String {
        url_for(&self.server, self.strategy, table)
    }

    pub fn url(&self) -> String {
        self.url_of(&self.table)
    }
}

#[async_trait]
impl Harness for PgHarness {
    async fn client(&self) -> Result<Arc<dyn DistributedLock>> {
        Ok(Arc::new(PostgresLock::connect(&self.url()).await?))
    }

    async fn client_in_namespace(&self, suffix: &str) -> Result<Arc<dyn DistributedLock>> {
        let clean = fenced_testkit::namespace_suffix(suffix).to_lowercase();
        let table = format!("{}_{clean}", self.table);
        Ok(Arc::new(PostgresLock::connect(&self.url_of(&table)).await?))
    }

    async fn unreachable_client(&self) -> Option<Result<Arc<dyn DistributedLock>>> {
        // Nothing listens on port 1.
        let url = format!(
            "postgres://postgres@127.0.0.1:1/fenced_test?strategy={}&connect_timeout=2s",
            self.strategy
        );
        Some(
            PostgresLock::connect(&url)
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
        let server = match PrivatePostgres::start(PostgresOptions::default()).await {
            Ok(s) => Arc::new(s),
            Err(e) => return Some(Err(e)),
        };
        Some(Ok(Box::new(PgHarness {
            server: server.url(),
            strategy: self.strategy,
            table: "fenced_private".into(),
            private: Some(server),
        })))
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

/// A fresh base table name for one test (`fenced_<tag>_<10 hex>`).
pub fn fresh_table(tag: &str) -> String {
    format!(
        "fenced_{tag}_{}",
        &uuid::Uuid::new_v4().simple().to_string()[..10]
    )
}

/// The URL of a fresh `lease` table on the shared server, and its name.
pub async fn fresh(tag: &str) -> (String, String) {
    let server = server_url().await;
    let table = fresh_table(tag);
    (url_for(&server, Strategy::Lease, &table), table)
}

/// A plain pool on the shared server, for looking at and arranging rows.
pub async fn admin() -> sqlx::PgPool {
    sqlx::postgres::PgPoolOptions::new()
        .max_connections(4)
        .connect(&server_url().await)
        .await
        .unwrap()
}

/// Runs one statement without results.
pub async fn exec(pool: &sqlx::PgPool, sql: &str) {
    sqlx::raw_sql(sqlx::AssertSqlSafe(sql.to_owned()))
        .execute(pool)
        .await
        .unwrap_or_else(|e| panic!("`{sql}`: {e}"));
}

/// Drops every table of `base` (and its sequence). Close the test's
/// `PostgresLock`s first, or not: nothing here waits for them.
pub async fn drop_tables(base: &str) {
    let pool = admin().await;
    exec(
        &pool,
        &format!(
            "DROP TABLE IF EXISTS \"{base}\", \"{base}_advisory\", \"{base}_migrations\", \
             \"{base}_permits\", \"{base}_permit_keys\"; \
             DROP SEQUENCE IF EXISTS \"{base}_token\""
        ),
    )
    .await;
    pool.close().await;
}

/// What follows `prefix` on the first line of the child's output that has it.
pub async fn next_line(
    lines: &mut tokio::io::Lines<tokio::io::BufReader<tokio::process::ChildStdout>>,
    prefix: &str,
) -> String {
    loop {
        let line = tokio::time::timeout(Duration::from_secs(60), lines.next_line())
            .await
            .expect("the child said nothing for a minute")
            .unwrap()
            .expect("the child ended early");
        // libtest may print the test's name on the same line first.
        if let Some(at) = line.find(prefix) {
            return line[at + prefix.len()..].trim().to_owned();
        }
    }
}

/// Now on the wall clock, in microseconds since the Unix epoch.
pub fn unix_micros() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_micros() as i64
}

/// Options with `ttl` that wait at most `wait`.
pub fn wait_opts(ttl: Duration, wait: Duration) -> LockOptions {
    LockOptions::builder()
        .ttl(ttl)
        .wait_timeout(wait)
        .build()
        .unwrap()
}
