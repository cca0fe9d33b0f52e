//! `row_lock` edge cases on the shared MariaDB: fixed rows that do not
//! exist, session changes made through the transaction-scoped API, holds
//! whose connection the server killed, and one owner through two instances.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::Duration;

use common::{drop_tables, fresh, fresh_pair, key, server_url, ttl};
use fenced_api::{DistributedLock, Error, LockKey, LockOptions, ReleaseOutcome};
use fenced_mysql::{MySqlLock, RowMode};
use sqlx::{Connection, Row};

/// A generous bound on calls that must not hang (never a timing assertion).
const HANG: Duration = Duration::from_secs(30);

/// The holder's server connection, from the grant description.
async fn holder_conn(base: &str, k: &LockKey) -> u64 {
    let pool = sqlx::MySqlPool::connect(&server_url().await).await.unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT conn_id FROM `{base}_live` WHERE lock_key = ?"
    )))
    .bind(k.as_bytes())
    .fetch_one(&pool)
    .await
    .unwrap()
    .get(0)
}

/// Fixed-row mode answers an unknown key with the configuration error
/// after a non-locking read — never with a `FOR UPDATE` on the missing row
/// (a gap lock). Shown with another session holding `LOCK TABLES … READ`
/// on the rows table: plain reads pass it, a locking read (or a write)
/// would wait behind it, and the call would end in a timeout, not the
/// configuration error.
#[tokio::test]
async fn fixed_rows_unknown_key_is_refused_without_a_locking_read() {
    let (url, base) = fresh("fixed", "&timeout=5s").await;
    let fixed = MySqlLock::builder(&url)
        .unwrap()
        .row_mode(RowMode::Fixed)
        .connect()
        .await
        .unwrap();
    let opts = ttl(Duration::from_secs(10));
    let known = key("fixed-known");
    assert_eq!(
        fixed
            .create_rows(std::slice::from_ref(&known))
            .await
            .unwrap(),
        1
    );

    let mut blocker = sqlx::MySqlConnection::connect(&server_url().await)
        .await
        .unwrap();
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "LOCK TABLES `{base}_rows` READ"
    )))
    .execute(&mut blocker)
    .await
    .unwrap();
    let unknown = key("fixed-unknown");
    let waiting = opts
        .to_builder()
        .wait_timeout(Duration::from_secs(2))
        .build()
        .unwrap();
    for attempt in [
        tokio::time::timeout(HANG, fixed.try_acquire(&unknown, &opts))
            .await
            .map(|r| r.map(|_| ())),
        tokio::time::timeout(HANG, fixed.acquire(&unknown, &waiting))
            .await
            .map(|r| r.map(|_| ())),
    ] {
        match attempt {
            Ok(Err(Error::Config { reason })) => {
                assert!(reason.contains("create_rows"), "{reason}")
            }
            other => panic!("expected the fixed-row configuration error, got {other:?}"),
        }
    }
    sqlx::raw_sql("UNLOCK TABLES")
        .execute(&mut blocker)
        .await
        .unwrap();

    // The known row works; the unknown one is still refused, and nothing
    // was created for it.
    let l = fixed.try_acquire(&known, &opts).await.unwrap().unwrap();
    assert_eq!(fixed.release(&l).await.unwrap(), ReleaseOutcome::Released);
    assert!(matches!(
        fixed.try_acquire(&unknown, &opts).await,
        Err(Error::Config { .. })
    ));
    let rows: i64 = sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT COUNT(*) FROM `{base}_rows`"
    )))
    .fetch_one(&mut blocker)
    .await
    .unwrap()
    .get(0);
    assert_eq!(rows, 1);
    drop_tables(&base).await;
}

