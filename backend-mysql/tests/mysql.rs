//! MySQL/MariaDB-specific behaviour beyond the shared suite: takeover,
//! reaper, killed holders, restarts, the transaction-scoped API, injection,
//! read-only servers, row modes. Destructive cases use a private MariaDB.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;
mod schema_v2;

use std::{sync::Arc, time::Duration};

use common::{private::PrivateMariaDb, run_table, server_url, url_for, MySqlHarness};
use fenced_api::{DistributedLock, Error, Lease, LockKey, LockOptions, ReleaseOutcome};
use fenced_mysql::{MySqlLock, RowLockTransaction, RowMode, Strategy};
use schema_v2::install_with_holder;
use sqlx::Row;

fn key(tag: &str) -> LockKey {
    LockKey::new(format!("{tag}/{}", uuid::Uuid::new_v4().simple())).unwrap()
}

fn ttl(d: Duration) -> LockOptions {
    LockOptions::builder().ttl(d).build().unwrap()
}

/// Waits up to 5 s for a 30 s lease.
fn wait() -> LockOptions {
    LockOptions::builder()
        .ttl(Duration::from_secs(30))
        .wait_timeout(Duration::from_secs(5))
        .build()
        .unwrap()
}

async fn pool() -> sqlx::MySqlPool {
    sqlx::MySqlPool::connect(&server_url().await).await.unwrap()
}

/// Runs `sql` as a prepared statement.
async fn exec(p: &sqlx::MySqlPool, sql: String) {
    sqlx::query(sqlx::AssertSqlSafe(sql))
        .execute(p)
        .await
        .unwrap();
}

/// Runs `sql` as plain text (for statements that cannot be prepared).
async fn exec_raw(p: &sqlx::MySqlPool, sql: String) {
    sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
        .execute(p)
        .await
        .unwrap();
}

/// The one integer `sql` selects with `arg` bound.
async fn scalar<'t, T>(p: &sqlx::MySqlPool, sql: &str, arg: T) -> i64
where
    T: sqlx::Encode<'t, sqlx::MySql> + sqlx::Type<sqlx::MySql>,
{
    sqlx::query(sqlx::AssertSqlSafe(sql.to_owned()))
        .bind(arg)
        .fetch_one(p)
        .await
        .unwrap()
        .get(0)
}

/// `lock` takes `k` for `d`; it must be free.
async fn take(lock: &MySqlLock, k: &LockKey, d: Duration) -> Lease {
    lock.try_acquire(k, &ttl(d)).await.unwrap().unwrap()
}

/// `lock` takes `k` and releases it again: it must be free (`why` says
/// why). Returns the lease it had.
async fn take_and_release(lock: &MySqlLock, k: &LockKey, opts: &LockOptions, why: &str) -> Lease {
    let lease = lock.try_acquire(k, opts).await.unwrap().expect(why);
    lock.release(&lease).await.unwrap();
    lease
}

/// `next`, granted after `prev`, carries a higher token.
fn assert_rises(next: &Lease, prev: &Lease, when: &str) {
    assert!(
        next.token > prev.token,
        "{} ≤ {}{when}",
        next.token,
        prev.token
    );
}

/// A `unique_key` store on the shared server in this run's table with
/// `_<suffix>` appended.
async fn unique_key_url(suffix: &str) -> String {
    let table = format!("{}_{suffix}", run_table());
    url_for(&server_url().await, Strategy::UniqueKey, &table)
}

/// Two stores with `strategy` on the shared server, in this run's table.
async fn two_locks(strategy: Strategy) -> (MySqlLock, MySqlLock) {
    let h = MySqlHarness::new(strategy).await;
    (h.lock().await, h.lock().await)
}

/// Takes `n` keys `<prefix>/<i>` that expire after 10 ms.
async fn take_expiring(lock: &MySqlLock, prefix: &str, n: usize) {
    for i in 0..n {
        let k = LockKey::new(format!("{prefix}/{i}")).unwrap();
        take(lock, &k, Duration::from_millis(10)).await;
    }
}

