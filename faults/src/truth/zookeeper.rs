//! ZooKeeper server truth: the transaction log of a private ZooKeeper.
//!
//! Every change ZooKeeper commits is first appended to its transaction log
//! (`<dataDir>/version-2/log.<first zxid>`, fsynced before the client hears
//! back): the zxid that orders it, the session that asked, the server's
//! time, and the change — a node created (its path, whether ephemeral), a
//! node deleted, a session closed or expired (which deletes every ephemeral
//! node of that session). The ZooKeeper cells run against a private
//! standalone server ([`private_server`], tickTime 500 ms: see
//! [`ZOOKEEPER_TICK_MS`](crate::scenario::ZOOKEEPER_TICK_MS))
//! whose data directory this process owns; after each run the log is read
//! up to an end marker the recorder creates, so it is complete.
//!
//! fenced-zookeeper keeps the queue of a key as the ephemeral sequential
//! children `<nonce>-<sequence>` of the container `<namespace>/k<key>`; the
//! live child with the lowest sequence holds the lock and its creation zxid
//! is the token. Per queue, a **grant** is a child from the zxid at which it
//! became the lowest live child (its own create, or the delete or session
//! end that removed the one before it) to the zxid that removed it (delete,
//! or the end of its session). A younger child holding while an older one
//! lives — or a child appearing with a sequence below a live holder's —
//! would make two grants overlap or the token go back.
//!
//! Every grant a client reported is then matched to the log, on the
//! server's own clock (the log's times are the server's wall clock in ms,
//! this machine's; the run's clock is mapped onto it at the start and the
//! end of the run): its token must be the creation zxid of a child that
//! held; the child must have been created after the client asked (each
//! attempt creates a child of its own: a token from an earlier attempt is
//! not a grant of this one), and it must have become the holder before the
//! client was told it holds. Both comparisons allow [`CLOCK_MARGIN_MS`].

use std::{
    collections::{BTreeMap, BTreeSet},
    path::{Path, PathBuf},
    sync::{Arc, Mutex, Weak},
    time::Duration,
};

use fenced::zookeeper::zookeeper_client::{Acls, Client, CreateMode};

pub use super::clock::ClockMap;
use super::clock::{clock_pair, ClockPair};
use crate::{
    history::{Event, History, Op, Phase, ServerGrant},
    private::{PrivateZooKeeper, ZooKeeperOptions},
};

/// The slack of the time comparisons between the log and the run: the
/// log's times are whole milliseconds, and the run's monotonic clock is
/// mapped onto the wall clock.
pub const CLOCK_MARGIN_MS: f64 = 10.0;

static SHARED: Mutex<Weak<PrivateZooKeeper>> = Mutex::new(Weak::new());
static START: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// The process's private ZooKeeper whose transaction log the recorder
/// reads, started on first use (standalone, ticking every
/// [`ZOOKEEPER_TICK_MS`](crate::scenario::ZOOKEEPER_TICK_MS)). While a
/// handle lives, the ZooKeeper target of the fault suite uses it instead of
/// the shared server.
///
/// # Errors
///
/// When it cannot be started (names `scripts/services.sh` when Java or
/// ZooKeeper is missing).
pub async fn private_server() -> Result<Arc<PrivateZooKeeper>, String> {
    let _gate = START.lock().await;
    if let Some(zk) = current() {
        return Ok(zk);
    }
    let zk = PrivateZooKeeper::start(ZooKeeperOptions {
        members: 1,
        tick_ms: crate::model::ZOOKEEPER_TICK_MS,
        ..ZooKeeperOptions::default()
    })
    .await
    .map_err(|e| format!("private ZooKeeper with a transaction log: {e}"))?;
    let zk = Arc::new(zk);
    *SHARED.lock().unwrap_or_else(|p| p.into_inner()) = Arc::downgrade(&zk);
    Ok(zk)
}

