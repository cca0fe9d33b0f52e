//! Session leases: locks of one client share a lease per TTL, yet each lock
//! still expires at its own TTL; a lost session lease is every guard's loss;
//! one watch stream serves all waits of a client; renewals of many locks.
//! Only generous upper bounds on time (they catch hangs, not slowness).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stdout)]

mod common;
mod locks;

use std::{sync::Arc, time::Duration};

use common::{line_of, line_prefix, raw, EtcdHarness};
use fenced_api::{DistributedLock, LockClient, LockKey, LockOptions, ReleaseOutcome};
use fenced_etcd::{etcd_client, EtcdLock};
use locks::{hold, key, opts};
use tokio::time::Instant;

/// The session lease of the holder of `k` (the oldest entry of its line).
async fn lease_of(c: &mut etcd_client::Client, k: &LockKey) -> Option<i64> {
    let oldest = etcd_client::GetOptions::new()
        .with_prefix()
        .with_sort(
            etcd_client::SortTarget::Create,
            etcd_client::SortOrder::Ascend,
        )
        .with_limit(1);
    let r = c.get(line_prefix(k), Some(oldest)).await.unwrap();
    r.kvs().first().map(|kv| kv.lease())
}

/// Two locks of one client share one session lease; the one its holder
/// renews stays held, the other is freed at its own deadline — never before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unextended_lock_expires_at_its_ttl_while_a_sibling_is_renewed() {
    let h = EtcdHarness::new().await;
    let (holder, other) = (h.lock().await, h.lock().await);
    let ttl = Duration::from_secs(2);
    let (idle, busy) = (key("idle"), key("busy"));
    let idle_lease = hold(&holder, &idle, ttl).await;
    let mut busy_lease = hold(&holder, &busy, ttl).await;

    let mut c = raw().await;
    let shared = lease_of(&mut c, &idle).await.unwrap();
    assert_ne!(shared, 0);
    assert_eq!(
        lease_of(&mut c, &busy).await,
        Some(shared),
        "one session lease per TTL"
    );

    // Renew `busy` every ttl/4; poll `idle` from another client.
    let start = Instant::now();
    let mut next_renew = start;
    let taken = loop {
        assert!(
            start.elapsed() < ttl * 3 + Duration::from_secs(5),
            "the unextended lock was never freed"
        );
        if Instant::now() >= next_renew {
            busy_lease = holder.extend(&busy_lease, ttl).await.unwrap();
            next_renew = Instant::now() + ttl / 4;
        }
        if let Some(l) = other.try_acquire(&idle, &opts(ttl)).await.unwrap() {
            break (l, Instant::now());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let (next, at) = taken;
    assert!(
        at >= idle_lease.deadline,
        "freed {:?} before its holder's deadline",
        idle_lease.deadline - at
    );
    assert!(next.token > idle_lease.token);
    // The renewed sibling is untouched, on the same (still live) lease.
    assert!(other
        .try_acquire(&busy, &opts(ttl))
        .await
        .unwrap()
        .is_none());
    assert_eq!(lease_of(&mut c, &busy).await, Some(shared));
    assert!(matches!(
        holder.extend(&idle_lease, ttl).await,
        Err(fenced_api::Error::LeaseLost { .. })
    ));
    assert_eq!(
        holder.release(&busy_lease).await.unwrap(),
        ReleaseOutcome::Released
    );
    other.release(&next).await.unwrap();
}

/// When the session lease dies (here: revoked behind the client's back),
/// every guard on it reports the loss, and the client recovers with a new
/// lease for its next acquisition.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn session_lease_loss_resolves_every_guard() {
    let h = EtcdHarness::new().await;
    let client = LockClient::builder(Arc::new(h.lock().await))
        .ttl(Duration::from_secs(3))
        .build()
        .unwrap();
    let keys = [key("loss-a"), key("loss-b"), key("loss-c")];
    let mut guards = Vec::new();
    for k in &keys {
        guards.push(client.acquire(k).await.unwrap());
    }
    let mut c = raw().await;
    let lease = lease_of(&mut c, &keys[0]).await.unwrap();
    for k in &keys {
        assert_eq!(lease_of(&mut c, k).await, Some(lease));
    }
    c.lease_revoke(lease).await.unwrap();

    let all_lost = async {
        for g in &guards {
            g.lost().await;
        }
    };
    tokio::time::timeout(Duration::from_secs(15), all_lost)
        .await
        .expect("every guard on the revoked session lease reports the loss");

    // The keys are free for others, and this client works again.
    let other = h.lock().await;
    for k in &keys {
        let l = other
            .try_acquire(k, &opts(Duration::from_secs(3)))
            .await
            .unwrap()
            .expect("free after the lease died");
        other.release(&l).await.unwrap();
    }
    drop(guards);
    let again = client.acquire(&keys[0]).await.unwrap();
    assert_ne!(lease_of(&mut c, &keys[0]).await, Some(lease), "a new lease");
    again.release().await.unwrap();
}

