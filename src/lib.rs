//! **fenced**: distributed locks with fencing tokens, written once against one
//! async trait and backed by the store your configuration names.
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> fenced::Result<()> {
//! // In production: fenced::connect(&std::env::var("FENCED_URL")?) with
//! // mysql://…, redis://…, etcd://… or sqlite://… — the code below is the same.
//! let store = fenced::connect("memory://").await?;
//! let client = fenced::LockClient::new(store);
//! let out = client
//!     .with_lock("job:rebuild-index", |lease| async move {
//!         // pass lease.token() to the resource you protect
//!         lease.token().get()
//!     })
//!     .await?;
//! assert!(out >= 1);
//! # Ok(()) }
//! ```
//!
//! This facade re-exports [`fenced_api`] (the trait, [`LockClient`], the
//! types) and chooses the backend by URL scheme through [`connect`]. Each
//! backend is a cargo feature (`mysql`, `redis`, `etcd`, `sqlite`,
//! `zookeeper`, `postgres`); the backend crates are re-exported under their
//! names (`fenced::mysql`…) for backend-specific APIs such as MySQL's
//! transaction-scoped row locks.
#![forbid(unsafe_code)]
#![warn(missing_docs, missing_debug_implementations, unreachable_pub)]

mod registry;

pub use fenced_api::url::redact;
pub use fenced_api::*;
pub use registry::{connect, default_url, driver_for, drivers, migrate};

#[cfg(feature = "etcd")]
pub use fenced_etcd as etcd;
#[cfg(feature = "mysql")]
pub use fenced_mysql as mysql;
#[cfg(feature = "postgres")]
pub use fenced_postgres as postgres;
#[cfg(feature = "redis")]
pub use fenced_redis as redis;
#[cfg(feature = "sqlite")]
pub use fenced_sqlite as sqlite;
#[cfg(feature = "zookeeper")]
pub use fenced_zookeeper as zookeeper;
