#![doc = include_str!("../README.md")]
#![forbid(unsafe_code)]
#![warn(missing_docs, missing_debug_implementations, unreachable_pub)]

mod config;
mod conn;
mod error;
pub mod fence;
mod list;
mod lock;
mod permits;
mod reaper;
mod schema;
mod strategy;
mod transaction;
mod wait;

pub use config::{
    PostgresConfig, Strategy, TableName, DEFAULT_CONNECT_TIMEOUT, DEFAULT_MAX_CONNECTIONS,
    DEFAULT_MAX_LOCK_CONNECTIONS, DEFAULT_OPERATION_TIMEOUT, DEFAULT_RECHECK_INTERVAL,
    DEFAULT_TABLE,
};
pub use lock::{PostgresLock, PostgresLockBuilder};
pub use reaper::{ReaperHandle, DEFAULT_REAP_GRACE, MIN_REAP_GRACE};
pub use schema::SCHEMA_VERSION;
pub use sqlx;
pub use strategy::advisory::hash::{advisory_key, ADVISORY_KEY_SQL};
pub use transaction::PostgresLockTransaction;

/// URL schemes this backend serves.
pub const SCHEMES: &[&str] = &["postgres", "postgresql"];

/// The entry for `fenced::connect(url)`: connects with
/// [`PostgresLock::connect`] and migrates with [`PostgresLock::migrate`].
pub fn driver() -> fenced_api::Driver {
    fenced_api::Driver {
        name: "postgres",
        schemes: SCHEMES,
        connect: |url| fenced_api::Driver::boxed(async move { PostgresLock::connect(&url).await }),
        migrate: Some(|url| Box::pin(async move { PostgresLock::migrate(&url).await.map(|_| ()) })),
    }
}

/// Compile-time checks that the public types can cross threads and tasks.
#[allow(dead_code)]
fn _assert_send_sync() {
    fn ok<T: Send + Sync + 'static>() {}
    ok::<(
        PostgresLock,
        PostgresLockBuilder,
        PostgresConfig,
        ReaperHandle,
        fence::Fence,
    )>();
}
