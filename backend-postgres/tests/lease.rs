//! The `lease` strategy on real servers: what the conformance suite does
//! not cover. A hot standby refused; held leases and rising tokens across a
//! server crash; hand-off across processes through `NOTIFY` (not the
//! re-check), and the re-check when no notification comes; a listening
//! session that is killed; the reaper; `migrate`; a missing table; the
//! statements one acquire and release cost, and a batch renewal of many
//! owners.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::print_stderr,
    clippy::print_stdout
)]

mod common;

use std::{sync::Arc, time::Duration};

use common::{
    admin, drop_tables, exec, fresh, key, next_line, ttl, unix_micros, url_for, wait_opts,
};
use fenced_api::{DistributedLock, Error, LockKey, LockOptions, ReleaseOutcome};
use fenced_postgres::{PostgresLock, Strategy};
use fenced_testkit::private::{PostgresOptions, PrivatePostgres};
use sqlx::Row;
use tokio::{
    io::{AsyncBufReadExt, BufReader},
    time::Instant,
};

/// The first key of the reaper's guard (`"fenc"`), as the crate docs give it.
const GUARD_CLASS: i32 = 0x6665_6e63;

/// The same server and database through another spelling of the URL (the
/// default port left out), so that the two handles' waiting scopes differ
/// as two processes' would: a release through one never wakes the other's
/// waiters in memory.
fn other_spelling(url: &str) -> String {
    let other = url.replacen(":5432/", "/", 1);
    assert_ne!(
        other, url,
        "the test URL names no :5432 to leave out: {url}"
    );
    other
}

#[tokio::test]
async fn a_hot_standby_is_refused_naming_the_primary() {
    let primary = PrivatePostgres::start(PostgresOptions::default())
        .await
        .unwrap();
    let standby = PrivatePostgres::standby_of(&primary).await.unwrap();
    assert!(standby.in_recovery().await.unwrap());
    let url = |server: &PrivatePostgres| url_for(&server.url(), Strategy::Lease, "fenced_standby");
    for attempt in [
        PostgresLock::connect(&url(&standby)).await.map(drop),
        PostgresLock::migrate(&url(&standby)).await.map(drop),
    ] {
        match attempt {
            Err(e @ Error::Config { .. }) => {
                let text = e.to_string();
                assert!(
                    text.contains("hot standby") && text.contains("primary"),
                    "{text}"
                );
                assert!(text.contains(&standby.port().to_string()), "{text}");
            }
            other => panic!("a standby was not refused: {other:?}"),
        }
    }
    // The primary is fine, and a lock taken there is seen nowhere else.
    let lock = PostgresLock::connect(&url(&primary)).await.unwrap();
    let k = key("standby");
    let lease = lock
        .try_acquire(&k, &ttl(Duration::from_secs(5)))
        .await
        .unwrap();
    assert!(lease.is_some());
}

