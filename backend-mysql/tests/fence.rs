//! `fence::Fence` on the shared MariaDB: the check and the business write
//! commit together or not at all, stale tokens are refused with the highest
//! token, writers of one resource are serialised, and the column form
//! (`… AND fence_token <= ?`) behaves the same. Each test uses tables of its
//! own (random names) and drops them.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::{sync::Arc, time::Duration};

use common::{drop_tables, server_url, url_for};
use fenced_api::{DistributedLock, Error, FencingToken, LockKey, LockOptions};
use fenced_mysql::{
    fence::{Fence, FenceOutcome},
    sqlx::{self, AssertSqlSafe, MySqlPool, Row},
    MySqlLock, Strategy,
};

fn tok(t: u64) -> FencingToken {
    FencingToken::new(t)
}

fn fresh_name(tag: &str) -> String {
    format!(
        "fenced_f_{tag}_{}",
        &uuid::Uuid::new_v4().simple().to_string()[..10]
    )
}

/// A fence table and a business table `(id INT, v VARCHAR)` of this test's own.
struct World {
    pool: MySqlPool,
    fence: Fence,
    business: String,
}

impl World {
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
        }
    }

    /// One transaction: the check first, then (if accepted) the write; commits
    /// on `Accepted`, rolls back on `Stale`.
    async fn fenced_write(&self, resource: &str, token: u64, v: &str) -> FenceOutcome {
        let mut tx = self.pool.begin().await.unwrap();
        let outcome = self
            .fence
            .check(&mut tx, resource, tok(token))
            .await
            .unwrap();
        if outcome.is_accepted() {
            self.upsert(&mut tx, v).await;
            tx.commit().await.unwrap();
        } else {
            tx.rollback().await.unwrap();
        }
        outcome
    }

    async fn upsert(&self, tx: &mut sqlx::MySqlConnection, v: &str) {
        sqlx::query(AssertSqlSafe(format!(
            "INSERT INTO `{}` (id, v) VALUES (1, ?) ON DUPLICATE KEY UPDATE v = ?",
            self.business
        )))
        .bind(v)
        .bind(v)
        .execute(&mut *tx)
        .await
        .unwrap();
    }

    async fn value(&self) -> Option<String> {
        sqlx::query(AssertSqlSafe(format!(
            "SELECT v FROM `{}` WHERE id = 1",
            self.business
        )))
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
        sqlx::query(AssertSqlSafe(format!(
            "SELECT COUNT(*) FROM `{}`",
            self.fence.table()
        )))
        .fetch_one(&self.pool)
        .await
        .unwrap()
        .get(0)
    }

    async fn cleanup(self) {
        exec(
            &self.pool,
            &format!("DROP TABLE `{}`, `{}`", self.fence.table(), self.business),
        )
        .await;
    }
}