/// One client waits for several keys at once: its single watch stream
/// routes each deletion to the right waiter.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_client_waits_for_many_keys_on_one_stream() {
    let h = EtcdHarness::new().await;
    let (holder, waiter) = (h.lock().await, h.lock().await);
    let long = Duration::from_secs(20);
    let keys: Vec<LockKey> = (0..5).map(|i| key(&format!("multi{i}"))).collect();
    let mut held = Vec::new();
    for k in &keys {
        held.push(hold(&holder, k, long).await);
    }
    let wait = waiting(long, Duration::from_secs(30));
    let waits: Vec<_> = keys
        .iter()
        .map(|k| spawn_acquire(&waiter, k, &wait))
        .collect();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !waits.iter().any(|w| w.is_finished()),
        "a waiter finished while its key was held"
    );
    // Release in reverse order; each waiter must be woken by its own
    // key's release (a misrouted event would leave it waiting).
    let items: Vec<_> = keys.iter().zip(&held).zip(waits).collect();
    for ((k, l), w) in items.into_iter().rev() {
        holder.release(l).await.unwrap();
        let got = tokio::time::timeout(Duration::from_secs(10), w)
            .await
            .expect("the waiter was woken by its key's release")
            .unwrap()
            .unwrap();
        assert_eq!(&got.key, k);
        assert!(got.token > l.token);
        waiter.release(&got).await.unwrap();
    }
}

/// A cancelled waiter leaves no queue entry behind: the next client to
/// come gets the key as soon as the holder releases.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelled_waiter_leaves_the_queue() {
    let h = EtcdHarness::new().await;
    let holder = h.lock().await;
    let k = key("cancel");
    let long = Duration::from_secs(30);
    let held = hold(&holder, &k, long).await;
    let waiter = h.lock().await;
    let wait = LockOptions::builder()
        .ttl(long)
        .wait_timeout(Duration::from_secs(60))
        .build()
        .unwrap();
    let cancelled =
        tokio::time::timeout(Duration::from_millis(400), waiter.acquire(&k, &wait)).await;
    assert!(cancelled.is_err(), "the key was held");
    // Only the holder's entry is left in the line.
    let mut c = raw().await;
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let q = c
            .get(
                line_prefix(&k),
                Some(etcd_client::GetOptions::new().with_prefix()),
            )
            .await
            .unwrap();
        if q.kvs().len() == 1 {
            assert_eq!(q.kvs()[0].value(), held.owner.as_str().as_bytes());
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the cancelled waiter's entry stayed"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    holder.release(&held).await.unwrap();
    let q = c
        .get(
            line_prefix(&k),
            Some(
                etcd_client::GetOptions::new()
                    .with_prefix()
                    .with_count_only(),
            ),
        )
        .await
        .unwrap();
    assert_eq!(q.count(), 0, "release removes the holder's entry");
    let next = waiter.try_acquire(&k, &opts(long)).await.unwrap();
    waiter.release(&next.expect("free")).await.unwrap();
}

/// Extending with another TTL moves the lock to that TTL's session lease
/// and reports the new TTL.
#[tokio::test]
async fn extend_with_a_new_ttl_changes_the_ttl() {
    let h = EtcdHarness::new().await;
    let lock = h.lock().await;
    let k = key("newttl");
    let l = hold(&lock, &k, Duration::from_secs(3)).await;
    let mut c = raw().await;
    let before = lease_of(&mut c, &k).await.unwrap();
    let longer = lock.extend(&l, Duration::from_secs(9)).await.unwrap();
    assert!(longer.ttl >= Duration::from_secs(9), "{:?}", longer.ttl);
    assert_eq!(longer.token, l.token);
    assert_ne!(lease_of(&mut c, &k).await, Some(before));
    let again = lock.extend(&longer, Duration::from_secs(9)).await.unwrap();
    assert_eq!(again.token, l.token);
    assert_eq!(
        lock.release(&again).await.unwrap(),
        ReleaseOutcome::Released
    );
}

/// Many locks of one client, renewed by the watchdog (batched ownership
/// checks): none is lost while held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_locks_of_one_client_keep_renewing() {
    let h = EtcdHarness::new().await;
    let store: Arc<EtcdLock> = Arc::new(h.lock().await);
    let client = LockClient::builder(store)
        .ttl(Duration::from_secs(2))
        .build()
        .unwrap();
    let mut guards = Vec::new();
    for i in 0..400 {
        guards.push(client.acquire(key(&format!("many{i}"))).await.unwrap());
    }
    // Several TTLs: every lock needs several renewals.
    tokio::time::sleep(Duration::from_secs(5)).await;
    let lost = guards.iter().filter(|g| g.is_lost()).count();
    assert_eq!(
        lost,
        0,
        "{lost} of {} locks lost while renewed",
        guards.len()
    );
    for g in guards {
        g.release().await.unwrap();
    }
}