/// Take leases, crash the server (SIGKILL, no shutdown checkpoint) while
/// grants are being made, start it again: the held leases are still held
/// (inspect shows them, another client is refused), and every new token is
/// larger than every token any client was given before the crash.
#[tokio::test]
async fn held_leases_survive_a_server_crash_and_tokens_keep_rising() {
    let server = PrivatePostgres::start(PostgresOptions::default())
        .await
        .unwrap();
    let url = url_for(&server.url(), Strategy::Lease, "fenced_crash");
    let a = PostgresLock::connect(&url).await.unwrap();
    let long = LockOptions::builder()
        .ttl(Duration::from_secs(120))
        .label("crash test")
        .build()
        .unwrap();
    let held: Vec<_> = {
        let mut held = Vec::new();
        for i in 0..3 {
            let k = LockKey::new(format!("held/{i}")).unwrap();
            held.push(a.try_acquire(&k, &long).await.unwrap().unwrap());
        }
        held
    };
    // Grants right up to the crash and on after the restart, from a client
    // of their own: every token it was given is recorded with when.
    let churn = PostgresLock::connect(&url).await.unwrap();
    let seen = Arc::new(std::sync::Mutex::new(Vec::<(Instant, u64)>::new()));
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let grants = {
        let (churn, seen, stop) = (churn.clone(), Arc::clone(&seen), Arc::clone(&stop));
        tokio::spawn(async move {
            let short = ttl(Duration::from_secs(30));
            let mut i = 0;
            while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                i += 1;
                let k = LockKey::new(format!("churn/{}", i % 7)).unwrap();
                // Errors while the server is down are expected.
                if let Ok(Some(lease)) = churn.try_acquire(&k, &short).await {
                    seen.lock()
                        .unwrap()
                        .push((Instant::now(), lease.token.get()));
                    let _ = churn.release(&lease).await;
                }
            }
        })
    };
    tokio::time::sleep(Duration::from_millis(500)).await;
    let crash = Instant::now();
    server.restart().await.unwrap();
    // The churn rides through the restart: its pool reconnects.
    let start = Instant::now();
    while !seen.lock().unwrap().iter().any(|(at, _)| *at > crash) {
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "no grant after the restart"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    grants.await.unwrap();
    let seen = seen.lock().unwrap().clone();
    let (pre, post): (Vec<_>, Vec<_>) = seen.iter().partition(|(at, _)| *at <= crash);
    assert!(
        pre.len() > 10,
        "too few grants before the crash to mean anything"
    );
    let before = held
        .iter()
        .map(|l| l.token.get())
        .chain(pre.iter().map(|(_, t)| *t))
        .max()
        .unwrap();
    for (_, t) in &post {
        assert!(*t > before, "token {t} after the crash, {before} before it");
    }

    let b = PostgresLock::connect(&url).await.unwrap();
    for lease in &held {
        let info = b
            .inspect(&lease.key)
            .await
            .unwrap()
            .expect("held across the crash");
        assert_eq!(info.token, lease.token);
        assert_eq!(info.owner, lease.owner);
        assert_eq!(info.label.as_ref().map(|l| l.as_str()), Some("crash test"));
        assert!(info.remaining_ttl > Duration::from_secs(60), "{info:?}");
        assert!(
            b.try_acquire(&lease.key, &long).await.unwrap().is_none(),
            "another client took {} after the crash",
            lease.key
        );
    }
    // (A churn grant whose reply the crash cut off may be listed too.)
    let listed = b.list(10).await.unwrap();
    let held_keys: Vec<&str> = listed
        .iter()
        .map(|i| i.key.as_str())
        .filter(|k| k.starts_with("held/"))
        .collect();
    assert_eq!(held_keys, ["held/0", "held/1", "held/2"], "{listed:?}");
    for i in 0..5 {
        let k = LockKey::new(format!("after/{i}")).unwrap();
        let lease = b.try_acquire(&k, &long).await.unwrap().unwrap();
        assert!(
            lease.token.get() > before,
            "token {} after the crash, {before} before it",
            lease.token
        );
    }
    // The holder's own handle goes on at its first renewal: its pooled
    // connections died with the server, and each one the renewal is sent
    // on is closed and the statement sent on the next, until one is live.
    let renewed = a.extend(&held[0], Duration::from_secs(60)).await.unwrap();
    assert_eq!(a.release(&renewed).await.unwrap(), ReleaseOutcome::Released);
    assert!(b.try_acquire(&held[0].key, &long).await.unwrap().is_some());
}

/// Two handles whose waiting scopes differ, as two processes' do. The
/// waiter re-checks only every 10 s (5–10 s with jitter), so a hand-off
/// within a fraction of a second is the notification's doing.
#[tokio::test]
async fn a_waiter_of_another_handle_is_woken_by_the_notification() {
    let (url, table) = fresh("notify").await;
    let holder = PostgresLock::connect(&url).await.unwrap();
    let waiter = PostgresLock::builder(&other_spelling(&url))
        .unwrap()
        .recheck_interval(Duration::from_secs(10))
        .connect()
        .await
        .unwrap();
    assert_ne!(holder.config().display_url(), waiter.config().display_url());
    let k = key("notify");
    let opts = wait_opts(Duration::from_secs(30), Duration::from_secs(30));
    let mut gaps = Vec::new();
    for round in 0..10 {
        let lease = holder.try_acquire(&k, &opts).await.unwrap().unwrap();
        let w = {
            let (waiter, k, opts) = (waiter.clone(), k.clone(), opts.clone());
            tokio::spawn(async move {
                let got = waiter.acquire(&k, &opts).await;
                (got, Instant::now())
            })
        };
        // Long enough for the first round's listener to be up.
        let pause = if round == 0 { 1000 } else { 300 };
        tokio::time::sleep(Duration::from_millis(pause)).await;
        assert!(!w.is_finished(), "the waiter got a held key");
        let released = Instant::now();
        assert_eq!(
            holder.release(&lease).await.unwrap(),
            ReleaseOutcome::Released
        );
        let (got, at) = w.await.unwrap();
        let got = got.unwrap();
        assert!(got.token > lease.token);
        gaps.push(at - released);
        waiter.release(&got).await.unwrap();
    }
    gaps.sort();
    eprintln!(
        "NOTIFY hand-off between two handles: median {:?}, max {:?} (10 rounds)",
        gaps[gaps.len() / 2],
        gaps[gaps.len() - 1]
    );
    assert!(
        gaps[gaps.len() - 1] < Duration::from_secs(1),
        "a hand-off took {:?}: not the notification",
        gaps[gaps.len() - 1]
    );
    drop_tables(&table).await;
}

