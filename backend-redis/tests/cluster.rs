//! `redis+cluster://`: every lock lives on the shard that serves its key's
//! slot. On the shared cluster (`scripts/services.sh`, 7000-7005): locks on
//! every shard, hand-over by sharded pub/sub on each, the listing across
//! shards. On private clusters (loopback, own ports, 1 s node timeout): a
//! primary killed while a lock is held, and a held key's slot moved to
//! another shard.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::{
    collections::HashMap,
    time::{Duration, Instant},
};

use common::{key, opts};
use fenced_api::{fence::TokenFence, DistributedLock, Error, Lease, LockKey, ReleaseOutcome};
use fenced_redis::{redis, RedisLock};
use fenced_testkit::private::{admin_connection, cluster_slot_owner, PrivateRedisCluster};

/// `server` with a prefix and a re-check interval of 10 s: a waiter that
/// gets a key well within that was woken by a message, not by a re-check.
fn url(server: &str, prefix: &str) -> String {
    format!("{server}?prefix={prefix}&recheck_interval=10s&connect_timeout=5s&operation_timeout=5s")
}

fn prefix() -> String {
    format!("{}.cl", common::run_prefix())
}

/// The slot of a lock's names (`{prefix/key}`) and its primary's
/// `host:port`.
async fn owner_of(
    admin: &mut redis::aio::MultiplexedConnection,
    prefix: &str,
    k: &LockKey,
) -> (u16, String) {
    let (slot, (host, port)) = cluster_slot_owner(admin, &format!("{{{prefix}/{k}}}:l"))
        .await
        .unwrap();
    (slot, format!("{host}:{port}"))
}

/// One fresh key served by each primary (among the owners of 1000 random
/// keys, which every shard of a few is sure to be): `host:port` → key.
async fn key_per_shard(
    admin: &mut redis::aio::MultiplexedConnection,
    prefix: &str,
) -> HashMap<String, LockKey> {
    let mut keys = HashMap::new();
    for _ in 0..1000 {
        let k = key("shard");
        let (_, owner) = owner_of(admin, prefix, &k).await;
        keys.entry(owner).or_insert(k);
    }
    keys
}

/// Whether the node at `addr` holds the Redis key `name` itself (no
/// redirection: `EXISTS` on a node that does not serve the slot is MOVED).
async fn node_has(addr: &str, name: &str) -> bool {
    let mut c = admin_connection(&format!("redis://{addr}")).await.unwrap();
    let n: redis::RedisResult<i64> = redis::cmd("EXISTS").arg(name).query_async(&mut c).await;
    n.is_ok_and(|n| n == 1)
}