/// Writes order `id` in `state` inside `tx` with `insert`, fenced with the
/// token of `tx`.
async fn write_order(tx: &mut RowLockTransaction, insert: &str, id: i32, state: &str) {
    let token = tx.token().get();
    sqlx::query(sqlx::AssertSqlSafe(insert.to_owned()))
        .bind(id)
        .bind(state)
        .bind(token)
        .execute(tx.connection().unwrap())
        .await
        .unwrap();
}

/// A `row_lock` store on `url` whose keys map to rows as `mode` says.
async fn with_rows(url: &str, mode: RowMode) -> MySqlLock {
    MySqlLock::builder(url)
        .unwrap()
        .row_mode(mode)
        .connect()
        .await
        .unwrap()
}

#[tokio::test]
async fn unique_key_takes_over_an_expired_row_inline() {
    let (a, b) = two_locks(Strategy::UniqueKey).await;
    let k = key("takeover");
    let crashed = take(&a, &k, Duration::from_millis(200)).await;
    tokio::time::sleep(Duration::from_millis(400)).await;
    // No reaper runs: the acquire itself removes the expired row.
    let next = take(&b, &k, Duration::from_secs(10)).await;
    assert!(next.token > crashed.token);
    let count = format!("SELECT COUNT(*) FROM `{}` WHERE lock_key = ?", run_table());
    let rows = scalar(&pool().await, &count, k.as_bytes()).await;
    assert_eq!(rows, 1, "exactly the new holder's row");
    assert_eq!(a.release(&crashed).await.unwrap(), ReleaseOutcome::NotHeld);
    assert!(
        b.inspect(&k).await.unwrap().is_some(),
        "the stale release left the new row alone"
    );
}

#[tokio::test]
async fn reaper_removes_expired_rows_and_only_one_node_reaps() {
    // A table of its own, so other tests' rows do not disturb the counts.
    let server = server_url().await;
    let table = format!("{}_reap", run_table());
    let url = url_for(&server, Strategy::UniqueKey, &table);
    MySqlLock::migrate(&url).await.unwrap();
    let lock = MySqlLock::connect(&url).await.unwrap();
    take_expiring(&lock, "reap", 30).await;
    let live = take(&lock, &key("live"), Duration::from_secs(60)).await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    let stats = lock.table_stats().await.unwrap();
    assert_eq!((stats.rows, stats.expired), (31, 30));

    // Another node is reaping: this pass stands aside.
    let other = MySqlLock::connect(&url).await.unwrap();
    let reaper_key = LockKey::new("fenced:reaper").unwrap();
    let busy = take(&other, &reaper_key, Duration::from_secs(60)).await;
    assert_eq!(lock.reap_expired().await.unwrap(), None);
    other.release(&busy).await.unwrap();

    assert_eq!(lock.reap_expired().await.unwrap(), Some(30));
    let stats = lock.table_stats().await.unwrap();
    assert_eq!(
        (stats.rows, stats.expired),
        (1, 0),
        "only the live lock is left"
    );
    assert!(lock.inspect(&live.key).await.unwrap().is_some());

    // Two reapers at once: at most one does the work.
    take_expiring(&lock, "reap2", 10).await;
    tokio::time::sleep(Duration::from_millis(50)).await;
    let (r1, r2) = tokio::join!(lock.reap_expired(), other.reap_expired());
    let (r1, r2) = (r1.unwrap(), r2.unwrap());
    assert_eq!(r1.unwrap_or(0) + r2.unwrap_or(0), 10, "{r1:?} {r2:?}");

    // The background reaper does the same on a schedule.
    take_expiring(&lock, "reap3", 5).await;
    let handle = lock.spawn_reaper(Duration::from_millis(50)).unwrap();
    let start = tokio::time::Instant::now();
    while lock.table_stats().await.unwrap().expired > 0 {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "the background reaper never ran"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    handle.stop();
    assert_eq!(
        lock.purge_stale(Duration::from_secs(3600)).await.unwrap(),
        0
    );
    exec(&pool().await, format!("DROP TABLE `{table}`, `{table}_optimistic`, `{table}_rows`, `{table}_fence`, `{table}_live`, `{table}_migrations`")).await;
}

/// Other strategies have no rows to delete (an `optimistic` row's version
/// is its token, a `row_lock` row is what gets locked): reaping and purging
/// are refused, while the background reaper runs and only measures.
#[tokio::test]
async fn reaper_is_refused_for_other_strategies() {
    for strategy in [Strategy::Optimistic, Strategy::RowLock] {
        let h = MySqlHarness::new(strategy).await;
        let lock = h.lock().await;
        assert!(matches!(
            lock.reap_expired().await,
            Err(Error::Unsupported { .. })
        ));
        assert!(matches!(
            lock.purge_stale(Duration::from_secs(1)).await,
            Err(Error::Unsupported { .. })
        ));
        lock.spawn_reaper(Duration::from_secs(1)).unwrap().stop();
        assert!(lock.spawn_reaper(Duration::from_millis(1)).is_err());
    }
}

#[tokio::test]
async fn row_lock_holder_killed_server_side_loses_the_lock_and_tokens_still_increase() {
    let (a, b) = two_locks(Strategy::RowLock).await;
    let k = key("kill");
    let held = take(&a, &k, Duration::from_secs(30)).await;
    let p = pool().await;
    let conn_id: u64 = sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT conn_id FROM `{}_live` WHERE lock_key = ?",
        run_table()
    )))
    .bind(k.as_bytes())
    .fetch_one(&p)
    .await
    .unwrap()
    .get(0);
    exec_raw(&p, format!("KILL CONNECTION {conn_id}")).await;
    // The server rolled the holder back: the key is free at once, long before the TTL.
    let next = b.acquire(&k, &wait()).await.unwrap();
    assert_rises(&next, &held, "");
    assert!(matches!(
        a.extend(&held, Duration::from_secs(30)).await,
        Err(Error::LeaseLost { .. })
    ));
    assert_eq!(a.release(&held).await.unwrap(), ReleaseOutcome::NotHeld);
    assert_eq!(b.release(&next).await.unwrap(), ReleaseOutcome::Released);
}

