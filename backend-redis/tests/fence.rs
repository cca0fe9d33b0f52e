//! `fence::set` on the shared Redis: a value is written only with a token at
//! least the highest seen, stale writes change nothing and report the
//! highest, tokens compare exactly over all of `u64`, and the fence outlives
//! an expiring value. Each test uses keys of its own (random names) and
//! deletes them.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::Duration;

use common::{run_prefix, server_url, url_for};
use fenced_api::{DistributedLock, Error, FencingToken, LockKey, LockOptions};
use fenced_redis::{
    fence::{self, FenceOutcome, FencedValue},
    redis::{self, aio::MultiplexedConnection, AsyncCommands},
    RedisLock,
};

fn tok(t: u64) -> FencingToken {
    FencingToken::new(t)
}

async fn conn() -> MultiplexedConnection {
    redis::Client::open(server_url().await)
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap()
}

fn fresh_key(tag: &str) -> String {
    format!(
        "{}/fence/{tag}/{}",
        run_prefix(),
        &uuid::Uuid::new_v4().simple().to_string()[..12]
    )
}

async fn cleanup(c: &mut MultiplexedConnection, keys: &[&str]) {
    for k in keys {
        let _: () = c.del(&[*k, &fence::fence_key(k).unwrap()]).await.unwrap();
    }
}

async fn value(c: &mut MultiplexedConnection, key: &str) -> Option<String> {
    c.get(key).await.unwrap()
}

#[tokio::test]
async fn a_current_token_is_accepted_and_its_write_lands() {
    let mut c = conn().await;
    let k = fresh_key("current");
    assert_eq!(
        fence::set(&mut c, &k, "five", tok(5)).await.unwrap(),
        FenceOutcome::Accepted
    );
    assert_eq!(value(&mut c, &k).await.as_deref(), Some("five"));
    assert_eq!(
        fence::set(&mut c, &k, "six", tok(6)).await.unwrap(),
        FenceOutcome::Accepted
    );
    assert_eq!(
        fence::get(&mut c, &k).await.unwrap(),
        Some(FencedValue {
            value: b"six".to_vec(),
            token: tok(6)
        })
    );
    assert_eq!(fence::highest(&mut c, &k).await.unwrap(), Some(tok(6)));
    cleanup(&mut c, &[&k]).await;
}

#[tokio::test]
async fn a_stale_token_is_refused_and_writes_nothing() {
    let mut c = conn().await;
    let k = fresh_key("stale");
    assert!(fence::set(&mut c, &k, "new holder", tok(7))
        .await
        .unwrap()
        .is_accepted());
    assert_eq!(
        fence::set(&mut c, &k, "paused ex-holder", tok(5))
            .await
            .unwrap(),
        FenceOutcome::Stale { highest: tok(7) }
    );
    assert_eq!(value(&mut c, &k).await.as_deref(), Some("new holder"));
    assert_eq!(fence::highest(&mut c, &k).await.unwrap(), Some(tok(7)));
    // A stale write with a ttl does not touch the value's expiry either.
    let late = fence::set_with_ttl(&mut c, &k, "x", tok(6), Duration::from_millis(50)).await;
    assert!(!late.unwrap().is_accepted());
    let pttl: i64 = c.pttl(&k).await.unwrap();
    assert_eq!(pttl, -1, "the value kept no expiry");
    cleanup(&mut c, &[&k]).await;
}

#[tokio::test]
async fn an_equal_token_is_accepted_for_the_same_holder_writing_twice() {
    let mut c = conn().await;
    let k = fresh_key("equal");
    assert!(fence::set(&mut c, &k, "first", tok(4))
        .await
        .unwrap()
        .is_accepted());
    assert!(fence::set(&mut c, &k, "second", tok(4))
        .await
        .unwrap()
        .is_accepted());
    assert_eq!(value(&mut c, &k).await.as_deref(), Some("second"));
    cleanup(&mut c, &[&k]).await;
}

