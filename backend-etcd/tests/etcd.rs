//! etcd-specific behaviour: FIFO fairness, effective TTLs, exact keys, a
//! 3-member cluster losing its leader, and a restart with a dead holder.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stdout)]

mod common;
mod locks;

use std::{sync::Arc, time::Duration};

use common::{line_of, private::PrivateEtcd, raw, EtcdHarness};
use fenced_api::{DistributedLock, Error, LockClient, LockKey, LockOptions, ReleaseOutcome};
use fenced_etcd::{etcd_client, EtcdLock};
use locks::{hold, key, opts};
use tokio::time::Instant;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiters_are_served_in_arrival_order() {
    let h = EtcdHarness::new().await;
    let holder = h.lock().await;
    let k = key("fifo");
    let held = hold(&holder, &k, Duration::from_secs(10)).await;
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let wait = LockOptions::builder()
        .ttl(Duration::from_secs(10))
        .wait_timeout(Duration::from_secs(60))
        .build()
        .unwrap();
    let mut watcher = raw().await;
    let mut tasks = Vec::new();
    for i in 0..6 {
        let lock = h.lock().await;
        let (key, wait, tx) = (k.clone(), wait.clone(), tx.clone());
        tasks.push(tokio::spawn(async move {
            let lease = lock.acquire(&key, &wait).await.unwrap();
            tx.send(i).unwrap();
            tokio::time::sleep(Duration::from_millis(20)).await;
            assert_eq!(
                lock.release(&lease).await.unwrap(),
                ReleaseOutcome::Released
            );
        }));
        // Each waiter takes its place in line (the holder's entry and i + 1
        // waiters') before the next arrives: arrival order is then certain,
        // however slow a new client's session grant is.
        line_of(&mut watcher, &k, i + 2).await;
    }
    holder.release(&held).await.unwrap();
    let mut order = Vec::new();
    for _ in 0..6 {
        order.push(
            tokio::time::timeout(Duration::from_secs(30), rx.recv())
                .await
                .unwrap()
                .unwrap(),
        );
    }
    for t in tasks {
        t.await.unwrap();
    }
    assert_eq!(order, vec![0, 1, 2, 3, 4, 5]);
}

#[tokio::test]
async fn effective_ttl_is_whole_seconds_and_reported() {
    let h = EtcdHarness::new().await;
    let lock = h.lock().await;
    let k = key("ttl");
    let lease = hold(&lock, &k, Duration::from_millis(1500)).await;
    assert!(
        lease.ttl >= Duration::from_secs(2),
        "1.5 s must round up, got {:?}",
        lease.ttl
    );
    assert_eq!(lease.ttl.subsec_nanos(), 0);
    let info = lock.inspect(&k).await.unwrap().unwrap();
    assert!(info.remaining_ttl <= lease.ttl);
    lock.release(&lease).await.unwrap();
}

/// etcd raises a lease TTL below its minimum (3/2 of the election timeout,
/// rounded up to whole seconds: 2 s with etcd's default timing, measured on
/// etcd 3.4.23 here) without an error. The lease must report what etcd
/// granted, not what was asked for.
#[tokio::test]
async fn a_one_second_ttl_reports_the_ttl_etcd_granted() {
    let h = EtcdHarness::new().await;
    let lock = h.lock().await;
    let k = key("ttl1");
    let lease = hold(&lock, &k, Duration::from_secs(1)).await;
    // The session lease the entry is on, as etcd itself reports it.
    let hostport = common::server_hostport().await;
    let mut c = etcd_client::Client::connect([format!("http://{hostport}")], None)
        .await
        .unwrap();
    let mut line = common::run_prefix().as_bytes().to_vec();
    line.extend_from_slice(b"\0lock\0");
    line.extend_from_slice(k.as_bytes());
    line.push(0);
    let entry = c
        .get(line, Some(etcd_client::GetOptions::new().with_prefix()))
        .await
        .unwrap();
    let lease_id = entry.kvs().first().expect("the lock's entry").lease();
    let granted = c
        .lease_time_to_live(lease_id, None)
        .await
        .unwrap()
        .granted_ttl();
    println!("asked for a 1 s TTL; etcd granted {granted} s");
    assert!(granted >= 1, "etcd granted {granted} s");
    assert_eq!(
        lease.ttl,
        Duration::from_secs(granted as u64),
        "the lease reports the TTL etcd granted"
    );
    assert!(lease.ttl >= lock.capabilities().get_min_ttl());
    let info = lock.inspect(&k).await.unwrap().unwrap();
    assert!(info.remaining_ttl <= lease.ttl);
    lock.release(&lease).await.unwrap();
}

