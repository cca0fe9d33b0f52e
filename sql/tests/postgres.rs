//! fenced-sql on a real PostgreSQL (the shared server `scripts/services.sh`
//! starts, or `FENCED_TEST_POSTGRES_URL`): the fence table's statements, the
//! migration runner in a transaction, what a check does at each isolation
//! level, and the shared fence cases (`fenced_sql::testing`) through a
//! backend of this file's own. Every test works in tables of its own
//! (`fresh_name`) and drops them.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::{sync::Arc, time::Duration};

use async_trait::async_trait;
use fenced_api::{DistributedLock, Error, FencingToken, MemoryLock};
use fenced_sql::{
    fence::{Fence, FenceOutcome},
    migrate::{self, Migration, NoHooks},
    testing::{exec, fresh_name, FenceWorld},
    SqlBackend, TableName,
};
use sqlx::{
    postgres::{PgListener, PgPoolOptions},
    Connection, PgConnection, PgPool, Postgres, Row, Transaction,
};

/// The shared server's test database (`fenced_conformance::services::postgres_url`'s default).
const DEFAULT_URL: &str = "postgres://postgres@127.0.0.1:5432/fenced_test";

/// A pool on the test server; fails the test, naming how to start the
/// server, when it does not answer.
async fn pool(max: u32) -> PgPool {
    let url = std::env::var("FENCED_TEST_POSTGRES_URL").unwrap_or_else(|_| DEFAULT_URL.to_owned());
    // One connection first: a pool's error would only say it timed out.
    let probe = tokio::time::timeout(Duration::from_secs(10), PgConnection::connect(&url))
        .await
        .unwrap_or_else(|_| Err(sqlx::Error::PoolTimedOut));
    match probe {
        Ok(conn) => drop(conn),
        Err(e) => panic!(
            "PostgreSQL at {url} does not answer ({e}); start the test services with \
             scripts/services.sh, or point FENCED_TEST_POSTGRES_URL at a server"
        ),
    }
    PgPoolOptions::new()
        .max_connections(max)
        .acquire_timeout(Duration::from_secs(10))
        .connect(&url)
        .await
        .unwrap()
}

/// PostgreSQL as the shared code sees it, for these tests: the errors a
/// writer retries (serialization failure, deadlock, lock not available)
/// retryable, the rest not.
#[derive(Debug)]
struct Pg;

fn sqlstate(e: &sqlx::Error) -> Option<String> {
    e.as_database_error()
        .and_then(|d| d.code())
        .map(|c| c.into_owned())
}

impl SqlBackend for Pg {
    type Db = Postgres;
    const BACKEND: &'static str = "postgres";
    fn map(e: sqlx::Error) -> Error {
        let retryable = matches!(sqlstate(&e).as_deref(), Some("40001" | "40P01" | "55P03"));
        Error::backend(Self::BACKEND, retryable, e)
    }
    fn is_missing_table(e: &sqlx::Error) -> bool {
        sqlstate(e).as_deref() == Some("42P01")
    }
    fn is_missing_column(e: &sqlx::Error) -> bool {
        sqlstate(e).as_deref() == Some("42703")
    }
}

fn tok(t: u64) -> FencingToken {
    FencingToken::new(t)
}

/// Whether a table of that (unquoted, lowercase) name exists.
async fn exists(pool: &PgPool, table: &str) -> bool {
    sqlx::query_scalar::<_, bool>("SELECT to_regclass(quote_ident($1)) IS NOT NULL")
        .bind(table)
        .fetch_one(pool)
        .await
        .unwrap()
}