/// Any token is accepted for a new key, and tokens compare as integers over
/// all of u64 — past 2^53, where Lua's doubles stop being exact, and across
/// digit counts, where string order is not number order.
#[tokio::test]
async fn tokens_compare_exactly_over_all_of_u64() {
    let mut c = conn().await;
    let one = fresh_key("one");
    assert!(fence::set(&mut c, &one, "v", tok(1))
        .await
        .unwrap()
        .is_accepted());
    let max = fresh_key("max");
    assert!(fence::set(&mut c, &max, "v", tok(u64::MAX))
        .await
        .unwrap()
        .is_accepted());
    assert_eq!(
        fence::highest(&mut c, &max).await.unwrap(),
        Some(tok(u64::MAX))
    );
    let below_max = fence::set(&mut c, &max, "v", tok(u64::MAX - 1)).await;
    assert!(!below_max.unwrap().is_accepted());

    let cases: [(u64, u64); 4] = [
        (10, 9),
        (100, 99),
        ((1 << 53) + 1, 1 << 53),
        (u64::MAX, u64::MAX - 1),
    ];
    let mut keys = vec![one.clone(), max.clone()];
    for (high, low) in cases {
        let k = fresh_key("order");
        assert!(fence::set(&mut c, &k, "high", tok(high))
            .await
            .unwrap()
            .is_accepted());
        assert_eq!(
            fence::set(&mut c, &k, "low", tok(low)).await.unwrap(),
            FenceOutcome::Stale { highest: tok(high) },
            "{low} after {high}"
        );
        assert_eq!(value(&mut c, &k).await.as_deref(), Some("high"));
        // And upwards across the same boundary.
        let up = fresh_key("up");
        assert!(fence::set(&mut c, &up, "low", tok(low))
            .await
            .unwrap()
            .is_accepted());
        assert!(fence::set(&mut c, &up, "high", tok(high))
            .await
            .unwrap()
            .is_accepted());
        keys.extend([k, up]);
    }
    let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
    cleanup(&mut c, &keys).await;
}

/// Many writers at once, each on its own connection, with scrambled tokens:
/// the highest token's value stays and every refusal names a higher token.
#[tokio::test]
async fn concurrent_writers_end_with_the_highest_tokens_write() {
    let k = fresh_key("race");
    let mut tokens: Vec<u64> = (1..=24).collect();
    tokens.sort_by_key(|t| (t * 7) % 24);
    let mut tasks = Vec::new();
    for &t in &tokens {
        let mut c = conn().await;
        let k = k.clone();
        tasks.push(tokio::spawn(async move {
            (
                t,
                fence::set(&mut c, &k, t.to_string(), tok(t)).await.unwrap(),
            )
        }));
    }
    for task in tasks {
        let (t, outcome) = task.await.unwrap();
        if let FenceOutcome::Stale { highest } = outcome {
            assert!(highest.get() > t, "{t} refused by {highest}");
        }
    }
    let mut c = conn().await;
    assert_eq!(value(&mut c, &k).await.as_deref(), Some("24"));
    assert_eq!(fence::highest(&mut c, &k).await.unwrap(), Some(tok(24)));
    // The late write the fence exists for, once more after the race.
    assert!(fence::set(&mut c, &k, "next", tok(25))
        .await
        .unwrap()
        .is_accepted());
    assert_eq!(
        fence::set(&mut c, &k, "late", tok(24)).await.unwrap(),
        FenceOutcome::Stale { highest: tok(25) }
    );
    assert_eq!(value(&mut c, &k).await.as_deref(), Some("next"));
    cleanup(&mut c, &[&k]).await;
}

/// The value may expire; the fence must not, or a stale holder could write
/// again once the value is gone.
#[tokio::test]
async fn the_fence_outlives_an_expiring_value() {
    let mut c = conn().await;
    let k = fresh_key("ttl");
    assert!(
        fence::set_with_ttl(&mut c, &k, "v", tok(9), Duration::from_millis(300))
            .await
            .unwrap()
            .is_accepted()
    );
    // The expiry itself is read on a key with a long TTL: a stalled
    // machine cannot let it run out between the two round trips.
    let long = fresh_key("ttl-long");
    assert!(
        fence::set_with_ttl(&mut c, &long, "v", tok(9), Duration::from_secs(60))
            .await
            .unwrap()
            .is_accepted()
    );
    let pttl: i64 = c.pttl(&long).await.unwrap();
    assert!((1..=60_000).contains(&pttl), "{pttl}");
    cleanup(&mut c, &[&long]).await;
    let fence_ttl: i64 = c.pttl(fence::fence_key(&k).unwrap()).await.unwrap();
    assert_eq!(fence_ttl, -1, "the fence key has no expiry");
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_eq!(fence::get(&mut c, &k).await.unwrap(), None);
    assert_eq!(
        fence::set(&mut c, &k, "late", tok(8)).await.unwrap(),
        FenceOutcome::Stale { highest: tok(9) }
    );
    assert_eq!(value(&mut c, &k).await, None);
    assert!(fence::set(&mut c, &k, "again", tok(9))
        .await
        .unwrap()
        .is_accepted());
    let pttl: i64 = c.pttl(&k).await.unwrap();
    assert_eq!(pttl, -1);
    cleanup(&mut c, &[&k]).await;
}

