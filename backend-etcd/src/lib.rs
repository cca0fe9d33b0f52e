//! etcd backend of [fenced](https://docs.rs/fenced): one lease and one
//! transaction per lock, the key's **create revision** as the fencing token,
//! and FIFO waiting on watches.
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
//! * **acquire**: grant a lease (etcd reports the *effective* TTL: it rounds
//!   up to whole seconds and to its minimum, so `lease.ttl` may exceed the
//!   request), then `If(create_revision(key) == 0) Then(Put(key, owner, lease))`.
//!   Exact-key comparisons: keys `a` and `a/b` never interfere.
//! * **token** = the key's create revision: global, durable, strictly
//!   increasing — across releases, expiries and server restarts.
//! * **extend** = a guarded read (same create revision, same owner) and a
//!   lease keep-alive; a keep-alive answering TTL ≤ 0 means the lease is gone,
//!   which the [`LockClient`](fenced_api::LockClient) watchdog turns into a loss signal.
//!   A keep-alive restores the lease's granted TTL; it cannot change it.
//! * **release** = delete guarded by create revision and owner, then revoke.
//! * **waiting**: a FIFO queue of per-waiter keys, each watching only its
//!   predecessor (module `queue`); cancellation revokes the waiter's lease.
//! * Not built on etcd's `Lock` RPC: in etcd 3.4, cancelling many waiting
//!   `Lock` calls wedges its lock service (etcd issue 13336, reproduced here).
//! * Reentrancy by owner is not offered ([`Capabilities::is_reentrant`](fenced_api::Capabilities::is_reentrant)
//!   is false); use `LockClient::builder(..).reentrant(true)`. Re-acquiring
//!   with the same explicit owner fails at once with `AlreadyHeld`.
//!
//! # Restarts and clusters
//!
//! etcd is a CP store: locks survive restarts and leader changes, and a
//! minority partition cannot grant anything. After a restart the leases of
//! held locks are **renewed to their full TTL** (etcd resets lease expiry on
//! leader change), so a holder that died just before the restart keeps its
//! key for up to a whole TTL after the cluster is back. Measured here on a
//! single-node etcd 3.4.23: a dead holder's 4 s lock, 2 s into its TTL when
//! the server was killed, lived another 5.1 s after the server answered
//! again (`tests/etcd.rs`, `dead_holder_lock_after_restart_lives_about_one_ttl`).
//! In a 3-member cluster whose leader was killed, the holder kept its lease
//! and no second holder appeared (`leader_kill_in_a_three_member_cluster`).
//!
//! With several endpoints, a request refused by a dead member before it was
//! sent is retried on another one within the operation timeout; requests that
//! may have reached a server are never retried blindly.
//!
//! Building needs `protoc` (Debian: `protobuf-compiler`; `scripts/services.sh`
//! installs it).
//!
//! Keys live under `<prefix>\0lock\0<key>` and `<prefix>\0queue\0<key>\0…`;
//! the prefix (URL path, default `fenced`) is the namespace.
#![forbid(unsafe_code)]
#![warn(missing_docs, missing_debug_implementations, unreachable_pub)]

mod config;
mod error;
mod lock;
mod queue;

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