#[tokio::test]
async fn row_lock_transaction_commits_writes_with_the_release_or_rolls_both_back() {
    let h = MySqlHarness::new(Strategy::RowLock).await;
    let lock = h.lock().await;
    let other = h.lock().await;
    let p = pool().await;
    let business = format!("{}_orders", run_table());
    exec(&p, format!(
        "CREATE TABLE IF NOT EXISTS `{business}` (id INT PRIMARY KEY, state VARCHAR(20), fence BIGINT UNSIGNED)"
    ))
    .await;
    let insert = format!("INSERT INTO `{business}` (id, state, fence) VALUES (?, ?, ?)");
    let count = format!("SELECT COUNT(*) FROM `{business}` WHERE id = ?");
    let opts = ttl(Duration::from_secs(30));
    let k = key("tx");

    // Commit: the write and the release become visible together.
    let mut tx = lock.lock_in_transaction(&k, &opts).await.unwrap();
    write_order(&mut tx, &insert, 1, "shipped").await;
    assert!(
        other.try_acquire(&k, &opts).await.unwrap().is_none(),
        "held during the transaction"
    );
    assert_eq!(scalar(&p, &count, 1).await, 0, "uncommitted write visible");
    tx.commit().await.unwrap();
    assert_eq!(scalar(&p, &count, 1).await, 1);
    let after = take_and_release(&other, &k, &opts, "released by the commit").await;

    // Rollback: neither the write nor the lock survive.
    let mut tx = lock.lock_in_transaction(&k, &opts).await.unwrap();
    assert!(tx.token() > after.token);
    write_order(&mut tx, &insert, 2, "cancelled").await;
    tx.rollback().await.unwrap();
    assert_eq!(scalar(&p, &count, 2).await, 0);
    take_and_release(&other, &k, &opts, "released by the rollback").await;

    // Dropped without commit: rolled back and released (the connection is closed).
    let mut tx = lock.lock_in_transaction(&k, &opts).await.unwrap();
    write_order(&mut tx, &insert, 3, "lost").await;
    drop(tx);
    let last = other.acquire(&k, &wait()).await.unwrap();
    assert_eq!(scalar(&p, &count, 3).await, 0);
    other.release(&last).await.unwrap();
    exec(&p, format!("DROP TABLE `{business}`")).await;

    // Other strategies say plainly that they cannot do this.
    let uk = MySqlHarness::new(Strategy::UniqueKey).await.lock().await;
    assert!(matches!(
        uk.lock_in_transaction(&k, &opts).await,
        Err(Error::Unsupported { .. })
    ));
}