#[tokio::test]
async fn bad_input_is_a_clear_error_and_writes_nothing() {
    let mut c = conn().await;
    let k = fresh_key("bad");
    for bad in ["", "a}b", "x{}y"] {
        let e = fence::set(&mut c, bad, "v", tok(1)).await.unwrap_err();
        assert!(matches!(e, Error::InvalidKey { .. }), "{bad:?}: {e}");
    }
    let e = fence::set(&mut c, &k, "v", tok(0)).await.unwrap_err();
    assert!(matches!(e, Error::InvalidOptions { .. }), "{e}");
    assert!(e.to_string().contains("token 0"), "{e}");
    let e = fence::set_with_ttl(&mut c, &k, "v", tok(1), Duration::ZERO)
        .await
        .unwrap_err();
    assert!(matches!(e, Error::InvalidOptions { .. }), "{e}");
    let exists: u32 = c
        .exists(&[k.as_str(), &fence::fence_key(&k).unwrap()])
        .await
        .unwrap();
    assert_eq!(exists, 0, "nothing was written");

    // Something that is not a token under the fence key: refused, value untouched.
    let _: () = c
        .set(fence::fence_key(&k).unwrap(), "not a token")
        .await
        .unwrap();
    let e = fence::set(&mut c, &k, "v", tok(1)).await.unwrap_err();
    assert!(matches!(e, Error::Backend { .. }), "{e}");
    assert!(e.to_string().contains("not a fencing token"), "{e}");
    assert!(fence::highest(&mut c, &k).await.is_err());
    assert_eq!(value(&mut c, &k).await, None);
    // A value written around the fence is reported, not trusted.
    let plain = fresh_key("plain");
    let _: () = c.set(&plain, "unfenced").await.unwrap();
    let e = fence::get(&mut c, &plain).await.unwrap_err();
    assert!(e.to_string().contains("not written by fence::set"), "{e}");
    cleanup(&mut c, &[&k, &plain]).await;
}

/// Tokens from real grants: A's lease expires while it is paused, B is
/// granted a higher token and writes; A's late write is refused.
#[tokio::test]
async fn a_late_write_of_an_expired_holder_is_refused() {
    let url = url_for(&server_url().await, run_prefix());
    let (node_a, node_b) = (
        RedisLock::connect(&url).await.unwrap(),
        RedisLock::connect(&url).await.unwrap(),
    );
    let key = LockKey::new(format!("fence/{}", uuid::Uuid::new_v4().simple())).unwrap();
    let data = fresh_key("grants");
    let mut c = conn().await;
    let short = LockOptions::builder()
        .ttl(Duration::from_millis(300))
        .build()
        .unwrap();
    let a = node_a.try_acquire(&key, &short).await.unwrap().unwrap();
    assert!(fence::set(&mut c, &data, "A", a.token)
        .await
        .unwrap()
        .is_accepted());
    // A pauses past its TTL; B waits and takes over.
    let wait = LockOptions::builder()
        .ttl(Duration::from_secs(30))
        .wait_timeout(Duration::from_secs(10))
        .build()
        .unwrap();
    let b = node_b.acquire(&key, &wait).await.unwrap();
    assert!(b.token > a.token);
    assert!(fence::set(&mut c, &data, "B", b.token)
        .await
        .unwrap()
        .is_accepted());
    assert_eq!(
        fence::set(&mut c, &data, "A, late", a.token).await.unwrap(),
        FenceOutcome::Stale { highest: b.token }
    );
    assert_eq!(value(&mut c, &data).await.as_deref(), Some("B"));
    node_b.release(&b).await.unwrap();
    cleanup(&mut c, &[&data]).await;
}
