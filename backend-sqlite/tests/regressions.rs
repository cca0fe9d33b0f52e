//! Races between concurrent releases and re-entries of one re-entered lock,
//! on several stores over one file.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::Duration;

use common::{fresh_file, url_for};
use fenced_api::{DistributedLock, LockKey, LockOptions, ReleaseOutcome};
use fenced_sqlite::SqliteLock;

/// `N` stores on one fresh file (`file_tag` names it), and the options of
/// re-entrant holds by one owner.
async fn reentrant_stores<const N: usize>(file_tag: &str) -> ([SqliteLock; N], LockOptions) {
    let file = fresh_file(file_tag);
    let mut stores = Vec::with_capacity(N);
    for _ in 0..N {
        stores.push(
            SqliteLock::connect(&url_for(&file, "rv", ""))
                .await
                .unwrap(),
        );
    }
    let opts = LockOptions::builder()
        .ttl(Duration::from_secs(30))
        .owner("node-1")
        .reentrant(true)
        .build()
        .unwrap();
    (stores.try_into().unwrap(), opts)
}

/// S1: `release` is three autocommit statements. Two entries of one
/// re-entered lock released concurrently: one gets StillHeld{1}, the other's
/// `release_one` finds count 1 and its `delete_own` deletes the row — the key
/// is freed but the caller is told NotHeld ("lease lost").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s1_concurrent_reentrant_releases_are_counted() {
    let ([a, b], opts) = reentrant_stores("review").await;
    let mut bad = Vec::new();
    for i in 0..300 {
        let k = LockKey::new(format!("re/{i}")).unwrap();
        let l1 = a.try_acquire(&k, &opts).await.unwrap().unwrap();
        let l2 = b.try_acquire(&k, &opts).await.unwrap().unwrap();
        let (r1, r2) = tokio::join!(a.release(&l1), b.release(&l2));
        let (r1, r2) = (r1.unwrap(), r2.unwrap());
        if r1 == ReleaseOutcome::NotHeld || r2 == ReleaseOutcome::NotHeld {
            bad.push((i, r1, r2, a.inspect(&k).await.unwrap().is_none()));
        }
    }
    assert!(
        bad.is_empty(),
        "{} of 300 concurrent releases said NotHeld: {:?}",
        bad.len(),
        &bad[..bad.len().min(5)]
    );
}

/// S1b: the same race with a third entry re-entering: the stray `delete_own`
/// deletes the row the new entry holds, so the key is free while that entry's
/// lease (count 1) is believed held — a second owner can take the key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s1b_concurrent_release_never_deletes_a_fresh_reentry() {
    let ([a, b, c], opts) = reentrant_stores("review3").await;
    let other = LockOptions::builder()
        .ttl(Duration::from_secs(30))
        .build()
        .unwrap();
    let mut lost = Vec::new();
    for i in 0..500 {
        let k = LockKey::new(format!("re3/{i}")).unwrap();
        let l1 = a.try_acquire(&k, &opts).await.unwrap().unwrap();
        let l2 = b.try_acquire(&k, &opts).await.unwrap().unwrap();
        let (r1, r2, l3) = tokio::join!(a.release(&l1), b.release(&l2), c.try_acquire(&k, &opts));
        let Some(l3) = l3.unwrap() else { continue };
        // l3 was granted and never released: the key must still be held.
        if let Some(intruder) = a.try_acquire(&k, &other).await.unwrap() {
            lost.push((i, r1.unwrap(), r2.unwrap(), l3.token, intruder.token));
        }
    }
    assert!(
        lost.is_empty(),
        "{} of 500: a granted re-entry was deleted and another owner got the key: {:?}",
        lost.len(),
        &lost[..lost.len().min(5)]
    );
}