#[tokio::test]
async fn injection_attempts_are_harmless() {
    let server = server_url().await;
    // Table names are validated before anything is sent.
    for bad in ["locks;DROP TABLE x", "locks`", "a b", "x--", "db.tbl"] {
        let url = format!("{server}?table={}", bad.replace(' ', "%20"));
        match MySqlLock::connect(&url).await {
            Err(Error::Config { .. }) => {}
            other => panic!("table {bad:?}: expected a config error, got {other:?}"),
        }
    }
    // Keys are bound parameters: SQL in a key is just bytes.
    let p = pool().await;
    let canary = format!("{}_canary", run_table());
    exec(
        &p,
        format!("CREATE TABLE IF NOT EXISTS `{canary}` (id INT)"),
    )
    .await;
    for strategy in [Strategy::UniqueKey, Strategy::RowLock, Strategy::Optimistic] {
        let lock = MySqlHarness::new(strategy).await.lock().await;
        for evil in [
            format!("'; DROP TABLE `{canary}`; --"),
            format!("\"); DROP TABLE {canary}; --"),
            "%' OR '1'='1".to_string(),
            r"\'; SELECT SLEEP(5); --".to_string(),
        ] {
            let k = LockKey::new(format!("{}{evil}", uuid::Uuid::new_v4().simple())).unwrap();
            let lease = take(&lock, &k, Duration::from_secs(10)).await;
            assert_eq!(lock.inspect(&k).await.unwrap().unwrap().key, k);
            lock.release(&lease).await.unwrap();
        }
    }
    let exists = scalar(&p, "SELECT COUNT(*) FROM information_schema.tables WHERE table_schema = DATABASE() AND table_name = ?", &canary).await;
    assert_eq!(exists, 1, "the canary table was dropped");
    exec(&p, format!("DROP TABLE `{canary}`")).await;
}

#[tokio::test]
async fn a_missing_schema_names_migrate() {
    let server = server_url().await;
    let url = url_for(
        &server,
        Strategy::UniqueKey,
        &format!("nope_{}", &uuid::Uuid::new_v4().simple().to_string()[..8]),
    );
    match MySqlLock::connect(&url).await {
        Err(Error::Config { reason }) => assert!(reason.contains("migrate"), "{reason}"),
        other => panic!("expected a config error naming migrate, got {other:?}"),
    }
}

#[tokio::test]
async fn migrate_is_idempotent() {
    let url = unique_key_url("mig").await;
    let first = MySqlLock::migrate(&url).await.unwrap();
    let (a, b) = tokio::join!(MySqlLock::migrate(&url), MySqlLock::migrate(&url));
    assert_eq!(
        first,
        (1..=fenced_mysql::SCHEMA_VERSION).collect::<Vec<_>>()
    );
    assert!(a.unwrap().is_empty() && b.unwrap().is_empty());
    MySqlLock::connect(&url).await.unwrap();
}

#[tokio::test]
async fn first_migrations_from_two_nodes_at_once_apply_each_version_once() {
    let url = unique_key_url("mig2").await;
    // v3 is an ALTER, which would fail if run twice: the migration lock
    // makes the second node find everything applied.
    let (a, b) = tokio::join!(MySqlLock::migrate(&url), MySqlLock::migrate(&url));
    let (mut a, b) = (a.unwrap(), b.unwrap());
    a.extend(b);
    a.sort_unstable();
    assert_eq!(a, (1..=fenced_mysql::SCHEMA_VERSION).collect::<Vec<_>>());
    MySqlLock::connect(&url).await.unwrap();
}