fn current() -> Option<Arc<PrivateZooKeeper>> {
    SHARED.lock().unwrap_or_else(|p| p.into_inner()).upgrade()
}

/// The URL (`zk://host:port`) of the private ZooKeeper while one is in use.
pub fn server_url() -> Option<String> {
    current().map(|zk| format!("zk://{}", zk.hostports()))
}

/// Why a ZooKeeper run on the shared server has no server truth.
pub const SHARED_REASON: &str = "the run used the shared ZooKeeper, whose transaction log this process does not own (hold truth::zookeeper::private_server() while running)";

mod txnlog;

pub use txnlog::{read_log, Change, Txn};

/// The log files of a data directory, by their first zxid.
fn log_files(version2: &Path) -> Result<BTreeMap<i64, PathBuf>, String> {
    let dir = std::fs::read_dir(version2)
        .map_err(|e| format!("zookeeper truth: listing {}: {e}", version2.display()))?;
    let mut out = BTreeMap::new();
    for e in dir.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if let Some(hex) = name.strip_prefix("log.") {
            if let Ok(z) = i64::from_str_radix(hex, 16) {
                out.insert(z, e.path());
            }
        }
    }
    Ok(out)
}

/// The log files runs still need: per recorder in flight, the first zxid
/// of the file that was the newest when it started. Older files are
/// deleted as runs end (a full profile writes gigabytes otherwise).
static IN_FLIGHT: Mutex<BTreeMap<u64, i64>> = Mutex::new(BTreeMap::new());
static NEXT_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

fn in_flight() -> std::sync::MutexGuard<'static, BTreeMap<u64, i64>> {
    IN_FLIGHT.lock().unwrap_or_else(|p| p.into_inner())
}

/// Deletes the log files no run in flight needs: every file older than the
/// oldest one a run needs, never the newest (ZooKeeper writes to it).
fn purge(version2: &Path) {
    let flight = in_flight();
    let Ok(files) = log_files(version2) else {
        return;
    };
    let Some(newest) = files.keys().next_back().copied() else {
        return;
    };
    let keep_from = flight.values().min().copied().unwrap_or(newest).min(newest);
    for path in files.range(..keep_from).map(|(_, p)| p) {
        let _ = std::fs::remove_file(path);
    }
}

// ---------------------------------------------------------------------------
// The recorder.

/// What a finished recording holds: the run's transactions and the clock
/// mapping.
#[derive(Debug, Clone)]
pub struct Record {
    /// The namespace of the run (`/fenced-faults-<ns>`).
    pub namespace: String,
    /// The transactions of the run, in zxid order (others' left out).
    pub txns: Vec<Txn>,
    /// The run's clock on the wall clock.
    pub clock: ClockMap,
}

/// The transaction log of one run, from its start.
pub struct TxnLog {
    id: u64,
    version2: PathBuf,
    first_file: i64,
    hostport: String,
    namespace: String,
    history: History,
    start: ClockPair,
    _server: Arc<PrivateZooKeeper>,
}

impl std::fmt::Debug for TxnLog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TxnLog")
            .field("version2", &self.version2)
            .field("namespace", &self.namespace)
            .finish_non_exhaustive()
    }
}

impl Drop for TxnLog {
    fn drop(&mut self) {
        in_flight().remove(&self.id);
    }
}

/// `host:port` list and namespace of a `zk://hosts/namespace?…` URL.
fn split_url(url: &str) -> Option<(&str, String)> {
    let rest = url.split_once("://")?.1;
    let rest = rest.split('?').next().unwrap_or(rest);
    let (hosts, path) = rest.split_once('/')?;
    let hosts = hosts.rsplit_once('@').map_or(hosts, |(_, h)| h);
    Some((hosts, format!("/{}", path.trim_end_matches('/'))))
}

fn zk_err(what: &str, e: impl std::fmt::Display) -> String {
    format!("zookeeper truth: {what}: {e}")
}

