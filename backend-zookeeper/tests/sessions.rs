//! Locks and their sessions: no lock lives on a session shorter than its
//! TTL, so a cut-off holder's deadline always comes before the server can
//! free its key; a TTL longer than the server's longest session is granted
//! shorter, says so, and `LockClient` renews by what was granted.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::{sync::Arc, time::Duration};

use common::{opts, run_namespace, server_hosts, Blackhole};
use fenced_api::{DistributedLock, LockClient, LockKey};
use fenced_testkit::private::{PrivateZooKeeper, ZooKeeperOptions};
use fenced_zookeeper::ZkLock;
use tokio::time::Instant;

/// Generous bound on every wait (a hang catcher).
const WAIT: Duration = Duration::from_secs(30);

fn key(k: &str) -> LockKey {
    LockKey::new(k).expect("a valid key")
}

/// The base session is 2 s, the lock's TTL 6 s: the lock must live on a
/// session of its own length. Were it on the 2 s session, the server would
/// expire that session about 2 s after the cut and grant the key to the
/// other client while the cut-off holder still trusted its lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cut_off_holder_keeps_the_key_until_its_deadline_when_its_ttl_exceeds_the_base_session() {
    let hosts = server_hosts().await;
    let first_host = hosts.split(',').next().unwrap_or(&hosts).to_owned();
    let ns = run_namespace();
    let proxy = Blackhole::start(&first_host).await;
    let holder = ZkLock::connect(&format!(
        "zk://{}{ns}?session_timeout=2s&connect_timeout=3s&timeout=2s",
        proxy.hostport()
    ))
    .await
    .expect("holder connects");
    assert_eq!(
        holder.negotiated_session_timeout(),
        Some(Duration::from_secs(2))
    );
    let other = ZkLock::connect(&format!(
        "zk://{hosts}{ns}?session_timeout=2s&connect_timeout=3s"
    ))
    .await
    .expect("other client connects");

    let k = key("longer-than-the-base-session");
    let ttl = Duration::from_secs(6);
    let lease = holder
        .acquire(&k, &opts(ttl, WAIT))
        .await
        .expect("the holder gets the free key");
    assert_eq!(lease.ttl, ttl, "the server grants 6 s sessions");
    proxy.blackhole();

    let next = other
        .acquire(&k, &opts(Duration::from_secs(2), WAIT))
        .await
        .expect("the key is free once the cut-off holder's session expired");
    let granted_at = Instant::now();
    assert!(
        granted_at >= lease.deadline,
        "granted {:?} before the cut-off holder's deadline",
        lease.deadline - granted_at
    );
    assert!(next.token > lease.token);
    other.release(&next).await.expect("release");
}

/// One counter of the server's `mntr`.
async fn mntr(hostport: &str, name: &str) -> u64 {
    let mntr = common::four_letter(hostport, "mntr").await;
    mntr.lines()
        .find_map(|l| l.strip_prefix(name))
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or_else(|| panic!("no {name} in {mntr}"))
}

/// The server's open client connections (`mntr`), this probe's included.
async fn connections(hostport: &str) -> u64 {
    mntr(hostport, "zk_num_alive_connections").await
}