async fn exec(pool: &MySqlPool, sql: &str) {
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
    let mut tx = w.pool.begin().await.unwrap();
    w.upsert(&mut tx, "paused ex-holder").await;
    let outcome = w.fence.check(&mut tx, "order:1", tok(5)).await.unwrap();
    assert_eq!(outcome, FenceOutcome::Stale { highest: tok(7) });
    tx.rollback().await.unwrap();
    assert_eq!(w.value().await.as_deref(), Some("new holder"));
    assert_eq!(
        w.highest("order:1").await,
        Some(7),
        "a stale check lowers nothing"
    );
    // Check-first order, through the helper: also refused, nothing written.
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
    // Twice in one transaction, too.
    let mut tx = w.pool.begin().await.unwrap();
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
    let mut tx = w.pool.begin().await.unwrap();
    for (resource, token) in [
        ("r:one", 1),
        ("r:max", u64::MAX),
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
    assert_eq!(
        w.highest("r:max").await,
        Some(u64::MAX),
        "BIGINT UNSIGNED keeps u64"
    );
    // Case, trailing spaces and Unicode forms are distinct resources.
    assert_eq!(w.highest("order").await, Some(3));
    assert_eq!(w.highest("order ").await, Some(2));
    assert_eq!(w.highest("e\u{301}").await, Some(8));
    assert_eq!(w.highest("never").await, None);
    w.cleanup().await;
}

/// The first checker holds the fence row until it commits; a second one
/// waits and is then decided against the committed token.
#[tokio::test]
async fn a_second_writer_waits_for_the_first_and_is_decided_by_its_commit() {
    let w = Arc::new(World::new("wait").await);
    for (first, second, winner) in [(20, 19, "first"), (30, 31, "second")] {
        let resource = format!("order:{first}");
        let mut a = w.pool.begin().await.unwrap();
        assert!(w
            .fence
            .check(&mut a, &resource, tok(first))
            .await
            .unwrap()
            .is_accepted());
        let b = {
            let (w, resource) = (w.clone(), resource.clone());
            tokio::spawn(async move { w.fenced_write(&resource, second, "second").await })
        };
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(
            !b.is_finished(),
            "the second check must wait for the first transaction"
        );
        w.upsert(&mut a, "first").await;
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
    Arc::try_unwrap(w).ok().unwrap().cleanup().await;
}

/// Many writers at once with shuffled tokens: the accepted writes, in the
/// order they committed, never go down, and the highest token's write is
/// the one that stays.
#[tokio::test]
async fn concurrent_writers_end_with_the_highest_tokens_write() {
    let w = Arc::new(World::new("race").await);
    let log = fresh_name("race_log");
    exec(
        &w.pool,
        &format!("CREATE TABLE `{log}` (seq BIGINT AUTO_INCREMENT PRIMARY KEY, token BIGINT UNSIGNED NOT NULL) ENGINE=InnoDB"),
    )
    .await;
    let mut tokens: Vec<u64> = (1..=24).collect();
    fastrand::shuffle(&mut tokens);
    let tasks: Vec<_> = tokens
        .iter()
        .map(|&t| {
            let (w, log) = (w.clone(), log.clone());
            tokio::spawn(async move {
                let mut tx = w.pool.begin().await.unwrap();
                let outcome = w.fence.check(&mut tx, "hot", tok(t)).await.unwrap();
                if outcome.is_accepted() {
                    w.upsert(&mut tx, &t.to_string()).await;
                    sqlx::query(AssertSqlSafe(format!(
                        "INSERT INTO `{log}` (token) VALUES (?)"
                    )))
                    .bind(t)
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
    let accepted: Vec<u64> = sqlx::query(AssertSqlSafe(format!(
        "SELECT token FROM `{log}` ORDER BY seq"
    )))
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
    exec(&w.pool, &format!("DROP TABLE `{log}`")).await;
    Arc::try_unwrap(w).ok().unwrap().cleanup().await;
}

#[tokio::test]
async fn bad_input_is_a_clear_error_and_writes_nothing() {
    let w = World::new("bad").await;
    let mut tx = w.pool.begin().await.unwrap();
    let long = "x".repeat(256);
    for (resource, token) in [("", 1), (long.as_str(), 1), ("a\nb", 1)] {
        let e = w
            .fence
            .check(&mut tx, resource, tok(token))
            .await
            .unwrap_err();
        assert!(matches!(e, Error::InvalidKey { .. }), "{resource:?}: {e}");
    }
    let e = w.fence.check(&mut tx, "r", tok(0)).await.unwrap_err();
    assert!(matches!(e, Error::InvalidOptions { .. }), "{e}");
    assert!(e.to_string().contains("token 0"), "{e}");
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
        "fence;DROP TABLE x",
        "a`b",
        "1abc",
        "a b",
        &"t".repeat(49),
    ] {
        assert!(
            matches!(Fence::new(bad), Err(Error::Config { .. })),
            "{bad:?}"
        );
    }
    // No table yet: the error names the fix.
    let missing = Fence::new(&fresh_name("missing")).unwrap();
    let e = missing
        .check(&mut w.pool.acquire().await.unwrap(), "r", tok(1))
        .await
        .unwrap_err();
    assert!(
        matches!(&e, Error::Config { reason } if reason.contains("Fence::create_table")),
        "{e}"
    );
    // A table of that name that is something else is refused by create_table.
    let e = Fence::new(&w.business)
        .unwrap()
        .create_table(&w.pool)
        .await
        .unwrap_err();
    assert!(
        matches!(&e, Error::Config { reason } if reason.contains("not a fence table")),
        "{e}"
    );
    // Idempotent on a real fence table.
    w.fence.create_table(&w.pool).await.unwrap();
    w.cleanup().await;
}

/// The token on the business row itself: `… AND fence_token <= ?`, decided
/// by the rows matched.
#[tokio::test]
async fn the_column_form_refuses_stale_tokens_too() {
    let pool = MySqlPool::connect(&server_url().await).await.unwrap();
    let orders = fresh_name("orders");
    exec(
        &pool,
        &format!(
            "CREATE TABLE `{orders}` (id INT PRIMARY KEY, state VARCHAR(20) NOT NULL, \
             fence_token BIGINT UNSIGNED NOT NULL DEFAULT 0) ENGINE=InnoDB; "
        ),
    )
    .await;
    exec(
        &pool,
        &format!("INSERT INTO `{orders}` (id, state) VALUES (1001, 'new')"),
    )
    .await;
    let write = |state: &'static str, token: u64| {
        let (pool, orders) = (pool.clone(), orders.clone());
        async move {
            sqlx::query(AssertSqlSafe(format!(
                "UPDATE `{orders}` SET state = ?, fence_token = ? WHERE id = 1001 AND fence_token <= ?"
            )))
            .bind(state)
            .bind(token)
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
    assert!(write("shipped", u64::MAX).await, "the largest token");
    let row = sqlx::query(AssertSqlSafe(format!(
        "SELECT state, fence_token FROM `{orders}` WHERE id = 1001"
    )))
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(row.get::<String, _>(0), "shipped");
    assert_eq!(row.get::<u64, _>(1), u64::MAX);
    exec(&pool, &format!("DROP TABLE `{orders}`")).await;
}

/// Tokens from real grants: A's lease is force-released, B is granted a
/// higher token and writes; A's late write is refused and does not land.
#[tokio::test]
async fn a_late_write_of_a_force_released_holder_is_refused() {
    let w = World::new("grants").await;
    let base = fresh_name("grants_lock");
    let url = url_for(&server_url().await, Strategy::UniqueKey, &base);
    MySqlLock::migrate(&url).await.unwrap();
    let (node_a, node_b) = (
        MySqlLock::connect(&url).await.unwrap(),
        MySqlLock::connect(&url).await.unwrap(),
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
    // An operator evicts A (or it paused past its TTL); B takes over.
    assert!(node_b.force_release(&key).await.unwrap());
    let b = node_b.acquire(&key, &opts).await.unwrap();
    assert!(b.token > a.token);
    assert!(w
        .fenced_write(key.as_str(), b.token.get(), "B")
        .await
        .is_accepted());
    // A wakes up and writes with its old token.
    assert_eq!(
        w.fenced_write(key.as_str(), a.token.get(), "A, late").await,
        FenceOutcome::Stale { highest: b.token }
    );
    assert_eq!(w.value().await.as_deref(), Some("B"));
    node_b.release(&b).await.unwrap();
    drop((node_a, node_b));
    drop_tables(&base).await;
    w.cleanup().await;
}

/// Under REPEATABLE READ a transaction that read before a newer holder
/// committed still sees the old token in its snapshot; the check must read
/// the newest one (a locking read), not the snapshot.
#[tokio::test]
async fn an_old_snapshot_does_not_hide_a_newer_token() {
    let w = World::new("snapshot").await;
    assert!(w.fenced_write("order:1", 5, "five").await.is_accepted());
    let mut late = w.pool.begin().await.unwrap();
    // The late writer's snapshot is taken here, while the token is 5.
    assert_eq!(
        sqlx::query(AssertSqlSafe(format!(
            "SELECT token FROM `{}`",
            w.fence.table()
        )))
        .fetch_one(&mut *late)
        .await
        .unwrap()
        .get::<u64, _>(0),
        5
    );
    assert!(w.fenced_write("order:1", 10, "ten").await.is_accepted());
    assert_eq!(
        w.fence.check(&mut late, "order:1", tok(7)).await.unwrap(),
        FenceOutcome::Stale { highest: tok(10) }
    );
    late.rollback().await.unwrap();
    assert_eq!(w.value().await.as_deref(), Some("ten"));
    w.cleanup().await;
}
