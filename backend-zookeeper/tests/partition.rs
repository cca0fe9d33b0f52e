//! Clients cut off from ZooKeeper by a proxy: a holder whose session
//! expires knows it before anyone else is granted its lock, and an
//! acquirer whose replies were lost leaves nothing behind in the queue.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::{sync::Arc, time::Duration};

use common::{entries, opts, queue_path, raw_client, wait_for_entries, Blackhole, ZkHarness};
use fenced_api::{DistributedLock, LockClient, LockKey};
use fenced_testkit::private::{PrivateZooKeeper, ZooKeeperOptions};
use fenced_zookeeper::ZkLock;
use tokio::time::{timeout, Instant};

/// Hang catcher for every wait.
const WAIT: Duration = Duration::from_secs(60);

/// The holder reaches the server through a proxy that is then blackholed
/// (nothing passes, nothing is closed): the server hears nothing more on
/// its session and expires it, deleting its node, which grants the lock to
/// the waiting client. The holder's lease (TTL = the negotiated session
/// timeout, renewed by a `LockClient`) must be reported lost first.
#[tokio::test]
async fn the_holder_of_an_expired_session_knows_before_anyone_else_is_granted() {
    let zk = PrivateZooKeeper::start(ZooKeeperOptions::default())
        .await
        .unwrap();
    let server = zk.members()[0].hostport();
    let proxy = Blackhole::start(&server).await;
    let key = LockKey::new("expiry").unwrap();

    let holder = Arc::new(
        ZkLock::connect(&format!(
            "zk://{}/expiry?session_timeout=4s&connect_timeout=5s&timeout=2s",
            proxy.hostport()
        ))
        .await
        .unwrap(),
    );
    let session = holder
        .negotiated_session_timeout()
        .expect("a negotiated session timeout");
    assert_eq!(session, Duration::from_secs(4));
    let client = LockClient::builder(holder.clone())
        .ttl(session)
        .build()
        .unwrap();
    let guard = client.acquire(key.clone()).await.unwrap();
    let held = guard.handle().clone();
    let lost = tokio::spawn(async move {
        let reason = held.lost().await;
        (Instant::now(), reason)
    });

    let other = ZkLock::connect(&format!(
        "zk://{server}/expiry?session_timeout=20s&connect_timeout=5s&timeout=5s"
    ))
    .await
    .unwrap();
    let waiting = tokio::spawn({
        let key = key.clone();
        async move {
            let lease = other
                .acquire(&key, &opts(Duration::from_secs(10), WAIT))
                .await
                .unwrap();
            (Instant::now(), lease)
        }
    });
    let raw = raw_client(&server).await;
    let queue = queue_path("/expiry", "expiry");
    wait_for_entries(&raw, &queue, 2).await;

    // Renewals pass for a while (so the loss is not simply the first TTL
    // running out), then the holder is cut off.
    tokio::time::sleep(session).await;
    assert!(!guard.handle().is_lost());
    proxy.blackhole();
    let cut_at = Instant::now();

    let (granted_at, lease) = timeout(WAIT, waiting)
        .await
        .expect("the waiter is granted once the holder's session expires")
        .unwrap();
    let (lost_at, reason) = timeout(WAIT, lost)
        .await
        .expect("the holder's lost() fires")
        .unwrap();
    assert!(
        lost_at < granted_at,
        "the other client was granted {:?} before the holder's lost() fired",
        lost_at - granted_at
    );
    assert!(lost_at > cut_at);
    assert!(lease.token > guard.token());
    eprintln!(
        "cut off; lost() after {:?} ({reason}); the other client granted after {:?}",
        lost_at - cut_at,
        granted_at - cut_at
    );
}

/// A `try_acquire` on a connection whose replies are lost (the server
/// creates its queue entry, the client never hears) fails, and the client
/// then reconnects on the same session. Its entry must not outlive the
/// failed call: once the holder releases, the key is free for others —
/// not held by a node nobody owns while its session lives on.
#[tokio::test]

async fn an_entry_whose_create_reply_was_lost_leaves_the_queue() {
    let h = ZkHarness::new().await;
    let first_host = h.hosts().split(',').next().unwrap().to_owned();
    let proxy = Blackhole::start(&first_host).await;
    let key = LockKey::new("lost-reply").unwrap();
    let raw = raw_client(h.hosts()).await;
    let queue = queue_path(h.namespace(), "lost-reply");

    let holder = h.lock().await;
    let held = holder
        .acquire(&key, &opts(Duration::from_secs(15), WAIT))
        .await
        .unwrap();
    let cut_off = ZkLock::connect(&format!(
        "zk://{}{}?session_timeout=6s&connect_timeout=5s&timeout=2s",
        proxy.hostport(),
        h.namespace()
    ))
    .await
    .unwrap();

    proxy.mute_replies();
    let tried = cut_off
        .try_acquire(&key, &opts(Duration::from_secs(5), WAIT))
        .await;
    assert!(
        tried.as_ref().is_err_and(|e| e.is_retryable()),
        "no reply can be heard: {tried:?}"
    );
    // The client gives up on the silent connection and resumes its
    // session on a new one, which the proxy passes.
    let started = Instant::now();
    while cut_off.inspect(&key).await.is_err() {
        assert!(
            started.elapsed() < WAIT,
            "the cut-off client never reconnected"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    holder.release(&held).await.unwrap();
    let other = h.lock().await;
    let taken = other
        .acquire(&key, &opts(Duration::from_secs(5), Duration::from_secs(30)))
        .await;
    assert!(
        taken.is_ok(),
        "the key stays taken after its holder released it: {taken:?}; queue: {:?}",
        entries(&raw, &queue).await
    );
    drop(cut_off);
}