#[tokio::test]
async fn exact_keys_and_prefixes_never_interfere() {
    let h = EtcdHarness::new().await;
    let lock = h.lock().await;
    let base = key("exact");
    let o = opts(Duration::from_secs(10));
    let a = lock.try_acquire(&base, &o).await.unwrap().unwrap();
    for other in [
        format!("{base}/b"),
        format!("{base}b"),
        format!("{base}\u{e9}"),
    ] {
        let k = LockKey::new(other).unwrap();
        let l = lock
            .try_acquire(&k, &o)
            .await
            .unwrap()
            .expect("independent key");
        lock.release(&l).await.unwrap();
    }
    lock.release(&a).await.unwrap();
}

#[tokio::test]
async fn same_owner_reacquire_is_already_held_and_reentrancy_is_refused_clearly() {
    let h = EtcdHarness::new().await;
    let lock = h.lock().await;
    let k = key("owner");
    let mine = LockOptions::builder()
        .ttl(Duration::from_secs(10))
        .owner("job-7")
        .build()
        .unwrap();
    let l = lock.try_acquire(&k, &mine).await.unwrap().unwrap();
    assert!(matches!(
        lock.try_acquire(&k, &mine).await,
        Err(Error::AlreadyHeld { .. })
    ));
    let reentrant = mine.to_builder().reentrant(true).build().unwrap();
    assert!(matches!(
        lock.try_acquire(&k, &reentrant).await,
        Err(Error::Unsupported { .. })
    ));
    lock.release(&l).await.unwrap();
}

/// A URL listing a member that is down (here: nothing listens on port 1)
/// still connects through the others, whichever endpoint the channel tries
/// first: a request refused by the dead member is sent again, so `connect`
/// must succeed every time, not only when the channel picks the live one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_succeeds_with_one_endpoint_down() {
    let live = fenced_conformance::services::etcd_url();
    let live = live
        .split("://")
        .nth(1)
        .unwrap_or(&live)
        .trim_end_matches('/')
        .to_owned();
    for i in 0..8 {
        let url = format!("etcd://127.0.0.1:1,{live}/down-member?connect_timeout=3s&timeout=3s");
        let lock = EtcdLock::connect(&url).await.unwrap_or_else(|e| {
            panic!("connect {i} with one member down failed: {e} (is etcd up? run scripts/services.sh)")
        });
        let lease = lock
            .try_acquire(&key("down-member"), &opts(Duration::from_secs(5)))
            .await
            .unwrap()
            .expect("a fresh key is free");
        assert_eq!(
            lock.release(&lease).await.unwrap(),
            ReleaseOutcome::Released
        );
    }
}

/// A 3-member cluster loses its leader while a lock is held: no second
/// holder appears, the holder keeps (or cleanly loses) its lease, and a new
/// acquire works after the election.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leader_kill_in_a_three_member_cluster() {
    let cluster = PrivateEtcd::start_cluster(3).await.unwrap();
    let url = format!(
        "etcd://{}/cluster?connect_timeout=3s&timeout=3s",
        cluster.hostport()
    );
    let holder = LockClient::builder(Arc::new(EtcdLock::connect(&url).await.unwrap()))
        .ttl(Duration::from_secs(5))
        .build()
        .unwrap();
    let contender = EtcdLock::connect(&url).await.unwrap();
    let k = key("leader");
    let guard = holder.acquire(&k).await.unwrap();

    // Find the leader through the maintenance API and kill it.
    let mut leader = None;
    for (i, m) in cluster.members.iter().enumerate() {
        let mut c = etcd_client::Client::connect([format!("http://{}", m.hostport())], None)
            .await
            .unwrap();
        let s = c.status().await.unwrap();
        if s.header().map(|h| h.member_id()) == Some(s.leader()) {
            leader = Some(i);
        }
    }
    let leader = leader.expect("a leader");
    cluster.kill(leader).await;
    let killed_at = Instant::now();

    // For the next 8 s (more than a TTL), nobody else may get the key.
    let o = opts(Duration::from_secs(5));
    while killed_at.elapsed() < Duration::from_secs(8) {
        match contender.try_acquire(&k, &o).await {
            Ok(None) | Err(Error::Backend { .. }) => {}
            Ok(Some(l)) => {
                assert!(
                    guard.is_lost(),
                    "two holders: the contender got token {} while the guard still held",
                    l.token
                );
                contender.release(&l).await.unwrap();
                break;
            }
            Err(e) => panic!("unexpected error: {e}"),
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let kept = !guard.is_lost();
    println!("leader {leader} killed; holder kept its lease: {kept}");
    let token = guard.token();
    let released = guard.release().await;
    assert!(
        released.is_ok() || !kept,
        "a kept lease must release cleanly: {released:?}"
    );
    let wait = o
        .to_builder()
        .wait_timeout(Duration::from_secs(15))
        .build()
        .unwrap();
    // Right after a failover a request can still land on the killed member
    // and go unanswered: a retryable error, which the caller retries.
    let retry_until = Instant::now() + Duration::from_secs(30);
    let after = loop {
        match contender.acquire(&k, &wait).await {
            Ok(l) => break l,
            Err(e) if e.is_retryable() && Instant::now() < retry_until => {
                println!("acquire after the failover: {e}; retrying");
            }
            Err(e) => panic!("no acquire after the failover: {e}"),
        }
    };
    assert!(after.token > token);
    contender.release(&after).await.unwrap();
}

/// A holder dies (never releases), then the single-node etcd restarts: the
/// lock survives the restart with its TTL reset, and goes away after about
/// one TTL. Prints how long the dead holder's lock lived after the restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_holder_lock_after_restart_lives_about_one_ttl() {
    let etcd = PrivateEtcd::start().await.unwrap();
    let url = format!(
        "etcd://{}/restart?connect_timeout=3s&timeout=3s",
        etcd.hostport()
    );
    let ttl = Duration::from_secs(4);
    let k = key("dead");
    let dead = {
        let lock = EtcdLock::connect(&url).await.unwrap();
        hold(&lock, &k, ttl).await
    };
    tokio::time::sleep(Duration::from_secs(2)).await;
    etcd.restart().await.unwrap();
    let back = Instant::now();
    let lock = EtcdLock::connect(&url).await.unwrap();
    assert_eq!(
        lock.inspect(&k).await.unwrap().unwrap().token,
        dead.token,
        "the lock survived the restart"
    );
    let wait = opts(ttl)
        .to_builder()
        .wait_timeout(ttl * 4)
        .build()
        .unwrap();
    let next = lock.acquire(&k, &wait).await.unwrap();
    let lived = back.elapsed();
    println!("dead holder's lock lived {lived:?} after the restart (ttl {ttl:?}, 2 s had passed before it)");
    assert!(next.token > dead.token);
    // The TTL restarts from full on recovery: never much less than one TTL.
    assert!(
        lived + Duration::from_millis(1500) >= ttl,
        "expired early: {lived:?}"
    );
    assert!(lived <= ttl * 3, "lived far too long: {lived:?}");
    lock.release(&next).await.unwrap();
}

