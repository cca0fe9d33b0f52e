//! Races and corner cases of the MySQL backend, each test named for the
//! failure it guards against.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::{
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    time::Duration,
};

use common::{server_url, MySqlHarness};
use fenced_api::{DistributedLock, Error, Lease, LockKey, LockOptions, WaitPolicy};
use fenced_mysql::{MySqlLock, RowLockTransaction, Strategy};
use sqlx::Row;
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::{TcpListener, TcpStream},
    time::Instant,
};

fn key(tag: &str) -> LockKey {
    LockKey::new(format!("{tag}/{}", uuid::Uuid::new_v4().simple())).unwrap()
}

fn opts(ttl: Duration) -> LockOptions {
    LockOptions::builder().ttl(ttl).build().unwrap()
}

/// The TTL of holds that must not expire during a test.
const LONG: Duration = Duration::from_secs(30);

/// Runs `sql` as plain text inside the locking transaction `tx`.
async fn in_tx(tx: &mut RowLockTransaction, sql: String) {
    run_sql(tx.connection().unwrap(), sql).await;
}

/// Runs `sql` as plain text on `on` (a pool or a connection).
async fn run_sql<'c>(on: impl sqlx::Executor<'c, Database = sqlx::MySql>, sql: String) {
    sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
        .execute(on)
        .await
        .unwrap();
}

/// `common::url_for(server, strategy, table)`, migrated.
async fn migrated(server: &str, strategy: Strategy, table: &str) -> String {
    let url = common::url_for(server, strategy, table);
    MySqlLock::migrate(&url).await.unwrap();
    url
}

/// Two stores on `url`.
async fn two_on(url: &str) -> (MySqlLock, MySqlLock) {
    (
        MySqlLock::connect(url).await.unwrap(),
        MySqlLock::connect(url).await.unwrap(),
    )
}

/// `lock.try_acquire`, which must grant the key.
async fn granted(lock: &impl DistributedLock, k: &LockKey, opts: &LockOptions) -> Lease {
    lock.try_acquire(k, opts).await.unwrap().unwrap()
}

fn waiting(ttl: Duration, wait: Duration) -> LockOptions {
    LockOptions::builder()
        .ttl(ttl)
        .wait(WaitPolicy::Timeout(wait))
        .build()
        .unwrap()
}

