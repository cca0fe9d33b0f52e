#![doc = include_str!("../README.md")]
// A release build computes the layout of row_lock's `list` future (sqlx
// queries nested in the NOWAIT probes) 130 queries deep, past rustc's
// default limit of 128; debug builds do not get there.
#![recursion_limit = "256"]
#![forbid(unsafe_code)]
#![warn(missing_docs, missing_debug_implementations, unreachable_pub)]

mod sql;

mod config;
mod conn;
mod error;
pub mod fence;
mod list;
mod lock;
mod permits;
mod reaper;
mod schema;
mod stats;
mod strategy;
mod wait;

pub use config::{
    MySqlConfig, Strategy, TableName, DEFAULT_CONNECT_TIMEOUT, DEFAULT_MAX_CONNECTIONS,
    DEFAULT_OPERATION_TIMEOUT, DEFAULT_OP_TIMEOUT, DEFAULT_TABLE,
};
pub use lock::{MySqlLock, MySqlLockBuilder};
pub use reaper::ReaperHandle;
pub use schema::SCHEMA_VERSION;
pub use sqlx;
pub use stats::{
    TableRows, TableStats, METRIC_REAPED_ROWS, METRIC_TABLE_EXPIRED_ROWS, METRIC_TABLE_ROWS,
};
pub use strategy::row_lock::{RowLockTransaction, RowMode};

/// URL schemes this backend serves.
pub const SCHEMES: &[&str] = &["mysql", "mariadb"];

/// The entry for `fenced::connect(url)`: connects with [`MySqlLock::connect`]
/// and migrates with [`MySqlLock::migrate`].
pub fn driver() -> fenced_api::Driver {
    fenced_api::Driver {
        name: "mysql",
        schemes: SCHEMES,
        connect: |url| fenced_api::Driver::boxed(async move { MySqlLock::connect(&url).await }),
        migrate: Some(|url| Box::pin(async move { MySqlLock::migrate(&url).await.map(|_| ()) })),
    }
}

#[allow(dead_code)]
fn _assert_send_sync() {
    fn ok<T: Send + Sync + 'static>() {}
    ok::<(
        MySqlLock,
        MySqlLockBuilder,
        MySqlConfig,
        RowLockTransaction,
        fence::Fence,
    )>();
}
