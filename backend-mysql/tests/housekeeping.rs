//! Housekeeping on the shared MariaDB: table-size metrics for every
//! strategy (and the gauges the reaper publishes), the stale-row purge, and
//! a schema migration that died halfway. Each test works in tables of its
//! own, so other tests' rows never disturb the counts.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;
mod schema_v2;

use std::{collections::HashMap, time::Duration};

use common::{server_url, url_for};
use fenced_api::{DistributedLock, Error, LockKey, LockOptions, ReleaseOutcome};
use fenced_mysql::{MySqlLock, Strategy, TableStats};
use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};
use schema_v2::{install_with_holder, run_template};
use sqlx::Row;

fn ttl(d: Duration) -> LockOptions {
    LockOptions::builder().ttl(d).build().unwrap()
}

fn fresh_base(tag: &str) -> String {
    format!(
        "fenced_hk_{tag}_{}",
        &uuid::Uuid::new_v4().simple().to_string()[..10]
    )
}

async fn drop_tables(pool: &sqlx::MySqlPool, base: &str) {
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "DROP TABLE IF EXISTS `{base}`, `{base}_optimistic`, `{base}_rows`, `{base}_fence`, \
         `{base}_live`, `{base}_migrations`"
    )))
    .execute(pool)
    .await
    .unwrap();
}

/// Merges a snapshot into `seen`, keyed by `(name, table label)`. A
/// snapshot swaps every value to 0 (metrics-util's debugging recorder), so
/// counters are summed, and a gauge keeps its last non-zero reading (a 0 in
/// a later snapshot may only mean "not set since").
fn merge(snapshotter: &Snapshotter, seen: &mut HashMap<(String, String), f64>) {
    for (k, _, _, v) in snapshotter.snapshot().into_vec() {
        let Some(table) = k
            .key()
            .labels()
            .find(|l| l.key() == "table")
            .map(|l| l.value().to_owned())
        else {
            continue;
        };
        let entry = seen
            .entry((k.key().name().to_owned(), table))
            .or_insert(0.0);
        match v {
            DebugValue::Counter(c) => *entry += c as f64,
            DebugValue::Gauge(g) if g.into_inner() != 0.0 => *entry = g.into_inner(),
            _ => {}
        }
    }
}

/// Runs `f` on a current-thread runtime whose metrics go to `recorder`
/// (a local recorder covers tasks spawned on that one thread too).
fn with_recorder<F: std::future::Future<Output = ()>>(recorder: &DebuggingRecorder, f: F) {
    metrics::with_local_recorder(recorder, || {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
            .block_on(f)
    });
}

