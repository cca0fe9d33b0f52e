//! The `advisory` strategy on real servers: what the conformance suite does
//! not cover. The key hash against its documented SQL; the lock as
//! `pg_locks` and other sessions see it; a holder whose session is
//! terminated, frozen (a stopped process) or silent; a hash collision; the
//! bound on lock connections; a cancelled wait; tokens across a restart;
//! leases presented to another handle; force-release of a holder outside
//! fenced; the privilege `force_release` needs.
//!
//! Timings measured here are printed (`--nocapture`) and summarised in
//! the crate docs ("The advisory strategy").

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::print_stderr,
    clippy::print_stdout
)]

mod common;

use std::time::Duration;

use common::{
    admin, drop_tables, fresh_table, key, next_line, server_url, ttl, unix_micros, url_for,
    wait_opts,
};
use fenced_api::{DistributedLock, Error, Lease, LockKey, LockOptions, ReleaseOutcome};
use fenced_postgres::{advisory_key, PostgresLock, Strategy, TableName, ADVISORY_KEY_SQL};
use fenced_testkit::private::{PostgresOptions, PrivatePostgres};
use sqlx::{Connection, PgConnection, Row};
use tokio::{
    io::{AsyncBufReadExt, BufReader},
    time::Instant,
};

/// A fresh `advisory` table on the shared server: its URL (with `extra`
/// parameters) and name.
async fn fresh(tag: &str, extra: &str) -> (String, String) {
    let table = fresh_table(tag);
    (
        format!(
            "{}{extra}",
            url_for(&server_url().await, Strategy::Advisory, &table)
        ),
        table,
    )
}

fn hash_of(table: &str, k: &LockKey) -> i64 {
    advisory_key(&TableName::new(table).unwrap(), k)
}

/// The session (pid) the registry names as the holder of `k`.
async fn holder_pid(pool: &sqlx::PgPool, table: &str, k: &LockKey) -> i32 {
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT pid FROM \"{table}_advisory\" WHERE lock_key = $1"
    )))
    .bind(k.as_bytes())
    .fetch_one(pool)
    .await
    .unwrap()
    .try_get::<Option<i32>, _>(0)
    .unwrap()
    .expect("no holder pid recorded")
}

/// Sessions holding a granted advisory lock on `hash` in this database.
async fn sessions_holding(pool: &sqlx::PgPool, hash: i64) -> Vec<i32> {
    sqlx::query(
        "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted AND objsubid = 1 \
         AND database = (SELECT oid FROM pg_database WHERE datname = current_database()) \
         AND classid = ($1 >> 32 & 4294967295)::oid AND objid = ($1 & 4294967295)::oid",
    )
    .bind(hash)
    .fetch_all(pool)
    .await
    .unwrap()
    .iter()
    .map(|r| r.get::<i32, _>(0))
    .collect()
}

async fn terminate(pool: &sqlx::PgPool, pid: i32) {
    let ended: bool = sqlx::query("SELECT pg_terminate_backend($1)")
        .bind(pid)
        .fetch_one(pool)
        .await
        .unwrap()
        .get(0);
    assert!(ended, "pg_terminate_backend({pid}) found no session");
}

/// `pg_try_advisory_lock` of the documented key expression, on `c`.
async fn try_formula(c: &mut PgConnection, table: &str, k: &LockKey) -> bool {
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT pg_try_advisory_lock({ADVISORY_KEY_SQL})"
    )))
    .bind(table)
    .bind(k.as_bytes())
    .fetch_one(c)
    .await
    .unwrap()
    .get(0)
}

fn expect_lost(r: fenced_api::Result<Lease>, what: &str) -> String {
    match r {
        Err(e @ Error::LeaseLost { .. }) => e.to_string(),
        other => panic!("{what}: expected LeaseLost, got {other:?}"),
    }
}

/// `advisory_key` is the SQL expression the docs give, evaluated by the
/// server, for awkward keys and table names too; and the documented value.
#[tokio::test]
async fn the_key_hash_is_the_documented_sql_expression() {
    let pool = admin().await;
    for (table, k) in [
        ("fenced_locks", "order:1001"),
        ("fenced_locks", "ключ/ü ✓"),
        ("jobs", "100% _done_ \\ 'quoted' \"twice\""),
        ("a", " "),
        ("fenced_t_0123456789abcdef0123456789abcdef012345", "x"),
    ] {
        let key = LockKey::new(k).unwrap();
        let server: i64 = sqlx::query(sqlx::AssertSqlSafe(format!("SELECT {ADVISORY_KEY_SQL}")))
            .bind(table)
            .bind(key.as_bytes())
            .fetch_one(&pool)
            .await
            .unwrap()
            .get(0);
        assert_eq!(hash_of(table, &key), server, "{table} {k:?}");
    }
    let documented = LockKey::new("order:1001").unwrap();
    assert_eq!(
        hash_of("fenced_locks", &documented),
        -550_903_650_157_692_581
    );
}

