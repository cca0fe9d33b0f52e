//! FIFO waiting: each waiter queues a key of its own and watches only its
//! predecessor — etcd's own mutex recipe, rebuilt on transactions and watches
//! (etcd 3.4's Lock RPC wedges when many waiting calls are cancelled at once,
//! etcd issue 13336).
//!
//! 1. Grant the waiter's lease (kept alive while it waits: a wait may outlast
//!    the TTL) and put `<prefix>\0queue\0<key>\0<lease>` with it. Its create
//!    revision is the waiter's place in line.
//! 2. While an older queue entry exists, watch that one entry for deletion.
//! 3. At the head: the acquire transaction puts the lock key with the same
//!    lease and deletes the queue entry atomically; if a `try_acquire` caller
//!    holds the key, watch the lock key for deletion and try again.
//! 4. Having won, re-check the lease with a keep-alive (etcd #11456: a
//!    blocked waiter once returned holding an expired lease).
//!
//! Watches start one revision after the read that motivated them, so no
//! event is missed and etcd's 100 ms watch sync loop is skipped.
//! Dropping the future (cancellation) or timing out revokes the lease, which
//! deletes the queue entry and hands the turn to the next waiter.

use std::time::Duration;

use etcd_client::{EventType, WatchOptions};
use fenced_api::{
    wait::wait_deadline, Error, FencingToken, Lease, LockKey, LockOptions, Result, WaitPolicy,
};
use tokio::{task::JoinHandle, time::Instant};

use crate::{error, lock::oldest_before, EtcdLock};

/// Revokes the waiter's lease unless the wait ended in a grant.
struct WaitGuard {
    lock: EtcdLock,
    lease: i64,
    keeper: JoinHandle<()>,
    granted: bool,
}

impl Drop for WaitGuard {
    fn drop(&mut self) {
        self.keeper.abort();
        if !self.granted {
            self.lock.revoke_later(self.lease);
        }
    }
}

pub(crate) async fn acquire_fifo(
    lock: &EtcdLock,
    key: &LockKey,
    opts: &LockOptions,
) -> Result<Lease> {
    use fenced_api::DistributedLock;
    let start = Instant::now();
    if opts.wait() == WaitPolicy::NoWait {
        return lock
            .try_acquire(key, opts)
            .await?
            .ok_or_else(|| Error::Timeout {
                key: key.clone(),
                waited: start.elapsed(),
            });
    }
    let deadline = wait_deadline(opts.wait(), start);
    let owner = opts.owner_or_random();
    let (lease, granted_ttl) = lock.grant(opts.ttl()).await?;
    let keeper = {
        let lock = lock.clone();
        let every = (granted_ttl / 3).max(Duration::from_millis(100));
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(every).await;
                match lock.keep_alive_once(lease).await {
                    Ok(ttl) if ttl > 0 => {}
                    _ => return,
                }
            }
        })
    };
    let mut guard = WaitGuard {
        lock: lock.clone(),
        lease,
        keeper,
        granted: false,
    };

    let path = lock.lock_path(key);
    let queue = lock.queue_prefix(key);
    let mut entry = queue.clone();
    entry.extend_from_slice(format!("{lease:016x}").as_bytes());
    let put = lock
        .call("queue put", |mut c| {
            let (entry, owner) = (entry.clone(), owner.as_str().to_owned());
            let opts = etcd_client::PutOptions::new().with_lease(lease);
            async move { c.put(entry, owner, Some(opts)).await }
        })
        .await?;
    let my_rev = put.header().map_or(0, |h| h.revision());

    loop {
        let timeout = || Error::Timeout {
            key: key.clone(),
            waited: start.elapsed(),
        };
        let line = lock
            .call("queue read", |mut c| {
                let queue = queue.clone();
                async move { c.get(queue, Some(oldest_before(my_rev))).await }
            })
            .await?;
        if let Some(pred) = line.kvs().first() {
            let from = line.header().map_or(0, |h| h.revision()) + 1;
            if !wait_for_delete(lock, pred.key(), from, deadline).await? {
                return Err(timeout());
            }
            continue;
        }
        match lock.try_put(&path, &owner, lease, Some(&entry)).await? {
            Ok(token) => {
                guard.granted = true;
                drop(guard);
                let sent = Instant::now();
                let ttl_left = lock.keep_alive_once(lease).await?;
                if ttl_left <= 0 {
                    return Err(Error::backend(
                        error::BACKEND,
                        true,
                        "the lease expired while waiting; the grant was void",
                    ));
                }
                tracing::debug!(key = %key, token, waited_ms = start.elapsed().as_millis() as u64, "etcd lock granted after waiting");
                return Ok(Lease::new(
                    key.clone(),
                    owner,
                    FencingToken::new(token),
                    Duration::from_secs(ttl_left as u64),
                    sent,
                ));
            }
            Err((holder, revision)) => {
                lock.check_reentry(key, opts, holder.as_deref())?;
                if !wait_for_delete(lock, &path, revision + 1, deadline).await? {
                    return Err(timeout());
                }
            }
        }
    }
}

/// Waits until `key` is deleted at or after `from` (true), or the deadline
/// passes (false).
async fn wait_for_delete(
    lock: &EtcdLock,
    key: &[u8],
    from: i64,
    deadline: Option<Instant>,
) -> Result<bool> {
    let mut stream = lock
        .call("watch", |mut c| {
            let key = key.to_vec();
            async move {
                c.watch(key, Some(WatchOptions::new().with_start_revision(from)))
                    .await
            }
        })
        .await?;
    loop {
        let next = stream.message();
        let msg = match deadline {
            Some(d) => match tokio::time::timeout_at(d, next).await {
                Ok(m) => m,
                Err(_) => return Ok(false),
            },
            None => next.await,
        };
        let Some(resp) = msg.map_err(error::map)? else {
            return Err(Error::backend(
                error::BACKEND,
                true,
                "the watch stream closed",
            ));
        };
        // A cancelled watch (e.g. compaction) proves nothing: re-read.
        if resp.canceled()
            || resp
                .events()
                .iter()
                .any(|e| e.event_type() == EventType::Delete)
        {
            return Ok(true);
        }
    }
}
