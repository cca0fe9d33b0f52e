//! **fenced**: distributed locks with fencing tokens, written once against one
//! async trait and backed by the store your configuration names.
//!
//! ```
//! use std::sync::Arc;
//! use fenced::{LockClient, MemoryLock};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> fenced::Result<()> {
//! let client = LockClient::new(Arc::new(MemoryLock::new()));
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
//! This facade re-exports [`fenced_api`]; the backend drivers (MySQL/MariaDB,
//! Redis, etcd, SQLite), `fenced::connect(url)` and the `fenced` CLI are added
//! behind cargo features as they land.
#![forbid(unsafe_code)]
#![warn(missing_docs, missing_debug_implementations, unreachable_pub)]

pub use fenced_api::*;