/// Retries a retryable error for up to `limit` (a failover or a slot move
/// under way), returning the first other outcome.
async fn retrying<T, F, Fut>(limit: Duration, mut f: F) -> fenced_api::Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = fenced_api::Result<T>>,
{
    let start = Instant::now();
    loop {
        match f().await {
            Err(e) if e.is_retryable() && start.elapsed() < limit => {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            other => return other,
        }
    }
}

/// `holder` takes `k`, `waiter` queues for it (as `node`, the shard's
/// primary, shows), and `holder`'s release hands it over: the waiter gets
/// it, by message (the re-check interval is 10 s, see [`url`]), with a
/// higher token, and gives it back.
async fn hand_over_on_shard(
    holder: &RedisLock,
    waiter: &RedisLock,
    k: &LockKey,
    node: &mut redis::aio::MultiplexedConnection,
    prefix: &str,
) {
    let o = opts(Duration::from_secs(30));
    let wait = o
        .to_builder()
        .wait_timeout(Duration::from_secs(8))
        .build()
        .unwrap();
    let held = holder.try_acquire(k, &o).await.unwrap().expect("free");
    let waiting = {
        let (waiter, k) = (waiter.clone(), k.clone());
        tokio::spawn(async move { waiter.acquire(&k, &wait).await })
    };
    // Until the waiter is queued on that shard.
    let queue = format!("{{{prefix}/{k}}}:q");
    let start = Instant::now();
    while common::queue_len(node, &queue).await == 0 {
        assert!(start.elapsed() < Duration::from_secs(10), "never queued");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let released = Instant::now();
    assert_eq!(
        holder.release(&held).await.unwrap(),
        ReleaseOutcome::Released
    );
    let got = waiting.await.unwrap().unwrap();
    let took = released.elapsed();
    // The re-check interval is 10 s: only the message explains this.
    assert!(
        took < Duration::from_secs(3),
        "hand-over of {k} took {took:?}"
    );
    assert!(got.token > held.token, "{} > {}", got.token, held.token);
    assert_eq!(
        waiter.release(&got).await.unwrap(),
        ReleaseOutcome::Released
    );
}

/// A holder on one client, a waiter on another: the release hands the key
/// over by message, on every shard, and the lock's names live on the shard
/// that serves the key (and nowhere else).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_shard_hands_over_by_message() {
    let server = fenced_testkit::shared::require_redis_cluster().await;
    let seed = server.trim_start_matches("redis+cluster://");
    let seed = seed.split(',').next().unwrap().to_owned();
    let mut admin = admin_connection(&format!("redis://{seed}")).await.unwrap();
    let prefix = prefix();
    let keys = key_per_shard(&mut admin, &prefix).await;
    assert_eq!(keys.len(), 3, "the shared cluster has three shards");
    let holder = RedisLock::connect(&url(&server, &prefix)).await.unwrap();
    let waiter = RedisLock::connect(&url(&server, &prefix)).await.unwrap();
    for (shard, k) in &keys {
        let mut node = admin_connection(&format!("redis://{shard}")).await.unwrap();
        hand_over_on_shard(&holder, &waiter, k, &mut node, &prefix).await;
        // The state (kept after the release, as the fence) is on that shard.
        let state = format!("{{{prefix}/{k}}}:l");
        assert!(node_has(shard, &state).await, "{state} lives on {shard}");
    }
    let o = opts(Duration::from_secs(30));
    // The listing walks every shard.
    let mut held = Vec::new();
    for k in keys.values() {
        held.push(holder.try_acquire(k, &o).await.unwrap().expect("free"));
    }
    let listed: Vec<LockKey> = holder
        .list(100)
        .await
        .unwrap()
        .into_iter()
        .map(|i| i.key)
        .collect();
    for k in keys.values() {
        assert!(listed.contains(k), "{k} listed: {listed:?}");
    }
    for l in held {
        holder.release(&l).await.unwrap();
    }
}

/// Bad cluster URLs are configuration errors, before anything connects.
#[tokio::test]
async fn cluster_urls_are_checked() {
    for (bad, says) in [
        ("redis+cluster://h1:7000,h2:x", "invalid port"),
        ("redis+cluster://h1:7000/3", "database 0"),
        ("redis+cluster://h1:7000?db=2", "database 0"),
        (
            "redis+cluster://h1:7000?min_replicas=1&replica_timeout=9s",
            "below the operation timeout",
        ),
        ("redis+cluster://,h2:7000", "host[:port]"),
        (
            "redis+cluster://h1:7000?address_map=h1:7000",
            "reachable-host:port",
        ),
        ("redis+cluster://h1:7000?address_map=h1>h2:1", "host[:port]"),
        (
            "redis://h1:7000?address_map=h1:7000>h2:1",
            "applies to redis+cluster:// (the addresses",
        ),
    ] {
        match RedisLock::connect(bad).await {
            Err(Error::Config { reason }) => assert!(reason.contains(says), "{bad}: {reason}"),
            other => panic!("{bad}: {other:?}"),
        }
    }
    // Nothing listens: a retryable error within about the connect timeout.
    let start = Instant::now();
    let e = RedisLock::connect("redis+cluster://127.0.0.1:1?connect_timeout=1s")
        .await
        .unwrap_err();
    assert!(e.is_retryable(), "{e}");
    assert!(
        start.elapsed() < Duration::from_secs(10),
        "{:?}",
        start.elapsed()
    );
}

/// A primary is SIGKILLed while a lock on its shard is held; its replica
/// takes over (node timeout 1 s). Replication is asynchronous: the lock is
/// on the promoted replica if it was replicated before the kill (on an idle
/// loopback it always is), so the holder renews it there and a contender
/// stays out. Either way every later grant's token is above the old
/// holder's, so a resource that keeps the highest token it saw rejects the
/// old holder's writes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_primary_fails_over_and_fencing_holds() {
    let cluster = PrivateRedisCluster::start(3, 1).await.unwrap();
    let server = cluster.url();
    let prefix = "failover";
    let primary = format!("127.0.0.1:{}", cluster.primary(0).port());
    let mut admin = cluster.primary(1).admin().await.unwrap();
    let k = key_per_shard(&mut admin, prefix)
        .await
        .remove(&primary)
        .unwrap();
    let holder = RedisLock::connect(&url(&server, prefix)).await.unwrap();
    let contender = RedisLock::connect(&url(&server, prefix)).await.unwrap();
    let o = opts(Duration::from_secs(30));
    let held = holder.try_acquire(&k, &o).await.unwrap().expect("free");
    let fence = TokenFence::new();
    assert!(fence.check(held.token).is_accepted());

    cluster.primary(0).kill();
    cluster
        .wait_for(
            Duration::from_secs(30),
            "the replica promoted",
            |info, _| info.contains("cluster_state:ok"),
        )
        .await
        .unwrap();
    let replica = format!("127.0.0.1:{}", cluster.replicas_of(0)[0].port());

    // The holder renews on the new primary: the lock was replicated.
    let renewed: Lease = retrying(Duration::from_secs(20), || holder.extend(&held, o.ttl()))
        .await
        .expect("the lock survived on the promoted replica");
    assert_eq!(renewed.token, held.token);
    assert!(node_has(&replica, &format!("{{{prefix}/{k}}}:l")).await);
    let busy = retrying(Duration::from_secs(10), || contender.try_acquire(&k, &o))
        .await
        .unwrap();
    assert!(busy.is_none(), "the key is still held after the failover");

    // The next holder's token is above every earlier one: the old holder,
    // had it lost the lock, could not write past the fence.
    assert_eq!(
        retrying(Duration::from_secs(10), || holder.release(&renewed))
            .await
            .unwrap(),
        ReleaseOutcome::Released
    );
    let next = retrying(Duration::from_secs(10), || contender.try_acquire(&k, &o))
        .await
        .unwrap()
        .expect("free after the release");
    assert!(next.token > held.token, "{} > {}", next.token, held.token);
    assert!(fence.check(next.token).is_accepted());
    assert!(
        !fence.check(held.token).is_accepted(),
        "the old holder's token is stale"
    );
}