/// row_lock: an instance whose pool is busy must not end up with a lease
/// (and a higher token) for a hold it lost while waiting for a connection.
/// (Since tokens are taken on the holding connection, A needs no second
/// connection and may well be granted first; then its lease must have ended
/// before B's began, with a smaller token.)
#[tokio::test]
async fn row_lock_no_token_inversion_when_the_pool_is_busy() {
    let h = MySqlHarness::new(Strategy::RowLock).await;
    let one = MySqlLock::builder(&h.url())
        .unwrap()
        .max_connections(2)
        .connect()
        .await
        .unwrap();
    let (two, three) = (h.lock().await, h.lock().await);
    let (k, other) = (key("inv"), key("inv-other"));
    let h3 = granted(&three, &k, &opts(Duration::from_secs(30))).await;
    let busy = granted(&one, &other, &opts(Duration::from_secs(30))).await;
    let (one_a, ka) = (one.clone(), k.clone());
    let a = tokio::spawn(async move {
        one_a
            .acquire(
                &ka,
                &waiting(Duration::from_secs(1), Duration::from_secs(8)),
            )
            .await
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    let (two_b, kb) = (two.clone(), k.clone());
    let b = tokio::spawn(async move {
        two_b
            .acquire(
                &kb,
                &waiting(Duration::from_secs(30), Duration::from_secs(20)),
            )
            .await
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    three.release(&h3).await.unwrap();
    let lb = b.await.unwrap().unwrap();
    one.release(&busy).await.unwrap();
    // B holds (30 s) and never releases: A must not hold too.
    match a.await.unwrap() {
        Err(_) => {}
        Ok(la) => {
            assert!(
                la.token < lb.token,
                "A got token {} after B's {}",
                la.token,
                lb.token
            );
            let b_start = lb.deadline - lb.ttl;
            assert!(
                la.deadline <= b_start,
                "A's lease (token {}) still ran when B's (token {}) began",
                la.token,
                lb.token
            );
        }
    }
    assert_eq!(two.inspect(&k).await.unwrap().unwrap().token, lb.token);
    two.release(&lb).await.unwrap();
}

/// row_lock: a lease granted after a wait longer than its TTL is not born expired.
#[tokio::test]
async fn row_lock_lease_after_a_long_wait_is_fresh() {
    let h = MySqlHarness::new(Strategy::RowLock).await;
    let (a, b) = (h.lock().await, h.lock().await);
    let k = key("born");
    let held = granted(&a, &k, &opts(Duration::from_secs(30))).await;
    let a2 = a.clone();
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(2500)).await;
        a2.release(&held).await.unwrap();
    });
    let l = b
        .acquire(
            &k,
            &waiting(Duration::from_secs(2), Duration::from_secs(10)),
        )
        .await
        .unwrap();
    // Counted from the request, the 2 s lease would be 0.5 s past its
    // deadline; counted from the grant it has most of its TTL.
    assert!(
        l.remaining() > Duration::from_secs(1),
        "remaining {:?}",
        l.remaining()
    );
    b.release(&l).await.unwrap();
}

/// row_lock: a dropped waiter leaves InnoDB's queue (its statement is killed).
#[tokio::test]
async fn row_lock_dropped_waiter_leaves_the_server_queue() {
    // A table of its own: waiters of other tests running in parallel must
    // not count (the processlist is server-wide).
    let table = format!("{}_dw", common::run_table());
    let url = migrated(&server_url().await, Strategy::RowLock, &table).await;
    let (a, b) = two_on(&url).await;
    let k = key("ghost");
    let held = granted(&a, &k, &opts(Duration::from_secs(60))).await;
    let forever = LockOptions::builder()
        .ttl(Duration::from_secs(30))
        .wait(WaitPolicy::Forever)
        .build()
        .unwrap();
    let _ = tokio::time::timeout(Duration::from_millis(500), b.acquire(&k, &forever)).await;
    let p = sqlx::MySqlPool::connect(&server_url().await).await.unwrap();
    let start = Instant::now();
    loop {
        let waiting: i64 =
            sqlx::query("SELECT COUNT(*) FROM information_schema.PROCESSLIST WHERE INFO LIKE ?")
                .bind(format!(
                    "SELECT lock_key, CONNECTION_ID() FROM `{table}_rows`%FOR UPDATE"
                ))
                .fetch_one(&p)
                .await
                .unwrap()
                .get(0);
        if waiting == 0 {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(3),
            "the dropped waiter still waits on the server"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    a.release(&held).await.unwrap();
}

/// row_lock: a business statement chosen as deadlock victim ends the locking
/// transaction; `commit` must then report the loss and commit nothing.
#[tokio::test]
async fn row_lock_transaction_deadlock_victim_is_reported_and_commits_nothing() {
    let h = MySqlHarness::new(Strategy::RowLock).await;
    let a = h.lock().await;
    let p = sqlx::MySqlPool::connect(&server_url().await).await.unwrap();
    let t = format!("{}_dl", common::run_table());
    // 200 rows: the other transaction touches 199 of them, so InnoDB usually
    // picks the lock's (lighter) transaction as the deadlock victim; both
    // outcomes are checked.
    let values: Vec<String> = (1..=200).map(|i| format!("({i}, 0)")).collect();
    run_sql(
        &p,
        format!(
            "CREATE TABLE IF NOT EXISTS `{t}` (id INT PRIMARY KEY, v INT) ENGINE=InnoDB; \
         INSERT IGNORE INTO `{t}` VALUES {}",
            values.join(", ")
        ),
    )
    .await;
    let k = key("dl");
    let mut tx = a.lock_in_transaction(&k, &opts(LONG)).await.unwrap();
    let mut x = p.acquire().await.unwrap();
    sqlx::raw_sql("START TRANSACTION")
        .execute(&mut *x)
        .await
        .unwrap();
    run_sql(&mut *x, format!("UPDATE `{t}` SET v = 1 WHERE id = 2")).await;
    in_tx(&mut tx, format!("UPDATE `{t}` SET v = 1 WHERE id = 1")).await;
    let t2 = t.clone();
    let other = tokio::spawn(async move {
        let r = sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "UPDATE `{t2}` SET v = 2 WHERE id = 1"
        )))
        .execute(&mut *x)
        .await;
        let _ = sqlx::raw_sql("COMMIT").execute(&mut *x).await;
        r.is_ok()
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mine = sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "UPDATE `{t}` SET v = 3 WHERE id = 2"
    )))
    .execute(tx.connection().unwrap())
    .await;
    let other_ok = other.await.unwrap();
    if mine.is_ok() {
        // The other side was the victim: the lock's transaction is intact.
        assert!(!other_ok);
        tx.commit().await.unwrap();
    } else {
        assert!(other_ok);
        // We were the victim. A retried write must not commit on its own…
        in_tx(&mut tx, format!("UPDATE `{t}` SET v = 4 WHERE id = 2")).await;
        // …and commit must say the lock was lost.
        assert!(matches!(tx.commit().await, Err(Error::LeaseLost { .. })));
        let v: i32 = sqlx::query(sqlx::AssertSqlSafe(format!(
            "SELECT v FROM `{t}` WHERE id = 2"
        )))
        .fetch_one(&p)
        .await
        .unwrap()
        .get(0);
        assert_ne!(v, 4, "a write after the silent rollback was committed");
    }
    run_sql(&p, format!("DROP TABLE `{t}`")).await;
}