async fn admin_client(hostport: &str) -> Result<Client, String> {
    let connect = Client::connector()
        .with_session_timeout(Duration::from_secs(10))
        .with_connection_timeout(Duration::from_secs(5))
        .connect(hostport);
    tokio::time::timeout(Duration::from_secs(10), connect)
        .await
        .map_err(|_| zk_err("connecting", "no session within 10 s"))?
        .map_err(|e| zk_err("connecting", e))
}

impl TxnLog {
    /// Starts recording the run whose URL is `url` (straight to the store):
    /// `None` when it does not run on the private server.
    ///
    /// # Errors
    ///
    /// When the private server's data directory cannot be read.
    pub fn start(url: &str, history: &History) -> Result<Option<TxnLog>, String> {
        let Some(server) = current() else {
            return Ok(None);
        };
        let Some((hosts, namespace)) = split_url(url) else {
            return Err(format!("zookeeper truth: no namespace in `{url}`"));
        };
        if hosts != server.hostports() {
            return Ok(None);
        }
        let member = server
            .members()
            .first()
            .ok_or("zookeeper truth: the private server has no member")?;
        let version2 = member.dir.join("version-2");
        let id = NEXT_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        // Listed and registered at once, so that no purge removes the file
        // between the two.
        let first_file = {
            let mut flight = in_flight();
            let first = match log_files(&version2) {
                Ok(files) => files.keys().next_back().copied().unwrap_or(0),
                // No transaction yet: the directory comes with the first.
                Err(_) => 0,
            };
            flight.insert(id, first);
            first
        };
        Ok(Some(TxnLog {
            id,
            version2,
            first_file,
            hostport: hosts.to_owned(),
            namespace,
            history: history.clone(),
            start: clock_pair(history),
            _server: server,
        }))
    }

    /// Creates the end marker, reads the log up to it, and returns the
    /// run's transactions.
    ///
    /// # Errors
    ///
    /// When the marker cannot be written or the log read completely.
    pub async fn finish(self) -> Result<Record, String> {
        let end = clock_pair(&self.history);
        let client = admin_client(&self.hostport).await?;
        // A sibling of the namespace: nothing the run did is after it.
        let marker = format!("{}-end-of-run", self.namespace);
        let persistent = CreateMode::Persistent.with_acls(Acls::anyone_all());
        let (stat, _) = client
            .create(&marker, b"", &persistent)
            .await
            .map_err(|e| zk_err("creating the end marker", e))?;
        let _ = client.delete(&marker, None).await;
        let (version2, first, namespace) = (
            self.version2.clone(),
            self.first_file,
            self.namespace.clone(),
        );
        let stop = stat.czxid;
        let txns =
            tokio::task::spawn_blocking(move || read_run(&version2, first, stop, &namespace))
                .await
                .map_err(|e| zk_err("reading the log", e))??;
        let version2 = self.version2.clone();
        let record = Record {
            namespace: self.namespace.clone(),
            txns,
            clock: ClockMap::between(self.start, end),
        };
        drop(self);
        purge(&version2);
        Ok(record)
    }
}

/// The run's transactions: from the log file `first` on, up to the marker
/// `stop`, those under `namespace` and every session end.
fn read_run(version2: &Path, first: i64, stop: i64, namespace: &str) -> Result<Vec<Txn>, String> {
    let files = log_files(version2)?;
    let under = format!("{namespace}/");
    let mut out = Vec::new();
    let mut reached = false;
    for path in files.range(first..).map(|(_, p)| p) {
        let f = std::fs::File::open(path)
            .map_err(|e| zk_err(&format!("opening {}", path.display()), e))?;
        for t in read_log(f, Some(stop))? {
            reached |= t.zxid >= stop;
            let ours = match &t.change {
                Change::Create { path, .. } | Change::Delete { path } => path.starts_with(&under),
                Change::CloseSession => true,
                Change::Other(_) => false,
            };
            if ours && t.zxid < stop {
                out.push(t);
            }
        }
        if reached {
            return Ok(out);
        }
    }
    Err(format!(
        "zookeeper truth: the end marker (zxid {stop:#x}) is not in the log files {:?}",
        files.keys().map(|z| format!("{z:#x}")).collect::<Vec<_>>()
    ))
}