/// The slot of a held key moves to another shard (`CLUSTER SETSLOT …
/// MIGRATING/IMPORTING`, `MIGRATE`, `SETSLOT … NODE`) while a waiter waits
/// on it: the holder renews and releases on the new shard (a call that
/// meets the move fails with a retryable error and the next one goes to
/// the new node), the lock's names moved with the slot, and the waiter —
/// whose subscription the old shard ended — gets the key on the new shard,
/// by message.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_keys_slot_moves_to_another_shard() {
    let cluster = PrivateRedisCluster::start(2, 0).await.unwrap();
    let server = cluster.url();
    let prefix = "reshard";
    let (a, b) = (cluster.primary(0), cluster.primary(1));
    let from = format!("127.0.0.1:{}", a.port());
    let to = format!("127.0.0.1:{}", b.port());
    let (mut ca, mut cb) = (a.admin().await.unwrap(), b.admin().await.unwrap());
    let k = key_per_shard(&mut ca, prefix).await.remove(&from).unwrap();
    let (slot, _) = owner_of(&mut ca, prefix, &k).await;
    let holder = RedisLock::connect(&url(&server, prefix)).await.unwrap();
    let waiter = RedisLock::connect(&url(&server, prefix)).await.unwrap();
    let o = opts(Duration::from_secs(30));
    let held = holder.try_acquire(&k, &o).await.unwrap().expect("free");
    let waiting = {
        let (waiter, k) = (waiter.clone(), k.clone());
        let wait = o
            .to_builder()
            .wait_timeout(Duration::from_secs(20))
            .build()
            .unwrap();
        // As a LockClient would: a call that meets the slot moving fails
        // with a retryable error (the client never re-sends a script by
        // itself), and the caller asks again.
        tokio::spawn(async move {
            retrying(Duration::from_secs(20), || waiter.acquire(&k, &wait)).await
        })
    };
    let queue = format!("{{{prefix}/{k}}}:q");
    let start = Instant::now();
    while common::queue_len(&mut ca, &queue).await == 0 {
        assert!(start.elapsed() < Duration::from_secs(10), "never queued");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }

    let id = |c: &mut redis::aio::MultiplexedConnection| {
        let mut c = c.clone();
        async move {
            redis::cmd("CLUSTER")
                .arg("MYID")
                .query_async::<String>(&mut c)
                .await
                .unwrap()
        }
    };
    let (ida, idb) = (id(&mut ca).await, id(&mut cb).await);
    let setslot = |state: &str, node: &str| {
        let mut c = redis::cmd("CLUSTER");
        c.arg("SETSLOT").arg(slot).arg(state).arg(node);
        c
    };
    let () = setslot("IMPORTING", &ida)
        .query_async(&mut cb)
        .await
        .unwrap();
    let () = setslot("MIGRATING", &idb)
        .query_async(&mut ca)
        .await
        .unwrap();
    let names: Vec<String> = redis::cmd("CLUSTER")
        .arg("GETKEYSINSLOT")
        .arg(slot)
        .arg(100)
        .query_async(&mut ca)
        .await
        .unwrap();
    assert!(names.len() >= 2, "state and queue in the slot: {names:?}");
    let () = redis::cmd("MIGRATE")
        .arg("127.0.0.1")
        .arg(b.port())
        .arg("")
        .arg(0)
        .arg(5000)
        .arg("KEYS")
        .arg(&names)
        .query_async(&mut ca)
        .await
        .unwrap();
    let () = setslot("NODE", &idb).query_async(&mut cb).await.unwrap();
    let () = setslot("NODE", &idb).query_async(&mut ca).await.unwrap();
    let state = format!("{{{prefix}/{k}}}:l");
    assert!(node_has(&to, &state).await, "the state moved to {to}");
    assert!(!node_has(&from, &state).await, "and left {from}");

    // The holder renews and releases on the new shard.
    let renewed = retrying(Duration::from_secs(10), || holder.extend(&held, o.ttl()))
        .await
        .unwrap();
    assert_eq!(renewed.token, held.token);
    let released = Instant::now();
    assert_eq!(
        retrying(Duration::from_secs(10), || holder.release(&renewed))
            .await
            .unwrap(),
        ReleaseOutcome::Released
    );
    let got = waiting.await.unwrap().unwrap();
    assert!(got.token > held.token);
    // The waiter subscribed again on the new shard, so the release reached
    // it by message (a re-check would take up to 10 s).
    let took = released.elapsed();
    assert!(took < Duration::from_secs(5), "hand-over took {took:?}");
    assert!(waiter
        .inspect(&k)
        .await
        .unwrap()
        .is_some_and(|i| i.token == got.token));
    waiter.release(&got).await.unwrap();
}