/// A held key is a granted `pg_locks` row of the holding session with
/// `classid` the high half of the key, `objid` the low half, `objsubid` 1;
/// any session taking the documented key is refused while fenced holds it
/// and gets it once fenced releases (and fenced is refused while it holds).
#[tokio::test]
async fn other_sessions_see_and_respect_the_lock() {
    let (url, table) = fresh("adv_interop", "").await;
    let pool = admin().await;
    let lock = PostgresLock::connect(&url).await.unwrap();
    let k = key("interop");
    let lease = lock
        .try_acquire(&k, &ttl(Duration::from_secs(30)))
        .await
        .unwrap()
        .unwrap();
    let hash = hash_of(&table, &k);
    let pid = holder_pid(&pool, &table, &k).await;
    assert_eq!(sessions_holding(&pool, hash).await, [pid]);

    let mut other = PgConnection::connect(&server_url().await).await.unwrap();
    assert!(
        !try_formula(&mut other, &table, &k).await,
        "taken while fenced held it"
    );
    assert_eq!(
        lock.release(&lease).await.unwrap(),
        ReleaseOutcome::Released
    );
    assert!(sessions_holding(&pool, hash).await.is_empty());
    assert!(
        try_formula(&mut other, &table, &k).await,
        "refused after fenced released"
    );
    assert!(
        lock.try_acquire(&k, &ttl(Duration::from_secs(5)))
            .await
            .unwrap()
            .is_none(),
        "fenced took a key another session holds"
    );
    other.close().await.unwrap();
    drop_tables(&table).await;
}