/// The control: a key freed without a notification (its row expired by
/// hand, as an expired lease is) is found by the re-check — within the
/// recheck interval, not at once.
#[tokio::test]
async fn without_a_notification_the_recheck_finds_the_key() {
    let (url, table) = fresh("recheck").await;
    let holder = PostgresLock::connect(&url).await.unwrap();
    let waiter = PostgresLock::builder(&other_spelling(&url))
        .unwrap()
        .recheck_interval(Duration::from_secs(2))
        .connect()
        .await
        .unwrap();
    let k = key("recheck");
    let opts = wait_opts(Duration::from_secs(30), Duration::from_secs(30));
    let lease = holder.try_acquire(&k, &opts).await.unwrap().unwrap();
    let w = {
        let (waiter, k, opts) = (waiter.clone(), k.clone(), opts.clone());
        tokio::spawn(async move { (waiter.acquire(&k, &opts).await, Instant::now()) })
    };
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let pool = admin().await;
    let freed = Instant::now();
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "UPDATE \"{table}\" SET expire_at = clock_timestamp() WHERE lock_key = $1"
    )))
    .bind(k.as_bytes())
    .execute(&pool)
    .await
    .unwrap();
    let (got, at) = w.await.unwrap();
    let got = got.unwrap();
    assert!(got.token > lease.token);
    let gap = at - freed;
    eprintln!("hand-off by re-check alone (recheck_interval 2s): {gap:?}");
    assert!(gap <= Duration::from_millis(2300), "{gap:?}");
    drop_tables(&table).await;
}

/// The waiter half of [`a_waiter_in_another_process_is_woken_by_the_notification`]:
/// does nothing unless that test started this binary for it.
#[tokio::test]
async fn child_waiter() {
    let (Ok(url), Ok(k)) = (
        std::env::var("FENCED_PG_CHILD_URL"),
        std::env::var("FENCED_PG_CHILD_KEY"),
    ) else {
        return;
    };
    let lock = PostgresLock::builder(&url)
        .unwrap()
        .recheck_interval(Duration::from_secs(10))
        .connect()
        .await
        .unwrap();
    println!("CHILD CONNECTED");
    let k = LockKey::new(k).unwrap();
    let lease = lock
        .acquire(
            &k,
            &wait_opts(Duration::from_secs(30), Duration::from_secs(60)),
        )
        .await
        .unwrap();
    println!("CHILD GRANTED {} {}", lease.token, unix_micros());
    lock.release(&lease).await.unwrap();
}

