//! The queue of one key: entering it (an ephemeral sequential child of the
//! key's container node), finding one's place, and leaving it — also when
//! the caller's future is dropped or the create's reply was lost.

use std::{sync::Arc, time::Duration};

use fenced_api::{wait::Backoff, Error, FencingToken, Label, Lease, LockKey, Owner, Result};
use tokio::time::Instant;
use zookeeper_client::{Acls, CreateMode, Stat};

use crate::{
    entry,
    error::{self, kind, Kind},
    keys::{entry_prefix, in_order, Keys},
    session::{granted, Session, Sessions},
    track::{Node, Tracker},
};

/// What the recipe needs of one client.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Parts<'a> {
    pub(crate) sessions: &'a Sessions,
    pub(crate) keys: &'a Keys,
    pub(crate) tracker: &'a Arc<Tracker>,
}

/// Where an entry stands in its queue.
#[derive(Debug)]
pub(crate) enum Place {
    /// The lowest entry: it holds the lock.
    First,
    /// Behind `predecessor` (a name); `holder` is the lowest entry's name.
    Behind { predecessor: String, holder: String },
    /// The entry is gone (its session ended, or it was force-deleted).
    Gone,
}

/// One entry in a queue, deleted when dropped unless it became a lease.
#[derive(Debug)]
pub(crate) struct Attempt {
    session: Arc<Session>,
    pub(crate) queue: String,
    nonce: String,
    /// The node's name once known.
    name: Option<String>,
    czxid: i64,
    /// The TTL granted to the entry (see [`granted`]).
    ttl: Duration,
    /// The label written in the entry's data.
    label: Option<Label>,
    armed: bool,
    /// The queue's children as read right after the create, and when that
    /// read was sent: the first [`place`](Attempt::place) needs no round
    /// trip of its own.
    first_look: Option<(Instant, Vec<String>)>,
}

impl Drop for Attempt {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        // Without a runtime the node goes with the session.
        let (session, queue, nonce, name) = (
            Arc::clone(&self.session),
            std::mem::take(&mut self.queue),
            std::mem::take(&mut self.nonce),
            self.name.take(),
        );
        fenced_api::cleanup::spawn(async move {
            remove(&session, &queue, &nonce, name.as_deref()).await;
        });
    }
}

/// Pauses between tries to remove an entry: short first (a lost reply is
/// usually one dropped connection), then at most one try every 2 s.
const REMOVE_BACKOFF: Backoff = Backoff::new(Duration::from_millis(50), Duration::from_secs(2));

/// How many times an entry whose create reply was lost is looked for and
/// not found before it is taken as never created: a create may still be
/// applied after a first look (it was in flight when the connection broke).
const REMOVE_LOOKS: u32 = 3;

/// Deletes the entry `name` of `queue`, or — its name unknown because the
/// create's reply was lost — the entry carrying `nonce`.
///
/// Retried with backoff for as long as the session lives: a leftover entry
/// would block the key for everyone once it became the lowest, and nothing
/// else deletes it while its session is alive. When the session ends, the
/// server deletes the entry itself.
pub(crate) async fn remove(session: &Session, queue: &str, nonce: &str, name: Option<&str>) {
    let mut misses = 0;
    for attempt in 0u32.. {
        match remove_once(session, queue, nonce, name).await {
            Ok(true) => return,
            Ok(false) => {
                misses += 1;
                if misses >= REMOVE_LOOKS {
                    return;
                }
            }
            Err(e) if !e.is_retryable() => {
                tracing::warn!(queue, nonce, error = %e, "removing a queue entry failed; it stays until its session ends");
                return;
            }
            Err(e) => {
                tracing::debug!(queue, nonce, error = %e, "removing a queue entry failed; retrying")
            }
        }
        if !session.is_usable() {
            return; // the entry went with the session
        }
        tokio::time::sleep(REMOVE_BACKOFF.delay(attempt)).await;
    }
}

/// The name of the entry of `queue` carrying `nonce`, if there is one. A
/// create whose reply was lost may have been committed after a lagging
/// server answered: the read follows a sync, so it sees that create.
async fn find_by_nonce(session: &Session, queue: &str, nonce: &str) -> Result<Option<String>> {
    if let Err(e) = session.run("sync", session.client().sync(queue)).await? {
        return Err(error::map(e));
    }
    let children = match session
        .run("get children", session.client().list_children(queue))
        .await?
    {
        Ok(c) => c,
        Err(e) if kind(&e) == Kind::NoNode => return Ok(None),
        Err(e) => return Err(error::map(e)),
    };
    Ok(children
        .into_iter()
        .find(|c| c.starts_with(&entry_prefix(nonce))))
}

