#![doc = include_str!("../README.md")]
#![forbid(unsafe_code)]
#![warn(missing_docs, missing_debug_implementations, unreachable_pub)]

mod config;
mod error;
pub mod fence;
mod gate;
mod list;
mod lock;
mod permits;
mod pool;
mod schema;
mod unique_key;
mod wait;

pub use config::{
    SqliteConfig, Synchronous, TableName, DEFAULT_BUSY_TIMEOUT, DEFAULT_MAX_CONNECTIONS,
    DEFAULT_TABLE,
};
pub use lock::{SqliteLock, SqliteLockBuilder};
pub use schema::SCHEMA_VERSION;
pub use sqlx;

/// URL schemes this backend serves.
pub const SCHEMES: &[&str] = &["sqlite"];

/// The entry for `fenced::connect(url)`: connects with [`SqliteLock::connect`]
/// and migrates with [`SqliteLock::migrate`].
pub fn driver() -> fenced_api::Driver {
    fenced_api::Driver {
        name: "sqlite",
        schemes: SCHEMES,
        connect: |url| fenced_api::Driver::boxed(async move { SqliteLock::connect(&url).await }),
        migrate: Some(|url| Box::pin(async move { SqliteLock::migrate(&url).await.map(|_| ()) })),
    }
}

/// Compile-time checks that the public types can cross threads and tasks.
#[allow(dead_code)]
fn _assert_send_sync() {
    fn ok<T: Send + Sync + 'static>() {}
    ok::<SqliteLock>();
    ok::<SqliteLockBuilder>();
    ok::<SqliteConfig>();
    ok::<fence::Fence>();
}
