//! How many statements each operation sends, counted by the server
//! (`Questions`) on a private MariaDB that nothing else talks to — a count,
//! never a timing. Guards the round-trip budget per strategy:
//!
//! | strategy | acquire + release | refused try |
//! |---|---|---|
//! | unique_key | 2 (`INSERT … ON DUPLICATE KEY UPDATE`, `DELETE`) | 1 |
//! | optimistic | 2 (`UPDATE` take, `UPDATE` release) | 1 |
//! | row_lock (MariaDB) | 2 (`REPLACE … SELECT … FOR UPDATE`: lock + token, `ROLLBACK`) | 1 + 1 background `ROLLBACK` |
//! | row_lock, two-statement grant (MySQL) | 3 (`SELECT … FOR UPDATE`, `REPLACE` token, `ROLLBACK`) | 1 (`… NOWAIT`) + 1 background `ROLLBACK` |
//!
//! and that hot connections are reused without a `COM_PING` per checkout
//! (`Com_admin_commands`), and that a batch renewal (`extend_many`) is one
//! statement per chunk of leases, however many owners they have.
//!
//! A refused `row_lock` try is one statement on the caller's path: the
//! caller gets its answer when the refused locking read returns. The
//! server counts a second one, a `ROLLBACK` the strategy sends in the
//! background before it keeps the connection: the refusal rolls back the
//! statement, not the transaction it opened (`autocommit = 0`), whose
//! metadata locks would make DDL on the lock tables wait. The counts below
//! are the server's, so they include it, and check it is a `ROLLBACK`
//! (`Com_rollback`); a `ROLLBACK` still in flight is waited for (bounded)
//! before counting.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::Duration;

use common::{private::PrivateMariaDb, url_for};
use fenced_api::{DistributedLock, LockKey, LockOptions};
use fenced_mysql::{MySqlLock, Strategy};
use sqlx::{Connection, MySqlConnection, Row};

/// (Questions, Com_admin_commands, Com_rollback) — one statement of its
/// own per call.
async fn counters(probe: &mut MySqlConnection) -> (i64, i64, i64) {
    let rows = sqlx::query(
        "SELECT VARIABLE_NAME, CAST(VARIABLE_VALUE AS SIGNED) FROM information_schema.GLOBAL_STATUS \
         WHERE VARIABLE_NAME IN ('QUESTIONS', 'COM_ADMIN_COMMANDS', 'COM_ROLLBACK')",
    )
    .fetch_all(&mut *probe)
    .await
    .unwrap();
    let get = |name: &str| {
        rows.iter()
            .find(|r| r.get::<String, _>(0).eq_ignore_ascii_case(name))
            .map(|r| r.get::<i64, _>(1))
            .unwrap()
    };
    (
        get("QUESTIONS"),
        get("COM_ADMIN_COMMANDS"),
        get("COM_ROLLBACK"),
    )
}