/// Table sizes for every strategy, counted per table, and published by the
/// background reaper as gauges (with the documented names) whatever the
/// strategy; the unique_key reaper also counts what it deleted.
#[test]
fn table_stats_cover_every_strategy_and_the_reaper_publishes_them() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let bases: Vec<(Strategy, String)> =
        [Strategy::UniqueKey, Strategy::Optimistic, Strategy::RowLock]
            .into_iter()
            .map(|s| (s, fresh_base(&s.to_string())))
            .collect();
    with_recorder(&recorder, async {
        let server = server_url().await;
        let pool = sqlx::MySqlPool::connect(&server).await.unwrap();
        let short = ttl(Duration::from_millis(10));
        let long = ttl(Duration::from_secs(60));
        let k = |i: u32| LockKey::new(format!("stats/{i}")).unwrap();
        let mut handles = Vec::new();
        let mut locks = Vec::new();
        let mut expect: Vec<(String, u64, u64)> = Vec::new();
        for (strategy, base) in &bases {
            let url = url_for(&server, *strategy, base);
            MySqlLock::migrate(&url).await.unwrap();
            let lock = MySqlLock::connect(&url).await.unwrap();
            let fresh = lock.table_stats().await.unwrap();
            assert_eq!(
                (fresh.strategy, fresh.rows, fresh.expired),
                (*strategy, 0, 0)
            );
            match strategy {
                Strategy::UniqueKey => {
                    // Two dead holders and a live one.
                    for i in 0..2 {
                        lock.try_acquire(&k(i), &short).await.unwrap().unwrap();
                    }
                    lock.try_acquire(&k(2), &long).await.unwrap().unwrap();
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    let s = lock.table_stats().await.unwrap();
                    assert_eq!((s.rows, s.expired), (3, 2), "{s}");
                    assert_eq!(s.tables.len(), 1);
                    assert_eq!(s.tables[0].table, *base);
                    // After the reaper: the live row only.
                    expect.push((base.clone(), 1, 0));
                }
                Strategy::Optimistic => {
                    // Released, expired, held: rows stay (the version is the token).
                    let l = lock.try_acquire(&k(0), &long).await.unwrap().unwrap();
                    assert_eq!(lock.release(&l).await.unwrap(), ReleaseOutcome::Released);
                    lock.try_acquire(&k(1), &short).await.unwrap().unwrap();
                    lock.try_acquire(&k(2), &long).await.unwrap().unwrap();
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    let s = lock.table_stats().await.unwrap();
                    assert_eq!((s.rows, s.expired), (3, 1), "{s}");
                    assert_eq!(s.tables[0].table, format!("{base}_optimistic"));
                    expect.push((format!("{base}_optimistic"), 3, 1));
                }
                Strategy::RowLock => {
                    let l = lock.try_acquire(&k(0), &long).await.unwrap().unwrap();
                    lock.release(&l).await.unwrap();
                    let _held = lock.try_acquire(&k(1), &long).await.unwrap().unwrap();
                    let s = lock.table_stats().await.unwrap();
                    let names: Vec<_> = s.tables.iter().map(|t| t.table.clone()).collect();
                    assert_eq!(
                        names,
                        [
                            format!("{base}_rows"),
                            format!("{base}_live"),
                            format!("{base}_fence")
                        ]
                    );
                    assert_eq!((s.rows, s.expired), (2, 0), "{s}");
                    // One description per key granted, the lifetime row not counted.
                    assert_eq!(s.tables[1].rows, 2, "{s}");
                    assert!(s.tables[2].rows >= 1, "the epoch row: {s}");
                    expect.push((format!("{base}_rows"), 2, 0));
                    expect.push((format!("{base}_live"), 2, 0));
                }
            }
            handles.push(lock.spawn_reaper(Duration::from_millis(20)).unwrap());
            locks.push(lock);
        }
        // Wait (hang bound only) until every expected gauge shows, and the
        // unique_key reaper has counted the two rows it deleted.
        let reaped = (
            fenced_mysql::METRIC_REAPED_ROWS.to_owned(),
            bases[0].1.clone(),
        );
        let mut seen = HashMap::new();
        let start = tokio::time::Instant::now();
        loop {
            merge(&snapshotter, &mut seen);
            let done = seen.get(&reaped) == Some(&2.0)
                && expect.iter().all(|(table, rows, expired)| {
                    seen.get(&(fenced_mysql::METRIC_TABLE_ROWS.into(), table.clone()))
                        == Some(&(*rows as f64))
                        && seen.get(&(
                            fenced_mysql::METRIC_TABLE_EXPIRED_ROWS.into(),
                            table.clone(),
                        )) == Some(&(*expired as f64))
                });
            if done {
                break;
            }
            assert!(
                start.elapsed() < Duration::from_secs(20),
                "metrics never reached {expect:?} and 2 reaped rows: {seen:?}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        drop(handles);
        drop(locks);
        for (_, base) in &bases {
            drop_tables(&pool, base).await;
        }
    });
}

#[tokio::test]
async fn table_stats_display_is_one_line() {
    let server = server_url().await;
    let base = fresh_base("disp");
    let url = url_for(&server, Strategy::UniqueKey, &base);
    MySqlLock::migrate(&url).await.unwrap();
    let lock = MySqlLock::connect(&url).await.unwrap();
    let s: TableStats = lock.table_stats().await.unwrap();
    assert_eq!(
        s.to_string(),
        format!("unique_key: {base} 0 rows (0 expired)")
    );
    drop_tables(&sqlx::MySqlPool::connect(&server).await.unwrap(), &base).await;
}

/// The daily purge deletes rows expired longer ago than asked — exactly
/// those — and leaves recently expired and live rows alone.
#[tokio::test]
async fn purge_deletes_exactly_the_stale_rows() {
    let server = server_url().await;
    let base = fresh_base("purge");
    let url = url_for(&server, Strategy::UniqueKey, &base);
    MySqlLock::migrate(&url).await.unwrap();
    let lock = MySqlLock::connect(&url).await.unwrap();
    let pool = sqlx::MySqlPool::connect(&server).await.unwrap();
    let insert = format!(
        "INSERT INTO `{base}` (lock_key, owner, reentrant_count, expire_time, create_time) \
         VALUES (?, 'dead', 1, UTC_TIMESTAMP(6) - INTERVAL ? SECOND, UTC_TIMESTAMP(6))"
    );
    // Expired two hours ago, and one second ago.
    for (key, ago) in [("stale", 7200), ("recent", 1)] {
        sqlx::query(sqlx::AssertSqlSafe(insert.clone()))
            .bind(key)
            .bind(ago)
            .execute(&pool)
            .await
            .unwrap();
    }
    let live_key = LockKey::new("live").unwrap();
    let live = lock
        .try_acquire(&live_key, &ttl(Duration::from_secs(60)))
        .await
        .unwrap()
        .unwrap();

    assert_eq!(
        lock.purge_stale(Duration::from_secs(3600)).await.unwrap(),
        1
    );
    let mut left: Vec<Vec<u8>> = sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT lock_key FROM `{base}`"
    )))
    .fetch_all(&pool)
    .await
    .unwrap()
    .iter()
    .map(|r| r.get(0))
    .collect();
    left.sort();
    assert_eq!(left, [b"live".to_vec(), b"recent".to_vec()]);
    assert_eq!(
        lock.inspect(&live_key).await.unwrap().unwrap().token,
        live.token
    );
    assert_eq!(lock.release(&live).await.unwrap(), ReleaseOutcome::Released);
    // Nothing that old is left: a second purge is a no-op.
    assert_eq!(
        lock.purge_stale(Duration::from_secs(3600)).await.unwrap(),
        0
    );
    drop_tables(&pool, &base).await;
}