#[tokio::test]
async fn a_fence_table_raises_tokens_refuses_lower_ones_and_reads_back() {
    let pool = pool(4).await;
    let name = fresh_name("basic");
    let fence = Fence::<Pg>::new(&name).unwrap();
    fence.create_table(&pool).await.unwrap();
    fence.create_table(&pool).await.unwrap();

    let mut tx = pool.begin().await.unwrap();
    for (token, expected) in [
        (5, FenceOutcome::Accepted),
        (7, FenceOutcome::Accepted),
        (6, FenceOutcome::Stale { highest: tok(7) }),
        (7, FenceOutcome::Accepted),
    ] {
        let outcome = fence.check(&mut tx, "job:1", tok(token)).await.unwrap();
        assert_eq!(outcome, expected, "token {token}");
    }
    tx.commit().await.unwrap();
    assert_eq!(fence.highest(&pool, "job:1").await.unwrap(), Some(tok(7)));
    assert_eq!(fence.highest(&pool, "job:2").await.unwrap(), None);

    // In autocommit too; the refused token lowers nothing and leaves
    // `updated_at` where the last stored token put it.
    let t = format!("\"{name}\"");
    let updated = format!("SELECT updated_at::text FROM {t} WHERE resource = 'job:1'");
    let before: String = sqlx::query_scalar(sqlx::AssertSqlSafe(updated.clone()))
        .fetch_one(&pool)
        .await
        .unwrap();
    let mut conn = pool.acquire().await.unwrap();
    let outcome = fence.check(&mut conn, "job:1", tok(3)).await.unwrap();
    assert_eq!(outcome, FenceOutcome::Stale { highest: tok(7) });
    drop(conn);
    let after: String = sqlx::query_scalar(sqlx::AssertSqlSafe(updated))
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(before, after);
    assert_eq!(fence.highest(&pool, "job:1").await.unwrap(), Some(tok(7)));

    // The largest token PostgreSQL keeps, and the one above it refused.
    let max = i64::MAX as u64;
    let mut conn = pool.acquire().await.unwrap();
    assert!(fence
        .check(&mut conn, "job:max", tok(max))
        .await
        .unwrap()
        .is_accepted());
    let e = fence
        .check(&mut conn, "job:max", tok(max + 1))
        .await
        .unwrap_err();
    assert!(matches!(e, Error::Unsupported { .. }), "{e}");
    drop(conn);

    // The columns as created: byte-ordered text, BIGINT, a timestamp.
    let columns: Vec<(String, String, Option<String>)> = sqlx::query_as(
        "SELECT column_name::text, data_type::text, collation_name::text \
         FROM information_schema.columns WHERE table_name = $1 ORDER BY ordinal_position",
    )
    .bind(&name)
    .fetch_all(&pool)
    .await
    .unwrap();
    let columns: Vec<_> = columns
        .iter()
        .map(|(n, t, c)| (n.as_str(), t.as_str(), c.as_deref()))
        .collect();
    assert_eq!(
        columns,
        [
            ("resource", "text", Some("C")),
            ("token", "bigint", None),
            ("updated_at", "timestamp with time zone", None),
        ]
    );

    exec(&pool, &format!("DROP TABLE {t}")).await;
    assert!(!exists(&pool, &name).await);
    // A missing table is an error naming the fix.
    let mut conn = pool.acquire().await.unwrap();
    let e = fence.check(&mut conn, "job:1", tok(8)).await.unwrap_err();
    assert!(
        matches!(&e, Error::Config { reason } if reason.contains("Fence::create_table")),
        "{e}"
    );
}

/// Sessions creating one new fence table at once all succeed (a bare
/// `CREATE TABLE IF NOT EXISTS` can fail in all but one of them when they
/// race: a unique violation on the catalog, or "type … already exists").
#[tokio::test]
async fn create_table_is_safe_beside_itself() {
    let pool = pool(8).await;
    for _ in 0..20 {
        let name = fresh_name("create");
        let fence = Fence::<Pg>::new(&name).unwrap();
        let tasks: Vec<_> = (0..8)
            .map(|_| {
                let (pool, fence) = (pool.clone(), fence.clone());
                tokio::spawn(async move { fence.create_table(&pool).await })
            })
            .collect();
        for task in tasks {
            task.await.unwrap().unwrap();
        }
        exec(&pool, &format!("DROP TABLE \"{name}\"")).await;
    }
}

