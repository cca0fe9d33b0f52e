//! Keys, options and grants for the etcd tests that drive `EtcdLock`
//! directly.

use std::time::Duration;

use fenced_api::{DistributedLock, Lease, LockKey, LockOptions};
use fenced_etcd::EtcdLock;

/// A key unique to this call.
pub(crate) fn key(tag: &str) -> LockKey {
    LockKey::new(format!("{tag}/{}", uuid::Uuid::new_v4().simple())).unwrap()
}

/// Options with this TTL and nothing else.
pub(crate) fn opts(ttl: Duration) -> LockOptions {
    LockOptions::builder().ttl(ttl).build().unwrap()
}

/// `lock` takes `k` for `ttl`; the key must be free.
pub(crate) async fn hold(lock: &EtcdLock, k: &LockKey, ttl: Duration) -> Lease {
    lock.try_acquire(k, &opts(ttl)).await.unwrap().unwrap()
}
