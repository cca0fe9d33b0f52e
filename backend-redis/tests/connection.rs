//! Connections: TLS, a killed connection, a server that stops answering,
//! one that never answers. Each on a private `redis-server` or a local socket.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::Duration;

use common::{
    extend_after_reconnect, key, opts,
    private::{Mode, PrivateRedis},
    url_for,
};
use fenced_api::{DistributedLock, Error, LockOptions, ReleaseOutcome};
use fenced_redis::{redis, RedisLock};

#[tokio::test]
async fn a_killed_connection_reconnects_and_renews_its_own_lease() {
    let server = PrivateRedis::start(Mode::NoPersistence).await.unwrap();
    let mut admin = server.admin().await;
    let lock = RedisLock::connect(&url_for(&server.url(), "kill"))
        .await
        .unwrap();
    let k = key("kill");
    let held = lock
        .try_acquire(&k, &opts(Duration::from_secs(30)))
        .await
        .unwrap()
        .unwrap();
    let killed: i64 = redis::cmd("CLIENT")
        .arg("KILL")
        .arg("TYPE")
        .arg("normal")
        .arg("SKIPME")
        .arg("yes")
        .query_async(&mut admin)
        .await
        .unwrap();
    assert!(killed >= 1, "the lock's connection was killed");
    let renewed = extend_after_reconnect(&lock, &held).await.unwrap();
    assert_eq!(renewed.token, held.token);
    assert_eq!(
        lock.release(&renewed).await.unwrap(),
        ReleaseOutcome::Released
    );
}

#[tokio::test]
async fn a_silent_server_fails_within_the_timeouts_and_the_lease_survives() {
    let server = PrivateRedis::start(Mode::NoPersistence).await.unwrap();
    let url = format!(
        "{}?prefix=silent&connect_timeout=1s&operation_timeout=1s",
        server.url()
    );
    let lock = RedisLock::connect(&url).await.unwrap();
    let k = key("silent");
    let held = lock
        .try_acquire(&k, &opts(Duration::from_secs(30)))
        .await
        .unwrap()
        .unwrap();
    server.signal("STOP").await;
    let bound = Duration::from_millis(1800);
    let start = tokio::time::Instant::now();
    let renewal = lock.extend(&held, Duration::from_secs(30)).await;
    assert!(
        matches!(&renewal, Err(e @ Error::Backend { .. }) if e.is_retryable()),
        "{renewal:?}"
    );
    assert!(start.elapsed() < bound, "extend took {:?}", start.elapsed());
    let forever = LockOptions::builder()
        .ttl(Duration::from_secs(5))
        .build()
        .unwrap();
    let start = tokio::time::Instant::now();
    let waited = lock.acquire(&key("silent-other"), &forever).await;
    assert!(
        matches!(&waited, Err(e @ Error::Backend { .. }) if e.is_retryable()),
        "{waited:?}"
    );
    assert!(
        start.elapsed() < bound,
        "acquire took {:?}",
        start.elapsed()
    );
    server.signal("CONT").await;
    // The server kept the lease: the holder renews it once it answers again.
    let renewed = extend_after_reconnect(&lock, &held).await.unwrap();
    assert_eq!(renewed.token, held.token);
    lock.release(&renewed).await.unwrap();
}

#[tokio::test]
async fn a_server_that_never_answers_fails_connect_within_the_timeout() {
    // Accepts TCP connections (the kernel completes the handshake) but never
    // reads or answers: the HELLO of the connection setup goes unanswered.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = silent.local_addr().unwrap().port();
    let start = tokio::time::Instant::now();
    let res = RedisLock::connect(&format!(
        "redis://127.0.0.1:{port}?connect_timeout=1s&operation_timeout=1s"
    ))
    .await;
    let took = start.elapsed();
    match res {
        Err(e @ Error::Backend { .. }) => assert!(e.is_retryable(), "{e}"),
        other => panic!("connecting to a silent server gave {other:?}"),
    }
    assert!(took < Duration::from_millis(2500), "took {took:?}");
    drop(silent);
}

#[tokio::test]
async fn a_replica_is_refused_with_a_configuration_error() {
    let primary = PrivateRedis::start(Mode::NoPersistence).await.unwrap();
    let replica = PrivateRedis::start_replica_of(&primary).await.unwrap();
    let lock = RedisLock::connect(&url_for(&replica.url(), "replica"))
        .await
        .unwrap();
    let k = key("replica");
    match lock.try_acquire(&k, &opts(Duration::from_secs(5))).await {
        Err(Error::Config { reason }) => assert!(reason.contains("replica"), "{reason}"),
        other => panic!("acquire on a replica gave {other:?}"),
    }
}

#[cfg(feature = "tls")]
#[tokio::test]
async fn rediss_urls_speak_tls() {
    let server = PrivateRedis::start_tls().await.unwrap();
    // Self-signed certificate: `#insecure` skips verification (TLS still encrypts).
    let url = server
        .url()
        .replace("/#insecure", "/?prefix=tls&connect_timeout=5s#insecure");
    assert!(url.starts_with("rediss://"), "{url}");
    let (a, b) = (
        RedisLock::connect(&url).await.unwrap(),
        RedisLock::connect(&url).await.unwrap(),
    );
    let k = key("tls");
    let held = a
        .try_acquire(&k, &opts(Duration::from_secs(30)))
        .await
        .unwrap()
        .unwrap();
    let wait = LockOptions::builder()
        .ttl(Duration::from_secs(30))
        .wait_timeout(Duration::from_secs(10))
        .build()
        .unwrap();
    let waiter = {
        let k = k.clone();
        tokio::spawn(async move { b.acquire(&k, &wait).await })
    };
    tokio::time::sleep(Duration::from_millis(200)).await;
    a.release(&held).await.unwrap();
    let next = waiter.await.unwrap().unwrap();
    assert!(next.token > held.token);
    // Without `#insecure` the self-signed certificate is refused: verification is on.
    let verified = server
        .url()
        .replace("/#insecure", "/?connect_timeout=2s&operation_timeout=1s");
    match RedisLock::connect(&verified).await {
        Err(e) => assert!(
            e.to_string().to_lowercase().contains("certificate"),
            "refused for another reason: {e}"
        ),
        Ok(_) => panic!("an untrusted certificate was accepted"),
    }
    // A plain-text client cannot talk to the TLS port.
    let plain = server
        .url()
        .replace("rediss://", "redis://")
        .replace("#insecure", "");
    let refused =
        RedisLock::connect(&format!("{plain}?connect_timeout=1s&operation_timeout=1s")).await;
    assert!(refused.is_err(), "plain text accepted on the TLS port");
}
