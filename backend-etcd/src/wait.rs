//! FIFO waiting: etcd's own mutex recipe (each contender a key of its own,
//! the oldest one holds, each waiter watches only the one just ahead of
//! it), built on transactions and watches rather than etcd's Lock RPC
//! (in etcd 3.4 that RPC wedges when many waiting calls are cancelled at
//! once).
//!
//! The line of `key` is its entries `<prefix>\0lock\0<key>\0<owner>`
//! ([`keys`](crate::keys)), on the contenders' session leases, ordered by
//! create revision. The oldest entry is the holder and its create revision
//! the token; deleting it (release, expiry, force release) makes the next
//! one the holder without any write — the hand-off costs the release and a
//! watch event.
//!
//! 1. **Enqueue** (one transaction): if the line is empty, put our entry —
//!    the lock is ours (uncontended, this is the whole acquire). Otherwise
//!    put our entry and read the holder and the last in line (our
//!    predecessor).
//! 2. **Wait** for the predecessor's deletion on the client's shared watch
//!    stream (module `watch`; never etcd's 100 ms sync loop), keeping the
//!    session lease alive meanwhile.
//! 3. **Promoted**: if the predecessor was the holder, nothing older than us
//!    is left, and nothing older can be added (entries are only ever added
//!    at the end), so we hold — no request. We know it was the holder if it
//!    was the oldest entry when we looked, or if it *announced* itself: a
//!    promoted waiter rewrites its own entry in the background (same create
//!    revision, so same token and place), and only a holder ever writes an
//!    existing entry. Otherwise (a waiter ahead gave up, or the announcement
//!    was late) one read-only transaction tells whether anyone is still
//!    ahead: if not we hold, else we watch the new predecessor.
//!
//! **Our own entry** is watched too, on the same stream: etcd's own mutex
//! can return from a wait holding a lock whose session lease was revoked
//! meanwhile, and a waiter here must not. If our entry is deleted while we
//! wait — our session lease revoked, or the entry removed behind our back —
//! we have lost our place: we check the lease (forgetting it, and failing
//! every lock on it, if etcd does not know it) and queue again. The
//! promotion without a request in step 3 first takes what the stream
//! already delivered to our own watch: etcd sends one stream's events in
//! revision order, so a deletion of our entry before the predecessor's is
//! there. One revoke deletes both in a single revision when the predecessor
//! is on our own session lease (same client, same TTL): then we read the
//! line instead. If etcd ever delivers out of order (a watcher more than
//! 128 responses behind), the background announcement finds our entry gone
//! and marks the lock lost, so its first extend reports it.
//!
//! A contended acquisition thus costs 2 writes on its own path (enqueue,
//! release), one background write (the announcement) and rarely a read,
//! plus watch messages. Dropping the future (cancellation) or timing out
//! deletes our entry in the background ([`Attempt`]) — which also gives
//! back a lock granted in that same instant.

mod watch;

use std::{sync::Arc, time::Duration};

use etcd_client::{
    Compare, CompareOp, GetOptions, PutOptions, Txn, TxnOp, TxnOpResponse, TxnResponse,
};
use fenced_api::{wait::wait_deadline, Error, Label, Lease, LockKey, LockOptions, Owner, Result};
use tokio::{task::JoinHandle, time::Instant};

pub(crate) use watch::WatchHub;
use watch::{Seen, Watch};

use crate::{
    client::{revision, Etcd},
    entry, error,
    keys::{newest, newest_before, oldest, Keys},
    session::{Class, RefreshError, Sessions, View},
    track::Tracker,
};

/// The parts of a client that waiting uses.
#[derive(Clone, Copy)]
pub(crate) struct Parts<'a> {
    pub(crate) etcd: &'a Etcd,
    pub(crate) keys: &'a Keys,
    pub(crate) sessions: &'a Arc<Sessions>,
    pub(crate) tracker: &'a Arc<Tracker>,
    pub(crate) watches: &'a WatchHub,
}

/// Cleans up after an acquisition that did not finish: our entry — a place
/// in line, or a lock granted by a request whose answer never arrived.
/// Armed until the outcome is known; on drop it deletes, in the background,
/// our entry if it exists — now, and once more after twice the operation
/// timeout (a request in flight could still be applied after the first pass).
pub(crate) struct Attempt {
    /// The client's session leases, and through them its transport and
    /// its held locks.
    sessions: Arc<Sessions>,
    entry: Vec<u8>,
    /// The value the attempt puts (owner and label).
    value: Vec<u8>,
    lease: i64,
    /// An explicit owner may also hold the key through this client (with
    /// the same entry): never delete that hold.
    explicit: bool,
    armed: bool,
}