/// An installation at schema v2 with a lock
/// held: `connect` refuses it until `migrate`, which moves unique_key's
/// table to lock_key as primary key and keeps the holder, its token and the
/// token sequence.
#[tokio::test]
async fn upgrade_to_v3_keeps_held_locks_and_tokens() {
    let server = server_url().await;
    let base = format!("{}_v2", run_table());
    let url = url_for(&server, Strategy::UniqueKey, &base);
    let p = pool().await;
    let held = key("held-across-upgrade");
    let v2_token = install_with_holder(&p, &base, &held, "v2-holder").await;

    match MySqlLock::connect(&url).await {
        Err(Error::Config { reason }) => assert!(reason.contains("version 2"), "{reason}"),
        other => panic!("a v2 schema must be refused until migrated, got {other:?}"),
    }
    assert_eq!(MySqlLock::migrate(&url).await.unwrap(), vec![3, 4, 5]);
    let lock = MySqlLock::connect(&url).await.unwrap();
    let info = lock.inspect(&held).await.unwrap().expect("the v2 holder");
    assert_eq!(info.owner.as_str(), "v2-holder");
    assert_eq!(info.label, None);
    assert_eq!(info.token.get(), v2_token);
    assert!(lock
        .try_acquire(&held, &ttl(Duration::from_secs(5)))
        .await
        .unwrap()
        .is_none());
    let next = take(&lock, &key("after-upgrade"), Duration::from_secs(5)).await;
    assert!(next.token.get() > v2_token, "the token sequence went back");
    let primary: String = sqlx::query(
        "SELECT GROUP_CONCAT(column_name) FROM information_schema.statistics \
         WHERE table_schema = DATABASE() AND table_name = ? AND index_name = 'PRIMARY'",
    )
    .bind(&base)
    .fetch_one(&p)
    .await
    .unwrap()
    .get(0);
    assert_eq!(primary, "lock_key");
    lock.release(&next).await.unwrap();
}

#[tokio::test]
async fn row_modes_shards_and_fixed_rows() {
    let server = server_url().await;
    let url = url_for(&server, Strategy::RowLock, run_table());
    MySqlLock::migrate(&url).await.unwrap();
    // One shard: every key excludes every other (coarse but safe).
    let one = with_rows(&url, RowMode::Shards(1)).await;
    let other = with_rows(&url, RowMode::Shards(1)).await;
    let opts = ttl(Duration::from_secs(10));
    let (k1, k2) = (key("shard-a"), key("shard-b"));
    let l1 = one.try_acquire(&k1, &opts).await.unwrap().unwrap();
    assert!(
        other.try_acquire(&k2, &opts).await.unwrap().is_none(),
        "same shard must exclude"
    );
    one.release(&l1).await.unwrap();
    let l2 = other.try_acquire(&k2, &opts).await.unwrap().unwrap();
    other.release(&l2).await.unwrap();
    // Per-key tokens still increase through shared shard rows.
    let l1b = one.try_acquire(&k1, &opts).await.unwrap().unwrap();
    assert!(l1b.token > l1.token);
    one.release(&l1b).await.unwrap();

    // Fixed rows: unknown keys are a configuration error, created ones work.
    let fixed = with_rows(&url, RowMode::Fixed).await;
    let known = key("fixed");
    assert!(matches!(
        fixed.try_acquire(&known, &opts).await,
        Err(Error::Config { .. })
    ));
    assert_eq!(
        fixed
            .create_rows(std::slice::from_ref(&known))
            .await
            .unwrap(),
        1
    );
    let l = fixed.try_acquire(&known, &opts).await.unwrap().unwrap();
    assert_eq!(fixed.release(&l).await.unwrap(), ReleaseOutcome::Released);
}

#[tokio::test]
async fn read_only_servers_are_refused_and_row_lock_tokens_survive_a_restart() {
    let db = Arc::new(PrivateMariaDb::start().await.unwrap());
    let url = url_for(&db.url(), Strategy::RowLock, "fenced_private");
    MySqlLock::migrate(&url).await.unwrap();

    // row_lock: the lock dies with the server, the token counter does not.
    let lock = MySqlLock::connect(&url).await.unwrap();
    let k = key("restart");
    let opts = ttl(Duration::from_secs(30));
    let before = lock.try_acquire(&k, &opts).await.unwrap().unwrap();
    db.restart().await.unwrap();
    assert!(matches!(
        lock.extend(&before, Duration::from_secs(30)).await,
        Err(Error::LeaseLost { .. })
    ));
    let fresh = MySqlLock::connect(&url).await.unwrap();
    let after = fresh.try_acquire(&k, &opts).await.unwrap().unwrap();
    assert_rises(&after, &before, " across the restart");
    fresh.release(&after).await.unwrap();

    // A replica (read-only server) is refused at connect, with the reason.
    db.set_read_only(true).await.unwrap();
    match MySqlLock::connect(&url).await {
        Err(Error::Config { reason }) => assert!(reason.contains("read-only"), "{reason}"),
        other => panic!("expected a read-only refusal, got {other:?}"),
    }
    db.set_read_only(false).await.unwrap();
    MySqlLock::connect(&url).await.unwrap();
}

