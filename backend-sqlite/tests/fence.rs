//! `fence::Fence` on a temporary SQLite file: the shared fence cases
//! (`fenced_sql::testing`). Each test has a file of its own, in this test
//! process's temporary directory; another pool on that file stands for
//! another process.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::{path::PathBuf, sync::Arc, time::Duration};

use async_trait::async_trait;
use common::{fresh_file, url_for};
use fenced_api::DistributedLock;
use fenced_sql::testing::{exec, FenceWorld};
use fenced_sqlite::{
    fence::{Fence, SqliteBackend},
    sqlx::{
        self,
        sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions},
        Row, Sqlite, SqliteConnection, SqlitePool, Transaction,
    },
    SqliteLock,
};

async fn open(file: &PathBuf) -> SqlitePool {
    SqlitePoolOptions::new()
        .max_connections(8)
        .connect_with(
            SqliteConnectOptions::new()
                .filename(file)
                .create_if_missing(true)
                .journal_mode(SqliteJournalMode::Wal)
                .busy_timeout(Duration::from_secs(10)),
        )
        .await
        .unwrap()
}

/// A file with a fence table `app_fence` and a business table `(id, v)`.
struct World {
    file: PathBuf,
    pool: SqlitePool,
    fence: Fence,
}

#[async_trait]
impl FenceWorld for World {
    type Backend = SqliteBackend;
    const BAD_TABLE_NAMES: &'static [&'static str] = &["Fence", "sqlite_x"];
    /// A deferred transaction that read an older snapshot cannot write: SQLite
    /// refuses it (busy, retryable) instead of letting it check against it.
    const OLD_SNAPSHOT_FAILS: bool = true;

    async fn new(tag: &str) -> World {
        let file = fresh_file(tag);
        let pool = open(&file).await;
        let fence = Fence::new("app_fence").unwrap();
        fence.create_table(&pool).await.unwrap();
        exec(
            &pool,
            "CREATE TABLE business (id INTEGER PRIMARY KEY, v TEXT NOT NULL) STRICT",
        )
        .await;
        World { file, pool, fence }
    }

    fn fence(&self) -> &Fence {
        &self.fence
    }

    fn pool(&self) -> &SqlitePool {
        &self.pool
    }

    async fn second_pool(&self) -> SqlitePool {
        open(&self.file).await
    }

    /// `BEGIN IMMEDIATE`: the write lock from the start, as a fenced write needs.
    async fn begin(pool: &SqlitePool) -> Transaction<'static, Sqlite> {
        pool.begin_with("BEGIN IMMEDIATE").await.unwrap()
    }

    fn business(&self) -> &str {
        "business"
    }

    async fn upsert(&self, conn: &mut SqliteConnection, v: &str) {
        sqlx::query(
            "INSERT INTO business (id, v) VALUES (1, ?1) ON CONFLICT (id) DO UPDATE SET v = ?1",
        )
        .bind(v)
        .execute(conn)
        .await
        .unwrap();
    }

    async fn value(&self) -> Option<String> {
        sqlx::query_scalar("SELECT v FROM business WHERE id = 1")
            .fetch_optional(&self.pool)
            .await
            .unwrap()
    }

    async fn fence_rows(&self) -> i64 {
        sqlx::query_scalar("SELECT COUNT(*) FROM app_fence")
            .fetch_one(&self.pool)
            .await
            .unwrap()
    }

    async fn tokens_seen(&self, conn: &mut SqliteConnection) -> Vec<u64> {
        let tokens: Vec<i64> = sqlx::query_scalar("SELECT token FROM app_fence")
            .fetch_all(conn)
            .await
            .unwrap();
        tokens.into_iter().map(|t| t as u64).collect()
    }

    async fn log_create(&self) {
        exec(
            &self.pool,
            "CREATE TABLE log (seq INTEGER PRIMARY KEY AUTOINCREMENT, token INTEGER NOT NULL)",
        )
        .await;
    }

    async fn log_insert(&self, conn: &mut SqliteConnection, token: u64) {
        sqlx::query("INSERT INTO log (token) VALUES (?1)")
            .bind(token as i64)
            .execute(conn)
            .await
            .unwrap();
    }

    async fn log_tokens(&self) -> Vec<u64> {
        let tokens: Vec<i64> = sqlx::query_scalar("SELECT token FROM log ORDER BY seq")
            .fetch_all(&self.pool)
            .await
            .unwrap();
        tokens.into_iter().map(|t| t as u64).collect()
    }

    async fn orders_create(&self) {
        exec(
            &self.pool,
            "CREATE TABLE orders (id INTEGER PRIMARY KEY, state TEXT NOT NULL, \
             fence_token INTEGER NOT NULL DEFAULT 0) STRICT",
        )
        .await;
        exec(
            &self.pool,
            "INSERT INTO orders (id, state) VALUES (1001, 'new')",
        )
        .await;
    }

    async fn orders_write(&self, state: &str, token: u64) -> u64 {
        sqlx::query(
            "UPDATE orders SET state = ?1, fence_token = ?2 WHERE id = 1001 AND fence_token <= ?2",
        )
        .bind(state)
        .bind(i64::try_from(token).unwrap())
        .execute(&self.pool)
        .await
        .unwrap()
        .rows_affected()
    }

    async fn orders_row(&self) -> (String, u64) {
        let row = sqlx::query("SELECT state, fence_token FROM orders WHERE id = 1001")
            .fetch_one(&self.pool)
            .await
            .unwrap();
        (row.get(0), row.get::<i64, _>(1) as u64)
    }

    async fn lock_stores(&self) -> (Arc<dyn DistributedLock>, Arc<dyn DistributedLock>) {
        let url = url_for(&self.file, "locks", "");
        (
            Arc::new(SqliteLock::connect(&url).await.unwrap()),
            Arc::new(SqliteLock::connect(&url).await.unwrap()),
        )
    }

    async fn cleanup(self) {
        self.pool.close().await;
        let _ = std::fs::remove_file(&self.file);
        for suffix in ["-wal", "-shm"] {
            let mut f = self.file.clone().into_os_string();
            f.push(suffix);
            let _ = std::fs::remove_file(f);
        }
    }
}

fenced_sql::fence_tests!(World);