/// Whatever the caller changes in the session of a transaction-scoped
/// lock's connection stays with that transaction: the lock's later
/// connections (here: the next transactions' and the plain statements in
/// between) never carry it.
#[tokio::test]
async fn transaction_session_changes_do_not_leak() {
    // A small pool, so a connection handed back would be handed out again.
    let (url, base) = fresh("tx", "").await;
    let url = url.replace("max_connections=32", "max_connections=2");
    let lock = MySqlLock::connect(&url).await.unwrap();
    let opts = ttl(Duration::from_secs(30));
    let k = key("tx-session");
    let probe = "SELECT CAST(@fenced_leak AS SIGNED), @@SESSION.sql_mode";
    // What a fresh connection's session looks like (sqlx sets its own sql_mode).
    let mut fresh_conn = sqlx::MySqlConnection::connect(&server_url().await)
        .await
        .unwrap();
    let fresh_mode: String = sqlx::query(probe)
        .fetch_one(&mut fresh_conn)
        .await
        .unwrap()
        .get(1);
    assert!(!fresh_mode.contains("ANSI_QUOTES"), "{fresh_mode}");

    let mut tx = lock.lock_in_transaction(&k, &opts).await.unwrap();
    let conn = tx.connection().unwrap();
    sqlx::raw_sql("SET @fenced_leak = 42, SESSION sql_mode = 'ANSI_QUOTES'")
        .execute(&mut *conn)
        .await
        .unwrap();
    let row = sqlx::query(probe).fetch_one(&mut *conn).await.unwrap();
    assert_eq!(
        row.get::<Option<i64>, _>(0),
        Some(42),
        "the caller's own session"
    );
    tx.commit().await.unwrap();

    for round in 0..4 {
        // Plain statements of the lock in between (inspect, a try).
        lock.inspect(&k).await.unwrap();
        let l = lock.try_acquire(&k, &opts).await.unwrap().unwrap();
        lock.release(&l).await.unwrap();
        let mut tx = lock.lock_in_transaction(&k, &opts).await.unwrap();
        let row = sqlx::query(probe)
            .fetch_one(tx.connection().unwrap())
            .await
            .unwrap();
        let (leak, mode): (Option<i64>, String) = (row.get(0), row.get(1));
        assert_eq!(leak, None, "round {round}: a user variable leaked");
        assert_eq!(mode, fresh_mode, "round {round}: sql_mode leaked");
        tx.rollback().await.unwrap();
    }
    drop_tables(&base).await;
}

/// A hold whose connection the server killed (an admin's `KILL`, or a
/// force-release from another instance) is gone at once for the instance
/// that held it too: its `try_acquire` gets the key, with a larger token,
/// long before the old lease's local deadline.
#[tokio::test]
async fn a_killed_hold_frees_the_key_for_its_own_instance() {
    let (a, b, base) = fresh_pair("kill", "").await;
    let admin = sqlx::MySqlPool::connect(&server_url().await).await.unwrap();
    let long = ttl(Duration::from_secs(60));
    let k = key("killed");

    // Admin KILL.
    let first = a.try_acquire(&k, &long).await.unwrap().unwrap();
    let conn_id = holder_conn(&base, &k).await;
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("KILL CONNECTION {conn_id}")))
        .execute(&admin)
        .await
        .unwrap();
    let second = retry_until_granted(&a, &k, &long).await;
    assert!(second.token > first.token);
    assert_eq!(a.release(&first).await.unwrap(), ReleaseOutcome::NotHeld);
    assert!(matches!(
        a.extend(&first, Duration::from_secs(60)).await,
        Err(Error::LeaseLost { .. })
    ));

    // Force-release from another instance (it kills the holding connection).
    assert!(b.force_release(&k).await.unwrap());
    let third = retry_until_granted(&a, &k, &long).await;
    assert!(third.token > second.token);
    assert_eq!(a.release(&second).await.unwrap(), ReleaseOutcome::NotHeld);

    // A live hold through the same instance is still refused.
    assert!(a.try_acquire(&k, &long).await.unwrap().is_none());
    assert_eq!(a.release(&third).await.unwrap(), ReleaseOutcome::Released);
    drop((a, b));
    drop_tables(&base).await;
}