/// `pg_terminate_backend` of the holding session: the holder's next
/// extend fails with `LeaseLost` at once, its release is `NotHeld`,
/// inspect shows the waiter that got the key, and that waiter's token is
/// larger. The holder learns of it at its next call (nothing tells
/// `LockClient` sooner); the waiter is granted as soon as the session is
/// gone. Both delays are printed.
#[tokio::test]
async fn a_terminated_holder_loses_the_lease_and_the_next_token_is_larger() {
    let (url, table) = fresh("adv_term", "").await;
    let pool = admin().await;
    let holder = PostgresLock::connect(&url).await.unwrap();
    let waiter = PostgresLock::connect(&url).await.unwrap();
    let k = key("term");
    let lease = holder
        .try_acquire(&k, &ttl(Duration::from_secs(60)))
        .await
        .unwrap()
        .unwrap();
    let waiting = {
        let (waiter, k) = (waiter.clone(), k.clone());
        tokio::spawn(async move {
            let l = waiter
                .acquire(
                    &k,
                    &wait_opts(Duration::from_secs(60), Duration::from_secs(30)),
                )
                .await;
            (l, Instant::now())
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!waiting.is_finished());

    let pid = holder_pid(&pool, &table, &k).await;
    terminate(&pool, pid).await;
    let told = Instant::now();
    let lost = holder.extend(&lease, Duration::from_secs(60)).await;
    let holder_knew = told.elapsed();
    let reason = expect_lost(lost, "extend after pg_terminate_backend");
    assert!(reason.contains("terminated"), "{reason}");
    let (got, granted_at) = waiting.await.unwrap();
    let got = got.unwrap();
    assert!(
        got.token > lease.token,
        "token {} after {}",
        got.token,
        lease.token
    );
    eprintln!(
        "pg_terminate_backend of the holder: the holder's extend failed {holder_knew:?} after \
         the terminate returned; the waiter was granted {:?} after it",
        granted_at.saturating_duration_since(told)
    );
    assert!(holder_knew < Duration::from_secs(1), "{holder_knew:?}");
    assert!(
        granted_at.saturating_duration_since(told) < Duration::from_secs(2),
        "the waiter waited on after the holder's session ended"
    );
    assert_eq!(
        holder.release(&lease).await.unwrap(),
        ReleaseOutcome::NotHeld
    );
    let info = holder.inspect(&k).await.unwrap().expect("the new holder");
    assert_eq!((info.token, &info.owner), (got.token, &got.owner));
    waiter.release(&got).await.unwrap();
    drop_tables(&table).await;
}

/// The connection broken under a holder (its backend killed, nobody
/// waiting): extend is `LeaseLost`, release `NotHeld`, inspect and list show
/// no holder, and the key is free for anyone with a larger token.
#[tokio::test]
async fn a_broken_holder_connection_leaves_no_holder() {
    let (url, table) = fresh("adv_broken", "").await;
    let pool = admin().await;
    let a = PostgresLock::connect(&url).await.unwrap();
    let k = key("broken");
    let lease = a
        .try_acquire(&k, &ttl(Duration::from_secs(60)))
        .await
        .unwrap()
        .unwrap();
    let pid = holder_pid(&pool, &table, &k).await;
    terminate(&pool, pid).await;
    // The session is gone once pg_locks no longer shows it.
    let start = Instant::now();
    while !sessions_holding(&pool, hash_of(&table, &k))
        .await
        .is_empty()
    {
        assert!(start.elapsed() < Duration::from_secs(5), "still held");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(a.inspect(&k).await.unwrap().is_none());
    assert!(a.list(10).await.unwrap().is_empty());
    expect_lost(a.extend(&lease, Duration::from_secs(60)).await, "extend");
    assert_eq!(a.release(&lease).await.unwrap(), ReleaseOutcome::NotHeld);
    let b = PostgresLock::connect(&url).await.unwrap();
    let next = b
        .try_acquire(&k, &ttl(Duration::from_secs(5)))
        .await
        .unwrap()
        .expect("the key of a killed holder");
    assert!(next.token > lease.token);
    b.release(&next).await.unwrap();
    drop_tables(&table).await;
}

/// A holder that stops sending (no extend, nothing) keeps the key for its
/// TTL and loses it then: the server ends its idle session. The waiter is
/// granted at the TTL (measured from the grant), with a larger token; the
/// holder's next extend says why it lost the lease.
#[tokio::test]
async fn a_silent_holder_loses_the_key_when_its_ttl_passes_on_the_server() {
    let (url, table) = fresh("adv_silent", "").await;
    let a = PostgresLock::connect(&url).await.unwrap();
    let b = PostgresLock::connect(&url).await.unwrap();
    let k = key("silent");
    let ttl_d = Duration::from_millis(1500);
    let sent = Instant::now();
    let lease = a.try_acquire(&k, &ttl(ttl_d)).await.unwrap().unwrap();
    let got = b
        .acquire(
            &k,
            &wait_opts(Duration::from_secs(5), Duration::from_secs(10)),
        )
        .await
        .unwrap();
    let after = sent.elapsed();
    eprintln!(
        "silent holder, ttl {ttl_d:?}: the waiter got the key {after:?} after the grant was sent"
    );
    assert!(after >= ttl_d, "freed after {after:?}, before the ttl");
    assert!(
        after < ttl_d + Duration::from_secs(1),
        "freed only after {after:?}"
    );
    assert!(got.token > lease.token);
    let reason = expect_lost(a.extend(&lease, ttl_d).await, "extend of the silent holder");
    assert!(reason.contains("idle session"), "{reason}");
    b.release(&got).await.unwrap();
    drop_tables(&table).await;
}

/// The holder half of [`a_frozen_holder_process_loses_the_key_after_its_ttl`]:
/// does nothing unless that test started this binary for it.
#[tokio::test]
async fn child_holder() {
    let (Ok(url), Ok(k), Ok(ms)) = (
        std::env::var("FENCED_PG_ADV_CHILD_URL"),
        std::env::var("FENCED_PG_ADV_CHILD_KEY"),
        std::env::var("FENCED_PG_ADV_CHILD_TTL_MS"),
    ) else {
        return;
    };
    let lock = PostgresLock::connect(&url).await.unwrap();
    let k = LockKey::new(k).unwrap();
    let ttl_d = Duration::from_millis(ms.parse().unwrap());
    let lease = lock.try_acquire(&k, &ttl(ttl_d)).await.unwrap().unwrap();
    println!("CHILD HELD {} {}", lease.token, unix_micros());
    // Stopped (SIGSTOP) from here on by the parent.
    tokio::time::sleep(Duration::from_secs(60)).await;
}

/// A holder process frozen by SIGSTOP — its TCP connection open, its
/// kernel still acknowledging, nothing sent — loses the key after its TTL:
/// the server ends its session for idleness. TCP keepalives could not
/// (the stopped process's kernel answers them).
#[tokio::test]
async fn a_frozen_holder_process_loses_the_key_after_its_ttl() {
    let (url, table) = fresh("adv_frozen", "").await;
    let k = key("frozen");
    let ttl_ms = 2000u64;
    let mut child = tokio::process::Command::new(std::env::current_exe().unwrap())
        .args(["child_holder", "--exact", "--nocapture", "--test-threads=1"])
        .env("FENCED_PG_ADV_CHILD_URL", &url)
        .env("FENCED_PG_ADV_CHILD_KEY", k.as_str())
        .env("FENCED_PG_ADV_CHILD_TTL_MS", ttl_ms.to_string())
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let held = next_line(&mut lines, "CHILD HELD").await;
    let (token, at_us) = held.split_once(' ').unwrap();
    let child_pid = child.id().unwrap().to_string();
    let stopped = std::process::Command::new("kill")
        .args(["-STOP", &child_pid])
        .status()
        .unwrap();
    assert!(stopped.success());
    let b = PostgresLock::connect(&url).await.unwrap();
    let got = b
        .acquire(
            &k,
            &wait_opts(Duration::from_secs(5), Duration::from_secs(15)),
        )
        .await
        .unwrap();
    let gap_us = unix_micros() - at_us.parse::<i64>().unwrap();
    let gap = Duration::from_micros(u64::try_from(gap_us).unwrap());
    eprintln!(
        "SIGSTOPped holder, ttl {ttl_ms} ms: the key was granted {gap:?} after the holder's grant"
    );
    let ttl_d = Duration::from_millis(ttl_ms);
    // The holder printed after its reply arrived; the server's idle timer
    // started before that, by at most the reply's way back.
    assert!(
        gap + Duration::from_millis(50) >= ttl_d,
        "freed after {gap:?}"
    );
    assert!(
        gap < ttl_d + Duration::from_secs(1),
        "freed only after {gap:?}"
    );
    assert!(got.token.get() > token.parse::<u64>().unwrap());
    b.release(&got).await.unwrap();
    let _ = std::process::Command::new("kill")
        .args(["-KILL", &child_pid])
        .status();
    let _ = child.wait().await;
    drop_tables(&table).await;
}

/// A key whose hash another key already has in the registry (arranged by
/// hand: a real SHA-256 collision cannot be found) is refused with a
/// non-retryable error naming both keys — by try_acquire and acquire alike,
/// at once — and no advisory lock is taken.
#[tokio::test]
async fn a_hash_collision_is_refused_naming_both_keys() {
    let (url, table) = fresh("adv_collide", "").await;
    let pool = admin().await;
    let lock = PostgresLock::connect(&url).await.unwrap();
    let k = key("victim");
    let hash = hash_of(&table, &k);
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "INSERT INTO \"{table}_advisory\" (lock_key, hash) VALUES ($1, $2)"
    )))
    .bind(b"the-other-key".as_slice())
    .bind(hash)
    .execute(&pool)
    .await
    .unwrap();
    let long = wait_opts(Duration::from_secs(10), Duration::from_secs(30));
    let start = Instant::now();
    for r in [
        lock.try_acquire(&k, &long).await.map(|_| ()),
        lock.acquire(&k, &long).await.map(|_| ()),
    ] {
        match r {
            Err(e @ Error::Config { .. }) => {
                let text = e.to_string();
                assert!(!e.is_retryable());
                assert!(
                    text.contains(k.as_str()) && text.contains("the-other-key"),
                    "{text}"
                );
                assert!(text.contains(&hash.to_string()), "{text}");
            }
            other => panic!("expected a collision error, got {other:?}"),
        }
    }
    assert!(start.elapsed() < Duration::from_secs(2));
    assert!(sessions_holding(&pool, hash).await.is_empty());
    let rows: i64 = sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT count(*) FROM \"{table}_advisory\" WHERE lock_key = $1"
    )))
    .bind(k.as_bytes())
    .fetch_one(&pool)
    .await
    .unwrap()
    .get(0);
    assert_eq!(rows, 0, "the colliding key was recorded");
    drop_tables(&table).await;
}