/// A waiter in another process (this test binary, run again for
/// [`child_waiter`]) gets the key within a fraction of a second of the
/// release, though it re-checks only every 5–10 s.
#[tokio::test]
async fn a_waiter_in_another_process_is_woken_by_the_notification() {
    let (url, table) = fresh("child").await;
    let holder = PostgresLock::connect(&url).await.unwrap();
    let k = key("child");
    let lease = holder
        .try_acquire(&k, &ttl(Duration::from_secs(60)))
        .await
        .unwrap()
        .unwrap();
    let mut child = tokio::process::Command::new(std::env::current_exe().unwrap())
        .args(["child_waiter", "--exact", "--nocapture", "--test-threads=1"])
        .env("FENCED_PG_CHILD_URL", &url)
        .env("FENCED_PG_CHILD_KEY", k.as_str())
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    next_line(&mut lines, "CHILD CONNECTED").await;
    // The child tries, finds the key held, starts listening, tries again and
    // then re-checks 5–10 s later.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let released_us = unix_micros();
    assert_eq!(
        holder.release(&lease).await.unwrap(),
        ReleaseOutcome::Released
    );
    let granted = next_line(&mut lines, "CHILD GRANTED").await;
    let (token, at_us) = granted.split_once(' ').unwrap();
    assert!(token.parse::<u64>().unwrap() > lease.token.get());
    let gap = Duration::from_micros(
        u64::try_from(at_us.parse::<i64>().unwrap() - released_us).unwrap_or(0),
    );
    eprintln!("NOTIFY hand-off to another process: {gap:?}");
    assert!(
        gap < Duration::from_secs(1),
        "{gap:?}: not the notification"
    );
    assert!(child.wait().await.unwrap().success());
    drop_tables(&table).await;
}

/// The listening session is terminated by the server: it is reopened, and
/// a waiter that may have missed a release meanwhile is woken.
#[tokio::test]
async fn a_terminated_listening_session_is_reopened_and_waiters_look_again() {
    let (url, table) = fresh("relisten").await;
    let app = format!(
        "fenced_relisten_{}",
        &uuid::Uuid::new_v4().simple().to_string()[..8]
    );
    let holder = PostgresLock::connect(&url).await.unwrap();
    let waiter = PostgresLock::builder(&format!("{}&application_name={app}", other_spelling(&url)))
        .unwrap()
        .recheck_interval(Duration::from_secs(10))
        .connect()
        .await
        .unwrap();
    let k = key("relisten");
    let opts = wait_opts(Duration::from_secs(30), Duration::from_secs(30));
    let lease = holder.try_acquire(&k, &opts).await.unwrap().unwrap();
    let w = {
        let (waiter, k, opts) = (waiter.clone(), k.clone(), opts.clone());
        tokio::spawn(async move { (waiter.acquire(&k, &opts).await, Instant::now()) })
    };
    tokio::time::sleep(Duration::from_secs(1)).await;
    let pool = admin().await;
    let listeners = |pool: sqlx::PgPool, app: String| async move {
        sqlx::query(
            "SELECT pid FROM pg_stat_activity WHERE application_name = $1 AND query LIKE 'LISTEN%'",
        )
        .bind(app)
        .fetch_all(&pool)
        .await
        .unwrap()
        .iter()
        .map(|r| r.get::<i32, _>(0))
        .collect::<Vec<_>>()
    };
    let before = listeners(pool.clone(), app.clone()).await;
    assert_eq!(before.len(), 1, "one listening session: {before:?}");
    // Terminated, and the key released in the same instant: the
    // notification may reach no one.
    let (_, released) = tokio::join!(
        sqlx::query("SELECT pg_terminate_backend($1)")
            .bind(before[0])
            .execute(&pool),
        async {
            let at = Instant::now();
            holder.release(&lease).await.unwrap();
            at
        }
    );
    let (got, at) = w.await.unwrap();
    got.unwrap();
    let gap = at - released;
    eprintln!("hand-off across a terminated listening session: {gap:?}");
    assert!(
        gap < Duration::from_secs(2),
        "{gap:?}: the waiter was not woken"
    );
    // The handle listens again, in a new session.
    let start = Instant::now();
    loop {
        let after = listeners(pool.clone(), app.clone()).await;
        if after.len() == 1 && after != before {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "the listening session was not reopened: {after:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    drop_tables(&table).await;
}

/// The listening session lives as long as the handle: dropping the last
/// clone ends it (and `close` does too).
#[tokio::test]
async fn the_listening_session_ends_with_the_handle() {
    let (url, table) = fresh("listenend").await;
    let pool = admin().await;
    for close in [false, true] {
        let app = format!(
            "fenced_listenend_{}",
            &uuid::Uuid::new_v4().simple().to_string()[..8]
        );
        let sessions = |pool: sqlx::PgPool, app: String| async move {
            sqlx::query_scalar::<_, i64>(
                "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1 \
                 AND query LIKE 'LISTEN%'",
            )
            .bind(app)
            .fetch_one(&pool)
            .await
            .unwrap()
        };
        let holder = PostgresLock::connect(&url).await.unwrap();
        let waiter = PostgresLock::connect(&format!("{url}&application_name={app}"))
            .await
            .unwrap();
        let k = key("listenend");
        let lease = holder
            .try_acquire(&k, &ttl(Duration::from_secs(30)))
            .await
            .unwrap()
            .unwrap();
        // A wait that times out: the listener is started and stays.
        let short = wait_opts(Duration::from_secs(30), Duration::from_millis(300));
        assert!(matches!(
            waiter.acquire(&k, &short).await,
            Err(Error::Timeout { .. })
        ));
        assert_eq!(sessions(pool.clone(), app.clone()).await, 1);
        let clone = waiter.clone();
        if close {
            clone.close().await;
        }
        drop(waiter);
        drop(clone);
        let start = Instant::now();
        while sessions(pool.clone(), app.clone()).await != 0 {
            assert!(
                start.elapsed() < Duration::from_secs(5),
                "the listening session outlived its handle (close: {close})"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        holder.release(&lease).await.unwrap();
    }
    drop_tables(&table).await;
}

/// Rows of `table` as (key, expired seconds ago): negative = live.
async fn insert_rows(pool: &sqlx::PgPool, table: &str, rows: &[(&str, i64)]) {
    for (k, ago) in rows {
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "INSERT INTO \"{table}\" (lock_key, owner, token, reentrant_count, expire_at, created_at) \
             VALUES ($1, 'dead', nextval('\"{table}_token\"'), 0, \
             clock_timestamp() - $2 * interval '1 second', clock_timestamp() - interval '1 hour')"
        )))
        .bind(k.as_bytes())
        .bind(*ago as f64)
        .execute(pool)
        .await
        .unwrap();
    }
}

async fn keys_left(pool: &sqlx::PgPool, table: &str) -> Vec<String> {
    let rows = sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT lock_key FROM \"{table}\" ORDER BY lock_key"
    )))
    .fetch_all(pool)
    .await
    .unwrap();
    rows.iter()
        .map(|r| String::from_utf8(r.get::<Vec<u8>, _>(0)).unwrap())
        .collect()
}

