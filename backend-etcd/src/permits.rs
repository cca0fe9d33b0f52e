//! Semaphores and reader-writer locks on etcd: the line model of
//! [`fenced_api::permits`] over lines of their own,
//! `<prefix>\0permits\0<key>\0<owner>`, ordered by create revision — which
//! is the token, as for locks (global, durable, monotonic).
//!
//! * **arrive** reads the line (one range, at revision `R`), decides with
//!   [`permits::decide`], and puts its entry on the client's session lease
//!   in a transaction guarded by *no entry of the line created after `R`*:
//!   an entry that joined meanwhile fails the guard and the arrival reads
//!   again. So every entry was decided on everything before it, and a
//!   refused arrival (another capacity, a second entry of one owner) writes
//!   nothing.
//! * **look** reads the line up to the entry (create revision ≤ its token):
//!   granted once the weights up to it fit. Entries before a granted one
//!   only ever leave.
//! * Every entry, waiting or granted, is on a session lease and tracked by
//!   the client's reaper like a lock: deleted at its own deadline unless a
//!   renewal (an extend, or a waiter's look every third of its TTL) moves
//!   that deadline; extend and release are the locks' ([`Holds`]). A client
//!   that dies or freezes leaves its entries to etcd's session-lease
//!   expiry, as its locks.
//! * A dropped arrival deletes its entry in the background, now and once
//!   more later (the entry's path names its owner, so it can be found
//!   without the answer that was lost).
//! * Waiters poll with backoff ([`fenced_api::permits::acquire_in_line`])
//!   and are woken at once by a release in the same process; between
//!   processes the hand-off waits for the waiter's next look.

use std::{collections::HashMap, sync::Arc, time::Duration};

use async_trait::async_trait;
use etcd_client::{
    Compare, CompareOp, DeleteOptions, GetOptions, PutOptions, SortOrder, SortTarget,
};
use etcd_client::{Txn, TxnOp};
use fenced_api::{
    deadlines::{ReaperTask, Tracked},
    permits::{self, Arrival, Decision, LineEntry, LineRow, LineStore, Look, Permits},
    wait::Polling,
    Capabilities, Error, FencingToken, Lease, LockInfo, LockKey, LockOptions, Owner,
    ReleaseOutcome, Result,
};
use tokio::time::Instant;

use crate::{
    batch::Batches,
    client::{revision, Etcd},
    entry, error,
    hold::Holds,
    keys::Keys,
    list::{self, PAGE},
    session::Sessions,
    track::{Held, Tracker},
    wait::Attempt,
};

/// Arrivals that find the line changed between their read and their write
/// read it again, up to this many times (each round lets at least one
/// arrival through, so only a line with this many arrivals at once can
/// exhaust it).
const ARRIVE_TRIES: usize = 100;

/// The line steps of the store's semaphores;
/// [`EtcdLock::semaphores`](fenced_api::DistributedLock::semaphores)
/// returns them as [`LineSemaphores`](fenced_api::permits::LineSemaphores).
/// Cheap to clone; shares the client's sessions, reaper and batches.
#[derive(Clone)]
pub(crate) struct EtcdPermits {
    inner: Arc<Inner>,
}

struct Inner {
    etcd: Etcd,
    keys: Keys,
    sessions: Arc<Sessions>,
    tracker: Arc<Tracker>,
    batches: Arc<Batches>,
    polling: Polling,
    capabilities: Capabilities,
    /// The client's reaper stays while the semaphores are in use, also
    /// after the lock handles are gone: it enforces every entry's TTL.
    _reaper: Arc<ReaperTask>,
}

impl std::fmt::Debug for EtcdPermits {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdPermits")
            .field("scope", &self.inner.polling.scope())
            .finish_non_exhaustive()
    }
}

/// One entry of a line as read.
struct Entry {
    path: Vec<u8>,
    value: Vec<u8>,
    revision: i64,
    lease: i64,
    capacity: u32,
    weight: u32,
}

