//! Races and corner cases of the Redis backend, each named by its code (R1,
//! …) and the failure it guards against.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::Duration;

use common::{
    key, opts,
    private::{Mode, PrivateRedis},
};
use fenced_api::{DistributedLock, Lease, LockKey, LockOptions};
use fenced_redis::{redis, RedisLock};
use tokio::time::Instant;

/// `lock.try_acquire`, which must grant the key.
async fn granted(lock: &RedisLock, k: &LockKey, opts: &LockOptions) -> Lease {
    lock.try_acquire(k, opts).await.unwrap().unwrap()
}

/// R1: a waiter cancelled while its *first queued* acquire script is in flight
/// never runs LEAVE (the leave ticket is only armed after a Busy reply). Its
/// queue entry stays for the whole waiter lease and, because live waiters
/// refresh their score on every re-check, it has the lowest score: every
/// release names the ghost and the live waiter sleeps until its re-check.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r1_a_waiter_cancelled_in_its_first_queued_attempt_leaves_no_ghost() {
    let server = PrivateRedis::start(Mode::NoPersistence).await.unwrap();
    let url = format!("{}?prefix=rv&recheck_interval=3s", server.url());
    let a = RedisLock::connect(&url).await.unwrap();
    let b = RedisLock::connect(&url).await.unwrap();
    let k = key("ghost");
    let held = granted(&a, &k, &opts(Duration::from_secs(60))).await;

    // Live waiter on client b.
    let live = {
        let (b, k) = (b.clone(), k.clone());
        tokio::spawn(async move {
            let l = b.acquire(&k, &opts(Duration::from_secs(10))).await.unwrap();
            (Instant::now(), l)
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;

    // Make sure b's channel is subscribed so the next waiter's first attempt is queued.
    let mut admin = server.admin().await;
    let _: () = redis::cmd("CLIENT")
        .arg("PAUSE")
        .arg(600)
        .arg("WRITE")
        .query_async(&mut admin)
        .await
        .unwrap();
    // A second waiter on the same (already subscribed) client: its first
    // attempt is queued; cancel it while the script is stalled.
    let cancelled = tokio::time::timeout(
        Duration::from_millis(150),
        b.acquire(&k, &opts(Duration::from_secs(10))),
    )
    .await;
    assert!(cancelled.is_err());
    // Let the pause end (the ghost's ZADD runs) and the live waiter re-check once.
    tokio::time::sleep(Duration::from_millis(3500)).await;
    let queue = format!("{{rv/{}}}:q", k.as_str());
    let q: Vec<(String, f64)> = redis::cmd("ZRANGE")
        .arg(&queue)
        .arg(0)
        .arg(-1)
        .arg("WITHSCORES")
        .query_async(&mut admin)
        .await
        .unwrap();
    eprintln!("queue before release: {q:?}");
    // The deciding check: the ghost's entry (10 s waiter lease, ZADDed when
    // the pause ended) would still be here next to the live waiter's.
    assert_eq!(q.len(), 1, "a cancelled waiter left an entry: {q:?}");

    let released_at = Instant::now();
    a.release(&held).await.unwrap();
    let (got_at, lease) = live.await.unwrap();
    let waited = got_at - released_at;
    eprintln!("live waiter got the lock {waited:?} after the release");
    b.release(&lease).await.unwrap();
    // A loose sanity bound only: a direct wake-up takes a few ms, but a
    // ghost's grant is passed on by the client quickly too, so timing alone
    // does not tell a ghost (the queue check above does).
    assert!(
        waited < Duration::from_secs(1),
        "the release woke a ghost; the live waiter waited {waited:?} (queue: {q:?})"
    );
}

/// R2: `BUSY Redis is busy running a script` is transient but classified
/// as a permanent (non-retryable) backend error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r2_busy_script_reply_is_retryable() {
    let server = PrivateRedis::start(Mode::NoPersistence).await.unwrap();
    let url = format!("{}?prefix=rv", server.url());
    let lock = RedisLock::connect(&url).await.unwrap();
    let mut admin = server.admin().await;
    let _: () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("busy-reply-threshold")
        .arg(100)
        .query_async(&mut admin)
        .await
        .unwrap();
    let mut spinner = server.admin().await;
    let spin = tokio::spawn(async move {
        let _ = redis::cmd("EVAL")
            .arg("local i = 0 while true do i = i + 1 end")
            .arg(0)
            .query_async::<redis::Value>(&mut spinner)
            .await;
    });
    tokio::time::sleep(Duration::from_millis(400)).await;
    let err = lock
        .try_acquire(&key("busy"), &opts(Duration::from_secs(5)))
        .await
        .unwrap_err();
    let mut killer = server.admin().await;
    let _: redis::RedisResult<()> = redis::cmd("SCRIPT")
        .arg("KILL")
        .query_async(&mut killer)
        .await;
    let _ = spin.await;
    eprintln!("error: {err}");
    assert!(err.is_retryable(), "BUSY should be retryable: {err}");
}

/// R3: SUBSCRIBEs are serialised behind one tokio mutex whose wait is not
/// bounded by the operation timeout nor by the caller's wait bound. With a
/// stalled SUBSCRIBE, N waiters on N keys finish after about N × timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r3_stalled_subscribes_never_run_past_the_wait_bound() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let server = PrivateRedis::start(Mode::NoPersistence).await.unwrap();
    let upstream = server.url().trim_start_matches("redis://").to_owned();
    // A proxy that silently swallows everything from a client once it sends SUBSCRIBE.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move {
        loop {
            let (c, _) = listener.accept().await.unwrap();
            let up = tokio::net::TcpStream::connect(&upstream).await.unwrap();
            let (mut ur, mut uw) = up.into_split();
            let (mut cr, mut cw) = c.into_split();
            tokio::spawn(async move {
                let _ = tokio::io::copy(&mut ur, &mut cw).await;
            });
            tokio::spawn(async move {
                let mut buf = vec![0u8; 65536];
                let mut stalled = false;
                loop {
                    let n = match cr.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => n,
                    };
                    if stalled {
                        continue;
                    }
                    if buf[..n]
                        .windows(9)
                        .any(|w| w.eq_ignore_ascii_case(b"SUBSCRIBE"))
                    {
                        stalled = true;
                        continue;
                    }
                    if uw.write_all(&buf[..n]).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    let direct = RedisLock::connect(&format!("{}?prefix=rv", server.url()))
        .await
        .unwrap();
    let url = format!("redis://127.0.0.1:{port}?prefix=rv&operation_timeout=1s");
    let proxied = RedisLock::connect(&url).await.unwrap();
    const N: usize = 4;
    let mut keys = Vec::new();
    for i in 0..N {
        let k = key(&format!("sub{i}"));
        granted(&direct, &k, &opts(Duration::from_secs(60))).await;
        keys.push(k);
    }
    let wait = LockOptions::builder()
        .ttl(Duration::from_secs(5))
        .wait_timeout(Duration::from_millis(500))
        .build()
        .unwrap();
    let start = Instant::now();
    let tasks: Vec<_> = keys
        .into_iter()
        .map(|k| {
            let (p, w) = (proxied.clone(), wait.clone());
            tokio::spawn(async move {
                let r = p.acquire(&k, &w).await;
                (
                    start.elapsed(),
                    r.map(|_| ())
                        .map_err(|e| format!("{e} retryable={}", e.is_retryable())),
                )
            })
        })
        .collect();
    let mut worst = Duration::ZERO;
    for t in tasks {
        let (took, r) = t.await.unwrap();
        eprintln!("{took:?}: {r:?}");
        worst = worst.max(took);
    }
    assert!(
        worst < Duration::from_millis(2500),
        "wait bound 500 ms, op timeout 1 s, yet the slowest acquire took {worst:?}"
    );
}

/// R4: a waiter that claims a hand-over with a queued attempt (the grant
/// found in the state) while its hand-over message is still on the way — in
/// a Redis Cluster pushes and replies travel apart — has stopped waiting by
/// the time the message arrives; the client then runs the leave script in
/// its name. That must not pass on the lease it now holds: the claim clears
/// the waiter's name from the state. The scripts are run directly, on a
/// state written as a release leaves it after handing the key over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r4_a_late_leave_cannot_pass_on_a_claimed_hand_over() {
    let server = PrivateRedis::start(Mode::NoPersistence).await.unwrap();
    let mut admin = server.admin().await;
    let prelude = include_str!("../scripts/prelude.lua");
    let acquire = redis::Script::new(&format!(
        "{prelude}{}",
        include_str!("../scripts/acquire.lua")
    ));
    let leave = redis::Script::new(&format!(
        "{prelude}{}",
        include_str!("../scripts/leave.lua")
    ));
    let (state, queue) = ("{rv/k}:l", "{rv/k}:q");
    let waiter = "abc123";
    // Handed to `waiter` (owner w), token 42, far from expiry.
    let () = redis::cmd("SET")
        .arg(state)
        .arg(format!("42|1|99999999999999|0|{waiter}|w"))
        .query_async(&mut admin)
        .await
        .unwrap();
    // The waiter's queued attempt finds the hand-over: {2, token}.
    let claimed: Vec<redis::Value> = acquire
        .key(state)
        .key(queue)
        .arg("w")
        .arg(30_000)
        .arg("0")
        .arg("")
        .arg(waiter)
        .arg(":w:client")
        .arg(4000)
        .arg("")
        .arg("")
        .invoke_async(&mut admin)
        .await
        .unwrap();
    assert_eq!(
        claimed,
        vec![
            redis::Value::Int(2),
            redis::Value::BulkString(b"42".to_vec())
        ]
    );
    // The late message's leave, in the waiter's name: nothing passed on.
    let passed: i64 = leave
        .key(state)
        .key(queue)
        .arg(waiter)
        .arg("")
        .invoke_async(&mut admin)
        .await
        .unwrap();
    assert_eq!(passed, 0, "a claimed lease was passed on");
    let now: String = redis::cmd("GET")
        .arg(state)
        .query_async(&mut admin)
        .await
        .unwrap();
    assert!(now.starts_with("42|1|"), "still held, token 42: {now}");
}
