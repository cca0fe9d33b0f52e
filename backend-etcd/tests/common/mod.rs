//! Test support: the conformance harness over the shared etcd, and private
//! etcd processes (single node or a 3-member cluster) for destructive tests.

#![allow(dead_code, unreachable_pub, clippy::unwrap_used, clippy::expect_used)]

pub mod private;

use std::{sync::Arc, time::Duration};

use tokio::time::Instant;

use async_trait::async_trait;
use fenced_api::{DistributedLock, LockKey, Result};
use fenced_conformance::Harness;
use fenced_etcd::{etcd_client, EtcdLock};

/// `host:port` of the shared etcd (`FENCED_TEST_ETCD_URL`) once it answers; a test
/// whose server is down fails with a message naming `scripts/services.sh`.
pub use fenced_testkit::shared::require_etcd_hostport as server_hostport;

/// A namespace prefix unique to this test process.
pub fn run_prefix() -> &'static str {
    fenced_testkit::run_name("fenced-test-")
}

/// A raw etcd client on the shared server.
pub async fn raw() -> etcd_client::Client {
    let hostport = server_hostport().await;
    etcd_client::Client::connect([format!("http://{hostport}")], None)
        .await
        .unwrap()
}

/// `<prefix>\0lock\0<key>\0`: the line of a key (holder first).
pub fn line_prefix(k: &LockKey) -> Vec<u8> {
    let mut p = run_prefix().as_bytes().to_vec();
    p.extend_from_slice(b"\0lock\0");
    p.extend_from_slice(k.as_bytes());
    p.push(0);
    p
}

/// Waits until the line of `k` holds `n` entries; returns them, oldest first.
pub async fn line_of(
    c: &mut etcd_client::Client,
    k: &LockKey,
    n: usize,
) -> Vec<etcd_client::KeyValue> {
    let all = etcd_client::GetOptions::new().with_prefix().with_sort(
        etcd_client::SortTarget::Create,
        etcd_client::SortOrder::Ascend,
    );
    let bound = Instant::now() + Duration::from_secs(10);
    loop {
        let r = c.get(line_prefix(k), Some(all.clone())).await.unwrap();
        if r.kvs().len() == n {
            return r.kvs().to_vec();
        }
        assert!(Instant::now() < bound, "the line never held {n} entries");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

pub struct EtcdHarness {
    hostport: String,
    prefix: String,
    private: Option<Arc<private::PrivateEtcd>>,
}

impl EtcdHarness {
    pub async fn new() -> Self {
        EtcdHarness {
            hostport: server_hostport().await,
            prefix: run_prefix().to_owned(),
            private: None,
        }
    }

    pub fn url(&self) -> String {
        format!(
            "etcd://{}/{}?connect_timeout=3s&timeout=5s",
            self.hostport, self.prefix
        )
    }

    pub async fn lock(&self) -> EtcdLock {
        EtcdLock::connect(&self.url()).await.unwrap()
    }
}

#[async_trait]
impl Harness for EtcdHarness {
    async fn client(&self) -> Result<Arc<dyn DistributedLock>> {
        Ok(Arc::new(EtcdLock::connect(&self.url()).await?))
    }

    async fn client_in_namespace(&self, suffix: &str) -> Result<Arc<dyn DistributedLock>> {
        let url = format!(
            "etcd://{}/{}-{suffix}?connect_timeout=3s",
            self.hostport, self.prefix
        );
        Ok(Arc::new(EtcdLock::connect(&url).await?))
    }

    async fn unreachable_client(&self) -> Option<Result<Arc<dyn DistributedLock>>> {
        let url = "etcd://127.0.0.1:1/x?connect_timeout=2s&timeout=2s";
        Some(
            EtcdLock::connect(url)
                .await
                .map(|l| Arc::new(l) as Arc<dyn DistributedLock>),
        )
    }

    fn connect_timeout(&self) -> Duration {
        Duration::from_secs(2)
    }

    async fn restart_store(&self) -> Option<Result<()>> {
        Some(self.private.as_ref()?.restart().await)
    }

    async fn private_store(&self) -> Option<Result<Box<dyn Harness>>> {
        let server = match private::PrivateEtcd::start().await {
            Ok(s) => Arc::new(s),
            Err(e) => return Some(Err(e)),
        };
        Some(Ok(Box::new(EtcdHarness {
            hostport: server.hostport(),
            prefix: "fenced-private".into(),
            private: Some(server),
        })))
    }

    fn base_ttl(&self) -> Duration {
        Duration::from_secs(2)
    }
}
