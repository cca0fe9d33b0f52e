//! Batched renewals: one queue per [`LockClient`](crate::LockClient),
//! drained into [`DistributedLock::extend_many`].
//!
//! Every held lock has its own watchdog, which decides *when* to renew. A
//! client holding thousands of locks would otherwise send thousands of
//! `extend` calls per renewal interval — one write each on a SQL store,
//! which then spends its capacity renewing instead of granting (10 000 keys
//! held with a 6 s TTL is 5 000 writes a second). Here the watchdogs' requests
//! meet in a queue; a batch takes whatever has queued up while the previous
//! batches were in flight, and what arrives within a short linger after its
//! first renewal ([`linger`]: a 200th of the TTL, at most 10 ms, which the
//! watchdog's margin of a third of the TTL absorbs), so a crowd goes out as
//! a few statements: 100 000 locks renewed every 2 s are about 200 batches a
//! second instead of 50 000 calls.

use std::{
    sync::{Arc, OnceLock},
    time::Duration,
};

use tokio::sync::{mpsc, oneshot, Semaphore};

use crate::{DistributedLock, Lease, Result};

/// Most leases in one `extend_many` call.
const MAX_BATCH: usize = 512;
/// Batches in flight at once, per client.
const IN_FLIGHT: usize = 4;
/// The longest a batch waits for more renewals after its first.
const MAX_LINGER: Duration = Duration::from_millis(10);

/// How long a batch waits for more renewals after its first: a 200th of the
/// TTL, at most [`MAX_LINGER`]. The lease counts from when its batch is
/// sent, so a linger shortens no lease; it only spends a sliver of the
/// watchdog's margin.
fn linger(ttl: Duration) -> Duration {
    (ttl / 200).min(MAX_LINGER)
}

struct Request {
    lease: Lease,
    reply: oneshot::Sender<Result<Lease>>,
}

/// The renewal queue of one client; its task starts with the first renewal.
pub(crate) struct Renewer {
    ttl: Duration,
    queue: OnceLock<mpsc::UnboundedSender<Request>>,
}

impl Renewer {
    pub(crate) fn new(ttl: Duration) -> Self {
        Renewer {
            ttl,
            queue: OnceLock::new(),
        }
    }

    /// Renews `lease` for the client's TTL, batched with the renewals queued
    /// at the same time. Same result as `lock.extend(lease, ttl)`.
    ///
    /// Cancel safety: dropping the future before its batch is sent takes the
    /// lease out of the batch; after that the renewal may still happen (an
    /// extend is owner- and token-checked, so it never touches another
    /// holder's lock, and never recreates a released one).
    pub(crate) async fn renew(
        &self,
        lock: &Arc<dyn DistributedLock>,
        lease: &Lease,
    ) -> Result<Lease> {
        let queue = self
            .queue
            .get_or_init(|| spawn_batcher(Arc::clone(lock), self.ttl));
        let (reply, answer) = oneshot::channel();
        let request = Request {
            lease: lease.clone(),
            reply,
        };
        // The batcher is gone only if the runtime that started it shut down
        // while this client lives on in another: renew directly then.
        if queue.send(request).is_err() {
            return lock.extend(lease, self.ttl).await;
        }
        match answer.await {
            Ok(result) => result,
            Err(_) => lock.extend(lease, self.ttl).await,
        }
    }
}

fn spawn_batcher(lock: Arc<dyn DistributedLock>, ttl: Duration) -> mpsc::UnboundedSender<Request> {
    let (tx, rx) = mpsc::unbounded_channel();
    tokio::spawn(batcher(lock, ttl, rx));
    tx
}

