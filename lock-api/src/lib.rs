//! The contract of [fenced](https://docs.rs/fenced): one async trait for
//! distributed locks with fencing tokens, the types around it, the policy
//! layer ([`LockClient`]) and the in-memory reference backend ([`MemoryLock`]).
//!
//! ```
//! use std::{sync::Arc, time::Duration};
//! use fenced_api::{LockClient, MemoryLock};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> fenced_api::Result<()> {
//! let store = Arc::new(MemoryLock::new()); // or fenced::connect("redis://…")
//! let node_a = LockClient::builder(store.clone()).ttl(Duration::from_secs(10)).build()?;
//! let node_b = LockClient::new(store);
//!
//! let guard = node_a.acquire("order:1001").await?;
//! // While A holds the key, B is refused at once.
//! assert!(node_b.try_acquire("order:1001").await?.is_none());
//! // The fencing token goes with every write to the protected resource,
//! // which rejects tokens lower than the highest it has seen.
//! let first = guard.token();
//! guard.release().await?;
//!
//! let guard = node_b.acquire("order:1001").await?;
//! assert!(guard.token() > first);
//! # guard.release().await?;
//! # Ok(()) }
//! ```
//!
//! # Layers
//!
//! * [`DistributedLock`] — the per-store primitive (`try_acquire`, `acquire`,
//!   `extend`, `release`, `inspect`, `force_release`, `capabilities`, and
//!   `list` for stores that can enumerate their locks); small and
//!   object-safe. Its `# Contract` section is what every backend is tested
//!   against by the `fenced-conformance` suite.
//! * [`LockClient`] / [`LockGuard`] — policy written once: watchdog renewal
//!   every ttl/3 driven by monotonic deadlines (batched per client through
//!   [`DistributedLock::extend_many`]; see [`batch`]), a [`SafetyMargin`]
//!   before each lease's deadline, `max_hold` circuit breaker, one holder per
//!   acquisition (tasks sharing a client wait in turn) with opt-in re-entry
//!   by the acquiring task, inside a hold's scope ([`LockGuard::scope`]) or
//!   through [`LockGuard::reenter`], holder [`Label`]s, the loss signal ([`LockGuard::lost`],
//!   [`LeaseHandle::lost_token`], [`LeaseHandle::expiring`]) and
//!   [`LockClient::with_lock`].
//! * [`wait`] — the shared waiting helper for stores with no native wait.
//! * [`deadlines`] — per-lock deadlines and their reaper, for stores whose
//!   locks share a session that outlives each of them.
//! * [`telemetry`] — the metric names `LockClient` emits through the
//!   `metrics` facade (acquire wait, contention, hold time, renewals and
//!   their failures, losses, releases).
//!
//! # Time
//!
//! Lock expiry is decided by the **store's** clock. The client only keeps a
//! local, monotonic deadline per lease (TTL counted from when the request was
//! sent, less a [`SafetyMargin`] for clock-rate drift and reaction time), so
//! it gives up *before* the store could grant the key to someone else — even
//! after the process was paused. Wall-clock jumps on the client change
//! nothing.
#![forbid(unsafe_code)]
#![warn(missing_docs, missing_debug_implementations, unreachable_pub)]

pub mod batch;
mod bounded;
mod capabilities;
pub mod cleanup;
mod client;
pub mod deadlines;
mod driver;
mod dual;
mod error;
mod family;
pub mod fence;
mod guard;
mod holder;
mod key;
mod lease;
mod lock;
mod margin;
mod memory;
mod options;
pub mod permits;
mod renewer;
pub mod telemetry;
pub mod url;
pub mod wait;
mod wrap;

pub use async_trait::async_trait;
pub use bounded::{bounded, bounded_until, no_answer};
pub use capabilities::Capabilities;
pub use client::{LockClient, LockClientBuilder};
pub use driver::{BoxFuture, ConnectFn, Driver, MigrateFn};
pub use dual::{DualLock, TokenSource};
pub use error::{BoxError, Error, NoAnswer, Result};
pub use family::{Election, Leader, Leadership, MultiGuard, RwLock, Semaphore};
pub use guard::{LeaseHandle, LockGuard, LossReason};
pub use key::{IntoLockKey, LockKey};
pub use lease::{FencingToken, Lease, LockInfo, ReleaseOutcome};
pub use lock::{DistributedLock, EXTEND_MANY_CONCURRENCY};
pub use margin::SafetyMargin;
pub use memory::{MemoryLock, MemorySemaphores};
pub use options::{Label, LockOptions, LockOptionsBuilder, Owner, WaitPolicy};
pub use permits::{KeyHolders, PermitHolder, Permits, SemaphoreStore};
/// The signal type of [`DistributedLock::loss_signal`] and
/// [`LeaseHandle::lost_token`] (tokio-util's).
pub use tokio_util::sync::CancellationToken;
pub use wrap::WrapLock;

/// Compile-time checks that the public types can cross threads and tasks.
#[allow(dead_code)]
fn _assert_send_sync() {
    fn ok<T: Send + Sync + 'static>() {}
    ok::<Error>();
    ok::<LockKey>();
    ok::<Lease>();
    ok::<LockOptions>();
    ok::<LockClient>();
    ok::<LockGuard>();
    ok::<LeaseHandle>();
    ok::<MemoryLock>();
    ok::<fence::TokenFence>();
    ok::<fence::Fenced<String>>();
    ok::<std::sync::Arc<dyn DistributedLock>>();
}
