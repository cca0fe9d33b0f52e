//! The server-truth recorders can fail on real servers: each test makes the
//! store itself execute a history that breaks the lock (writes a lock
//! library would never send), records it the way a fault run does, and
//! expects the checker to report the violation. The unit tests in
//! `faults/src/truth/` do the same on crafted records.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use fenced::{
    etcd::etcd_client,
    mysql::sqlx::{self, Connection as _},
    redis::redis,
    zookeeper::zookeeper_client::{self, Acls, CreateMode},
};
use fenced_conformance::services;
use fenced_faults::{
    history::{check_server_grants, History, Op, Phase},
    scenario::Target,
    truth::{binlog, etcd, postgres, redis as redis_truth, unmatched_tokens, zookeeper},
};

fn ns() -> String {
    uuid::Uuid::new_v4().simple().to_string()[..10].to_owned()
}

/// Two holders on one key, the second written over the first's current
/// lease by a script that is no release, and with a lower token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_monitor_catches_a_takeover_the_server_executed() {
    let url = services::redis_url();
    let ns = format!("fftruth{}", ns());
    let monitor = redis_truth::Monitor::start(&url, &format!("{{{ns}/"))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let client = redis::Client::open(url.as_str()).expect("redis url");
    let mut c = client
        .get_multiplexed_async_connection()
        .await
        .unwrap_or_else(|e| panic!("{url}: {e}; are the services up? run scripts/services.sh"));
    // The state format of fenced-redis (prelude.lua), a lease of 10 s.
    let script = "local t = redis.call('TIME') \
        local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) \
        redis.call('SET', KEYS[1], ARGV[1] .. '|1|' .. (now + 10000) .. '|0||' .. ARGV[2], 'PX', 60000) \
        return 1";
    let (state, queue) = (format!("{{{ns}/k}}:l"), format!("{{{ns}/k}}:q"));
    for (token, owner) in [("5", "o1"), ("4", "o2")] {
        let _: i64 = redis::cmd("EVAL")
            .arg(script)
            .arg(2)
            .arg(&state)
            .arg(&queue)
            .arg(token)
            .arg(owner)
            .arg("not-a-release")
            .query_async(&mut c)
            .await
            .expect("EVAL");
    }
    let calls = monitor.finish().await.unwrap_or_else(|e| panic!("{e}"));
    let _: redis::RedisResult<i64> = redis::cmd("DEL").arg(&state).query_async(&mut c).await;
    let grants = redis_truth::grants(&calls).unwrap();
    let t = check_server_grants(&grants);
    assert_eq!(
        (t.grants, t.overlaps, t.token_regressions),
        (2, 1, 1),
        "{grants:?}\n{calls:?}"
    );
}

/// A waiter's entry that was deleted before it ever became the oldest:
/// a client reporting its create revision as a grant is not vouched for.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_watch_history_refuses_a_grant_no_entry_held() {
    let endpoint = services::etcd_url();
    let prefix = format!("fenced-faults-truth-{}", ns());
    let history = History::new();
    let log = etcd::WatchLog::start(&endpoint, &prefix, &history)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let mut c = etcd_client::Client::connect([endpoint.as_str()], None)
        .await
        .unwrap_or_else(|e| {
            panic!("{endpoint}: {e}; are the services up? run scripts/services.sh")
        });
    let entry = |owner: &str| format!("{prefix}\0lock\0k\0{owner}").into_bytes();
    let rev = |r: etcd_client::PutResponse| r.header().map_or(0, |h| h.revision()) as u64;
    history.push(0, Op::Acquire, Phase::Invoke, "k", None, "");
    let holder = rev(c.put(entry("a"), "a", None).await.expect("put a"));
    history.push(0, Op::Acquire, Phase::Ok, "k", Some(holder), "");
    history.push(1, Op::Acquire, Phase::Invoke, "k", None, "");
    let waiter = rev(c.put(entry("b"), "b", None).await.expect("put b"));
    c.delete(entry("b"), None).await.expect("delete b");
    history.push(1, Op::Acquire, Phase::Ok, "k", Some(waiter), "");
    c.delete(entry("a"), None).await.expect("delete a");
    let events = log.finish().await.unwrap_or_else(|e| panic!("{e}"));
    // A client that asks only after the watch delivered the holder's
    // deletion, and still reports its token: not vouched for either.
    history.push(2, Op::Acquire, Phase::Invoke, "k", None, "");
    history.push(2, Op::Acquire, Phase::Ok, "k", Some(holder), "");
    let holds = etcd::holds(&events);
    assert_eq!(holds.len(), 1, "only the oldest entry held: {holds:?}");
    assert_eq!(holds[0].token, holder);
    // Client 1 (its entry never held) and client 2 (asked after the end);
    // client 0 is vouched for.
    assert_eq!(
        etcd::unmatched(&history.events(), &holds),
        2,
        "{holds:?} {events:?}"
    );
}

