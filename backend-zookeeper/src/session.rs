//! Sessions: one ZooKeeper session per client (and one per longer lock
//! TTL, see [`Sessions`]), each replaced when it ends.
//!
//! Every ephemeral node this client creates lives on one of them. When a
//! session ends (`Expired`, or closed), every lock on it is lost
//! at once — the server has deleted their nodes — and the next call opens a
//! new session. A session is never resumed after it expired, so a lock is
//! never believed held on a session the server already ended.

use std::{
    collections::BTreeMap,
    future::Future,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    time::Duration,
};

use fenced_api::{Error, Result};
use tokio::task::JoinHandle;
use zookeeper_client::{Client, Error as ZkError, SessionState};

use crate::{
    config::ZkConfig,
    error::{self, bounded, kind, Kind},
    tls::{self, Tls},
    track::Tracker,
};

/// One ZooKeeper session.
#[derive(Debug)]
pub(crate) struct Session {
    client: Client,
    id: i64,
    timeout: Duration,
    ended: Arc<AtomicBool>,
    tracker: Arc<Tracker>,
    watch: JoinHandle<()>,
}

impl Drop for Session {
    fn drop(&mut self) {
        self.watch.abort();
    }
}

impl Session {
    pub(crate) fn client(&self) -> &Client {
        &self.client
    }

    /// The session id (what ephemeral nodes carry as their owner).
    pub(crate) fn id(&self) -> i64 {
        self.id
    }

    /// The bound on one request.
    pub(crate) fn timeout(&self) -> Duration {
        self.timeout
    }

    /// The session timeout the server granted.
    pub(crate) fn negotiated(&self) -> Duration {
        self.client.session_timeout()
    }

    /// Neither ended nor closed: requests on it may still succeed.
    pub(crate) fn is_usable(&self) -> bool {
        !self.ended.load(Ordering::Acquire) && !self.client.state().is_terminated()
    }

    fn end(&self) {
        end(&self.ended, &self.tracker, self.id);
    }

    /// Runs one request of this session, bounded: ZooKeeper's answer (left
    /// to the caller to classify), or a retryable error when it is silent.
    /// An answer saying the session ended ends it here too.
    pub(crate) async fn run<T>(
        &self,
        what: &str,
        call: impl Future<Output = std::result::Result<T, ZkError>>,
    ) -> Result<std::result::Result<T, ZkError>> {
        let r = bounded(what, self.timeout, call).await?;
        if let Err(e) = &r {
            if kind(e) == Kind::SessionLost {
                self.end();
            }
        }
        Ok(r)
    }
}

fn end(ended: &AtomicBool, tracker: &Tracker, id: i64) {
    if !ended.swap(true, Ordering::AcqRel) {
        tracing::warn!(
            session = format!("{id:#x}"),
            "ZooKeeper session ended; every lock on it is lost"
        );
        tracker.lose_where(|_, node| node.session == id);
    }
}

/// One session timeout's current session, and how to make the next.
#[derive(Debug)]
struct Slot {
    /// The session timeout asked of the server.
    timeout: Duration,
    /// The current session: read without waiting (extends look sessions up
    /// by id while other requests are opening or using them).
    current: std::sync::Mutex<Option<Arc<Session>>>,
    /// Held while a new session is opened, so that one opens at a time.
    opening: tokio::sync::Mutex<()>,
}

impl Slot {
    fn new(timeout: Duration, first: Option<Session>) -> Slot {
        Slot {
            timeout,
            current: std::sync::Mutex::new(first.map(Arc::new)),
            opening: tokio::sync::Mutex::new(()),
        }
    }

    /// The current session, or a new one when it ended.
    async fn get(&self, config: &ZkConfig, tracker: &Arc<Tracker>) -> Result<Arc<Session>> {
        if let Some(s) = self.peek() {
            return Ok(s);
        }
        let _opening = self.opening.lock().await;
        // Another caller may have opened one while this one waited.
        if let Some(s) = self.peek() {
            return Ok(s);
        }
        if let Some(old) = self.current().take() {
            old.end();
        }
        let fresh = Arc::new(open(config, self.timeout, tracker).await?);
        *self.current() = Some(Arc::clone(&fresh));
        Ok(fresh)
    }

