//! `list` on `row_lock`: what the grant descriptions alone would get wrong.
//! A released key whose connection has gone on to wait for another key is
//! still inside a transaction and has no later grant — a candidate — and
//! only the probe tells that nobody holds it.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::Duration;

use common::{run_table, server_url, url_for};
use fenced_api::{DistributedLock, LockKey, LockOptions, WaitPolicy};
use fenced_mysql::{MySqlLock, Strategy};

fn opts(wait: WaitPolicy) -> LockOptions {
    LockOptions::builder()
        .ttl(Duration::from_secs(30))
        .wait(wait)
        .build()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn row_lock_list_leaves_out_a_released_key_whose_connection_waits_elsewhere() {
    let server = server_url().await;
    let table = format!("{}_list1", run_table());
    let url = url_for(&server, Strategy::RowLock, &table);
    MySqlLock::migrate(&url).await.unwrap();
    let (holder, waiter, lister) = (
        MySqlLock::connect(&url).await.unwrap(),
        MySqlLock::connect(&url).await.unwrap(),
        MySqlLock::connect(&url).await.unwrap(),
    );
    let (a, b) = (LockKey::new("a").unwrap(), LockKey::new("b").unwrap());
    // The waiter's lock connection grants `a` and gives it back (kept for
    // its next hold) ...
    let la = waiter
        .try_acquire(&a, &opts(WaitPolicy::NoWait))
        .await
        .unwrap()
        .unwrap();
    waiter.release(&la).await.unwrap();
    let lb = holder
        .try_acquire(&b, &opts(WaitPolicy::NoWait))
        .await
        .unwrap()
        .unwrap();
    // ... then waits on it for `b`: in a transaction, `a` its latest grant.
    let wait = tokio::spawn({
        let (waiter, b) = (waiter.clone(), b.clone());
        async move {
            waiter
                .acquire(&b, &opts(WaitPolicy::Timeout(Duration::from_secs(30))))
                .await
        }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    let listed = lister.list(10).await.unwrap();
    let keys: Vec<&str> = listed.iter().map(|i| i.key.as_str()).collect();
    assert_eq!(keys, ["b"], "{listed:?}");
    assert_eq!(listed[0].token, lb.token);
    assert_eq!(listed[0].owner, lb.owner);
    assert_eq!(lister.inspect(&a).await.unwrap(), None);

    holder.release(&lb).await.unwrap();
    let lb2 = tokio::time::timeout(Duration::from_secs(60), wait)
        .await
        .expect("the waiter hung")
        .unwrap()
        .unwrap();
    let listed = lister.list(10).await.unwrap();
    let keys: Vec<&str> = listed.iter().map(|i| i.key.as_str()).collect();
    assert_eq!(keys, ["b"], "{listed:?}");
    assert_eq!(listed[0].token, lb2.token);
    // Through the holding instance: its own hold, with its local count.
    let own = waiter.list(10).await.unwrap();
    assert_eq!(own.len(), 1);
    assert_eq!((own[0].token, own[0].hold_count), (lb2.token, 1));
    waiter.release(&lb2).await.unwrap();
    assert!(lister.list(10).await.unwrap().is_empty());
}
