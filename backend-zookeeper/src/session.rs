//! Sessions: one ZooKeeper session per client, replaced when it ends.
//!
//! Every ephemeral node this client creates lives on the current session.
//! When the session ends (`Expired`, or closed), every lock on it is lost
//! at once — the server has deleted their nodes — and the next call opens a
//! new session. A session is never resumed after it expired, so a lock is
//! never believed held on a session the server already ended.

use std::{
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

    fn is_usable(&self) -> bool {
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
        tracker.session_lost(id);
    }
}

/// The session of one client, and how to make the next.
#[derive(Debug)]
pub(crate) struct Sessions {
    config: ZkConfig,
    tracker: Arc<Tracker>,
    current: tokio::sync::Mutex<Option<Arc<Session>>>,
}

impl Sessions {
    /// Opens the first session (so that a client that cannot reach
    /// ZooKeeper fails at once).
    pub(crate) async fn connect(config: ZkConfig, tracker: Arc<Tracker>) -> Result<Sessions> {
        let first = open(&config, &tracker).await?;
        Ok(Sessions {
            config,
            tracker,
            current: tokio::sync::Mutex::new(Some(Arc::new(first))),
        })
    }

    /// The current session, or a new one when it ended.
    pub(crate) async fn get(&self) -> Result<Arc<Session>> {
        let mut current = self.current.lock().await;
        if let Some(s) = current.as_ref().filter(|s| s.is_usable()) {
            return Ok(Arc::clone(s));
        }
        if let Some(old) = current.take() {
            old.end();
        }
        let fresh = Arc::new(open(&self.config, &self.tracker).await?);
        *current = Some(Arc::clone(&fresh));
        Ok(fresh)
    }

    /// The negotiated timeout of the current session, if there is one.
    pub(crate) fn negotiated(&self) -> Option<Duration> {
        self.current
            .try_lock()
            .ok()
            .and_then(|c| c.as_ref().map(|s| s.negotiated()))
    }
}

/// Establishes a session within the connect timeout.
async fn open(config: &ZkConfig, tracker: &Arc<Tracker>) -> Result<Session> {
    let mut connector = Client::connector()
        .with_session_timeout(config.session_timeout)
        .with_connection_timeout(config.connect_timeout)
        .with_fail_eagerly();
    if let Some((user, password)) = &config.user {
        connector = connector.with_auth("digest", format!("{user}:{password}").as_bytes());
    }
    let at = config.connect_string();
    let client = bounded("connect", config.connect_timeout, connector.connect(&at))
        .await
        .map_err(|e| e.connecting(&at))?
        .map_err(|e| error::map(e).connecting(&at))?;
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
