//! Redis backend of [fenced](https://docs.rs/fenced): leases taken and
//! checked by Lua scripts, fencing tokens from the server's clock, waiters
//! woken by pub/sub. Tested on Redis 7.0; needs Redis 6 or later (RESP3).
//!
//! ```no_run
//! use std::{sync::Arc, time::Duration};
//! use fenced_api::LockClient;
//! use fenced_redis::RedisLock;
//!
//! # async fn run() -> fenced_api::Result<()> {
//! let store = RedisLock::connect("redis://cache.internal:6379/0?prefix=billing").await?;
//! if !store.persistence().is_durable() {
//!     // A restart of this Redis forgets held locks: fine for efficiency locks only.
//!     tracing::warn!(persistence = %store.persistence(), "locks do not survive a redis restart");
//! }
//! let client = LockClient::builder(Arc::new(store)).ttl(Duration::from_secs(30)).build()?;
//! let guard = client.acquire("invoice:1001").await?;
//! // … UPDATE invoices SET …, fence = ? WHERE id = 1001 AND fence <= ?   (guard.token())
//! guard.release().await?;
//! # Ok(()) }
//! ```
//!
//! # When Redis is the right choice, and when it is not
//!
//! The source articles compare the usual stores like this:
//!
//! | store | for | against |
//! |---|---|---|
//! | database (`fenced-mysql`) | simple, strongly consistent, no extra component | slow, holds connections, replicas complicate it |
//! | **Redis** (this crate) | fast, mature pattern (Redisson) | needs renewal; a primary/replica failover can lose locks; the Redlock controversy |
//! | ZooKeeper / etcd (`fenced-etcd`) | consensus, strongly consistent | slower, a cluster to run |
//!
//! Kleppmann's distinction decides it. An **efficiency** lock stops work
//! being done twice (two nodes refreshing one cache, sending one e-mail
//! twice): an occasional double grant costs a little. A **correctness** lock
//! protects data: a double grant corrupts it. One Redis primary is a good
//! efficiency lock — one round trip per acquire, hand-off by message. For a
//! correctness lock, Redis is safe only with the protected resource checking
//! the fencing token, and even then these limits stay:
//!
//! * **No persistence, no locks across restarts.** Without `appendonly yes`
//!   a restart of Redis forgets every held lock, and another client can take
//!   it at once; the old holder learns at its next renewal
//!   ([`Error::LeaseLost`](fenced_api::Error::LeaseLost)). [`RedisLock::persistence`]
//!   reports what the server keeps, and
//!   [`Capabilities::is_durable`](fenced_api::Capabilities::is_durable) is true only
//!   with `appendfsync always`.
//! * **Failover loses locks.** Replication is asynchronous: a grant the
//!   primary acknowledged may never reach the replica that is promoted. Point
//!   this crate at the primary only (on a replica every acquire fails with a
//!   configuration error); with Sentinel, expect a lost lock per failover. Fencing tokens
//!   come from the promoted server's clock, so they keep rising when its
//!   clock agrees with the old primary's.
//! * **Expiry follows the Redis host's wall clock.** A clock jumping forward
//!   expires leases early. Run NTP in slewing mode on Redis hosts.
//!
//! Need locks that survive any single failure? Use etcd.
//!
//! # Design
//!
//! Each lock key has four Redis names sharing one hash tag, `{prefix/key}`:
//! the lock hash (`:l`: owner, token, hold count; the lease is its `PX`
//! expiry, kept by the **server's** clock), the fence (`:f`: the last token),
//! the waiter queue (`:q`) and a release channel (`:c`). In a Redis Cluster
//! the tag puts them in one slot, so every script touches one node — this
//! crate connects to a single node, though: point it at the primary of the
//! shard, or use a standalone server. Keys are byte-exact; no name is ever
//! used as a pattern.
//!
//! The scripts in `scripts/*.lua` do every step atomically (loaded with
//! `SCRIPT LOAD`, run with EVALSHA, reloaded when the server answers NOSCRIPT
//! after a restart or `SCRIPT FLUSH`):
//!
//! * **acquire** grants a free key, re-enters it for the same owner when the
//!   options say reentrant (the count goes up, the token stays, the expiry is
//!   never shortened), answers "already held" to the same owner otherwise, and
//!   queues the caller as a waiter when it may wait;
//! * **extend** and **release** act only when owner **and** token match, and
//!   never create a lock: after a restart that lost the key, `extend` reports
//!   the lease lost rather than taking the key again;
//! * **release** publishes the id of one live waiter on the key's channel.
//!
//! **Fencing tokens** are `max(last token + 1, server time in µs)`, computed
//! in the acquire script from Redis `TIME`. The stored last token keeps them
//! strictly rising while Redis keeps its data (clock steps back included);
//! the clock keeps them rising when Redis loses it — a restart without
//! persistence resets every counter to nothing, and the next grant is still
//! above every earlier one because time has moved on. Tokens look like
//! timestamps (about 1.8 × 10¹⁵ in 2026) and stay below 2⁵³ until the year
//! 2255. The limit: if a Redis that lost its data also comes back with a
//! clock set *earlier* than the last grant before the loss (a restored VM, a
//! failover to a host whose clock lags), a token can repeat an old value.
//! A resource that has seen a higher token then rejects the new holder's
//! writes (it fails closed); only a token equal to the highest one seen is
//! indistinguishable from its earlier holder. The last token of an idle key
//! is forgotten after seven days, which only matters for a clock that steps
//! back further than that.
//!
//! **Waiting** ([`DistributedLock::acquire`](fenced_api::DistributedLock::acquire)):
//! a waiter subscribes to the key's channel (one subscription per client and
//! key, shared by its waiters) and queues itself; a release wakes exactly
//! one waiter, so a contended hand-off costs about three commands (the
//! waiter's queued try, the release, the woken try) whatever the number of
//! waiters. As a fallback a waiter looks again when the holder's lease ends
//! (no message is sent on expiry) and at most every `recheck_interval`
//! (default 250 ms) — bounded, never a tight loop. Waiters are not served in
//! strict arrival order (`fifo: false`).
//!
//! **Connection loss**: the connection reconnects by itself and re-subscribes;
//! every waiter checks again. A held lease is renewed on the new connection if
//! it is still ours; otherwise `extend` returns `LeaseLost`. A reply lost
//! after the server applied an acquire leaves a lock nobody renews; it
//! expires after its TTL.
#![forbid(unsafe_code)]
#![warn(missing_docs, missing_debug_implementations, unreachable_pub)]

