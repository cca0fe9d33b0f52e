//! Redis-specific tests: scripts reloaded after `SCRIPT FLUSH`, commands
//! per contended acquisition (against a naive poll loop), TTLs rejected
//! before any I/O, the waiter queue and its subscriptions. Servers that are
//! counted are private `redis-server` processes started here; the shared one
//! is only used under this run's prefix. Restarts are in `restart.rs`,
//! connection faults and TLS in `connection.rs`.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stderr)]

mod common;
mod on_private;

use std::{
    collections::HashMap,
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc,
    },
    time::Duration,
};

use common::{
    command_stats, delta, key, opts,
    private::{admin, Mode, PrivateRedis},
    server_url, until_queued, until_queued_within, url_for,
};
use fenced_api::{
    DistributedLock, Error, FencingToken, LockKey, LockOptions, Owner, ReleaseOutcome,
};
use fenced_redis::{redis, RedisLock};
use on_private::{hold, on_private};

/// SHA1s of the crate's scripts (the prelude, then each file), as EVALSHA names them.
fn script_hashes() -> Vec<String> {
    const PRELUDE: &str = include_str!("../scripts/prelude.lua");
    [
        include_str!("../scripts/acquire.lua"),
        include_str!("../scripts/extend.lua"),
        include_str!("../scripts/release.lua"),
        include_str!("../scripts/force_release.lua"),
        include_str!("../scripts/leave.lua"),
        include_str!("../scripts/inspect.lua"),
    ]
    .iter()
    .map(|code| {
        redis::Script::new(&format!("{PRELUDE}{code}"))
            .get_hash()
            .to_owned()
    })
    .collect()
}

async fn scripts_loaded(conn: &mut redis::aio::MultiplexedConnection) -> Vec<bool> {
    redis::cmd("SCRIPT")
        .arg("EXISTS")
        .arg(script_hashes())
        .query_async(conn)
        .await
        .unwrap()
}

#[tokio::test]
async fn scripts_survive_script_flush() {
    let (_server, mut admin, lock, k) = on_private("flush").await;
    let held = hold(&lock, &k, Duration::from_secs(10)).await;
    assert!(scripts_loaded(&mut admin).await[0], "acquire loaded");

    redis::cmd("SCRIPT")
        .arg("FLUSH")
        .query_async::<()>(&mut admin)
        .await
        .unwrap();
    assert!(
        scripts_loaded(&mut admin).await.iter().all(|l| !l),
        "SCRIPT FLUSH emptied the cache"
    );

    // Every operation still works: NOSCRIPT → SCRIPT LOAD → EVALSHA.
    let held = lock.extend(&held, Duration::from_secs(10)).await.unwrap();
    let info = lock.inspect(&k).await.unwrap().unwrap();
    assert_eq!(info.token, held.token);
    assert!(lock
        .try_acquire(&k, &opts(Duration::from_secs(1)))
        .await
        .unwrap()
        .is_none());
    assert_eq!(lock.release(&held).await.unwrap(), ReleaseOutcome::Released);
    let next = hold(&lock, &k, Duration::from_secs(1)).await;
    assert!(next.token > held.token);
    assert!(lock.force_release(&k).await.unwrap());
    let loaded = scripts_loaded(&mut admin).await;
    assert_eq!(
        loaded,
        vec![true, true, true, true, false, true],
        "acquire, extend, release, force_release, leave (unused), inspect"
    );
}

/// Commands our scripts run inside Redis (counted by INFO commandstats but
/// not sent by the client).
const SCRIPT_INTERNAL: &[&str] = &[
    "get", "set", "time", "zadd", "zrem", "zpopmin", "zrange", "pexpire", "publish",
];

/// Commands sent by the clients per acquisition, from commandstats deltas.
/// The test's own INFO calls are left out.
fn client_commands(d: &HashMap<String, u64>) -> u64 {
    d.iter()
        .filter(|(name, _)| !SCRIPT_INTERNAL.contains(&name.as_str()) && *name != "info")
        .map(|(_, n)| n)
        .sum()
}