#[tokio::test]
async fn the_reaper_deletes_only_rows_expired_past_the_grace() {
    let (url, table) = fresh("reap").await;
    let lock = PostgresLock::connect(&url).await.unwrap();
    let pool = admin().await;
    insert_rows(
        &pool,
        &table,
        &[
            ("old/1", 600),
            ("old/2", 3600),
            ("old/3", 301),
            ("recent", 30),
        ],
    )
    .await;
    let live = LockKey::new("live").unwrap();
    let released = LockKey::new("released").unwrap();
    let opts = ttl(Duration::from_secs(60));
    lock.try_acquire(&live, &opts).await.unwrap().unwrap();
    let r = lock.try_acquire(&released, &opts).await.unwrap().unwrap();
    lock.release(&r).await.unwrap();

    assert_eq!(lock.reap_expired().await.unwrap(), Some(3));
    assert_eq!(
        keys_left(&pool, &table).await,
        ["live", "recent", "released"]
    );
    assert_eq!(lock.reap_expired().await.unwrap(), Some(0));
    // A shorter grace reaches the recently expired rows, never a live one.
    assert_eq!(
        lock.reap_expired_older_than(Duration::from_secs(60))
            .await
            .unwrap(),
        Some(0)
    );
    match lock.reap_expired_older_than(Duration::from_secs(10)).await {
        Err(Error::InvalidOptions { .. }) => {}
        other => panic!("a 10 s grace was accepted: {other:?}"),
    }
    drop_tables(&table).await;
}