mod config;
mod error;
mod keys;
mod lock;
mod persistence;
mod scripts;
mod wait;

pub use config::{
    Prefix, RedisConfig, DEFAULT_CONNECT_TIMEOUT, DEFAULT_OPERATION_TIMEOUT, DEFAULT_PREFIX,
    DEFAULT_RECHECK_INTERVAL,
};
pub use lock::{RedisLock, RedisLockBuilder};
pub use persistence::Persistence;
pub use redis;

/// URL schemes this backend serves.
pub const SCHEMES: &[&str] = &["redis", "rediss"];

/// This backend's entry for the `fenced::connect(url)` registry.
pub fn driver() -> fenced_api::Driver {
    fenced_api::Driver {
        name: "redis",
        schemes: SCHEMES,
        connect: |url| {
            Box::pin(async move {
                let lock = RedisLock::connect(&url).await?;
                Ok(std::sync::Arc::new(lock) as std::sync::Arc<dyn fenced_api::DistributedLock>)
            })
        },
        // Redis needs no schema.
        migrate: None,
    }
}

/// Compile-time checks that the public types can cross threads and tasks.
#[allow(dead_code)]
fn _assert_send_sync() {
    fn ok<T: Send + Sync + 'static>() {}
    ok::<RedisLock>();
    ok::<RedisLockBuilder>();
    ok::<RedisConfig>();
    ok::<Persistence>();
}