struct Run {
    acquisitions: usize,
    client_commands: u64,
    all_commands: u64,
    breakdown: Vec<(String, u64)>,
}

impl Run {
    fn per_acquisition(&self) -> f64 {
        self.client_commands as f64 / self.acquisitions as f64
    }
}

/// 16 independent clients × `rounds` acquisitions of one key, each holding
/// for `hold`; `naive` waiters poll `try_acquire` every 5 ms instead.
async fn contended_run(server: &PrivateRedis, naive: bool, rounds: usize, hold: Duration) -> Run {
    const CLIENTS: usize = 16;
    let prefix = if naive { "naive" } else { "fenced" };
    let url = url_for(&server.url(), prefix);
    let mut clients = Vec::new();
    for _ in 0..CLIENTS {
        clients.push(Arc::new(RedisLock::connect(&url).await.unwrap()));
    }
    let k = key("contended");
    let wait = LockOptions::builder()
        .ttl(Duration::from_secs(10))
        .wait_timeout(Duration::from_secs(60))
        .build()
        .unwrap();
    let inside = Arc::new(AtomicUsize::new(0));
    let run = |rounds: usize| {
        let mut tasks = Vec::new();
        for lock in &clients {
            let (lock, k, wait, inside) = (lock.clone(), k.clone(), wait.clone(), inside.clone());
            tasks.push(tokio::spawn(async move {
                let mut last = FencingToken::new(0);
                for _ in 0..rounds {
                    let lease = if naive {
                        loop {
                            if let Some(l) = lock.try_acquire(&k, &wait).await.unwrap() {
                                break l;
                            }
                            tokio::time::sleep(Duration::from_millis(5)).await;
                        }
                    } else {
                        lock.acquire(&k, &wait).await.unwrap()
                    };
                    assert!(lease.token > last);
                    last = lease.token;
                    assert_eq!(inside.fetch_add(1, Ordering::SeqCst), 0, "two holders");
                    tokio::time::sleep(hold).await;
                    inside.fetch_sub(1, Ordering::SeqCst);
                    assert_eq!(
                        lock.release(&lease).await.unwrap(),
                        ReleaseOutcome::Released
                    );
                }
            }));
        }
        async move {
            for t in tasks {
                t.await.unwrap();
            }
        }
    };
    // Warm-up: connections, script loads and subscriptions happen once per
    // client; the measured rounds show the steady state.
    run(1).await;
    let mut admin = server.admin().await;
    let before = command_stats(&mut admin).await;
    run(rounds).await;
    let after = command_stats(&mut admin).await;
    let d = delta(&before, &after);
    let mut breakdown: Vec<_> = d.clone().into_iter().collect();
    breakdown.sort_by_key(|(_, n)| std::cmp::Reverse(*n));
    Run {
        acquisitions: CLIENTS * rounds,
        client_commands: client_commands(&d),
        all_commands: d.iter().filter(|(n, _)| *n != "info").map(|(_, v)| v).sum(),
        breakdown,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn contended_waiters_send_few_commands_per_acquisition() {
    let server = PrivateRedis::start(Mode::NoPersistence).await.unwrap();
    let hold = Duration::from_millis(5);
    let fenced = contended_run(&server, false, 10, hold).await;
    let naive = contended_run(&server, true, 10, hold).await;
    for (name, run) in [("fenced acquire", &fenced), ("naive 5 ms poll", &naive)] {
        eprintln!(
            "{name}: {} acquisitions, {} client commands ({:.2} per acquisition, release included), \
             {} commands counting those run inside scripts; {:?}",
            run.acquisitions,
            run.client_commands,
            run.per_acquisition(),
            run.all_commands,
            run.breakdown
        );
    }
    assert!(
        fenced.per_acquisition() <= 5.0,
        "{:.2} commands per contended acquisition (want ≤ 5): {:?}",
        fenced.per_acquisition(),
        fenced.breakdown
    );
    assert!(
        naive.per_acquisition() > fenced.per_acquisition() * 2.0,
        "the naive poll loop sent {:.2} per acquisition, fenced {:.2}",
        naive.per_acquisition(),
        fenced.per_acquisition()
    );
}

/// The common path: one script to acquire, one to release, and inside them
/// only the state key and the server clock (no fence counter, no queue, no
/// message when nobody waits).
#[tokio::test]
async fn an_uncontended_cycle_is_two_round_trips_and_eight_commands() {
    const CYCLES: u64 = 50;
    let (_server, mut admin, lock, k) = on_private("cycle").await;
    let wait = LockOptions::builder()
        .ttl(Duration::from_secs(30))
        .wait_timeout(Duration::from_secs(5))
        .build()
        .unwrap();
    let mut last = FencingToken::new(0);
    let cycle = || {
        let (lock, k, wait) = (lock.clone(), k.clone(), wait.clone());
        async move {
            let l = lock.acquire(&k, &wait).await.unwrap();
            assert_eq!(lock.release(&l).await.unwrap(), ReleaseOutcome::Released);
            l.token
        }
    };
    // Warm-up: the scripts are loaded once.
    cycle().await;
    let before = command_stats(&mut admin).await;
    for _ in 0..CYCLES {
        let token = cycle().await;
        assert!(token > last);
        last = token;
    }
    let after = command_stats(&mut admin).await;
    let mut d = delta(&before, &after);
    d.remove("info");
    eprintln!("{CYCLES} cycles: {d:?}");
    let want: HashMap<String, u64> = [("evalsha", 2), ("get", 2), ("time", 2), ("set", 2)]
        .into_iter()
        .map(|(c, n)| (c.to_owned(), n * CYCLES))
        .collect();
    assert_eq!(d, want, "commands per acquire + release cycle");
}

/// A batch of renewals is one script run per 256 leases, and the script
/// answers for each lease: a released one and one taken over by another
/// holder come back lost, the others renewed to the new TTL, and nothing
/// else is changed.
#[tokio::test]
async fn extend_many_is_one_script_per_chunk_and_answers_per_lease() {
    const HELD: usize = 300;
    let (_server, mut admin, lock, k) = on_private("batch").await;
    let mut held = Vec::new();
    for i in 0..HELD {
        let key = LockKey::new(format!("{k}-{i}")).unwrap();
        held.push(hold(&lock, &key, Duration::from_secs(5)).await);
    }
    // One released; one released and taken by another owner.
    assert_eq!(
        lock.release(&held[7]).await.unwrap(),
        ReleaseOutcome::Released
    );
    assert_eq!(
        lock.release(&held[280]).await.unwrap(),
        ReleaseOutcome::Released
    );
    let other = lock
        .try_acquire(&held[280].key, &opts(Duration::from_secs(5)))
        .await
        .unwrap()
        .unwrap();

    // The script is loaded by a first renewal.
    held[0] = lock.extend(&held[0], Duration::from_secs(5)).await.unwrap();

    let before = command_stats(&mut admin).await;
    let results = lock.extend_many(&held, Duration::from_secs(60)).await;
    let mut d = delta(&before, &command_stats(&mut admin).await);
    d.remove("info");
    assert_eq!(d.get("evalsha"), Some(&2), "two chunks (256 + 44): {d:?}");
    assert_eq!(d.get("set"), Some(&(HELD as u64 - 2)), "{d:?}");

    assert_eq!(results.len(), HELD);
    for (i, r) in results.iter().enumerate() {
        match (i, r) {
            (7 | 280, Err(Error::LeaseLost { .. })) => {}
            (7 | 280, other) => panic!("lease {i} was not current: {other:?}"),
            (_, Ok(l)) => assert_eq!(l.token, held[i].token),
            (_, Err(e)) => panic!("lease {i}: {e}"),
        }
    }
    // Renewed on the server to about 60 s; the other owner's lease kept its 5 s.
    let renewed = lock.inspect(&held[0].key).await.unwrap().unwrap();
    assert!(
        renewed.remaining_ttl > Duration::from_secs(50),
        "{renewed:?}"
    );
    let theirs = lock.inspect(&other.key).await.unwrap().unwrap();
    assert_eq!(theirs.token, other.token);
    assert!(theirs.remaining_ttl <= Duration::from_secs(5), "{theirs:?}");
    assert!(lock.inspect(&held[7].key).await.unwrap().is_none());
}

/// The clock steps back (or the last token is ahead of it): tokens keep
/// rising by one; at 2⁵³ the acquire fails and writes nothing.
#[tokio::test]
async fn tokens_rise_past_a_clock_behind_the_last_token() {
    let (_server, mut admin, lock, k) = on_private("clock").await;
    let state = format!("{{clock/{}}}:l", k.as_str());
    let set_last = |admin: &mut redis::aio::MultiplexedConnection, last: u64| {
        let (mut admin, state) = (admin.clone(), state.clone());
        async move {
            let _: () = redis::cmd("SET")
                .arg(&state)
                .arg(format!("{last}|0|0|0||"))
                .query_async(&mut admin)
                .await
                .unwrap();
        }
    };
    // Far ahead of the server clock (about 1.8 × 10¹⁵ µs in 2026).
    let ahead = 8_000_000_000_000_000u64;
    set_last(&mut admin, ahead).await;
    for i in 1..=3 {
        let l = hold(&lock, &k, Duration::from_secs(5)).await;
        assert_eq!(l.token, FencingToken::new(ahead + i));
        lock.release(&l).await.unwrap();
    }
    let max = (1u64 << 53) - 1;
    set_last(&mut admin, max).await;
    let err = lock
        .try_acquire(&k, &opts(Duration::from_secs(5)))
        .await
        .unwrap_err();
    assert!(err.to_string().contains("2^53"), "{err}");
    let kept: String = redis::cmd("GET")
        .arg(&state)
        .query_async(&mut admin)
        .await
        .unwrap();
    assert_eq!(kept, format!("{max}|0|0|0||"), "nothing written");
}

#[tokio::test]
async fn bad_ttls_never_reach_redis() {
    let (_server, mut admin, lock, k) = on_private("ttl").await;
    let held = hold(&lock, &k, Duration::from_secs(30)).await;
    let before = command_stats(&mut admin).await;
    for ttl in [
        Duration::ZERO,
        Duration::MAX,
        Duration::from_secs(u64::MAX / 1000),
    ] {
        assert!(matches!(
            LockOptions::builder().ttl(ttl).build(),
            Err(Error::InvalidOptions { .. })
        ));
        match lock.extend(&held, ttl).await {
            Err(Error::InvalidOptions { .. }) => {}
            other => panic!("extend with {ttl:?} gave {other:?}"),
        }
    }
    let after = command_stats(&mut admin).await;
    let sent: Vec<_> = delta(&before, &after)
        .into_iter()
        .filter(|(n, _)| n != "info")
        .collect();
    assert!(sent.is_empty(), "invalid TTLs reached redis: {sent:?}");
    // The lock kept its expiry: it was not extended by a wrapped-around value
    // or expired at once (Redis has expired keys on overflowing PX values).
    let info = lock.inspect(&k).await.unwrap().unwrap();
    assert!(
        info.remaining_ttl > Duration::from_secs(20)
            && info.remaining_ttl <= Duration::from_secs(30)
    );
    // The largest valid TTL is honoured exactly, in milliseconds.
    let max = lock.extend(&held, LockOptions::MAX_TTL).await.unwrap();
    let info = lock.inspect(&k).await.unwrap().unwrap();
    assert_eq!(max.ttl, LockOptions::MAX_TTL);
    assert!(info.remaining_ttl > LockOptions::MAX_TTL - Duration::from_secs(5));
    lock.release(&max).await.unwrap();
}

#[tokio::test]
async fn a_cancelled_waiter_leaves_the_queue_and_passes_the_wake_up_on() {
    let url = url_for(&server_url().await, common::run_prefix());
    let (holder, waiter, next) = (
        RedisLock::connect(&url).await.unwrap(),
        RedisLock::connect(&url).await.unwrap(),
        RedisLock::connect(&url).await.unwrap(),
    );
    let k = key("leave");
    let long = LockOptions::builder()
        .ttl(Duration::from_secs(30))
        .wait_timeout(Duration::from_secs(30))
        .build()
        .unwrap();
    let held = holder.try_acquire(&k, &long).await.unwrap().unwrap();
    // The first waiter queues, then is cancelled.
    let cancelled =
        tokio::time::timeout(Duration::from_millis(300), waiter.acquire(&k, &long)).await;
    assert!(cancelled.is_err());
    // The cancelled waiter leaves in the background, within milliseconds;
    // an entry left behind would stay for its waiter lease (seconds).
    let mut admin = admin(&server_url().await).await;
    let queue = format!("{{{}/{}}}:q", common::run_prefix(), k.as_str());
    until_queued_within(&mut admin, &queue, 0, Duration::from_secs(2)).await;
    // The second waiter queues alone and must be woken by the release.
    let next_task = {
        let (k, long) = (k.clone(), long.clone());
        tokio::spawn(async move {
            let start = tokio::time::Instant::now();
            let l = next.acquire(&k, &long).await.unwrap();
            (l, start.elapsed(), next)
        })
    };
    until_queued(&mut admin, &queue, 1).await;
    holder.release(&held).await.unwrap();
    let (lease, waited, next) = next_task.await.unwrap();
    assert!(lease.token > held.token);
    assert!(waited < Duration::from_secs(5));
    let queued: i64 = redis::cmd("ZCARD")
        .arg(&queue)
        .query_async(&mut admin)
        .await
        .unwrap();
    assert_eq!(queued, 0, "the granted waiter left the queue");
    next.release(&lease).await.unwrap();
}

#[tokio::test]
async fn explicit_owner_reentry_and_inspect_on_redis() {
    let url = url_for(&server_url().await, common::run_prefix());
    let lock = RedisLock::connect(&url).await.unwrap();
    let k = key("owner");
    let o = LockOptions::builder()
        .ttl(Duration::from_secs(5))
        .owner("node-1")
        .reentrant(true)
        .build()
        .unwrap();
    let a = lock.try_acquire(&k, &o).await.unwrap().unwrap();
    // Re-entering with a shorter TTL never shortens the lock.
    let short = o
        .to_builder()
        .ttl(Duration::from_millis(100))
        .build()
        .unwrap();
    let b = lock.try_acquire(&k, &short).await.unwrap().unwrap();
    assert_eq!(a.token, b.token);
    let info = lock.inspect(&k).await.unwrap().unwrap();
    assert_eq!(info.owner, Owner::new("node-1").unwrap());
    assert_eq!(info.hold_count, 2);
    assert!(info.remaining_ttl > Duration::from_secs(4));
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(lock.inspect(&k).await.unwrap().is_some());
    assert_eq!(
        lock.release(&b).await.unwrap(),
        ReleaseOutcome::StillHeld { remaining: 1 }
    );
    assert_eq!(lock.release(&a).await.unwrap(), ReleaseOutcome::Released);
}

/// `sub=` of every connection in `CLIENT LIST` but the one asking.
async fn fenced_subscriptions(admin: &mut redis::aio::MultiplexedConnection) -> Vec<u64> {
    let list: String = redis::cmd("CLIENT")
        .arg("LIST")
        .query_async(admin)
        .await
        .unwrap();
    list.lines()
        .filter(|l| !l.contains("cmd=client|list"))
        .map(|l| {
            l.split(' ')
                .find_map(|f| f.strip_prefix("sub="))
                .unwrap()
                .parse()
                .unwrap()
        })
        .collect()
}

#[tokio::test]
async fn one_subscription_per_client_serves_every_key() {
    let server = PrivateRedis::start(Mode::NoPersistence).await.unwrap();
    let mut admin = server.admin().await;
    let url = url_for(&server.url(), "wake");
    // A 10 s re-check interval: only the hand-over message can wake the waiter quickly.
    let (holder, waiter) = (
        RedisLock::connect(&url).await.unwrap(),
        RedisLock::connect(&format!("{url}&recheck_interval=10s"))
            .await
            .unwrap(),
    );
    let mut subs = fenced_subscriptions(&mut admin).await;
    subs.sort_unstable();
    assert_eq!(subs, vec![0, 0], "nobody subscribes before waiting");
    let wait = LockOptions::builder()
        .ttl(Duration::from_secs(30))
        .wait_timeout(Duration::from_secs(20))
        .build()
        .unwrap();
    for i in 0..3 {
        let k = key(&format!("wake{i}"));
        let held = hold(&holder, &k, Duration::from_secs(30)).await;
        let task = {
            let (k, waiter, wait) = (k.clone(), waiter.clone(), wait.clone());
            tokio::spawn(async move { waiter.acquire(&k, &wait).await })
        };
        tokio::time::sleep(Duration::from_millis(300)).await;
        let released = tokio::time::Instant::now();
        holder.release(&held).await.unwrap();
        let got = task.await.unwrap().unwrap();
        assert!(got.token > held.token);
        assert!(
            released.elapsed() < Duration::from_secs(5),
            "woken by the hand-over, not a re-check"
        );
        waiter.release(&got).await.unwrap();
    }
    let mut subs = fenced_subscriptions(&mut admin).await;
    subs.sort_unstable();
    assert_eq!(
        subs,
        vec![0, 1],
        "one channel for the waiting client, for all keys"
    );
}

#[tokio::test]
async fn the_driver_serves_redis_urls() {
    let driver = fenced_redis::driver();
    assert_eq!(driver.name, "redis");
    assert!(driver.serves("redis://h") && driver.serves("rediss://h"));
    assert!(!driver.serves("mysql://h/db") && !driver.serves("redis+unix:///tmp/s"));
    assert!(driver.migrate.is_none());
    let url = url_for(&server_url().await, common::run_prefix());
    let lock = (driver.connect)(url).await.unwrap();
    assert_eq!(lock.capabilities().backend_name(), "redis");
    let k = key("driver");
    let l = hold(&lock, &k, Duration::from_secs(5)).await;
    assert_eq!(lock.release(&l).await.unwrap(), ReleaseOutcome::Released);
}

/// `list` walks every SCAN batch (more held locks than one `COUNT`), leaves
/// out released and free state keys and other prefixes, sorts by key, and
/// stops at `limit`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn list_walks_every_scan_batch_and_stops_at_the_limit() {
    let server = server_url().await;
    let id = &uuid::Uuid::new_v4().simple().to_string()[..10];
    let lock = RedisLock::connect(&url_for(&server, &format!("fenced-list-{id}")))
        .await
        .unwrap();
    let other = RedisLock::connect(&url_for(&server, &format!("fenced-list-{id}x")))
        .await
        .unwrap();
    let o = opts(Duration::from_secs(60));
    let mut held = Vec::new();
    for i in 0..1200 {
        let l = lock
            .try_acquire(&key(&format!("k{i:05}*")), &o)
            .await
            .unwrap()
            .unwrap();
        held.push(l);
    }
    // A free state key (kept after release) and a lock of another prefix.
    let freed = lock.try_acquire(&key("freed"), &o).await.unwrap().unwrap();
    lock.release(&freed).await.unwrap();
    let elsewhere = other
        .try_acquire(&key("k00000*"), &o)
        .await
        .unwrap()
        .unwrap();

    let all = lock.list(10_000).await.unwrap();
    assert_eq!(all.len(), held.len());
    for (info, lease) in all.iter().zip(&held) {
        assert_eq!((&info.key, info.token), (&lease.key, lease.token));
    }
    let some = lock.list(7).await.unwrap();
    assert_eq!(some.len(), 7);
    assert!(some.windows(2).all(|w| w[0].key < w[1].key));
    let theirs = other.list(10).await.unwrap();
    assert_eq!(theirs.len(), 1);
    assert_eq!(theirs[0].token, elsewhere.token);

    for l in &held {
        lock.release(l).await.unwrap();
    }
    other.release(&elsewhere).await.unwrap();
    assert!(lock.list(10).await.unwrap().is_empty());
}

/// The label travels with a queued waiter: a release that hands the key
/// over stores the waiter's label (and owner) from its queue entry; a
/// re-entry keeps the first entry's label. Labels may hold `|`.
#[tokio::test]
async fn labels_survive_hand_over_and_re_entry() {
    let url = url_for(&server_url().await, common::run_prefix());
    let (holder, waiter) = (
        RedisLock::connect(&url).await.unwrap(),
        RedisLock::connect(&url).await.unwrap(),
    );
    let k = key("label-handover");
    let first = LockOptions::builder()
        .ttl(Duration::from_secs(10))
        .owner("o|1")
        .label("holder|1 ü")
        .reentrant(true)
        .build()
        .unwrap();
    let held = holder.try_acquire(&k, &first).await.unwrap().unwrap();
    let again = first.to_builder().label("second entry").build().unwrap();
    let entered = holder.try_acquire(&k, &again).await.unwrap().unwrap();
    let info = waiter.inspect(&k).await.unwrap().unwrap();
    assert_eq!((info.hold_count, info.owner.as_str()), (2, "o|1"));
    assert_eq!(info.label.unwrap().as_str(), "holder|1 ü");

    let next = LockOptions::builder()
        .ttl(Duration::from_secs(10))
        .wait_timeout(Duration::from_secs(10))
        .label("waiter|2")
        .build()
        .unwrap();
    let task = {
        let k = k.clone();
        tokio::spawn(async move { (waiter.acquire(&k, &next).await.unwrap(), waiter) })
    };
    let mut admin = admin(&server_url().await).await;
    let queue = format!("{{{}/{}}}:q", common::run_prefix(), k.as_str());
    until_queued(&mut admin, &queue, 1).await;
    holder.release(&entered).await.unwrap();
    holder.release(&held).await.unwrap();
    let (lease, waiter) = task.await.unwrap();
    let info = holder.inspect(&k).await.unwrap().unwrap();
    assert_eq!(info.owner, lease.owner, "handed over");
    assert_eq!(info.label.unwrap().as_str(), "waiter|2");
    waiter.release(&lease).await.unwrap();
}

/// A state whose holder has no label (`token|count|expiry|queued|waiter|owner`,
/// no newline) reads: held, no label, and its holder can release.
#[tokio::test]
async fn a_state_without_a_label_still_reads() {
    let url = url_for(&server_url().await, common::run_prefix());
    let lock = RedisLock::connect(&url).await.unwrap();
    let k = key("label-old-state");
    let mut admin = admin(&server_url().await).await;
    let time: Vec<String> = redis::cmd("TIME").query_async(&mut admin).await.unwrap();
    let now_ms = time[0].parse::<u64>().unwrap() * 1000;
    let state = format!("{{{}/{}}}:l", common::run_prefix(), k.as_str());
    let () = redis::cmd("SET")
        .arg(&state)
        .arg(format!("1000|1|{}|0||old|owner", now_ms + 60_000))
        .query_async(&mut admin)
        .await
        .unwrap();
    let info = lock.inspect(&k).await.unwrap().unwrap();
    assert_eq!(info.owner.as_str(), "old|owner");
    assert_eq!(info.label, None);
    assert_eq!(
        lock.list(1000)
            .await
            .unwrap()
            .iter()
            .find(|i| i.key == k)
            .unwrap()
            .label,
        None
    );
    let lease = fenced_api::Lease::new(
        k.clone(),
        Owner::new("old|owner").unwrap(),
        FencingToken::new(1000),
        Duration::from_secs(60),
        tokio::time::Instant::now(),
    );
    assert_eq!(
        lock.release(&lease).await.unwrap(),
        ReleaseOutcome::Released
    );
    assert!(lock.inspect(&k).await.unwrap().is_none());
}
