//! Transaction-scoped locks (`PostgresLock::lock_in_transaction`) on the
//! real server, with both strategies: business writes become visible
//! exactly when the lock is released; rollback, drop, an aborted
//! transaction or a lost lock commit nothing and free the key; exclusion
//! against plain holders; tokens from the same sequence; the fence in the
//! same transaction. Then what is particular to each strategy: `lease`
//! renews while the transaction is open and fails a commit whose lease
//! expired or was taken (and, under REPEATABLE READ, one renewed after the
//! snapshot); `advisory` keeps the lock while the transaction is busy and
//! loses it after a TTL of silence.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::print_stderr,
    clippy::print_stdout
)]

mod common;

use std::time::Duration;

use common::{admin, drop_tables, exec, fresh_table, key, server_url, ttl, url_for};
use fenced_api::{DistributedLock, Error, LockOptions, WaitPolicy};
use fenced_postgres::{
    fence::{Fence, FenceOutcome},
    PostgresLock, PostgresLockTransaction, Strategy,
};
use sqlx::{Connection, PgPool, Row};
use tokio::time::Instant;

const LONG: Duration = Duration::from_secs(30);

/// Two clients of one table that share nothing in memory (different URL
/// spellings: different waiting scopes, as in two processes), a plain
/// pool for looking at rows, and a business table.
struct Fixture {
    a: PostgresLock,
    b: PostgresLock,
    url: String,
    admin: PgPool,
    table: String,
    orders: String,
}

impl Fixture {
    async fn new(strategy: Strategy, tag: &str) -> Fixture {
        let table = fresh_table(tag);
        let url = url_for(&server_url().await, strategy, &table);
        let a = PostgresLock::connect(&url).await.unwrap();
        let b = PostgresLock::connect(&other_spelling(&url)).await.unwrap();
        let admin = admin().await;
        let orders = format!("{table}_orders");
        exec(
            &admin,
            &format!("CREATE TABLE \"{orders}\" (id INT PRIMARY KEY, token BIGINT NOT NULL)"),
        )
        .await;
        Fixture {
            a,
            b,
            url,
            admin,
            table,
            orders,
        }
    }

    /// Another client.
    async fn client(&self) -> PostgresLock {
        PostgresLock::connect(&self.url).await.unwrap()
    }

    /// Writes order `id` inside `tx`, with the transaction's token.
    async fn write(&self, tx: &mut PostgresLockTransaction, id: i32) {
        let token = tx.token().get() as i64;
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "INSERT INTO \"{}\" (id, token) VALUES ($1, $2)",
            self.orders
        )))
        .bind(id)
        .bind(token)
        .execute(&mut **tx)
        .await
        .unwrap();
    }

    /// How many committed rows order `id` has (0 or 1).
    async fn committed(&self, id: i32) -> i64 {
        count(&self.admin, &self.orders, id).await
    }

    async fn finish(self) {
        self.a.close().await;
        self.b.close().await;
        exec(
            &self.admin,
            &format!(
                "DROP TABLE IF EXISTS \"{}\", \"{}_fences\"",
                self.orders, self.table
            ),
        )
        .await;
        self.admin.close().await;
        drop_tables(&self.table).await;
    }
}

async fn count(pool: &PgPool, orders: &str, id: i32) -> i64 {
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT count(*) FROM \"{orders}\" WHERE id = $1"
    )))
    .bind(id)
    .fetch_one(pool)
    .await
    .unwrap()
    .get(0)
}

/// The same server through another spelling of its URL (the default port
/// left out), when the URL names it.
fn other_spelling(url: &str) -> String {
    url.replacen(":5432/", "/", 1)
}

fn waiting(ttl: Duration, wait: Duration) -> LockOptions {
    LockOptions::builder()
        .ttl(ttl)
        .wait_timeout(wait)
        .build()
        .unwrap()
}

fn no_wait(ttl: Duration) -> LockOptions {
    LockOptions::builder()
        .ttl(ttl)
        .wait(WaitPolicy::NoWait)
        .build()
        .unwrap()
}