/// A sweep "of expired rows" that deleted a current row, then a new grant:
/// the binary log shows the second grant starting inside the first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_binlog_catches_a_current_row_deleted_as_expired() {
    let db = binlog::private_server()
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let table = format!("ff_truth_{}", ns());
    let url = format!("{}?strategy=unique_key&table={table}", db.url());
    fenced::migrate(&url)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let log = binlog::BinlogLog::start(Target::MySqlUniqueKey, &url)
        .await
        .unwrap_or_else(|e| panic!("{e}"))
        .expect("the private server keeps a binary log");
    let mut c = sqlx::MySqlConnection::connect(&db.url())
        .await
        .expect("connect");
    let insert = |key: &str, owner: &str| {
        format!(
            "INSERT INTO `{table}` (lock_key, owner, reentrant_count, expire_time, create_time) \
             VALUES ('{key}', '{owner}', 1, UTC_TIMESTAMP(6) + INTERVAL 10 SECOND, UTC_TIMESTAMP(6))"
        )
    };
    for sql in [
        // A clean key: a release by the owner, then the next holder.
        insert("good", "o1"),
        format!("DELETE FROM `{table}` WHERE lock_key = 'good' AND owner = 'o1'"),
        insert("good", "o2"),
        // The bug: an "expired rows" sweep with a wrong bound.
        insert("bad", "o1"),
        format!(
            "DELETE FROM `{table}` WHERE lock_key = 'bad' AND expire_time <= UTC_TIMESTAMP(6) + INTERVAL 1 HOUR"
        ),
        insert("bad", "o2"),
    ] {
        sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
            .execute(&mut c)
            .await
            .expect("statement");
    }
    let (t, tokens) = log.finish().await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        (t.grants, t.overlaps, t.token_regressions),
        (4, 1, 0),
        "{t:?}"
    );
    let grants: Vec<_> = tokens
        .iter()
        .map(|&token| fenced_faults::history::ServerGrant {
            key: String::new(),
            token,
            from: 0,
            to: 0,
        })
        .collect();
    let history = History::new();
    history.push(0, Op::Acquire, Phase::Ok, "k", Some(tokens[0]), "");
    history.push(1, Op::Acquire, Phase::Ok, "k", Some(tokens[3] + 100), "");
    assert_eq!(unmatched_tokens(&history.events(), &grants), 1);
}

