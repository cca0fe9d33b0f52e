//! What a backend supplies to run the suite.

use std::{sync::Arc, time::Duration};

use async_trait::async_trait;
use fenced_api::{DistributedLock, Result};

/// Hands the suite independent clients of one store.
///
/// Implement it once per backend (per MySQL strategy) and pass it to
/// [`conformance_tests!`](crate::conformance_tests) or [`run_all`](crate::run_all).
///
/// Every call to [`client`](Harness::client) must return a **new, independent**
/// client — its own connection or pool — so contention cases really cross
/// connections and backend instances, as separate nodes would. All clients of
/// one harness share a namespace unique to the run (a fresh uuid table suffix
/// or key prefix), so parallel runs against a shared server never meet.
#[async_trait]
pub trait Harness: Send + Sync {
    /// A new, independent client in this run's namespace.
    async fn client(&self) -> Result<Arc<dyn DistributedLock>>;

    /// A new client on the same store in another namespace derived from
    /// `suffix` (distinct suffixes, distinct namespaces). Used by the C20 case.
    async fn client_in_namespace(&self, suffix: &str) -> Result<Arc<dyn DistributedLock>>;

    /// A client configured for a store that does not answer (closed port,
    /// blackholed address), or `None` when the backend cannot be unreachable
    /// (in-process stores). Used by the C19 case.
    async fn unreachable_client(&self) -> Option<Result<Arc<dyn DistributedLock>>> {
        None
    }

    /// Whether the store lives inside this process (and so cannot be
    /// unreachable). Only then may [`unreachable_client`](Harness::unreachable_client)
    /// return `None` without failing the C19 case.
    fn in_process(&self) -> bool {
        false
    }

    /// The bound within which operations on an unreachable store must fail.
    fn connect_timeout(&self) -> Duration {
        Duration::from_secs(5)
    }

    /// Restarts the store, keeping its data, or `None` when the harness cannot
    /// (a shared server must never be restarted under other running tests).
    async fn restart_store(&self) -> Option<Result<()>> {
        None
    }

    /// For the durability case (C7 across restarts): a harness on a private
    /// store — its own server process — whose [`restart_store`](Harness::restart_store)
    /// works. `None` when the harness cannot provide one; a backend that
    /// declares itself durable then fails that case.
    async fn private_store(&self) -> Option<Result<Box<dyn Harness>>> {
        None
    }

    /// The TTL the timing cases build on. Longer than the store's minimum and
    /// comfortably above a round trip; expiry cases wait about 2–3 of these.
    fn base_ttl(&self) -> Duration {
        Duration::from_secs(1)
    }
}

/// Runs the suite on a store's semaphores (its
/// [`SemaphoreStore`](fenced_api::SemaphoreStore)) through another
/// harness: every client is the inner client's
/// [`semaphores`](DistributedLock::semaphores), so the mutex cases C1–C20
/// check the semaphore of one permit — the line, its tokens, expiry,
/// waiting and cancellation — with the cases written for mutexes.
///
/// A semaphore store's own `semaphores` are itself, so the family cases run
/// on it unchanged. A harness whose store has no semaphores fails every
/// case with a message that says so.
#[derive(Debug)]
pub struct SemaphoresAsMutex<H>(pub H);

fn semaphores_of(lock: Arc<dyn DistributedLock>) -> Result<Arc<dyn DistributedLock>> {
    match lock.semaphores() {
        Some(s) => Ok(s),
        None => Err(fenced_api::Error::Unsupported {
            backend: lock.capabilities().backend_name(),
            what: "semaphores (SemaphoresAsMutex needs a store that has them)".into(),
        }),
    }
}

#[async_trait]
impl<H: Harness> Harness for SemaphoresAsMutex<H> {
    async fn client(&self) -> Result<Arc<dyn DistributedLock>> {
        semaphores_of(self.0.client().await?)
    }

    async fn client_in_namespace(&self, suffix: &str) -> Result<Arc<dyn DistributedLock>> {
        semaphores_of(self.0.client_in_namespace(suffix).await?)
    }

    async fn unreachable_client(&self) -> Option<Result<Arc<dyn DistributedLock>>> {
        Some(self.0.unreachable_client().await?.and_then(semaphores_of))
    }

    fn in_process(&self) -> bool {
        self.0.in_process()
    }

    fn connect_timeout(&self) -> Duration {
        self.0.connect_timeout()
    }

    async fn restart_store(&self) -> Option<Result<()>> {
        self.0.restart_store().await
    }

    async fn private_store(&self) -> Option<Result<Box<dyn Harness>>> {
        Some(
            self.0
                .private_store()
                .await?
                .map(|h| Box::new(SemaphoresAsMutex(h)) as Box<dyn Harness>),
        )
    }

    fn base_ttl(&self) -> Duration {
        self.0.base_ttl()
    }
}

#[async_trait]
impl Harness for Box<dyn Harness> {
    async fn client(&self) -> Result<Arc<dyn DistributedLock>> {
        (**self).client().await
    }

    async fn client_in_namespace(&self, suffix: &str) -> Result<Arc<dyn DistributedLock>> {
        (**self).client_in_namespace(suffix).await
    }

    async fn unreachable_client(&self) -> Option<Result<Arc<dyn DistributedLock>>> {
        (**self).unreachable_client().await
    }

    fn in_process(&self) -> bool {
        (**self).in_process()
    }

    fn connect_timeout(&self) -> Duration {
        (**self).connect_timeout()
    }

    async fn restart_store(&self) -> Option<Result<()>> {
        (**self).restart_store().await
    }

    async fn private_store(&self) -> Option<Result<Box<dyn Harness>>> {
        (**self).private_store().await
    }

    fn base_ttl(&self) -> Duration {
        (**self).base_ttl()
    }
}