/// One try: `Ok(true)` when the entry is gone (deleted now or before),
/// `Ok(false)` when the entry of a lost create reply was not found.
async fn remove_once(
    session: &Session,
    queue: &str,
    nonce: &str,
    name: Option<&str>,
) -> Result<bool> {
    let name = match name {
        Some(n) => n.to_owned(),
        None => match find_by_nonce(session, queue, nonce).await? {
            Some(n) => n,
            None => return Ok(false),
        },
    };
    let path = format!("{queue}/{name}");
    match session
        .run("delete", session.client().delete(&path, None))
        .await?
    {
        Ok(()) => Ok(true),
        Err(e) if kind(&e) == Kind::NoNode => Ok(true),
        Err(e) => Err(error::map(e)),
    }
}

impl Attempt {
    /// Enters the queue of `key` as `owner`, on the session that covers
    /// `ttl` (see [`Sessions::for_ttl`]); the entry's TTL is what that
    /// session grants ([`granted`]).
    pub(crate) async fn enter(
        parts: Parts<'_>,
        key: &LockKey,
        owner: &Owner,
        ttl: Duration,
        label: Option<&Label>,
    ) -> Result<Attempt> {
        let session = parts.sessions.for_ttl(ttl).await?;
        let ttl = granted(ttl, session.negotiated());
        let data = entry::data(owner, ttl, label);
        let data = &data[..];
        let mut attempt = Attempt {
            ttl,
            label: label.cloned(),
            queue: parts.keys.queue(key),
            nonce: uuid::Uuid::new_v4().simple().to_string(),
            name: None,
            czxid: 0,
            armed: true,
            first_look: None,
            session,
        };
        let prefix = format!("{}/{}", attempt.queue, entry_prefix(&attempt.nonce));
        let options = CreateMode::EphemeralSequential.with_acls(Acls::anyone_all());
        let s = Arc::clone(&attempt.session);
        for _ in 0..3 {
            // The children read goes out right behind the create, without
            // waiting for its reply: the client sends requests in the order
            // they are made and the server runs a session's requests in that
            // order, so the read sees the new entry. One round trip finds
            // the entry's place.
            let sent = Instant::now();
            let create = s.client().create(&prefix, data, &options);
            let look = s.client().list_children(&attempt.queue);
            match s.run("create", create).await? {
                Ok((stat, sequence)) => {
                    attempt.name = Some(format!("{}{sequence}", entry_prefix(&attempt.nonce)));
                    attempt.czxid = stat.czxid;
                    match s.run("get children", look).await? {
                        Ok(children) => attempt.first_look = Some((sent, children)),
                        // The queue vanished (force-deleted with the
                        // entry): the first place reads again and finds
                        // the entry gone.
                        Err(e) if kind(&e) == Kind::NoNode => {}
                        // No list, no place: the caller gives up and the
                        // dropped attempt deletes its entry.
                        Err(e) => return Err(error::map(e)),
                    }
                    return Ok(attempt);
                }
                Err(e) if kind(&e) == Kind::NoNode => {
                    make_queue(&s, parts.keys, &attempt.queue).await?
                }
                Err(e) if kind(&e) == Kind::Retryable => {
                    // The reply was lost: the node may exist. Find it by
                    // its nonce; if it is not there (yet), dropping the
                    // attempt looks again and deletes it.
                    if attempt.find().await? {
                        return Ok(attempt);
                    }
                    return Err(error::map(e));
                }
                Err(e) => return Err(error::map(e)),
            }
        }
        Err(Error::backend(
            error::BACKEND,
            true,
            "the queue node vanished three times in a row",
        ))
    }

    /// Looks for this attempt's node among the queue's children (after a
    /// sync, so a lagging server cannot hide a committed create).
    async fn find(&mut self) -> Result<bool> {
        self.name = find_by_nonce(&self.session, &self.queue, &self.nonce).await?;
        Ok(self.name.is_some())
    }

    fn name(&self) -> &str {
        self.name.as_deref().unwrap_or_default()
    }