const STEPS: &[Migration] = &[
    Migration {
        version: 1,
        name: "initial",
        sql: "-- the rows; and their index\n\
              CREATE TABLE \"{base}\" (id BIGINT PRIMARY KEY, v TEXT);\n\
              CREATE INDEX \"{base}_v\" ON \"{base}\" (v);",
        compatible: false,
    },
    Migration {
        version: 2,
        name: "notify",
        sql: "CREATE FUNCTION \"{base}_notify\"() RETURNS trigger LANGUAGE plpgsql AS $$\n\
              BEGIN\n\
                PERFORM pg_notify('{base}', NEW.id::text);\n\
                RETURN NEW;\n\
              END;\n\
              $$;\n\
              CREATE TRIGGER \"{base}_notify\" AFTER INSERT ON \"{base}\" \
              FOR EACH ROW EXECUTE FUNCTION \"{base}_notify\"()",
        compatible: true,
    },
];

async fn drop_migrated(pool: &PgPool, base: &str) {
    let tables = format!("DROP TABLE IF EXISTS \"{base}\", \"{base}_migrations\"");
    exec(pool, &tables).await;
    exec(
        pool,
        &format!("DROP FUNCTION IF EXISTS \"{base}_notify\"()"),
    )
    .await;
}

#[tokio::test]
async fn migrations_apply_in_a_transaction_all_or_nothing() {
    let pool = pool(4).await;
    let name = fresh_name("migrate");
    let base = TableName::<Postgres>::new(&name).unwrap();
    let log = format!("{name}_migrations");

    // Rolled back: no table, no log.
    let mut tx = pool.begin().await.unwrap();
    let applied = migrate::apply::<Pg>(&mut tx, &base, STEPS, &NoHooks).await;
    assert_eq!(applied.unwrap(), [1, 2]);
    tx.rollback().await.unwrap();
    assert!(!exists(&pool, &name).await);
    assert!(!exists(&pool, &log).await);

    // A step that fails leaves its transaction to roll back, steps before it included.
    let broken = [
        STEPS[0],
        Migration {
            version: 2,
            name: "broken",
            sql: "ALTER TABLE \"{base}\" ADD COLUMN v TEXT",
            compatible: true,
        },
    ];
    let mut tx = pool.begin().await.unwrap();
    let e = migrate::apply::<Pg>(&mut tx, &base, &broken, &NoHooks)
        .await
        .unwrap_err();
    assert!(matches!(e, Error::Backend { .. }), "{e}");
    tx.rollback().await.unwrap();
    assert!(!exists(&pool, &name).await);

    // Committed: applied once, recorded, and then nothing left to apply.
    let mut tx = pool.begin().await.unwrap();
    let applied = migrate::apply::<Pg>(&mut tx, &base, &STEPS[..1], &NoHooks).await;
    assert_eq!(applied.unwrap(), [1]);
    let applied = migrate::apply::<Pg>(&mut tx, &base, STEPS, &NoHooks).await;
    assert_eq!(applied.unwrap(), [2]);
    tx.commit().await.unwrap();
    let mut conn = pool.acquire().await.unwrap();
    let applied = migrate::apply::<Pg>(&mut conn, &base, STEPS, &NoHooks).await;
    assert!(applied.unwrap().is_empty());
    drop(conn);
    let logged: Vec<(i64, String)> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT version, name FROM \"{log}\" ORDER BY version"
    )))
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(
        logged,
        [(1, "initial".to_owned()), (2, "notify".to_owned())]
    );

    // The dollar-quoted body arrived whole: the trigger notifies.
    let mut listener = PgListener::connect_with(&pool).await.unwrap();
    listener.listen(&name).await.unwrap();
    exec(
        &pool,
        &format!("INSERT INTO \"{name}\" (id, v) VALUES (42, 'x')"),
    )
    .await;
    let note = tokio::time::timeout(Duration::from_secs(10), listener.recv())
        .await
        .unwrap()
        .unwrap();
    assert_eq!((note.channel(), note.payload()), (name.as_str(), "42"));
    drop(listener);

    drop_migrated(&pool, &name).await;
}

