//! The fence test cases every SQL backend runs against its real store
//! (feature `testing`, for dev-dependencies).
//!
//! A backend's `tests/fence.rs` implements [`FenceWorld`] — a fence table
//! and a business table `(id, v)` of one test's own, and the few statements
//! that differ between stores — and runs every case with
//! [`fence_tests!`](crate::fence_tests): the check and the business write
//! commit together or not at all, stale tokens are refused with the highest
//! token, writers of one resource are serialised, and the column form
//! (`… AND fence_token <= ?`) behaves the same.

#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::{sync::Arc, time::Duration};

use async_trait::async_trait;
use fenced_api::{DistributedLock, Error, FencingToken, LockKey, LockOptions};
use sqlx::{Database, Pool, Transaction};

use crate::{
    fence::{Fence, FenceOutcome},
    Dialect, SqlBackend,
};

/// The store of world `W`.
pub type Db<W> = <<W as FenceWorld>::Backend as SqlBackend>::Db;
/// A connection of `W`'s store.
pub type Conn<W> = <Db<W> as Database>::Connection;
/// A transaction of `W`'s store.
pub type Tx<W> = Transaction<'static, Db<W>>;

/// One test's tables on a real store.
#[async_trait]
pub trait FenceWorld: Sized + Send + Sync + 'static {
    /// The backend under test.
    type Backend: SqlBackend;
    /// Table names `Fence::new` refuses on this store, beyond those every
    /// store refuses.
    const BAD_TABLE_NAMES: &'static [&'static str];
    /// Whether a check in a transaction whose snapshot predates a newer
    /// token fails (retryable) rather than answering `Stale`: SQLite's
    /// deferred transactions, PostgreSQL's REPEATABLE READ and SERIALIZABLE
    /// (not its default READ COMMITTED, which `pool.begin()` opens).
    const OLD_SNAPSHOT_FAILS: bool;

    /// A fence table (created) and a business table `(id, v)`.
    async fn new(tag: &str) -> Self;
    fn fence(&self) -> &Fence<Self::Backend>;
    fn pool(&self) -> &Pool<Db<Self>>;
    /// A pool of its own on the same store, as another process would have.
    async fn second_pool(&self) -> Pool<Db<Self>>;
    /// Begins the transaction of a fenced write.
    async fn begin(pool: &Pool<Db<Self>>) -> Tx<Self>;
    /// The business table's name.
    fn business(&self) -> &str;
    /// Writes `v` into business row 1.
    async fn upsert(&self, conn: &mut Conn<Self>, v: &str);
    /// Business row 1's value.
    async fn value(&self) -> Option<String>;
    /// The rows of the fence table.
    async fn fence_rows(&self) -> i64;
    /// The tokens of the fence table, as read on `conn` (its snapshot).
    async fn tokens_seen(&self, conn: &mut Conn<Self>) -> Vec<u64>;
    /// Creates a log `(seq, token)` of accepted writes, in commit order.
    async fn log_create(&self);
    async fn log_insert(&self, conn: &mut Conn<Self>, token: u64);
    async fn log_tokens(&self) -> Vec<u64>;
    /// Creates `orders (id, state, fence_token)` with row 1001 `new`, 0.
    async fn orders_create(&self);
    /// `UPDATE orders SET state, fence_token WHERE id = 1001 AND
    /// fence_token <= token`: the rows it matched.
    async fn orders_write(&self, state: &str, token: u64) -> u64;
    /// Row 1001's state and token.
    async fn orders_row(&self) -> (String, u64);
    /// Two lock stores on one namespace of this backend.
    async fn lock_stores(&self) -> (Arc<dyn DistributedLock>, Arc<dyn DistributedLock>);
    /// Removes what the world created.
    async fn cleanup(self);
}

/// Runs one statement without parameters on `pool` (tables, fixtures).
pub async fn exec<D: Dialect>(pool: &Pool<D>, sql: &str) {
    let mut conn = pool.acquire().await.unwrap();
    D::execute(&mut conn, sql.to_owned()).await.unwrap();
}

/// A table name unique to this test run.
pub fn fresh_name(tag: &str) -> String {
    format!("fenced_f_{tag}_{:010x}", fastrand::u64(..) >> 24)
}

fn tok(t: u64) -> FencingToken {
    FencingToken::new(t)
}

fn max_token<W: FenceWorld>() -> u64 {
    <Db<W> as Dialect>::MAX_TOKEN
}

/// One transaction: the check first, then (if accepted) the write; commits
/// on `Accepted`, rolls back on `Stale`.
async fn fenced_write<W: FenceWorld>(
    w: &W,
    pool: &Pool<Db<W>>,
    resource: &str,
    token: u64,
    v: &str,
) -> FenceOutcome {
    let mut tx = W::begin(pool).await;
    let outcome = w
        .fence()
        .check(&mut tx, resource, tok(token))
        .await
        .unwrap();
    if outcome.is_accepted() {
        w.upsert(&mut tx, v).await;
        tx.commit().await.unwrap();
    } else {
        tx.rollback().await.unwrap();
    }
    outcome
}

