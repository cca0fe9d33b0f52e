//! `redis+sentinel://`: the primary is found through Sentinel, and followed
//! when Sentinel promotes a replica. A private primary, its replica and one
//! sentinel (quorum 1, down after 500 ms) on loopback ports; the primary is
//! SIGKILLed and left down.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::{Duration, Instant};

use common::{
    key, opts,
    private::{Mode, PrivateRedis},
};
use fenced_api::{DistributedLock, Error, Lease, LockKey, LockOptions, ReleaseOutcome};
use fenced_redis::{redis, RedisLock};
use fenced_testkit::private::PrivateSentinel;

/// Until `f` is true, polling every 100 ms; panics with `what` after `limit`.
async fn until<F, Fut>(limit: Duration, what: &str, mut f: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let start = Instant::now();
    while !f().await {
        assert!(start.elapsed() < limit, "{what} (waited {limit:?})");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn info(server: &PrivateRedis) -> String {
    let mut admin = server.admin().await;
    redis::cmd("INFO")
        .arg("replication")
        .query_async(&mut admin)
        .await
        .unwrap_or_default()
}

/// A sentinel-led primary and replica, and the sentinel, ready to fail over
/// (the sentinel has found the replica).
async fn setup() -> (PrivateRedis, PrivateRedis, PrivateSentinel) {
    let primary = PrivateRedis::start(Mode::NoPersistence).await.unwrap();
    let replica = PrivateRedis::start_replica_of(&primary).await.unwrap();
    until(
        Duration::from_secs(20),
        "the replica never synced",
        || async { info(&replica).await.contains("master_link_status:up") },
    )
    .await;
    let sentinel = PrivateSentinel::start(primary.port()).await.unwrap();
    let admin = sentinel.admin().await.unwrap();
    let replica_port = replica.port().to_string();
    until(
        Duration::from_secs(30),
        "the sentinel never found the replica",
        || {
            let mut admin = admin.clone();
            let replica_port = replica_port.clone();
            async move {
                let replicas: redis::Value = redis::cmd("SENTINEL")
                    .arg("REPLICAS")
                    .arg(PrivateSentinel::MASTER)
                    .query_async(&mut admin)
                    .await
                    .unwrap_or(redis::Value::Nil);
                format!("{replicas:?}").contains(&replica_port)
            }
        },
    )
    .await;
    (primary, replica, sentinel)
}

/// `try_acquire`, retried while the store says "try again" (the failover).
async fn try_acquire_through(lock: &RedisLock, k: &LockKey, limit: Duration) -> Lease {
    let start = Instant::now();
    loop {
        match lock.try_acquire(k, &opts(Duration::from_secs(30))).await {
            Ok(Some(lease)) => return lease,
            Ok(None) => panic!("{k} is held"),
            Err(e) if e.is_retryable() => {
                assert!(
                    start.elapsed() < limit,
                    "no grant within {limit:?} of the failover: {e}"
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => panic!("not retryable during a failover: {e}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_follow_sentinel_to_the_promoted_replica() {
    let (primary, replica, sentinel) = setup().await;
    // A long re-check interval: a hand-over after the failover must come by
    // message, on a subscription made again on the new primary.
    let url = format!(
        "{}?prefix=sent&connect_timeout=2s&operation_timeout=1s&recheck_interval=10s",
        sentinel.url()
    );
    let a = RedisLock::connect(&url).await.unwrap();
    let b = RedisLock::connect(&url).await.unwrap();
    assert!(a.config().display_url().starts_with("redis+sentinel://"));

    // Before: grants on the primary; b subscribed there (it waited once).
    let k = key("sent");
    let before = a
        .try_acquire(&k, &opts(Duration::from_secs(30)))
        .await
        .unwrap()
        .expect("free key");
    let waiting = LockOptions::builder()
        .ttl(Duration::from_secs(30))
        .wait_timeout(Duration::from_millis(300))
        .build()
        .unwrap();
    assert!(matches!(
        b.acquire(&k, &waiting).await,
        Err(Error::Timeout { .. })
    ));

    primary.kill();
    until(
        Duration::from_secs(30),
        "the sentinel never promoted the replica",
        || async { info(&replica).await.contains("role:master") },
    )
    .await;

    // After: both clients reach the new primary.
    let k2 = key("sent-after");
    let held = try_acquire_through(&a, &k2, Duration::from_secs(20)).await;
    assert!(
        held.token > before.token,
        "tokens keep rising across the failover: {} after {}",
        held.token,
        before.token
    );
    let mut on_replica = replica.admin().await;
    let state: Option<String> = redis::cmd("GET")
        .arg(format!("{{sent/{k2}}}:l"))
        .query_async(&mut on_replica)
        .await
        .unwrap();
    assert!(
        state.is_some_and(|s| s.starts_with(&held.token.get().to_string())),
        "the grant is on the promoted replica"
    );
    let probe = try_acquire_through(&b, &key("sent-probe"), Duration::from_secs(20)).await;
    b.release(&probe).await.unwrap();

    // A hand-over on the new primary reaches b by message.
    let waiter = {
        let b = b.clone();
        let k2 = k2.clone();
        tokio::spawn(async move {
            let long = LockOptions::builder()
                .ttl(Duration::from_secs(30))
                .wait_timeout(Duration::from_secs(8))
                .build()
                .unwrap();
            b.acquire(&k2, &long).await
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    let released = Instant::now();
    assert_eq!(a.release(&held).await.unwrap(), ReleaseOutcome::Released);
    let next = waiter.await.unwrap().unwrap();
    assert!(
        released.elapsed() < Duration::from_secs(3),
        "the hand-over took {:?}: no message reached the waiter (re-check is 10 s)",
        released.elapsed()
    );
    assert!(next.token > held.token);
    b.release(&next).await.unwrap();
}

#[tokio::test]
async fn sentinel_urls_are_checked_before_connecting() {
    for bad in [
        "redis+sentinel://127.0.0.1:1",
        "redis+sentinel://127.0.0.1:1/",
        "redis+sentinel://127.0.0.1:x/mymaster",
        "redis+sentinel://127.0.0.1:1,/mymaster",
        "redis+sentinel://127.0.0.1:1/my master",
        "redis+sentinel://127.0.0.1:1/mymaster/0/extra",
        "redis+sentinel://127.0.0.1:1/mymaster?nope=1",
        "rediss+sentinel://127.0.0.1:1/mymaster",
    ] {
        match RedisLock::connect(bad).await {
            Err(Error::Config { .. }) => {}
            other => panic!("{bad}: {other:?}"),
        }
    }
    // No sentinel answers: a retryable error naming the sentinels, in time.
    let start = Instant::now();
    let e = RedisLock::connect("redis+sentinel://127.0.0.1:1/mymaster?connect_timeout=1s")
        .await
        .unwrap_err();
    assert!(e.is_retryable(), "{e}");
    assert!(start.elapsed() < Duration::from_secs(5));
}

/// A TCP forwarder on a free loopback port to `to`; counts the connections
/// it took.
async fn forwarder(to: u16) -> (u16, std::sync::Arc<std::sync::atomic::AtomicUsize>) {
    use std::sync::{atomic::AtomicUsize, atomic::Ordering, Arc};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let taken = Arc::new(AtomicUsize::new(0));
    let count = Arc::clone(&taken);
    tokio::spawn(async move {
        while let Ok((mut inbound, _)) = listener.accept().await {
            count.fetch_add(1, Ordering::SeqCst);
            tokio::spawn(async move {
                if let Ok(mut outbound) = tokio::net::TcpStream::connect(("127.0.0.1", to)).await {
                    let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                }
            });
        }
    });
    (port, taken)
}

/// `address_map` applies to the primary the sentinels name: its check and
/// its connection both go to the mapped address. A map to a port where
/// nothing listens is a retryable error naming that port; a wrong primary
/// name is one naming the name.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn address_map_sends_the_primary_connections_where_it_says() {
    let (primary, _replica, sentinel) = setup().await;
    let (via, taken) = forwarder(primary.port()).await;
    let url = format!(
        "{}?prefix=sentmap&connect_timeout=2s&address_map=127.0.0.1:{}>127.0.0.1:{via}",
        sentinel.url(),
        primary.port()
    );
    let lock = RedisLock::connect(&url).await.unwrap();
    let lease = lock
        .try_acquire(&key("sentmap"), &opts(Duration::from_secs(30)))
        .await
        .unwrap()
        .expect("free key");
    assert_eq!(
        lock.release(&lease).await.unwrap(),
        ReleaseOutcome::Released
    );
    let through = taken.load(std::sync::atomic::Ordering::SeqCst);
    assert!(
        through >= 2,
        "the role check and the connection go through the mapped address: {through} connections"
    );

    // Nothing listens where the map points.
    let dead = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let dead_port = dead.local_addr().unwrap().port();
    drop(dead);
    let url = format!(
        "{}?connect_timeout=2s&address_map=127.0.0.1:{}>127.0.0.1:{dead_port}",
        sentinel.url(),
        primary.port()
    );
    let e = RedisLock::connect(&url).await.unwrap_err();
    assert!(e.is_retryable(), "{e}");
    assert!(
        e.to_string()
            .contains(&format!("(reached at 127.0.0.1:{dead_port}), unreachable")),
        "{e}"
    );

    // A map that does not list the primary: never connected to as named.
    let url = format!(
        "{}?connect_timeout=2s&address_map=127.0.0.1:1>127.0.0.1:{via}",
        sentinel.url()
    );
    let e = RedisLock::connect(&url).await.unwrap_err();
    assert!(e.is_retryable(), "{e}");
    assert!(
        e.to_string().contains(&format!(
            "named 127.0.0.1:{}, which address_map does not list",
            primary.port()
        )),
        "{e}"
    );

    // Credentials the primary refuses: an error no retry mends.
    let url = sentinel
        .url()
        .replace("redis+sentinel://", "redis+sentinel://someone:wrong@")
        + "?connect_timeout=2s";
    let e = RedisLock::connect(&url).await.unwrap_err();
    assert!(!e.is_retryable(), "{e}");
    assert!(e.to_string().contains("refused the credentials"), "{e}");

    // A name the sentinel does not monitor.
    let url = sentinel.url().replace("/mymaster", "/nosuchname") + "?connect_timeout=2s";
    let e = RedisLock::connect(&url).await.unwrap_err();
    assert!(e.is_retryable(), "{e}");
    assert!(
        e.to_string().contains("knows no primary `nosuchname`"),
        "{e}"
    );
}
