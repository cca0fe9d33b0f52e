//! One watch stream per client, shared by all its waiters (watches are
//! created and cancelled as messages on it, not as new gRPC streams).
//!
//! Every watch starts at the server's current revision (`start_revision`
//! 0), so etcd puts it in its *synced* group and delivers events as they
//! commit. A watch started at an older revision joins the unsynced group and
//! waits for etcd's 100 ms sync loop — before *any* event reaches it, even
//! one committed after the watch was created. The caller learns from the
//! creation reply the revision the watch starts after and re-reads the key
//! if anything happened since it last looked (see the parent module).

use std::{
    collections::HashMap,
    sync::atomic::{AtomicI64, Ordering},
};

use etcd_client::{
    EventType, WatchOptions, WatchRequestSender, WatchResponse, WatchResponseStream,
};
use fenced_api::{Error, Result};
use tokio::sync::mpsc;

use crate::{
    client::Etcd,
    error::{self, bounded},
};

enum Cmd {
    Watch {
        id: i64,
        key: Vec<u8>,
        tx: mpsc::UnboundedSender<WatchResponse>,
    },
    Cancel(i64),
}

/// The shared stream of one client (opened on first use, reopened after it breaks).
pub(crate) struct WatchHub {
    etcd: Etcd,
    conn: tokio::sync::Mutex<Option<mpsc::UnboundedSender<Cmd>>>,
    next_id: AtomicI64,
}

/// One watch on one key; cancelled on drop.
pub(crate) struct Watch {
    id: i64,
    rx: mpsc::UnboundedReceiver<WatchResponse>,
    cmds: mpsc::UnboundedSender<Cmd>,
    /// The watch reports every event after this revision.
    pub(crate) after: i64,
}

impl Drop for Watch {
    fn drop(&mut self) {
        let _ = self.cmds.send(Cmd::Cancel(self.id));
    }
}

/// What a watch saw next.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Seen {
    /// The key was deleted.
    Deleted,
    /// The key was written (and not deleted after, in the same response),
    /// now on this lease (0: none).
    Put { lease: i64 },
    /// Nothing that concerns the key (progress): keep waiting.
    Other,
    /// The watch or its stream ended: re-read the store.
    Ended,
}

impl Watch {
    pub(crate) async fn next(&mut self) -> Seen {
        seen(self.rx.recv().await)
    }

    /// What the stream has already delivered to this watch, without
    /// waiting: the first deletion (or end) among the responses routed to it
    /// so far, else `Other`. The stream's one dispatcher routes responses in
    /// the order etcd sent them, so a deletion etcd sent before an event
    /// another watch of this client just received is found here.
    pub(crate) fn delivered(&mut self) -> Seen {
        let mut last = Seen::Other;
        loop {
            match self.rx.try_recv() {
                Ok(r) => match seen(Some(r)) {
                    s @ (Seen::Deleted | Seen::Ended) => return s,
                    s @ Seen::Put { .. } => last = s,
                    Seen::Other => {}
                },
                Err(mpsc::error::TryRecvError::Empty) => return last,
                Err(mpsc::error::TryRecvError::Disconnected) => return Seen::Ended,
            }
        }
    }
}

fn seen(r: Option<WatchResponse>) -> Seen {
    match r {
        None => Seen::Ended,
        Some(r) if r.canceled() => Seen::Ended,
        Some(r) => {
            let has = |t: EventType| r.events().iter().any(|e| e.event_type() == t);
            if has(EventType::Delete) {
                Seen::Deleted
            } else if let Some(kv) = r
                .events()
                .iter()
                .rev()
                .filter(|e| e.event_type() == EventType::Put)
                .find_map(|e| e.kv())
            {
                Seen::Put { lease: kv.lease() }
            } else {
                Seen::Other
            }
        }
    }
}

impl WatchHub {
    pub(crate) fn new(etcd: Etcd) -> WatchHub {
        WatchHub {
            etcd,
            conn: tokio::sync::Mutex::new(None),
            next_id: AtomicI64::new(0),
        }
    }

