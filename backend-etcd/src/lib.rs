#![doc = include_str!("../README.md")]
#![forbid(unsafe_code)]
#![warn(missing_docs, missing_debug_implementations, unreachable_pub)]

// Files import only files of a lower layer, and none imports `lock`:
// lock | permits | wait (and wait/watch), list, hold | session | track |
// batch | client, keys, entry | config, error.
mod batch;
mod client;
mod config;
mod entry;
mod error;
mod hold;
mod keys;
mod list;
mod lock;
mod permits;
mod session;
mod track;
mod wait;

pub use config::{EtcdConfig, DEFAULT_CONNECT_TIMEOUT, DEFAULT_OPERATION_TIMEOUT, DEFAULT_PREFIX};
pub use etcd_client;
pub use lock::{EtcdLock, EtcdLockBuilder};

/// URL schemes this backend serves.
pub const SCHEMES: &[&str] = &["etcd", "etcds"];

/// This backend's entry for the `fenced::connect(url)` registry.
pub fn driver() -> fenced_api::Driver {
    fenced_api::Driver {
        name: "etcd",
        schemes: SCHEMES,
        connect: |url| fenced_api::Driver::boxed(async move { EtcdLock::connect(&url).await }),
        // etcd needs no schema.
        migrate: None,
    }
}

/// Compile-time checks that the public types can cross threads and tasks.
#[allow(dead_code)]
fn _assert_send_sync() {
    fn ok<T: Send + Sync + 'static>() {}
    ok::<EtcdLock>();
    ok::<EtcdLockBuilder>();
    ok::<EtcdConfig>();
}