    fn current(&self) -> std::sync::MutexGuard<'_, Option<Arc<Session>>> {
        self.current.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The current session, if it is usable.
    fn peek(&self) -> Option<Arc<Session>> {
        self.current()
            .as_ref()
            .filter(|s| s.is_usable())
            .map(Arc::clone)
    }
}

/// The sessions of one client: the base session (the configured timeout),
/// which carries every read and every lock whose TTL its negotiated timeout
/// covers, and one more session per longer TTL (in whole seconds), opened
/// when first needed.
///
/// Why a lock never lives on a session shorter than its TTL: a partitioned
/// client cannot delete its node at the lock's deadline, so only the
/// session's expiry frees the key. The server expires a session one
/// negotiated timeout after the last request it received on it, and every
/// grant and extend is a request on the lock's own session sent at the
/// instant its deadline counts from — so with TTL ≤ negotiated timeout the
/// server cannot free the key before the holder's deadline. A TTL longer
/// than the longest session the server grants is shortened to it
/// ([`granted`]).
#[derive(Debug)]
pub(crate) struct Sessions {
    config: ZkConfig,
    tracker: Arc<Tracker>,
    base: Slot,
    /// Longer-TTL sessions by requested timeout in whole seconds.
    classes: std::sync::Mutex<BTreeMap<u64, Arc<Slot>>>,
}

impl Sessions {
    /// Opens the base session (so that a client that cannot reach
    /// ZooKeeper fails at once).
    pub(crate) async fn connect(config: ZkConfig, tracker: Arc<Tracker>) -> Result<Sessions> {
        let first = open(&config, config.session_timeout, &tracker).await?;
        Ok(Sessions {
            base: Slot::new(config.session_timeout, Some(first)),
            config,
            tracker,
            classes: std::sync::Mutex::new(BTreeMap::new()),
        })
    }

    /// The base session, or a new one when it ended: for reads, deletes,
    /// and locks whose TTL it covers.
    pub(crate) async fn get(&self) -> Result<Arc<Session>> {
        self.base.get(&self.config, &self.tracker).await
    }

    /// The session a lock with `ttl` lives on: the base session when its
    /// negotiated timeout covers `ttl`, otherwise the session of `ttl`
    /// rounded up to whole seconds (whose negotiated timeout may still be
    /// shorter, when the server's `maxSessionTimeout` is: see [`granted`]).
    pub(crate) async fn for_ttl(&self, ttl: Duration) -> Result<Arc<Session>> {
        let base = self.get().await?;
        if ttl <= base.negotiated() {
            return Ok(base);
        }
        if let Some(open) = self.covering(ttl) {
            return Ok(open);
        }
        let secs = ttl.as_secs() + u64::from(ttl.subsec_nanos() > 0);
        let slot = {
            let mut classes = self.classes.lock().unwrap_or_else(|p| p.into_inner());
            Arc::clone(
                classes
                    .entry(secs)
                    .or_insert_with(|| Arc::new(Slot::new(Duration::from_secs(secs), None))),
            )
        };
        slot.get(&self.config, &self.tracker).await
    }

    /// The longer-TTL slots, copied out of their lock.
    fn class_slots(&self) -> Vec<Arc<Slot>> {
        self.classes
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .cloned()
            .collect()
    }

