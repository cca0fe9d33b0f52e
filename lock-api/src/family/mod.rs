//! The lock family on top of [`LockClient`]: semaphores, reader-writer
//! locks, all-or-nothing multi-locks and leader election.
//!
//! Every member is held through a [`LockGuard`] (or a set of them) with the
//! same policy as the mutex: a lease per grant with its own fencing token,
//! renewed by the watchdog, given up a safety margin before the store could
//! hand it on, and a loss signal.
//!
//! * [`Semaphore`] and [`RwLock`] ask the store's
//!   [`SemaphoreStore`](crate::SemaphoreStore) (see [`crate::permits`] for
//!   the model); their keys are a namespace of their own, beside the
//!   mutexes'.
//! * [`MultiGuard`] holds several mutexes at once, all or nothing
//!   ([`LockClient::acquire_all`]); it works on every store.
//! * [`Election`] is a mutex whose holder is the leader, its fencing token
//!   the term ([`LockClient::election`]); it works on every store, and
//!   shares the mutex's key: the leader of `K` holds the mutex `K`.

mod election;
mod multi;
mod permits;

pub use election::{Election, Leader, Leadership};
pub use multi::MultiGuard;
pub use permits::{RwLock, Semaphore};