impl Attempt {
    pub(crate) fn new(
        parts: Parts<'_>,
        key: &LockKey,
        owner: &Owner,
        label: Option<&Label>,
        lease: i64,
        explicit: bool,
    ) -> Attempt {
        Attempt::at(
            parts.sessions,
            parts.keys.entry(key, owner.as_str().as_bytes()),
            entry::value(owner, label),
            lease,
            explicit,
        )
    }

    /// An attempt that puts `value` at `entry` on session lease `lease`
    /// (any line: a lock's or a semaphore's).
    pub(crate) fn at(
        sessions: &Arc<Sessions>,
        entry: Vec<u8>,
        value: Vec<u8>,
        lease: i64,
        explicit: bool,
    ) -> Attempt {
        Attempt {
            sessions: Arc::clone(sessions),
            entry,
            value,
            lease,
            explicit,
            armed: true,
        }
    }

    pub(crate) fn disarm(mut self) {
        self.armed = false;
    }

    /// One cleanup pass: deletes our entry if it is ours (our value — owner
    /// and label —, our lease) — unless an explicit owner holds the key
    /// through this client.
    async fn clean(sessions: &Sessions, entry: &[u8], value: &[u8], lease: i64, explicit: bool) {
        if explicit && sessions.tracker().holds(|(path, _)| path == entry) {
            return;
        }
        let txn = Txn::new()
            .when([
                Compare::value(entry.to_vec(), CompareOp::Equal, value.to_vec()),
                Compare::lease(entry.to_vec(), CompareOp::Equal, lease),
            ])
            .and_then([TxnOp::delete(entry.to_vec(), None)]);
        if let Err(e) = sessions.etcd().txn("abandon txn", txn).await {
            tracing::debug!(error = %e, "cleaning up an abandoned acquire failed; it expires with the session lease");
        }
    }

    /// Cleans up now (before trying again), then disarms.
    pub(crate) async fn clean_now(self) {
        Attempt::clean(
            &self.sessions,
            &self.entry,
            &self.value,
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
        // The first pass keeps the client's sessions alive for its one
        // request (the dropped future may have owned the last handle on
        // the client); the second, for a create still in flight, runs only
        // if the client is still in use — otherwise its session leases, and
        // anything left on them, expire one TTL after its last use. Only the
        // first is a clean-up that `fenced_api::cleanup::settle` waits for
        // (the second waits two operation timeouts first): in a process that
        // exits meanwhile, a create that lands after the first pass stays
        // until its session lease expires, one TTL after the last renewal.
        let sessions = Arc::clone(&self.sessions);
        let weak = Arc::downgrade(&self.sessions);
        let (entry, value) = (self.entry.clone(), self.value.clone());
        let (lease, explicit) = (self.lease, self.explicit);
        let later = self.sessions.etcd().timeout() * 2;
        let cleanup = async move {
            Attempt::clean(&sessions, &entry, &value, lease, explicit).await;
            drop(sessions);
            tokio::spawn(async move {
                tokio::time::sleep(later).await;
                if let Some(sessions) = weak.upgrade() {
                    Attempt::clean(&sessions, &entry, &value, lease, explicit).await;
                }
            });
        };
        fenced_api::cleanup::spawn(cleanup);
    }
}

/// What the enqueue / line-read transactions saw.
struct Line {
    /// The holder's entry: (key, value).
    holder: Option<(Vec<u8>, Vec<u8>)>,
    /// The entry just ahead of ours: (key, the session lease it is on).
    predecessor: Option<(Vec<u8>, i64)>,
    /// Whether our own entry exists (it was put, or it is still there).
    ours: bool,
    /// The revision all of this was read at.
    revision: i64,
}

/// Reads `[Get(oldest), Get(predecessor), <ours>]` answers: `ours` is a
/// nested transaction that put our entry (enqueue) or a get of our entry,
/// which must still have create revision `my_rev` (line read).
fn read_line(resp: &TxnResponse, my_rev: i64) -> Line {
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
        predecessor: kv(1).map(|p| (p.key().to_vec(), p.lease())),
        ours,
        revision: revision(resp),
    }
}