/// Whether `e` says too few replicas acknowledged (retryable).
fn short_of_replicas(e: &Error) -> bool {
    e.is_retryable() && e.to_string().contains("min_replicas")
}

/// The state value of `name` on the replica at `port` (`READONLY` first: a
/// cluster replica redirects reads otherwise).
async fn on_replica(port: u16, name: &str) -> Option<String> {
    let mut c = admin_connection(&format!("redis://127.0.0.1:{port}"))
        .await
        .unwrap();
    let () = redis::cmd("READONLY").query_async(&mut c).await.unwrap();
    redis::cmd("GET")
        .arg(name)
        .query_async(&mut c)
        .await
        .unwrap()
}

/// How many `WAIT`s the node at `port` ran (`INFO commandstats`).
async fn wait_calls(port: u16) -> u64 {
    let mut c = admin_connection(&format!("redis://127.0.0.1:{port}"))
        .await
        .unwrap();
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(&mut c)
        .await
        .unwrap();
    info.lines()
        .find_map(|l| l.strip_prefix("cmdstat_wait:calls="))
        .and_then(|rest| rest.split(',').next())
        .map_or(0, |n| n.parse().unwrap())
}

/// `min_replicas` on a Cluster: each grant and renewal waits for that many
/// replicas of the shard that serves the key (`WAIT`, sent with the script
/// in one pipeline). With shard 0's replica stopped, a grant there is
/// refused with a retryable error and given back, a renewal is reported
/// short while the lease stays extended on the primary, and the other
/// shards go on granting; with the replica back, shard 0 grants again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn min_replicas_waits_for_the_replicas_of_the_keys_shard() {
    let cluster = PrivateRedisCluster::start(3, 1).await.unwrap();
    let prefix = "replicated";
    let mut admin = cluster.primary(0).admin().await.unwrap();
    let keys = key_per_shard(&mut admin, prefix).await;
    assert_eq!(keys.len(), 3, "a key on every shard");
    let lock = RedisLock::connect(&format!(
        "{}&min_replicas=1&replica_timeout=300ms",
        url(&cluster.url(), prefix)
    ))
    .await
    .unwrap();
    let o = opts(Duration::from_secs(30));
    let shard = |i: usize| {
        let primary = format!("127.0.0.1:{}", cluster.primary(i).port());
        let k = keys[&primary].clone();
        let replica = cluster.replicas_of(i)[0].port();
        (k, replica)
    };

    // Every shard: once a grant returns, the shard's replica has it, and
    // the shard's primary ran a WAIT for each grant and renewal.
    for i in 0..3 {
        let (k, replica) = shard(i);
        let primary = cluster.primary(i).port();
        let waits_before = wait_calls(primary).await;
        for _ in 0..5 {
            let l = lock.try_acquire(&k, &o).await.unwrap().expect("free");
            let state = on_replica(replica, &format!("{{{prefix}/{k}}}:l"))
                .await
                .expect("replicated before the grant returned");
            assert!(state.starts_with(&format!("{}|1|", l.token)), "{state}");
            let l = lock.extend(&l, o.ttl()).await.unwrap();
            assert_eq!(lock.release(&l).await.unwrap(), ReleaseOutcome::Released);
        }
        let waits = wait_calls(primary).await - waits_before;
        assert!(
            waits >= 10,
            "{waits} WAITs on shard {i} for 5 grants and 5 renewals"
        );
    }

    // The permits script loaded everywhere, and a permit replicated too.
    let sems = lock.semaphores().expect("redis has semaphores");
    let (k0, _) = shard(0);
    let permit = fenced_api::Permits::semaphore(2).unwrap();
    let p = sems
        .try_acquire_permits(&k0, permit, &o)
        .await
        .unwrap()
        .expect("free");
    sems.release(&p).await.unwrap();
    let (k1, _) = shard(1);
    let held = lock.try_acquire(&k0, &o).await.unwrap().expect("free");
    // A client whose grants wait up to 1 s, with six connections for
    // replicated writes opened (and idle) while every node answers.
    let slow = RedisLock::connect(&format!(
        "{}&min_replicas=1&replica_timeout=1s",
        url(&cluster.url(), prefix)
    ))
    .await
    .unwrap();
    let warm: Vec<_> = (0..6)
        .map(|_| {
            let (slow, o) = (slow.clone(), o.clone());
            tokio::spawn(async move {
                let l = slow.try_acquire(&key("replicated-warm"), &o).await;
                slow.release(&l.unwrap().expect("free")).await.unwrap();
            })
        })
        .collect();
    for w in warm {
        w.await.unwrap();
    }
    cluster.replicas_of(0)[0].signal("STOP").unwrap();
    // A second key on shard 0 (its primary serves its slot).
    let primary0 = format!("127.0.0.1:{}", cluster.primary(0).port());
    let mut other = key("replicated-short");
    while owner_of(&mut admin, prefix, &other).await.1 != primary0 {
        other = key("replicated-short");
    }
    let start = Instant::now();
    let e = lock.try_acquire(&other, &o).await.unwrap_err();
    assert!(short_of_replicas(&e), "{e}");
    assert!(
        start.elapsed() < Duration::from_secs(4),
        "{:?}",
        start.elapsed()
    );
    assert!(lock.inspect(&other).await.unwrap().is_none(), "given back");
    let e = lock.extend(&held, o.ttl()).await.unwrap_err();
    assert!(short_of_replicas(&e), "{e}");
    let info = lock.inspect(&k0).await.unwrap().expect("still held");
    assert_eq!(info.token, held.token);
    // Another shard is not held up.
    let l = lock.try_acquire(&k1, &o).await.unwrap().expect("free");
    lock.release(&l).await.unwrap();
    // Grants on the stopped shard wait side by side, each on a connection
    // of its own, not one behind another's WAIT: six take about one
    // replica timeout (1 s here), in turn they would take at least 6 s.
    let mut fresh = Vec::new();
    while fresh.len() < 6 {
        let k = key("replicated-side");
        if owner_of(&mut admin, prefix, &k).await.1 == primary0 {
            fresh.push(k);
        }
    }
    let start = Instant::now();
    let grants: Vec<_> = fresh
        .into_iter()
        .map(|k| {
            let (slow, o) = (slow.clone(), o.clone());
            tokio::spawn(async move { slow.try_acquire(&k, &o).await })
        })
        .collect();
    for g in grants {
        let e = g.await.unwrap().unwrap_err();
        assert!(short_of_replicas(&e), "{e}");
    }
    let took = start.elapsed();
    assert!(
        took < Duration::from_secs(4),
        "six grants waiting for replicas took {took:?}: they waited in turn"
    );
    // A caller that leaves while its grant waits for the replica (its
    // future dropped): the grant, answered after it left, is given back,
    // so the key is free long before its 30 s TTL — a lock and a permit.
    let sems = slow.semaphores().expect("redis has semaphores");
    let mut on_shard0 = Vec::new();
    while on_shard0.len() < 2 {
        let k = key("replicated-left");
        if owner_of(&mut admin, prefix, &k).await.1 == primary0 {
            on_shard0.push(k);
        }
    }
    let (left, left_permit) = (on_shard0[0].clone(), on_shard0[1].clone());
    let gone = tokio::time::timeout(Duration::from_millis(300), slow.try_acquire(&left, &o)).await;
    assert!(gone.is_err(), "the grant waited for the stopped replica");
    let permit = fenced_api::Permits::semaphore(2).unwrap();
    let gone = tokio::time::timeout(
        Duration::from_millis(300),
        sems.try_acquire_permits(&left_permit, permit, &o),
    )
    .await;
    assert!(gone.is_err(), "the permit waited for the stopped replica");
    let start = Instant::now();
    loop {
        let lock_free = lock.inspect(&left).await.unwrap().is_none();
        let permits_free = sems
            .holders(&left_permit)
            .await
            .unwrap()
            .is_none_or(|h| h.holders.is_empty());
        if lock_free && permits_free {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(8),
            "a grant whose caller left was not given back (lock free: {lock_free}, permits free: {permits_free})"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    cluster.replicas_of(0)[0].signal("CONT").unwrap();
    let renewed = retrying(Duration::from_secs(10), || lock.extend(&held, o.ttl()))
        .await
        .expect("renewed once the replica is back");
    assert_eq!(
        lock.release(&renewed).await.unwrap(),
        ReleaseOutcome::Released
    );
    let l = retrying(Duration::from_secs(10), || lock.try_acquire(&other, &o))
        .await
        .unwrap()
        .expect("free");
    lock.release(&l).await.unwrap();
}

/// `rediss+cluster://`: TLS to every node (the cluster's nodes speak TLS
/// only, to clients, to their replicas and on the cluster bus). Locks on
/// every shard with a hand-over by message and `min_replicas` on each; the
/// certificate is verified unless the URL ends in `#insecure`, and plain
/// text to the TLS ports is refused.
#[cfg(feature = "tls")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rediss_cluster_urls_speak_tls_to_every_node() {
    let dir = fenced_testkit::private::temp_dir("redis-cluster-tls").unwrap();
    let files = fenced_testkit::private::TestCa::new("fenced redis cluster test CA")
        .unwrap()
        .issue_server(dir.path())
        .unwrap();
    let cluster = PrivateRedisCluster::start_tls(3, 1, files).await.unwrap();
    let server = cluster.url();
    assert!(server.starts_with("rediss+cluster://"), "{server}");
    let prefix = "tls";
    let mut admin = cluster.primary(0).admin().await.unwrap();
    let keys = key_per_shard(&mut admin, prefix).await;
    assert_eq!(keys.len(), 3, "a key on every shard");
    // The test CA is trusted by no one: `#insecure` (TLS still encrypts).
    let insecure = format!(
        "{}&min_replicas=1&replica_timeout=2s#insecure",
        url(&server, prefix)
    );
    let holder = RedisLock::connect(&insecure).await.unwrap();
    let waiter = RedisLock::connect(&insecure).await.unwrap();
    for k in keys.values() {
        let (_, owner) = owner_of(&mut admin, prefix, k).await;
        let node = cluster
            .nodes()
            .find(|n| format!("127.0.0.1:{}", n.port()) == owner)
            .expect("the owner is a node of the cluster");
        let mut node = node.admin().await.unwrap();
        hand_over_on_shard(&holder, &waiter, k, &mut node, prefix).await;
    }

    // Without `#insecure` the certificate is checked, and refused.
    let verified = format!("{}&operation_timeout=2s", url(&server, prefix))
        .replace("operation_timeout=5s&", "");
    match RedisLock::connect(&verified).await {
        Err(e @ Error::Config { .. }) => assert!(
            e.to_string().contains("certificate"),
            "refused for another reason: {e}"
        ),
        other => panic!("an untrusted certificate: {other:?}"),
    }
    // Plain text to the TLS ports is refused.
    let plain = url(
        &server.replace("rediss+cluster://", "redis+cluster://"),
        prefix,
    )
    .replace(
        "connect_timeout=5s&operation_timeout=5s",
        "connect_timeout=1s&operation_timeout=1s",
    );
    match RedisLock::connect(&plain).await {
        Err(e) => assert!(e.is_retryable(), "{e}"),
        Ok(_) => panic!("plain text accepted on the TLS ports"),
    }
}
