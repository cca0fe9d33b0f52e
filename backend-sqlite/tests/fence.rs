//! `fence::Fence` on a temporary SQLite file: the check and the business
//! write commit together or not at all, stale tokens are refused with the
//! highest token, writers of one resource are serialised, and the column
//! form (`… AND fence_token <= ?`) behaves the same. Each test has a file of
//! its own, in this test process's temporary directory.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::{path::PathBuf, sync::Arc, time::Duration};

use common::{fresh_file, url_for};
use fenced_api::{DistributedLock, Error, FencingToken, LockKey, LockOptions};
use fenced_sqlite::{
    fence::{Fence, FenceOutcome},
    sqlx::{
        self,
        sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions},
        AssertSqlSafe, Row, SqlitePool,
    },
    SqliteLock,
};

fn tok(t: u64) -> FencingToken {
    FencingToken::new(t)
}

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

/// A file with a fence table and a business table `(id, v)`.
struct World {
    file: PathBuf,
    pool: SqlitePool,
    fence: Fence,
}

impl World {
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

    /// One transaction: the check first, then (if accepted) the write; commits
    /// on `Accepted`, rolls back on `Stale`.
    async fn fenced_write(&self, resource: &str, token: u64, v: &str) -> FenceOutcome {
        let mut tx = self.pool.begin_with("BEGIN IMMEDIATE").await.unwrap();
        let outcome = self
            .fence
            .check(&mut tx, resource, tok(token))
            .await
            .unwrap();
        if outcome.is_accepted() {
            upsert(&mut tx, v).await;
            tx.commit().await.unwrap();
        } else {
            tx.rollback().await.unwrap();
        }
        outcome
    }

    async fn value(&self) -> Option<String> {
        sqlx::query("SELECT v FROM business WHERE id = 1")
            .fetch_optional(&self.pool)
            .await
            .unwrap()
            .map(|r| r.get(0))
    }

    async fn highest(&self, resource: &str) -> Option<u64> {
        self.fence
            .highest(&self.pool, resource)
            .await
            .unwrap()
            .map(FencingToken::get)
    }