async fn highest<W: FenceWorld>(w: &W, resource: &str) -> Option<u64> {
    w.fence()
        .highest(w.pool(), resource)
        .await
        .unwrap()
        .map(FencingToken::get)
}

/// Runs every shared fence case as a `#[tokio::test]` on world `$world`.
#[macro_export]
macro_rules! fence_tests {
    ($world:ty) => {
        $crate::fence_tests!(@cases $world;
            a_current_token_is_accepted_and_its_write_lands,
            a_stale_token_is_refused_and_the_write_in_its_transaction_rolled_back,
            an_equal_token_is_accepted_for_the_same_holder_writing_twice,
            a_new_resource_accepts_any_token_and_resources_are_byte_exact,
            a_second_writer_waits_for_the_first_and_is_decided_by_its_commit,
            concurrent_writers_end_with_the_highest_tokens_write,
            an_old_snapshot_does_not_hide_a_newer_token,
            bad_input_is_a_clear_error_and_writes_nothing,
            the_column_form_refuses_stale_tokens_too,
            a_late_write_of_a_force_released_holder_is_refused,
        );
    };
    (@cases $world:ty; $($case:ident,)*) => {
        $(
            #[::tokio::test]
            async fn $case() {
                $crate::testing::$case::<$world>().await
            }
        )*
    };
}

pub async fn a_current_token_is_accepted_and_its_write_lands<W: FenceWorld>() {
    let w = W::new("current").await;
    let write = |token, v| fenced_write(&w, w.pool(), "order:1", token, v);
    assert_eq!(write(5, "five").await, FenceOutcome::Accepted);
    assert_eq!(w.value().await.as_deref(), Some("five"));
    assert_eq!(highest(&w, "order:1").await, Some(5));
    assert_eq!(write(6, "six").await, FenceOutcome::Accepted);
    assert_eq!(w.value().await.as_deref(), Some("six"));
    assert_eq!(highest(&w, "order:1").await, Some(6));
    w.cleanup().await;
}

pub async fn a_stale_token_is_refused_and_the_write_in_its_transaction_rolled_back<
    W: FenceWorld,
>() {
    let w = W::new("stale").await;
    assert!(fenced_write(&w, w.pool(), "order:1", 7, "new holder")
        .await
        .is_accepted());
    // The late writer writes first and checks after, in one transaction.
    let mut tx = W::begin(w.pool()).await;
    w.upsert(&mut tx, "paused ex-holder").await;
    let outcome = w.fence().check(&mut tx, "order:1", tok(5)).await.unwrap();
    assert_eq!(outcome, FenceOutcome::Stale { highest: tok(7) });
    tx.rollback().await.unwrap();
    assert_eq!(w.value().await.as_deref(), Some("new holder"));
    assert_eq!(
        highest(&w, "order:1").await,
        Some(7),
        "a stale check lowers nothing"
    );
    // Check-first order, through the helper: also refused, nothing written.
    assert_eq!(
        fenced_write(&w, w.pool(), "order:1", 6, "paused ex-holder").await,
        FenceOutcome::Stale { highest: tok(7) }
    );
    assert_eq!(w.value().await.as_deref(), Some("new holder"));
    w.cleanup().await;
}

pub async fn an_equal_token_is_accepted_for_the_same_holder_writing_twice<W: FenceWorld>() {
    let w = W::new("equal").await;
    assert!(fenced_write(&w, w.pool(), "order:1", 4, "first")
        .await
        .is_accepted());
    assert!(fenced_write(&w, w.pool(), "order:1", 4, "second")
        .await
        .is_accepted());
    assert_eq!(w.value().await.as_deref(), Some("second"));
    assert_eq!(highest(&w, "order:1").await, Some(4));
    // Twice in one transaction, too.
    let mut tx = W::begin(w.pool()).await;
    for _ in 0..2 {
        let outcome = w.fence().check(&mut tx, "order:1", tok(4)).await.unwrap();
        assert!(outcome.is_accepted());
    }
    tx.commit().await.unwrap();
    w.cleanup().await;
}

