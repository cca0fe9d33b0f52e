//! FIFO waiting: etcd's own mutex recipe (each contender a key of its own,
//! the oldest one holds, each waiter watches only the one just ahead of
//! it), built on transactions and watches rather than etcd's Lock RPC
//! (etcd 3.4's Lock RPC wedges when many waiting calls are cancelled at
//! once, etcd issue 13336).
//!
//! The line of `key` is its entries `<prefix>\0lock\0<key>\0<owner>`, on
//! the contenders' session leases, ordered by create revision. The oldest
//! entry is the holder and its create revision the token; deleting it
//! (release, expiry, force release) makes the next one the holder without
//! any write — the hand-off costs the release and a watch event.
//!
//! 1. **Enqueue** (one transaction): if the line is empty, put our entry —
//!    the lock is ours (uncontended, this is the whole acquire). Otherwise
//!    put our entry and read the holder and the last in line (our
//!    predecessor).
//! 2. **Wait** for the predecessor's deletion on the client's shared watch
//!    stream (module `watch`; never etcd's 100 ms sync loop), keeping the
//!    session lease alive meanwhile.
//! 3. **Promoted**: if the predecessor was the holder, nothing older than us
//!    can exist any more (entries are only ever added at the end), so we
//!    hold — no request. We know it was the holder if it was the oldest
//!    entry when we looked, or if it *announced* itself: a promoted waiter
//!    rewrites its own entry in the background (same create revision, so
//!    same token and place), and only a holder ever writes an existing
//!    entry. Otherwise (a waiter ahead gave up, or the announcement was
//!    late) one read-only transaction tells whether anyone is still ahead:
//!    if not we hold, else we watch the new predecessor.
//!
//! A contended acquisition thus costs 2 writes on its own path (enqueue,
//! release), one background write (the announcement) and rarely a read,
//! plus watch messages. Dropping the future (cancellation) or timing out
//! deletes our entry in the background ([`Attempt`]) — which
//! also gives back a lock granted in that same instant.

use std::{sync::Arc, time::Duration};

use etcd_client::{Compare, CompareOp, PutOptions, Txn, TxnOp, TxnOpResponse, TxnResponse};
use fenced_api::{
    wait::wait_deadline, Error, Lease, LockKey, LockOptions, Owner, Result, WaitPolicy,
};
use tokio::{task::JoinHandle, time::Instant};

use crate::{
    error,
    lock::{newest, newest_before, oldest, revision},
    session::{Class, RefreshError, View},
    watch::Seen,
    EtcdLock,
};

/// Cleans up after an acquisition that did not finish: our entry — a place
/// in line, or a lock granted by a request whose answer never arrived.
/// Armed until the outcome is known; on drop it deletes, in the background,
/// our entry if it exists — now, and once more after twice the operation
/// timeout (a request in flight could still be applied after the first pass).
pub(crate) struct Attempt {
    lock: EtcdLock,
    entry: Vec<u8>,
    owner: Owner,
    lease: i64,
    /// An explicit owner may also hold the key through this client (with
    /// the same entry): never delete that hold.
    explicit: bool,
    armed: bool,
}

impl Attempt {
    pub(crate) fn new(
        lock: &EtcdLock,
        key: &LockKey,
        owner: &Owner,
        lease: i64,
        explicit: bool,
    ) -> Attempt {
        Attempt {
            lock: lock.clone(),
            entry: lock.entry_path(key, owner.as_str().as_bytes()),
            owner: owner.clone(),
            lease,
            explicit,
            armed: true,
        }
    }

    pub(crate) fn disarm(mut self) {
        self.armed = false;
    }

    /// One cleanup pass: deletes our entry if it is ours (our owner, our
    /// lease) — unless an explicit owner holds the key through this client.
    async fn clean(lock: &EtcdLock, entry: &[u8], owner: &Owner, lease: i64, explicit: bool) {
        if explicit && lock.inner.tracker.holds(entry) {
            return;
        }
        let txn = Txn::new()
            .when([
                Compare::value(entry.to_vec(), CompareOp::Equal, owner.as_str()),
                Compare::lease(entry.to_vec(), CompareOp::Equal, lease),
            ])
            .and_then([TxnOp::delete(entry.to_vec(), None)]);
        if let Err(e) = lock.txn("abandon txn", txn).await {
            tracing::debug!(error = %e, "cleaning up an abandoned acquire failed; it expires with the session lease");
        }
    }