    async fn fence_rows(&self) -> i64 {
        sqlx::query("SELECT COUNT(*) FROM app_fence")
            .fetch_one(&self.pool)
            .await
            .unwrap()
            .get(0)
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

async fn upsert(tx: &mut sqlx::SqliteConnection, v: &str) {
    sqlx::query(
        "INSERT INTO business (id, v) VALUES (1, ?1) ON CONFLICT (id) DO UPDATE SET v = ?1",
    )
    .bind(v)
    .execute(&mut *tx)
    .await
    .unwrap();
}

async fn exec(pool: &SqlitePool, sql: &str) {
    sqlx::query(AssertSqlSafe(sql.to_owned()))
        .execute(pool)
        .await
        .unwrap();
}

#[tokio::test]
async fn a_current_token_is_accepted_and_its_write_lands() {
    let w = World::new("current").await;
    assert_eq!(
        w.fenced_write("order:1", 5, "five").await,
        FenceOutcome::Accepted
    );
    assert_eq!(w.value().await.as_deref(), Some("five"));
    assert_eq!(w.highest("order:1").await, Some(5));
    assert_eq!(
        w.fenced_write("order:1", 6, "six").await,
        FenceOutcome::Accepted
    );
    assert_eq!(w.value().await.as_deref(), Some("six"));
    assert_eq!(w.highest("order:1").await, Some(6));
    w.cleanup().await;
}

#[tokio::test]
async fn a_stale_token_is_refused_and_the_write_in_its_transaction_rolled_back() {
    let w = World::new("stale").await;
    assert!(w
        .fenced_write("order:1", 7, "new holder")
        .await
        .is_accepted());
    // The late writer writes first and checks after, in one transaction.
    let mut tx = w.pool.begin_with("BEGIN IMMEDIATE").await.unwrap();
    upsert(&mut tx, "paused ex-holder").await;
    let outcome = w.fence.check(&mut tx, "order:1", tok(5)).await.unwrap();
    assert_eq!(outcome, FenceOutcome::Stale { highest: tok(7) });
    tx.rollback().await.unwrap();
    assert_eq!(w.value().await.as_deref(), Some("new holder"));
    assert_eq!(
        w.highest("order:1").await,
        Some(7),
        "a stale check lowers nothing"
    );
    assert_eq!(
        w.fenced_write("order:1", 6, "paused ex-holder").await,
        FenceOutcome::Stale { highest: tok(7) }
    );
    assert_eq!(w.value().await.as_deref(), Some("new holder"));
    w.cleanup().await;
}

#[tokio::test]
async fn an_equal_token_is_accepted_for_the_same_holder_writing_twice() {
    let w = World::new("equal").await;
    assert!(w.fenced_write("order:1", 4, "first").await.is_accepted());
    assert!(w.fenced_write("order:1", 4, "second").await.is_accepted());
    assert_eq!(w.value().await.as_deref(), Some("second"));
    assert_eq!(w.highest("order:1").await, Some(4));
    let mut tx = w.pool.begin_with("BEGIN IMMEDIATE").await.unwrap();
    for _ in 0..2 {
        assert!(w
            .fence
            .check(&mut tx, "order:1", tok(4))
            .await
            .unwrap()
            .is_accepted());
    }
    tx.commit().await.unwrap();
    w.cleanup().await;
}

#[tokio::test]
async fn a_new_resource_accepts_any_token_and_resources_are_byte_exact() {
    let w = World::new("new").await;
    let mut tx = w.pool.begin_with("BEGIN IMMEDIATE").await.unwrap();
    for (resource, token) in [
        ("r:one", 1),
        ("r:max", i64::MAX as u64),
        ("Order", 100),
        ("order", 3),
        ("order ", 2),
        ("é", 9),
        ("e\u{301}", 8),
    ] {
        let outcome = w.fence.check(&mut tx, resource, tok(token)).await.unwrap();
        assert_eq!(outcome, FenceOutcome::Accepted, "{resource:?}");
    }
    tx.commit().await.unwrap();
    assert_eq!(w.highest("r:one").await, Some(1));
    assert_eq!(w.highest("r:max").await, Some(i64::MAX as u64));
    assert_eq!(w.highest("order").await, Some(3));
    assert_eq!(w.highest("order ").await, Some(2));
    assert_eq!(w.highest("e\u{301}").await, Some(8));
    assert_eq!(w.highest("never").await, None);
    w.cleanup().await;
}

/// The first checker holds SQLite's write lock until it commits; a second
/// one (another pool, as another process would be) waits and is then
/// decided against the committed token.
#[tokio::test]
async fn a_second_writer_waits_for_the_first_and_is_decided_by_its_commit() {
    let w = World::new("wait").await;
    let other = Arc::new(World {
        file: w.file.clone(),
        pool: open(&w.file).await,
        fence: w.fence.clone(),
    });
    for (first, second, winner) in [(20, 19, "first"), (30, 31, "second")] {
        let resource = format!("order:{first}");
        let mut a = w.pool.begin_with("BEGIN IMMEDIATE").await.unwrap();
        assert!(w
            .fence
            .check(&mut a, &resource, tok(first))
            .await
            .unwrap()
            .is_accepted());
        let b = {
            let (other, resource) = (other.clone(), resource.clone());
            tokio::spawn(async move { other.fenced_write(&resource, second, "second").await })
        };
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(
            !b.is_finished(),
            "the second writer must wait for the first transaction"
        );
        upsert(&mut a, "first").await;
        a.commit().await.unwrap();
        let outcome = tokio::time::timeout(Duration::from_secs(10), b)
            .await
            .unwrap()
            .unwrap();
        if winner == "first" {
            assert_eq!(
                outcome,
                FenceOutcome::Stale {
                    highest: tok(first)
                }
            );
        } else {
            assert_eq!(outcome, FenceOutcome::Accepted);
        }
        assert_eq!(w.value().await.as_deref(), Some(winner));
        assert_eq!(w.highest(&resource).await, Some(first.max(second)));
    }
    Arc::try_unwrap(other).ok().unwrap().pool.close().await;
    w.cleanup().await;
}

/// Many writers at once with shuffled tokens: the accepted writes, in the
/// order they committed, never go down, and the highest token's write is
/// the one that stays.
#[tokio::test]
async fn concurrent_writers_end_with_the_highest_tokens_write() {
    let w = Arc::new(World::new("race").await);
    exec(
        &w.pool,
        "CREATE TABLE log (seq INTEGER PRIMARY KEY AUTOINCREMENT, token INTEGER NOT NULL)",
    )
    .await;
    let mut tokens: Vec<u64> = (1..=24).collect();
    // A fixed scramble (no RNG dependency): far from sorted.
    tokens.sort_by_key(|t| (t * 7) % 24);
    let tasks: Vec<_> = tokens
        .iter()
        .map(|&t| {
            let w = w.clone();
            tokio::spawn(async move {
                let mut tx = w.pool.begin_with("BEGIN IMMEDIATE").await.unwrap();
                let outcome = w.fence.check(&mut tx, "hot", tok(t)).await.unwrap();
                if outcome.is_accepted() {
                    upsert(&mut tx, &t.to_string()).await;
                    sqlx::query("INSERT INTO log (token) VALUES (?1)")
                        .bind(t as i64)
                        .execute(&mut *tx)
                        .await
                        .unwrap();
                    tx.commit().await.unwrap();
                } else {
                    tx.rollback().await.unwrap();
                }
                (t, outcome)
            })
        })
        .collect();
    let mut stale = 0;
    for task in tasks {
        let (t, outcome) = task.await.unwrap();
        if let FenceOutcome::Stale { highest } = outcome {
            assert!(highest.get() > t, "{t} refused by {highest}");
            stale += 1;
        }
    }
    let accepted: Vec<i64> = sqlx::query("SELECT token FROM log ORDER BY seq")
        .fetch_all(&w.pool)
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert!(
        accepted.windows(2).all(|p| p[0] <= p[1]),
        "accepted writes went backwards: {accepted:?}"
    );
    assert_eq!(accepted.last(), Some(&24));
    assert_eq!(accepted.len() + stale, tokens.len());
    assert_eq!(w.value().await.as_deref(), Some("24"));
    assert_eq!(w.highest("hot").await, Some(24));
    Arc::try_unwrap(w).ok().unwrap().cleanup().await;
}

/// A deferred transaction whose snapshot predates a newer token cannot be
/// fooled by it: SQLite refuses its write (busy, retryable) instead of
/// letting it check against the old snapshot.
#[tokio::test]
async fn an_old_snapshot_does_not_hide_a_newer_token() {
    let w = World::new("snapshot").await;
    assert!(w.fenced_write("order:1", 5, "five").await.is_accepted());
    let mut late = w.pool.begin().await.unwrap();
    let seen: i64 = sqlx::query("SELECT token FROM app_fence")
        .fetch_one(&mut *late)
        .await
        .unwrap()
        .get(0);
    assert_eq!(seen, 5);
    assert!(w.fenced_write("order:1", 10, "ten").await.is_accepted());
    let e = w
        .fence
        .check(&mut late, "order:1", tok(7))
        .await
        .unwrap_err();
    assert!(e.is_retryable(), "{e}");
    late.rollback().await.unwrap();
    assert_eq!(w.value().await.as_deref(), Some("ten"));
    assert_eq!(w.highest("order:1").await, Some(10));
    w.cleanup().await;
}

#[tokio::test]
async fn bad_input_is_a_clear_error_and_writes_nothing() {
    let w = World::new("bad").await;
    let mut tx = w.pool.begin_with("BEGIN IMMEDIATE").await.unwrap();
    let long = "x".repeat(256);
    for resource in ["", long.as_str(), "a\nb"] {
        let e = w.fence.check(&mut tx, resource, tok(1)).await.unwrap_err();
        assert!(matches!(e, Error::InvalidKey { .. }), "{resource:?}: {e}");
    }
    let e = w.fence.check(&mut tx, "r", tok(0)).await.unwrap_err();
    assert!(matches!(e, Error::InvalidOptions { .. }), "{e}");
    assert!(e.to_string().contains("token 0"), "{e}");
    let e = w
        .fence
        .check(&mut tx, "r", tok(i64::MAX as u64 + 1))
        .await
        .unwrap_err();
    assert!(matches!(e, Error::Unsupported { .. }), "{e}");
    assert!(e.to_string().contains("signed 64-bit"), "{e}");
    tx.commit().await.unwrap();
    assert_eq!(w.fence_rows().await, 0);
    assert!(w
        .fence
        .check(
            &mut w.pool.acquire().await.unwrap(),
            &"x".repeat(255),
            tok(1)
        )
        .await
        .unwrap()
        .is_accepted());

    for bad in [
        "",
        "fence;drop table x",
        "a\"b",
        "1abc",
        "Fence",
        "sqlite_x",
        &"t".repeat(49),
    ] {
        assert!(
            matches!(Fence::new(bad), Err(Error::Config { .. })),
            "{bad:?}"
        );
    }
    let missing = Fence::new("missing_fence").unwrap();
    let e = missing
        .check(&mut w.pool.acquire().await.unwrap(), "r", tok(1))
        .await
        .unwrap_err();
    assert!(
        matches!(&e, Error::Config { reason } if reason.contains("Fence::create_table")),
        "{e}"
    );
    let e = Fence::new("business")
        .unwrap()
        .create_table(&w.pool)
        .await
        .unwrap_err();
    assert!(
        matches!(&e, Error::Config { reason } if reason.contains("not a fence table")),
        "{e}"
    );
    w.fence.create_table(&w.pool).await.unwrap();
    w.cleanup().await;
}

/// The token on the business row itself: `… AND fence_token <= ?`, decided
/// by the rows matched.
#[tokio::test]
async fn the_column_form_refuses_stale_tokens_too() {
    let w = World::new("column").await;
    exec(
        &w.pool,
        "CREATE TABLE orders (id INTEGER PRIMARY KEY, state TEXT NOT NULL, \
         fence_token INTEGER NOT NULL DEFAULT 0) STRICT",
    )
    .await;
    exec(
        &w.pool,
        "INSERT INTO orders (id, state) VALUES (1001, 'new')",
    )
    .await;
    let write = |state: &'static str, token: i64| {
        let pool = w.pool.clone();
        async move {
            sqlx::query(
                "UPDATE orders SET state = ?1, fence_token = ?2 WHERE id = 1001 AND fence_token <= ?2",
            )
            .bind(state)
            .bind(token)
            .execute(&pool)
            .await
            .unwrap()
            .rows_affected()
                == 1
        }
    };
    assert!(write("paid", 10).await, "current token");
    assert!(
        write("paid", 10).await,
        "equal token, same value: still matched"
    );
    assert!(!write("cancelled", 9).await, "stale token");
    assert!(write("shipped", i64::MAX).await, "the largest token");
    let row = sqlx::query("SELECT state, fence_token FROM orders WHERE id = 1001")
        .fetch_one(&w.pool)
        .await
        .unwrap();
    assert_eq!(row.get::<String, _>(0), "shipped");
    assert_eq!(row.get::<i64, _>(1), i64::MAX);
    w.cleanup().await;
}

/// Tokens from real grants: A's lease is force-released, B is granted a
/// higher token and writes; A's late write is refused and does not land.
#[tokio::test]
async fn a_late_write_of_a_force_released_holder_is_refused() {
    let w = World::new("grants").await;
    let url = url_for(&w.file, "locks", "");
    let (node_a, node_b) = (
        SqliteLock::connect(&url).await.unwrap(),
        SqliteLock::connect(&url).await.unwrap(),
    );
    let key = LockKey::new("order:1001").unwrap();
    let opts = LockOptions::builder()
        .ttl(Duration::from_secs(30))
        .wait_timeout(Duration::from_secs(10))
        .build()
        .unwrap();
    let a = node_a.try_acquire(&key, &opts).await.unwrap().unwrap();
    assert!(w
        .fenced_write(key.as_str(), a.token.get(), "A")
        .await
        .is_accepted());
    assert!(node_b.force_release(&key).await.unwrap());
    let b = node_b.acquire(&key, &opts).await.unwrap();
    assert!(b.token > a.token);
    assert!(w
        .fenced_write(key.as_str(), b.token.get(), "B")
        .await
        .is_accepted());
    assert_eq!(
        w.fenced_write(key.as_str(), a.token.get(), "A, late").await,
        FenceOutcome::Stale { highest: b.token }
    );
    assert_eq!(w.value().await.as_deref(), Some("B"));
    node_b.release(&b).await.unwrap();
    drop((node_a, node_b));
    w.cleanup().await;
}