    /// Watches `key` from now on; returns once etcd confirmed the watch.
    pub(crate) async fn watch(&self, key: &[u8]) -> Result<Watch> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed) + 1;
        let (tx, mut rx) = mpsc::unbounded_channel();
        let cmds = {
            let mut conn = self.conn.lock().await;
            let live = conn.as_ref().filter(|c| !c.is_closed()).cloned();
            let sent = match live {
                Some(c) => c
                    .send(Cmd::Watch {
                        id,
                        key: key.to_vec(),
                        tx: tx.clone(),
                    })
                    .ok()
                    .map(|()| c),
                None => None,
            };
            match sent {
                Some(c) => c,
                None => {
                    let opts = WatchOptions::new().with_watch_id(id);
                    let stream = self
                        .etcd
                        .call("watch", |mut c| {
                            let (key, opts) = (key.to_vec(), opts.clone());
                            async move { c.watch(key, Some(opts)).await }
                        })
                        .await?;
                    let (sender, responses) = stream.split();
                    let (cmd_tx, cmd_rx) = mpsc::unbounded_channel();
                    let mut routes = HashMap::new();
                    routes.insert(id, tx);
                    tokio::spawn(dispatch(sender, responses, cmd_rx, routes));
                    *conn = Some(cmd_tx.clone());
                    cmd_tx
                }
            }
        };
        let created = match bounded("watch", self.etcd.timeout(), rx.recv()).await {
            Ok(Some(r)) if r.created() && !r.canceled() => r,
            Ok(Some(r)) => {
                let _ = cmds.send(Cmd::Cancel(id));
                return Err(Error::backend(
                    error::BACKEND,
                    true,
                    format!("etcd refused the watch: {}", r.cancel_reason()),
                ));
            }
            Ok(None) => {
                return Err(Error::backend(
                    error::BACKEND,
                    true,
                    "the watch stream closed",
                ))
            }
            Err(silent) => {
                let _ = cmds.send(Cmd::Cancel(id));
                return Err(silent);
            }
        };
        Ok(Watch {
            id,
            rx,
            cmds,
            after: created.header().map_or(0, |h| h.revision()),
        })
    }
}

/// Routes the responses of the shared stream by watch id; ends (closing
/// every watch) when the stream breaks or the client is dropped.
async fn dispatch(
    mut sender: WatchRequestSender,
    mut responses: WatchResponseStream,
    mut cmds: mpsc::UnboundedReceiver<Cmd>,
    mut routes: HashMap<i64, mpsc::UnboundedSender<WatchResponse>>,
) {
    loop {
        tokio::select! {
            cmd = cmds.recv() => match cmd {
                None => return,
                Some(Cmd::Watch { id, key, tx }) => {
                    routes.insert(id, tx);
                    let opts = WatchOptions::new().with_watch_id(id);
                    if sender.watch(key, Some(opts)).await.is_err() {
                        return;
                    }
                }
                Some(Cmd::Cancel(id)) => {
                    if routes.remove(&id).is_some() && sender.cancel(id).await.is_err() {
                        return;
                    }
                }
            },
            msg = responses.message() => match msg {
                Ok(Some(resp)) => {
                    let id = resp.watch_id();
                    if let Some(tx) = routes.get(&id) {
                        if tx.send(resp).is_err() {
                            routes.remove(&id);
                            if sender.cancel(id).await.is_err() {
                                return;
                            }
                        }
                    }
                }
                Ok(None) => return,
                Err(e) => {
                    tracing::debug!(error = %e, "etcd watch stream broken; waiters re-read and re-watch");
                    return;
                }
            },
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use std::time::Duration;

    use super::{Seen, WatchHub};
    use crate::{client::Etcd, EtcdConfig};

    /// Two watches on one client's stream: a deletion reaches its own
    /// watch, and only that one (needs the etcd of `scripts/services.sh`).
    #[tokio::test]
    async fn each_watch_gets_only_its_own_events() {
        let url = std::env::var("FENCED_TEST_ETCD_URL")
            .ok()
            .filter(|u| !u.is_empty())
            .unwrap_or_else(|| "http://127.0.0.1:2379".into());
        let host = url.split_once("://").map_or(url.as_str(), |(_, h)| h);
        let host = host.split('/').next().unwrap_or(host).to_owned();
        let config =
            EtcdConfig::from_url(&format!("etcd://{host}/watch-test?connect_timeout=3s")).unwrap();
        let etcd = Etcd::connect(&config)
            .await
            .unwrap_or_else(|e| panic!("etcd unreachable ({e}); run scripts/services.sh"));
        let hub = WatchHub::new(etcd.clone());
        let id = uuid::Uuid::new_v4().simple().to_string();
        let (a, b) = (format!("watch-test/{id}/a"), format!("watch-test/{id}/b"));
        for k in [&a, &b] {
            let k = k.clone();
            etcd.call("put", |mut c| {
                let k = k.clone();
                async move { c.put(k, "x", None).await }
            })
            .await
            .unwrap();
        }
        let mut wa = hub.watch(a.as_bytes()).await.unwrap();
        let mut wb = hub.watch(b.as_bytes()).await.unwrap();
        let delete = |k: String| {
            let etcd = etcd.clone();
            async move {
                etcd.call("delete", |mut c| {
                    let k = k.clone();
                    async move { c.delete(k, None).await }
                })
                .await
                .unwrap();
            }
        };
        delete(b.clone()).await;
        let seen = tokio::time::timeout(Duration::from_secs(10), wb.next()).await;
        assert_eq!(seen.ok(), Some(Seen::Deleted), "b's watch saw b's deletion");
        assert!(wa.rx.try_recv().is_err(), "a's watch saw nothing");
        delete(a.clone()).await;
        let seen = tokio::time::timeout(Duration::from_secs(10), wa.next()).await;
        assert_eq!(seen.ok(), Some(Seen::Deleted));
    }
}