    /// Cleans up now (before trying again), then disarms.
    pub(crate) async fn clean_now(self) {
        Attempt::clean(
            &self.lock,
            &self.entry,
            &self.owner,
            self.lease,
            self.explicit,
        )
        .await;
        self.disarm();
    }
}

impl Drop for Attempt {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        // The first pass keeps the client alive for its one request (the
        // dropped future may have owned the last handle on it); the second
        // runs only if the client is still in use — otherwise its session
        // leases, and anything left on them, expire one TTL after its last use.
        let lock = self.lock.clone();
        let weak = Arc::downgrade(&self.lock.inner);
        let (entry, owner) = (self.entry.clone(), self.owner.clone());
        let (lease, explicit) = (self.lease, self.explicit);
        let later = self.lock.inner.config.op_timeout * 2;
        let cleanup = async move {
            Attempt::clean(&lock, &entry, &owner, lease, explicit).await;
            drop(lock);
            tokio::time::sleep(later).await;
            if let Some(inner) = weak.upgrade() {
                Attempt::clean(&EtcdLock { inner }, &entry, &owner, lease, explicit).await;
            }
        };
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(cleanup);
        }
    }
}

/// What the enqueue / line-read transactions saw.
struct Line {
    /// The holder's entry: (key, owner).
    holder: Option<(Vec<u8>, Vec<u8>)>,
    /// The entry just ahead of ours.
    predecessor: Option<Vec<u8>>,
    /// Whether our own entry exists (it was put, or it is still there).
    ours: bool,
    /// The revision all of this was read at.
    revision: i64,
}

/// Reads `[Get(oldest), Get(predecessor), <ours>]` answers: `ours` is a
/// nested transaction that put our entry (enqueue) or a get of our entry,
/// which must still have create revision `my_rev` (line read).
fn line(resp: &TxnResponse, my_rev: i64) -> Line {
    let ops = resp.op_responses();
    let kv = |i: usize| match ops.get(i) {
        Some(TxnOpResponse::Get(g)) => g.kvs().first().cloned(),
        _ => None,
    };
    let ours = match ops.get(2) {
        Some(TxnOpResponse::Txn(t)) => t.succeeded(),
        Some(TxnOpResponse::Get(g)) => g
            .kvs()
            .first()
            .is_some_and(|e| e.create_revision() == my_rev),
        _ => false,
    };
    Line {
        holder: kv(0).map(|h| (h.key().to_vec(), h.value().to_vec())),
        predecessor: kv(1).map(|p| p.key().to_vec()),
        ours,
        revision: revision(resp),
    }
}

/// How a wait for a deletion ended.
enum Waited {
    /// Deleted; `announced`: its owner had announced holding the lock first.
    Deleted {
        announced: bool,
    },
    /// The watch ended without telling: read the line to know.
    Unsure,
    TimedOut,
    /// The session lease (and our entry with it) is gone.
    LeaseGone,
}

