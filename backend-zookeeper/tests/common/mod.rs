//! Test support: the conformance harness over the shared ZooKeeper.

#![allow(dead_code, unreachable_pub, clippy::unwrap_used, clippy::expect_used)]

use std::{sync::Arc, time::Duration};

use async_trait::async_trait;
use fenced_api::{DistributedLock, Result};
use fenced_conformance::Harness;
use fenced_testkit::private::{PrivateZooKeeper, ZooKeeperOptions};
use fenced_zookeeper::ZkLock;

/// The hosts of the shared ZooKeeper (`FENCED_TEST_ZOOKEEPER_URL`) once it
/// serves requests; a test whose server is down fails with a message
/// naming `scripts/services.sh`.
pub async fn server_hosts() -> String {
    let url = fenced_testkit::shared::require_zookeeper().await;
    let rest = url.split_once("://").map_or(url.as_str(), |(_, r)| r);
    rest.split(['/', '?']).next().unwrap_or(rest).to_owned()
}

/// A namespace unique to this test process.
pub fn run_namespace() -> String {
    format!("/{}", fenced_testkit::run_name("fenced-test-"))
}

pub struct ZkHarness {
    hosts: String,
    namespace: String,
    private: Option<Arc<PrivateZooKeeper>>,
}

impl ZkHarness {
    pub async fn new() -> Self {
        ZkHarness {
            hosts: server_hosts().await,
            namespace: run_namespace(),
            private: None,
        }
    }

    pub fn url(&self) -> String {
        format!(
            "zk://{}{}?session_timeout=20s&connect_timeout=3s&timeout=5s",
            self.hosts, self.namespace
        )
    }

    pub async fn lock(&self) -> ZkLock {
        ZkLock::connect(&self.url()).await.unwrap()
    }
}

#[async_trait]
impl Harness for ZkHarness {
    async fn client(&self) -> Result<Arc<dyn DistributedLock>> {
        Ok(Arc::new(ZkLock::connect(&self.url()).await?))
    }

    async fn client_in_namespace(&self, suffix: &str) -> Result<Arc<dyn DistributedLock>> {
        let url = format!(
            "zk://{}{}-{suffix}?session_timeout=20s&connect_timeout=3s",
            self.hosts, self.namespace
        );
        Ok(Arc::new(ZkLock::connect(&url).await?))
    }

    async fn unreachable_client(&self) -> Option<Result<Arc<dyn DistributedLock>>> {
        let url = "zk://127.0.0.1:1/x?connect_timeout=2s&timeout=2s";
        Some(
            ZkLock::connect(url)
                .await
                .map(|l| Arc::new(l) as Arc<dyn DistributedLock>),
        )
    }

    fn connect_timeout(&self) -> Duration {
        Duration::from_secs(2)
    }

    async fn restart_store(&self) -> Option<Result<()>> {
        Some(self.private.as_ref()?.restart(0).await)
    }

    async fn private_store(&self) -> Option<Result<Box<dyn Harness>>> {
        let server = match PrivateZooKeeper::start(ZooKeeperOptions::default()).await {
            Ok(s) => Arc::new(s),
            Err(e) => return Some(Err(e)),
        };
        Some(Ok(Box::new(ZkHarness {
            hosts: server.hostports(),
            namespace: "/fenced-private".into(),
            private: Some(server),
        })))
    }

    fn base_ttl(&self) -> Duration {
        Duration::from_secs(2)
    }
}
