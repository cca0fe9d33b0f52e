//! Live migration: `DualLock(mysql, redis)` passes the whole conformance
//! suite, and the documented phases keep nodes on the old store, on the
//! dual lock and on the new store mutually exclusive with increasing tokens.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::{sync::Arc, time::Duration};

use fenced::async_trait;
use fenced::{DistributedLock, DualLock, LockKey, LockOptions, Result, TokenSource, WaitPolicy};
use fenced_conformance::{services, Harness};

async fn mysql_url(table: &str) -> String {
    let base = services::mysql_url();
    services::probe_mysql(&base)
        .await
        .unwrap_or_else(|m| panic!("{m}"));
    let url = format!("{base}?strategy=unique_key&table={table}&max_connections=8");
    fenced::migrate(&url).await.unwrap();
    url
}

async fn redis_url(prefix: &str) -> String {
    let base = services::redis_url();
    services::probe_redis(&base)
        .await
        .unwrap_or_else(|m| panic!("{m}"));
    format!("{base}/0?prefix={prefix}")
}

fn run_id() -> &'static str {
    static ID: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    ID.get_or_init(|| uuid::Uuid::new_v4().simple().to_string()[..10].to_owned())
}

struct DualHarness {
    mysql: String,
    redis: String,
}

impl DualHarness {
    async fn new() -> Self {
        DualHarness {
            mysql: mysql_url(&format!("fenced_dual_{}", run_id())).await,
            redis: redis_url(&format!("fenced-dual-{}", run_id())).await,
        }
    }
}

#[async_trait]
impl Harness for DualHarness {
    async fn client(&self) -> Result<Arc<dyn DistributedLock>> {
        Ok(Arc::new(DualLock::new(
            fenced::connect(&self.mysql).await?,
            fenced::connect(&self.redis).await?,
        )))
    }

    async fn client_in_namespace(&self, suffix: &str) -> Result<Arc<dyn DistributedLock>> {
        let clean: String = suffix
            .chars()
            .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
            .collect();
        Ok(Arc::new(DualLock::new(
            fenced::connect(&mysql_url(&format!("fenced_dual_{}_{clean}", run_id())).await).await?,
            fenced::connect(&redis_url(&format!("fenced-dual-{}-{clean}", run_id())).await).await?,
        )))
    }

    async fn unreachable_client(&self) -> Option<Result<Arc<dyn DistributedLock>>> {
        let down = fenced::connect("redis://127.0.0.1:1/0?connect_timeout=1s").await;
        Some(down.map(|_| -> Arc<dyn DistributedLock> { unreachable!("port 1 answered") }))
    }

    fn connect_timeout(&self) -> Duration {
        Duration::from_secs(2)
    }

    fn base_ttl(&self) -> Duration {
        Duration::from_secs(1)
    }
}

fenced_conformance::conformance_tests!(DualHarness::new().await, skips = [
    c07_tokens_increase_after_restart: "durable only if both halves are; the shared Redis keeps nothing on disk",
    c08_waiters_served_in_order: "DualLock declares no fifo: a waiter queues on each store in turn",
], without_semaphores = "DualLock migrates mutexes only: it has no semaphores");

/// The migration, phase by phase, with two live "nodes" contending on one key
/// in each phase: never both inside, tokens strictly increasing throughout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_migration_phases_stay_exclusive_with_increasing_tokens() {
    let id = uuid::Uuid::new_v4().simple().to_string()[..10].to_owned();
    let mysql = mysql_url(&format!("fenced_mig_{id}")).await;
    let redis = redis_url(&format!("fenced-mig-{id}")).await;
    let old = || async { fenced::connect(&mysql).await.unwrap() };
    let new = || async { fenced::connect(&redis).await.unwrap() };
    let dual = |src| {
        let (mysql, redis) = (mysql.clone(), redis.clone());
        async move {
            Arc::new(
                DualLock::new(
                    fenced::connect(&mysql).await.unwrap(),
                    fenced::connect(&redis).await.unwrap(),
                )
                .tokens(src),
            ) as Arc<dyn DistributedLock>
        }
    };
    type Node = Arc<dyn DistributedLock>;
    let phases: Vec<(&str, Node, Node)> = vec![
        ("1 old", old().await, old().await),
        (
            "2 old + dual(old tokens)",
            old().await,
            dual(TokenSource::Old).await,
        ),
        (
            "3 dual(new tokens)",
            dual(TokenSource::New).await,
            dual(TokenSource::New).await,
        ),
        (
            "4 dual(new tokens) + new",
            dual(TokenSource::New).await,
            new().await,
        ),
        ("5 new", new().await, new().await),
    ];
    let key = LockKey::new("orders:1001").unwrap();
    let opts = LockOptions::builder()
        .ttl(Duration::from_secs(10))
        .wait(WaitPolicy::Timeout(Duration::from_secs(20)))
        .build()
        .unwrap();
    let inside = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut last = 0u64;
    for (name, a, b) in phases {
        let tokens = Arc::new(std::sync::Mutex::new(Vec::new()));
        let mut tasks = Vec::new();
        for node in [a, b] {
            let (key, opts, inside, tokens) =
                (key.clone(), opts.clone(), inside.clone(), tokens.clone());
            tasks.push(tokio::spawn(async move {
                for _ in 0..5 {
                    let lease = node.acquire(&key, &opts).await.unwrap();
                    assert_eq!(
                        inside.fetch_add(1, std::sync::atomic::Ordering::SeqCst),
                        0,
                        "two holders"
                    );
                    tokens.lock().unwrap().push(lease.token.get());
                    tokio::time::sleep(Duration::from_millis(5)).await;
                    inside.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
                    node.release(&lease).await.unwrap();
                }
            }));
        }
        for t in tasks {
            t.await.unwrap();
        }
        for t in tokens.lock().unwrap().iter() {
            assert!(*t > last, "phase {name}: token {t} after {last}");
            last = *t;
        }
    }
}
