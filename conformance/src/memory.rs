//! The harness for the in-memory reference backend.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use fenced_api::{DistributedLock, MemoryLock, Result};

use crate::Harness;

/// Runs the suite on [`MemoryLock`]: every client is a new handle on one
/// store, in a namespace unique to this harness.
#[derive(Debug, Clone)]
pub struct MemoryHarness {
    store: MemoryLock,
    namespace: String,
}

impl MemoryHarness {
    /// A harness over a fresh store.
    pub fn new() -> Self {
        MemoryHarness {
            store: MemoryLock::new(),
            namespace: format!("run-{}", uuid::Uuid::new_v4().simple()),
        }
    }

    /// A new handle on the harness's store, in its namespace (no boxing), for
    /// wrappers that decorate the memory backend.
    pub fn memory_client(&self) -> MemoryLock {
        self.store.with_namespace(&self.namespace)
    }
}

impl Default for MemoryHarness {
    fn default() -> Self {
        Self::new()
    }
}

#[async_trait]
impl Harness for MemoryHarness {
    async fn client(&self) -> Result<Arc<dyn DistributedLock>> {
        Ok(Arc::new(self.memory_client()))
    }

    async fn client_in_namespace(&self, suffix: &str) -> Result<Arc<dyn DistributedLock>> {
        Ok(Arc::new(
            self.store
                .with_namespace(format!("{}-{suffix}", self.namespace)),
        ))
    }

    async fn unreachable_client(&self) -> Option<Result<Arc<dyn DistributedLock>>> {
        // The closest thing to an unreachable in-process store: one in outage.
        let down = MemoryLock::new();
        down.set_available(false);
        Some(Ok(Arc::new(down)))
    }

    fn in_process(&self) -> bool {
        true
    }

    fn connect_timeout(&self) -> Duration {
        Duration::from_millis(100)
    }

    fn base_ttl(&self) -> Duration {
        Duration::from_millis(500)
    }
}
