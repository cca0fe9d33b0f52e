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
    truth::{binlog, etcd, redis as redis_truth, unmatched_tokens, zookeeper},
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