/// `try_acquire` through the instance whose hold was killed, until granted
/// (the server may need a moment to roll the killed transaction back);
/// bounded far below the old lease's 60 s deadline.
async fn retry_until_granted(
    lock: &MySqlLock,
    k: &LockKey,
    opts: &LockOptions,
) -> fenced_api::Lease {
    let start = tokio::time::Instant::now();
    loop {
        if let Some(l) = lock.try_acquire(k, opts).await.unwrap() {
            return l;
        }
        assert!(
            start.elapsed() < HANG,
            "the instance still answers \"held\" for a killed hold"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Reentrancy is per instance: the same owner through a second instance
/// cannot join the first one's transaction. Instead of waiting for itself
/// until the wait bound, it gets `AlreadyHeld` at once — from
/// `try_acquire` and a waiting `acquire`, reentrant or not, with either
/// grant path — and once the first instance releases, it acquires.
#[tokio::test]
async fn one_owner_through_two_instances_is_refused_not_deadlocked() {
    for extra in ["", "&row_lock_one_statement=false"] {
        let (a, b, base) = fresh_pair("owner", extra).await;
        let k = key("same-owner");
        for reentrant in [true, false] {
            let opts = LockOptions::builder()
                .ttl(Duration::from_secs(30))
                .owner("shared-owner")
                .reentrant(reentrant)
                .wait_timeout(Duration::from_secs(25))
                .build()
                .unwrap();
            let held = a.try_acquire(&k, &opts).await.unwrap().unwrap();
            match tokio::time::timeout(HANG, b.try_acquire(&k, &opts)).await {
                Ok(Err(Error::AlreadyHeld { .. })) => {}
                other => panic!("{extra} reentrant={reentrant}: try_acquire gave {other:?}"),
            }
            match tokio::time::timeout(Duration::from_secs(20), b.acquire(&k, &opts)).await {
                Ok(Err(Error::AlreadyHeld { .. })) => {}
                Ok(other) => panic!("{extra} reentrant={reentrant}: acquire gave {other:?}"),
                Err(_) => panic!("{extra} reentrant={reentrant}: acquire waited for itself"),
            }
            // Another owner through the second instance is plain contention.
            assert!(b
                .try_acquire(&k, &ttl(Duration::from_secs(30)))
                .await
                .unwrap()
                .is_none());
            assert_eq!(a.release(&held).await.unwrap(), ReleaseOutcome::Released);
            let next = b.acquire(&k, &opts).await.unwrap();
            assert!(next.token > held.token);
            assert_eq!(b.release(&next).await.unwrap(), ReleaseOutcome::Released);
        }
        drop((a, b));
        drop_tables(&base).await;
    }
}

/// A refused try leaves no transaction open on the connection the
/// instance keeps for reuse: the refused statement's metadata locks on
/// `<base>_rows` and `<base>_live` would make any DDL on them (`DROP
/// TABLE`, `ALTER`, a later `migrate`) wait until that connection is reused
/// or closed for idleness. Refused by a `try_acquire` and by an `inspect`
/// probe, with either grant path; the holder releases first (its own
/// transaction holds those locks while it holds), and both instances stay
/// open while another session alters and then drops the tables with a
/// 5 s `lock_wait_timeout` — a kept transaction makes that fail.
#[tokio::test]
async fn a_refused_try_leaves_no_transaction_open() {
    for extra in ["", "&row_lock_one_statement=false"] {
        let (a, b, base) = fresh_pair("mdl", extra).await;
        let long = ttl(Duration::from_secs(60));
        let k = key("refused");
        let held = a.try_acquire(&k, &long).await.unwrap().unwrap();
        assert!(b.try_acquire(&k, &long).await.unwrap().is_none());
        assert!(b.inspect(&k).await.unwrap().is_some());
        assert_eq!(a.release(&held).await.unwrap(), ReleaseOutcome::Released);

        let mut ddl = sqlx::MySqlConnection::connect(&server_url().await)
            .await
            .unwrap();
        sqlx::raw_sql("SET SESSION lock_wait_timeout = 5")
            .execute(&mut ddl)
            .await
            .unwrap();
        for table in [format!("{base}_rows"), format!("{base}_live")] {
            let alter = sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
                "ALTER TABLE `{table}` COMMENT = 'fenced mdl test'"
            )))
            .execute(&mut ddl);
            match tokio::time::timeout(HANG, alter).await {
                Ok(Ok(_)) => {}
                other => panic!("{extra}: ALTER TABLE {table} after a refused try: {other:?}"),
            }
        }
        let dropped = sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "DROP TABLE `{base}_rows`, `{base}_live`"
        )))
        .execute(&mut ddl);
        match tokio::time::timeout(HANG, dropped).await {
            Ok(Ok(_)) => {}
            other => panic!("{extra}: DROP TABLE after a refused try: {other:?}"),
        }
        drop((a, b));
        drop_tables(&base).await;
    }
}

/// `url` with its user and password replaced (the server URL's own
/// credentials, if any, dropped).
fn as_user(url: &str, user: &str, password: &str) -> String {
    let (scheme, rest) = url.split_once("://").expect("a URL with a scheme");
    let host = rest.split_once('@').map_or(rest, |(_, h)| h);
    format!("{scheme}://{user}:{password}@{host}")
}

