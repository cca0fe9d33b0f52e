//! `fence::Fence` on the shared MariaDB: the shared fence cases
//! (`fenced_sql::testing`). Each test uses tables of its own (random names)
//! and drops them.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::sync::Arc;

use async_trait::async_trait;
use common::{drop_tables, server_url, url_for};
use fenced_api::DistributedLock;
use fenced_mysql::{
    fence::{Fence, MySqlBackend},
    sqlx::{self, AssertSqlSafe, MySql, MySqlConnection, MySqlPool, Row, Transaction},
    MySqlLock, Strategy,
};
use fenced_sql::testing::{exec, fresh_name, FenceWorld};

/// A fence table, a business table `(id INT, v VARCHAR)` and the names of
/// the other tables a case may create, all of this test's own.
struct World {
    pool: MySqlPool,
    fence: Fence,
    business: String,
    log: String,
    orders: String,
    locks: String,
}

#[async_trait]
impl FenceWorld for World {
    type Backend = MySqlBackend;
    const BAD_TABLE_NAMES: &'static [&'static str] = &["a b"];
    /// The check reads the newest token (a locking read), not the snapshot.
    const OLD_SNAPSHOT_FAILS: bool = false;

    async fn new(tag: &str) -> World {
        let pool = MySqlPool::connect(&server_url().await).await.unwrap();
        let fence = Fence::new(&fresh_name(tag)).unwrap();
        fence.create_table(&pool).await.unwrap();
        let business = fresh_name(&format!("{tag}_biz"));
        exec(
            &pool,
            &format!("CREATE TABLE `{business}` (id INT PRIMARY KEY, v VARCHAR(64) NOT NULL) ENGINE=InnoDB"),
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

    fn pool(&self) -> &MySqlPool {
        &self.pool
    }

    async fn second_pool(&self) -> MySqlPool {
        MySqlPool::connect(&server_url().await).await.unwrap()
    }

    async fn begin(pool: &MySqlPool) -> Transaction<'static, MySql> {
        pool.begin().await.unwrap()
    }

    fn business(&self) -> &str {
        &self.business
    }

    async fn upsert(&self, conn: &mut MySqlConnection, v: &str) {
        sqlx::query(AssertSqlSafe(format!(
            "INSERT INTO `{}` (id, v) VALUES (1, ?) ON DUPLICATE KEY UPDATE v = ?",
            self.business
        )))
        .bind(v)
        .bind(v)
        .execute(conn)
        .await
        .unwrap();
    }

    async fn value(&self) -> Option<String> {
        let sql = format!("SELECT v FROM `{}` WHERE id = 1", self.business);
        sqlx::query_scalar(AssertSqlSafe(sql))
            .fetch_optional(&self.pool)
            .await
            .unwrap()
    }

    async fn fence_rows(&self) -> i64 {
        let sql = format!("SELECT COUNT(*) FROM `{}`", self.fence.table());
        sqlx::query_scalar(AssertSqlSafe(sql))
            .fetch_one(&self.pool)
            .await
            .unwrap()
    }

    async fn tokens_seen(&self, conn: &mut MySqlConnection) -> Vec<u64> {
        let sql = format!("SELECT token FROM `{}`", self.fence.table());
        sqlx::query_scalar(AssertSqlSafe(sql))
            .fetch_all(conn)
            .await
            .unwrap()
    }

    async fn log_create(&self) {
        exec(
            &self.pool,
            &format!(
                "CREATE TABLE `{}` (seq BIGINT AUTO_INCREMENT PRIMARY KEY, \
                 token BIGINT UNSIGNED NOT NULL) ENGINE=InnoDB",
                self.log
            ),
        )
        .await;
    }

    async fn log_insert(&self, conn: &mut MySqlConnection, token: u64) {
        let sql = format!("INSERT INTO `{}` (token) VALUES (?)", self.log);
        sqlx::query(AssertSqlSafe(sql))
            .bind(token)
            .execute(conn)
            .await
            .unwrap();
    }

    async fn log_tokens(&self) -> Vec<u64> {
        let sql = format!("SELECT token FROM `{}` ORDER BY seq", self.log);
        sqlx::query_scalar(AssertSqlSafe(sql))
            .fetch_all(&self.pool)
            .await
            .unwrap()
    }

    async fn orders_create(&self) {
        let orders = &self.orders;
        exec(
            &self.pool,
            &format!(
                "CREATE TABLE `{orders}` (id INT PRIMARY KEY, state VARCHAR(20) NOT NULL, \
                 fence_token BIGINT UNSIGNED NOT NULL DEFAULT 0) ENGINE=InnoDB"
            ),
        )
        .await;
        exec(
            &self.pool,
            &format!("INSERT INTO `{orders}` (id, state) VALUES (1001, 'new')"),
        )
        .await;
    }

    /// The token bound to both placeholders; decided by the rows *matched*
    /// (sqlx connects with `CLIENT_FOUND_ROWS`).
    async fn orders_write(&self, state: &str, token: u64) -> u64 {
        let sql = format!(
            "UPDATE `{}` SET state = ?, fence_token = ? WHERE id = 1001 AND fence_token <= ?",
            self.orders
        );
        sqlx::query(AssertSqlSafe(sql))
            .bind(state)
            .bind(token)
            .bind(token)
            .execute(&self.pool)
            .await
            .unwrap()
            .rows_affected()
    }

    async fn orders_row(&self) -> (String, u64) {
        let sql = format!(
            "SELECT state, fence_token FROM `{}` WHERE id = 1001",
            self.orders
        );
        let row = sqlx::query(AssertSqlSafe(sql))
            .fetch_one(&self.pool)
            .await
            .unwrap();
        (row.get(0), row.get(1))
    }

    async fn lock_stores(&self) -> (Arc<dyn DistributedLock>, Arc<dyn DistributedLock>) {
        let url = url_for(&server_url().await, Strategy::UniqueKey, &self.locks);
        MySqlLock::migrate(&url).await.unwrap();
        (
            Arc::new(MySqlLock::connect(&url).await.unwrap()),
            Arc::new(MySqlLock::connect(&url).await.unwrap()),
        )
    }

    async fn cleanup(self) {
        exec(
            &self.pool,
            &format!(
                "DROP TABLE IF EXISTS `{}`, `{}`, `{}`, `{}`",
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