/// Polls `done` every 10 ms for at most 10 s.
async fn wait_until(mut done: impl FnMut() -> bool) {
    let start = Instant::now();
    while !done() {
        assert!(start.elapsed() < Duration::from_secs(10), "waited 10 s");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

fn expect_lost(r: fenced_api::Result<()>, what: &str) -> String {
    match r {
        Err(Error::LeaseLost { reason, .. }) => reason,
        other => panic!("{what}: expected LeaseLost, got {other:?}"),
    }
}

/// Cases run with both strategies: a module per strategy, a test per case.
macro_rules! both_strategies {
    ($($case:ident),* $(,)?) => {
        mod lease {
            $(
                #[tokio::test]
                async fn $case() {
                    super::$case(fenced_postgres::Strategy::Lease).await
                }
            )*
        }
        mod advisory {
            $(
                #[tokio::test]
                async fn $case() {
                    super::$case(fenced_postgres::Strategy::Advisory).await
                }
            )*
        }
    };
}

both_strategies!(
    commit_makes_the_writes_and_the_release_visible_together,
    rollback_discards_the_writes_and_frees_the_key,
    dropping_without_commit_frees_the_key_promptly,
    plain_holders_and_transactions_exclude_each_other,
    tokens_rise_across_transaction_and_plain_grants,
    the_fence_check_runs_inside_the_transaction,
    an_aborted_transaction_commits_nothing,
    a_savepoint_rolls_back_only_its_part,
    the_same_owner_is_refused,
    a_force_released_hold_commits_nothing,
);

/// The business write and the release become visible together: while the
/// transaction is open the key is held (inspect shows the holder) and the
/// write invisible; a client waiting in `acquire` and one polling with
/// `try_acquire` both read the write as soon as they are granted.
async fn commit_makes_the_writes_and_the_release_visible_together(strategy: Strategy) {
    let f = Fixture::new(strategy, "txc").await;
    let k = key("commit");
    let mut tx = f.a.lock_in_transaction(&k, &ttl(LONG)).await.unwrap();
    let t = tx.token();
    assert_eq!(tx.key(), k);
    assert_eq!(tx.lease().token, t);
    f.write(&mut tx, 1).await;

    assert!(f.b.try_acquire(&k, &ttl(LONG)).await.unwrap().is_none());
    assert_eq!(f.committed(1).await, 0, "an uncommitted write is visible");
    let info = f.b.inspect(&k).await.unwrap().expect("the holder is shown");
    assert_eq!(info.token, t);
    assert_eq!(info.owner, tx.lease().owner);

    // A waiter, and a poller in a third client: whoever is granted first
    // reads the order at once; then the other.
    let waiter = {
        let (b, k, admin, orders) = (f.b.clone(), k.clone(), f.admin.clone(), f.orders.clone());
        tokio::spawn(async move {
            let lease = b.acquire(&k, &waiting(LONG, LONG)).await.unwrap();
            let at = Instant::now();
            let seen = count(&admin, &orders, 1).await;
            b.release(&lease).await.unwrap();
            (lease.token, seen, at)
        })
    };
    let poller = {
        let (c, k, admin, orders) = (
            f.client().await,
            k.clone(),
            f.admin.clone(),
            f.orders.clone(),
        );
        tokio::spawn(async move {
            loop {
                if let Some(lease) = c.try_acquire(&k, &ttl(LONG)).await.unwrap() {
                    let seen = count(&admin, &orders, 1).await;
                    c.release(&lease).await.unwrap();
                    return (lease.token, seen);
                }
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!waiter.is_finished() && !poller.is_finished());
    let committed_at = Instant::now();
    tx.commit().await.unwrap();
    let (wt, wseen, granted_at) = waiter.await.unwrap();
    let (pt, pseen) = poller.await.unwrap();
    assert_eq!(
        wseen, 1,
        "the waiter was granted before the write was visible"
    );
    assert_eq!(
        pseen, 1,
        "the poller was granted before the write was visible"
    );
    assert!(wt > t && pt > t && wt != pt);
    let hand_off = granted_at.saturating_duration_since(committed_at);
    eprintln!("{strategy}: commit to the waiter's grant: {hand_off:?}");
    assert!(hand_off < Duration::from_secs(2), "{hand_off:?}");
    f.finish().await;
}

async fn rollback_discards_the_writes_and_frees_the_key(strategy: Strategy) {
    let f = Fixture::new(strategy, "txr").await;
    let k = key("rollback");
    let mut tx = f.a.lock_in_transaction(&k, &ttl(LONG)).await.unwrap();
    let t = tx.token();
    f.write(&mut tx, 2).await;
    tx.rollback().await.unwrap();
    assert_eq!(f.committed(2).await, 0);
    assert!(f.b.inspect(&k).await.unwrap().is_none());
    let next = f.b.try_acquire(&k, &ttl(LONG)).await.unwrap();
    assert!(next.expect("free right after the rollback").token > t);
    f.finish().await;
}

/// Dropped without commit or rollback (TTL 30 s): the writes are gone and
/// a client already waiting gets the key within moments, not after the
/// TTL.
async fn dropping_without_commit_frees_the_key_promptly(strategy: Strategy) {
    let f = Fixture::new(strategy, "txd").await;
    let k = key("drop");
    let mut tx = f.a.lock_in_transaction(&k, &ttl(LONG)).await.unwrap();
    f.write(&mut tx, 3).await;
    let waiter = {
        let (b, k) = (f.b.clone(), k.clone());
        tokio::spawn(async move {
            let lease = b
                .acquire(&k, &waiting(LONG, Duration::from_secs(10)))
                .await
                .unwrap();
            (lease, Instant::now())
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!waiter.is_finished());
    let dropped_at = Instant::now();
    drop(tx);
    let (lease, granted_at) = waiter.await.unwrap();
    let freed = granted_at - dropped_at;
    eprintln!("{strategy}: dropped transaction to the waiter's grant: {freed:?}");
    assert!(freed < Duration::from_secs(2), "{freed:?}");
    assert_eq!(f.committed(3).await, 0);
    f.b.release(&lease).await.unwrap();
    f.finish().await;
}

/// A transaction-scoped hold excludes plain holders and vice versa, with
/// every wait policy; a transaction waiting for a plain holder gets the
/// key when it is released.
async fn plain_holders_and_transactions_exclude_each_other(strategy: Strategy) {
    let f = Fixture::new(strategy, "txx").await;
    let k = key("exclude");
    let short_wait = waiting(LONG, Duration::from_millis(300));

    let tx = f.a.lock_in_transaction(&k, &ttl(LONG)).await.unwrap();
    assert!(f.b.try_acquire(&k, &ttl(LONG)).await.unwrap().is_none());
    let start = Instant::now();
    assert!(matches!(
        f.b.acquire(&k, &short_wait).await,
        Err(Error::Timeout { .. })
    ));
    assert!(start.elapsed() >= Duration::from_millis(300));
    // Another transaction too.
    assert!(matches!(
        f.b.lock_in_transaction(&k, &no_wait(LONG)).await,
        Err(Error::Timeout { .. })
    ));
    let t = tx.token();
    tx.commit().await.unwrap();

    let plain = f.b.try_acquire(&k, &ttl(LONG)).await.unwrap().unwrap();
    assert!(plain.token > t);
    let start = Instant::now();
    assert!(matches!(
        f.a.lock_in_transaction(&k, &no_wait(LONG)).await,
        Err(Error::Timeout { .. })
    ));
    assert!(start.elapsed() < Duration::from_secs(1));
    let start = Instant::now();
    assert!(matches!(
        f.a.lock_in_transaction(&k, &short_wait).await,
        Err(Error::Timeout { .. })
    ));
    let waited = start.elapsed();
    assert!(
        waited >= Duration::from_millis(300) && waited < Duration::from_secs(3),
        "{waited:?}"
    );

    let waiter = {
        let (a, k) = (f.a.clone(), k.clone());
        tokio::spawn(async move {
            a.lock_in_transaction(&k, &waiting(LONG, Duration::from_secs(10)))
                .await
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !waiter.is_finished(),
        "granted while the plain holder held the key"
    );
    f.b.release(&plain).await.unwrap();
    let tx = waiter.await.unwrap().unwrap();
    assert!(tx.token() > plain.token);
    assert!(f.b.try_acquire(&k, &ttl(LONG)).await.unwrap().is_none());
    tx.commit().await.unwrap();
    f.finish().await;
}

/// One sequence for every grant of the table: tokens of transaction-scoped
/// holds (committed, rolled back, dropped) and plain ones only increase.
async fn tokens_rise_across_transaction_and_plain_grants(strategy: Strategy) {
    let f = Fixture::new(strategy, "txt").await;
    let k = key("tokens");
    let mut tokens = Vec::new();
    for round in 0..3 {
        let plain = f.b.acquire(&k, &waiting(LONG, LONG)).await.unwrap();
        tokens.push(plain.token);
        f.b.release(&plain).await.unwrap();
        let tx = f.a.lock_in_transaction(&k, &ttl(LONG)).await.unwrap();
        tokens.push(tx.token());
        match round {
            0 => tx.commit().await.unwrap(),
            1 => tx.rollback().await.unwrap(),
            _ => drop(tx),
        }
    }
    let last = f.b.acquire(&k, &waiting(LONG, LONG)).await.unwrap();
    tokens.push(last.token);
    assert!(
        tokens.windows(2).all(|w| w[0] < w[1]),
        "tokens did not rise: {tokens:?}"
    );
    f.finish().await;
}

/// `Fence::check` on the transaction's connection: accepted for the
/// current token, stale for an older one — and the fence's row commits
/// with the write.
async fn the_fence_check_runs_inside_the_transaction(strategy: Strategy) {
    let f = Fixture::new(strategy, "txf").await;
    let fence = Fence::new(&format!("{}_fences", f.table)).unwrap();
    fence.create_table(&f.admin).await.unwrap();
    let k = key("fence");
    let resource = k.as_str();

    let mut checked = Vec::new();
    for id in [4, 5] {
        let mut tx = f.a.lock_in_transaction(&k, &ttl(LONG)).await.unwrap();
        let t = tx.token();
        assert_eq!(
            fence.check(&mut tx, resource, t).await.unwrap(),
            FenceOutcome::Accepted
        );
        f.write(&mut tx, id).await;
        tx.commit().await.unwrap();
        checked.push(t);
    }
    let latest = checked[1];
    assert_eq!(
        fence.highest(&f.admin, resource).await.unwrap(),
        Some(latest)
    );

    // A holder that kept an older token is refused by the fence.
    let mut tx = f.a.lock_in_transaction(&k, &ttl(LONG)).await.unwrap();
    assert_eq!(
        fence.check(&mut tx, resource, checked[0]).await.unwrap(),
        FenceOutcome::Stale { highest: latest }
    );
    tx.rollback().await.unwrap();
    f.finish().await;
}

/// An error in the caller's statement aborts the transaction; `commit`
/// then reports an error — never success — and the key is freed.
async fn an_aborted_transaction_commits_nothing(strategy: Strategy) {
    let f = Fixture::new(strategy, "txa").await;
    let k = key("aborted");
    let mut tx = f.a.lock_in_transaction(&k, &ttl(LONG)).await.unwrap();
    f.write(&mut tx, 5).await;
    assert!(sqlx::query("SELECT 1 / 0").execute(&mut *tx).await.is_err());
    match tx.commit().await {
        Err(Error::Backend { retryable, .. }) => assert!(!retryable),
        other => panic!("commit of an aborted transaction: {other:?}"),
    }
    assert_eq!(f.committed(5).await, 0);
    assert!(f.b.try_acquire(&k, &ttl(LONG)).await.unwrap().is_some());
    f.finish().await;
}

/// The transaction is sqlx's: `begin()` on it is a savepoint.
async fn a_savepoint_rolls_back_only_its_part(strategy: Strategy) {
    let f = Fixture::new(strategy, "txs").await;
    let k = key("savepoint");
    let mut tx = f.a.lock_in_transaction(&k, &ttl(LONG)).await.unwrap();
    {
        let mut inner = tx.begin().await.unwrap();
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "INSERT INTO \"{}\" (id, token) VALUES (6, 0)",
            f.orders
        )))
        .execute(&mut *inner)
        .await
        .unwrap();
        inner.rollback().await.unwrap();
    }
    f.write(&mut tx, 7).await;
    tx.commit().await.unwrap();
    assert_eq!(f.committed(6).await, 0);
    assert_eq!(f.committed(7).await, 1);
    f.finish().await;
}

/// An owner already holding the key is refused at once, re-entrant
/// options or not (a transaction-scoped hold is never a re-entry).
async fn the_same_owner_is_refused(strategy: Strategy) {
    let f = Fixture::new(strategy, "txo").await;
    let k = key("owner");
    let mine = |reentrant: bool| {
        LockOptions::builder()
            .ttl(LONG)
            .owner("me")
            .reentrant(reentrant)
            .wait_timeout(Duration::from_secs(5))
            .build()
            .unwrap()
    };
    let held = f.a.try_acquire(&k, &mine(false)).await.unwrap().unwrap();
    for reentrant in [false, true] {
        let start = Instant::now();
        match f.a.lock_in_transaction(&k, &mine(reentrant)).await {
            Err(Error::AlreadyHeld { .. }) => {}
            other => panic!("reentrant {reentrant}: {other:?}"),
        }
        assert!(start.elapsed() < Duration::from_secs(2));
    }
    assert_eq!(f.a.inspect(&k).await.unwrap().unwrap().hold_count, 1);
    f.a.release(&held).await.unwrap();
    f.finish().await;
}

/// Another client force-releases the key mid-transaction (lease: the row
/// expired; advisory: the holding session terminated) and takes it: the
/// commit fails with `LeaseLost` and nothing is committed; the new
/// holder keeps the key.
async fn a_force_released_hold_commits_nothing(strategy: Strategy) {
    let f = Fixture::new(strategy, "txk").await;
    let k = key("forced");
    let mut tx = f.a.lock_in_transaction(&k, &ttl(LONG)).await.unwrap();
    f.write(&mut tx, 8).await;
    assert!(f.b.force_release(&k).await.unwrap());
    let taker = f.b.try_acquire(&k, &ttl(LONG)).await.unwrap().unwrap();
    assert!(taker.token > tx.token());
    let reason = expect_lost(tx.commit().await, "commit after a force-release");
    eprintln!("{strategy}: {reason}");
    assert_eq!(f.committed(8).await, 0);
    let info = f.a.inspect(&k).await.unwrap().unwrap();
    assert_eq!(info.token, taker.token);
    f.b.release(&taker).await.unwrap();
    f.finish().await;
}

// ---- lease ----

/// The lease is renewed while the transaction is open: with a 600 ms TTL,
/// held for 1.8 s without a gap, and the commit succeeds.
#[tokio::test]
async fn lease_is_renewed_while_the_transaction_is_open() {
    let f = Fixture::new(Strategy::Lease, "txn").await;
    let k = key("renewed");
    let short = Duration::from_millis(600);
    let mut tx = f.a.lock_in_transaction(&k, &ttl(short)).await.unwrap();
    let start = Instant::now();
    while start.elapsed() < Duration::from_millis(1800) {
        assert!(
            f.b.try_acquire(&k, &ttl(LONG)).await.unwrap().is_none(),
            "taken {:?} into a transaction with a 600 ms ttl",
            start.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        tx.lease().deadline > Instant::now(),
        "the lease was not renewed"
    );
    f.write(&mut tx, 9).await;
    tx.commit().await.unwrap();
    assert_eq!(f.committed(9).await, 1);
    assert!(f.b.try_acquire(&k, &ttl(LONG)).await.unwrap().is_some());
    f.finish().await;
}

/// The lease row expired on the server mid-transaction (set in the past
/// here, as when renewals stop): the commit fails with `LeaseLost` and the
/// write is not committed.
#[tokio::test]
async fn lease_that_expired_mid_transaction_commits_nothing() {
    let f = Fixture::new(Strategy::Lease, "txe").await;
    let k = key("expired");
    let mut tx = f.a.lock_in_transaction(&k, &ttl(LONG)).await.unwrap();
    f.write(&mut tx, 10).await;
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "UPDATE \"{}\" SET expire_at = clock_timestamp() - interval '1 second' WHERE lock_key = $1",
        f.table
    )))
    .bind(k.as_bytes())
    .execute(&f.admin)
    .await
    .unwrap();
    assert!(f.b.inspect(&k).await.unwrap().is_none());
    expect_lost(tx.commit().await, "commit after the lease expired");
    assert_eq!(f.committed(10).await, 0);
    assert!(f.b.try_acquire(&k, &ttl(LONG)).await.unwrap().is_some());
    f.finish().await;
}

/// The same with renewals failing for real: a 300 ms lease whose handle
/// is closed (its renewals fail) runs out, another client takes the key,
/// and the commit fails.
#[tokio::test]
async fn lease_that_ran_out_while_renewals_failed_commits_nothing() {
    let f = Fixture::new(Strategy::Lease, "txq").await;
    let k = key("ran-out");
    let holder = f.client().await;
    let mut tx = holder
        .lock_in_transaction(&k, &ttl(Duration::from_millis(300)))
        .await
        .unwrap();
    f.write(&mut tx, 11).await;
    // Closing the handle closes its statement pool: renewals fail, the
    // transaction's own connection stays.
    holder.close().await;
    let taker =
        f.b.acquire(&k, &waiting(LONG, Duration::from_secs(5)))
            .await
            .unwrap();
    expect_lost(tx.commit().await, "commit after the lease ran out");
    assert_eq!(f.committed(11).await, 0);
    assert_eq!(f.b.inspect(&k).await.unwrap().unwrap().token, taker.token);
    f.finish().await;
}

/// Under REPEATABLE READ the commit's release updates a row that renewals
/// updated after the transaction's snapshot: PostgreSQL refuses it with a
/// serialization failure (retryable), nothing is committed and the key is
/// freed. A transaction that ends before the first renewal commits.
#[tokio::test]
async fn lease_under_repeatable_read_fails_after_a_renewal() {
    let f = Fixture::new(Strategy::Lease, "txi").await;
    let k = key("rr");
    let rr = "SET TRANSACTION ISOLATION LEVEL REPEATABLE READ";

    let mut tx = f.a.lock_in_transaction(&k, &ttl(LONG)).await.unwrap();
    sqlx::raw_sql(rr).execute(&mut *tx).await.unwrap();
    f.write(&mut tx, 12).await;
    tx.commit().await.unwrap();
    assert_eq!(f.committed(12).await, 1);

    // Renewed, and the row as the snapshot sees it expired: the lease is
    // found current on the server, and the error says why the commit
    // cannot be made. (2 s: renewals every 667 ms keep it current on a
    // loaded machine; with 600 ms one late renewal lost the lease itself.)
    let mut tx =
        f.a.lock_in_transaction(&k, &ttl(Duration::from_secs(2)))
            .await
            .unwrap();
    sqlx::raw_sql(rr).execute(&mut *tx).await.unwrap();
    f.write(&mut tx, 13).await;
    let granted = tx.lease().deadline;
    wait_until(|| tx.lease().deadline > granted && Instant::now() > granted).await;
    match tx.commit().await {
        Err(e @ Error::Backend { .. }) => {
            assert!(e.is_retryable(), "{e}");
            let text = e.to_string();
            assert!(text.contains("snapshot"), "{text}");
            eprintln!("lease under repeatable read: {text}");
        }
        other => panic!("commit under REPEATABLE READ after a renewal: {other:?}"),
    }
    assert_eq!(f.committed(13).await, 0);

    // Renewed, and the snapshot's row not yet expired: the server's own
    // serialization failure.
    let mut tx =
        f.a.lock_in_transaction(&k, &ttl(Duration::from_secs(3)))
            .await
            .unwrap();
    sqlx::raw_sql(rr).execute(&mut *tx).await.unwrap();
    f.write(&mut tx, 14).await;
    let granted = tx.lease().deadline;
    wait_until(|| tx.lease().deadline > granted).await;
    match tx.commit().await {
        Err(e @ Error::Backend { .. }) => {
            assert!(e.is_retryable(), "{e}");
            eprintln!("lease under repeatable read: {e}");
        }
        other => panic!("commit under REPEATABLE READ after a renewal: {other:?}"),
    }
    assert_eq!(f.committed(14).await, 0);
    assert!(f.b.try_acquire(&k, &ttl(LONG)).await.unwrap().is_some());
    f.finish().await;
}

// ---- advisory ----

/// A transaction silent for longer than the TTL loses its session, and the
/// lock with it: a waiting client gets the key about a TTL later, and the
/// commit fails with `LeaseLost`, committing nothing.
#[tokio::test]
async fn advisory_transaction_silent_past_its_ttl_loses_the_lock() {
    let f = Fixture::new(Strategy::Advisory, "txl").await;
    let k = key("silent");
    let ttl_ = Duration::from_millis(500);
    let mut tx = f.a.lock_in_transaction(&k, &ttl(ttl_)).await.unwrap();
    f.write(&mut tx, 14).await;
    let silent_from = Instant::now();
    let taker =
        f.b.acquire(&k, &waiting(LONG, Duration::from_secs(10)))
            .await
            .unwrap();
    let after = silent_from.elapsed();
    eprintln!("advisory: an idle transaction with ttl {ttl_:?} lost the key after {after:?}");
    assert!(after >= ttl_ && after < ttl_ * 4, "{after:?}");
    let reason = expect_lost(tx.commit().await, "commit after the session ended");
    eprintln!("advisory: {reason}");
    assert_eq!(f.committed(14).await, 0);
    assert!(taker.token.get() > 0);
    f.finish().await;
}

/// A transaction that keeps talking keeps the lock well past its TTL
/// (the server's idle timer restarts with every statement) — at any
/// isolation level: nothing it commits was changed after its snapshot.
#[tokio::test]
async fn advisory_busy_transaction_keeps_the_lock_past_its_ttl() {
    let f = Fixture::new(Strategy::Advisory, "txb").await;
    let k = key("busy");
    let mut tx =
        f.a.lock_in_transaction(&k, &ttl(Duration::from_millis(500)))
            .await
            .unwrap();
    sqlx::raw_sql("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        .execute(&mut *tx)
        .await
        .unwrap();
    for _ in 0..10 {
        sqlx::query("SELECT 1").execute(&mut *tx).await.unwrap();
        tokio::time::sleep(Duration::from_millis(150)).await;
    }
    assert!(f.b.try_acquire(&k, &ttl(LONG)).await.unwrap().is_none());
    f.write(&mut tx, 15).await;
    tx.commit().await.unwrap();
    assert_eq!(f.committed(15).await, 1);
    f.finish().await;
}

/// What `inspect` shows of an advisory transaction: the holder, by the
/// session that holds the lock; nothing once it committed.
#[tokio::test]
async fn advisory_inspect_shows_the_transaction_while_open() {
    let f = Fixture::new(Strategy::Advisory, "txv").await;
    let k = key("inspect");
    let opts = LockOptions::builder()
        .ttl(LONG)
        .label("tx label")
        .build()
        .unwrap();
    let tx = f.a.lock_in_transaction(&k, &opts).await.unwrap();
    let info = f.b.inspect(&k).await.unwrap().unwrap();
    assert_eq!(info.token, tx.token());
    assert_eq!(info.label.as_ref().map(|l| l.as_str()), Some("tx label"));
    let listed = f.b.list(10).await.unwrap();
    assert_eq!(listed.len(), 1, "{listed:?}");
    tx.commit().await.unwrap();
    assert!(f.b.inspect(&k).await.unwrap().is_none());
    assert!(f.b.list(10).await.unwrap().is_empty());
    f.finish().await;
}

// ---- cost ----

/// What a transaction-scoped hold costs uncontended, next to a plain
/// acquire and release (printed; bounded loosely): the transaction's own
/// connection is opened and closed each time.
#[tokio::test]
async fn an_uncontended_transaction_costs_a_few_round_trips_and_a_connect() {
    for strategy in [Strategy::Lease, Strategy::Advisory] {
        let f = Fixture::new(strategy, "txm").await;
        let k = key("cost");
        let rounds = 20u32;
        // Warm: the handle's pools and lock connections are open.
        let l = f.a.acquire(&k, &ttl(LONG)).await.unwrap();
        f.a.release(&l).await.unwrap();
        let start = Instant::now();
        for _ in 0..rounds {
            let l = f.a.acquire(&k, &ttl(LONG)).await.unwrap();
            f.a.release(&l).await.unwrap();
        }
        let plain = start.elapsed() / rounds;
        let (mut locked, mut committed) = (Duration::ZERO, Duration::ZERO);
        for _ in 0..rounds {
            let start = Instant::now();
            let tx = f.a.lock_in_transaction(&k, &ttl(LONG)).await.unwrap();
            let got = start.elapsed();
            tx.commit().await.unwrap();
            locked += got;
            committed += start.elapsed() - got;
        }
        let (locked, committed) = (locked / rounds, committed / rounds);
        eprintln!(
            "{strategy}: plain acquire+release {plain:?}; lock_in_transaction {locked:?}, \
             commit {committed:?}"
        );
        assert!(locked + committed < Duration::from_millis(500));
        f.finish().await;
    }
}

/// Transactions recording one new key at the same moment: `ON CONFLICT`
/// arbitrates on the key only, so a racing insert can fail on the `hash`
/// index; that is the same key, not a collision. To make the inserts meet,
/// an open transaction of the test inserts the key's row first: every
/// registration waits for it, and its rollback lets them all go at once.
/// Exactly one transaction gets the key each round, the others are refused
/// (`NoWait`), and none reports a collision.
#[tokio::test]
async fn advisory_concurrent_first_registrations_are_not_a_collision() {
    const CONTENDERS: usize = 8;
    let f = Fixture::new(Strategy::Advisory, "txr").await;
    let table = fenced_postgres::TableName::new(&f.table).unwrap();
    let mut blocker = sqlx::PgConnection::connect(&server_url().await)
        .await
        .unwrap();
    let blocker_pid: i32 = sqlx::query("SELECT pg_backend_pid()")
        .fetch_one(&mut blocker)
        .await
        .unwrap()
        .get(0);
    for round in 0..10 {
        let k = key(&format!("race{round}"));
        let mut open = blocker.begin().await.unwrap();
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "INSERT INTO \"{}_advisory\" (lock_key, hash) VALUES ($1, $2)",
            f.table
        )))
        .bind(k.as_bytes())
        .bind(fenced_postgres::advisory_key(&table, &k))
        .execute(&mut *open)
        .await
        .unwrap();
        let tries: Vec<_> = (0..CONTENDERS)
            .map(|_| {
                let (h, k) = (f.a.clone(), k.clone());
                tokio::spawn(async move { h.lock_in_transaction(&k, &no_wait(LONG)).await })
            })
            .collect();
        let start = Instant::now();
        loop {
            let blocked: i64 = sqlx::query(
                "SELECT count(*) FROM pg_stat_activity WHERE $1 = ANY(pg_blocking_pids(pid))",
            )
            .bind(blocker_pid)
            .fetch_one(&f.admin)
            .await
            .unwrap()
            .get(0);
            if blocked as usize == CONTENDERS {
                break;
            }
            assert!(
                start.elapsed() < Duration::from_secs(5),
                "round {round}: {blocked} registrations waiting"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        open.rollback().await.unwrap();
        let mut granted = Vec::new();
        for t in tries {
            match t.await.unwrap() {
                Ok(tx) => granted.push(tx),
                Err(Error::Timeout { .. }) => {}
                Err(e) => panic!("round {round}: {e}"),
            }
        }
        assert_eq!(granted.len(), 1, "round {round}");
        for tx in granted {
            tx.rollback().await.unwrap();
        }
    }
    blocker.close().await.unwrap();
    f.finish().await;
}
