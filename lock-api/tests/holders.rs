//! Every acquisition through a `LockClient` is its own holder: tasks that
//! share one client exclude each other and wait in turn; a task asking again
//! for a key it holds is told so at once (or re-enters when asked for).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::{
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc,
    },
    time::Duration,
};

use fenced_api::{
    DistributedLock, Error, LockClient, LockKey, LockOptions, MemoryLock, WaitPolicy,
};
use tokio::time::{sleep, timeout, Instant};

const TTL: Duration = Duration::from_secs(3);

fn client(store: &MemoryLock, reentrant: bool) -> LockClient {
    LockClient::builder(Arc::new(store.clone()))
        .ttl(TTL)
        .wait(WaitPolicy::Timeout(Duration::from_secs(60)))
        .reentrant(reentrant)
        .build()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixteen_tasks_sharing_one_client_take_turns() {
    for reentrant in [false, true] {
        let store = MemoryLock::new();
        let shared = client(&store, reentrant);
        let inside = Arc::new(AtomicUsize::new(0));
        let most = Arc::new(AtomicUsize::new(0));
        let rounds = Arc::new(AtomicUsize::new(0));
        let tasks: Vec<_> = (0..16)
            .map(|_| {
                let (c, inside, most, rounds) = (
                    shared.clone(),
                    Arc::clone(&inside),
                    Arc::clone(&most),
                    Arc::clone(&rounds),
                );
                tokio::spawn(async move {
                    let mut last = 0;
                    for _ in 0..10 {
                        let guard = c.acquire("shared").await?;
                        assert!(guard.token().get() > last, "a token went backwards");
                        last = guard.token().get();
                        let now = inside.fetch_add(1, Ordering::SeqCst) + 1;
                        most.fetch_max(now, Ordering::SeqCst);
                        tokio::task::yield_now().await;
                        sleep(Duration::from_millis(1)).await;
                        inside.fetch_sub(1, Ordering::SeqCst);
                        rounds.fetch_add(1, Ordering::SeqCst);
                        guard.release().await?;
                    }
                    Ok::<_, Error>(())
                })
            })
            .collect();
        for t in tasks {
            timeout(Duration::from_secs(60), t)
                .await
                .expect("a task hung")
                .expect("a task panicked")
                .unwrap_or_else(|e| panic!("reentrant={reentrant}: {e}"));
        }
        assert_eq!(rounds.load(Ordering::SeqCst), 160, "reentrant={reentrant}");
        assert_eq!(
            most.load(Ordering::SeqCst),
            1,
            "two tasks of one client held the key at once (reentrant={reentrant})"
        );
    }
}

#[tokio::test(start_paused = true)]
async fn another_task_of_the_same_client_waits_for_the_release() {
    for reentrant in [false, true] {
        let store = MemoryLock::new();
        let c = client(&store, reentrant);
        let guard = c.acquire("k").await.unwrap();
        let waiter = {
            let c = c.clone();
            tokio::spawn(async move {
                let g = c.acquire("k").await.unwrap();
                let at = Instant::now();
                (g.token(), at, g.release().await)
            })
        };
        sleep(TTL * 2).await;
        assert!(!waiter.is_finished(), "another task got a held key");
        let released_at = Instant::now();
        let first = guard.token();
        guard.release().await.unwrap();
        let (token, at, released) = waiter.await.unwrap();
        released.unwrap();
        assert!(token > first);
        assert!(at - released_at < Duration::from_secs(1));
    }
}

#[tokio::test(start_paused = true)]
async fn a_task_asking_again_for_its_own_key_is_told_at_once() {
    let store = MemoryLock::new();
    let c = client(&store, false);
    let guard = c.acquire("k").await.unwrap();
    let start = Instant::now();
    match c.acquire("k").await {
        Err(Error::AlreadyHeld { key }) => assert_eq!(key.as_str(), "k"),
        other => panic!("expected AlreadyHeld, got {other:?}"),
    }
    assert!(matches!(
        c.try_acquire("k").await,
        Err(Error::AlreadyHeld { .. })
    ));
    // Not after the wait bound: at once.
    assert_eq!(start.elapsed(), Duration::ZERO);
    // The same task inside a spawned task is a task of its own.
    let inner = {
        let c = c.clone();
        tokio::spawn(async move {
            let g = c.acquire("k2").await.unwrap();
            let again = c.try_acquire("k2").await;
            g.release().await.unwrap();
            again.map(|g| g.is_some())
        })
    };
    assert!(matches!(
        inner.await.unwrap(),
        Err(Error::AlreadyHeld { .. })
    ));
    guard.release().await.unwrap();
    // Released: the same task takes it again.
    c.acquire("k").await.unwrap().release().await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn reentry_by_the_acquiring_task_a_scope_or_the_guard() {
    let store = MemoryLock::new();
    let c = client(&store, true);
    let key = LockKey::new("k").unwrap();
    let g1 = c.acquire("k").await.unwrap();
    // The acquiring task asking again re-enters: same token, one lease.
    let again = c.try_acquire("k").await.unwrap().unwrap();
    assert_eq!(again.token(), g1.token());
    again.release().await.unwrap();
    assert!(store.inspect(&key).await.unwrap().is_some());
    // Inside the hold's scope: re-entry too.
    let g2 = g1.scope(c.acquire("k")).await.unwrap();
    assert_eq!(g1.token(), g2.token());
    // Explicit re-entry hands the hold to another task.
    let g3 = g1.reenter().unwrap();
    let t = tokio::spawn(async move {
        sleep(Duration::from_millis(10)).await;
        let token = g3.token();
        g3.release().await.unwrap();
        token
    });
    assert_eq!(t.await.unwrap(), g1.token());
    g2.release().await.unwrap();
    assert!(
        store.inspect(&key).await.unwrap().is_some(),
        "one guard is left"
    );
    // Still renewed while a guard is left.
    sleep(TTL * 2).await;
    assert!(!g1.is_lost());
    g1.release().await.unwrap();
    assert!(store.inspect(&key).await.unwrap().is_none());

    // reenter on a lost guard is an error, not a second guard.
    let plain = client(&store, false);
    let g = plain.acquire("k").await.unwrap();
    let _also = g.reenter().unwrap();
    store.force_release(&key).await.unwrap();
    g.lost().await;
    assert!(matches!(g.reenter(), Err(Error::LeaseLost { .. })));
}

#[tokio::test(start_paused = true)]
async fn with_lock_work_re_enters_or_is_told_and_its_spawned_tasks_wait() {
    for reentrant in [false, true] {
        let store = MemoryLock::new();
        let c = client(&store, reentrant);
        let (inner, spawned) = c
            .with_lock("k", |lease| {
                let c = c.clone();
                async move {
                    let inner = match c.try_acquire("k").await {
                        Ok(Some(g)) => {
                            assert_eq!(g.token(), lease.token());
                            g.release().await.unwrap();
                            "re-entered"
                        }
                        Err(Error::AlreadyHeld { .. }) => "told",
                        other => panic!("inside with_lock: {other:?}"),
                    };
                    // A task spawned from the work is another holder.
                    let c2 = c.clone();
                    let spawned = tokio::spawn(async move { c2.try_acquire("k").await })
                        .await
                        .unwrap();
                    (inner, spawned.map(|g| g.is_some()))
                }
            })
            .await
            .unwrap();
        assert_eq!(inner, if reentrant { "re-entered" } else { "told" });
        assert!(
            matches!(spawned, Ok(false)),
            "reentrant={reentrant}: a spawned task got {spawned:?}"
        );
    }
}

/// A guard handed to a worker task still counts as its acquirer's: on a
/// client that is not reentrant, the acquiring task asking again is told at
/// once — never let in beside the worker as a second holder. (On a
/// reentrant client it re-enters the worker's hold, as documented.)
#[tokio::test(start_paused = true)]
async fn a_handed_off_guard_never_lets_its_acquiring_task_in_again() {
    {
        let reentrant = false;
        let store = MemoryLock::new();
        let c = client(&store, reentrant);
        let inside = Arc::new(AtomicUsize::new(0));
        let g = c.acquire("k").await.unwrap();
        let worker = {
            let inside = Arc::clone(&inside);
            tokio::spawn(async move {
                inside.fetch_add(1, Ordering::SeqCst);
                sleep(Duration::from_millis(100)).await;
                inside.fetch_sub(1, Ordering::SeqCst);
                g.release().await.unwrap();
            })
        };
        sleep(Duration::from_millis(10)).await;
        match c.try_acquire("k").await {
            Err(Error::AlreadyHeld { .. }) => {}
            Ok(Some(_)) => panic!("reentrant={reentrant}: let in beside the worker"),
            other => panic!("reentrant={reentrant}: {other:?}"),
        }
        assert_eq!(inside.load(Ordering::SeqCst), 1);
        worker.await.unwrap();
        // Once the worker released it, the dispatcher takes it normally.
        c.acquire("k").await.unwrap().release().await.unwrap();
    }
}

/// Two futures of one task both asking for the key on a client that is not
/// reentrant: never both inside (the second is told). A reentrant client
/// counts them as one holder, as documented.
#[tokio::test(start_paused = true)]
async fn futures_of_one_task_are_never_both_inside() {
    {
        let reentrant = false;
        let store = MemoryLock::new();
        let c = client(&store, reentrant);
        let inside = Arc::new(AtomicUsize::new(0));
        let most = Arc::new(AtomicUsize::new(0));
        let one = |delay: u64| {
            let (c, inside, most) = (c.clone(), Arc::clone(&inside), Arc::clone(&most));
            async move {
                sleep(Duration::from_millis(delay)).await;
                match c.acquire("k").await {
                    Ok(g) => {
                        let now = inside.fetch_add(1, Ordering::SeqCst) + 1;
                        most.fetch_max(now, Ordering::SeqCst);
                        sleep(Duration::from_millis(100)).await;
                        inside.fetch_sub(1, Ordering::SeqCst);
                        g.release().await.unwrap();
                        true
                    }
                    Err(Error::AlreadyHeld { .. }) => false,
                    Err(e) => panic!("{e}"),
                }
            }
        };
        let (a, b) = tokio::join!(one(0), one(10));
        assert!(a && !b, "reentrant={reentrant}: {a} {b}");
        assert_eq!(most.load(Ordering::SeqCst), 1, "reentrant={reentrant}");
    }
}

#[tokio::test(start_paused = true)]
async fn each_acquisition_has_its_own_owner_on_the_store() {
    let store = MemoryLock::new();
    let c = client(&store, false);
    let key = LockKey::new("k").unwrap();
    let a = c.acquire("k").await.unwrap();
    let first = store.inspect(&key).await.unwrap().unwrap().owner;
    a.release().await.unwrap();
    let b = c.acquire("k").await.unwrap();
    let second = store.inspect(&key).await.unwrap().unwrap().owner;
    assert_ne!(first, second);
    // Another acquisition's lease cannot release it.
    let opts = LockOptions::builder().ttl(TTL).build().unwrap();
    assert!(store.try_acquire(&key, &opts).await.unwrap().is_none());
    b.release().await.unwrap();
}

/// A scope counts for the task that entered it only: another task polled
/// inside it (a `LocalSet` driven from the work) is another holder.
#[tokio::test]
async fn a_scope_does_not_leak_into_tasks_polled_inside_it() {
    let store = MemoryLock::new();
    let c = client(&store, true);
    let local = tokio::task::LocalSet::new();
    let other = {
        let c = c.clone();
        local.spawn_local(async move { c.try_acquire("k").await.map(|g| g.is_some()) })
    };
    let guard = c.acquire("k").await.unwrap();
    let got_in = guard.scope(local.run_until(other)).await.unwrap();
    assert!(
        matches!(got_in, Ok(false)),
        "a task polled inside the scope was let in: {got_in:?}"
    );
    guard.release().await.unwrap();
}

/// Re-entry never hands out a lease past its safe deadline, even when the
/// watchdog has had no chance to mark it lost (its runtime was blocked);
/// inside the scope of a lost hold, asking again is told of the loss.
#[tokio::test]
async fn no_re_entry_into_a_hold_past_its_safe_deadline() {
    let store = MemoryLock::new();
    let c = LockClient::builder(Arc::new(store.clone()))
        .ttl(Duration::from_millis(300))
        .reentrant(true)
        .build()
        .unwrap();
    let guard = c.acquire("k").await.unwrap();
    // The whole runtime stalls past the TTL: no watchdog runs.
    std::thread::sleep(Duration::from_millis(450));
    assert!(matches!(guard.reenter(), Err(Error::LeaseLost { .. })));
    match guard.scope(c.try_acquire("k")).await {
        Err(Error::LeaseLost { .. }) => {}
        other => panic!("re-entry past the safe deadline: {other:?}"),
    }
    guard.lost().await;
    match guard.scope(c.try_acquire("k")).await {
        Err(Error::LeaseLost { .. }) => {}
        other => panic!("inside a lost hold's scope: {other:?}"),
    }
}