/// A fence table with `resource` at token 5, committed.
async fn fence_at_five(pool: &PgPool, tag: &str) -> Fence<Pg> {
    let fence = Fence::<Pg>::new(&fresh_name(tag)).unwrap();
    fence.create_table(pool).await.unwrap();
    let mut conn = pool.acquire().await.unwrap();
    let outcome = fence.check(&mut conn, "resource", tok(5)).await.unwrap();
    assert!(outcome.is_accepted());
    fence
}

async fn begin(pool: &PgPool, level: &str) -> Transaction<'static, Postgres> {
    match level {
        "READ COMMITTED" => pool.begin_with("BEGIN ISOLATION LEVEL READ COMMITTED"),
        "REPEATABLE READ" => pool.begin_with("BEGIN ISOLATION LEVEL REPEATABLE READ"),
        "SERIALIZABLE" => pool.begin_with("BEGIN ISOLATION LEVEL SERIALIZABLE"),
        other => unreachable!("{other}"),
    }
    .await
    .unwrap()
}

async fn tokens_seen(conn: &mut PgConnection, fence: &Fence<Pg>) -> Vec<i64> {
    let sql = format!("SELECT token FROM {}", fence.table().quoted(""));
    sqlx::query_scalar(sqlx::AssertSqlSafe(sql))
        .fetch_all(conn)
        .await
        .unwrap()
}

const LEVELS: [&str; 3] = ["READ COMMITTED", "REPEATABLE READ", "SERIALIZABLE"];

/// A transaction whose snapshot predates a newer token: `Stale` under READ
/// COMMITTED; a retryable serialization failure under REPEATABLE READ and
/// SERIALIZABLE. Never `Accepted`.
#[tokio::test]
async fn an_old_snapshot_is_stale_or_a_serialization_failure_by_isolation_level() {
    let pool = pool(4).await;
    for level in LEVELS {
        let fence = fence_at_five(&pool, "iso").await;
        let mut late = begin(&pool, level).await;
        assert_eq!(tokens_seen(&mut late, &fence).await, [5], "{level}");
        let mut conn = pool.acquire().await.unwrap();
        let outcome = fence.check(&mut conn, "resource", tok(10)).await.unwrap();
        assert!(outcome.is_accepted());
        drop(conn);
        let checked = fence.check(&mut late, "resource", tok(7)).await;
        match (level, checked) {
            ("READ COMMITTED", Ok(outcome)) => {
                assert_eq!(outcome, FenceOutcome::Stale { highest: tok(10) })
            }
            (_, Err(e @ Error::Backend { .. })) if level != "READ COMMITTED" => {
                assert!(e.is_retryable(), "{level}: {e}");
                assert!(
                    e.to_string().contains("could not serialize"),
                    "{level}: {e}"
                );
            }
            (_, other) => panic!("{level}: {other:?}"),
        }
        late.rollback().await.unwrap();

        // A snapshot that is current checks as under READ COMMITTED.
        let mut tx = begin(&pool, level).await;
        assert_eq!(tokens_seen(&mut tx, &fence).await, [10], "{level}");
        let outcome = fence.check(&mut tx, "resource", tok(9)).await.unwrap();
        assert_eq!(outcome, FenceOutcome::Stale { highest: tok(10) }, "{level}");
        let outcome = fence.check(&mut tx, "resource", tok(11)).await.unwrap();
        assert!(outcome.is_accepted(), "{level}");
        tx.commit().await.unwrap();
        assert_eq!(
            fence.highest(&pool, "resource").await.unwrap(),
            Some(tok(11))
        );
        exec(&pool, &format!("DROP TABLE {}", fence.table().quoted(""))).await;
    }
}

