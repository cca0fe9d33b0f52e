//! `row_lock` reads `information_schema.INNODB_TRX`, which InnoDB serves
//! from a cache it refills only when the last read is over 0.1 s old. These
//! tests make that cache stale on purpose — and, in one, keep it stale — on
//! the shared MariaDB. They are a binary of their own, run one at a time: a
//! session that keeps the cache stale affects every session on the server,
//! and the other binaries' tests expect it to refill.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::{drop_tables, fresh_pair, key, server_url, ttl};
use fenced_api::{DistributedLock, Error, LockOptions, ReleaseOutcome};
use sqlx::{Connection, MySqlConnection};

/// A generous bound on calls that must not hang (never a timing assertion).
const HANG: Duration = Duration::from_secs(30);

/// The tests of this binary, one at a time (see the module docs).
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Reads `INNODB_TRX` once: the cache is filled now, and any read in the
/// next 0.1 s is served this copy.
async fn fill_cache(side: &mut MySqlConnection) {
    sqlx::raw_sql("SELECT COUNT(*) FROM information_schema.INNODB_TRX")
        .execute(side)
        .await
        .unwrap();
}

fn shared_owner() -> LockOptions {
    LockOptions::builder()
        .ttl(Duration::from_secs(30))
        .owner("shared-owner")
        .wait_timeout(Duration::from_secs(3))
        .build()
        .unwrap()
}

/// A hold granted right after the cache was filled is still seen: the same
/// owner through a second instance gets `AlreadyHeld`, and `list` through
/// the second instance shows the key — with either grant path. Without the
/// witness the check read the copy taken before the hold began (a CI run
/// failed this way: `try_acquire` gave `Ok(None)`), and `list` left the key
/// out.
#[tokio::test]
async fn a_hold_younger_than_the_cache_is_seen() {
    let _one = ONE_AT_A_TIME.lock().await;
    for extra in ["", "&row_lock_one_statement=false"] {
        let (a, b, base) = fresh_pair("trxcache", extra).await;
        let mut side = MySqlConnection::connect(&server_url().await).await.unwrap();
        let opts = shared_owner();

        let k = key("young");
        fill_cache(&mut side).await;
        let held = a.try_acquire(&k, &opts).await.unwrap().unwrap();
        match tokio::time::timeout(HANG, b.try_acquire(&k, &opts)).await {
            Ok(Err(Error::AlreadyHeld { .. })) => {}
            other => panic!("{extra}: the same owner's young hold was missed: {other:?}"),
        }

        let other = key("young-list");
        fill_cache(&mut side).await;
        let listed_hold = a
            .try_acquire(&other, &ttl(Duration::from_secs(30)))
            .await
            .unwrap()
            .unwrap();
        let listed = tokio::time::timeout(HANG, b.list(100))
            .await
            .expect("list hung")
            .unwrap();
        for (k, lease) in [(&k, &held), (&other, &listed_hold)] {
            let info = listed
                .iter()
                .find(|i| &i.key == k)
                .unwrap_or_else(|| panic!("{extra}: {k} is held but not listed: {listed:?}"));
            assert_eq!(info.token, lease.token, "{extra}: {k}");
        }
        assert_eq!(listed.len(), 2, "{extra}: {listed:?}");

        assert_eq!(a.release(&held).await.unwrap(), ReleaseOutcome::Released);
        assert_eq!(
            a.release(&listed_hold).await.unwrap(),
            ReleaseOutcome::Released
        );
        drop((a, b, side));
        drop_tables(&base).await;
    }
}