/// Every strategy: a server that stops answering mid-call yields a
/// retryable error within the operation timeout, not a hang.
#[tokio::test]
async fn a_blackholed_server_never_hangs_a_call() {
    for (strategy, trigger) in [
        (Strategy::UniqueKey, &b"DELETE"[..]),
        (Strategy::RowLock, &b"ROLLBACK"[..]),
    ] {
        let h = MySqlHarness::new(strategy).await;
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let upstream = common::server_url().await;
        let upstream = fenced_conformance::services::host_port(&upstream, 3306).unwrap();
        let frozen = Arc::new(AtomicBool::new(false));
        let armed = Arc::new(AtomicBool::new(false));
        let (f0, a0) = (frozen.clone(), armed.clone());
        let trigger = trigger.to_vec();
        let proxy = tokio::spawn(async move {
            loop {
                let (client, _) = listener.accept().await.unwrap();
                let server = TcpStream::connect(&upstream).await.unwrap();
                let (mut cr, mut cw) = client.into_split();
                let (mut sr, mut sw) = server.into_split();
                let (f1, f2, a1, trig) = (f0.clone(), f0.clone(), a0.clone(), trigger.clone());
                tokio::spawn(async move {
                    let mut buf = vec![0u8; 65536];
                    loop {
                        let n = match cr.read(&mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => n,
                        };
                        if a1.load(Ordering::SeqCst)
                            && buf[..n].windows(trig.len()).any(|w| w == trig.as_slice())
                        {
                            f1.store(true, Ordering::SeqCst);
                        }
                        if f1.load(Ordering::SeqCst) {
                            continue;
                        }
                        if sw.write_all(&buf[..n]).await.is_err() {
                            return;
                        }
                    }
                });
                tokio::spawn(async move {
                    let mut buf = vec![0u8; 65536];
                    loop {
                        let n = match sr.read(&mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => n,
                        };
                        if f2.load(Ordering::SeqCst) {
                            continue;
                        }
                        if cw.write_all(&buf[..n]).await.is_err() {
                            return;
                        }
                    }
                });
            }
        });
        let url = format!(
            "mysql://root@127.0.0.1:{port}/test?strategy={strategy}&table={}&timeout=2s",
            common::run_table()
        );
        let lock = MySqlLock::connect(&url).await.unwrap();
        let l = granted(&lock, &key("hang"), &opts(Duration::from_secs(30))).await;
        armed.store(true, Ordering::SeqCst);
        let start = Instant::now();
        let r = tokio::time::timeout(Duration::from_secs(10), lock.release(&l)).await;
        match r {
            Ok(Err(e)) => assert!(e.is_retryable(), "{strategy}: {e}"),
            Ok(Ok(o)) => panic!("{strategy}: release through a blackhole returned {o:?}"),
            Err(_) => panic!("{strategy}: release hung past 10 s (op timeout 2 s)"),
        }
        assert!(
            start.elapsed() < Duration::from_secs(4),
            "{strategy}: took {:?}",
            start.elapsed()
        );
        let _ = h;
        proxy.abort();
    }
}