/// Two checks of one resource at once: the second waits for the first
/// transaction. Under READ COMMITTED it is then decided against the
/// committed token; under REPEATABLE READ and SERIALIZABLE the row changed
/// after its snapshot, so it fails (retryable) and a retry decides.
#[tokio::test]
async fn a_second_check_waits_and_then_is_decided_or_retried_by_isolation_level() {
    let pool = pool(4).await;
    for level in LEVELS {
        let fence = fence_at_five(&pool, "wait").await;
        let mut first = begin(&pool, level).await;
        let outcome = fence.check(&mut first, "resource", tok(20)).await.unwrap();
        assert!(outcome.is_accepted());
        let second = {
            let (pool, fence) = (pool.clone(), fence.clone());
            tokio::spawn(async move {
                let mut tx = begin(&pool, level).await;
                let checked = fence.check(&mut tx, "resource", tok(21)).await;
                tx.rollback().await.unwrap();
                checked
            })
        };
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(!second.is_finished(), "{level}: the second check must wait");
        first.commit().await.unwrap();
        let checked = tokio::time::timeout(Duration::from_secs(10), second)
            .await
            .unwrap()
            .unwrap();
        match (level, checked) {
            ("READ COMMITTED", Ok(outcome)) => assert!(outcome.is_accepted()),
            (_, Err(e)) if level != "READ COMMITTED" => {
                assert!(e.is_retryable(), "{level}: {e}")
            }
            (_, other) => panic!("{level}: {other:?}"),
        }
        // The retry, with a fresh snapshot.
        let mut tx = begin(&pool, level).await;
        let outcome = fence.check(&mut tx, "resource", tok(19)).await.unwrap();
        assert_eq!(outcome, FenceOutcome::Stale { highest: tok(20) }, "{level}");
        tx.rollback().await.unwrap();
        exec(&pool, &format!("DROP TABLE {}", fence.table().quoted(""))).await;
    }
}

/// One test's tables: a fence, a business table, and (when a case asks)
/// a log and an orders table, all named after the fence.
struct World {
    pool: PgPool,
    fence: Fence<Pg>,
    name: String,
    business: String,
}

impl World {
    fn table(&self, suffix: &str) -> String {
        format!("\"{}{suffix}\"", self.name)
    }
}