/// Several checks at once in one process, started 35 ms apart, after the
/// cache was filled and before the holds began: a read less than 0.1 s
/// after another one is served the old copy and puts off the refill.
/// Re-reading on their own (a fixed 110 ms period failed 3 of 3 runs, a
/// jittered 110–210 ms one 5 of 6) the checks kept each other from ever
/// seeing a fresh copy; taking turns through the process's gate, each
/// read may refill, and every check sees its owner's hold.
#[tokio::test]
async fn staggered_checks_do_not_starve_each_other() {
    let _one = ONE_AT_A_TIME.lock().await;
    let (a, b, base) = fresh_pair("trxstagger", "").await;
    let mut side = MySqlConnection::connect(&server_url().await).await.unwrap();
    let opts = shared_owner();
    let keys: Vec<_> = (0..4).map(|i| key(&format!("stagger-{i}"))).collect();
    // Filled before the holds begin: no read of this copy shows them.
    fill_cache(&mut side).await;
    let mut held = Vec::new();
    for k in &keys {
        held.push((k.clone(), a.try_acquire(k, &opts).await.unwrap().unwrap()));
    }
    let checks = held.iter().enumerate().map(|(i, (k, _))| {
        let (b, opts) = (&b, &opts);
        async move {
            tokio::time::sleep(Duration::from_millis(35 * i as u64)).await;
            (k, tokio::time::timeout(HANG, b.try_acquire(k, opts)).await)
        }
    });
    for (k, r) in futures_util::future::join_all(checks).await {
        match r {
            Ok(Err(Error::AlreadyHeld { .. })) => {}
            other => panic!("{k}: a staggered same-owner check gave {other:?}"),
        }
    }
    for (_, lease) in &held {
        assert_eq!(a.release(lease).await.unwrap(), ReleaseOutcome::Released);
    }
    drop((a, b, side));
    drop_tables(&base).await;
}

/// While another session reads `INNODB_TRX` every 20 ms, InnoDB never
/// refills the cache (a hold of 1.5 s stayed invisible when measured).
/// Then nothing is detected from it, and nothing goes wrong: `list` falls
/// back to probing every described key and is still exact, the same owner
/// through a second instance is answered within its bound (refused, or
/// `AlreadyHeld` should the reader stall long enough for a refill), and
/// once the reader stops, detection works again.
#[tokio::test]
async fn a_cache_kept_stale_costs_detection_not_correctness() {
    let _one = ONE_AT_A_TIME.lock().await;
    let (a, b, base) = fresh_pair("trxstarve", "").await;
    let opts = shared_owner();
    let released = key("starve-released");
    let gone = a
        .try_acquire(&released, &ttl(Duration::from_secs(30)))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(a.release(&gone).await.unwrap(), ReleaseOutcome::Released);

    let stop = Arc::new(AtomicBool::new(false));
    let reads = Arc::new(AtomicU64::new(0));
    let mut side = MySqlConnection::connect(&server_url().await).await.unwrap();
    let reader = tokio::spawn({
        let (stop, reads) = (Arc::clone(&stop), Arc::clone(&reads));
        async move {
            while !stop.load(Ordering::Relaxed) {
                fill_cache(&mut side).await;
                reads.fetch_add(1, Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    let reads_before = reads.load(Ordering::Relaxed);
    assert!(reads_before > 0, "the reader never read INNODB_TRX");

    let k = key("starved");
    let held = a.try_acquire(&k, &opts).await.unwrap().unwrap();
    match tokio::time::timeout(HANG, b.try_acquire(&k, &opts)).await {
        Ok(Ok(None)) | Ok(Err(Error::AlreadyHeld { .. })) => {}
        other => panic!("a refused same-owner try under a stale cache gave {other:?}"),
    }
    match tokio::time::timeout(HANG, b.acquire(&k, &opts)).await {
        Ok(Err(Error::Timeout { .. })) | Ok(Err(Error::AlreadyHeld { .. })) => {}
        other => panic!("a same-owner acquire under a stale cache gave {other:?}"),
    }
    let listed = tokio::time::timeout(HANG, b.list(100))
        .await
        .expect("list hung")
        .unwrap();
    assert_eq!(
        listed.iter().map(|i| (&i.key, i.token)).collect::<Vec<_>>(),
        vec![(&k, held.token)],
        "list under a stale cache must show the held key and not the released one"
    );

    // The reader kept reading while the checks ran (a stall of it could let
    // the cache refill, which the checks above allow for).
    let reads_during = reads.load(Ordering::Relaxed) - reads_before;
    assert!(
        reads_during > 0,
        "the reader did not read during the checks"
    );
    stop.store(true, Ordering::Relaxed);
    reader.await.unwrap();
    match tokio::time::timeout(HANG, b.try_acquire(&k, &opts)).await {
        Ok(Err(Error::AlreadyHeld { .. })) => {}
        other => panic!("once the reader stopped, the same owner was not detected: {other:?}"),
    }
    assert_eq!(a.release(&held).await.unwrap(), ReleaseOutcome::Released);
    drop((a, b));
    drop_tables(&base).await;
}