/// Deletes a run's namespace (`zk://…/<namespace>?…`) and the queues left in
/// it, best effort: the queues are containers the server removes anyway
/// once empty; the namespace is a plain node.
pub async fn remove_namespace(url: &str) {
    let Some((hosts, namespace)) = split_url(url) else {
        return;
    };
    let Ok(client) = admin_client(hosts).await else {
        return;
    };
    if let Ok(children) = client.list_children(&namespace).await {
        for c in children {
            let _ = client.delete(&format!("{namespace}/{c}"), None).await;
        }
    }
    let _ = client.delete(&namespace, None).await;
}

// ---------------------------------------------------------------------------
// Grants.

/// A grant the log shows: a child that was the lowest of its queue.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Held {
    /// The queue (`<namespace>/k<key>`).
    pub queue: String,
    /// The child's name (`<nonce>-<sequence>`).
    pub entry: String,
    /// Its creation zxid: the token.
    pub token: u64,
    /// The server's time of its creation, ms.
    pub created_ms: i64,
    /// The zxid at which it became the lowest live child.
    pub from: u64,
    /// The server's time of that, ms.
    pub from_ms: i64,
    /// The zxid that removed it (`u64::MAX`: still there at the end).
    pub to: u64,
}

/// A live child of a queue.
#[derive(Debug, Clone)]
struct Child {
    czxid: i64,
    session: Option<i64>,
    created_ms: i64,
}

/// `(queue, entry name, sequence)` of a child path under `namespace`.
fn entry_of<'p>(namespace: &str, path: &'p str) -> Option<(&'p str, &'p str, i64)> {
    let rest = path.strip_prefix(namespace)?.strip_prefix('/')?;
    let (queue, name) = rest.split_once('/')?;
    if name.contains('/') {
        return None;
    }
    let seq = name.rsplit_once('-')?.1.parse().ok()?;
    Some((&path[..namespace.len() + 1 + queue.len()], name, seq))
}