pub(crate) async fn acquire_fifo(
    lock: &EtcdLock,
    key: &LockKey,
    opts: &LockOptions,
) -> Result<Lease> {
    use fenced_api::DistributedLock;
    let start = Instant::now();
    let timeout = || Error::Timeout {
        key: key.clone(),
        waited: start.elapsed(),
    };
    if opts.wait() == WaitPolicy::NoWait {
        return lock.try_acquire(key, opts).await?.ok_or_else(timeout);
    }
    let deadline = wait_deadline(opts.wait(), start);
    let explicit = opts.owner().is_some();
    let line_prefix = lock.line_prefix(key);
    let mut owner = opts.owner_or_random();
    let mut stale: Option<Attempt> = None;

    'enqueue: for _ in 0..3 {
        // Queueing again (our session lease ended or was replaced): an entry
        // of ours may linger on the old lease. A generated owner simply
        // takes a new name; an explicit one clears the old entry first.
        if let Some(old) = stale.take() {
            if explicit {
                old.clean_now().await;
            } else {
                drop(old);
                owner = Owner::random();
            }
        }
        let value = owner.as_str().as_bytes().to_vec();
        let entry = lock.entry_path(key, &value);
        let (class, view) = lock.session(opts.ttl()).await?;
        let attempt = Attempt::new(lock, key, &owner, view.id, explicit);
        let put = || {
            TxnOp::put(
                entry.clone(),
                value.clone(),
                Some(PutOptions::new().with_lease(view.id)),
            )
        };
        let txn = Txn::new()
            .when([
                Compare::create_revision(line_prefix.clone(), CompareOp::Equal, 0).with_prefix(),
            ])
            .and_then([put()])
            .or_else([
                TxnOp::get(line_prefix.clone(), Some(oldest())),
                TxnOp::get(line_prefix.clone(), Some(newest())),
                // Our entry, unless this owner already holds or waits.
                TxnOp::txn(
                    Txn::new()
                        .when([Compare::create_revision(entry.clone(), CompareOp::Equal, 0)])
                        .and_then([put()]),
                ),
            ]);
        let (resp, fresh) = tokio::join!(lock.txn("enqueue txn", txn), lock.freshen(&class, view));
        let Some(resp) = resp? else {
            attempt.disarm();
            class.invalidate(view.id);
            continue;
        };
        let my_rev = revision(&resp);
        if resp.succeeded() {
            match fresh {
                Ok(v) => {
                    attempt.disarm();
                    return Ok(lock.hold(key, owner, my_rev, v));
                }
                Err(_) => {
                    // The lease ended, and the lock with it (or was replaced).
                    stale = Some(attempt);
                    continue;
                }
            }
        }
        let first = line(&resp, my_rev);
        if !first.ours {
            attempt.disarm();
            lock.check_reentry(key, opts, first.holder.as_ref().map(|h| h.1.as_slice()))?;
            return Err(Error::AlreadyHeld { key: key.clone() });
        }
        let Some(mut ahead) = first.predecessor else {
            // The line was not empty a moment ago, yet holds nothing older
            // than us: we are first.
            match lock.freshen(&class, view).await {
                Ok(v) => {
                    attempt.disarm();
                    return Ok(lock.hold(key, owner, my_rev, v));
                }
                Err(_) => {
                    stale = Some(attempt);
                    continue;
                }
            }
        };
        let mut ahead_holds = first.holder.as_ref().is_some_and(|h| h.0 == ahead);
        let mut known = my_rev;
        loop {
            let deleted = match wait_deleted(lock, &class, view.id, &ahead, known, deadline).await?
            {
                Waited::Deleted { announced } => {
                    ahead_holds |= announced;
                    true
                }
                Waited::Unsure => false,
                Waited::TimedOut => return Err(timeout()),
                Waited::LeaseGone => {
                    stale = Some(attempt);
                    continue 'enqueue;
                }
            };
            let current = class.view().filter(|v| v.id == view.id);
            if deleted && ahead_holds {
                // The holder just left and nobody can queue ahead of us: we
                // hold, with no request — our entry lives while the session
                // lease does.
                if let Some(v) = current.filter(|v| v.valid_until > Instant::now()) {
                    match lock.freshen(&class, v).await {
                        Ok(v) => {
                            attempt.disarm();
                            return Ok(granted(lock, key, owner, my_rev, v, start));
                        }
                        Err(_) => {
                            stale = Some(attempt);
                            continue 'enqueue;
                        }
                    }
                }
            }
            // Someone ahead of us left: is anyone still in front?
            let look = Txn::new().and_then([
                TxnOp::get(line_prefix.clone(), Some(oldest())),
                TxnOp::get(line_prefix.clone(), Some(newest_before(my_rev))),
                TxnOp::get(entry.clone(), None),
            ]);
            let (resp, fresh) = tokio::join!(
                lock.txn("line read", look),
                lock.freshen(&class, current.unwrap_or(view))
            );
            let Some(resp) = resp? else {
                stale = Some(attempt);
                continue 'enqueue;
            };
            let now = line(&resp, my_rev);
            if !now.ours {
                // Our entry vanished (its lease ended): queue again.
                stale = Some(attempt);
                continue 'enqueue;
            }
            match now.predecessor {
                None => match fresh {
                    Ok(v) => {
                        attempt.disarm();
                        return Ok(granted(lock, key, owner, my_rev, v, start));
                    }
                    Err(_) => {
                        stale = Some(attempt);
                        continue 'enqueue;
                    }
                },
                Some(p) => {
                    ahead_holds = now.holder.as_ref().is_some_and(|h| h.0 == p);
                    ahead = p;
                    known = now.revision;
                }
            }
        }
    }
    Err(Error::backend(
        error::BACKEND,
        true,
        "the session lease vanished three times while queueing",
    ))
}