/// Hundreds of releases at once (batched into few requests), each also
/// released a second time concurrently: every first release frees its key,
/// every repeat is `NotHeld` — never an error (one key per batch).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_and_repeated_releases() {
    let ttl = Duration::from_secs(30);
    let (h, lock, leases) = take_many("rel", 300, ttl).await;
    let mut tasks = Vec::new();
    for l in &leases {
        for _ in 0..2 {
            let (lock, l) = (lock.clone(), l.clone());
            tasks.push(tokio::spawn(async move { lock.release(&l).await }));
        }
    }
    let (mut released, mut not_held) = (0, 0);
    for t in tasks {
        match tokio::time::timeout(Duration::from_secs(30), t)
            .await
            .expect("releases finish")
            .unwrap()
            .unwrap()
        {
            ReleaseOutcome::Released => released += 1,
            ReleaseOutcome::NotHeld => not_held += 1,
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!((released, not_held), (leases.len(), leases.len()));
    let other = h.lock().await;
    for l in &leases {
        let again = other.try_acquire(&l.key, &opts(ttl)).await.unwrap();
        other.release(&again.expect("released")).await.unwrap();
    }
}

/// Many unextended locks of one client expire together: the reaper frees
/// every one of them, none before its deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_unextended_locks_all_expire() {
    let ttl = Duration::from_secs(2);
    let (h, _lock, leases) = take_many("exp", 200, ttl).await;
    let last = leases.iter().map(|l| l.deadline).max().unwrap();
    let other = h.lock().await;
    let mut free = vec![false; leases.len()];
    let bound = last + Duration::from_secs(15);
    while free.iter().any(|f| !f) {
        assert!(Instant::now() < bound, "locks were never reaped");
        for (i, l) in leases.iter().enumerate() {
            if free[i] {
                continue;
            }
            let checked = Instant::now();
            if let Some(next) = other.try_acquire(&l.key, &opts(ttl)).await.unwrap() {
                assert!(checked >= l.deadline, "freed before its deadline");
                assert!(next.token > l.token);
                other.release(&next).await.unwrap();
                free[i] = true;
            }
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// A waiter whose predecessor gives up (its entry is deleted, but it never
/// held) stays waiting while the holder holds, and gets the lock when the
/// holder releases.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiter_behind_a_quitter_keeps_waiting() {
    let h = EtcdHarness::new().await;
    let (holder, quitter, waiter) = (h.lock().await, h.lock().await, h.lock().await);
    let k = key("quit");
    let long = Duration::from_secs(30);
    let held = hold(&holder, &k, long).await;
    let wait = waiting(long, Duration::from_secs(60));
    // The task owns the quitter's only handle: aborting it drops the store.
    let quitting = {
        let (k, wait) = (k.clone(), wait.clone());
        tokio::spawn(async move { quitter.acquire(&k, &wait).await })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    let patient = {
        let (k, wait) = (k.clone(), wait.clone());
        tokio::spawn(async move {
            let l = waiter.acquire(&k, &wait).await;
            (l, waiter)
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    quitting.abort(); // its entry goes: the patient waiter wakes up
    tokio::time::sleep(Duration::from_millis(700)).await;
    assert!(
        !patient.is_finished(),
        "the waiter took the lock while the holder still held it"
    );
    holder.release(&held).await.unwrap();
    let (got, waiter) = tokio::time::timeout(Duration::from_secs(10), patient)
        .await
        .expect("the waiter gets the lock after the release")
        .unwrap();
    let got = got.unwrap();
    assert!(got.token > held.token);
    waiter.release(&got).await.unwrap();
}

/// A store on the shared server (and its harness) that took `n` fresh
/// keys `<prefix><i>…` for `ttl`.
async fn take_many(
    prefix: &str,
    n: usize,
    ttl: Duration,
) -> (EtcdHarness, EtcdLock, Vec<fenced_api::Lease>) {
    let h = EtcdHarness::new().await;
    let lock = h.lock().await;
    let mut leases = Vec::with_capacity(n);
    for i in 0..n {
        let k = key(&format!("{prefix}{i}"));
        leases.push(hold(&lock, &k, ttl).await);
    }
    (h, lock, leases)
}

/// The holders' and waiters' TTL in the phantom-lock tests.
const PHANTOM_TTL: Duration = Duration::from_secs(60);

/// A lease of `ttl`, waited for up to `wait`.
fn waiting(ttl: Duration, wait: Duration) -> LockOptions {
    LockOptions::builder()
        .ttl(ttl)
        .wait_timeout(wait)
        .build()
        .unwrap()
}

/// `lock.acquire(k, wait)` in a task of its own.
fn spawn_acquire(
    lock: &EtcdLock,
    k: &LockKey,
    wait: &LockOptions,
) -> tokio::task::JoinHandle<fenced_api::Result<fenced_api::Lease>> {
    let (lock, k, wait) = (lock.clone(), k.clone(), wait.clone());
    tokio::spawn(async move { lock.acquire(&k, &wait).await })
}

/// `holder` takes `k` for [`PHANTOM_TTL`] and `waiter` queues behind it
/// with `wait`: the holder's lease, the waiting task, and the line's two
/// entries.
async fn hold_and_queue(
    c: &mut etcd_client::Client,
    holder: &EtcdLock,
    waiter: &EtcdLock,
    k: &LockKey,
    wait: &LockOptions,
) -> (
    fenced_api::Lease,
    tokio::task::JoinHandle<fenced_api::Result<fenced_api::Lease>>,
    Vec<etcd_client::KeyValue>,
) {
    let held = hold(holder, k, PHANTOM_TTL).await;
    let waiting = spawn_acquire(waiter, k, wait);
    let line = line_of(c, k, 2).await;
    (held, waiting, line)
}

/// Once `waiting` (see [`spawn_acquire`]) returned a lease (within 40 s) or
/// failed, the lock must be exactly what `inspect` shows: never a lease
/// whose entry is gone.
async fn check_not_phantom(
    lock: &EtcdLock,
    k: &LockKey,
    waiting: tokio::task::JoinHandle<fenced_api::Result<fenced_api::Lease>>,
    case: &str,
) {
    let got = tokio::time::timeout(Duration::from_secs(40), waiting)
        .await
        .unwrap_or_else(|_| panic!("{case}: acquire hung"))
        .unwrap();
    match got {
        Ok(lease) => {
            let info = lock.inspect(k).await.unwrap();
            assert_eq!(
                info.map(|i| (i.token, i.owner)),
                Some((lease.token, lease.owner.clone())),
                "{case}: acquire returned a lease whose entry is gone (etcd #11456)"
            );
            assert_eq!(
                lock.release(&lease).await.unwrap(),
                ReleaseOutcome::Released,
                "{case}"
            );
        }
        // Failing is allowed; coming back with a phantom lock is not.
        Err(e) => println!("{case}: acquire failed: {e}"),
    }
}

/// The phantom-lock race of etcd's lock recipe: a waiter whose place in
/// line vanishes behind its back — its session lease revoked, or its entry
/// deleted — while the holder still holds must not come back holding a
/// lock whose entry is gone once the holder releases: it queues again (and
/// `inspect` then shows its token) or fails. The holder releases right
/// after the damage, or a little later.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiter_whose_entry_vanished_never_returns_a_phantom_lock() {
    let h = EtcdHarness::new().await;
    let mut c = raw().await;
    let wait = waiting(PHANTOM_TTL, Duration::from_secs(30));
    for revoke in [true, false] {
        for pause in [Duration::ZERO, Duration::from_millis(300)] {
            let case = format!(
                "{} then release after {pause:?}",
                if revoke {
                    "lease revoked"
                } else {
                    "entry deleted"
                }
            );
            let (holder, waiter) = (h.lock().await, h.lock().await);
            let k = key("phantom");
            let (held, waiting, line) = hold_and_queue(&mut c, &holder, &waiter, &k, &wait).await;
            let mine = &line[1];
            assert_ne!(mine.value(), held.owner.as_str().as_bytes());
            if revoke {
                c.lease_revoke(mine.lease()).await.unwrap();
            } else {
                c.delete(mine.key(), None).await.unwrap();
            }
            tokio::time::sleep(pause).await;
            holder.release(&held).await.unwrap();
            check_not_phantom(&waiter, &k, waiting, &case).await;
        }
    }
}

/// The same with the holder and the waiter on one client and one TTL: they
/// share a session lease, so revoking it deletes both entries in one
/// revision — the waiter sees its predecessor go and its own entry go at
/// once, in either order. Repeated, since the order is etcd's choice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiter_sharing_the_holders_revoked_lease_never_returns_a_phantom_lock() {
    let h = EtcdHarness::new().await;
    let mut c = raw().await;
    let wait = waiting(PHANTOM_TTL, Duration::from_secs(30));
    for round in 0..6 {
        let case = format!("round {round}");
        let lock = h.lock().await;
        let k = key("phantom-shared");
        let (held, waiting, line) = hold_and_queue(&mut c, &lock, &lock, &k, &wait).await;
        assert_eq!(line[0].lease(), line[1].lease(), "one session lease");
        c.lease_revoke(line[0].lease()).await.unwrap();
        check_not_phantom(&lock, &k, waiting, &case).await;
        drop(held);
    }
}
