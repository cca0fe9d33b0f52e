//! Test support shared by the Redis test binaries: the conformance harness
//! over the shared Redis, and private `redis-server` processes for tests that
//! restart a server or count its commands.

#![allow(dead_code, unreachable_pub, clippy::unwrap_used, clippy::expect_used)]

pub mod private;

use std::{collections::HashMap, sync::Arc, time::Duration};

use async_trait::async_trait;
use fenced_api::{DistributedLock, Error, Lease, LockKey, LockOptions, Result};
use fenced_conformance::Harness;
use fenced_redis::{redis, RedisLock};

use private::{Mode, PrivateRedis};

/// The shared server's URL (`FENCED_TEST_REDIS_URL`) once it answers; a test whose
/// server is down fails with a message naming `scripts/services.sh`.
pub use fenced_testkit::shared::require_redis as server_url;

/// A key prefix unique to this test process ("a fresh uuid namespace per run").
pub fn run_prefix() -> &'static str {
    fenced_testkit::run_name("fenced-t-")
}

/// `server` with fenced's parameters appended.
pub fn url_for(server: &str, prefix: &str) -> String {
    let sep = if server.contains('?') { '&' } else { '?' };
    format!("{server}{sep}prefix={prefix}&connect_timeout=5s&operation_timeout=5s")
}

/// Runs the suite against one Redis server, or the shared Redis Cluster.
pub struct RedisHarness {
    server: String,
    prefix: String,
    private: Option<Arc<PrivateRedis>>,
    /// On the shared Cluster: no private server of the same kind to restart.
    cluster: bool,
}

impl RedisHarness {
    /// On the shared server, in this run's prefix.
    pub async fn new() -> Self {
        RedisHarness {
            server: server_url().await,
            prefix: run_prefix().to_owned(),
            private: None,
            cluster: false,
        }
    }

    /// On the shared Redis Cluster (`FENCED_TEST_REDIS_CLUSTER_URL`), in
    /// this run's prefix.
    pub async fn cluster() -> Self {
        RedisHarness {
            server: fenced_testkit::shared::require_redis_cluster().await,
            prefix: run_prefix().to_owned(),
            private: None,
            cluster: true,
        }
    }

    /// On a private server (restartable).
    pub fn on_private(server: Arc<PrivateRedis>) -> Self {
        RedisHarness {
            server: server.url(),
            prefix: "fenced-private".into(),
            private: Some(server),
            cluster: false,
        }
    }

    pub fn url(&self) -> String {
        url_for(&self.server, &self.prefix)
    }

    pub async fn lock(&self) -> RedisLock {
        RedisLock::connect(&self.url()).await.unwrap()
    }
}

#[async_trait]
impl Harness for RedisHarness {
    async fn client(&self) -> Result<Arc<dyn DistributedLock>> {
        Ok(Arc::new(RedisLock::connect(&self.url()).await?))
    }

    async fn client_in_namespace(&self, suffix: &str) -> Result<Arc<dyn DistributedLock>> {
        let clean = fenced_testkit::namespace_suffix(suffix);
        let prefix = format!("{}.{clean}", self.prefix);
        Ok(Arc::new(
            RedisLock::connect(&url_for(&self.server, &prefix)).await?,
        ))
    }

    async fn unreachable_client(&self) -> Option<Result<Arc<dyn DistributedLock>>> {
        // Nothing listens on port 1.
        Some(
            RedisLock::connect("redis://127.0.0.1:1/?connect_timeout=2s&operation_timeout=2s")
                .await
                .map(|l| Arc::new(l) as Arc<dyn DistributedLock>),
        )
    }

    fn connect_timeout(&self) -> Duration {
        Duration::from_secs(2)
    }

    async fn restart_store(&self) -> Option<Result<()>> {
        let server = self.private.as_ref()?;
        Some(server.restart().await)
    }

    async fn private_store(&self) -> Option<Result<Box<dyn Harness>>> {
        if self.cluster {
            return None;
        }
        // Durable configuration: AOF with fsync on every write.
        Some(
            PrivateRedis::start(Mode::AofAlways)
                .await
                .map(|s| Box::new(RedisHarness::on_private(Arc::new(s))) as Box<dyn Harness>),
        )
    }

    fn base_ttl(&self) -> Duration {
        Duration::from_secs(1)
    }
}

/// `INFO commandstats` as command name → calls.
pub async fn command_stats(conn: &mut redis::aio::MultiplexedConnection) -> HashMap<String, u64> {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(conn)
        .await
        .unwrap();
    info.lines()
        .filter_map(|l| {
            let rest = l.strip_prefix("cmdstat_")?;
            let (name, stats) = rest.split_once(':')?;
            let calls = stats
                .split(',')
                .find_map(|kv| kv.strip_prefix("calls="))?
                .parse()
                .ok()?;
            Some((name.to_owned(), calls))
        })
        .collect()
}

/// Per-command call counts between two snapshots (zero deltas dropped).
pub fn delta(before: &HashMap<String, u64>, after: &HashMap<String, u64>) -> HashMap<String, u64> {
    after
        .iter()
        .map(|(k, v)| (k.clone(), v - before.get(k).copied().unwrap_or(0)))
        .filter(|(_, v)| *v > 0)
        .collect()
}

/// `extend` on a client whose connection died with the server: the first
/// call may fail with a retryable error while the connection is replaced.
pub async fn extend_after_reconnect(lock: &RedisLock, lease: &Lease) -> Result<Lease> {
    let mut last = None;
    for _ in 0..20 {
        match lock.extend(lease, Duration::from_secs(30)).await {
            Err(e @ Error::Backend { .. }) => {
                assert!(e.is_retryable(), "{e}");
                last = Some(Err(e));
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            other => return other,
        }
    }
    last.unwrap()
}

/// A key unique to this call.
pub fn key(k: &str) -> LockKey {
    LockKey::new(format!(
        "{k}/{}",
        &uuid::Uuid::new_v4().simple().to_string()[..8]
    ))
    .unwrap()
}

/// Options with this TTL.
pub fn opts(ttl: Duration) -> LockOptions {
    LockOptions::builder().ttl(ttl).build().unwrap()
}

/// The number of entries in the wait queue `queue`.
pub async fn queue_len(admin: &mut redis::aio::MultiplexedConnection, queue: &str) -> usize {
    redis::cmd("ZCARD")
        .arg(queue)
        .query_async(admin)
        .await
        .unwrap()
}

/// Waits until the queue holds `n` entries; fails after 10 s.
pub async fn until_queued(admin: &mut redis::aio::MultiplexedConnection, queue: &str, n: usize) {
    until_queued_within(admin, queue, n, Duration::from_secs(10)).await;
}

/// Waits until the queue holds `n` entries; fails after `bound`.
pub async fn until_queued_within(
    admin: &mut redis::aio::MultiplexedConnection,
    queue: &str,
    n: usize,
    bound: Duration,
) {
    let start = tokio::time::Instant::now();
    loop {
        let len = queue_len(admin, queue).await;
        if len == n {
            return;
        }
        assert!(
            start.elapsed() < bound,
            "{queue} holds {len} entries, expected {n} within {bound:?}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}