/// unique_key: re-entered holds never have their expiry cut by one entry's extend.
#[tokio::test]
async fn reentrant_extend_never_shortens_another_entry() {
    for strategy in [Strategy::UniqueKey, Strategy::Optimistic] {
        let h = MySqlHarness::new(strategy).await;
        let (a, b) = (h.lock().await, h.lock().await);
        let k = key("re");
        let long = LockOptions::builder()
            .ttl(Duration::from_secs(30))
            .owner(format!("o-{strategy}"))
            .reentrant(true)
            .build()
            .unwrap();
        let short = long
            .to_builder()
            .ttl(Duration::from_secs(1))
            .build()
            .unwrap();
        let e1 = a.try_acquire(&k, &long).await.unwrap().unwrap();
        let e2 = a.try_acquire(&k, &short).await.unwrap().unwrap();
        a.extend(&e2, Duration::from_secs(1)).await.unwrap();
        a.release(&e2).await.unwrap();
        tokio::time::sleep(Duration::from_millis(1300)).await;
        assert!(
            b.try_acquire(&k, &opts(Duration::from_secs(5)))
                .await
                .unwrap()
                .is_none(),
            "{strategy}: entry 1 was cut short"
        );
        a.release(&e1).await.unwrap();
    }
}

/// row_lock needs a connection for the token bump besides the holding one.
#[tokio::test]
async fn row_lock_refuses_a_single_connection_pool() {
    let h = MySqlHarness::new(Strategy::RowLock).await;
    let r = MySqlLock::builder(&h.url())
        .unwrap()
        .max_connections(1)
        .connect()
        .await;
    assert!(matches!(r, Err(Error::Config { .. })), "{r:?}");
}

/// row_lock: an implicit commit (DDL) on the transaction's connection ends
/// the locking transaction; `commit` reports the loss and later writes stay
/// uncommitted.
#[tokio::test]
async fn row_lock_transaction_ended_by_an_implicit_commit_is_reported() {
    let h = MySqlHarness::new(Strategy::RowLock).await;
    let (a, b) = (h.lock().await, h.lock().await);
    let p = sqlx::MySqlPool::connect(&server_url().await).await.unwrap();
    let t = format!("{}_ic", common::run_table());
    run_sql(
        &p,
        format!("CREATE TABLE IF NOT EXISTS `{t}` (id INT PRIMARY KEY, v INT) ENGINE=InnoDB"),
    )
    .await;
    let k = key("ic");
    let mut tx = a.lock_in_transaction(&k, &opts(LONG)).await.unwrap();
    // DDL commits implicitly: the row lock is gone right here.
    in_tx(
        &mut tx,
        format!("CREATE TABLE IF NOT EXISTS `{t}_x` (id INT)"),
    )
    .await;
    let other = b
        .try_acquire(&k, &opts(Duration::from_secs(30)))
        .await
        .unwrap();
    assert!(other.is_some(), "the implicit commit released the row lock");
    in_tx(&mut tx, format!("INSERT INTO `{t}` VALUES (7, 7)")).await;
    assert!(matches!(tx.commit().await, Err(Error::LeaseLost { .. })));
    let n: i64 = sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT COUNT(*) FROM `{t}` WHERE id = 7"
    )))
    .fetch_one(&p)
    .await
    .unwrap()
    .get(0);
    assert_eq!(n, 0, "a write after the lock was gone was committed");
    b.release(&other.unwrap()).await.unwrap();
    run_sql(&p, format!("DROP TABLE `{t}`, `{t}_x`")).await;
}