/// `max_lock_connections=2`: two held locks take both lock connections; a
/// third `try_acquire` is refused with the documented retryable error (no
/// wait), an `acquire` waits for a connection and gets its key as soon as
/// one of the two is released.
#[tokio::test]
async fn max_lock_connections_bounds_holds_and_waits() {
    let (url, table) = fresh("adv_bound", "&max_lock_connections=2").await;
    let lock = PostgresLock::connect(&url).await.unwrap();
    let long = ttl(Duration::from_secs(60));
    let (k1, k2, k3) = (key("b1"), key("b2"), key("b3"));
    let l1 = lock.try_acquire(&k1, &long).await.unwrap().unwrap();
    let l2 = lock.try_acquire(&k2, &long).await.unwrap().unwrap();
    let start = Instant::now();
    match lock.try_acquire(&k3, &long).await {
        Err(e @ Error::Backend { .. }) => {
            assert!(e.is_retryable(), "{e}");
            let text = e.to_string();
            assert!(
                text.contains("max_lock_connections") && text.contains("all 2"),
                "{text}"
            );
        }
        other => panic!("expected the bound's error, got {other:?}"),
    }
    assert!(start.elapsed() < Duration::from_secs(1));
    let waiting = {
        let (lock, k3) = (lock.clone(), k3.clone());
        tokio::spawn(async move {
            let l = lock
                .acquire(
                    &k3,
                    &wait_opts(Duration::from_secs(60), Duration::from_secs(20)),
                )
                .await;
            (l, Instant::now())
        })
    };
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(!waiting.is_finished(), "acquired a third lock connection");
    let released = Instant::now();
    assert_eq!(lock.release(&l1).await.unwrap(), ReleaseOutcome::Released);
    let (l3, at) = waiting.await.unwrap();
    let l3 = l3.unwrap();
    assert!(at.saturating_duration_since(released) < Duration::from_secs(2));
    // A bounded acquire that finds no connection in time is a Timeout.
    match lock
        .acquire(
            &k1,
            &wait_opts(Duration::from_secs(5), Duration::from_millis(300)),
        )
        .await
    {
        Err(Error::Timeout { waited, .. }) => assert!(waited >= Duration::from_millis(290)),
        other => panic!("expected Timeout, got {other:?}"),
    }
    lock.release(&l2).await.unwrap();
    lock.release(&l3).await.unwrap();
    drop_tables(&table).await;
}

