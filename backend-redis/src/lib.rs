#![doc = include_str!("../README.md")]
#![forbid(unsafe_code)]
#![warn(missing_docs, missing_debug_implementations, unreachable_pub)]

mod config;
mod conn;
mod error;
pub mod fence;
mod keys;
mod list;
mod lock;
mod permits;
mod persistence;
mod scripts;
mod sentinel;
mod wait;

pub use config::{
    Prefix, RedisConfig, DEFAULT_CONNECT_TIMEOUT, DEFAULT_OPERATION_TIMEOUT, DEFAULT_PREFIX,
    DEFAULT_RECHECK_INTERVAL, DEFAULT_REPLICA_TIMEOUT, MAX_MIN_REPLICAS,
};
pub use lock::{RedisLock, RedisLockBuilder};
pub use persistence::Persistence;
pub use redis;

/// URL schemes this backend serves.
pub const SCHEMES: &[&str] = &[
    "redis",
    "rediss",
    "redis+sentinel",
    "redis+cluster",
    "rediss+cluster",
];

/// This backend's entry for the `fenced::connect(url)` registry.
pub fn driver() -> fenced_api::Driver {
    fenced_api::Driver {
        name: "redis",
        schemes: SCHEMES,
        connect: |url| fenced_api::Driver::boxed(async move { RedisLock::connect(&url).await }),
        // Redis needs no schema.
        migrate: None,
    }
}

/// Compile-time checks that the public types can cross threads and tasks.
#[allow(dead_code)]
fn _assert_send_sync() {
    fn ok<T: Send + Sync + 'static>() {}
    ok::<(RedisLock, RedisLockBuilder, RedisConfig, Persistence)>();
}
