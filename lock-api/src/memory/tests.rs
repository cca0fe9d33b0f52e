//! Unit tests of the in-memory store.

use super::*;

fn key(k: &str) -> LockKey {
    LockKey::new(k).unwrap()
}

fn ttl(ms: u64) -> LockOptions {
    LockOptions::builder()
        .ttl(Duration::from_millis(ms))
        .build()
        .unwrap()
}

#[tokio::test(start_paused = true)]
async fn expiry_follows_tokio_time() {
    let m = MemoryLock::new();
    let l = m.try_acquire(&key("k"), &ttl(1000)).await.unwrap().unwrap();
    tokio::time::advance(Duration::from_millis(999)).await;
    assert!(m
        .try_acquire(&key("k"), &ttl(1000))
        .await
        .unwrap()
        .is_none());
    tokio::time::advance(Duration::from_millis(1)).await;
    let l2 = m.try_acquire(&key("k"), &ttl(1000)).await.unwrap().unwrap();
    assert!(l2.token > l.token);
    assert_eq!(m.release(&l).await.unwrap(), ReleaseOutcome::NotHeld);
}

#[tokio::test(start_paused = true)]
async fn waiters_are_served_in_arrival_order() {
    let m = MemoryLock::new();
    let k = key("fifo");
    let first = m.try_acquire(&k, &ttl(10_000)).await.unwrap().unwrap();
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    for i in 0..5 {
        let (m, k, tx) = (m.clone(), k.clone(), tx.clone());
        tokio::spawn(async move {
            let lease = m.acquire(&k, &ttl(10_000)).await.unwrap();
            tx.send(i).unwrap();
            tokio::time::sleep(Duration::from_millis(10)).await;
            m.release(&lease).await.unwrap();
        });
        // Let each waiter queue before the next one arrives.
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    m.release(&first).await.unwrap();
    let mut order = Vec::new();
    for _ in 0..5 {
        order.push(rx.recv().await.unwrap());
    }
    assert_eq!(order, vec![0, 1, 2, 3, 4]);
}

#[tokio::test(start_paused = true)]
async fn cancelled_waiter_leaves_the_queue() {
    let m = MemoryLock::new();
    let k = key("cancel");
    let held = m.try_acquire(&k, &ttl(10_000)).await.unwrap().unwrap();
    let w = tokio::time::timeout(Duration::from_millis(50), m.acquire(&k, &ttl(1000))).await;
    assert!(w.is_err(), "still waiting when cancelled");
    m.release(&held).await.unwrap();
    // The cancelled waiter must not block the key or hold it.
    assert!(m.try_acquire(&k, &ttl(1000)).await.unwrap().is_some());
    assert!(m.state().entries.values().all(|e| e.waiters.is_empty()));
}

#[tokio::test(start_paused = true)]
async fn an_unpolled_first_waiter_does_not_block_a_free_key_forever() {
    let m = MemoryLock::new();
    let k = key("stuck");
    let held = m.try_acquire(&k, &ttl(10_000)).await.unwrap().unwrap();
    let opts = ttl(1000);
    let waiter = m.acquire(&k, &opts);
    tokio::pin!(waiter);
    // Poll once so it queues, then never again.
    assert!(futures_poll_once(waiter.as_mut()).await.is_none());
    m.release(&held).await.unwrap();
    assert!(
        m.try_acquire(&k, &opts).await.unwrap().is_none(),
        "reserved for the first waiter"
    );
    tokio::time::advance(FRONT_GRACE).await;
    assert!(
        m.try_acquire(&k, &opts).await.unwrap().is_some(),
        "the grace period ended"
    );
}

#[tokio::test(start_paused = true)]
async fn extending_one_reentered_lease_never_shortens_another() {
    let m = MemoryLock::new();
    let k = key("re");
    let long = LockOptions::builder()
        .ttl(Duration::from_secs(8))
        .owner("me")
        .reentrant(true)
        .build()
        .unwrap();
    let a = m.try_acquire(&k, &long).await.unwrap().unwrap();
    let _b = m.try_acquire(&k, &long).await.unwrap().unwrap();
    m.extend(&a, Duration::from_secs(1)).await.unwrap();
    tokio::time::advance(Duration::from_secs(2)).await;
    assert!(
        m.inspect(&k).await.unwrap().is_some(),
        "the 8 s entry was cut short"
    );
}

#[tokio::test]
async fn a_re_entry_keeps_the_first_label() {
    let m = MemoryLock::new();
    let k = key("label");
    let first = LockOptions::builder()
        .owner("me")
        .reentrant(true)
        .label("first")
        .build()
        .unwrap();
    let a = m.try_acquire(&k, &first).await.unwrap().unwrap();
    let again = first.to_builder().label("second").build().unwrap();
    m.try_acquire(&k, &again).await.unwrap().unwrap();
    let info = m.inspect(&k).await.unwrap().unwrap();
    assert_eq!(
        (info.hold_count, info.label.unwrap().as_str()),
        (2, "first")
    );
    assert_eq!(
        m.list(10).await.unwrap()[0]
            .label
            .as_ref()
            .unwrap()
            .as_str(),
        "first"
    );
    m.release(&a).await.unwrap();
    m.release(&a).await.unwrap();
    assert!(m.inspect(&k).await.unwrap().is_none());
}

/// Polls a future exactly once.
async fn futures_poll_once<F: std::future::Future + Unpin>(f: F) -> Option<F::Output> {
    let mut f = f;
    std::future::poll_fn(|cx| {
        std::task::Poll::Ready(match std::pin::Pin::new(&mut f).poll(cx) {
            std::task::Poll::Ready(v) => Some(v),
            std::task::Poll::Pending => None,
        })
    })
    .await
}

#[tokio::test]
async fn outage_is_a_retryable_backend_error() {
    let m = MemoryLock::new();
    m.set_available(false);
    let e = m.try_acquire(&key("k"), &ttl(1000)).await.unwrap_err();
    assert!(
        matches!(
            e,
            Error::Backend {
                retryable: true,
                ..
            }
        ),
        "{e}"
    );
    m.set_available(true);
    assert!(m
        .try_acquire(&key("k"), &ttl(1000))
        .await
        .unwrap()
        .is_some());
}

#[tokio::test(start_paused = true)]
async fn list_shows_current_holds_of_the_namespace_in_key_order() {
    let m = MemoryLock::new();
    let b = m.try_acquire(&key("b"), &ttl(1000)).await.unwrap().unwrap();
    let a = m.try_acquire(&key("a"), &ttl(5000)).await.unwrap().unwrap();
    let c = m.try_acquire(&key("c"), &ttl(5000)).await.unwrap().unwrap();
    m.release(&c).await.unwrap();
    m.with_namespace("other")
        .try_acquire(&key("z"), &ttl(5000))
        .await
        .unwrap()
        .unwrap();
    let all = m.list(10).await.unwrap();
    let keys: Vec<&str> = all.iter().map(|i| i.key.as_str()).collect();
    assert_eq!(keys, ["a", "b"]);
    assert_eq!(all[0].token, a.token);
    assert_eq!(all[1].owner, b.owner);
    assert_eq!(m.list(1).await.unwrap().len(), 1);
    // Expired holds are not listed.
    tokio::time::advance(Duration::from_millis(1500)).await;
    let keys: Vec<LockKey> = m
        .list(10)
        .await
        .unwrap()
        .into_iter()
        .map(|i| i.key)
        .collect();
    assert_eq!(keys, [key("a")]);
}
