//! Semaphores and reader-writer locks on ZooKeeper: the line model of
//! [`fenced_api::permits`] over lines of their own — per key a container
//! `<namespace>/p<encoded key>` (a namespace apart from the lock queues),
//! each holder or waiter an `EPHEMERAL_SEQUENTIAL` child
//! `<nonce>-<capacity>.<weight>-<sequence>` whose data is a lock entry's
//! (owner, TTL, label). Line order is the sequence; the token is the
//! node's creation zxid, as for locks.
//!
//! * **arrive** reads the line's children (names carry capacity and
//!   weight, so no node is read; with an explicit owner each entry's data
//!   is read too, to find a second entry of that owner), decides with
//!   [`permits::decide`], and creates its entry in a `multi` with a
//!   `setData` of the container guarded by the version the read saw: every
//!   arrival bumps that version, so an arrival that raced another fails
//!   the guard and reads again. Every entry is decided on everything before
//!   it, and a refused request writes nothing.
//! * **look** reads the children through the entry's own session (the
//!   read's send time anchors a grant's lease, and keeps the session
//!   alive): granted once the weights up to the entry fit.
//! * Every entry, waiting or granted, is tracked by the client's reaper
//!   like a lock (deleted at its deadline unless renewed: an extend, or a
//!   waiter's look every third of its TTL); extend and release are the
//!   locks' ([`hold`](crate::hold)). A client that dies leaves its entries
//!   to its session's expiry, as its locks.
//! * A dropped arrival deletes its entry in the background, found by its
//!   nonce when the create's reply was lost.
//! * Waiters poll with backoff ([`fenced_api::permits::acquire_in_line`])
//!   and are woken at once by a release in the same process.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use fenced_api::{
    deadlines::{ReaperTask, Tracked},
    permits::{self, Arrival, Decision, LineEntry, LineRow, LineStore, Look, Permits},
    wait::Polling,
    Capabilities, Error, FencingToken, Lease, LockInfo, LockKey, LockOptions, Owner,
    ReleaseOutcome, Result,
};
use tokio::time::Instant;
use zookeeper_client::{Acls, CreateMode, Error as ZkError, MultiWriteResult, Stat};

use crate::{
    entry,
    error::{self, kind, Kind},
    hold,
    keys::{self, in_order, permit_entry_prefix, permit_sizes, Keys},
    list::{self, Holder},
    queue::{make_queue, remove},
    session::{granted, Session, Sessions},
    track::{Node, Tracker},
};

/// Arrivals that lose the race for the line's version read it again, up
/// to this many times (each round lets one arrival through).
const ARRIVE_TRIES: usize = 100;

/// The line steps of the store's semaphores;
/// [`ZkLock::semaphores`](fenced_api::DistributedLock::semaphores) returns
/// them as [`LineSemaphores`](fenced_api::permits::LineSemaphores). Cheap to
/// clone; shares the client's sessions and reaper.
#[derive(Clone)]
pub(crate) struct ZkPermits {
    inner: Arc<Inner>,
}

struct Inner {
    sessions: Arc<Sessions>,
    keys: Keys,
    tracker: Arc<Tracker>,
    polling: Polling,
    capabilities: Capabilities,
    /// The client's reaper stays while the semaphores are in use, also
    /// after the lock handles are gone: it enforces every entry's TTL.
    _reaper: Arc<ReaperTask>,
}

impl std::fmt::Debug for ZkPermits {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ZkPermits")
            .field("scope", &self.inner.polling.scope())
            .finish_non_exhaustive()
    }
}

/// One entry of a line, from its name.
struct Row {
    name: String,
    capacity: u32,
    weight: u32,
}

/// A new entry that is deleted (in the background) when dropped armed: the
/// create may have been applied although its reply never came.
struct Cleanup {
    session: Arc<Session>,
    queue: String,
    nonce: String,
    armed: bool,
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        // Without a runtime the node goes with the session.
        let (session, queue, nonce) = (
            Arc::clone(&self.session),
            std::mem::take(&mut self.queue),
            std::mem::take(&mut self.nonce),
        );
        fenced_api::cleanup::spawn(async move {
            remove(&session, &queue, &nonce, None).await;
        });
    }
}

