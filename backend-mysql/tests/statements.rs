//! How many statements each operation sends, counted by the server
//! (`Questions`) on a private MariaDB that nothing else talks to — a count,
//! never a timing. Guards the round-trip budget per strategy:
//!
//! | strategy | acquire + release | refused try |
//! |---|---|---|
//! | unique_key | 2 (`INSERT … ON DUPLICATE KEY UPDATE`, `DELETE`) | 1 |
//! | optimistic | 2 (`UPDATE` take, `UPDATE` release) | 1 |
//! | row_lock (MariaDB) | 2 (`REPLACE … SELECT … FOR UPDATE`: lock + token, `ROLLBACK`) | 1 |
//! | row_lock, two-statement grant (MySQL) | 3 (`SELECT … FOR UPDATE`, `REPLACE` token, `ROLLBACK`) | 1 (`… NOWAIT`) |
//!
//! and that hot connections are reused without a `COM_PING` per checkout
//! (`Com_admin_commands`).

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::Duration;

use common::{private::PrivateMariaDb, url_for};
use fenced_api::{DistributedLock, LockKey, LockOptions};
use fenced_mysql::{MySqlLock, Strategy};
use sqlx::{Connection, MySqlConnection, Row};

/// (Questions, Com_admin_commands) — one statement of its own per call.
async fn counters(probe: &mut MySqlConnection) -> (i64, i64) {
    let rows = sqlx::query(
        "SELECT VARIABLE_NAME, CAST(VARIABLE_VALUE AS SIGNED) FROM information_schema.GLOBAL_STATUS \
         WHERE VARIABLE_NAME IN ('QUESTIONS', 'COM_ADMIN_COMMANDS')",
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
    (get("QUESTIONS"), get("COM_ADMIN_COMMANDS"))
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
    for (strategy, extra, per_cycle) in [
        (Strategy::UniqueKey, "", 2),
        (Strategy::Optimistic, "", 2),
        (Strategy::RowLock, "", 2),
        (Strategy::RowLock, "&row_lock_one_statement=false", 3),
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
        let (q0, p0) = counters(&mut probe).await;
        for _ in 0..CYCLES {
            let l = a.try_acquire(&key, &opts).await.unwrap().unwrap();
            a.release(&l).await.unwrap();
        }
        let (q1, p1) = counters(&mut probe).await;
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

        // Refused tries while A holds the key.
        let held = a.try_acquire(&key, &opts).await.unwrap().unwrap();
        assert!(b.try_acquire(&key, &opts).await.unwrap().is_none());
        let (q0, _) = counters(&mut probe).await;
        for _ in 0..CYCLES {
            assert!(b.try_acquire(&key, &opts).await.unwrap().is_none());
        }
        let (q1, _) = counters(&mut probe).await;
        let got = q1 - q0 - 1;
        if got != CYCLES {
            failures.push(format!(
                "{strategy}: {got} statements for {CYCLES} refused tries, expected {CYCLES}"
            ));
        }
        a.release(&held).await.unwrap();
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
