//! etcd backend of [fenced](https://docs.rs/fenced): etcd's own mutex
//! recipe (a line of keys per lock, the oldest one holds, its **create
//! revision** is the fencing token) on **session leases** shared by all the
//! locks of a client, with each lock's own TTL still enforced.
//!
//! ```no_run
//! use std::{sync::Arc, time::Duration};
//! use fenced_api::LockClient;
//! use fenced_etcd::EtcdLock;
//!
//! # async fn run() -> fenced_api::Result<()> {
//! let store = EtcdLock::connect("etcd://10.0.0.1:2379,10.0.0.2:2379,10.0.0.3:2379/billing").await?;
//! let client = LockClient::builder(Arc::new(store)).ttl(Duration::from_secs(10)).build()?;
//! let guard = client.acquire("invoice-run").await?;
//! // write with guard.token(): etcd revisions are global, durable and monotonic
//! guard.release().await?;
//! # Ok(()) }
//! ```
//!
//! # Design
//!
//! An [`EtcdLock`] (and its clones) is one *client*: one gRPC channel, one
//! watch stream, one reaper task, and one session lease per **(client, TTL
//! class)** — not one per client: the locks and queue entries of one client
//! whose TTLs round to the same whole number of seconds share a lease, locks
//! with another TTL are on another lease, and two clients never share one.
//!
//! * **The lock** of `key` is the oldest entry of its line
//!   `<prefix>\0lock\0<key>\0<owner>`, entries ordered by create revision.
//!   Its create revision is the **token**: the oldest entry only ever gets
//!   younger, so tokens strictly increase — across releases, expiries,
//!   force releases and server restarts (revisions are durable). The
//!   entry's value is its owner, then a newline and the holder's
//!   [`Label`](fenced_api::Label) when it gave one (entries written before
//!   labels hold the owner alone and read as unlabelled).
//! * **acquire**, uncontended: one transaction, `If(line empty)
//!   Then(Put(entry, owner and label, session lease))`. Contended: the same
//!   transaction puts the entry at the end of the line and reads who is
//!   ahead; the waiter watches only its predecessor — and its own entry
//!   (module `queue`).
//!   Deleting the holder's entry makes the next one the holder **without a
//!   write**: a waiter that knows its predecessor held the lock (it was the
//!   oldest, or announced its promotion by rewriting its own entry) returns
//!   as soon as the deletion event arrives; otherwise it reads the line once.
//!   Waiters are served in arrival order; a `try_acquire` never barges.
//! * **A waiter never returns a lock it lost while waiting** (etcd issue
//!   [#11456](https://github.com/etcd-io/etcd/issues/11456): etcd's own mutex
//!   could return from a wait holding a lease that had been revoked). A
//!   waiter also watches its **own** entry on the client's watch stream: if
//!   the entry goes while it waits (its session lease revoked, or the entry
//!   deleted behind its back), it checks its lease and queues again. When its
//!   predecessor's deletion promotes it without a request, it first takes
//!   every response the stream already routed to its own watch (etcd sends a
//!   stream's events in revision order), so a deletion of its entry before
//!   the predecessor's is seen; when the predecessor is on the waiter's own
//!   session lease (one revoke can delete both in one revision), it reads the
//!   line instead. The residue: etcd reorders a stream's events only for a
//!   watcher that fell behind (more than 128 responses unsent); a lock then
//!   returned without its entry fails its background announcement, which
//!   marks it lost, and its next extend reports
//!   [`LeaseLost`](fenced_api::Error::LeaseLost).
//! * **release** = delete the holder's entry, guarded by create revision and
//!   owner. Requests per acquire + release: **2** uncontended (two
//!   transactions); contended, 2 writes on the caller's path plus one
//!   background write (the announcement) and rarely a read, plus watch
//!   messages on the client's one stream.
//! * **Session leases**: one lease per client and TTL class (whole seconds;
//!   etcd raises a TTL below its minimum — 3/2 of its election timeout,
//!   rounded up: 2 s with the default timing, so a 1 s request gets 2 s —
//!   and `lease.ttl` is what etcd granted, never the request), granted
//!   on first use and refreshed by use — a keep-alive on its own stream,
//!   sent beside an acquire or extend at most once per TTL/8 (so a lease's
//!   reported deadline may be up to TTL/8 short of a full TTL). Waiters
//!   refresh it while they wait. Nothing refreshes an idle lease.
//! * **Each lock's TTL**: a lease outlives the locks on it, so a lock whose
//!   holder stops extending is deleted by the client's reaper at the lock's
//!   deadline — the same instant [`Lease::deadline`](fenced_api::Lease::deadline)
//!   names, computed from the send time of the keep-alive that guarantees
//!   the session lease until then. The holder stops trusting the lock at
//!   that instant and the key goes right after, so nobody else can take it
//!   while the holder may still act.
//! * **extend** = a guarded read of the entry (same create revision, owner
//!   and session lease; reads of concurrent extends share one read-only
//!   transaction, up to 128) plus the coalesced keep-alive. A different TTL
//!   moves the entry onto that TTL's session lease (a put keeps the create
//!   revision, so the token and the place in line stay).
//! * **Loss**: when a keep-alive finds the session lease gone, every lock
//!   on it is marked lost and its next extend fails with `LeaseLost`; a
//!   force-released or otherwise deleted entry fails the guarded read. The
//!   [`LockClient`](fenced_api::LockClient) watchdog turns either into the
//!   guard's loss signal at its next renewal (every TTL/3).
//! * **Cancellation**: a dropped or timed-out acquire deletes its entry in
//!   the background (and once more after twice the operation timeout, for a
//!   request still in flight); releases and expiry deletions of many locks
//!   at once are batched, up to 64 guarded deletes per request.
//! * **Waiting never meets etcd's 100 ms watch sync loop**: a watch started
//!   at an older revision joins etcd's *unsynced* watchers and hears nothing
//!   until that loop runs. Watches here start at the current revision
//!   (synced) and the waiter re-reads the key if the store moved since it
//!   last looked (module `watch`).
//! * Not built on etcd's `Lock` RPC: in etcd 3.4, cancelling many waiting
//!   `Lock` calls wedges its lock service (etcd issue 13336, reproduced here).
//! * Reentrancy by owner is not offered ([`Capabilities::is_reentrant`](fenced_api::Capabilities::is_reentrant)
//!   is false); use `LockClient::builder(..).reentrant(true)`. Re-acquiring
//!   (or waiting twice) with the same explicit owner fails with `AlreadyHeld`.
//!
//! ## Deviation from the contract: per-lock expiry on the client's clock
//!
//! The contract (C5) has a lock expire by the **store's** clock. Here a
//! lock's own TTL is enforced by the holder's client — the reaper deletes
//! the key at the lock's deadline, on that client's monotonic clock — while
//! the client lives; etcd's session lease (the store's clock) is only the
//! **backstop** for a client that dies, freezes or is cut off. The bound:
//! a lock whose holder stops extending can outlive its deadline by **up to
//! one TTL** if the whole client dies (or freezes) before that deadline,
//! because other locks' renewals had kept the shared session lease alive
//! until then; a client that keeps running deletes it at the deadline. The
//! holder itself stops trusting the lock at its deadline either way, so this
//! costs availability (the key stays taken longer), not exclusion.
//! [`Capabilities`](fenced_api::Capabilities) has no flag for this; it is
//! documented on [`EtcdLock`]'s `capabilities` as well.
//!
//! ## Trade-off: shared session leases
//!
//! A lease per lock (this crate's first design) lets etcd enforce every
//! lock's TTL on its own clock, but costs a grant, a revoke and a keep-alive
//! stream per lock: 7 requests per acquire + release instead of 2. With
//! shared leases, a **running** client enforces each lock's TTL itself (the
//! reaper, on the holder's own clock, at the holder's own deadline), and
//! etcd is the backstop for a client that **stops** — crashed, frozen or cut
//! off: its session leases are no longer refreshed, and etcd removes every
//! lock and queue entry on them at most one TTL after the client's last
//! acquire, extend or wait. One lease per *TTL* rather than one per client
//! keeps that bound at the lock's own TTL; the cost is a lock whose holder
//! had already stopped extending when the whole client died: it can outlive
//! its own deadline by up to one TTL (its siblings' renewals kept the
//! session lease alive). `inspect` reports the session lease's remaining TTL
//! (the latest the key can live if its client stops now), or the holder's
//! own deadline when asked through the holder's client.
//!
//! # Restarts and clusters
//!
//! etcd is a CP store: locks survive restarts and leader changes, and a
//! minority partition cannot grant anything. After a restart the leases of
//! held locks are **renewed to their full TTL** (etcd resets lease expiry on
//! leader change), so a holder that died just before the restart keeps its
//! key for up to a whole TTL after the cluster is back. Measured here on a
//! single-node etcd 3.4.23: a dead holder's 4 s lock, 2 s into its TTL when
//! the server was killed, lived another 5.2 s after the server answered
//! again (5.1 s with the first, lease-per-lock design; `tests/etcd.rs`,
//! `dead_holder_lock_after_restart_lives_about_one_ttl`). In a 3-member cluster whose leader was killed, the holder kept
//! its lease and no second holder appeared (`leader_kill_in_a_three_member_cluster`).
//!
//! With several endpoints, a request refused by a dead member before it was
//! sent is retried on another one within the operation timeout; requests that
//! may have reached a server are never retried blindly.
//!
//! Building needs `protoc` (Debian: `protobuf-compiler`; `scripts/services.sh`
//! installs it).
//!
//! Keys live under `<prefix>\0lock\0<key>\0<owner>`; the prefix (URL path,
//! default `fenced`) is the namespace.
#![forbid(unsafe_code)]
#![warn(missing_docs, missing_debug_implementations, unreachable_pub)]

mod batch;
mod config;
mod entry;
mod error;
mod list;
mod lock;
mod queue;
mod session;
mod track;
mod watch;

pub use config::{EtcdConfig, DEFAULT_PREFIX};
pub use etcd_client;
pub use lock::EtcdLock;

/// URL schemes this backend serves.
pub const SCHEMES: &[&str] = &["etcd", "etcds"];

/// The entry for `fenced::connect(url)`.
pub fn driver() -> fenced_api::Driver {
    fenced_api::Driver {
        name: "etcd",
        schemes: SCHEMES,
        connect: |url| {
            Box::pin(async move {
                Ok(std::sync::Arc::new(EtcdLock::connect(&url).await?)
                    as std::sync::Arc<dyn fenced_api::DistributedLock>)
            })
        },
        migrate: None,
    }
}