/// A migrate that died between v3's `ALTER` (which committed) and the log
/// row: the next migrate must skip the `ALTER` (it cannot run twice),
/// record v3, and keep the rows.
#[tokio::test]
async fn migration_v3_recovers_from_a_migrate_that_died_halfway() {
    let server = server_url().await;
    let base = fresh_base("v3");
    let url = url_for(&server, Strategy::UniqueKey, &base);
    let pool = sqlx::MySqlPool::connect(&server).await.unwrap();
    let held = LockKey::new("held-through-the-crash").unwrap();
    let token = install_with_holder(&pool, &base, &held, "holder").await;
    // The v3 ALTER ran and committed; the process died before the log row.
    run_template(
        &pool,
        include_str!("../migrations/0003_unique_key_by_lock_key.sql"),
        &base,
    )
    .await;
    match MySqlLock::connect(&url).await {
        Err(Error::Config { reason }) => assert!(reason.contains("version 2"), "{reason}"),
        other => panic!("an unrecorded v3 must still be refused, got {other:?}"),
    }

    assert_eq!(MySqlLock::migrate(&url).await.unwrap(), vec![3, 4, 5]);
    assert!(MySqlLock::migrate(&url).await.unwrap().is_empty());
    let lock = MySqlLock::connect(&url).await.unwrap();
    let info = lock
        .inspect(&held)
        .await
        .unwrap()
        .expect("the holder's row");
    assert_eq!((info.owner.as_str(), info.token.get()), ("holder", token));
    let next = lock
        .try_acquire(
            &LockKey::new("after").unwrap(),
            &ttl(Duration::from_secs(5)),
        )
        .await
        .unwrap()
        .unwrap();
    assert!(next.token.get() > token);
    lock.release(&next).await.unwrap();
    drop_tables(&pool, &base).await;
}