/// On the private ZooKeeper whose transaction log is read: a child created
/// (by hand, not sequentially) with a sequence below the live holder's
/// jumps the queue — the log shows two holders at once and the token going
/// back; and clients report grants the log does not vouch for: a waiter's
/// child that never held, and a holder's child created before the client
/// asked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zookeeper_txn_log_catches_a_child_jumping_the_queue_and_unvouched_grants() {
    let zk = zookeeper::private_server()
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let namespace = format!("/fenced-faults-truth-{}", ns());
    let history = History::new();
    let log = zookeeper::TxnLog::start(&format!("zk://{}{namespace}", zk.hostports()), &history)
        .unwrap_or_else(|e| panic!("{e}"))
        .expect("the private server's log is read");
    let c = zookeeper_client::Client::connect(&zk.hostports())
        .await
        .expect("connect");
    let persistent = CreateMode::Persistent.with_acls(Acls::anyone_all());
    let container = CreateMode::Container.with_acls(Acls::anyone_all());
    let entry = CreateMode::EphemeralSequential.with_acls(Acls::anyone_all());
    let ephemeral = CreateMode::Ephemeral.with_acls(Acls::anyone_all());
    let queue = format!("{namespace}/kk");
    c.create(&namespace, b"", &persistent)
        .await
        .expect("namespace");
    c.create(&queue, b"", &container).await.expect("queue");
    // A first holder, gone: the next child's sequence is above 0.
    let (_, x) = c
        .create(&format!("{queue}/x-"), b"", &entry)
        .await
        .expect("x");
    c.delete(&format!("{queue}/x-{x}"), None)
        .await
        .expect("delete x");
    history.push(0, Op::Acquire, Phase::Invoke, "k", None, "");
    let (held, a) = c
        .create(&format!("{queue}/a-"), b"", &entry)
        .await
        .expect("a");
    let holder = held.czxid as u64;
    history.push(0, Op::Acquire, Phase::Ok, "k", Some(holder), "");
    history.push(1, Op::Acquire, Phase::Invoke, "k", None, "");
    let (waited, b) = c
        .create(&format!("{queue}/b-"), b"", &entry)
        .await
        .expect("b");
    c.delete(&format!("{queue}/b-{b}"), None)
        .await
        .expect("delete b");
    history.push(
        1,
        Op::Acquire,
        Phase::Ok,
        "k",
        Some(waited.czxid as u64),
        "",
    );
    // The bug: a child named as if it came first.
    c.create(&format!("{queue}/c-0000000000"), b"", &ephemeral)
        .await
        .expect("c");
    c.delete(&format!("{queue}/c-0000000000"), None)
        .await
        .expect("delete c");
    // A client that asks well after the holder's child was created, and
    // still reports its token.
    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    history.push(2, Op::Acquire, Phase::Invoke, "k", None, "");
    history.push(2, Op::Acquire, Phase::Ok, "k", Some(holder), "");
    c.delete(&format!("{queue}/a-{a}"), None)
        .await
        .expect("delete a");
    let record = log.finish().await.unwrap_or_else(|e| panic!("{e}"));
    zookeeper::remove_namespace(&format!("zk://{}{namespace}", zk.hostports())).await;
    let holds = zookeeper::holds(&record);
    let t = check_server_grants(&zookeeper::server_grants(&holds));
    // x, a and the queue-jumping c held; b never did.
    assert_eq!(
        (t.grants, t.overlaps, t.token_regressions),
        (3, 1, 0),
        "{holds:?}\n{record:?}"
    );
    assert!(holds.iter().any(|h| h.token == holder));
    // Client 1 (its child never held) and client 2 (asked after the
    // holder's child was created; and it is client 0's); client 0 is vouched for.
    assert_eq!(
        zookeeper::unmatched(&history.events(), &holds, &record.clock),
        2,
        "{holds:?}\n{record:?}"
    );
}

/// A PostgreSQL namespace migrated for the test and its audit installed.
async fn postgres_audit(history: &History) -> (String, String, postgres::AuditLog) {
    let table = format!("ff_truth_{}", ns());
    let url = format!(
        "{}?strategy=lease&table={table}&sslmode=disable",
        services::postgres_url()
    );
    fenced::migrate(&url)
        .await
        .unwrap_or_else(|e| panic!("{e}; are the services up? run scripts/services.sh"));
    let log = postgres::AuditLog::start(Target::PostgresLease, &url, history)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    (url, table, log)
}

async fn pg_exec(c: &mut sqlx::PgConnection, sql: String) {
    sqlx::raw_sql(sqlx::AssertSqlSafe(sql.clone()))
        .execute(c)
        .await
        .unwrap_or_else(|e| panic!("`{sql}`: {e}"));
}