/// Runs until every sender (the client and its guards) is gone.
async fn batcher(
    lock: Arc<dyn DistributedLock>,
    ttl: Duration,
    mut queue: mpsc::UnboundedReceiver<Request>,
) {
    let slots = Arc::new(Semaphore::new(IN_FLIGHT));
    while let Some(first) = queue.recv().await {
        // Wait for a free slot *before* draining: what queues up meanwhile
        // joins this batch.
        let Ok(slot) = Arc::clone(&slots).acquire_owned().await else {
            return;
        };
        let mut batch = vec![first];
        let until = tokio::time::Instant::now() + linger(ttl);
        while batch.len() < MAX_BATCH {
            // A renewal already queued is taken even once the linger is
            // over: `timeout_at` polls the receive before its deadline.
            let next = tokio::time::timeout_at(until, queue.recv())
                .await
                .ok()
                .flatten();
            match next {
                Some(r) => batch.push(r),
                None => break,
            }
        }
        // Watchdogs that stopped (released, lost) while queued: not renewed.
        batch.retain(|r| !r.reply.is_closed());
        if batch.is_empty() {
            continue;
        }
        let lock = Arc::clone(&lock);
        tokio::spawn(async move {
            let _slot = slot;
            let leases: Vec<Lease> = batch.iter().map(|r| r.lease.clone()).collect();
            tracing::trace!(leases = leases.len(), "renewing a batch");
            let results = lock.extend_many(&leases, ttl).await;
            if results.len() != leases.len() {
                tracing::error!(
                    sent = leases.len(),
                    got = results.len(),
                    "extend_many returned a result count that does not match its batch; renewing one by one"
                );
            }
            // A short answer leaves some replies unsent: their watchdogs fall
            // back to a plain extend (see `renew`).
            for (request, result) in batch.into_iter().zip(results) {
                let _ = request.reply.send(result);
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use async_trait::async_trait;

    use super::*;
    use crate::{LockKey, LockOptions, MemoryLock};

    /// A memory store that records the size of every `extend_many` batch.
    #[derive(Debug, Default)]
    struct Counting {
        inner: MemoryLock,
        batches: Mutex<Vec<usize>>,
    }

    #[async_trait]
    impl crate::WrapLock for Counting {
        fn inner(&self) -> &dyn DistributedLock {
            &self.inner
        }
        async fn extend_many(&self, leases: &[Lease], ttl: Duration) -> Vec<Result<Lease>> {
            self.batches.lock().unwrap().push(leases.len());
            self.inner.extend_many(leases, ttl).await
        }
    }
    crate::wrap_lock!(Counting);

    #[test]
    fn the_linger_is_a_sliver_of_the_ttl() {
        assert_eq!(linger(Duration::from_secs(6)), MAX_LINGER);
        assert_eq!(linger(Duration::from_millis(200)), Duration::from_millis(1));
    }

    /// Two renewals 3 ms apart (a 6 s TTL lingers 10 ms) go out as one
    /// batch; one 30 ms later goes out alone.
    #[tokio::test(start_paused = true)]
    async fn renewals_within_the_linger_share_a_batch() {
        let store = Arc::new(Counting::default());
        let lock: Arc<dyn DistributedLock> = store.clone();
        let opts = LockOptions::builder()
            .ttl(Duration::from_secs(6))
            .build()
            .unwrap();
        let mut leases = Vec::new();
        for k in ["a", "b", "c"] {
            let key = LockKey::new(k).unwrap();
            leases.push(lock.try_acquire(&key, &opts).await.unwrap().unwrap());
        }
        let renewer = Renewer::new(Duration::from_secs(6));
        let (a, b, c) = tokio::join!(
            renewer.renew(&lock, &leases[0]),
            async {
                tokio::time::sleep(Duration::from_millis(3)).await;
                renewer.renew(&lock, &leases[1]).await
            },
            async {
                tokio::time::sleep(Duration::from_millis(30)).await;
                renewer.renew(&lock, &leases[2]).await
            }
        );
        assert!(a.is_ok() && b.is_ok() && c.is_ok(), "{a:?} {b:?} {c:?}");
        assert_eq!(*store.batches.lock().unwrap(), [2, 1]);
    }
}
