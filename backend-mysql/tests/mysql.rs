//! MySQL/MariaDB-specific behaviour beyond the shared suite: takeover,
//! reaper, killed holders, restarts, the transaction-scoped API, injection,
//! read-only servers, row modes. Destructive cases use a private MariaDB.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::{sync::Arc, time::Duration};

use common::{private::PrivateMariaDb, run_table, server_url, url_for, MySqlHarness};
use fenced_api::{DistributedLock, Error, LockKey, LockOptions, ReleaseOutcome};
use fenced_mysql::{MySqlLock, RowMode, Strategy};
use sqlx::Row;

fn key(tag: &str) -> LockKey {
    LockKey::new(format!("{tag}/{}", uuid::Uuid::new_v4().simple())).unwrap()
}

fn ttl(d: Duration) -> LockOptions {
    LockOptions::builder().ttl(d).build().unwrap()
}

async fn pool() -> sqlx::MySqlPool {
    sqlx::MySqlPool::connect(&server_url().await).await.unwrap()
}

#[tokio::test]
async fn unique_key_takes_over_an_expired_row_inline() {
    let h = MySqlHarness::new(Strategy::UniqueKey).await;
    let (a, b) = (h.lock().await, h.lock().await);
    let k = key("takeover");
    let crashed = a
        .try_acquire(&k, &ttl(Duration::from_millis(200)))
        .await
        .unwrap()
        .unwrap();
    tokio::time::sleep(Duration::from_millis(400)).await;
    // No reaper runs: the acquire itself removes the expired row.
    let next = b
        .try_acquire(&k, &ttl(Duration::from_secs(10)))
        .await
        .unwrap()
        .unwrap();
    assert!(next.token > crashed.token);
    let rows: i64 = sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT COUNT(*) FROM `{}` WHERE lock_key = ?",
        run_table()
    )))
    .bind(k.as_bytes())
    .fetch_one(&pool().await)
    .await
    .unwrap()
    .get(0);
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
    for i in 0..30 {
        let k = LockKey::new(format!("reap/{i}")).unwrap();
        lock.try_acquire(&k, &ttl(Duration::from_millis(10)))
            .await
            .unwrap()
            .unwrap();
    }
    let live = lock
        .try_acquire(&key("live"), &ttl(Duration::from_secs(60)))
        .await
        .unwrap()
        .unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    let stats = lock.table_stats().await.unwrap();
    assert_eq!((stats.rows, stats.expired), (31, 30));

    // Another node is reaping: this pass stands aside.
    let other = MySqlLock::connect(&url).await.unwrap();
    let reaper_key = LockKey::new("fenced:reaper").unwrap();
    let busy = other
        .try_acquire(&reaper_key, &ttl(Duration::from_secs(60)))
        .await
        .unwrap()
        .unwrap();
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
    for i in 0..10 {
        let k = LockKey::new(format!("reap2/{i}")).unwrap();
        lock.try_acquire(&k, &ttl(Duration::from_millis(10)))
            .await
            .unwrap()
            .unwrap();
    }
    tokio::time::sleep(Duration::from_millis(50)).await;
    let (r1, r2) = tokio::join!(lock.reap_expired(), other.reap_expired());
    let (r1, r2) = (r1.unwrap(), r2.unwrap());
    assert_eq!(r1.unwrap_or(0) + r2.unwrap_or(0), 10, "{r1:?} {r2:?}");

    // The background reaper does the same on a schedule.
    for i in 0..5 {
        let k = LockKey::new(format!("reap3/{i}")).unwrap();
        lock.try_acquire(&k, &ttl(Duration::from_millis(10)))
            .await
            .unwrap()
            .unwrap();
    }
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
    sqlx::query(sqlx::AssertSqlSafe(format!("DROP TABLE `{table}`, `{table}_optimistic`, `{table}_rows`, `{table}_fence`, `{table}_live`, `{table}_migrations`")))
        .execute(&pool().await)
        .await
        .unwrap();
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
    let h = MySqlHarness::new(Strategy::RowLock).await;
    let (a, b) = (h.lock().await, h.lock().await);
    let k = key("kill");
    let held = a
        .try_acquire(&k, &ttl(Duration::from_secs(30)))
        .await
        .unwrap()
        .unwrap();
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
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("KILL CONNECTION {conn_id}")))
        .execute(&p)
        .await
        .unwrap();
    // The server rolled the holder back: the key is free at once, long before the TTL.
    let wait = LockOptions::builder()
        .ttl(Duration::from_secs(30))
        .wait_timeout(Duration::from_secs(5))
        .build()
        .unwrap();
    let next = b.acquire(&k, &wait).await.unwrap();
    assert!(next.token > held.token, "{} ≤ {}", next.token, held.token);
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
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "CREATE TABLE IF NOT EXISTS `{business}` (id INT PRIMARY KEY, state VARCHAR(20), fence BIGINT UNSIGNED)"
    )))
    .execute(&p)
    .await
    .unwrap();
    let insert = format!("INSERT INTO `{business}` (id, state, fence) VALUES (?, ?, ?)");
    let count = format!("SELECT COUNT(*) FROM `{business}` WHERE id = ?");
    let opts = ttl(Duration::from_secs(30));
    let k = key("tx");

    // Commit: the write and the release become visible together.
    let mut tx = lock.lock_in_transaction(&k, &opts).await.unwrap();
    sqlx::query(sqlx::AssertSqlSafe(insert.clone()))
        .bind(1)
        .bind("shipped")
        .bind(tx.token().get())
        .execute(tx.connection().unwrap())
        .await
        .unwrap();
    assert!(
        other.try_acquire(&k, &opts).await.unwrap().is_none(),
        "held during the transaction"
    );
    let n: i64 = sqlx::query(sqlx::AssertSqlSafe(count.clone()))
        .bind(1)
        .fetch_one(&p)
        .await
        .unwrap()
        .get(0);
    assert_eq!(n, 0, "uncommitted write visible");
    tx.commit().await.unwrap();
    let n: i64 = sqlx::query(sqlx::AssertSqlSafe(count.clone()))
        .bind(1)
        .fetch_one(&p)
        .await
        .unwrap()
        .get(0);
    assert_eq!(n, 1);
    let after = other
        .try_acquire(&k, &opts)
        .await
        .unwrap()
        .expect("released by the commit");
    other.release(&after).await.unwrap();

    // Rollback: neither the write nor the lock survive.
    let mut tx = lock.lock_in_transaction(&k, &opts).await.unwrap();
    assert!(tx.token() > after.token);
    sqlx::query(sqlx::AssertSqlSafe(insert.clone()))
        .bind(2)
        .bind("cancelled")
        .bind(tx.token().get())
        .execute(tx.connection().unwrap())
        .await
        .unwrap();
    tx.rollback().await.unwrap();
    let n: i64 = sqlx::query(sqlx::AssertSqlSafe(count.clone()))
        .bind(2)
        .fetch_one(&p)
        .await
        .unwrap()
        .get(0);
    assert_eq!(n, 0);
    let again = other
        .try_acquire(&k, &opts)
        .await
        .unwrap()
        .expect("released by the rollback");
    other.release(&again).await.unwrap();

    // Dropped without commit: rolled back and released (the connection is closed).
    let mut tx = lock.lock_in_transaction(&k, &opts).await.unwrap();
    sqlx::query(sqlx::AssertSqlSafe(insert))
        .bind(3)
        .bind("lost")
        .bind(tx.token().get())
        .execute(tx.connection().unwrap())
        .await
        .unwrap();
    drop(tx);
    let wait = LockOptions::builder()
        .ttl(Duration::from_secs(30))
        .wait_timeout(Duration::from_secs(5))
        .build()
        .unwrap();
    let last = other.acquire(&k, &wait).await.unwrap();
    let n: i64 = sqlx::query(sqlx::AssertSqlSafe(count))
        .bind(3)
        .fetch_one(&p)
        .await
        .unwrap()
        .get(0);
    assert_eq!(n, 0);
    other.release(&last).await.unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!("DROP TABLE `{business}`")))
        .execute(&p)
        .await
        .unwrap();

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
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "CREATE TABLE IF NOT EXISTS `{canary}` (id INT)"
    )))
    .execute(&p)
    .await
    .unwrap();
    for strategy in [Strategy::UniqueKey, Strategy::RowLock, Strategy::Optimistic] {
        let lock = MySqlHarness::new(strategy).await.lock().await;
        for evil in [
            format!("'; DROP TABLE `{canary}`; --"),
            format!("\"); DROP TABLE {canary}; --"),
            "%' OR '1'='1".to_string(),
            r"\'; SELECT SLEEP(5); --".to_string(),
        ] {
            let k = LockKey::new(format!("{}{evil}", uuid::Uuid::new_v4().simple())).unwrap();
            let lease = lock
                .try_acquire(&k, &ttl(Duration::from_secs(10)))
                .await
                .unwrap()
                .unwrap();
            assert_eq!(lock.inspect(&k).await.unwrap().unwrap().key, k);
            lock.release(&lease).await.unwrap();
        }
    }
    let exists: i64 = sqlx::query("SELECT COUNT(*) FROM information_schema.tables WHERE table_schema = DATABASE() AND table_name = ?")
        .bind(&canary)
        .fetch_one(&p)
        .await
        .unwrap()
        .get(0);
    assert_eq!(exists, 1, "the canary table was dropped");
    sqlx::query(sqlx::AssertSqlSafe(format!("DROP TABLE `{canary}`")))
        .execute(&p)
        .await
        .unwrap();
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
    let server = server_url().await;
    let url = url_for(
        &server,
        Strategy::UniqueKey,
        &format!("{}_mig", run_table()),
    );
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
    let server = server_url().await;
    let url = url_for(
        &server,
        Strategy::UniqueKey,
        &format!("{}_mig2", run_table()),
    );
    // v3 is an ALTER, which would fail if run twice: the migration lock
    // makes the second node find everything applied.
    let (a, b) = tokio::join!(MySqlLock::migrate(&url), MySqlLock::migrate(&url));
    let (mut a, b) = (a.unwrap(), b.unwrap());
    a.extend(b);
    a.sort_unstable();
    assert_eq!(a, (1..=fenced_mysql::SCHEMA_VERSION).collect::<Vec<_>>());
    MySqlLock::connect(&url).await.unwrap();
}