/// unique_key / optimistic: concurrent releases of re-entered entries (one
/// owner, several instances) never delete a hold another entry still counts
/// on, and the last one frees the key.
#[tokio::test]
async fn concurrent_releases_of_reentered_entries_are_counted_exactly() {
    for strategy in [Strategy::UniqueKey, Strategy::Optimistic] {
        let h = MySqlHarness::new(strategy).await;
        let locks = [h.lock().await, h.lock().await, h.lock().await];
        let probe = h.lock().await;
        for round in 0..20 {
            let k = key("rr");
            let opts = LockOptions::builder()
                .ttl(Duration::from_secs(30))
                .owner(format!("shared-{round}"))
                .reentrant(true)
                .build()
                .unwrap();
            let mut leases = Vec::new();
            for l in &locks {
                leases.push(l.try_acquire(&k, &opts).await.unwrap().unwrap());
            }
            let (a, b, c) = tokio::join!(
                locks[0].release(&leases[0]),
                locks[1].release(&leases[1]),
                locks[2].release(&leases[2]),
            );
            let outcomes = [a.unwrap(), b.unwrap(), c.unwrap()];
            let released = outcomes
                .iter()
                .filter(|o| **o == fenced_api::ReleaseOutcome::Released)
                .count();
            assert_eq!(released, 1, "{strategy} round {round}: {outcomes:?}");
            assert!(
                probe.inspect(&k).await.unwrap().is_none(),
                "{strategy} round {round}: still held"
            );
        }
    }
}

/// Every strategy: many tasks sharing one instance with a small pool all get
/// served. (The connection cache once handed freed connections to newcomers
/// ahead of tasks queued for the pool, which then timed out.)
#[tokio::test]
async fn a_shared_instance_with_a_small_pool_serves_every_task() {
    for strategy in [Strategy::UniqueKey, Strategy::Optimistic, Strategy::RowLock] {
        let h = MySqlHarness::new(strategy).await;
        let url = format!(
            "{}&max_connections=2&connect_timeout=2s",
            h.url()
                .replace("&max_connections=32", "")
                .replace("&connect_timeout=5s", "")
        );
        let lock = MySqlLock::connect(&url).await.unwrap();
        let mut tasks = Vec::new();
        for t in 0..16 {
            let lock = lock.clone();
            tasks.push(tokio::spawn(async move {
                let k = key(&format!("pool-{t}"));
                for round in 0..25 {
                    let l = lock
                        .try_acquire(&k, &opts(Duration::from_secs(30)))
                        .await
                        .map_err(|e| format!("round {round}: {e}"))?
                        .ok_or_else(|| format!("round {round}: a key of its own was refused"))?;
                    match lock.release(&l).await {
                        Ok(fenced_api::ReleaseOutcome::Released) => {}
                        other => return Err(format!("round {round}: release: {other:?}")),
                    }
                }
                Ok::<_, String>(())
            }));
        }
        for t in tasks {
            if let Err(e) = t.await.unwrap() {
                panic!("{strategy}: a task failed: {e}");
            }
        }
    }
}