/// Rebuilds the grants from the log (see the module docs).
pub fn holds(record: &Record) -> Vec<Held> {
    let ns = record.namespace.as_str();
    // Per queue: live children by (sequence, name).
    let mut live: BTreeMap<String, BTreeMap<(i64, String), Child>> = BTreeMap::new();
    // Per session: its ephemeral children (queue, sequence, name).
    let mut owned: BTreeMap<i64, BTreeSet<(String, i64, String)>> = BTreeMap::new();
    let mut open: BTreeMap<(String, String), Held> = BTreeMap::new();
    let mut out = Vec::new();
    let txns = &record.txns;
    let mut i = 0;
    while i < txns.len() {
        // The changes of one zxid (a multi) together before judging.
        let (zxid, time_ms) = (txns[i].zxid, txns[i].time_ms);
        let mut touched = BTreeSet::new();
        let mut removed: Vec<(String, String)> = Vec::new();
        while i < txns.len() && txns[i].zxid == zxid {
            let t = &txns[i];
            i += 1;
            match &t.change {
                Change::Create { path, ephemeral } => {
                    let Some((queue, name, seq)) = entry_of(ns, path) else {
                        continue;
                    };
                    let session = ephemeral.then_some(t.session);
                    if let Some(s) = session {
                        owned.entry(s).or_default().insert((
                            queue.to_owned(),
                            seq,
                            name.to_owned(),
                        ));
                    }
                    live.entry(queue.to_owned()).or_default().insert(
                        (seq, name.to_owned()),
                        Child {
                            czxid: t.zxid,
                            session,
                            created_ms: t.time_ms,
                        },
                    );
                    touched.insert(queue.to_owned());
                }
                Change::Delete { path } => {
                    let Some((queue, name, seq)) = entry_of(ns, path) else {
                        continue;
                    };
                    let gone = live
                        .get_mut(queue)
                        .and_then(|q| q.remove(&(seq, name.to_owned())));
                    if let Some(s) = gone.and_then(|c| c.session) {
                        if let Some(set) = owned.get_mut(&s) {
                            set.remove(&(queue.to_owned(), seq, name.to_owned()));
                        }
                    }
                    removed.push((queue.to_owned(), name.to_owned()));
                    touched.insert(queue.to_owned());
                }
                Change::CloseSession => {
                    for (queue, seq, name) in owned.remove(&t.session).unwrap_or_default() {
                        if let Some(q) = live.get_mut(&queue) {
                            q.remove(&(seq, name.clone()));
                        }
                        removed.push((queue.clone(), name));
                        touched.insert(queue);
                    }
                }
                Change::Other(_) => {}
            }
        }
        for k in removed {
            if let Some(mut h) = open.remove(&k) {
                h.to = zxid as u64;
                out.push(h);
            }
        }
        for queue in touched {
            let Some(((_, name), child)) = live.get(&queue).and_then(|q| q.iter().next()) else {
                continue;
            };
            // A holder still open keeps its start; a new lowest child opens.
            open.entry((queue.clone(), name.clone()))
                .or_insert_with(|| Held {
                    queue: queue.clone(),
                    entry: name.clone(),
                    token: child.czxid.max(0) as u64,
                    created_ms: child.created_ms,
                    from: zxid as u64,
                    from_ms: time_ms,
                    to: u64::MAX,
                });
        }
    }
    out.extend(open.into_values());
    out
}

/// The grants as [`ServerGrant`]s (zxids as the time scale).
pub fn server_grants(holds: &[Held]) -> Vec<ServerGrant> {
    holds
        .iter()
        .map(|h| ServerGrant {
            key: h.queue.clone(),
            token: h.token,
            from: h.from,
            to: h.to,
        })
        .collect()
}