/// An installation at schema v2 (as earlier builds left it) with a lock
/// held: `connect` refuses it until `migrate`, which moves unique_key's
/// table to lock_key as primary key and keeps the holder, its token and the
/// token sequence.
#[tokio::test]
async fn upgrade_to_v3_keeps_held_locks_and_tokens() {
    let server = server_url().await;
    let base = format!("{}_v2", run_table());
    let url = url_for(&server, Strategy::UniqueKey, &base);
    let p = pool().await;
    let v1_v2 = [
        include_str!("../migrations/0001_initial.sql"),
        include_str!("../migrations/0002_row_lock_live.sql"),
    ];
    for template in v1_v2 {
        let sql: String = template
            .lines()
            .filter(|l| !l.trim_start().starts_with("--"))
            .collect::<Vec<_>>()
            .join("\n");
        for stmt in sql.split(';').map(str::trim).filter(|s| !s.is_empty()) {
            sqlx::query(sqlx::AssertSqlSafe(stmt.replace("{base}", &base)))
                .execute(&p)
                .await
                .unwrap();
        }
    }
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "CREATE TABLE `{base}_migrations` (version INT UNSIGNED NOT NULL PRIMARY KEY, \
         name VARCHAR(100) NOT NULL, applied_at DATETIME(6) NOT NULL) ENGINE=InnoDB"
    )))
    .execute(&p)
    .await
    .unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "INSERT INTO `{base}_migrations` VALUES (1, 'initial', UTC_TIMESTAMP(6)), \
         (2, 'row_lock_live', UTC_TIMESTAMP(6))"
    )))
    .execute(&p)
    .await
    .unwrap();
    let held = key("held-across-upgrade");
    let done = sqlx::query(sqlx::AssertSqlSafe(format!(
        "INSERT INTO `{base}` (lock_key, owner, reentrant_count, expire_time, create_time) \
         VALUES (?, 'v2-holder', 1, UTC_TIMESTAMP(6) + INTERVAL 60 SECOND, UTC_TIMESTAMP(6))"
    )))
    .bind(held.as_bytes())
    .execute(&p)
    .await
    .unwrap();
    let v2_token = done.last_insert_id();

    match MySqlLock::connect(&url).await {
        Err(Error::Config { reason }) => assert!(reason.contains("version 2"), "{reason}"),
        other => panic!("a v2 schema must be refused until migrated, got {other:?}"),
    }
    assert_eq!(MySqlLock::migrate(&url).await.unwrap(), vec![3, 4]);
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
    let next = lock
        .try_acquire(&key("after-upgrade"), &ttl(Duration::from_secs(5)))
        .await
        .unwrap()
        .unwrap();
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
    let one = MySqlLock::builder(&url)
        .unwrap()
        .row_mode(RowMode::Shards(1))
        .connect()
        .await
        .unwrap();
    let other = MySqlLock::builder(&url)
        .unwrap()
        .row_mode(RowMode::Shards(1))
        .connect()
        .await
        .unwrap();
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
    let fixed = MySqlLock::builder(&url)
        .unwrap()
        .row_mode(RowMode::Fixed)
        .connect()
        .await
        .unwrap();
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
    assert!(
        after.token > before.token,
        "{} ≤ {}",
        after.token,
        before.token
    );
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
            // One line naming the server and the cause — it used to read
            // "pool timed out while waiting for an open connection".
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
    let wait = LockOptions::builder()
        .ttl(Duration::from_secs(30))
        .wait_timeout(Duration::from_secs(5))
        .build()
        .unwrap();

    let table = format!("{}_rl_mem", run_table());
    let url = url_for(&server, Strategy::RowLock, &table);
    MySqlLock::migrate(&url).await.unwrap();
    let lock = MySqlLock::connect(&url).await.unwrap();
    let k = key("lifetime");
    let first = lock.try_acquire(&k, &opts).await.unwrap().unwrap();
    lock.release(&first).await.unwrap();
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "TRUNCATE TABLE `{table}_live`"
    )))
    .execute(&p)
    .await
    .unwrap();
    let second = lock.try_acquire(&k, &opts).await.unwrap().unwrap();
    assert!(
        second.token > first.token,
        "{} <= {} after the token table was emptied",
        second.token,
        first.token
    );
    lock.release(&second).await.unwrap();

    let table = format!("{}_rl_inno", run_table());
    let url = url_for(&server, Strategy::RowLock, &table);
    MySqlLock::migrate(&url).await.unwrap();
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "ALTER TABLE `{table}_live` ENGINE=InnoDB"
    )))
    .execute(&p)
    .await
    .unwrap();
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
    assert!(next.token > held.token, "{} <= {}", next.token, held.token);
    assert!(next.remaining() > Duration::from_secs(20));
    assert_eq!(a.release(&held).await.unwrap(), ReleaseOutcome::NotHeld);
    assert_eq!(b.release(&next).await.unwrap(), ReleaseOutcome::Released);
}