/// Managed servers often give applications no `PROCESS` privilege, which
/// `information_schema.INNODB_TRX` needs. Without it `row_lock` still
/// locks, refuses, waits, inspects and lists (every described key probed
/// instead); what it cannot tell is the same owner holding through a second
/// instance, so that owner waits until its bound (`Timeout`, never a hang)
/// instead of getting `AlreadyHeld` — as the crate docs say.
#[tokio::test]
async fn without_the_process_privilege_row_lock_still_works() {
    let server = server_url().await;
    let (root_url, base) = fresh("noproc", "").await;
    let user = format!(
        "fenced_np_{}",
        &uuid::Uuid::new_v4().simple().to_string()[..8]
    );
    let mut admin = sqlx::MySqlConnection::connect(&server).await.unwrap();
    for host in ["127.0.0.1", "localhost", "%"] {
        for sql in [
            format!("CREATE USER '{user}'@'{host}' IDENTIFIED BY 'np-pass'"),
            format!("GRANT SELECT, INSERT, UPDATE, DELETE ON test.* TO '{user}'@'{host}'"),
        ] {
            sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
                .execute(&mut admin)
                .await
                .unwrap();
        }
    }
    let url = as_user(&root_url, &user, "np-pass");

    // The precondition: this account really cannot read INNODB_TRX.
    let plain = as_user(&server, &user, "np-pass");
    let mut probe = sqlx::MySqlConnection::connect(&plain).await.unwrap();
    let denied = sqlx::raw_sql("SELECT COUNT(*) FROM information_schema.INNODB_TRX")
        .execute(&mut probe)
        .await;
    assert!(
        denied.is_err(),
        "the test account can read INNODB_TRX: {denied:?}"
    );
    drop(probe);

    let (a, b) = (
        MySqlLock::connect(&url).await.unwrap(),
        MySqlLock::connect(&url).await.unwrap(),
    );
    let long = ttl(Duration::from_secs(30));
    let k = key("noproc");
    let held = a.try_acquire(&k, &long).await.unwrap().unwrap();
    assert!(b.try_acquire(&k, &long).await.unwrap().is_none());
    let seen = b.inspect(&k).await.unwrap().expect("inspect sees the hold");
    assert_eq!(seen.token, held.token);
    let listed = tokio::time::timeout(HANG, b.list(10))
        .await
        .unwrap()
        .unwrap();
    assert!(
        listed.iter().any(|i| i.key == k && i.token == held.token),
        "list without PROCESS missed the held key: {listed:?}"
    );
    let short = LockOptions::builder()
        .ttl(Duration::from_secs(30))
        .wait_timeout(Duration::from_millis(300))
        .build()
        .unwrap();
    match tokio::time::timeout(HANG, b.acquire(&k, &short)).await {
        Ok(Err(Error::Timeout { .. })) => {}
        other => panic!("a waiting acquire of a held key gave {other:?}"),
    }

    // The same owner through the second instance: not detected, bounded.
    let owned = LockOptions::builder()
        .ttl(Duration::from_secs(30))
        .owner("np-owner")
        .wait_timeout(Duration::from_millis(300))
        .build()
        .unwrap();
    let k2 = key("noproc-owner");
    let first = a.try_acquire(&k2, &owned).await.unwrap().unwrap();
    match tokio::time::timeout(HANG, b.acquire(&k2, &owned)).await {
        Ok(Err(Error::Timeout { .. })) => {}
        other => panic!("the same owner through a second instance gave {other:?}"),
    }
    assert_eq!(a.release(&first).await.unwrap(), ReleaseOutcome::Released);

    assert_eq!(a.release(&held).await.unwrap(), ReleaseOutcome::Released);
    let next = tokio::time::timeout(HANG, b.acquire(&k, &long))
        .await
        .unwrap()
        .unwrap();
    assert!(next.token > held.token);
    assert_eq!(b.release(&next).await.unwrap(), ReleaseOutcome::Released);

    drop((a, b));
    for host in ["127.0.0.1", "localhost", "%"] {
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!("DROP USER '{user}'@'{host}'")))
            .execute(&mut admin)
            .await
            .unwrap();
    }
    drop_tables(&base).await;
}