/// Every strategy: tokens never go backwards under contention. unique_key's
/// INSERT gets its AUTO_INCREMENT id when it starts; one that then waited for
/// a row lock (another holder's DELETE) was granted its old id after a higher
/// one had been granted and released — caught by the fault suite (834 after
/// 835). Its acquiring INSERT is now a bulk insert (`INSERT … SELECT`), which
/// keeps the AUTO-INC lock to its end. Eight instances race on one key on a
/// private server that skips the log flush (the race needs speed to show);
/// grants are exclusive, so the order they return in is the grant order.
#[tokio::test]
async fn tokens_never_go_backwards_under_contention() {
    let db = common::private::PrivateMariaDb::start_with(&["--innodb-flush-log-at-trx-commit=2"])
        .await
        .unwrap();
    let mut failures = Vec::new();
    for (strategy, extra) in [
        (Strategy::UniqueKey, ""),
        (Strategy::Optimistic, ""),
        (Strategy::RowLock, ""),
        (Strategy::RowLock, "&row_lock_one_statement=false"),
    ] {
        let url = format!(
            "{}{extra}",
            common::url_for(&db.url(), strategy, "fenced_race")
        );
        MySqlLock::migrate(&url).await.unwrap();
        let k = key("race");
        let grants: Arc<std::sync::Mutex<Vec<u64>>> = Arc::default();
        let end = Instant::now() + Duration::from_secs(4);
        let mut tasks = Vec::new();
        for _ in 0..8 {
            let lock = MySqlLock::connect(&url).await.unwrap();
            let (k, grants) = (k.clone(), grants.clone());
            tasks.push(tokio::spawn(async move {
                while Instant::now() < end {
                    if let Some(l) = lock.try_acquire(&k, &opts(Duration::from_secs(30))).await? {
                        grants.lock().unwrap().push(l.token.get());
                        lock.release(&l).await?;
                    }
                }
                Ok::<_, Error>(())
            }));
        }
        for t in tasks {
            if let Err(e) = t.await.unwrap() {
                failures.push(format!("{strategy}{extra}: {e}"));
            }
        }
        let grants = grants.lock().unwrap();
        let mut top = 0;
        let mut backwards = Vec::new();
        for &t in grants.iter() {
            if t < top {
                backwards.push(format!("{t} after {top}"));
            }
            top = top.max(t);
        }
        if grants.len() < 50 {
            failures.push(format!("{strategy}{extra}: only {} grants", grants.len()));
        }
        if !backwards.is_empty() {
            failures.push(format!(
                "{strategy}{extra}: {} of {} grants went backwards: {:?}",
                backwards.len(),
                grants.len(),
                &backwards[..backwards.len().min(10)]
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// The verdict and token of every grant come from the statement's own OK
/// packet, never from what an earlier statement left in the connection's
/// `LAST_INSERT_ID()`: a lock whose pool is one connection (so every
/// statement shares one session) first leaves a token, a re-entry and a
/// partial release there (each sets `LAST_INSERT_ID(…)` to an id or a
/// count); then its try on a key another instance holds must be refused,
/// and releases / extends of that key with a foreign or stale lease must
/// report the lease lost and leave the holder untouched.
#[tokio::test]
async fn verdicts_never_come_from_a_previous_statement() {
    let mut failures = Vec::new();
    for strategy in [Strategy::UniqueKey, Strategy::Optimistic, Strategy::RowLock] {
        let h = MySqlHarness::new(strategy).await;
        // row_lock needs a second connection (see row_lock_refuses_a_single_connection_pool).
        let pool = if strategy == Strategy::RowLock { 2 } else { 1 };
        let mine = MySqlLock::builder(&h.url())
            .unwrap()
            .max_connections(pool)
            .connect()
            .await
            .unwrap();
        let theirs = h.lock().await;
        let (a, b) = (key("verdict-a"), key("verdict-b"));
        let me = LockOptions::builder()
            .ttl(Duration::from_secs(30))
            .owner("verdict-me")
            .reentrant(true)
            .build()
            .unwrap();
        let them = LockOptions::builder()
            .ttl(Duration::from_secs(30))
            .owner("verdict-them")
            .build()
            .unwrap();
        let name = strategy.to_string();
        let held = theirs.try_acquire(&b, &them).await.unwrap().unwrap();
        let first = mine.try_acquire(&a, &me).await.unwrap().unwrap();
        let again = mine.try_acquire(&a, &me).await.unwrap().unwrap();
        assert_eq!(
            again.token, first.token,
            "{name}: a re-entry keeps the token"
        );
        mine.release(&again).await.unwrap();
        // The session's LAST_INSERT_ID() now holds a token or a count.
        for _ in 0..3 {
            if let Some(l) = mine.try_acquire(&b, &me).await.unwrap() {
                failures.push(format!(
                    "{name}: a try on a key held by another owner was granted token {} \
                     (the holder has {}, this session's last token was {})",
                    l.token, held.token, first.token
                ));
            }
        }
        // Another owner with the holder's token; the holder's owner with
        // this session's earlier token (optimistic's tokens are per-key
        // versions and may equal the holder's: then that one is the real
        // lease, not a forgery) and with a token the holder never had.
        let mut forged = vec![fenced_api::Lease::new(
            b.clone(),
            me.owner().unwrap().clone(),
            held.token,
            Duration::from_secs(30),
            Instant::now(),
        )];
        for t in [first.token.get(), held.token.get() + 1] {
            if t != held.token.get() {
                forged.push(fenced_api::Lease::new(
                    b.clone(),
                    held.owner.clone(),
                    fenced_api::FencingToken::new(t),
                    Duration::from_secs(30),
                    Instant::now(),
                ));
            }
        }
        for lease in &forged {
            match mine.extend(lease, Duration::from_secs(30)).await {
                Err(Error::LeaseLost { .. }) => {}
                other => failures.push(format!(
                    "{name}: extend with a foreign lease (owner {}, token {}): {other:?}",
                    lease.owner.as_str(),
                    lease.token
                )),
            }
            match mine.release(lease).await {
                Ok(fenced_api::ReleaseOutcome::NotHeld) => {}
                other => failures.push(format!(
                    "{name}: release with a foreign lease (owner {}, token {}): {other:?}",
                    lease.owner.as_str(),
                    lease.token
                )),
            }
        }
        let info = theirs.inspect(&b).await.unwrap();
        if info.as_ref().map(|i| (&i.owner, i.token)) != Some((&held.owner, held.token)) {
            failures.push(format!("{name}: the holder's lock changed: {info:?}"));
        }
        mine.release(&first).await.unwrap();
        theirs.release(&held).await.unwrap();
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// `innodb_autoinc_lock_mode = 2` (MySQL 8's default) allocates ids without
/// the AUTO-INC lock, so `unique_key`'s bulk-insert guard (see
/// `tokens_never_go_backwards_under_contention`) does not hold there: eight
/// clients saw tokens go backwards within seconds. `unique_key` must refuse
/// such a server (a warning alone would still hand out inverted tokens);
/// the other strategies take their tokens under the row lock and work.
#[tokio::test]
async fn unique_key_refuses_autoinc_lock_mode_2() {
    let db = common::private::PrivateMariaDb::start_with(&["--innodb-autoinc-lock-mode=2"])
        .await
        .unwrap();
    let url = migrated(&db.url(), Strategy::UniqueKey, "fenced_mode2").await;
    match MySqlLock::connect(&url).await {
        Err(e @ Error::Config { .. }) => {
            let msg = e.to_string();
            assert!(
                msg.contains("innodb_autoinc_lock_mode") && msg.contains("optimistic"),
                "the refusal should name the setting and the alternatives: {msg}"
            );
        }
        other => panic!(
            "unique_key on innodb_autoinc_lock_mode=2: expected a config error, got {other:?}"
        ),
    }
    for strategy in [Strategy::Optimistic, Strategy::RowLock] {
        let url = migrated(&db.url(), strategy, "fenced_mode2").await;
        let lock = MySqlLock::connect(&url).await.unwrap();
        let k = key("mode2");
        let l = lock
            .try_acquire(&k, &opts(Duration::from_secs(30)))
            .await
            .unwrap()
            .unwrap_or_else(|| panic!("{strategy}: a free key was refused"));
        lock.release(&l).await.unwrap();
    }
}

/// MariaDB's `SIMULTANEOUS_ASSIGNMENT` sql_mode (part of `sql_mode=ORACLE`)
/// makes every assignment of an UPDATE see the old row. `optimistic`'s take
/// compared the *new* version with `version`, which there reads the old
/// one: the row's version was bumped and the token handed out, but the
/// holder was never written — so the next client was granted the same key
/// while the first believed it held it.
#[tokio::test]
async fn optimistic_take_holds_under_simultaneous_assignment() {
    let db = common::private::PrivateMariaDb::start_with(&[
        "--sql-mode=STRICT_TRANS_TABLES,SIMULTANEOUS_ASSIGNMENT",
    ])
    .await
    .unwrap();
    let mut failures = Vec::new();
    for strategy in [Strategy::Optimistic, Strategy::UniqueKey, Strategy::RowLock] {
        let url = migrated(&db.url(), strategy, "fenced_simul").await;
        let (one, two) = two_on(&url).await;
        let k = key("simul");
        let l = granted(&one, &k, &opts(Duration::from_secs(30))).await;
        if let Some(other) = two
            .try_acquire(&k, &opts(Duration::from_secs(30)))
            .await
            .unwrap()
        {
            failures.push(format!(
                "{strategy}: granted twice (tokens {} and {})",
                l.token, other.token
            ));
        }
        match one.inspect(&k).await.unwrap() {
            Some(i) if i.owner == l.owner && i.token == l.token => {}
            other => failures.push(format!("{strategy}: inspect shows {other:?}")),
        }
        if one.release(&l).await.unwrap() != fenced_api::ReleaseOutcome::Released {
            failures.push(format!(
                "{strategy}: the holder's release was not confirmed"
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// A lock wait timeout (1205) must never read as success. Another session
/// holds the key's row (`SELECT … FOR UPDATE` in an open transaction, as a
/// DBA's query or a stuck job might) on a server with
/// `innodb_lock_wait_timeout = 1`: a contender's `try_acquire`, and the
/// holder's `extend` and `release`, all wait on that row and time out. Each
/// must come back as an error (or "held"), never as a grant, a renewal or a
/// release; once the other session lets go, the lease is still the holder's
/// and releases normally.
#[tokio::test]
async fn lock_wait_timeouts_never_read_as_success() {
    let db = common::private::PrivateMariaDb::start_with(&["--innodb-lock-wait-timeout=1"])
        .await
        .unwrap();
    for (strategy, table) in [
        (Strategy::UniqueKey, "fenced_lwt"),
        (Strategy::Optimistic, "fenced_lwt_optimistic"),
    ] {
        let url = migrated(&db.url(), strategy, "fenced_lwt").await;
        let (holder, contender) = two_on(&url).await;
        let k = key("lwt");
        let lease = granted(&holder, &k, &opts(Duration::from_secs(60))).await;
        let mut blocker = <sqlx::MySqlConnection as sqlx::Connection>::connect(&db.url())
            .await
            .unwrap();
        sqlx::raw_sql("START TRANSACTION")
            .execute(&mut blocker)
            .await
            .unwrap();
        let locked = sqlx::query(sqlx::AssertSqlSafe(format!(
            "SELECT COUNT(*) FROM `{table}` WHERE lock_key = ? FOR UPDATE"
        )))
        .bind(k.as_bytes())
        .fetch_one(&mut blocker)
        .await
        .unwrap()
        .get::<i64, _>(0);
        assert_eq!(locked, 1, "{strategy}: the key's row");

        if let Ok(Some(l)) = contender
            .try_acquire(&k, &opts(Duration::from_secs(60)))
            .await
        {
            panic!("{strategy}: a lock wait timeout granted the key ({l:?})");
        }
        match holder.extend(&lease, Duration::from_secs(60)).await {
            Ok(l) => panic!("{strategy}: extend succeeded through a held row lock ({l:?})"),
            Err(e) => assert!(
                !matches!(e, Error::LeaseLost { .. }),
                "{strategy}: a lock wait timeout is not a lost lease: {e}"
            ),
        }
        match holder.release(&lease).await {
            Ok(outcome) => panic!("{strategy}: release through a held row lock said {outcome:?}"),
            Err(e) => assert!(e.is_retryable(), "{strategy}: {e}"),
        }

        sqlx::raw_sql("ROLLBACK")
            .execute(&mut blocker)
            .await
            .unwrap();
        let info = contender.inspect(&k).await.unwrap().unwrap();
        assert_eq!(info.token, lease.token, "{strategy}: the holder changed");
        assert_eq!(
            holder.release(&lease).await.unwrap(),
            fenced_api::ReleaseOutcome::Released,
            "{strategy}"
        );
    }
}