/// The parts of an etcd client the semaphores share.
pub(crate) struct Shared<'a> {
    pub(crate) etcd: &'a Etcd,
    pub(crate) keys: &'a Keys,
    pub(crate) sessions: &'a Arc<Sessions>,
    pub(crate) tracker: &'a Arc<Tracker>,
    pub(crate) batches: &'a Arc<Batches>,
    pub(crate) reaper: &'a Arc<ReaperTask>,
}

impl EtcdPermits {
    pub(crate) fn new(shared: Shared<'_>, scope: String, capabilities: Capabilities) -> Self {
        EtcdPermits {
            inner: Arc::new(Inner {
                etcd: shared.etcd.clone(),
                keys: shared.keys.clone(),
                sessions: Arc::clone(shared.sessions),
                tracker: Arc::clone(shared.tracker),
                batches: Arc::clone(shared.batches),
                polling: Polling::new(scope),
                capabilities: capabilities.fifo(true).native_wait(false),
                _reaper: Arc::clone(shared.reaper),
            }),
        }
    }

    fn holds(&self) -> Holds<'_> {
        Holds {
            sessions: &self.inner.sessions,
            tracker: &self.inner.tracker,
            batches: &self.inner.batches,
        }
    }

    fn path(&self, key: &LockKey, owner: &Owner) -> Vec<u8> {
        self.inner.keys.permit_entry(key, owner.as_str().as_bytes())
    }

    /// The line of `key` in line order, up to create revision `upto` when
    /// given, and the revision it was read at.
    async fn read(&self, key: &LockKey, upto: Option<i64>) -> Result<(i64, Vec<Entry>)> {
        let line = self.inner.keys.permit_line(key);
        let mut opts = GetOptions::new()
            .with_prefix()
            .with_sort(SortTarget::Create, SortOrder::Ascend);
        if let Some(r) = upto {
            opts = opts.with_max_create_revision(r);
        }
        let resp = self
            .inner
            .etcd
            .call("permits line get", |mut c| {
                let (line, opts) = (line.clone(), opts.clone());
                async move { c.get(line, Some(opts)).await }
            })
            .await?;
        let at = resp.header().map_or(0, |h| h.revision());
        let entries = resp
            .kvs()
            .iter()
            .map(|kv| {
                let (_, sizes) = entry::decode_permit(key, kv.value());
                let (capacity, weight) = sizes.ok_or_else(|| hand_edited(key))?;
                Ok(Entry {
                    path: kv.key().to_vec(),
                    value: kv.value().to_vec(),
                    revision: kv.create_revision(),
                    lease: kv.lease(),
                    capacity,
                    weight,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok((at, entries))
    }

    /// Starts tracking a waiting entry: the reaper deletes it at `deadline`
    /// unless a renewing look moves it.
    fn track_waiter(
        &self,
        path: Vec<u8>,
        owner: &Owner,
        token: i64,
        lease: i64,
        deadline: Instant,
    ) {
        let held = Held {
            owner: owner.clone(),
            lease,
        };
        self.inner.tracker.track((path, token), held, deadline);
    }

    /// The entry at `path` (token `token`) moved onto session lease `lease`
    /// (a put keeps its create revision); whether it was still there.
    async fn move_to(&self, path: &[u8], token: i64, lease: i64) -> Result<bool> {
        let txn = Txn::new()
            .when([Compare::create_revision(
                path.to_vec(),
                CompareOp::Equal,
                token,
            )])
            .and_then([TxnOp::put(
                path.to_vec(),
                Vec::new(),
                Some(PutOptions::new().with_ignore_value().with_lease(lease)),
            )]);
        Ok(self
            .inner
            .etcd
            .txn("permits move txn", txn)
            .await?
            .is_some_and(|r| r.succeeded()))
    }
}

fn hand_edited(key: &LockKey) -> Error {
    Error::backend(
        error::BACKEND,
        false,
        format!("an entry of the semaphore `{key}` has no capacity and weight; was the store edited by hand?"),
    )
}

#[async_trait]
impl LineStore for EtcdPermits {
    async fn arrive(
        &self,
        key: &LockKey,
        permits: Permits,
        opts: &LockOptions,
        owner: &Owner,
        queue: bool,
    ) -> Result<Arrival> {
        let inner = &self.inner;
        let path = self.path(key, owner);
        let line = inner.keys.permit_line(key);
        let value = entry::permit_value(owner, permits, opts.label());
        for _ in 0..ARRIVE_TRIES {
            let (class, view) = inner.sessions.session(opts.ttl()).await?;
            let (at, entries) = self.read(key, None).await?;
            let seen: Vec<LineEntry> = entries
                .iter()
                .map(|e| LineEntry {
                    capacity: e.capacity,
                    weight: e.weight,
                    mine: e.path == path,
                })
                .collect();
            let granted = match permits::decide(key, &seen, permits, opts, queue)? {
                // etcd keeps no hold count: no reentrancy by owner, as for locks.
                Decision::Reenter { .. } => return Err(opts.refuse_reentry(error::BACKEND, key)),
                Decision::Busy => return Ok(Arrival::Busy),
                Decision::Grant => true,
                Decision::Queue => false,
            };
            let attempt = Attempt::at(
                &inner.sessions,
                path.clone(),
                value.clone(),
                view.id,
                opts.owner().is_some(),
            );
            let txn = Txn::new()
                .when([
                    Compare::create_revision(line.clone(), CompareOp::Less, at + 1).with_prefix(),
                ])
                .and_then([TxnOp::put(
                    path.clone(),
                    value.clone(),
                    Some(PutOptions::new().with_lease(view.id)),
                )]);
            let sent = inner
                .sessions
                .txn_on(&class, view, "permits arrive txn", txn);
            let Some((resp, fresh)) = sent.await? else {
                // The session lease was gone: a new one next round.
                attempt.disarm();
                continue;
            };
            if !resp.succeeded() {
                // Someone joined after our read: decide again.
                attempt.disarm();
                continue;
            }
            let token = revision(&resp);
            let Ok(fresh) = fresh else {
                // The lease ended right after the put: our entry went (or
                // goes) with it.
                attempt.clean_now().await;
                continue;
            };
            attempt.disarm();
            if granted {
                let lease = inner.sessions.hold(path, key, owner.clone(), token, fresh);
                return Ok(Arrival::Granted(lease));
            }
            self.track_waiter(path, owner, token, fresh.id, fresh.valid_until);
            return Ok(Arrival::Queued(FencingToken::new(token as u64)));
        }
        Err(Error::backend(
            error::BACKEND,
            true,
            format!("the line of `{key}` changed under {ARRIVE_TRIES} arrivals in a row"),
        ))
    }

    async fn look(
        &self,
        key: &LockKey,
        opts: &LockOptions,
        owner: &Owner,
        token: FencingToken,
        renew: bool,
    ) -> Result<Look> {
        let inner = &self.inner;
        let path = self.path(key, owner);
        let t = token.get() as i64;
        let tracked = (path.clone(), t);
        // Keeps the reaper off the entry while we look: a grant found here
        // then starts from a deadline the reaper also honours.
        let on = match inner.tracker.begin_extend(&tracked) {
            Tracked::Expired => {
                // Its deadline passed before this look: it is lost, and the
                // reaper's delete may not have run yet. Delete it now (the
                // path names the owner), so that the waiter's arrival again
                // does not find itself in line.
                self.leave(key, owner, token).await?;
                return Ok(Look::Gone);
            }
            Tracked::Lost => return Ok(Look::Gone),
            Tracked::No => None,
            Tracked::Yes(_) => Some(tracked.clone()),
        };
        let mut ending = inner.tracker.extending(on);
        let (_, entries) = self.read(key, Some(t)).await?;
        let Some(at) = entries
            .iter()
            .position(|e| e.revision == t && e.path == path)
        else {
            drop(ending);
            inner.tracker.forget(&tracked);
            return Ok(Look::Gone);
        };
        let capacity = entries[at].capacity;
        let granted = permits::granted_count(entries.iter().map(|e| e.weight), capacity) > at;
        if !granted && !renew {
            return Ok(Look::Waiting);
        }
        let (class, view) = inner.sessions.session(opts.ttl()).await?;
        if entries[at].lease != view.id && !self.move_to(&path, t, view.id).await? {
            drop(ending);
            inner.tracker.forget(&tracked);
            return Ok(Look::Gone);
        }
        let Ok(fresh) = inner.sessions.freshen(&class, view).await else {
            // The session lease ended: the entry went with it.
            drop(ending);
            inner.tracker.forget(&tracked);
            return Ok(Look::Gone);
        };
        let held = Held {
            owner: owner.clone(),
            lease: fresh.id,
        };
        if !ending.is_active() {
            inner
                .tracker
                .track(tracked, held.clone(), fresh.valid_until);
        }
        ending.renewed(fresh.valid_until, held);
        if granted {
            return Ok(Look::Granted(Lease::new(
                key.clone(),
                owner.clone(),
                token,
                fresh.ttl,
                fresh.sent_at(),
            )));
        }
        Ok(Look::Waiting)
    }

    async fn leave(&self, key: &LockKey, owner: &Owner, token: FencingToken) -> Result<()> {
        let path = self.path(key, owner);
        let t = token.get() as i64;
        let txn = Txn::new()
            .when([Compare::create_revision(path.clone(), CompareOp::Equal, t)])
            .and_then([TxnOp::delete(path.clone(), None)]);
        let left = self
            .inner
            .etcd
            .txn("permits leave txn", txn)
            .await?
            .is_some_and(|r| r.succeeded());
        self.inner.tracker.forget(&(path, t));
        if left {
            // Those behind it may be granted now.
            self.inner.polling.freed(key);
        }
        Ok(())
    }

    async fn renew(&self, lease: &Lease, ttl: Duration) -> Result<bool> {
        match self.extend(lease, ttl).await {
            Ok(_) => Ok(true),
            Err(Error::LeaseLost { .. }) => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// The locks' extend: the deadline is the one the session lease's
    /// keep-alive bought, which the reaper honours too.
    async fn extend(&self, lease: &Lease, ttl: Duration) -> Result<Lease> {
        let path = self.path(&lease.key, &lease.owner);
        self.holds().extend(path, lease, ttl).await
    }

    async fn give_back(&self, lease: &Lease) -> Result<ReleaseOutcome> {
        let path = self.path(&lease.key, &lease.owner);
        self.holds().release(path, lease).await
    }

    async fn read_line(&self, key: &LockKey) -> Result<Vec<LineRow>> {
        let (_, entries) = self.read(key, None).await?;
        let mut ttls = HashMap::new();
        let mut rows = Vec::with_capacity(entries.len());
        for e in entries {
            let info = self.info(key.clone(), &e, &mut ttls).await;
            rows.push(LineRow::new(info, e.capacity, e.weight));
        }
        Ok(rows)
    }

    async fn clear(&self, key: &LockKey) -> Result<bool> {
        let line = self.inner.keys.permit_line(key);
        let resp = self
            .inner
            .etcd
            .call("permits clear", |mut c| {
                let line = line.clone();
                async move {
                    c.delete(line, Some(DeleteOptions::new().with_prefix()))
                        .await
                }
            })
            .await?;
        Ok(resp.deleted() > 0)
    }

    /// Reads the range `<prefix>\0permits\0…` in pages at one revision;
    /// each key's entries are contiguous, its granted ones are those whose
    /// weights fit in line order.
    async fn list_granted(&self, limit: usize) -> Result<Vec<LockInfo>> {
        if limit == 0 {
            return Ok(Vec::new());
        }
        let inner = &self.inner;
        let base = inner.keys.permit_lines();
        let end = list::range_end(base);
        let mut from = base.to_vec();
        let mut at = 0;
        let mut lines: Vec<(LockKey, Vec<Entry>)> = Vec::new();
        let mut granted = 0;
        loop {
            let opts = GetOptions::new()
                .with_range(end.clone())
                .with_limit(PAGE)
                .with_revision(at);
            let resp = inner
                .etcd
                .call("permits list range", |mut c| {
                    let (from, opts) = (from.clone(), opts.clone());
                    async move { c.get(from, Some(opts)).await }
                })
                .await?;
            if at == 0 {
                at = resp.header().map_or(0, |h| h.revision());
            }
            for kv in resp.kvs() {
                let Some(rest) = kv.key().strip_prefix(base) else {
                    continue;
                };
                let Some(key) = rest
                    .iter()
                    .position(|b| *b == 0)
                    .and_then(|nul| std::str::from_utf8(&rest[..nul]).ok())
                    .and_then(|k| LockKey::new(k).ok())
                else {
                    tracing::warn!(entry = ?String::from_utf8_lossy(kv.key()), "an entry under the permits prefix names no valid key; not listed");
                    continue;
                };
                let Some((capacity, weight)) = entry::decode_permit(&key, kv.value()).1 else {
                    return Err(hand_edited(&key));
                };
                let e = Entry {
                    path: kv.key().to_vec(),
                    value: kv.value().to_vec(),
                    revision: kv.create_revision(),
                    lease: kv.lease(),
                    capacity,
                    weight,
                };
                match lines.last_mut() {
                    Some((k, entries)) if *k == key => entries.push(e),
                    _ => {
                        granted += lines.last_mut().map_or(0, |(_, es)| grant(es));
                        if granted >= limit {
                            break;
                        }
                        lines.push((key, vec![e]));
                    }
                }
            }
            match resp.kvs().last() {
                Some(last) if resp.more() && granted < limit => {
                    from = last.key().to_vec();
                    from.push(0);
                }
                _ => break,
            }
        }
        let mut ttls = HashMap::new();
        let mut out = Vec::new();
        for (key, mut entries) in lines {
            let n = grant(&mut entries);
            for e in entries.iter().take(n) {
                out.push(self.info(key.clone(), e, &mut ttls).await);
            }
        }
        out.truncate(limit);
        Ok(out)
    }

    fn polling(&self) -> &Polling {
        &self.inner.polling
    }

    fn line_capabilities(&self) -> Capabilities {
        self.inner.capabilities
    }
}

/// Puts one key's entries in line order; how many of them are granted.
fn grant(entries: &mut [Entry]) -> usize {
    entries.sort_by_key(|e| e.revision);
    let capacity = entries.first().map_or(0, |e| e.capacity);
    permits::granted_count(entries.iter().map(|e| e.weight), capacity)
}

impl EtcdPermits {
    /// An entry as `holders` and `list` show it: owner, label, token, and
    /// the remaining TTL of its session lease — capped by this client's own
    /// deadline when it is held through this client (`ttls` caches one
    /// lease lookup per session lease).
    async fn info(&self, key: LockKey, e: &Entry, ttls: &mut HashMap<i64, Duration>) -> LockInfo {
        let inner = &self.inner;
        let mut ttl = match ttls.get(&e.lease) {
            Some(t) => *t,
            None => {
                let t = list::lease_ttl(&inner.etcd, e.lease).await;
                ttls.insert(e.lease, t);
                t
            }
        };
        if let Some(deadline) = inner.tracker.deadline(&(e.path.clone(), e.revision)) {
            ttl = ttl.min(deadline.saturating_duration_since(Instant::now()));
        }
        let ((owner, label), _) = entry::decode_permit(&key, &e.value);
        LockInfo::new(key, owner, FencingToken::new(e.revision as u64), ttl, 1).with_label(label)
    }
}