#[tokio::test]
async fn two_reapers_never_delete_at_once() {
    let (url, table) = fresh("reap2").await;
    let (a, b) = (
        PostgresLock::connect(&url).await.unwrap(),
        PostgresLock::connect(&url).await.unwrap(),
    );
    let pool = admin().await;
    exec(
        &pool,
        &format!(
            "INSERT INTO \"{table}\" (lock_key, owner, token, reentrant_count, expire_at, created_at) \
             SELECT convert_to('dead/' || i, 'UTF8'), 'dead', nextval('\"{table}_token\"'), 0, \
             clock_timestamp() - interval '1 hour', clock_timestamp() - interval '2 hours' \
             FROM generate_series(1, 1200) AS i"
        ),
    )
    .await;
    // Another reaper mid-batch: its guard is held in an open transaction.
    let mut other = pool.begin().await.unwrap();
    sqlx::query("SELECT pg_advisory_xact_lock($1, hashtext($2))")
        .bind(GUARD_CLASS)
        .bind(format!("reaper:{table}"))
        .execute(&mut *other)
        .await
        .unwrap();
    assert_eq!(a.reap_expired().await.unwrap(), None);
    assert_eq!(keys_left(&pool, &table).await.len(), 1200);
    other.rollback().await.unwrap();

    // Two at once: whichever finds the guard taken stops; together they
    // delete every row exactly once, without an error.
    let (ra, rb) = tokio::join!(a.reap_expired(), b.reap_expired());
    let total = ra.unwrap().unwrap_or(0) + rb.unwrap().unwrap_or(0);
    assert_eq!(total, 1200);
    assert!(keys_left(&pool, &table).await.is_empty());

    // In the background, until the handle is dropped.
    insert_rows(&pool, &table, &[("late/1", 900), ("late/2", 900)]).await;
    let reaper = a.start_reaper(Duration::from_millis(50)).unwrap();
    let start = Instant::now();
    while !keys_left(&pool, &table).await.is_empty() {
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "the background reaper did nothing"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    reaper.stop();
    insert_rows(&pool, &table, &[("later", 900)]).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        keys_left(&pool, &table).await,
        ["later"],
        "a stopped reaper ran"
    );
    drop_tables(&table).await;
}

#[tokio::test]
async fn migrate_is_idempotent_and_safe_from_many_clients_at_once() {
    let (url, table) = fresh("migrate").await;
    let runs: Vec<_> = (0..8)
        .map(|_| {
            let url = url.clone();
            tokio::spawn(async move { PostgresLock::migrate(&url).await })
        })
        .collect();
    let mut applied = Vec::new();
    for run in runs {
        applied.extend(run.await.unwrap().unwrap());
    }
    assert_eq!(applied, [1, 2, 3], "each version applied exactly once");
    assert!(PostgresLock::migrate(&url).await.unwrap().is_empty());
    drop_tables(&table).await;

    // Connects create missing tables the same way, many at once.
    let (url, table) = fresh("connects").await;
    let connects: Vec<_> = (0..8)
        .map(|_| {
            let url = url.clone();
            tokio::spawn(async move { PostgresLock::connect(&url).await })
        })
        .collect();
    for c in connects {
        let lock = c.await.unwrap().unwrap();
        assert!(lock
            .try_acquire(&key("c"), &ttl(Duration::from_secs(5)))
            .await
            .unwrap()
            .is_some());
    }
    assert!(PostgresLock::migrate(&url).await.unwrap().is_empty());
    drop_tables(&table).await;
}

#[tokio::test]
async fn a_missing_table_is_a_config_error_naming_migrate() {
    let (url, table) = fresh("missing").await;
    let lock = PostgresLock::connect(&url).await.unwrap();
    drop_tables(&table).await;
    let k = key("missing");
    let opts = ttl(Duration::from_secs(5));
    let errors = [
        lock.try_acquire(&k, &opts).await.map(drop).unwrap_err(),
        lock.inspect(&k).await.map(drop).unwrap_err(),
        lock.list(10).await.map(drop).unwrap_err(),
        lock.force_release(&k).await.map(drop).unwrap_err(),
    ];
    for e in errors {
        assert!(matches!(e, Error::Config { .. }), "{e:?}");
        assert!(e.to_string().contains("migrate"), "{e}");
    }
}