/// Tables of schema 3 (before labels) with a held lock in `unique_key` and
/// `optimistic` and a past `row_lock` grant (an open `row_lock` hold would
/// make the `ALTER`s wait: it keeps metadata locks on its tables), and a
/// migrate to 4 that died after its first `ADD COLUMN`: connect refuses
/// them until `migrate`, which adds the missing columns only and keeps every
/// row. The old holds read as unlabelled; new grants store their labels,
/// with tokens above the old ones (where tokens are not per key).
#[tokio::test]
async fn migration_v4_adds_labels_to_tables_in_use() {
    let server = server_url().await;
    let base = fresh_base("v4");
    let pool = sqlx::MySqlPool::connect(&server).await.unwrap();
    let url = |s: Strategy| url_for(&server, s, &base);
    // Schema 3, made by the previous build, with a lock held in each.
    MySqlLock::migrate(&url(Strategy::UniqueKey)).await.unwrap();
    let held = LockKey::new("held-across-the-upgrade").unwrap();
    let mut old = Vec::new();
    for s in [Strategy::UniqueKey, Strategy::Optimistic] {
        let lock = MySqlLock::connect(&url(s)).await.unwrap();
        old.push(
            lock.try_acquire(&held, &ttl(Duration::from_secs(60)))
                .await
                .unwrap()
                .unwrap(),
        );
    }
    let row_lock = MySqlLock::connect(&url(Strategy::RowLock)).await.unwrap();
    let row_past = row_lock
        .try_acquire(&held, &ttl(Duration::from_secs(60)))
        .await
        .unwrap()
        .unwrap();
    row_lock.release(&row_past).await.unwrap();
    drop(row_lock);
    for t in ["", "_optimistic", "_live"] {
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "ALTER TABLE `{base}{t}` DROP COLUMN label"
        )))
        .execute(&pool)
        .await
        .unwrap();
    }
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "DELETE FROM `{base}_migrations` WHERE version >= 4"
    )))
    .execute(&pool)
    .await
    .unwrap();
    // The migrate that died: its first ALTER committed, nothing else.
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "ALTER TABLE `{base}` ADD COLUMN label VARBINARY(128) NULL"
    )))
    .execute(&pool)
    .await
    .unwrap();
    match MySqlLock::connect(&url(Strategy::Optimistic)).await {
        Err(Error::Config { reason }) => assert!(reason.contains("version 3"), "{reason}"),
        other => panic!("schema 3 must be refused, got {other:?}"),
    }

    assert_eq!(
        MySqlLock::migrate(&url(Strategy::UniqueKey)).await.unwrap(),
        vec![4, 5]
    );
    let labelled = LockOptions::builder()
        .ttl(Duration::from_secs(5))
        .label("after the upgrade ü")
        .build()
        .unwrap();
    let fresh = LockKey::new("after-the-upgrade").unwrap();
    for (s, before) in [
        (Strategy::UniqueKey, &old[0]),
        (Strategy::Optimistic, &old[1]),
        (Strategy::RowLock, &row_past),
    ] {
        let lock = MySqlLock::connect(&url(s)).await.unwrap();
        if s != Strategy::RowLock {
            let info = lock.inspect(&held).await.unwrap().expect("the old hold");
            assert_eq!((info.token, info.label), (before.token, None), "{s}");
        }
        let lease = lock.try_acquire(&fresh, &labelled).await.unwrap().unwrap();
        // Tokens of optimistic are versions of one key's row: per key.
        if s != Strategy::Optimistic {
            assert!(lease.token > before.token, "{s}");
        }
        let info = lock.inspect(&fresh).await.unwrap().unwrap();
        assert_eq!(
            info.label.as_ref().map(|l| l.as_str()),
            Some("after the upgrade ü"),
            "{s}"
        );
        lock.release(&lease).await.unwrap();
    }
    drop_tables(&pool, &base).await;
}
