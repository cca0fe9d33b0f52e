//! Connections: TLS, a killed connection, a server that stops answering,
//! one that never answers. Each on a private `redis-server` or a local socket.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;
mod on_private;

use std::time::Duration;

use common::{
    extend_after_reconnect, key, opts,
    private::{Mode, PrivateRedis},
    url_for,
};
use fenced_api::{DistributedLock, Error, LockOptions, ReleaseOutcome};
use fenced_redis::{redis, RedisLock};
use on_private::{hold, on_private};

#[tokio::test]
async fn a_killed_connection_reconnects_and_renews_its_own_lease() {
    let (_server, mut admin, lock, k) = on_private("kill").await;
    let held = hold(&lock, &k, Duration::from_secs(30)).await;
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
        "{}?prefix=silent&connect_timeout=1s&operation_timeout=2s",
        server.url()
    );
    let lock = RedisLock::connect(&url).await.unwrap();
    let k = key("silent");
    let held = hold(&lock, &k, Duration::from_secs(30)).await;
    server.signal("STOP").await;
    // One 2 s operation timeout plus room for a loaded machine, and less
    // than two (a retry or a second timed-out step would show); without the
    // timeout these calls would wait for as long as the server sleeps.
    let bound = Duration::from_millis(3500);
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

/// A Redis Cluster of two shards: this crate talks to one node and does not
/// follow redirections. A key whose hash slot that node serves works; a key
/// served by the other shard fails at once with a configuration error naming
/// the limitation (the node's MOVED reply) — never a retryable error that a
/// caller would retry forever, never a hang.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_on_another_cluster_shard_is_a_configuration_error() {
    let a = PrivateRedis::start_cluster_node().await.unwrap();
    let b = PrivateRedis::start_cluster_node().await.unwrap();
    let (mut ca, mut cb) = (a.admin().await, b.admin().await);
    let addslots = |lo: u16, hi: u16| {
        let mut c = redis::cmd("CLUSTER");
        c.arg("ADDSLOTSRANGE").arg(lo).arg(hi);
        c
    };
    let () = addslots(0, 8191).query_async(&mut ca).await.unwrap();
    let () = addslots(8192, 16383).query_async(&mut cb).await.unwrap();
    let () = redis::cmd("CLUSTER")
        .arg("MEET")
        .arg("127.0.0.1")
        .arg(b.port())
        .arg(b.cluster_bus().unwrap())
        .query_async(&mut ca)
        .await
        .unwrap();
    let bound = tokio::time::Instant::now() + Duration::from_secs(30);
    for c in [&mut ca, &mut cb] {
        loop {
            let info: String = redis::cmd("CLUSTER")
                .arg("INFO")
                .query_async(c)
                .await
                .unwrap();
            if info.contains("cluster_state:ok") && info.contains("cluster_known_nodes:2") {
                break;
            }
            assert!(
                tokio::time::Instant::now() < bound,
                "the cluster never formed: {info}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    let prefix = "cluster";
    let lock = RedisLock::connect(&url_for(&a.url(), prefix))
        .await
        .unwrap();
    // One key in a slot of node a, one in a slot of node b (the server says
    // which slot the crate's hash tag `{prefix/key}` maps to).
    let (mut local, mut remote) = (None, None);
    while local.is_none() || remote.is_none() {
        let k = key("slot");
        let slot: u16 = redis::cmd("CLUSTER")
            .arg("KEYSLOT")
            .arg(format!("{{{prefix}/{k}}}:l"))
            .query_async(&mut ca)
            .await
            .unwrap();
        if slot < 8192 {
            local.get_or_insert(k);
        } else {
            remote.get_or_insert(k);
        }
    }
    let (local, remote) = (local.unwrap(), remote.unwrap());
    let o = opts(Duration::from_secs(5));

    let l = lock.try_acquire(&local, &o).await.unwrap().expect("free");
    assert_eq!(lock.release(&l).await.unwrap(), ReleaseOutcome::Released);

    let wait = o
        .to_builder()
        .wait_timeout(Duration::from_secs(5))
        .build()
        .unwrap();
    for (what, got) in [
        (
            "try_acquire",
            lock.try_acquire(&remote, &o).await.map(|_| ()),
        ),
        (
            "acquire",
            tokio::time::timeout(Duration::from_secs(30), lock.acquire(&remote, &wait))
                .await
                .expect("acquire on another shard hung")
                .map(|_| ()),
        ),
        ("inspect", lock.inspect(&remote).await.map(|_| ())),
    ] {
        match got {
            Err(e @ Error::Config { .. }) => {
                assert!(!e.is_retryable(), "{what}: {e}");
                let reason = e.to_string();
                assert!(
                    reason.contains("Redis Cluster") && reason.contains("MOVED"),
                    "{what}: {reason}"
                );
            }
            other => panic!("{what} of a key on another shard gave {other:?}"),
        }
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
    let held = hold(&a, &k, Duration::from_secs(30)).await;
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
    // Without `#insecure` the test CA's certificate is refused: verification is on.
    let verified = server
        .url()
        .replace("/#insecure", "/?connect_timeout=2s&operation_timeout=1s");
    // A configuration error: trying again meets the same certificate.
    match RedisLock::connect(&verified).await {
        Err(e @ Error::Config { .. }) => assert!(
            e.to_string().contains("certificate"),
            "refused for another reason: {e}"
        ),
        other => panic!("an untrusted certificate: {other:?}"),
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

/// A server that demands a client certificate (Redis's default for TLS),
/// which fenced never sends: a configuration error that says what to change,
/// not a retryable one retried until the timeout.
#[cfg(feature = "tls")]
#[tokio::test]
async fn a_server_demanding_client_certificates_is_a_configuration_error() {
    let server = PrivateRedis::start_tls_with_client_certificates()
        .await
        .unwrap();
    let url = server.url().replace(
        "/#insecure",
        "/?connect_timeout=2s&operation_timeout=1s#insecure",
    );
    match RedisLock::connect(&url).await {
        Err(e @ Error::Config { .. }) => {
            assert!(e.to_string().contains("tls-auth-clients"), "{e}")
        }
        other => panic!("a server demanding a client certificate: {other:?}"),
    }
}