/// Measured on a private server that logs every statement: what one
/// acquire and one release cost the database.
#[tokio::test]
async fn an_acquire_and_a_release_are_one_statement_each() {
    let server = PrivatePostgres::start(PostgresOptions {
        extra: vec!["log_statement=all".into()],
        ..PostgresOptions::default()
    })
    .await
    .unwrap();
    let url = url_for(&server.url(), Strategy::Lease, "fenced_count");
    let lock = PostgresLock::connect(&url).await.unwrap();
    let k = key("count");
    let opts = ttl(Duration::from_secs(30));
    // Warm-up: the statements are prepared once per connection.
    let l = lock.try_acquire(&k, &opts).await.unwrap().unwrap();
    lock.release(&l).await.unwrap();
    server.admin("SELECT 'fenced-count-start'").await.unwrap();
    const ROUNDS: usize = 20;
    for _ in 0..ROUNDS {
        let l = lock.try_acquire(&k, &opts).await.unwrap().unwrap();
        assert_eq!(lock.release(&l).await.unwrap(), ReleaseOutcome::Released);
    }
    server.admin("SELECT 'fenced-count-end'").await.unwrap();
    let log = std::fs::read_to_string(server.log_file()).unwrap();
    let window = log
        .split("fenced-count-start")
        .nth(1)
        .and_then(|rest| rest.split("fenced-count-end").next())
        .unwrap();
    let statements: Vec<&str> = window
        .lines()
        .filter(|l| l.contains("LOG:  execute") || l.contains("LOG:  statement:"))
        .collect();
    let grants = statements
        .iter()
        .filter(|l| l.contains("INSERT INTO \"fenced_count\""))
        .count();
    let releases = statements
        .iter()
        .filter(|l| l.contains("WITH r AS (UPDATE \"fenced_count\""))
        .count();
    eprintln!(
        "{} statements for {ROUNDS} acquire+release pairs ({grants} grants, {releases} releases)",
        statements.len()
    );
    assert_eq!((grants, releases), (ROUNDS, ROUNDS));
    // Besides them: the end marker, and the session set-up of any
    // connection the pool opened meanwhile.
    let others: Vec<&&str> = statements
        .iter()
        .filter(|l| {
            !l.contains("\"fenced_count\"") && !l.contains("set_config('synchronous_commit'")
        })
        .collect();
    assert_eq!(others.len(), 1, "{others:#?}");
}

/// Leases each with its own owner (what a `LockClient` without a
/// configured owner holds), renewed by `extend_many`: one statement per
/// chunk of 256, whatever their owners — counted on a private server that
/// logs every statement — and a forged lease among them (another owner, a
/// current token) is refused by that same statement.
#[tokio::test]
async fn a_batch_of_many_owners_is_one_statement_per_chunk() {
    const LEASES: usize = 300;
    let server = PrivatePostgres::start(PostgresOptions {
        extra: vec!["log_statement=all".into()],
        ..PostgresOptions::default()
    })
    .await
    .unwrap();
    let url = url_for(&server.url(), Strategy::Lease, "fenced_batch");
    let lock = PostgresLock::connect(&url).await.unwrap();
    let opts = ttl(Duration::from_secs(30));
    let mut leases = Vec::new();
    for i in 0..LEASES {
        leases.push(
            lock.try_acquire(&key(&format!("batch{i}")), &opts)
                .await
                .unwrap()
                .unwrap(),
        );
    }
    let owners: std::collections::HashSet<_> = leases.iter().map(|l| &l.owner).collect();
    assert_eq!(owners.len(), LEASES, "every acquisition has its own owner");
    let forged = fenced_api::Lease::new(
        leases[1].key.clone(),
        fenced_api::Owner::random(),
        leases[1].token,
        leases[1].ttl,
        Instant::now(),
    );
    server.admin("SELECT 'fenced-batch-start'").await.unwrap();
    let renewed = lock.extend_many(&leases, Duration::from_secs(60)).await;
    let mixed = lock
        .extend_many(&[leases[0].clone(), forged], Duration::from_secs(60))
        .await;
    server.admin("SELECT 'fenced-batch-end'").await.unwrap();
    assert!(renewed.iter().all(Result::is_ok), "{renewed:?}");
    assert!(
        mixed[0].is_ok() && matches!(mixed[1], Err(Error::LeaseLost { .. })),
        "{mixed:?}"
    );
    let log = std::fs::read_to_string(server.log_file()).unwrap();
    let window = log
        .split("fenced-batch-start")
        .nth(1)
        .and_then(|rest| rest.split("fenced-batch-end").next())
        .unwrap();
    let renewals: Vec<&str> = window
        .lines()
        .filter(|l| l.contains("LOG:  execute") && l.contains("\"fenced_batch\""))
        .collect();
    let batches = renewals.iter().filter(|l| l.contains("unnest(")).count();
    // 256 + 44, then the current and the forged lease together.
    assert_eq!(
        (batches, renewals.len()),
        (3, 3),
        "renewal statements: {renewals:#?}"
    );
}