/// A waiter became the holder: track it, and announce it to the next in
/// line — a put on our own entry (same create revision, so the token and the
/// place stay) that its watch sees. The next waiter then knows it is next and
/// takes over on our deletion without reading the line. Sent in the
/// background and guarded (it never re-creates a released entry); if it is
/// late or lost, the next waiter reads the line instead.
fn granted(
    lock: &EtcdLock,
    key: &LockKey,
    owner: Owner,
    token: i64,
    view: View,
    start: Instant,
) -> Lease {
    tracing::debug!(key = %key, token, waited_ms = start.elapsed().as_millis() as u64, "etcd lock granted after waiting");
    let entry = lock.entry_path(key, owner.as_str().as_bytes());
    let announce = Txn::new()
        .when([Compare::create_revision(
            entry.clone(),
            CompareOp::Equal,
            token,
        )])
        .and_then([TxnOp::put(
            entry,
            Vec::new(),
            Some(PutOptions::new().with_ignore_value().with_ignore_lease()),
        )]);
    let background = lock.clone();
    tokio::spawn(async move {
        if let Err(e) = background.txn("announce txn", announce).await {
            tracing::debug!(error = %e, "announcing the new holder failed; the next waiter reads the line");
        }
    });
    lock.hold(key, owner, token, view)
}

/// Waits until `key` — present at `known` — is deleted, the wait deadline
/// passes, or the session lease ends. Keeps the session lease alive.
async fn wait_deleted(
    lock: &EtcdLock,
    class: &Arc<Class>,
    lease: i64,
    key: &[u8],
    known: i64,
    deadline: Option<Instant>,
) -> Result<Waited> {
    let mut watch = lock.watch(key).await?;
    let mut announced = false;
    if watch.after > known {
        // The watch starts later than our read: was it deleted in between?
        let present = lock
            .call("get", |mut c| {
                let key = key.to_vec();
                async move {
                    c.get(key, Some(etcd_client::GetOptions::new().with_count_only()))
                        .await
                }
            })
            .await?
            .count()
            > 0;
        if !present {
            return Ok(Waited::Deleted { announced });
        }
    }
    // Often enough that the view stays fresh (an eighth of a TTL): a waiter
    // promoted by an event then needs no keep-alive before returning.
    // Waiters of one client share these (refreshes coalesce).
    let every = class
        .view()
        .map_or(Duration::from_secs(1), |v: View| v.ttl / 10)
        .max(Duration::from_millis(100));
    let mut next_refresh = Instant::now() + every;
    // The keep-alive runs beside the watch: an event never waits for it.
    let mut refreshing: Option<JoinHandle<std::result::Result<View, RefreshError>>> = None;
    loop {
        let far = Instant::now() + Duration::from_secs(3600);
        tokio::select! {
            seen = watch.next() => match seen {
                Seen::Deleted => return Ok(Waited::Deleted { announced }),
                // Only a holder writes its existing entry (the announcement
                // after a promotion, or an extend moving it to another lease).
                Seen::Put => announced = true,
                Seen::Other => {}
                Seen::Ended => {
                    // Re-read rather than trust silence; do not spin on a
                    // stream that keeps breaking.
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    return Ok(Waited::Unsure);
                }
            },
            _ = tokio::time::sleep_until(deadline.unwrap_or(far)) => return Ok(Waited::TimedOut),
            _ = tokio::time::sleep_until(next_refresh), if refreshing.is_none() => {
                let (lock, class) = (lock.clone(), Arc::clone(class));
                refreshing = Some(tokio::spawn(async move { lock.refresh(&class, false).await }));
            }
            Some(done) = async {
                match refreshing.as_mut() {
                    Some(h) => Some(h.await),
                    None => None,
                }
            }, if refreshing.is_some() => {
                refreshing = None;
                next_refresh = Instant::now() + every;
                match done {
                    Ok(Ok(v)) if v.id == lease => {}
                    Ok(Ok(_) | Err(RefreshError::Gone)) => return Ok(Waited::LeaseGone),
                    Ok(Err(RefreshError::Failed(e))) => {
                        tracing::debug!(error = %e, "keep-alive while waiting failed; retrying");
                    }
                    Err(e) => tracing::debug!(error = %e, "keep-alive task failed; retrying"),
                }
            }
        }
    }
}