/// The label is the part of the entry's value after the owner: kept when an
/// extend moves the lock to another session lease (a new TTL), when a
/// waiter becomes the holder (and announces it), and read as none from an
/// entry whose value is the owner alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn labels_survive_moves_and_hand_over_and_plain_entries_read_unlabelled() {
    let h = EtcdHarness::new().await;
    let (a, b) = (h.lock().await, h.lock().await);
    let k = key("label");
    let labelled = LockOptions::builder()
        .ttl(Duration::from_secs(10))
        .label("holder 1 ü")
        .build()
        .unwrap();
    let held = a.try_acquire(&k, &labelled).await.unwrap().unwrap();
    // Another TTL class: the entry is put on another session lease.
    let moved = a.extend(&held, Duration::from_secs(20)).await.unwrap();
    let info = b.inspect(&k).await.unwrap().unwrap();
    assert_eq!(
        (info.owner.clone(), info.token),
        (held.owner.clone(), held.token)
    );
    assert_eq!(info.label.unwrap().as_str(), "holder 1 ü");

    let waiting = LockOptions::builder()
        .ttl(Duration::from_secs(10))
        .wait_timeout(Duration::from_secs(30))
        .label("waiter 2")
        .build()
        .unwrap();
    let task = {
        let k = k.clone();
        tokio::spawn(async move { (b.acquire(&k, &waiting).await.unwrap(), b) })
    };
    let mut c = raw().await;
    line_of(&mut c, &k, 2).await;
    a.release(&moved).await.unwrap();
    let (next, b) = task.await.unwrap();
    // The announcement rewrites the entry in the background, keeping its value.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let info = a.inspect(&k).await.unwrap().unwrap();
    assert_eq!(info.owner, next.owner);
    assert_eq!(info.label.unwrap().as_str(), "waiter 2");
    let listed = a.list(1000).await.unwrap();
    let listed = listed.iter().find(|i| i.key == k).unwrap();
    assert_eq!(listed.label.as_ref().unwrap().as_str(), "waiter 2");
    b.release(&next).await.unwrap();

    // An entry whose value is the owner alone (no newline, no label).
    let old = key("label-old");
    let mut entry = common::line_prefix(&old);
    entry.extend_from_slice(b"old-owner");
    let lease = c.lease_grant(30, None).await.unwrap().id();
    c.put(
        entry,
        "old-owner",
        Some(etcd_client::PutOptions::new().with_lease(lease)),
    )
    .await
    .unwrap();
    let info = a.inspect(&old).await.unwrap().unwrap();
    assert_eq!((info.owner.as_str(), info.label), ("old-owner", None));
    assert!(a.force_release(&old).await.unwrap());
    c.lease_revoke(lease).await.unwrap();
}
