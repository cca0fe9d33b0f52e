//! A three-member ensemble loses its leader while a lock is held and
//! renewed: never two holders; the holder either keeps the lock (renewals
//! succeed after the election) or loses it cleanly (`lost()` fires before
//! anyone else is granted, with a larger token); locks are granted after
//! the election.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::{sync::Arc, time::Duration};

use common::{entries, opts, queue_path, raw_client};
use fenced_api::{DistributedLock, Error, LockClient, LockKey};
use fenced_testkit::private::{PrivateZooKeeper, ZooKeeperOptions};
use fenced_zookeeper::ZkLock;
use tokio::time::{sleep, timeout, Instant};

/// The guarded lock's TTL, renewed every third of it; within the session.
const TTL: Duration = Duration::from_secs(6);
/// The raw lease's TTL: the whole session.
const RAW_TTL: Duration = Duration::from_secs(12);
/// Hang catcher for every wait.
const WAIT: Duration = Duration::from_secs(60);

/// The contender's `try_acquire` in flight when the leader dies may lose
/// its reply; its queue entry must then still leave the queue (see
/// `partition.rs`'s `an_entry_whose_create_reply_was_lost_leaves_the_queue`),
/// or the contender is never granted and this test names what is left.
#[tokio::test]
async fn a_leader_kill_never_makes_two_holders() {
    let zk = PrivateZooKeeper::start(ZooKeeperOptions {
        members: 3,
        ..ZooKeeperOptions::default()
    })
    .await
    .expect("a three-member ensemble");
    let url = zk.url("/ensemble") + "?session_timeout=12s&connect_timeout=5s&timeout=3s";
    let key = LockKey::new("leader-kill").unwrap();

    let holder = Arc::new(ZkLock::connect(&url).await.unwrap());
    let client = LockClient::builder(holder.clone())
        .ttl(TTL)
        .build()
        .unwrap();
    let guard = client.acquire(key.clone()).await.unwrap();
    let held = guard.handle().clone();
    let lost = tokio::spawn({
        let held = held.clone();
        async move {
            let reason = held.lost().await;
            (Instant::now(), reason)
        }
    });
    let raw_key = LockKey::new("leader-kill-raw").unwrap();
    let raw = holder
        .acquire(&raw_key, &opts(RAW_TTL, WAIT))
        .await
        .unwrap();

    // A second client asks for the key all along (errors while the
    // ensemble has no leader are expected).
    let contender = ZkLock::connect(&url).await.unwrap();
    let trying = tokio::spawn({
        let key = key.clone();
        async move {
            let (mut busy, mut errors) = (0u32, 0u32);
            loop {
                match contender.try_acquire(&key, &opts(TTL, WAIT)).await {
                    Ok(Some(lease)) => return (Instant::now(), lease, busy, errors),
                    Ok(None) => busy += 1,
                    Err(_) => errors += 1,
                }
                sleep(Duration::from_millis(100)).await;
            }
        }
    });

    let leader = zk.leader().await.expect("a leader");
    zk.kill(leader);
    let killed_at = Instant::now();
    let elected_at = loop {
        match zk.leader().await {
            Some(l) if l != leader => break Instant::now(),
            _ => {}
        }
        assert!(killed_at.elapsed() < WAIT, "no new leader");
        sleep(Duration::from_millis(100)).await;
    };

    // Kept: a renewal sent after the election succeeded (the safe deadline
    // then lies beyond elected_at + TTL − margin). Lost: lost() fired.
    let kept = loop {
        if held.is_lost() {
            break false;
        }
        if held
            .deadline()
            .is_some_and(|d| d > elected_at + TTL - client.margin())
        {
            break true;
        }
        assert!(elected_at.elapsed() < WAIT, "neither renewed nor lost");
        sleep(Duration::from_millis(50)).await;
    };
    let holder_done = if kept {
        assert!(
            !trying.is_finished(),
            "the contender was granted while the holder renews"
        );
        let info = holder.inspect(&key).await.unwrap().expect("still held");
        assert_eq!(info.token, guard.token());
        // The holder is done when it asks for the release: the server
        // deletes its entry before replying, so the contender's grant may
        // reach the contender before the release's reply reaches the
        // holder (CI once saw it 0.2 ms earlier).
        let asked = Instant::now();
        guard
            .release()
            .await
            .expect("released: the lock was still held");
        asked
    } else {
        timeout(WAIT, lost).await.expect("lost() fired").unwrap().0
    };
    let (granted_at, lease, busy, errors) = match timeout(WAIT, trying).await {
        Ok(t) => t.unwrap(),
        Err(_) => {
            let raw = raw_client(&zk.hostports()).await;
            let queue = queue_path("/ensemble", "leader-kill");
            let mut left = Vec::new();
            for entry in entries(&raw, &queue).await {
                let stat = raw.check_stat(&format!("{queue}/{entry}")).await;
                left.push(format!("{entry} {stat:?}"));
            }
            panic!(
                "the contender was not granted within {WAIT:?} after the holder {}; \
                 the queue holds {left:#?}",
                if kept { "released" } else { "lost the lock" }
            );
        }
    };
    assert!(
        granted_at > holder_done,
        "the contender was granted {:?} before the holder was done",
        holder_done - granted_at
    );
    assert!(lease.token > held.token());

    // The raw lease: extended after the election, or cleanly lost.
    let extended = loop {
        match holder.extend(&raw, RAW_TTL).await {
            Ok(renewed) => {
                assert_eq!(renewed.token, raw.token);
                break true;
            }
            Err(Error::LeaseLost { .. }) => break false,
            Err(e) if e.is_retryable() && elected_at.elapsed() < WAIT => {
                sleep(Duration::from_millis(200)).await
            }
            Err(e) => panic!("extending the raw lease: {e}"),
        }
    };
    if extended {
        let info = holder.inspect(&raw_key).await.unwrap().expect("held");
        assert_eq!(info.token, raw.token);
    }

    // A new client takes a new lock after the election, with a larger token.
    let fresh = ZkLock::connect(&url).await.unwrap();
    let after = fresh
        .acquire(&LockKey::new("after-election").unwrap(), &opts(TTL, WAIT))
        .await
        .unwrap();
    assert!(after.token > lease.token && after.token > raw.token);
    eprintln!(
        "leader {leader} killed; new leader after {:?}; the holder {} the lock; \
         contender granted {:?} after the kill ({busy} busy answers, {errors} errors); \
         raw lease {}",
        elected_at - killed_at,
        if kept { "kept" } else { "lost" },
        granted_at - killed_at,
        if extended { "extended" } else { "lost" },
    );
}