/// How a wait for a deletion ended.
enum Waited {
    /// Deleted; `announced`: its owner had announced holding the lock first;
    /// `lease`: the session lease a write seen meanwhile moved it onto.
    Deleted {
        announced: bool,
        lease: Option<i64>,
    },
    /// The watch ended without telling: read the line to know.
    Unsure,
    TimedOut,
    /// The session lease (and our entry with it) is gone.
    LeaseGone,
    /// Our own entry was deleted (its session lease revoked, or the entry
    /// deleted behind our back): we lost our place in line.
    OwnGone,
}

/// Where a waiter stands: its entry in the line of `key`, put at revision
/// `rev` on the session lease `view` of `class`.
struct Place<'a> {
    key: &'a LockKey,
    line: &'a [u8],
    entry: &'a [u8],
    rev: i64,
    class: &'a Arc<Class>,
    view: View,
    deadline: Option<Instant>,
}

/// How waiting for our turn ended.
enum Turn {
    /// Nobody is ahead of us now: we hold, if the session lease is still
    /// ours (the refresh that says so).
    Ours(std::result::Result<View, RefreshError>),
    /// Our place in line is gone (our entry or its session lease): queue again.
    Lost,
    /// The wait deadline passed.
    TimedOut,
}

/// Acquires `key`, waiting in its line as the options allow (never
/// [`WaitPolicy::NoWait`](fenced_api::WaitPolicy::NoWait): that is a plain
/// `try_acquire`).
pub(crate) async fn acquire(parts: Parts<'_>, key: &LockKey, opts: &LockOptions) -> Result<Lease> {
    let start = Instant::now();
    let deadline = wait_deadline(opts.wait(), start);
    let explicit = opts.owner().is_some();
    let line = parts.keys.line(key);
    let mut owner = opts.owner_or_random();
    let mut stale: Option<Attempt> = None;

    for _ in 0..3 {
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
        let value = entry::value(&owner, opts.label());
        let entry = parts.keys.entry(key, owner.as_str().as_bytes());
        let (class, view) = parts.sessions.session(opts.ttl()).await?;
        let attempt = Attempt::new(parts, key, &owner, opts.label(), view.id, explicit);
        let put = || {
            TxnOp::put(
                entry.clone(),
                value.clone(),
                Some(PutOptions::new().with_lease(view.id)),
            )
        };
        let txn = Txn::new()
            .when([Compare::create_revision(line.clone(), CompareOp::Equal, 0).with_prefix()])
            .and_then([put()])
            .or_else([
                TxnOp::get(line.clone(), Some(oldest())),
                TxnOp::get(line.clone(), Some(newest())),
                // Our entry, unless this owner already holds or waits.
                TxnOp::txn(
                    Txn::new()
                        .when([Compare::create_revision(entry.clone(), CompareOp::Equal, 0)])
                        .and_then([put()]),
                ),
            ]);
        let sent = parts.sessions.txn_on(&class, view, "enqueue txn", txn);
        let Some((resp, fresh)) = sent.await? else {
            attempt.disarm();
            continue;
        };
        let rev = revision(&resp);
        let first = (!resp.succeeded()).then(|| read_line(&resp, rev));
        if let Some(first) = first.as_ref().filter(|f| !f.ours) {
            attempt.disarm();
            entry::check_reentry(key, opts, first.holder.as_ref().map(|h| h.1.as_slice()))?;
            return Err(Error::AlreadyHeld { key: key.clone() });
        }
        // The line was empty: our entry is the lock. (In a line that was
        // not, the newest entry read before our put is our predecessor; a
        // line without one has nobody ahead of us either.)
        let Some((first, ahead)) = first.and_then(|mut f| f.predecessor.take().map(|p| (f, p)))
        else {
            if let Ok(v) = fresh {
                attempt.disarm();
                return Ok(parts.sessions.hold(entry, key, owner, rev, v));
            }
            // The lease ended, and the lock with it (or was replaced).
            stale = Some(attempt);
            continue;
        };
        let ahead_holds = first.holder.as_ref().is_some_and(|h| h.0 == ahead.0);
        let place = Place {
            key,
            line: &line,
            entry: &entry,
            rev,
            class: &class,
            view,
            deadline,
        };
        match wait_turn(parts, &place, ahead, ahead_holds).await? {
            Turn::Ours(Ok(v)) => {
                attempt.disarm();
                return Ok(granted(parts, key, owner, rev, v, start));
            }
            Turn::Ours(Err(_)) | Turn::Lost => stale = Some(attempt),
            Turn::TimedOut => {
                return Err(Error::Timeout {
                    key: key.clone(),
                    waited: start.elapsed(),
                })
            }
        }
    }
    Err(Error::backend(
        error::BACKEND,
        true,
        "the session lease vanished three times while queueing",
    ))
}

