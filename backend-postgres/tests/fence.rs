//! `fence::Fence` on the shared PostgreSQL: the shared fence cases
//! (`fenced_sql::testing`) with this crate's error mapping. Each test uses
//! tables of its own (random names) and drops them.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::sync::Arc;

use async_trait::async_trait;
use common::{drop_tables, server_url, url_for};
use fenced_api::DistributedLock;
use fenced_postgres::{
    fence::{Fence, PostgresBackend},
    sqlx::{self, AssertSqlSafe, PgConnection, PgPool, Postgres, Row, Transaction},
    PostgresLock, Strategy,
};
use fenced_sql::testing::{exec, fresh_name, FenceWorld};

/// A fence table, a business table `(id INT, v TEXT)` and the names of the
/// other tables a case may create, all of this test's own.
struct World {
    pool: PgPool,
    fence: Fence,
    business: String,
    log: String,
    orders: String,
    locks: String,
}

#[async_trait]
impl FenceWorld for World {
    type Backend = PostgresBackend;
    /// Beyond what every store refuses: PostgreSQL folds unquoted names to
    /// lowercase, and `pg_` is the catalogs' prefix.
    const BAD_TABLE_NAMES: &'static [&'static str] = &["a b", "Fences", "pg_fences"];
    /// `pool.begin()` is READ COMMITTED: the upsert works on the newest row.
    const OLD_SNAPSHOT_FAILS: bool = false;

    async fn new(tag: &str) -> World {
        let pool = PgPool::connect(&server_url().await).await.unwrap();
        let fence = Fence::new(&fresh_name(tag)).unwrap();
        fence.create_table(&pool).await.unwrap();
        let business = fresh_name(&format!("{tag}_biz"));
        exec(
            &pool,
            &format!("CREATE TABLE \"{business}\" (id INT PRIMARY KEY, v TEXT NOT NULL)"),
        )
        .await;
        World {
            pool,
            fence,
            business,
            log: fresh_name(&format!("{tag}_log")),
            orders: fresh_name(&format!("{tag}_orders")),
            locks: fresh_name(&format!("{tag}_lock")),
        }
    }

    fn fence(&self) -> &Fence {
        &self.fence
    }

    fn pool(&self) -> &PgPool {
        &self.pool
    }

    async fn second_pool(&self) -> PgPool {
        PgPool::connect(&server_url().await).await.unwrap()
    }

    async fn begin(pool: &PgPool) -> Transaction<'static, Postgres> {
        pool.begin().await.unwrap()
    }

    fn business(&self) -> &str {
        &self.business
    }

    async fn upsert(&self, conn: &mut PgConnection, v: &str) {
        sqlx::query(AssertSqlSafe(format!(
            "INSERT INTO \"{}\" (id, v) VALUES (1, $1) ON CONFLICT (id) DO UPDATE SET v = $1",
            self.business
        )))
        .bind(v)
        .execute(conn)
        .await
        .unwrap();
    }

    async fn value(&self) -> Option<String> {
        let sql = format!("SELECT v FROM \"{}\" WHERE id = 1", self.business);
        sqlx::query_scalar(AssertSqlSafe(sql))
            .fetch_optional(&self.pool)
            .await
            .unwrap()
    }

    async fn fence_rows(&self) -> i64 {
        let sql = format!("SELECT COUNT(*) FROM \"{}\"", self.fence.table());
        sqlx::query_scalar(AssertSqlSafe(sql))
            .fetch_one(&self.pool)
            .await
            .unwrap()
    }

    async fn tokens_seen(&self, conn: &mut PgConnection) -> Vec<u64> {
        let sql = format!("SELECT token FROM \"{}\"", self.fence.table());
        let tokens: Vec<i64> = sqlx::query_scalar(AssertSqlSafe(sql))
            .fetch_all(conn)
            .await
            .unwrap();
        tokens.into_iter().map(|t| t as u64).collect()
    }

    async fn log_create(&self) {
        exec(
            &self.pool,
            &format!(
                "CREATE TABLE \"{}\" (seq BIGSERIAL PRIMARY KEY, token BIGINT NOT NULL)",
                self.log
            ),
        )
        .await;
    }

    async fn log_insert(&self, conn: &mut PgConnection, token: u64) {
        let sql = format!("INSERT INTO \"{}\" (token) VALUES ($1)", self.log);
        sqlx::query(AssertSqlSafe(sql))
            .bind(token as i64)
            .execute(conn)
            .await
            .unwrap();
    }

    async fn log_tokens(&self) -> Vec<u64> {
        let sql = format!("SELECT token FROM \"{}\" ORDER BY seq", self.log);
        let tokens: Vec<i64> = sqlx::query_scalar(AssertSqlSafe(sql))
            .fetch_all(&self.pool)
            .await
            .unwrap();
        tokens.into_iter().map(|t| t as u64).collect()
    }

    async fn orders_create(&self) {
        let orders = &self.orders;
        exec(
            &self.pool,
            &format!(
                "CREATE TABLE \"{orders}\" (id INT PRIMARY KEY, state TEXT NOT NULL, \
                 fence_token BIGINT NOT NULL DEFAULT 0)"
            ),
        )
        .await;
        exec(
            &self.pool,
            &format!("INSERT INTO \"{orders}\" (id, state) VALUES (1001, 'new')"),
        )
        .await;
    }

    /// Decided by the rows matched (PostgreSQL counts a matched row as
    /// updated even when no value changed).
    async fn orders_write(&self, state: &str, token: u64) -> u64 {
        let sql = format!(
            "UPDATE \"{}\" SET state = $1, fence_token = $2 WHERE id = 1001 AND fence_token <= $2",
            self.orders
        );
        sqlx::query(AssertSqlSafe(sql))
            .bind(state)
            .bind(token as i64)
            .execute(&self.pool)
            .await
            .unwrap()
            .rows_affected()
    }

    async fn orders_row(&self) -> (String, u64) {
        let sql = format!(
            "SELECT state, fence_token FROM \"{}\" WHERE id = 1001",
            self.orders
        );
        let row = sqlx::query(AssertSqlSafe(sql))
            .fetch_one(&self.pool)
            .await
            .unwrap();
        (row.get(0), row.get::<i64, _>(1) as u64)
    }

    async fn lock_stores(&self) -> (Arc<dyn DistributedLock>, Arc<dyn DistributedLock>) {
        let url = url_for(&server_url().await, Strategy::Lease, &self.locks);
        (
            Arc::new(PostgresLock::connect(&url).await.unwrap()),
            Arc::new(PostgresLock::connect(&url).await.unwrap()),
        )
    }

    async fn cleanup(self) {
        exec(
            &self.pool,
            &format!(
                "DROP TABLE IF EXISTS \"{}\", \"{}\", \"{}\", \"{}\"",
                self.fence.table(),
                self.business,
                self.log,
                self.orders
            ),
        )
        .await;
        drop_tables(&self.locks).await;
    }
}

fenced_sql::fence_tests!(World);