    /// An open longer-TTL session a lock with `ttl` can live on instead of
    /// opening another: the shortest whose negotiated timeout covers `ttl`,
    /// or — once the server granted a session shorter than asked, i.e. at
    /// its `maxSessionTimeout` — that one (a new session would be cut to the
    /// same length). Keeps the sessions of a client few.
    fn covering(&self, ttl: Duration) -> Option<Arc<Session>> {
        let open: Vec<(Duration, Arc<Session>)> = self
            .class_slots()
            .iter()
            .filter_map(|slot| slot.peek().map(|s| (slot.timeout, s)))
            .collect();
        let covers = open
            .iter()
            .filter(|(_, s)| s.negotiated() >= ttl)
            .min_by_key(|(_, s)| s.negotiated());
        let capped = open
            .iter()
            .filter(|(asked, s)| s.negotiated() < *asked)
            .max_by_key(|(_, s)| s.negotiated());
        covers.or(capped).map(|(_, s)| Arc::clone(s))
    }

    /// This client's current session with id `id`, if it is one.
    pub(crate) fn by_id(&self, id: i64) -> Option<Arc<Session>> {
        let classes = self.class_slots();
        std::iter::once(self.base.peek())
            .chain(classes.iter().map(|slot| slot.peek()))
            .flatten()
            .find(|s| s.id() == id)
    }

    /// The negotiated timeout of the base session, if there is one.
    pub(crate) fn negotiated(&self) -> Option<Duration> {
        self.base.peek().map(|s| s.negotiated())
    }
}

/// The TTL a lock asking for `ttl` gets on a session of `negotiated`
/// timeout: `ttl`, or the session timeout when that is shorter — a lock
/// cannot outlive its session (the server's `maxSessionTimeout` bounds the
/// longest lease; the lease says what was granted, and `LockClient` renews
/// by it).
pub(crate) fn granted(ttl: Duration, negotiated: Duration) -> Duration {
    if ttl > negotiated {
        tracing::debug!(
            asked_ms = ttl.as_millis() as u64,
            granted_ms = negotiated.as_millis() as u64,
            "lock TTL shortened to its ZooKeeper session's timeout"
        );
    }
    ttl.min(negotiated)
}

/// Establishes a session within the connect timeout.
async fn open(config: &ZkConfig, timeout: Duration, tracker: &Arc<Tracker>) -> Result<Session> {
    let mut connector = Client::connector()
        .with_session_timeout(timeout)
        .with_connection_timeout(config.connect_timeout)
        .with_fail_eagerly();
    if let Some((user, password)) = &config.user {
        connector = connector.with_auth("digest", format!("{user}:{password}").as_bytes());
    }
    // Certificates are read before anything is sent: a bad file is a
    // configuration error, not an unreachable server.
    let tls = Tls::load(config)?;
    let at = config.connect_string();
    let deadline = tokio::time::Instant::now() + config.connect_timeout;
    let connecting = tls::connect(tls.as_ref(), connector, &at);
    let client = match bounded("connect", config.connect_timeout, connecting)
        .await
        .and_then(|r| r.map_err(error::map))
    {
        Ok(client) => client,
        Err(e) => {
            let e = tls::explain(tls.as_ref(), &config.hosts, deadline, e).await;
            return Err(e.connecting(&at));
        }
    };
    let id = client.session_id().0;
    let ended = Arc::new(AtomicBool::new(false));
    let mut states = client.state_watcher();
    let watch = {
        let (ended, tracker) = (Arc::clone(&ended), Arc::clone(tracker));
        tokio::spawn(async move {
            loop {
                let state = states.changed().await;
                match state {
                    SessionState::Disconnected => {
                        tracing::debug!(
                            session = format!("{id:#x}"),
                            "ZooKeeper disconnected; locks stand until their deadlines"
                        )
                    }
                    s if s.is_terminated() => {
                        end(&ended, &tracker, id);
                        return;
                    }
                    _ => {}
                }
            }
        })
    };
    if client.state().is_terminated() {
        return Err(Error::backend(
            error::BACKEND,
            true,
            "the new session ended at once",
        ));
    }
    Ok(Session {
        client,
        id,
        timeout: config.operation_timeout,
        ended,
        tracker: Arc::clone(tracker),
        watch,
    })
}