/// Waits until nobody is ahead of `place` in its line: first for the
/// deletion of `ahead` (the entry just ahead: its path and session lease;
/// `ahead_holds` when it is known to be the holder), then for each new
/// predecessor a line read finds.
async fn wait_turn(
    parts: Parts<'_>,
    place: &Place<'_>,
    (mut ahead, mut ahead_lease): (Vec<u8>, i64),
    mut ahead_holds: bool,
) -> Result<Turn> {
    let mut known = place.rev;
    // Our own entry, watched on the same stream while we wait: a waiter
    // must not come back holding a lock whose entry is gone.
    let mut own: Option<Watch> = None;
    loop {
        let deleted = match wait_deleted(parts, place, &ahead, &mut own, known).await? {
            Waited::Deleted { announced, lease } => {
                ahead_holds |= announced;
                ahead_lease = lease.unwrap_or(ahead_lease);
                true
            }
            Waited::Unsure => {
                own = None;
                false
            }
            Waited::TimedOut => return Ok(Turn::TimedOut),
            Waited::LeaseGone => return Ok(Turn::Lost),
            Waited::OwnGone => {
                tracing::warn!(key = %place.key, "our entry in the line vanished while waiting (session lease revoked, or the entry deleted); queueing again");
                parts
                    .sessions
                    .confirm_lease(place.class, place.view.id)
                    .await;
                return Ok(Turn::Lost);
            }
        };
        let current = place.class.view().filter(|v| v.id == place.view.id);
        // The holder just left and nobody can queue ahead of us: we hold,
        // with no request — our entry lives while the session lease does,
        // and our watch reported no deletion of it before the holder's
        // (etcd sends a stream's events in revision order). One deletion
        // can remove both at once, though, when the holder is on our own
        // session lease (a revoke): then the line read below checks.
        if deleted && ahead_holds && ahead_lease != place.view.id {
            if let Some(v) = current.filter(|v| v.valid_until > Instant::now()) {
                return Ok(Turn::Ours(parts.sessions.freshen(place.class, v).await));
            }
        }
        // Someone ahead of us left: is anyone still in front?
        let look = Txn::new().and_then([
            TxnOp::get(place.line.to_vec(), Some(oldest())),
            TxnOp::get(place.line.to_vec(), Some(newest_before(place.rev))),
            TxnOp::get(place.entry.to_vec(), None),
        ]);
        let (resp, fresh) = tokio::join!(
            parts.etcd.txn("line read", look),
            parts
                .sessions
                .freshen(place.class, current.unwrap_or(place.view))
        );
        let Some(resp) = resp? else {
            return Ok(Turn::Lost);
        };
        let now = read_line(&resp, place.rev);
        if !now.ours {
            // Our entry vanished (its lease ended): queue again.
            return Ok(Turn::Lost);
        }
        let Some((p, p_lease)) = now.predecessor else {
            return Ok(Turn::Ours(fresh));
        };
        ahead_holds = now.holder.as_ref().is_some_and(|h| h.0 == p);
        ahead = p;
        ahead_lease = p_lease;
        known = now.revision;
    }
}

/// A waiter became the holder: track it, and announce it to the next in
/// line — a put on our own entry (same create revision, so the token and the
/// place stay) that its watch sees. The next waiter then knows it is next and
/// takes over on our deletion without reading the line. Sent in the
/// background and guarded (it never re-creates a released entry); if it is
/// late or lost, the next waiter reads the line instead.
fn granted(
    parts: Parts<'_>,
    key: &LockKey,
    owner: Owner,
    token: i64,
    view: View,
    start: Instant,
) -> Lease {
    tracing::debug!(key = %key, token, waited_ms = start.elapsed().as_millis() as u64, "etcd lock granted after waiting");
    let entry = parts.keys.entry(key, owner.as_str().as_bytes());
    let lease = parts.sessions.hold(entry.clone(), key, owner, token, view);
    let announce = Txn::new()
        .when([Compare::create_revision(
            entry.clone(),
            CompareOp::Equal,
            token,
        )])
        .and_then([TxnOp::put(
            entry.clone(),
            Vec::new(),
            Some(PutOptions::new().with_ignore_value().with_ignore_lease()),
        )]);
    let (etcd, tracker) = (parts.etcd.clone(), Arc::clone(parts.tracker));
    tokio::spawn(async move {
        match etcd.txn("announce txn", announce).await {
            // The entry is gone already: released at once, or — the
            // out-of-order residue described in the module docs — lost
            // before we returned it. Either way the lock is not held: its
            // next extend must say so.
            Ok(Some(r)) if !r.succeeded() => {
                tracing::debug!(
                    token,
                    "announcing the new holder: its entry is gone; marked lost"
                );
                tracker.lose(&(entry, token));
            }
            Ok(_) => {}
            Err(e) => {
                tracing::debug!(error = %e, "announcing the new holder failed; the next waiter reads the line");
            }
        }
    });
    lease
}