fn hand_edited(key: &LockKey, name: &str) -> Error {
    Error::backend(
        error::BACKEND,
        false,
        format!("the entry `{name}` of the semaphore `{key}` names no capacity and weight; was the store edited by hand?"),
    )
}

impl ZkPermits {
    pub(crate) fn new(
        sessions: Arc<Sessions>,
        keys: Keys,
        tracker: Arc<Tracker>,
        reaper: Arc<ReaperTask>,
        scope: String,
        capabilities: Capabilities,
    ) -> Self {
        ZkPermits {
            inner: Arc::new(Inner {
                sessions,
                keys,
                tracker,
                polling: Polling::new(scope),
                capabilities: capabilities.fifo(true).native_wait(false),
                _reaper: reaper,
            }),
        }
    }

    /// The entries of `queue` in line order and the container's stat;
    /// `None` when the container does not exist.
    async fn rows(
        &self,
        s: &Session,
        key: &LockKey,
        queue: &str,
    ) -> Result<Option<(Vec<Row>, Stat)>> {
        let (children, stat) = match s
            .run("get children", s.client().get_children(queue))
            .await?
        {
            Ok(c) => c,
            Err(e) if kind(&e) == Kind::NoNode => return Ok(None),
            Err(e) => return Err(error::map(e)),
        };
        let rows = in_order(children)
            .into_iter()
            .map(|name| {
                let (capacity, weight) =
                    permit_sizes(&name).ok_or_else(|| hand_edited(key, &name))?;
                Ok(Row {
                    name,
                    capacity,
                    weight,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Some((rows, stat)))
    }

    /// The data and stat of the entry `name` of `queue`; `None` if it is gone.
    async fn read(s: &Session, queue: &str, name: &str) -> Result<Option<(Vec<u8>, Stat)>> {
        match s
            .run("get", s.client().get_data(&format!("{queue}/{name}")))
            .await?
        {
            Ok(r) => Ok(Some(r)),
            Err(e) if kind(&e) == Kind::NoNode => Ok(None),
            Err(e) => Err(error::map(e)),
        }
    }

    /// The tracked node of `owner`'s entry with token `token` in `key`'s line.
    fn tracked(&self, key: &LockKey, owner: &Owner, token: FencingToken) -> Option<(String, i64)> {
        let probe = Lease::new(
            key.clone(),
            owner.clone(),
            token,
            Duration::ZERO,
            Instant::now(),
        );
        hold::tracked_in(
            &self.inner.tracker,
            &self.inner.keys.permit_queue(key),
            &probe,
        )
    }
}

#[async_trait]
impl LineStore for ZkPermits {
    async fn arrive(
        &self,
        key: &LockKey,
        permits: Permits,
        opts: &LockOptions,
        owner: &Owner,
        queue: bool,
    ) -> Result<Arrival> {
        let inner = &self.inner;
        let s = inner.sessions.for_ttl(opts.ttl()).await?;
        let ttl = granted(opts.ttl(), s.negotiated());
        let line = inner.keys.permit_queue(key);
        let data = entry::data(owner, ttl, opts.label());
        let node_mode = CreateMode::EphemeralSequential.with_acls(Acls::anyone_all());
        for _ in 0..ARRIVE_TRIES {
            let Some((rows, stat)) = self.rows(&s, key, &line).await? else {
                make_queue(&s, &inner.keys, &line).await?;
                continue;
            };
            let stat_read_czxid = stat.czxid;
            let mut seen = Vec::with_capacity(rows.len());
            for row in &rows {
                // Only an explicit owner can be in line already.
                let mine = match opts.owner() {
                    Some(o) => Self::read(&s, &line, &row.name)
                        .await?
                        .is_some_and(|(d, _)| entry::owner_bytes(&d) == o.as_str().as_bytes()),
                    None => false,
                };
                seen.push(LineEntry {
                    capacity: row.capacity,
                    weight: row.weight,
                    mine,
                });
            }
            let grant = match permits::decide(key, &seen, permits, opts, queue)? {
                // No hold count in a node: no reentrancy by owner, as for locks.
                Decision::Reenter { .. } => return Err(opts.refuse_reentry(error::BACKEND, key)),
                Decision::Busy => return Ok(Arrival::Busy),
                Decision::Grant => true,
                Decision::Queue => false,
            };
            let nonce = uuid::Uuid::new_v4().simple().to_string();
            let prefix = format!(
                "{line}/{}",
                permit_entry_prefix(&nonce, permits.capacity(), permits.weight())
            );
            let mut cleanup = Cleanup {
                session: Arc::clone(&s),
                queue: line.clone(),
                nonce,
                armed: true,
            };
            let mut writer = s.client().new_multi_writer();
            writer
                .add_set_data(&line, &[], Some(stat.version))
                .map_err(error::map)?;
            writer
                .add_create(&prefix, &data, &node_mode)
                .map_err(error::map)?;
            let sent = Instant::now();
            let commit = writer.commit();
            let results = match s
                .run("multi", async move { commit.await.map_err(ZkError::from) })
                .await?
            {
                Ok(r) => r,
                // Another arrival (or the container's removal) came first.
                Err(e) if matches!(kind(&e), Kind::BadVersion | Kind::NoNode) => {
                    cleanup.armed = false;
                    continue;
                }
                Err(e) => return Err(error::map(e)),
            };
            let mut results = results.into_iter();
            let (
                Some(MultiWriteResult::SetData { stat: line_now }),
                Some(MultiWriteResult::Create { path, stat }),
            ) = (results.next(), results.next())
            else {
                return Err(Error::backend(
                    error::BACKEND,
                    true,
                    "ZooKeeper answered a multi without its set-data and create",
                ));
            };
            if line_now.czxid != stat_read_czxid {
                // The line is a container: the server removed it once it
                // stood empty, and another arrival made it again — at
                // version 0, so the version we read matched a line we never
                // looked at. Our entry may stand behind a grant we did not
                // count: take it out and look again.
                match s.run("delete", s.client().delete(&path, None)).await? {
                    Ok(()) => cleanup.armed = false,
                    Err(e) if kind(&e) == Kind::NoNode => cleanup.armed = false,
                    // The guard removes it (by its nonce) when dropped.
                    Err(e) => return Err(error::map(e)),
                }
                continue;
            }
            // A create inside a multi may come back without a valid stat
            // (ZOOKEEPER-4026): read the token then.
            let czxid = if stat.czxid > 0 && !stat.is_invalid() {
                stat.czxid
            } else {
                match s.run("exists", s.client().check_stat(&path)).await? {
                    Ok(Some(st)) => st.czxid,
                    Ok(None) => {
                        cleanup.armed = false;
                        continue;
                    }
                    Err(e) => return Err(error::map(e)),
                }
            };
            cleanup.armed = false;
            let node = Node {
                session: s.id(),
                owner: owner.clone(),
                label: opts.label().cloned(),
            };
            inner.tracker.track((path, czxid), node, sent + ttl);
            let token = FencingToken::new(czxid as u64);
            if grant {
                return Ok(Arrival::Granted(Lease::new(
                    key.clone(),
                    owner.clone(),
                    token,
                    ttl,
                    sent,
                )));
            }
            return Ok(Arrival::Queued(token));
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
        _renew: bool,
    ) -> Result<Look> {
        let inner = &self.inner;
        let Some(node) = self.tracked(key, owner, token) else {
            // Forgotten: found gone before, or deleted at its deadline.
            return Ok(Look::Gone);
        };
        let held = match inner.tracker.begin_extend(&node) {
            Tracked::Expired => {
                // Its deadline passed before this look: it is lost, and the
                // reaper's delete may not have run yet. Delete it now, so
                // that the waiter's arrival again does not find itself.
                self.leave(key, owner, token).await?;
                return Ok(Look::Gone);
            }
            Tracked::Lost | Tracked::No => return Ok(Look::Gone),
            Tracked::Yes(held) => held,
        };
        // Keeps the reaper off the entry while we look: a grant found here
        // then starts from a deadline the reaper also honours.
        let mut ending = inner.tracker.extending(Some(node.clone()));
        let Some(s) = inner.sessions.by_id(held.session) else {
            drop(ending);
            inner.tracker.forget(&node);
            return Ok(Look::Gone);
        };
        let line = inner.keys.permit_queue(key);
        let sent = Instant::now();
        let rows = match self.rows(&s, key, &line).await? {
            Some((rows, _)) => rows,
            None => Vec::new(),
        };
        let name = node.0.rsplit_once('/').map_or("", |(_, n)| n);
        let Some(at) = rows.iter().position(|r| r.name == name) else {
            drop(ending);
            inner.tracker.forget(&node);
            return Ok(Look::Gone);
        };
        let granted_here =
            permits::granted_count(rows.iter().map(|r| r.weight), rows[at].capacity) > at;
        // The read went out on the entry's own session: the server keeps
        // that session (and the entry) at least one session timeout past
        // `sent`, and the entry's TTL never exceeds it. So every look
        // renews (`_renew` asks for a write elsewhere; here it costs
        // nothing): a waiter whose TTL the server capped to its session
        // timeout stays in line although the line's refresh goes by the
        // TTL it asked for.
        let ttl = granted(opts.ttl(), s.negotiated());
        ending.renewed(sent + ttl, held);
        if granted_here {
            return Ok(Look::Granted(Lease::new(
                key.clone(),
                owner.clone(),
                token,
                ttl,
                sent,
            )));
        }
        Ok(Look::Waiting)
    }

    async fn leave(&self, key: &LockKey, owner: &Owner, token: FencingToken) -> Result<()> {
        let inner = &self.inner;
        let Some(node) = self.tracked(key, owner, token) else {
            return Ok(());
        };
        let outcome = hold::delete(&inner.sessions, &inner.tracker, node.0, node.1).await?;
        if outcome == ReleaseOutcome::Released {
            // Those behind it may be granted now.
            inner.polling.freed(key);
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

    /// The locks' extend: one write of the TTL through the entry's own
    /// session, from whose send time the lease counts.
    async fn extend(&self, lease: &Lease, ttl: Duration) -> Result<Lease> {
        LockOptions::validate_ttl(ttl)?;
        let inner = &self.inner;
        let lost = |why: &str| Error::lease_lost(&lease.key, lease.token, why);
        let Some(node) = self.tracked(&lease.key, &lease.owner, lease.token) else {
            if self.find(lease).await?.is_none() {
                return Err(lost(
                    "its node was deleted, expired or belongs to another grant",
                ));
            }
            return Err(Error::Unsupported {
                backend: error::BACKEND,
                what: "extending a ZooKeeper permit through a client other than the one whose \
                       session holds it (only that session can keep the node alive)"
                    .into(),
            });
        };
        hold::extend_tracked(&inner.sessions, &inner.tracker, node, lease, ttl)
            .await?
            .ok_or_else(|| lost("its node was deleted or expired"))
    }

    async fn give_back(&self, lease: &Lease) -> Result<ReleaseOutcome> {
        let inner = &self.inner;
        let Some(node) = self.tracked(&lease.key, &lease.owner, lease.token) else {
            // Held through another client: any session may delete the node.
            let Some(path) = self.find(lease).await? else {
                tracing::warn!(key = %lease.key, token = %lease.token, "release of a permit that was not held");
                return Ok(ReleaseOutcome::NotHeld);
            };
            let token = lease.token.get() as i64;
            let outcome = hold::delete(&inner.sessions, &inner.tracker, path, token).await?;
            if outcome == ReleaseOutcome::NotHeld {
                tracing::warn!(key = %lease.key, token = %lease.token, "release of a permit that was not held");
            }
            return Ok(outcome);
        };
        match inner.tracker.data(&node) {
            Some(held) if held.owner == lease.owner => {}
            _ => return Ok(ReleaseOutcome::NotHeld),
        }
        hold::delete(&inner.sessions, &inner.tracker, node.0, node.1).await
    }

    async fn read_line(&self, key: &LockKey) -> Result<Vec<LineRow>> {
        let inner = &self.inner;
        let s = inner.sessions.get().await?;
        let line = inner.keys.permit_queue(key);
        let Some((rows, _)) = self.rows(&s, key, &line).await? else {
            return Ok(Vec::new());
        };
        let mut out = Vec::with_capacity(rows.len());
        for row in rows {
            let Some((data, stat)) = Self::read(&s, &line, &row.name).await? else {
                continue; // left meanwhile
            };
            let path = format!("{line}/{}", row.name);
            let info = list::info(&inner.tracker, key.clone(), &Holder { path, data, stat });
            out.push(LineRow::new(info, row.capacity, row.weight));
        }
        Ok(out)
    }

    async fn clear(&self, key: &LockKey) -> Result<bool> {
        let inner = &self.inner;
        let s = inner.sessions.get().await?;
        let line = inner.keys.permit_queue(key);
        let Some((rows, _)) = self.rows(&s, key, &line).await? else {
            return Ok(false);
        };
        let mut any = false;
        for row in rows {
            let path = format!("{line}/{}", row.name);
            match s.run("delete", s.client().delete(&path, None)).await? {
                Ok(()) => any = true,
                Err(e) if kind(&e) == Kind::NoNode => {}
                Err(e) => return Err(error::map(e)),
            }
        }
        Ok(any)
    }

    /// The namespace's semaphore lines in key order, each read as
    /// [`read_line`](LineStore::read_line) reads it.
    async fn list_granted(&self, limit: usize) -> Result<Vec<LockInfo>> {
        let inner = &self.inner;
        let s = inner.sessions.get().await?;
        let names = match s
            .run(
                "get children",
                s.client().list_children(inner.keys.namespace()),
            )
            .await?
        {
            Ok(c) => c,
            Err(e) if kind(&e) == Kind::NoNode => return Ok(Vec::new()),
            Err(e) => return Err(error::map(e)),
        };
        let mut lines: Vec<LockKey> = names
            .iter()
            .filter_map(|n| keys::decode_permit_queue(n))
            .collect();
        lines.sort_by(|a, b| a.as_str().cmp(b.as_str()));
        let mut out = Vec::new();
        for key in lines {
            if out.len() >= limit {
                break;
            }
            let rows = self.read_line(&key).await?;
            let Some(capacity) = rows.first().map(|r| r.capacity) else {
                continue;
            };
            let granted = permits::granted_count(rows.iter().map(|r| r.weight), capacity);
            out.extend(rows.into_iter().take(granted).map(|r| r.info));
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

impl ZkPermits {
    /// The path of `lease`'s entry when it is still in line (its owner and
    /// token), read from the store: for a lease this client does not track.
    async fn find(&self, lease: &Lease) -> Result<Option<String>> {
        let inner = &self.inner;
        let s = inner.sessions.get().await?;
        let line = inner.keys.permit_queue(&lease.key);
        let Some((rows, _)) = self.rows(&s, &lease.key, &line).await? else {
            return Ok(None);
        };
        for row in rows {
            let Some((data, stat)) = Self::read(&s, &line, &row.name).await? else {
                continue;
            };
            if stat.czxid == lease.token.get() as i64
                && entry::owner_bytes(&data) == lease.owner.as_str().as_bytes()
            {
                return Ok(Some(format!("{line}/{}", row.name)));
            }
        }
        Ok(None)
    }
}
