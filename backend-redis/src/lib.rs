//! Redis backend of [fenced](https://docs.rs/fenced): leases taken and
//! checked by Lua scripts, fencing tokens from the server's clock, waiters
//! served first come, first served from a queue on the server, the key
//! handed over by pub/sub. Tested on Redis 7.0; needs Redis 6 or later (RESP3).
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
//! efficiency lock — one round trip per acquire, hand-over by message. For a
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
//! * **No multi-shard Redis Cluster.** This crate connects to a single node
//!   and never follows a cluster redirection. A standalone server, or a
//!   cluster with one shard (pointed at its primary), works. In a cluster of
//!   several shards, a lock whose hash slot another shard serves fails at
//!   once with [`Error::Config`](fenced_api::Error::Config) naming this
//!   limitation (the node's `MOVED` / `ASK` reply), never with a retryable
//!   error. Hand-over is not cluster-safe either: it relies on `PUBLISH`
//!   counting the receivers of a waiter's channel, and a cluster node counts
//!   only its own subscribers, so a waiter connected to another node would
//!   be skipped as dead.
//!
//! Need locks that survive any single failure? Use etcd.
//!
//! # Design
//!
//! Each lock key has two Redis keys sharing one hash tag, `{prefix/key}`:
//! the state (`:l`, one string: last token, hold count, lease expiry on the
//! **server's** clock, whether waiters may be queued, the waiter the lease
//! was handed to, the holder — its owner and, after a newline, its
//! [`Label`](fenced_api::Label) if it gave one: neither can contain a
//! newline; a re-entry keeps the first entry's label) and the waiter queue
//! (`:q`, a zset in arrival order, each entry carrying the waiter's owner
//! and label the same way). The tag puts both in one cluster slot, so every
//! script touches one key slot — but this crate connects to a single node and does not
//! follow redirections: a **multi-shard Redis Cluster is not supported**
//! (see above; a key on another shard is a configuration error). Use a
//! standalone server, or a single-shard cluster through its primary. Keys
//! are byte-exact; no name is ever used as a pattern. Each client
//! ([`RedisLock`] instance) also has a wake-up channel, `{prefix/}:w:<id>`.
//!
//! The scripts in `scripts/*.lua` (each is `prelude.lua`, which defines the
//! state format and the hand-over, followed by its own file) do every step
//! atomically. They are loaded with `SCRIPT LOAD`, run with EVALSHA, and
//! reloaded when the server answers NOSCRIPT after a restart or
//! `SCRIPT FLUSH`:
//!
//! * **acquire** grants a free key, re-enters it for the same owner when the
//!   options say reentrant (the count goes up, the token stays, the expiry is
//!   never shortened), answers "already held" to the same owner otherwise, and
//!   queues the caller when it may wait;
//! * **extend** and **release** act only when owner **and** token match and
//!   the lease is current, and never create a lock: after a restart that lost
//!   the key, `extend` reports the lease lost rather than taking the key again;
//! * **release** hands the key to the first live waiter, if any.
//!
//! The common path is two round trips and eight commands counted by
//! `INFO commandstats`: EVALSHA, GET, TIME and SET to acquire, the same to
//! release. Nothing else is touched while nobody waits: no counter key, no
//! queue, no message, no configuration check (persistence is read once, at
//! connect: [`RedisLock::persistence`] and
//! [`Capabilities::is_durable`](fenced_api::Capabilities::is_durable) describe
//! the server as it was configured then; a later `CONFIG SET appendonly …`,
//! or a restart with another configuration, is seen by the next
//! [`RedisLock::connect`], not by a running client).
//!
//! **Fencing tokens** are `max(last token + 1, server time in µs)`, computed
//! in the scripts from Redis `TIME`. The last token, kept in the state
//! string while the key is free, keeps them strictly rising while Redis keeps
//! its data (clock steps back included); the clock keeps them rising when
//! Redis loses it — a restart without persistence resets every key to
//! nothing, and the next grant is still above every earlier one because
//! time has moved on. Tokens look like timestamps (about 1.8 × 10¹⁵ in 2026)
//! and stay below 2⁵³ until the year 2255. The limit: if a Redis that lost
//! its data also comes back with a clock set *earlier* than the last grant
//! before the loss (a restored VM, a failover to a host whose clock lags), a
//! token can repeat an old value. A resource that has seen a higher token
//! then rejects the new holder's writes (it fails closed); only a token equal
//! to the highest one seen is indistinguishable from its earlier holder. The
//! state of an idle key is forgotten seven days after its last change, which
//! only matters for a clock that steps back further than that.
//!
//! **Waiting** ([`DistributedLock::acquire`](fenced_api::DistributedLock::acquire))
//! is first come, first served across processes (`fifo: true`). A waiter
//! that finds the key held queues itself: an entry in the key's queue,
//! ordered by its arrival on the server's clock, naming its wake-up channel
//! and carrying a liveness deadline. The release of a key with live waiters
//! does not free it: in the same script it grants the key to the first live
//! entry (a new token, the waiter's TTL) and publishes the grant on that
//! waiter's channel, which the client routes to the waiting future — the
//! waiter sends no further command. So nobody barges past the queue (a plain
//! `try_acquire` of a key with live waiters gets `None`; a releasing task
//! that asks again queues behind the others), a hand-over costs one message,
//! and a contended acquisition costs two scripts (the release, and the
//! queued attempt of the next waiter) — about ten commands counting those
//! run inside the scripts.
//!
//! Entries of waiters that are gone do not hold the queue up: a waiter that
//! gives up (timeout, dropped future) removes its entry, and passes on a
//! lease handed to it meanwhile; a grant that reaches a client whose waiter
//! is gone is passed on by that client; an entry whose channel has no
//! listener (the process died, its connection closed) is skipped at once,
//! since `PUBLISH` counts the receivers; and an entry whose deadline passed
//! (a frozen or partitioned process) is skipped. A waiter refreshes its
//! entry, keeping its place, at least every `recheck_interval` (default
//! 1 s); the entry lapses after three missed refreshes plus a second.
//! One script drops at most 64 dead entries (its run time stays bounded): a
//! release that meets more leaves the key **free but queued**, and nobody
//! holds it until the next acquire attempt — a live waiter's re-check, at
//! most `recheck_interval` later, or anyone's `try_acquire` (which clears
//! up to 64 more and gets `None`: it never barges) — drops the next 64 and
//! hands the key on. A backlog of dead entries (many waiting processes
//! killed at once) thus leaves the key unheld for up to one re-check
//! interval per 64 entries; no lock is ever granted twice by it. The
//! residual risk: a process that freezes with its connection open after its
//! last refresh and before its entry lapses can be handed the key, which
//! then stays with it until the TTL — as for a holder that freezes. When a
//! holder's lease runs out (no message is sent on expiry), the waiters look
//! again at its expiry and the first to look hands the key to the head.
//!
//! A handed-over lease counts from the send time of the waiter's last queued
//! attempt (the grant came later, so the server's expiry is never earlier);
//! if that leaves less than half the TTL, the waiter renews it once before
//! returning it.
//!
//! **Connection loss**: the connection reconnects by itself and re-subscribes;
//! every waiter checks again (a grant sent meanwhile is found by its next
//! attempt; an entry dropped while nobody listened is queued again at its
//! old place). A held lease is renewed on the new connection if it is still
//! ours; otherwise `extend` returns `LeaseLost`. A reply lost after the
//! server applied an acquire leaves a lock nobody renews; it expires after
//! its TTL.
//!
//! **Upgrading** from a version before the FIFO queue: the state key changed
//! from a hash to a string under the same name, so old and new clients on
//! one key fail loudly (`WRONGTYPE`) rather than both granting it; do not
//! mix them on a live key.
#![forbid(unsafe_code)]
#![warn(missing_docs, missing_debug_implementations, unreachable_pub)]

mod config;
mod error;
pub mod fence;
mod keys;
mod list;
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