#[tokio::test]
async fn unreachable_server_fails_fast_with_a_retryable_error() {
    let start = std::time::Instant::now();
    match MySqlLock::connect("mysql://root:hunter2@127.0.0.1:1/test?connect_timeout=1s").await {
        Err(e @ Error::Backend { .. }) => {
            assert!(e.is_retryable(), "{e}");
            // One line naming the server and the cause, not an internal
            // symptom such as "pool timed out while waiting for an open
            // connection".
            let msg = e.to_string();
            assert!(
                msg.contains("127.0.0.1:1") && msg.contains("connection refused"),
                "{msg}"
            );
            assert!(!msg.contains('\n') && !msg.contains("hunter2"), "{msg}");
        }
        other => panic!("expected a retryable backend error, got {other:?}"),
    }
    assert!(start.elapsed() < Duration::from_secs(5));
}

/// row_lock: the MEMORY token table being emptied (what a server restart
/// does to it) starts a new token lifetime above every earlier token; and
/// without a MEMORY table (engine unavailable) tokens are taken durably in
/// autocommit — still increasing across releases, KILLed holders and waits.
#[tokio::test]
async fn row_lock_tokens_survive_an_emptied_token_table_and_work_without_memory() {
    let server = server_url().await;
    let p = pool().await;
    let opts = ttl(Duration::from_secs(30));
    let wait = wait();

    let table = format!("{}_rl_mem", run_table());
    let url = url_for(&server, Strategy::RowLock, &table);
    MySqlLock::migrate(&url).await.unwrap();
    let lock = MySqlLock::connect(&url).await.unwrap();
    let k = key("lifetime");
    let first = lock.try_acquire(&k, &opts).await.unwrap().unwrap();
    lock.release(&first).await.unwrap();
    exec_raw(&p, format!("TRUNCATE TABLE `{table}_live`")).await;
    let second = lock.try_acquire(&k, &opts).await.unwrap().unwrap();
    assert_rises(&second, &first, " after the token table was emptied");
    lock.release(&second).await.unwrap();

    let table = format!("{}_rl_inno", run_table());
    let url = url_for(&server, Strategy::RowLock, &table);
    MySqlLock::migrate(&url).await.unwrap();
    exec_raw(&p, format!("ALTER TABLE `{table}_live` ENGINE=InnoDB")).await;
    let (a, b) = (
        MySqlLock::connect(&url).await.unwrap(),
        MySqlLock::connect(&url).await.unwrap(),
    );
    let k = key("durable");
    let mut last = fenced_api::FencingToken::new(0);
    for _ in 0..3 {
        let l = a.try_acquire(&k, &opts).await.unwrap().unwrap();
        assert!(l.token > last, "{} <= {}", l.token, last);
        last = l.token;
        assert!(b.try_acquire(&k, &opts).await.unwrap().is_none());
        assert_eq!(b.inspect(&k).await.unwrap().unwrap().token, l.token);
        a.release(&l).await.unwrap();
    }
    // A killed holder, then a waiter granted after it: higher token, fresh lease.
    let held = a.try_acquire(&k, &opts).await.unwrap().unwrap();
    let waiter = {
        let (b, k, wait) = (b.clone(), k.clone(), wait.clone());
        tokio::spawn(async move { b.acquire(&k, &wait).await })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(b.force_release(&k).await.unwrap());
    let next = waiter.await.unwrap().unwrap();
    assert_rises(&next, &held, "");
    assert!(next.remaining() > Duration::from_secs(20));
    assert_eq!(a.release(&held).await.unwrap(), ReleaseOutcome::NotHeld);
    assert_eq!(b.release(&next).await.unwrap(), ReleaseOutcome::Released);
}
