#![doc = include_str!("../README.md")]
#![forbid(unsafe_code)]
#![warn(missing_docs, missing_debug_implementations, unreachable_pub)]

// Files import only files of a lower layer, and none imports `lock`:
// lock | permits | wait | list, queue, hold | session, track | keys, entry, tls |
// config, error;
// session and track are partners (a session's end marks its locks lost,
// the reaper deletes through the sessions).
mod config;
mod entry;
mod error;
mod hold;
mod keys;
mod list;
mod lock;
mod permits;
mod queue;
mod session;
mod tls;
mod track;
mod wait;

pub use config::{
    ZkConfig, DEFAULT_CONNECT_TIMEOUT, DEFAULT_NAMESPACE, DEFAULT_OPERATION_TIMEOUT,
    DEFAULT_SESSION_TIMEOUT,
};
pub use lock::{ZkLock, ZkLockBuilder};
pub use zookeeper_client;

/// URL schemes this backend serves: plaintext `zk`, `zookeeper`; TLS
/// `zks`, `zookeeper+tls` (connecting needs the `tls` cargo feature).
pub const SCHEMES: &[&str] = &["zk", "zookeeper", "zks", "zookeeper+tls"];

/// This backend's entry for the `fenced::connect(url)` registry.
pub fn driver() -> fenced_api::Driver {
    fenced_api::Driver {
        name: "zookeeper",
        schemes: SCHEMES,
        connect: |url| fenced_api::Driver::boxed(async move { ZkLock::connect(&url).await }),
        // ZooKeeper needs no schema: the namespace is created on first use.
        migrate: None,
    }
}

/// Compile-time checks that the public types can cross threads and tasks.
#[allow(dead_code)]
fn _assert_send_sync() {
    fn ok<T: Send + Sync + 'static>() {}
    ok::<ZkLock>();
    ok::<ZkLockBuilder>();
    ok::<ZkConfig>();
}
