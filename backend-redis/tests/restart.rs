//! Fencing tokens and held locks across restarts of a private
//! `redis-server` (SIGKILL, then the same port and directory), with and
//! without persistence, and how persistence is detected.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::{sync::Arc, time::Duration};

use common::{
    extend_after_reconnect, key, opts,
    private::{Mode, PrivateRedis},
    url_for, RedisHarness,
};
use fenced_api::{DistributedLock, Error, FencingToken, ReleaseOutcome};
use fenced_redis::{redis, Persistence, RedisLock};

#[tokio::test]
async fn tokens_rise_across_a_restart_without_persistence() {
    let server = PrivateRedis::start(Mode::NoPersistence).await.unwrap();
    let url = url_for(&server.url(), "restart");
    let lock = RedisLock::connect(&url).await.unwrap();
    assert_eq!(lock.persistence(), &Persistence::None);
    assert!(!lock.capabilities().is_durable());
    let k = key("restart");
    let first = lock
        .try_acquire(&k, &opts(Duration::from_secs(30)))
        .await
        .unwrap()
        .unwrap();
    lock.release(&first).await.unwrap();
    let held = lock
        .try_acquire(&k, &opts(Duration::from_secs(30)))
        .await
        .unwrap()
        .unwrap();
    assert!(held.token > first.token);

    server.restart().await.unwrap();

    // The lock is gone (documented), and the old holder learns it: its
    // renewal never re-creates the key.
    let other = RedisLock::connect(&url).await.unwrap();
    assert!(other.inspect(&k).await.unwrap().is_none(), "no persistence");
    let renewal = extend_after_reconnect(&lock, &held).await;
    assert!(
        matches!(renewal, Err(Error::LeaseLost { .. })),
        "{renewal:?}"
    );
    assert!(
        other.inspect(&k).await.unwrap().is_none(),
        "extend re-created the lock"
    );
    // The counter was lost with everything else, yet the next token is larger.
    let after = other
        .try_acquire(&k, &opts(Duration::from_secs(30)))
        .await
        .unwrap()
        .unwrap();
    assert!(
        after.token > held.token,
        "token {} after restart ≤ {} before",
        after.token,
        held.token
    );
    assert_eq!(lock.release(&held).await.unwrap(), ReleaseOutcome::NotHeld);
    other.release(&after).await.unwrap();
}

async fn restart_with_aof(mode: Mode) {
    let server = PrivateRedis::start(mode).await.unwrap();
    let url = url_for(&server.url(), "aof");
    let lock = RedisLock::connect(&url).await.unwrap();
    let durable = mode == Mode::AofAlways;
    assert_eq!(
        lock.capabilities().is_durable(),
        durable,
        "{:?}",
        lock.persistence()
    );
    let k = key("aof");
    let mut last = FencingToken::new(0);
    for _ in 0..3 {
        let l = lock
            .try_acquire(&k, &opts(Duration::from_secs(60)))
            .await
            .unwrap()
            .unwrap();
        assert!(l.token > last);
        last = l.token;
        lock.release(&l).await.unwrap();
    }
    let held = lock
        .try_acquire(&k, &opts(Duration::from_secs(60)))
        .await
        .unwrap()
        .unwrap();

    server.restart().await.unwrap();

    let other = RedisLock::connect(&url).await.unwrap();
    let info = other
        .inspect(&k)
        .await
        .unwrap()
        .expect("the AOF kept the lock");
    assert_eq!(info.token, held.token);
    assert!(other
        .try_acquire(&k, &opts(Duration::from_secs(60)))
        .await
        .unwrap()
        .is_none());
    // The holder renews on a new connection: the lease is still its own.
    let held = extend_after_reconnect(&lock, &held).await.unwrap();
    assert_eq!(lock.release(&held).await.unwrap(), ReleaseOutcome::Released);
    let after = other
        .try_acquire(&k, &opts(Duration::from_secs(60)))
        .await
        .unwrap()
        .unwrap();
    assert!(after.token > held.token);
    other.release(&after).await.unwrap();
}

#[tokio::test]
async fn tokens_rise_and_locks_survive_a_restart_with_aof_always() {
    restart_with_aof(Mode::AofAlways).await;
}

#[tokio::test]
async fn tokens_rise_across_a_restart_with_aof_everysec() {
    restart_with_aof(Mode::AofEverySec).await;
}

/// The conformance case for durable stores, on a private AOF server it can
/// restart (the shared server keeps nothing on disk, so there it is skipped).
#[test]
fn conformance_restart_case_on_a_durable_server() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let server = Arc::new(PrivateRedis::start(Mode::AofAlways).await.unwrap());
        let h = RedisHarness::on_private(server);
        let outcome = fenced_conformance::run_case(&h, "c07_tokens_increase_after_restart").await;
        assert_eq!(outcome, Ok(fenced_conformance::Outcome::Passed));
    });
}

#[tokio::test]
async fn persistence_is_detected() {
    let server = PrivateRedis::start(Mode::NoPersistence).await.unwrap();
    let mut admin = server.admin().await;
    let url = url_for(&server.url(), "detect");
    let set = |conn: &mut redis::aio::MultiplexedConnection, k: &str, v: &str| {
        let mut c = conn.clone();
        let (k, v) = (k.to_owned(), v.to_owned());
        async move {
            redis::cmd("CONFIG")
                .arg("SET")
                .arg(k)
                .arg(v)
                .query_async::<()>(&mut c)
                .await
                .unwrap()
        }
    };
    assert_eq!(
        RedisLock::connect(&url).await.unwrap().persistence(),
        &Persistence::None
    );
    set(&mut admin, "save", "3600 1").await;
    assert_eq!(
        RedisLock::connect(&url).await.unwrap().persistence(),
        &Persistence::Snapshots {
            save: "3600 1".into()
        }
    );
    set(&mut admin, "appendonly", "yes").await;
    let lock = RedisLock::connect(&url).await.unwrap();
    assert!(
        !lock.capabilities().is_durable(),
        "{:?}",
        lock.persistence()
    );
    set(&mut admin, "appendfsync", "always").await;
    let lock = RedisLock::connect(&url).await.unwrap();
    assert!(lock.capabilities().is_durable(), "{:?}", lock.persistence());
    // CONFIG renamed away: nothing is assumed to survive, and locking works.
    set(&mut admin, "appendfsync", "everysec").await;
    redis::cmd("ACL")
        .arg("SETUSER")
        .arg("default")
        .arg("-config")
        .query_async::<()>(&mut admin)
        .await
        .unwrap();
    let lock = RedisLock::connect(&url).await.unwrap();
    assert!(
        matches!(lock.persistence(), Persistence::Unknown { .. }),
        "{:?}",
        lock.persistence()
    );
    assert!(!lock.capabilities().is_durable());
    let k = key("noconfig");
    let l = lock
        .try_acquire(&k, &opts(Duration::from_secs(5)))
        .await
        .unwrap()
        .unwrap();
    lock.release(&l).await.unwrap();
}