#[async_trait]
impl FenceWorld for World {
    type Backend = Pg;
    const BAD_TABLE_NAMES: &'static [&'static str] = &["Fence", "pg_fence", "a$b"];
    /// `pool.begin()` is READ COMMITTED (the server's default): an old
    /// snapshot gets `Stale`.
    const OLD_SNAPSHOT_FAILS: bool = false;

    async fn new(tag: &str) -> World {
        let pool = pool(5).await;
        let name = fresh_name(tag);
        let fence = Fence::new(&name).unwrap();
        fence.create_table(&pool).await.unwrap();
        let business = format!("{name}_biz");
        exec(
            &pool,
            &format!("CREATE TABLE \"{business}\" (id BIGINT PRIMARY KEY, v TEXT NOT NULL)"),
        )
        .await;
        World {
            pool,
            fence,
            name,
            business,
        }
    }

    fn fence(&self) -> &Fence<Pg> {
        &self.fence
    }

    fn pool(&self) -> &PgPool {
        &self.pool
    }

    async fn second_pool(&self) -> PgPool {
        pool(5).await
    }

    async fn begin(pool: &PgPool) -> Transaction<'static, Postgres> {
        pool.begin().await.unwrap()
    }

    fn business(&self) -> &str {
        &self.business
    }

    async fn upsert(&self, conn: &mut PgConnection, v: &str) {
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "INSERT INTO {} (id, v) VALUES (1, $1) ON CONFLICT (id) DO UPDATE SET v = excluded.v",
            self.table("_biz")
        )))
        .bind(v)
        .execute(conn)
        .await
        .unwrap();
    }

    async fn value(&self) -> Option<String> {
        let sql = format!("SELECT v FROM {} WHERE id = 1", self.table("_biz"));
        sqlx::query_scalar(sqlx::AssertSqlSafe(sql))
            .fetch_optional(&self.pool)
            .await
            .unwrap()
    }

    async fn fence_rows(&self) -> i64 {
        let sql = format!("SELECT COUNT(*) FROM {}", self.table(""));
        sqlx::query_scalar(sqlx::AssertSqlSafe(sql))
            .fetch_one(&self.pool)
            .await
            .unwrap()
    }

    async fn tokens_seen(&self, conn: &mut PgConnection) -> Vec<u64> {
        tokens_seen(conn, &self.fence)
            .await
            .into_iter()
            .map(|t| u64::try_from(t).unwrap())
            .collect()
    }

    async fn log_create(&self) {
        let sql = format!(
            "CREATE TABLE {} (seq BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY, \
             token BIGINT NOT NULL)",
            self.table("_log")
        );
        exec(&self.pool, &sql).await;
    }

    async fn log_insert(&self, conn: &mut PgConnection, token: u64) {
        let sql = format!("INSERT INTO {} (token) VALUES ($1)", self.table("_log"));
        sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(i64::try_from(token).unwrap())
            .execute(conn)
            .await
            .unwrap();
    }

    async fn log_tokens(&self) -> Vec<u64> {
        let sql = format!("SELECT token FROM {} ORDER BY seq", self.table("_log"));
        let tokens: Vec<i64> = sqlx::query_scalar(sqlx::AssertSqlSafe(sql))
            .fetch_all(&self.pool)
            .await
            .unwrap();
        tokens
            .into_iter()
            .map(|t| u64::try_from(t).unwrap())
            .collect()
    }

    async fn orders_create(&self) {
        let orders = self.table("_orders");
        exec(
            &self.pool,
            &format!(
                "CREATE TABLE {orders} (id BIGINT PRIMARY KEY, state TEXT NOT NULL, \
                 fence_token BIGINT NOT NULL DEFAULT 0)"
            ),
        )
        .await;
        exec(
            &self.pool,
            &format!("INSERT INTO {orders} (id, state) VALUES (1001, 'new')"),
        )
        .await;
    }

    async fn orders_write(&self, state: &str, token: u64) -> u64 {
        let sql = format!(
            "UPDATE {} SET state = $1, fence_token = $2 WHERE id = 1001 AND fence_token <= $2",
            self.table("_orders")
        );
        sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(state)
            .bind(i64::try_from(token).unwrap())
            .execute(&self.pool)
            .await
            .unwrap()
            .rows_affected()
    }

    async fn orders_row(&self) -> (String, u64) {
        let sql = format!(
            "SELECT state, fence_token FROM {} WHERE id = 1001",
            self.table("_orders")
        );
        let row = sqlx::query(sqlx::AssertSqlSafe(sql))
            .fetch_one(&self.pool)
            .await
            .unwrap();
        (row.get(0), u64::try_from(row.get::<i64, _>(1)).unwrap())
    }

    /// Two clients of one in-memory store: the cases need real grants, not
    /// a PostgreSQL lock (that is the backend crate's to test).
    async fn lock_stores(&self) -> (Arc<dyn DistributedLock>, Arc<dyn DistributedLock>) {
        let store = Arc::new(MemoryLock::new());
        (store.clone(), store)
    }

    async fn cleanup(self) {
        let tables = ["", "_biz", "_log", "_orders"].map(|s| self.table(s));
        exec(
            &self.pool,
            &format!("DROP TABLE IF EXISTS {}", tables.join(", ")),
        )
        .await;
        self.pool.close().await;
    }
}

fenced_sql::fence_tests!(World);
