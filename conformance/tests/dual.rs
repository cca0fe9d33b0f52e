//! The suite on `DualLock(memory, memory)`: two independent stores held as one.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::{sync::Arc, time::Duration};

use async_trait::async_trait;
use fenced_api::{DistributedLock, DualLock, MemoryLock, Result};
use fenced_conformance::{Harness, MemoryHarness};

struct DualHarness {
    old: MemoryHarness,
    new: MemoryHarness,
}

#[async_trait]
impl Harness for DualHarness {
    async fn client(&self) -> Result<Arc<dyn DistributedLock>> {
        Ok(Arc::new(DualLock::new(
            Arc::new(self.old.memory_client()),
            Arc::new(self.new.memory_client()),
        )))
    }

    async fn client_in_namespace(&self, suffix: &str) -> Result<Arc<dyn DistributedLock>> {
        Ok(Arc::new(DualLock::new(
            self.old.client_in_namespace(suffix).await?,
            self.new.client_in_namespace(suffix).await?,
        )))
    }

    async fn unreachable_client(&self) -> Option<Result<Arc<dyn DistributedLock>>> {
        let down = MemoryLock::new();
        down.set_available(false);
        Some(Ok(Arc::new(DualLock::new(
            Arc::new(self.old.memory_client()),
            Arc::new(down),
        ))))
    }

    // Both halves are memory stores: their timings are the dual's.
    fn in_process(&self) -> bool {
        self.old.in_process()
    }

    fn connect_timeout(&self) -> Duration {
        self.old.connect_timeout()
    }

    fn base_ttl(&self) -> Duration {
        self.old.base_ttl()
    }
}

fenced_conformance::conformance_tests!(
    DualHarness {
        old: MemoryHarness::new(),
        new: MemoryHarness::new()
    },
    skips = [
        c07_tokens_increase_after_restart: "both halves are MemoryLock: not durable",
        c08_waiters_served_in_order: "DualLock declares no fifo: a waiter queues on each store in turn",
    ], without_semaphores = "DualLock migrates mutexes only: it has no semaphores"
);