/// Lease rows written by hand: a clean release and hand-over, then a
/// takeover of a lease that had 10 s to run, with a smaller token. The
/// audit triggers record both; the checker sees the overlap and the token
/// going back, and a client reporting a token the table never held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_audit_catches_a_lease_taken_over_before_its_expiry() {
    let history = History::new();
    let (url, t, log) = postgres_audit(&history).await;
    let mut c = sqlx::PgConnection::connect(&services::postgres_url())
        .await
        .expect("connect");
    let insert = |key: &str, owner: &str, token: i64| {
        format!(
            "INSERT INTO \"{t}\" (lock_key, owner, token, reentrant_count, expire_at, created_at) \
             VALUES ('{key}'::bytea, '{owner}'::bytea, {token}, 1, \
             clock_timestamp() + interval '10 seconds', clock_timestamp())"
        )
    };
    history.push(0, Op::Acquire, Phase::Invoke, "good", None, "");
    pg_exec(&mut c, insert("good", "o1", 1)).await;
    history.push(0, Op::Acquire, Phase::Ok, "good", Some(1), "");
    for sql in [
        format!("UPDATE \"{t}\" SET expire_at = clock_timestamp() WHERE lock_key = 'good'::bytea"),
        format!(
            "UPDATE \"{t}\" SET owner = 'o2'::bytea, token = 2, \
             expire_at = clock_timestamp() + interval '10 seconds' WHERE lock_key = 'good'::bytea"
        ),
        insert("bad", "o1", 5),
        // The bug: a takeover whose WHERE forgot the expiry.
        format!(
            "UPDATE \"{t}\" SET owner = 'o2'::bytea, token = 4, \
             expire_at = clock_timestamp() + interval '10 seconds' WHERE lock_key = 'bad'::bytea"
        ),
    ] {
        pg_exec(&mut c, sql).await;
    }
    history.push(1, Op::Acquire, Phase::Invoke, "bad", None, "");
    history.push(1, Op::Acquire, Phase::Ok, "bad", Some(99), "");
    let record = log.finish().await.unwrap_or_else(|e| panic!("{e}"));
    postgres::drop_namespace(&url).await;
    let holds = postgres::holds(Target::PostgresLease, &record);
    let t = check_server_grants(&postgres::server_grants(&holds));
    assert_eq!(
        (t.grants, t.overlaps, t.token_regressions),
        (4, 1, 1),
        "{holds:?}\n{record:?}"
    );
    assert_eq!(
        postgres::unmatched(&history.events(), &holds, &record.clock),
        1,
        "{holds:?}"
    );
}

/// An advisory holder row written by a backend that does not hold the
/// advisory lock, while another backend does: the trigger's look at
/// `pg_locks` shows the previous holder still holding (an overlap) and the
/// new row's backend without the lock (a grant that vouches for no client).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_audit_catches_an_advisory_holder_row_without_the_lock() {
    let history = History::new();
    let (url, t, log) = postgres_audit(&history).await;
    let pg = services::postgres_url();
    let mut a = sqlx::PgConnection::connect(&pg).await.expect("a");
    let mut b = sqlx::PgConnection::connect(&pg).await.expect("b");
    let hash: i64 = -0x1234_5678_9abc_def0 - fastrand::i64(0..1 << 40);
    history.push(0, Op::Acquire, Phase::Invoke, "k", None, "");
    pg_exec(&mut a, format!("SELECT pg_advisory_lock({hash})")).await;
    pg_exec(
        &mut a,
        format!(
            "INSERT INTO \"{t}_advisory\" (lock_key, hash, owner, token, reentrant_count, \
             expire_at, created_at, pid) VALUES ('k'::bytea, {hash}, 'a'::bytea, 1, 1, \
             clock_timestamp() + interval '10 seconds', clock_timestamp(), pg_backend_pid())"
        ),
    )
    .await;
    history.push(0, Op::Acquire, Phase::Ok, "k", Some(1), "");
    history.push(1, Op::Acquire, Phase::Invoke, "k", None, "");
    // The bug: b records itself as holder without the lock.
    pg_exec(
        &mut b,
        format!(
            "UPDATE \"{t}_advisory\" SET owner = 'b'::bytea, token = 2, pid = pg_backend_pid() \
             WHERE lock_key = 'k'::bytea"
        ),
    )
    .await;
    history.push(1, Op::Acquire, Phase::Ok, "k", Some(2), "");
    pg_exec(&mut a, format!("SELECT pg_advisory_unlock({hash})")).await;
    let record = log.finish().await.unwrap_or_else(|e| panic!("{e}"));
    postgres::drop_namespace(&url).await;
    let holds = postgres::holds(Target::PostgresAdvisory, &record);
    let t = check_server_grants(&postgres::server_grants(&holds));
    assert_eq!(
        (t.grants, t.overlaps, t.token_regressions),
        (2, 1, 0),
        "{holds:?}\n{record:?}"
    );
    assert_eq!(
        postgres::unmatched(&history.events(), &holds, &record.clock),
        1,
        "{holds:?}\n{record:?}"
    );
}