/// Waits (bounded, never a timing assertion) until the server has counted
/// at least `rollbacks` `ROLLBACK`s since `since` — those of refused
/// `row_lock` tries are sent in the background — then returns the counters
/// and how many statements the probe itself sent since `since` was read.
async fn after_rollbacks(
    probe: &mut MySqlConnection,
    since: (i64, i64, i64),
    rollbacks: i64,
) -> ((i64, i64, i64), i64) {
    let start = std::time::Instant::now();
    let mut reads = 1;
    loop {
        let now = counters(probe).await;
        if now.2 - since.2 >= rollbacks || start.elapsed() > Duration::from_secs(30) {
            return (now, reads);
        }
        reads += 1;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

const CYCLES: i64 = 20;

#[tokio::test]
async fn statements_per_cycle_and_per_refused_try() {
    let db = PrivateMariaDb::start().await.unwrap();
    let mut probe = MySqlConnection::connect(&db.url()).await.unwrap();
    let opts = LockOptions::builder()
        .ttl(Duration::from_secs(30))
        .build()
        .unwrap();
    let mut failures = Vec::new();
    // (strategy, extra URL parameters, statements per acquire + release,
    // background ROLLBACKs per refused try — each on top of its 1 statement)
    for (strategy, extra, per_cycle, refused_rollbacks) in [
        (Strategy::UniqueKey, "", 2, 0),
        (Strategy::Optimistic, "", 2, 0),
        (Strategy::RowLock, "", 2, 1),
        (Strategy::RowLock, "&row_lock_one_statement=false", 3, 1),
    ] {
        let url = format!(
            "{}{extra}",
            url_for(&db.url(), strategy, &format!("stmts_{strategy}"))
        );
        let strategy = format!("{strategy}{extra}");
        MySqlLock::migrate(&url).await.unwrap();
        let (a, b) = (
            MySqlLock::connect(&url).await.unwrap(),
            MySqlLock::connect(&url).await.unwrap(),
        );
        let key = LockKey::new(format!("count/{strategy}")).unwrap();
        // Warm up: rows, lock connections, the token lifetime.
        for _ in 0..3 {
            let l = a.try_acquire(&key, &opts).await.unwrap().unwrap();
            a.release(&l).await.unwrap();
        }
        let (q0, p0, _) = counters(&mut probe).await;
        for _ in 0..CYCLES {
            let l = a.try_acquire(&key, &opts).await.unwrap().unwrap();
            a.release(&l).await.unwrap();
        }
        let (q1, p1, _) = counters(&mut probe).await;
        let got = q1 - q0 - 1;
        if got != per_cycle * CYCLES {
            failures.push(format!(
                "{strategy}: {got} statements for {CYCLES} acquire+release cycles, expected {}",
                per_cycle * CYCLES
            ));
        }
        // Pings are not statements; a stray one (a connection that sat idle
        // past the freshness window) is tolerated, one per checkout is not.
        if p1 - p0 > 2 {
            failures.push(format!(
                "{strategy}: {} pings during {CYCLES} cycles",
                p1 - p0
            ));
        }

        // Refused tries while A holds the key (warmed up by one, whose
        // background ROLLBACK is counted before the count starts).
        let held = a.try_acquire(&key, &opts).await.unwrap().unwrap();
        let before = counters(&mut probe).await;
        assert!(b.try_acquire(&key, &opts).await.unwrap().is_none());
        let (start, _) = after_rollbacks(&mut probe, before, refused_rollbacks).await;
        for _ in 0..CYCLES {
            assert!(b.try_acquire(&key, &opts).await.unwrap().is_none());
        }
        let (end, reads) = after_rollbacks(&mut probe, start, refused_rollbacks * CYCLES).await;
        let got = end.0 - start.0 - reads;
        let expected = CYCLES * (1 + refused_rollbacks);
        if got != expected {
            failures.push(format!(
                "{strategy}: {got} statements for {CYCLES} refused tries, expected {expected}"
            ));
        }
        let rollbacks = end.2 - start.2;
        if rollbacks != refused_rollbacks * CYCLES {
            failures.push(format!(
                "{strategy}: {rollbacks} ROLLBACKs for {CYCLES} refused tries, expected {}",
                refused_rollbacks * CYCLES
            ));
        }
        a.release(&held).await.unwrap();
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Leases held by one handle, each with its own owner (what a `LockClient`
/// without a configured owner holds): `extend_many` renews them with one
/// statement per chunk of 256, whatever their owners, and a forged lease
/// among them (another owner, a current token) is refused.
#[tokio::test]
async fn a_batch_of_many_owners_is_one_statement_per_chunk() {
    const LEASES: usize = 300;
    let db = PrivateMariaDb::start().await.unwrap();
    let mut probe = MySqlConnection::connect(&db.url()).await.unwrap();
    let opts = LockOptions::builder()
        .ttl(Duration::from_secs(30))
        .build()
        .unwrap();
    let mut failures = Vec::new();
    // The row lock strategy renews each hold on its own transaction's
    // connection: one by one by design, not counted here.
    for strategy in [Strategy::UniqueKey, Strategy::Optimistic] {
        let url = url_for(&db.url(), strategy, &format!("batch_{strategy}"));
        MySqlLock::migrate(&url).await.unwrap();
        let lock = MySqlLock::connect(&url).await.unwrap();
        let mut leases = Vec::new();
        for i in 0..LEASES {
            let key = LockKey::new(format!("batch/{strategy}/{i}")).unwrap();
            leases.push(lock.try_acquire(&key, &opts).await.unwrap().unwrap());
        }
        let owners: std::collections::HashSet<_> = leases.iter().map(|l| &l.owner).collect();
        assert_eq!(owners.len(), LEASES, "every acquisition has its own owner");
        let (q0, _, _) = counters(&mut probe).await;
        let renewed = lock.extend_many(&leases, Duration::from_secs(60)).await;
        let (q1, _, _) = counters(&mut probe).await;
        let ok = renewed.iter().filter(|r| r.is_ok()).count();
        if ok != LEASES {
            failures.push(format!("{strategy}: {ok} of {LEASES} leases renewed"));
        }
        let got = q1 - q0 - 1;
        if got != 2 {
            failures.push(format!(
                "{strategy}: {got} statements to renew {LEASES} leases of {LEASES} owners, \
                 expected 2 (chunks of 256 and 44)"
            ));
        }
        // A forged lease beside a current one in one chunk: found rows 1 of
        // 2, so the chunk is renewed again one by one (3 statements), and
        // only the forged lease is refused.
        let forged = fenced_api::Lease::new(
            leases[1].key.clone(),
            fenced_api::Owner::random(),
            leases[1].token,
            leases[1].ttl,
            tokio::time::Instant::now(),
        );
        let (q0, _, _) = counters(&mut probe).await;
        let mixed = lock
            .extend_many(&[leases[0].clone(), forged], Duration::from_secs(60))
            .await;
        let (q1, _, _) = counters(&mut probe).await;
        if !(mixed[0].is_ok() && matches!(mixed[1], Err(fenced_api::Error::LeaseLost { .. }))) {
            failures.push(format!(
                "{strategy}: current + forged came back as {mixed:?}"
            ));
        }
        if q1 - q0 - 1 != 3 {
            failures.push(format!(
                "{strategy}: {} statements for a batch of a current and a forged lease, \
                 expected 3",
                q1 - q0 - 1
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