/// An `acquire` dropped while it waits in the server's queue leaves
/// nothing: its session leaves the queue within the connection check
/// interval (printed), and the key is free for a third client right after
/// the holder releases.
#[tokio::test]
async fn a_cancelled_wait_leaves_nothing_behind() {
    let (url, table) = fresh("adv_cancel", "").await;
    let pool = admin().await;
    let (a, b, c) = (
        PostgresLock::connect(&url).await.unwrap(),
        PostgresLock::connect(&url).await.unwrap(),
        PostgresLock::connect(&url).await.unwrap(),
    );
    let k = key("cancel");
    let held = a
        .try_acquire(&k, &ttl(Duration::from_secs(60)))
        .await
        .unwrap()
        .unwrap();
    let hash = hash_of(&table, &k);
    let waiting_sessions = || {
        let pool = pool.clone();
        async move {
            sqlx::query(
                "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND NOT granted \
                 AND objsubid = 1 AND ((classid::bigint << 32) | objid::bigint) = $1",
            )
            .bind(hash)
            .fetch_all(&pool)
            .await
            .unwrap()
            .len()
        }
    };
    let waited = tokio::time::timeout(
        Duration::from_millis(500),
        b.acquire(
            &k,
            &wait_opts(Duration::from_secs(60), Duration::from_secs(60)),
        ),
    )
    .await;
    assert!(waited.is_err(), "the waiter finished: {waited:?}");
    let dropped = Instant::now();
    while waiting_sessions().await > 0 {
        assert!(
            dropped.elapsed() < Duration::from_secs(3),
            "the dropped waiter is still in the queue"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    eprintln!(
        "a dropped acquire left the server's queue {:?} after the drop",
        dropped.elapsed()
    );
    assert_eq!(a.release(&held).await.unwrap(), ReleaseOutcome::Released);
    let next = c
        .try_acquire(&k, &ttl(Duration::from_secs(5)))
        .await
        .unwrap()
        .expect("the key right after the release");
    assert!(next.token > held.token);
    c.release(&next).await.unwrap();
    drop_tables(&table).await;
}

/// Locks connections are kept between holds: a second hold through the
/// same handle runs on the session of the first (no new connection), also
/// after a wait that timed out.
#[tokio::test]
async fn lock_connections_are_reused_between_holds() {
    let (url, table) = fresh("adv_reuse", "").await;
    let pool = admin().await;
    let a = PostgresLock::connect(&url).await.unwrap();
    let b = PostgresLock::connect(&url).await.unwrap();
    let k = key("reuse");
    let first = a
        .try_acquire(&k, &ttl(Duration::from_secs(10)))
        .await
        .unwrap()
        .unwrap();
    let pid = holder_pid(&pool, &table, &k).await;
    a.release(&first).await.unwrap();
    let blocker = b
        .try_acquire(&k, &ttl(Duration::from_secs(10)))
        .await
        .unwrap()
        .unwrap();
    let short_wait = wait_opts(Duration::from_secs(10), Duration::from_millis(200));
    assert!(matches!(
        a.acquire(&k, &short_wait).await,
        Err(Error::Timeout { .. })
    ));
    b.release(&blocker).await.unwrap();
    let second = a
        .try_acquire(&k, &ttl(Duration::from_secs(10)))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(holder_pid(&pool, &table, &k).await, pid, "a new connection");
    a.release(&second).await.unwrap();
    drop_tables(&table).await;
}

/// Tokens come from a sequence: they keep rising across a server crash
/// (more grants than the 32 values the sequence logs ahead, most of them
/// committed without a WAL flush: the registry is unlogged), while the held
/// lock ends with its session (the holder's extend is `LeaseLost`, the key
/// is free after the restart) and the registry comes back empty.
#[tokio::test]
async fn tokens_keep_rising_across_a_restart_and_holds_end_with_it() {
    let server = PrivatePostgres::start(PostgresOptions::default())
        .await
        .unwrap();
    let url = url_for(&server.url(), Strategy::Advisory, "fenced_restart");
    let a = PostgresLock::connect(&url).await.unwrap();
    let k = LockKey::new("restart/held").unwrap();
    let long = ttl(Duration::from_secs(120));
    let mut before = 0;
    for i in 0..100 {
        let other = LockKey::new(format!("restart/churn{}", i % 10)).unwrap();
        let l = a.try_acquire(&other, &long).await.unwrap().unwrap();
        before = before.max(l.token.get());
        a.release(&l).await.unwrap();
    }
    let held = a.try_acquire(&k, &long).await.unwrap().unwrap();
    before = before.max(held.token.get());
    server.restart().await.unwrap();
    expect_lost(
        a.extend(&held, Duration::from_secs(60)).await,
        "extend after the restart",
    );
    let b = PostgresLock::connect(&url).await.unwrap();
    assert!(b.inspect(&k).await.unwrap().is_none());
    let mut c = PgConnection::connect(&server.url()).await.unwrap();
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM fenced_restart_advisory")
        .fetch_one(&mut c)
        .await
        .unwrap();
    assert_eq!(rows, 0, "the unlogged registry after the crash");
    let after = b
        .try_acquire(&k, &long)
        .await
        .unwrap()
        .expect("the key after the restart");
    assert!(
        after.token.get() > before,
        "token {} after the restart, {before} before",
        after.token
    );
    b.release(&after).await.unwrap();
}

/// A lease presented to a handle that does not hold it: release ends the
/// holding session (the lease is the capability), extend is refused as
/// unsupported while the lease is current and `LeaseLost` once it is not.
#[tokio::test]
async fn a_lease_presented_to_another_handle() {
    let (url, table) = fresh("adv_foreign", "").await;
    let a = PostgresLock::connect(&url).await.unwrap();
    let b = PostgresLock::connect(&url).await.unwrap();
    let k = key("foreign");
    let lease = a
        .try_acquire(&k, &ttl(Duration::from_secs(60)))
        .await
        .unwrap()
        .unwrap();
    match b.extend(&lease, Duration::from_secs(60)).await {
        Err(Error::Unsupported { what, .. }) => {
            assert!(what.contains("through that handle"), "{what}")
        }
        other => panic!("expected Unsupported, got {other:?}"),
    }
    assert_eq!(b.release(&lease).await.unwrap(), ReleaseOutcome::Released);
    assert!(b.inspect(&k).await.unwrap().is_none());
    expect_lost(
        a.extend(&lease, Duration::from_secs(60)).await,
        "the holder's extend",
    );
    expect_lost(
        b.extend(&lease, Duration::from_secs(60)).await,
        "a stale lease elsewhere",
    );
    assert_eq!(b.release(&lease).await.unwrap(), ReleaseOutcome::NotHeld);
    drop_tables(&table).await;
}

/// The same explicit owner through a second handle is its own session:
/// the server would make it wait for itself. It is told `AlreadyHeld` at
/// once instead (`Unsupported` when it asked to re-enter).
#[tokio::test]
async fn the_same_owner_through_another_handle_is_refused_at_once() {
    let (url, table) = fresh("adv_owner", "").await;
    let a = PostgresLock::connect(&url).await.unwrap();
    let b = PostgresLock::connect(&url).await.unwrap();
    let k = key("owner");
    let opts = LockOptions::builder()
        .ttl(Duration::from_secs(30))
        .wait_timeout(Duration::from_secs(10))
        .owner("worker-7")
        .build()
        .unwrap();
    let lease = a.try_acquire(&k, &opts).await.unwrap().unwrap();
    let start = Instant::now();
    assert!(matches!(
        b.acquire(&k, &opts).await,
        Err(Error::AlreadyHeld { .. })
    ));
    assert!(matches!(
        b.try_acquire(&k, &opts).await,
        Err(Error::AlreadyHeld { .. })
    ));
    let reentrant = opts.to_builder().reentrant(true).build().unwrap();
    assert!(matches!(
        b.acquire(&k, &reentrant).await,
        Err(Error::Unsupported { .. })
    ));
    assert!(
        start.elapsed() < Duration::from_secs(2),
        "{:?}",
        start.elapsed()
    );
    // Through the holding handle, re-entry counts.
    let again = a.acquire(&k, &reentrant).await.unwrap();
    assert_eq!(again.token, lease.token);
    assert_eq!(b.inspect(&k).await.unwrap().unwrap().hold_count, 2);
    assert_eq!(
        a.release(&again).await.unwrap(),
        ReleaseOutcome::StillHeld { remaining: 1 }
    );
    assert_eq!(a.release(&lease).await.unwrap(), ReleaseOutcome::Released);
    drop_tables(&table).await;
}

/// A session that took the key by the documented formula, outside fenced,
/// holds it without a registry row: fenced is refused, sees no holder to
/// describe, and `force_release` ends that session all the same.
#[tokio::test]
async fn force_release_ends_a_holder_outside_fenced() {
    let (url, table) = fresh("adv_outside", "").await;
    let lock = PostgresLock::connect(&url).await.unwrap();
    let k = key("outside");
    let mut other = PgConnection::connect(&server_url().await).await.unwrap();
    assert!(try_formula(&mut other, &table, &k).await);
    let long = ttl(Duration::from_secs(10));
    assert!(lock.try_acquire(&k, &long).await.unwrap().is_none());
    assert!(lock.inspect(&k).await.unwrap().is_none());
    assert!(lock.force_release(&k).await.unwrap(), "nothing was ended");
    assert!(!lock.force_release(&k).await.unwrap(), "ended twice");
    let lease = lock
        .try_acquire(&k, &long)
        .await
        .unwrap()
        .expect("the key after force_release");
    assert!(sqlx::query("SELECT 1").execute(&mut other).await.is_err());
    lock.release(&lease).await.unwrap();
    drop_tables(&table).await;
}

/// `force_release` signals the holding session: a role that is neither the
/// holder's role (nor a member of it) nor in `pg_signal_backend` is refused
/// with a configuration error naming what it needs, and the holder keeps the key; granted
/// `pg_signal_backend`, the same role ends it. On a private server (roles
/// are cluster-wide).
#[tokio::test]
async fn force_release_needs_the_right_to_signal_the_holder() {
    let server = PrivatePostgres::start(PostgresOptions::default())
        .await
        .unwrap();
    server
        .admin(
            "CREATE ROLE app_a LOGIN; CREATE ROLE app_b LOGIN; \
             GRANT CREATE ON SCHEMA public TO app_a, app_b",
        )
        .await
        .unwrap();
    let url_as = |role: &str| {
        let base = server.url();
        let url = base.replacen("postgres@", &format!("{role}@"), 1);
        assert_ne!(
            url, base,
            "the private server's URL names no postgres role: {base}"
        );
        url_for(&url, Strategy::Advisory, "fenced_roles")
    };
    let a = PostgresLock::connect(&url_as("app_a")).await.unwrap();
    server
        .admin(
            "GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA public TO app_b; \
             GRANT USAGE, SELECT ON ALL SEQUENCES IN SCHEMA public TO app_b",
        )
        .await
        .unwrap();
    let b = PostgresLock::connect(&url_as("app_b")).await.unwrap();
    let k = LockKey::new("roles/k").unwrap();
    let lease = a
        .try_acquire(&k, &ttl(Duration::from_secs(60)))
        .await
        .unwrap()
        .unwrap();
    match b.force_release(&k).await {
        Err(e @ Error::Config { .. }) => {
            assert!(!e.is_retryable(), "{e}");
            let text = e.to_string();
            assert!(
                text.contains("pg_signal_backend") && text.contains("pg_terminate_backend"),
                "{text}"
            );
        }
        other => panic!("expected a permission error, got {other:?}"),
    }
    a.extend(&lease, Duration::from_secs(60)).await.unwrap();
    server
        .admin("GRANT pg_signal_backend TO app_b")
        .await
        .unwrap();
    assert!(b.force_release(&k).await.unwrap());
    expect_lost(
        a.extend(&lease, Duration::from_secs(60)).await,
        "after force_release",
    );
}

/// An uncontended `try_acquire` + `release` on a kept lock connection is
/// two statements, no connecting: the time per cycle is printed.
#[tokio::test]
async fn an_uncontended_hold_is_quick() {
    let (url, table) = fresh("adv_quick", "").await;
    let a = PostgresLock::connect(&url).await.unwrap();
    let opts = ttl(Duration::from_secs(10));
    let k = key("quick");
    // Warm: the registry row, the lock connection.
    let l = a.try_acquire(&k, &opts).await.unwrap().unwrap();
    a.release(&l).await.unwrap();
    let n = 200u32;
    let start = Instant::now();
    for _ in 0..n {
        let l = a.try_acquire(&k, &opts).await.unwrap().unwrap();
        a.release(&l).await.unwrap();
    }
    let each = start.elapsed() / n;
    eprintln!("uncontended try_acquire + release on a kept lock connection: {each:?} per cycle");
    // A sanity bound only: this machine may be loaded by other work.
    assert!(each < Duration::from_millis(250), "{each:?}");
    drop_tables(&table).await;
}

/// Many handles recording one new key at the same moment: `ON CONFLICT`
/// arbitrates on the key only, so a racing insert can fail on the `hash`
/// index; that is the same key, not a collision. Exactly one handle gets
/// the key each round, and no one gets an error.
#[tokio::test]
async fn concurrent_first_uses_of_a_key_are_not_a_collision() {
    let (url, table) = fresh("adv_race", "").await;
    let mut handles = Vec::new();
    for i in 0..8 {
        let h = PostgresLock::connect(&url).await.unwrap();
        // A kept lock connection each, so the rounds' statements arrive
        // together.
        let warm = key(&format!("warm{i}"));
        let l = h
            .try_acquire(&warm, &ttl(Duration::from_secs(10)))
            .await
            .unwrap()
            .unwrap();
        h.release(&l).await.unwrap();
        handles.push(h);
    }
    for round in 0..30 {
        let k = key(&format!("race{round}"));
        let tries = handles.iter().map(|h| {
            let (h, k) = (h.clone(), k.clone());
            tokio::spawn(async move { h.try_acquire(&k, &ttl(Duration::from_secs(10))).await })
        });
        let mut granted = Vec::new();
        for t in tries.collect::<Vec<_>>() {
            match t.await.unwrap() {
                Ok(Some(lease)) => granted.push(lease),
                Ok(None) => {}
                Err(e) => panic!("round {round}: {e}"),
            }
        }
        assert_eq!(granted.len(), 1, "round {round}: {granted:?}");
        for h in &handles {
            let _ = h.release(&granted[0]).await;
        }
    }
    drop_tables(&table).await;
}

/// The registry is an unlogged table (schema v2), and `connect` brings a
/// v1 schema — its registry logged — to v2 itself: older processes read and
/// write the table the same way, so the step needs no `migrate`.
#[tokio::test]
async fn the_registry_is_unlogged_and_connect_upgrades_a_v1_schema() {
    let (url, table) = fresh("unlogged", "").await;
    let pool = admin().await;
    let persistence = |pool: sqlx::PgPool, table: String| async move {
        let p: i8 = sqlx::query_scalar(
            "SELECT relpersistence::\"char\" FROM pg_class WHERE oid = $1::regclass",
        )
        .bind(format!("\"{table}_advisory\""))
        .fetch_one(&pool)
        .await
        .unwrap();
        u8::try_from(p).map(char::from).unwrap()
    };
    let a = PostgresLock::connect(&url).await.unwrap();
    assert_eq!(persistence(pool.clone(), table.clone()).await, 'u');
    // Back to v1: a logged registry and no record of the later steps.
    common::exec(
        &pool,
        &format!(
            "ALTER TABLE \"{table}_advisory\" SET LOGGED; \
             DELETE FROM \"{table}_migrations\" WHERE version >= 2"
        ),
    )
    .await;
    assert_eq!(persistence(pool.clone(), table.clone()).await, 'p');
    let b = PostgresLock::connect(&url).await.unwrap();
    assert_eq!(persistence(pool.clone(), table.clone()).await, 'u');
    let versions: Vec<i64> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT version FROM \"{table}_migrations\" ORDER BY version"
    )))
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(versions, [1, 2, 3]);
    // Both handles work on it.
    let k = key("unlogged");
    let held = a
        .try_acquire(&k, &ttl(Duration::from_secs(30)))
        .await
        .unwrap()
        .unwrap();
    assert!(b
        .try_acquire(&k, &ttl(Duration::from_secs(30)))
        .await
        .unwrap()
        .is_none());
    a.release(&held).await.unwrap();
    drop(a);
    drop(b);
    drop_tables(&table).await;
}