/// The other side of the advisory judgement: a holder whose session ends
/// without a release (its connection closed) leaves no row change, and the
/// next holder's grant finds, in `pg_locks`, that the old backend no longer
/// holds the lock — no overlap, both grants vouched for.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_audit_judges_an_advisory_session_end_at_the_next_grant() {
    let history = History::new();
    let (url, t, log) = postgres_audit(&history).await;
    let pg = services::postgres_url();
    let hash: i64 = 0x2345_6789_abcd_ef01 + fastrand::i64(0..1 << 40);
    let grant = |token: i64| {
        format!(
            "WITH l AS (SELECT pg_try_advisory_lock({hash}) AS got) \
             INSERT INTO \"{t}_advisory\" (lock_key, hash, owner, token, reentrant_count, pid) \
             SELECT 'k'::bytea, {hash}, 'o{token}'::bytea, {token}, 1, pg_backend_pid() FROM l \
             WHERE l.got ON CONFLICT (lock_key) DO UPDATE SET owner = EXCLUDED.owner, \
             token = EXCLUDED.token, reentrant_count = 1, pid = EXCLUDED.pid"
        )
    };
    let mut a = sqlx::PgConnection::connect(&pg).await.expect("a");
    history.push(0, Op::Acquire, Phase::Invoke, "k", None, "");
    pg_exec(&mut a, grant(1)).await;
    history.push(0, Op::Acquire, Phase::Ok, "k", Some(1), "");
    // The session ends holding the lock: the server frees it.
    a.close().await.expect("close a");
    let mut b = sqlx::PgConnection::connect(&pg).await.expect("b");
    history.push(1, Op::Acquire, Phase::Invoke, "k", None, "");
    // Until the old backend has gone, the try fails and writes nothing.
    for _ in 0..200 {
        pg_exec(&mut b, grant(2)).await;
        let token: Option<i64> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            "SELECT token FROM \"{t}_advisory\" WHERE lock_key = 'k'::bytea"
        )))
        .fetch_one(&mut b)
        .await
        .expect("token");
        if token == Some(2) {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    history.push(1, Op::Acquire, Phase::Ok, "k", Some(2), "");
    let record = log.finish().await.unwrap_or_else(|e| panic!("{e}"));
    postgres::drop_namespace(&url).await;
    let second = record
        .rows
        .iter()
        .find(|r| r.token == Some(2))
        .unwrap_or_else(|| panic!("no second grant: {record:?}"));
    assert_eq!(
        (second.holds, second.old_holds, second.old_alive),
        (Some(true), Some(false), Some(false)),
        "{record:?}"
    );
    let holds = postgres::holds(Target::PostgresAdvisory, &record);
    let t = check_server_grants(&postgres::server_grants(&holds));
    assert_eq!(
        (t.grants, t.overlaps, t.token_regressions),
        (2, 0, 0),
        "{holds:?}\n{record:?}"
    );
    assert_eq!(
        postgres::unmatched(&history.events(), &holds, &record.clock),
        0,
        "{holds:?}\n{record:?}"
    );
}