pub async fn a_new_resource_accepts_any_token_and_resources_are_byte_exact<W: FenceWorld>() {
    let w = W::new("new").await;
    let max = max_token::<W>();
    let mut tx = W::begin(w.pool()).await;
    for (resource, token) in [
        ("r:one", 1),
        ("r:max", max),
        ("Order", 100),
        ("order", 3),
        ("order ", 2),
        ("é", 9),
        ("e\u{301}", 8),
    ] {
        let outcome = w
            .fence()
            .check(&mut tx, resource, tok(token))
            .await
            .unwrap();
        assert_eq!(outcome, FenceOutcome::Accepted, "{resource:?}");
    }
    tx.commit().await.unwrap();
    assert_eq!(highest(&w, "r:one").await, Some(1));
    assert_eq!(
        highest(&w, "r:max").await,
        Some(max),
        "the largest token is kept"
    );
    // Case, trailing spaces and Unicode forms are distinct resources.
    assert_eq!(highest(&w, "order").await, Some(3));
    assert_eq!(highest(&w, "order ").await, Some(2));
    assert_eq!(highest(&w, "e\u{301}").await, Some(8));
    assert_eq!(highest(&w, "never").await, None);
    w.cleanup().await;
}

/// The first checker holds the fence row (or the file's write lock) until
/// it commits; a second one, on a pool of its own, waits and is then decided
/// against the committed token.
pub async fn a_second_writer_waits_for_the_first_and_is_decided_by_its_commit<W: FenceWorld>() {
    let w = Arc::new(W::new("wait").await);
    let other = w.second_pool().await;
    for (first, second, winner) in [(20, 19, "first"), (30, 31, "second")] {
        let resource = format!("order:{first}");
        let mut a = W::begin(w.pool()).await;
        let outcome = w
            .fence()
            .check(&mut a, &resource, tok(first))
            .await
            .unwrap();
        assert!(outcome.is_accepted());
        let b = {
            let (w, other, resource) = (w.clone(), other.clone(), resource.clone());
            tokio::spawn(
                async move { fenced_write(&*w, &other, &resource, second, "second").await },
            )
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
        assert_eq!(highest(&*w, &resource).await, Some(first.max(second)));
    }
    other.close().await;
    Arc::try_unwrap(w).ok().unwrap().cleanup().await;
}

/// Many writers at once with shuffled tokens: the accepted writes, in the
/// order they committed, never go down, and the highest token's write is
/// the one that stays.
pub async fn concurrent_writers_end_with_the_highest_tokens_write<W: FenceWorld>() {
    let w = Arc::new(W::new("race").await);
    w.log_create().await;
    let mut tokens: Vec<u64> = (1..=24).collect();
    fastrand::shuffle(&mut tokens);
    let tasks: Vec<_> = tokens
        .iter()
        .map(|&t| {
            let w = w.clone();
            tokio::spawn(async move {
                let mut tx = W::begin(w.pool()).await;
                let outcome = w.fence().check(&mut tx, "hot", tok(t)).await.unwrap();
                if outcome.is_accepted() {
                    w.upsert(&mut tx, &t.to_string()).await;
                    w.log_insert(&mut tx, t).await;
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
    let accepted = w.log_tokens().await;
    assert!(
        accepted.windows(2).all(|p| p[0] <= p[1]),
        "accepted writes went backwards: {accepted:?}"
    );
    assert_eq!(accepted.last(), Some(&24));
    assert_eq!(accepted.len() + stale, tokens.len());
    assert_eq!(w.value().await.as_deref(), Some("24"));
    assert_eq!(highest(&*w, "hot").await, Some(24));
    Arc::try_unwrap(w).ok().unwrap().cleanup().await;
}

/// A transaction that read before a newer holder committed still sees the
/// old token in its snapshot; the check must not be fooled by it: it reads
/// the newest token (MySQL: a locking read; PostgreSQL under READ
/// COMMITTED: the upsert's latest row), or the store refuses its write
/// (SQLite: busy; PostgreSQL under REPEATABLE READ: a serialization
/// failure; both retryable) instead of letting it check against the old
/// snapshot. The transaction is `pool.begin()`, at the store's default
/// isolation level.
pub async fn an_old_snapshot_does_not_hide_a_newer_token<W: FenceWorld>() {
    let w = W::new("snapshot").await;
    assert!(fenced_write(&w, w.pool(), "order:1", 5, "five")
        .await
        .is_accepted());
    let mut late = w.pool().begin().await.unwrap();
    // The late writer's snapshot is taken here, while the token is 5.
    assert_eq!(w.tokens_seen(&mut late).await, [5]);
    assert!(fenced_write(&w, w.pool(), "order:1", 10, "ten")
        .await
        .is_accepted());
    let checked = w.fence().check(&mut late, "order:1", tok(7)).await;
    if W::OLD_SNAPSHOT_FAILS {
        let e = checked.unwrap_err();
        assert!(e.is_retryable(), "{e}");
    } else {
        assert_eq!(checked.unwrap(), FenceOutcome::Stale { highest: tok(10) });
    }
    late.rollback().await.unwrap();
    assert_eq!(w.value().await.as_deref(), Some("ten"));
    assert_eq!(highest(&w, "order:1").await, Some(10));
    w.cleanup().await;
}

pub async fn bad_input_is_a_clear_error_and_writes_nothing<W: FenceWorld>() {
    let w = W::new("bad").await;
    let mut tx = W::begin(w.pool()).await;
    let long = "x".repeat(256);
    for resource in ["", long.as_str(), "a\nb"] {
        let e = w
            .fence()
            .check(&mut tx, resource, tok(1))
            .await
            .unwrap_err();
        assert!(matches!(e, Error::InvalidKey { .. }), "{resource:?}: {e}");
    }
    let e = w.fence().check(&mut tx, "r", tok(0)).await.unwrap_err();
    assert!(matches!(e, Error::InvalidOptions { .. }), "{e}");
    assert!(e.to_string().contains("token 0"), "{e}");
    if let Some(over) = max_token::<W>().checked_add(1) {
        let e = w.fence().check(&mut tx, "r", tok(over)).await.unwrap_err();
        assert!(matches!(e, Error::Unsupported { .. }), "{e}");
        assert!(e.to_string().contains("signed 64-bit"), "{e}");
    }
    tx.commit().await.unwrap();
    assert_eq!(w.fence_rows().await, 0);
    let mut conn = w.pool().acquire().await.unwrap();
    let outcome = w.fence().check(&mut conn, &"x".repeat(255), tok(1)).await;
    assert!(outcome.unwrap().is_accepted());
    drop(conn);

    let quote = format!("a{}b", <Db<W> as Dialect>::QUOTE);
    let shared = [
        "",
        "fence;drop table x",
        "fence;DROP TABLE x",
        quote.as_str(),
        "1abc",
        &"t".repeat(49),
    ];
    for bad in shared.iter().chain(W::BAD_TABLE_NAMES) {
        assert!(
            matches!(Fence::<W::Backend>::new(bad), Err(Error::Config { .. })),
            "{bad:?}"
        );
    }
    // No table yet: the error names the fix.
    let missing = Fence::<W::Backend>::new(&fresh_name("missing")).unwrap();
    let mut conn = w.pool().acquire().await.unwrap();
    let e = missing.check(&mut conn, "r", tok(1)).await.unwrap_err();
    drop(conn);
    assert!(
        matches!(&e, Error::Config { reason } if reason.contains("Fence::create_table")),
        "{e}"
    );
    // A table of that name that is something else is refused by create_table.
    let e = Fence::<W::Backend>::new(w.business())
        .unwrap()
        .create_table(w.pool())
        .await
        .unwrap_err();
    assert!(
        matches!(&e, Error::Config { reason } if reason.contains("not a fence table")),
        "{e}"
    );
    // Idempotent on a real fence table.
    w.fence().create_table(w.pool()).await.unwrap();
    w.cleanup().await;
}

/// The token on the business row itself: `… AND fence_token <= ?`, decided
/// by the rows matched.
pub async fn the_column_form_refuses_stale_tokens_too<W: FenceWorld>() {
    let w = W::new("column").await;
    w.orders_create().await;
    assert_eq!(w.orders_write("paid", 10).await, 1, "current token");
    assert_eq!(
        w.orders_write("paid", 10).await,
        1,
        "equal token, same value: still matched"
    );
    assert_eq!(w.orders_write("cancelled", 9).await, 0, "stale token");
    let max = max_token::<W>();
    assert_eq!(w.orders_write("shipped", max).await, 1, "the largest token");
    assert_eq!(w.orders_row().await, ("shipped".to_owned(), max));
    w.cleanup().await;
}

/// Tokens from real grants: A's lease is force-released, B is granted a
/// higher token and writes; A's late write is refused and does not land.
pub async fn a_late_write_of_a_force_released_holder_is_refused<W: FenceWorld>() {
    let w = W::new("grants").await;
    let (node_a, node_b) = w.lock_stores().await;
    let key = LockKey::new("order:1001").unwrap();
    let opts = LockOptions::builder()
        .ttl(Duration::from_secs(30))
        .wait_timeout(Duration::from_secs(10))
        .build()
        .unwrap();
    let a = node_a.try_acquire(&key, &opts).await.unwrap().unwrap();
    let write = |token, v| fenced_write(&w, w.pool(), key.as_str(), token, v);
    assert!(write(a.token.get(), "A").await.is_accepted());
    // An operator evicts A (or it paused past its TTL); B takes over.
    assert!(node_b.force_release(&key).await.unwrap());
    let b = node_b.acquire(&key, &opts).await.unwrap();
    assert!(b.token > a.token);
    assert!(write(b.token.get(), "B").await.is_accepted());
    // A wakes up and writes with its old token.
    assert_eq!(
        write(a.token.get(), "A, late").await,
        FenceOutcome::Stale { highest: b.token }
    );
    assert_eq!(w.value().await.as_deref(), Some("B"));
    node_b.release(&b).await.unwrap();
    drop((node_a, node_b));
    w.cleanup().await;
}
