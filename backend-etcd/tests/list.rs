//! `list` on etcd: only the oldest entry of each line holds (waiters are
//! not listed), and lines are complete across range pages.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::Duration;

use common::server_hostport;
use fenced_api::{DistributedLock, LockKey, LockOptions, WaitPolicy};
use fenced_etcd::EtcdLock;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn list_shows_holders_not_waiters_across_pages() {
    let hostport = server_hostport().await;
    let id = &uuid::Uuid::new_v4().simple().to_string()[..10];
    let url = format!("etcd://{hostport}/fenced-list-{id}?connect_timeout=3s");
    let (holder, waiter) = (
        EtcdLock::connect(&url).await.unwrap(),
        EtcdLock::connect(&url).await.unwrap(),
    );
    let opts = LockOptions::builder()
        .ttl(Duration::from_secs(30))
        .build()
        .unwrap();
    // More entries than one range page (500).
    let mut held = Vec::new();
    for i in 0..510 {
        let key = LockKey::new(format!("k{i:04}")).unwrap();
        held.push(holder.try_acquire(&key, &opts).await.unwrap().unwrap());
    }
    // A waiter queued behind the holder of the first key.
    let first = held[0].key.clone();
    let wait = tokio::spawn({
        let (waiter, first) = (waiter.clone(), first.clone());
        async move {
            let o = LockOptions::builder()
                .ttl(Duration::from_secs(30))
                .wait(WaitPolicy::Timeout(Duration::from_secs(60)))
                .build()
                .unwrap();
            waiter.acquire(&first, &o).await
        }
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    let all = waiter.list(10_000).await.unwrap();
    assert_eq!(all.len(), held.len());
    for (info, lease) in all.iter().zip(&held) {
        assert_eq!(
            (&info.key, &info.owner, info.token),
            (&lease.key, &lease.owner, lease.token)
        );
    }
    let two = waiter.list(2).await.unwrap();
    assert_eq!(two.len(), 2);
    assert_eq!((two[0].token, two[1].token), (held[0].token, held[1].token));

    holder.release(&held[0]).await.unwrap();
    let next = tokio::time::timeout(Duration::from_secs(60), wait)
        .await
        .expect("the waiter hung")
        .unwrap()
        .unwrap();
    let now = holder.list(1).await.unwrap();
    assert_eq!(now.len(), 1);
    assert_eq!((&now[0].owner, now[0].token), (&next.owner, next.token));
    waiter.release(&next).await.unwrap();
    for l in &held[1..] {
        holder.release(l).await.unwrap();
    }
    assert!(holder.list(10).await.unwrap().is_empty());
}