/// A private server whose longest session is 4 s.
async fn short_sessions_server() -> PrivateZooKeeper {
    PrivateZooKeeper::start(ZooKeeperOptions {
        max_session_ms: 4_000,
        ..ZooKeeperOptions::default()
    })
    .await
    .expect("a private ZooKeeper starts (binaries from scripts/services.sh)")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ttl_longer_than_the_longest_session_is_granted_shorter_and_says_so() {
    let zk = short_sessions_server().await;
    let store = ZkLock::connect(&zk.url("/granted?session_timeout=2s&connect_timeout=5s"))
        .await
        .expect("connects");
    let k = key("long");
    let lease = store
        .acquire(&k, &opts(Duration::from_secs(20), WAIT))
        .await
        .expect("granted");
    assert_eq!(
        lease.ttl,
        Duration::from_secs(4),
        "the server's longest session"
    );
    let before = Instant::now();
    assert!(lease.deadline <= before + Duration::from_secs(4));

    // An extend asking for more than the node's session also gets the
    // session's length.
    let extended = store
        .extend(&lease, Duration::from_secs(30))
        .await
        .expect("extended");
    assert_eq!(extended.ttl, Duration::from_secs(4));
    assert_eq!(extended.token, lease.token);
    // A lock on the 2 s base session stays on it: extending it past 2 s
    // grants 2 s.
    let short = store
        .acquire(&key("short"), &opts(Duration::from_secs(1), WAIT))
        .await
        .expect("granted");
    let longer = store
        .extend(&short, Duration::from_secs(3))
        .await
        .expect("extended");
    assert_eq!(longer.ttl, Duration::from_secs(2));
    // Another TTL past the server's longest session reuses the capped
    // session rather than opening one more that would be capped alike: the
    // server's connection count (its own `mntr` connection included) does
    // not change.
    let hostport = zk.members()[0].hostport();
    let before = connections(&hostport).await;
    let other = store
        .acquire(&key("longer"), &opts(Duration::from_secs(30), WAIT))
        .await
        .expect("granted");
    assert_eq!(other.ttl, Duration::from_secs(4));
    assert_eq!(connections(&hostport).await, before);
    for lease in [extended, longer, other] {
        store.release(&lease).await.expect("release");
    }
}

/// `LockClient` asks for 12 s, the server grants 4 s: renewed every third
/// of the 4 s granted, the hold outlives several granted TTLs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lock_client_keeps_a_lock_granted_shorter_than_asked() {
    let zk = short_sessions_server().await;
    let store = ZkLock::connect(&zk.url("/client?session_timeout=2s&connect_timeout=5s"))
        .await
        .expect("connects");
    let client = LockClient::builder(Arc::new(store.clone()))
        .ttl(Duration::from_secs(12))
        .build()
        .expect("client");
    let guard = client.acquire("held").await.expect("granted");
    assert_eq!(guard.handle().lease().ttl, Duration::from_secs(4));
    tokio::time::sleep(Duration::from_secs(9)).await;
    assert!(!guard.is_lost(), "lost while renewing");
    let info = store
        .inspect(&key("held"))
        .await
        .expect("inspect")
        .expect("still held");
    assert_eq!(info.token, guard.token());
    guard.release().await.expect("release");
}

/// Requests the server has received so far (`mntr`).
async fn packets(hostport: &str) -> u64 {
    mntr(hostport, "zk_packets_received").await
}

/// `extend_many` of locks held on one session is one `multi` per 256: 300
/// renewals reach the server as a few requests, not 300. A node deleted
/// under its holder fails its chunk's `multi`, which then goes lease by
/// lease: that lease reads as lost, every other one is renewed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn extend_many_renews_a_sessions_locks_in_few_requests() {
    let zk = PrivateZooKeeper::start(ZooKeeperOptions::default())
        .await
        .expect("a private ZooKeeper starts (binaries from scripts/services.sh)");
    let url = zk.url("/batch?session_timeout=10s&connect_timeout=5s");
    let store = ZkLock::connect(&url).await.expect("connects");
    let other = ZkLock::connect(&url).await.expect("connects");
    let ttl = Duration::from_secs(10);
    let mut leases = Vec::new();
    for i in 0..300 {
        let lease = store
            .acquire(&key(&format!("k{i}")), &opts(ttl, WAIT))
            .await
            .expect("granted");
        assert_eq!(lease.ttl, ttl);
        leases.push(lease);
    }

    let before = packets(&zk.hostports()).await;
    let sent = Instant::now();
    let renewed = store.extend_many(&leases, ttl).await;
    let requests = packets(&zk.hostports()).await - before;
    assert!(
        requests <= 10,
        "300 renewals took {requests} requests (one multi per 256 expected)"
    );
    for (lease, r) in leases.iter().zip(&renewed) {
        let r = r.as_ref().expect("renewed");
        assert_eq!(r.token, lease.token);
        assert!(r.deadline >= sent + ttl - Duration::from_millis(1));
    }

    // The node of k5 deleted under its holder: its chunk goes one by one.
    assert!(other
        .force_release(&key("k5"))
        .await
        .expect("force release"));
    let before = packets(&zk.hostports()).await;
    let renewed = store.extend_many(&leases, ttl).await;
    let requests = packets(&zk.hostports()).await - before;
    for (i, r) in renewed.iter().enumerate() {
        match (i, r) {
            (5, Err(fenced_api::Error::LeaseLost { .. })) => {}
            (5, other) => panic!("k5's node is gone, yet: {other:?}"),
            (_, r) => assert!(r.is_ok(), "lease {i}: {r:?}"),
        }
    }
    assert!(
        (256..300).contains(&requests),
        "the failed chunk one by one, the other as one multi: {requests} requests"
    );
}
