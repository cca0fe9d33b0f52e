//! The opening of tests that watch or disturb a private `redis-server`:
//! the server, its admin connection, one client and one key.

use std::time::Duration;

use fenced_api::{DistributedLock, Lease, LockKey};
use fenced_redis::{redis::aio::MultiplexedConnection, RedisLock};

use crate::common::{
    key, opts,
    private::{Mode, PrivateRedis},
    url_for,
};

/// A private server without persistence, its admin connection, a client in
/// namespace `name`, and the key `name`.
pub(crate) async fn on_private(
    name: &str,
) -> (PrivateRedis, MultiplexedConnection, RedisLock, LockKey) {
    let server = PrivateRedis::start(Mode::NoPersistence).await.unwrap();
    let admin = server.admin().await;
    let lock = RedisLock::connect(&url_for(&server.url(), name))
        .await
        .unwrap();
    (server, admin, lock, key(name))
}

/// `lock` takes `k` for `ttl`; the key must be free.
pub(crate) async fn hold(lock: &impl DistributedLock, k: &LockKey, ttl: Duration) -> Lease {
    lock.try_acquire(k, &opts(ttl)).await.unwrap().unwrap()
}