/// Client grants the log does not vouch for: no child with that token
/// held; two clients report it; the child was created before the client
/// asked; or it became the holder only after the client was told it holds
/// (times on the server's clock, [`CLOCK_MARGIN_MS`] of slack).
pub fn unmatched(events: &[Event], holds: &[Held], clock: &ClockMap) -> usize {
    let by_token: BTreeMap<u64, &Held> = holds.iter().map(|h| (h.token, h)).collect();
    let mut asked: BTreeMap<usize, u64> = BTreeMap::new();
    let mut claimed: BTreeMap<u64, usize> = BTreeMap::new();
    let mut n = 0;
    for e in events {
        match (e.op, e.phase) {
            (Op::Acquire, Phase::Invoke) => {
                asked.insert(e.process, e.t_ns);
            }
            (Op::Acquire, Phase::Ok) => {
                let Some(t) = e.token else { continue };
                let foreign = *claimed.entry(t).or_insert(e.process) != e.process;
                let asked_ms = clock.wall_ms(asked.get(&e.process).copied().unwrap_or(0));
                let told_ms = clock.wall_ms(e.t_ns);
                let vouched = by_token.get(&t).is_some_and(|h| {
                    h.created_ms as f64 + CLOCK_MARGIN_MS >= asked_ms
                        && h.from_ms as f64 <= told_ms + CLOCK_MARGIN_MS
                });
                if foreign || !vouched {
                    n += 1;
                }
            }
            _ => {}
        }
    }
    n
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use crate::history::check_server_grants;

    const NS: &str = "/ff";

    fn txn(zxid: i64, session: i64, time_ms: i64, change: Change) -> Txn {
        Txn {
            zxid,
            session,
            time_ms,
            change,
        }
    }

    fn create(zxid: i64, session: i64, name: &str) -> Txn {
        txn(
            zxid,
            session,
            zxid * 10,
            Change::Create {
                path: format!("{NS}/kq/{name}"),
                ephemeral: true,
            },
        )
    }

    fn delete(zxid: i64, name: &str) -> Txn {
        txn(
            zxid,
            0,
            zxid * 10,
            Change::Delete {
                path: format!("{NS}/kq/{name}"),
            },
        )
    }

    fn record(txns: Vec<Txn>) -> Record {
        Record {
            namespace: NS.into(),
            txns,
            // Run time ns n ↔ wall ms n / 1e6: the log's ms are the run's.
            clock: ClockMap::fixed(0, 0.0),
        }
    }

    fn acq(process: usize, phase: Phase, token: Option<u64>, ms: u64) -> Event {
        Event {
            process,
            op: Op::Acquire,
            phase,
            key: "k".into(),
            token,
            t_ns: ms * 1_000_000,
            detail: String::new(),
        }
    }

    #[test]
    fn a_queue_served_in_order_is_clean_and_matches_the_clients() {
        let r = record(vec![
            txn(
                1,
                7,
                10,
                Change::Create {
                    path: format!("{NS}/kq"),
                    ephemeral: false,
                },
            ),
            create(2, 7, "a-0000000000"),
            create(3, 8, "b-0000000001"),
            create(4, 9, "c-0000000002"),
            delete(5, "a-0000000000"),
            // b's session expires: c holds.
            txn(6, 8, 60, Change::CloseSession),
            delete(7, "c-0000000002"),
        ]);
        let h = holds(&r);
        assert_eq!(
            h.iter()
                .map(|h| (h.token, h.from, h.to))
                .collect::<Vec<_>>(),
            [(2, 2, 5), (3, 5, 6), (4, 6, 7)],
            "{h:?}"
        );
        let t = check_server_grants(&server_grants(&h));
        assert_eq!((t.grants, t.overlaps, t.token_regressions), (3, 0, 0));
        let clients = [
            acq(0, Phase::Invoke, None, 15),
            acq(0, Phase::Ok, Some(2), 25),
            acq(1, Phase::Invoke, None, 25),
            acq(1, Phase::Ok, Some(3), 55),
            acq(2, Phase::Invoke, None, 35),
            acq(2, Phase::Ok, Some(4), 65),
        ];
        assert_eq!(unmatched(&clients, &h, &r.clock), 0);
    }

    /// The checker can fail: a child that jumps the queue (a sequence below
    /// the live holder's) overlaps the holder; a client reports a token no
    /// child held, one created before it asked, one it was told before the
    /// store made it the holder, or another client's.
    #[test]
    fn overlaps_and_unvouched_client_grants_are_caught() {
        let r = record(vec![
            create(2, 7, "a-0000000005"),
            create(3, 8, "b-0000000006"),
            create(4, 9, "x-0000000001"), // impossible for the recipe
            delete(5, "x-0000000001"),
            delete(6, "a-0000000005"),
            delete(7, "b-0000000006"),
        ]);
        let h = holds(&r);
        let t = check_server_grants(&server_grants(&h));
        assert_eq!((t.overlaps, t.token_regressions), (1, 1), "{h:?}");
        let clients = [
            acq(0, Phase::Invoke, None, 15),
            acq(0, Phase::Ok, Some(2), 25), // vouched
            acq(1, Phase::Invoke, None, 200),
            acq(1, Phase::Ok, Some(99), 201), // never held
            acq(2, Phase::Invoke, None, 100),
            acq(2, Phase::Ok, Some(3), 101), // b was created at 30, before the ask
            acq(3, Phase::Invoke, None, 25),
            acq(3, Phase::Ok, Some(3), 26), // b held only from 60 on; and b is 2's
        ];
        assert_eq!(unmatched(&clients, &h, &r.clock), 3);
    }
}