/// Waits until `ahead` — present at `known` — is deleted, the wait deadline
/// passes, the session lease ends, or our own entry (present at `known`
/// too) is deleted. Keeps the session lease alive. `own` is the watch of our
/// entry, opened here on first use (beside the watch of `ahead`) and kept
/// across waits; it is closed (`None`) after `Unsure`.
async fn wait_deleted(
    parts: Parts<'_>,
    place: &Place<'_>,
    ahead: &[u8],
    own: &mut Option<Watch>,
    known: i64,
) -> Result<Waited> {
    let (class, lease, mine) = (place.class, place.view.id, place.entry);
    let mut watch = match own {
        Some(_) => parts.watches.watch(ahead).await?,
        None => {
            let (o, w) = tokio::join!(parts.watches.watch(mine), parts.watches.watch(ahead));
            *own = Some(o?);
            w?
        }
    };
    let Some(own) = own.as_mut() else {
        return Ok(Waited::Unsure);
    };
    let mut announced = false;
    let mut moved = None;
    if watch.after > known || own.after > known {
        // A watch starts later than our read: was either entry deleted in
        // between? (One read-only transaction for both.)
        let check = Txn::new().and_then([
            TxnOp::get(ahead.to_vec(), Some(GetOptions::new().with_count_only())),
            TxnOp::get(mine.to_vec(), None),
        ]);
        let resp = parts
            .etcd
            .call("wait check txn", |mut c| {
                let check = check.clone();
                async move { c.txn(check).await }
            })
            .await?;
        let ops = resp.op_responses();
        let ours = match ops.get(1) {
            Some(TxnOpResponse::Get(g)) => g.kvs().first().map(|kv| kv.create_revision()),
            _ => None,
        };
        // Our entry was put at `known` or earlier and never re-created with
        // the same create revision: any other answer means it was deleted.
        if !matches!(ours, Some(rev) if rev <= known) {
            return Ok(Waited::OwnGone);
        }
        let present = matches!(ops.first(), Some(TxnOpResponse::Get(g)) if g.count() > 0);
        if !present {
            return Ok(Waited::Deleted {
                announced,
                lease: moved,
            });
        }
    }
    // Often enough that the view stays fresh (a tenth of a TTL): a waiter
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
            // Our own entry first: its deletion must never lose a race
            // against the predecessor's in this select.
            biased;
            seen = own.next() => match seen {
                Seen::Deleted => return Ok(Waited::OwnGone),
                Seen::Ended => {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    return Ok(Waited::Unsure);
                }
                // Nobody writes a waiter's entry; ignore anything else.
                Seen::Put { .. } | Seen::Other => {}
            },
            seen = watch.next() => match seen {
                Seen::Deleted => {
                    // The stream routes responses in the order etcd sent
                    // them: a deletion of our entry at an earlier revision
                    // is already in our watch's queue.
                    return Ok(match own.delivered() {
                        Seen::Deleted => Waited::OwnGone,
                        Seen::Ended => Waited::Unsure,
                        Seen::Put { .. } | Seen::Other => Waited::Deleted {
                            announced,
                            lease: moved,
                        },
                    });
                }
                // Only a holder writes its existing entry (the announcement
                // after a promotion, or an extend moving it to another lease).
                Seen::Put { lease } => {
                    announced = true;
                    moved = Some(lease);
                }
                Seen::Other => {}
                Seen::Ended => {
                    // Re-read rather than trust silence; do not spin on a
                    // stream that keeps breaking.
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    return Ok(Waited::Unsure);
                }
            },
            _ = tokio::time::sleep_until(place.deadline.unwrap_or(far)) => return Ok(Waited::TimedOut),
            _ = tokio::time::sleep_until(next_refresh), if refreshing.is_none() => {
                let (sessions, class) = (Arc::clone(parts.sessions), Arc::clone(class));
                refreshing = Some(tokio::spawn(async move { sessions.refresh(&class, false).await }));
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