    /// The session the entry is on.
    pub(crate) fn session(&self) -> &Arc<Session> {
        &self.session
    }

    /// The full path of an entry of this queue.
    pub(crate) fn path_of(&self, name: &str) -> String {
        format!("{}/{name}", self.queue)
    }

    /// Where the entry stands now (one children read; none the first time,
    /// which uses the read sent with the create), and the send time of that
    /// read: a grant counts its lease from it.
    pub(crate) async fn place(&mut self) -> Result<(Place, Instant)> {
        let (sent, children) = match self.first_look.take() {
            Some(look) => look,
            None => {
                let s = &self.session;
                let sent = Instant::now();
                match s
                    .run("get children", s.client().list_children(&self.queue))
                    .await?
                {
                    Ok(c) => (sent, c),
                    Err(e) if kind(&e) == Kind::NoNode => return Ok((Place::Gone, sent)),
                    Err(e) => return Err(error::map(e)),
                }
            }
        };
        let children = in_order(children);
        let Some(i) = children.iter().position(|c| c == self.name()) else {
            return Ok((Place::Gone, sent));
        };
        if i == 0 {
            return Ok((Place::First, sent));
        }
        let place = Place::Behind {
            predecessor: children[i - 1].clone(),
            holder: children[0].clone(),
        };
        Ok((place, sent))
    }

    /// The data of the entry `name` of this queue; `None` if it is gone.
    pub(crate) async fn data_of(&self, name: &str) -> Result<Option<Vec<u8>>> {
        let s = &self.session;
        match s
            .run("get", s.client().get_data(&self.path_of(name)))
            .await?
        {
            Ok((data, _)) => Ok(Some(data)),
            Err(e) if kind(&e) == Kind::NoNode => Ok(None),
            Err(e) => Err(error::map(e)),
        }
    }

    /// Leaves the queue: the entry is deleted by a spawned task (as when
    /// the attempt is dropped), so the caller neither waits for the delete
    /// nor leaves the node behind if it is itself dropped. The entry
    /// cannot hold the lock meanwhile: it is behind the holder.
    pub(crate) fn leave(self) {
        drop(self);
    }

    /// The entry holds the lock: it becomes a tracked lease with a
    /// deadline its TTL after `sent`, the send time of a request on the
    /// entry's own session at or before the read that showed it first. The token is the node's creation zxid, from the create's
    /// reply or a follow-up read when that reply carried none.
    pub(crate) async fn grant(
        mut self,
        tracker: &Tracker,
        key: &LockKey,
        owner: Owner,
        sent: Instant,
    ) -> Result<Lease> {
        let ttl = self.ttl;
        let path = self.path_of(self.name());
        if self.czxid <= 0 {
            let s = &self.session;
            match s.run("exists", s.client().check_stat(&path)).await? {
                Ok(Some(Stat { czxid, .. })) => self.czxid = czxid,
                Ok(None) => {
                    return Err(Error::backend(
                        error::BACKEND,
                        true,
                        "the granted node vanished",
                    ))
                }
                Err(e) => return Err(error::map(e)),
            }
        }
        self.armed = false;
        let node = Node {
            session: self.session.id(),
            owner: owner.clone(),
            label: self.label.take(),
        };
        tracker.track((path, self.czxid), node, sent + ttl);
        Ok(Lease::new(
            key.clone(),
            owner,
            FencingToken::new(self.czxid as u64),
            ttl,
            sent,
        ))
    }
}

/// Creates the namespace (persistent nodes) and the queue (a container
/// node, which the server deletes once it is empty).
pub(crate) async fn make_queue(s: &Session, keys: &Keys, queue: &str) -> Result<()> {
    let persistent = CreateMode::Persistent.with_acls(Acls::anyone_all());
    match s
        .run(
            "create namespace",
            s.client().mkdir(keys.namespace(), &persistent),
        )
        .await?
    {
        Ok(()) => {}
        Err(e) => return Err(error::map(e)),
    }
    let container = CreateMode::Container.with_acls(Acls::anyone_all());
    match s
        .run("create queue", s.client().create(queue, &[], &container))
        .await?
    {
        Ok(_) => Ok(()),
        Err(e) if kind(&e) == Kind::NodeExists => Ok(()),
        Err(e) => Err(error::map(e)),
    }
}
