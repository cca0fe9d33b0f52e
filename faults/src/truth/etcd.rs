//! etcd server truth: the watch history of the run's lock lines.
//!
//! fenced-etcd keeps each key's line as entries
//! `<prefix>\0lock\0<key>\0<owner>` (backend-etcd `queue.rs`): the live entry
//! with the smallest create revision holds the lock and its create revision
//! is the token. A watch opened on `<prefix>\0lock\0` (with `prev_kv`) before
//! the clients start sees every put and delete the server committed,
//! lease-expiry deletions included, each with its revision — etcd's own
//! total order.
//!
//! Per key, a **grant** is an entry from the revision at which it became the
//! oldest live entry of its line until the revision that deleted it (release,
//! reaper, abandoned attempt, lease expiry). A holder is never "replaced"
//! without a delete, so if the store ever let a younger entry be the oldest
//! while the old holder's entry still lived — or an entry appear with a
//! create revision below a live holder's — two grants overlap, or the token
//! goes back.
//!
//! Every grant a client reported is then matched to the server's: its token
//! must be the create revision of an entry that held the lock, and that
//! entry must not have been deleted before the client even asked (the watch
//! delivers a deletion after it happened, so "deleted before the ask" is
//! judged conservatively, never by a client's guess).

use std::collections::BTreeMap;

use fenced::etcd::etcd_client::{self, Client, EventType, WatchOptions};
use tokio::task::JoinHandle;

use crate::history::{Event, History, Op, Phase, ServerGrant};

/// One watch event, as the recorder keeps it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WatchEvent {
    /// The revision of the event.
    pub revision: i64,
    /// `true` for a put, `false` for a delete.
    pub put: bool,
    /// The entry's key (bytes, lossy UTF-8).
    pub key: String,
    /// The entry's create revision (of the deleted entry for a delete,
    /// from `prev_kv`; 0 when unknown).
    pub create_revision: i64,
    /// When the event reached the recorder, ns on the run's clock.
    pub seen_ns: u64,
}

/// A watch over the run's lock lines.
pub struct WatchLog {
    client: Client,
    prefix: Vec<u8>,
    task: JoinHandle<Result<Vec<WatchEvent>, String>>,
}

impl std::fmt::Debug for WatchLog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WatchLog")
            .field("prefix", &String::from_utf8_lossy(&self.prefix))
            .finish_non_exhaustive()
    }
}

fn err(what: &str, e: etcd_client::Error) -> String {
    format!("etcd truth: {what}: {e}; are the services up? run scripts/services.sh")
}

/// The marker put under the watched prefix at the end: no lock key is
/// empty, so no line is `<prefix>\0lock\0\0…`.
fn marker(prefix: &[u8]) -> Vec<u8> {
    let mut m = prefix.to_vec();
    m.extend_from_slice(b"\0end-of-run");
    m
}

impl WatchLog {
    /// Watches `<ns_prefix>\0lock\0` from the current revision on.
    ///
    /// # Errors
    ///
    /// When etcd cannot be reached.
    pub async fn start(
        endpoint: &str,
        ns_prefix: &str,
        history: &History,
    ) -> Result<WatchLog, String> {
        let opts = etcd_client::ConnectOptions::new()
            .with_connect_timeout(std::time::Duration::from_secs(5))
            .with_timeout(std::time::Duration::from_secs(10));
        let mut client = Client::connect([endpoint], Some(opts))
            .await
            .map_err(|e| err("connecting", e))?;
        let mut prefix = ns_prefix.as_bytes().to_vec();
        prefix.extend_from_slice(b"\0lock\0");
        let now = client
            .get(prefix.clone(), None)
            .await
            .map_err(|e| err("reading the start revision", e))?
            .header()
            .map_or(0, |h| h.revision());
        let mut stream = client
            .watch(
                prefix.clone(),
                Some(
                    WatchOptions::new()
                        .with_prefix()
                        .with_prev_key()
                        .with_start_revision(now + 1),
                ),
            )
            .await
            .map_err(|e| err("opening the watch", e))?;
        let end = marker(&prefix);
        let history = history.clone();
        let task = tokio::spawn(async move {
            let mut out = Vec::new();
            loop {
                let msg = stream
                    .message()
                    .await
                    .map_err(|e| err("reading the watch", e))?
                    .ok_or("etcd truth: the watch ended before the end marker")?;
                if msg.canceled() {
                    return Err(format!(
                        "etcd truth: the watch was cancelled ({}; compacted at {})",
                        msg.cancel_reason(),
                        msg.compact_revision()
                    ));
                }
                let seen_ns = history.now_ns();
                for e in msg.events() {
                    let Some(kv) = e.kv() else { continue };
                    if kv.key() == end.as_slice() {
                        return Ok(out);
                    }
                    let put = e.event_type() == EventType::Put;
                    let create_revision = if put {
                        kv.create_revision()
                    } else {
                        e.prev_kv().map_or(0, |p| p.create_revision())
                    };
                    out.push(WatchEvent {
                        revision: kv.mod_revision(),
                        put,
                        key: String::from_utf8_lossy(kv.key()).into_owned(),
                        create_revision,
                        seen_ns,
                    });
                }
            }
        });
        Ok(WatchLog {
            client,
            prefix,
            task,
        })
    }

    /// Puts the end marker, waits until the watch delivered it, and returns
    /// every event before it.
    ///
    /// # Errors
    ///
    /// When the marker cannot be written or does not arrive within 30 s.
    pub async fn finish(mut self) -> Result<Vec<WatchEvent>, String> {
        let m = marker(&self.prefix);
        self.client
            .put(m.clone(), "", None)
            .await
            .map_err(|e| err("writing the end marker", e))?;
        let drained = tokio::time::timeout(std::time::Duration::from_secs(30), self.task).await;
        let _ = self.client.delete(m, None).await;
        match drained {
            Ok(Ok(r)) => r,
            Ok(Err(e)) => Err(format!("etcd truth: the watch task failed: {e}")),
            Err(_) => {
                Err("etcd truth: the end marker did not come through the watch within 30s".into())
            }
        }
    }
}

/// A grant the server's history shows: token, key, first and last revision,
/// and when the recorder saw it end (`None`: still held at the end).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Held {
    /// The line (the lock key).
    pub key: String,
    /// The entry's create revision (the token).
    pub token: u64,
    /// The revision at which the entry became the oldest of its line.
    pub from: u64,
    /// The revision that deleted it (`u64::MAX`: never deleted).
    pub to: u64,
    /// When the recorder saw the deletion, ns on the run's clock.
    pub ended_seen_ns: Option<u64>,
}

/// The lock key of an entry `<prefix>\0lock\0<key>\0<owner>` (the part of
/// the watched key after the prefix).
fn line_of(entry: &str) -> Option<&str> {
    let rest = entry.split_once("\0lock\0")?.1;
    Some(rest.split_once('\0')?.0)
}

/// Rebuilds the grants from the watch events (see the module docs).
pub fn holds(events: &[WatchEvent]) -> Vec<Held> {
    // Per line: live entries (key → create revision), and the open grants.
    let mut live: BTreeMap<String, BTreeMap<String, i64>> = BTreeMap::new();
    let mut open: BTreeMap<(String, String), Held> = BTreeMap::new();
    let mut out = Vec::new();
    let mut i = 0;
    while i < events.len() {
        // All events of one revision (a transaction) before judging.
        let rev = events[i].revision;
        let mut touched = Vec::new();
        while i < events.len() && events[i].revision == rev {
            let e = &events[i];
            i += 1;
            let Some(line) = line_of(&e.key) else {
                continue;
            };
            let entries = live.entry(line.to_owned()).or_default();
            if e.put {
                entries.insert(e.key.clone(), e.create_revision);
            } else {
                entries.remove(&e.key);
                if let Some(mut h) = open.remove(&(line.to_owned(), e.key.clone())) {
                    h.to = rev as u64;
                    h.ended_seen_ns = Some(e.seen_ns);
                    out.push(h);
                }
            }
            touched.push(line.to_owned());
        }
        touched.dedup();
        for line in touched {
            let Some(entries) = live.get(&line) else {
                continue;
            };
            let Some((entry, create)) = entries.iter().min_by_key(|(_, c)| **c) else {
                continue;
            };
            let k = (line.clone(), entry.clone());
            let already = open.get(&k).is_some_and(|h| h.token == *create as u64);
            if !already {
                open.insert(
                    k,
                    Held {
                        key: line.clone(),
                        token: (*create).max(0) as u64,
                        from: rev as u64,
                        to: u64::MAX,
                        ended_seen_ns: None,
                    },
                );
            }
        }
    }
    out.extend(open.into_values());
    out
}

/// The grants as [`ServerGrant`]s (revisions as the time scale).
pub fn server_grants(holds: &[Held]) -> Vec<ServerGrant> {
    holds
        .iter()
        .map(|h| ServerGrant {
            key: h.key.clone(),
            token: h.token,
            from: h.from,
            to: h.to,
        })
        .collect()
}

/// Client grants the server cannot vouch for: no held entry has the token,
/// or the entry with that token had been deleted (as the recorder saw it)
/// before the client sent its acquire.
pub fn unmatched(events: &[Event], holds: &[Held]) -> usize {
    let by_token: BTreeMap<u64, &Held> = holds.iter().map(|h| (h.token, h)).collect();
    let mut asked: BTreeMap<usize, u64> = BTreeMap::new();
    let mut n = 0;
    for e in events {
        match (e.op, e.phase) {
            (Op::Acquire, Phase::Invoke) => {
                asked.insert(e.process, e.t_ns);
            }
            (Op::Acquire, Phase::Ok) => {
                let Some(t) = e.token else { continue };
                let ok = by_token.get(&t).is_some_and(|h| {
                    h.ended_seen_ns
                        .is_none_or(|end| end >= asked.get(&e.process).copied().unwrap_or(0))
                });
                if !ok {
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

    fn ev(revision: i64, put: bool, owner: &str, create: i64, seen_ns: u64) -> WatchEvent {
        WatchEvent {
            revision,
            put,
            key: format!("ns\0lock\0k\0{owner}"),
            create_revision: create,
            seen_ns,
        }
    }

    fn acq(process: usize, phase: Phase, token: Option<u64>, t_ns: u64) -> Event {
        Event {
            process,
            op: Op::Acquire,
            phase,
            key: "k".into(),
            token,
            t_ns,
            detail: String::new(),
        }
    }

    #[test]
    fn a_queue_served_in_order_is_clean_and_matches_the_clients() {
        let w = [
            ev(10, true, "a", 10, 100),
            ev(11, true, "b", 11, 110),  // b waits
            ev(12, true, "b", 11, 120),  // b announces (same create revision)
            ev(12, false, "a", 10, 120), // a released at 12… (same txn order is irrelevant)
            ev(13, true, "c", 13, 130),
            ev(14, false, "b", 11, 140), // lease expiry
            ev(15, false, "c", 13, 150),
        ];
        let h = holds(&w);
        assert_eq!(h.len(), 3, "{h:?}");
        let t = check_server_grants(&server_grants(&h));
        assert_eq!((t.overlaps, t.token_regressions), (0, 0), "{h:?}");
        let clients = [
            acq(0, Phase::Invoke, None, 90),
            acq(0, Phase::Ok, Some(10), 101),
            acq(1, Phase::Invoke, None, 105),
            acq(1, Phase::Ok, Some(11), 125),
            acq(2, Phase::Invoke, None, 125),
            acq(2, Phase::Ok, Some(13), 145),
        ];
        assert_eq!(unmatched(&clients, &h), 0);
    }

    /// The checker can fail: an entry older than the live holder appears
    /// (overlap and token going back); a client reports a token no entry
    /// held, or one whose entry was gone before it asked.
    #[test]
    fn overlaps_regressions_and_unvouched_client_grants_are_caught() {
        let w = [
            ev(10, true, "a", 10, 100),
            ev(12, true, "b", 9, 120), // impossible in etcd: what the check exists for
            ev(13, false, "b", 9, 130),
            ev(14, false, "a", 10, 140),
        ];
        let h = holds(&w);
        let t = check_server_grants(&server_grants(&h));
        assert_eq!((t.overlaps, t.token_regressions), (1, 1), "{h:?}");
        let clients = [
            acq(0, Phase::Invoke, None, 90),
            acq(0, Phase::Ok, Some(10), 101),
            acq(1, Phase::Invoke, None, 150),
            acq(1, Phase::Ok, Some(10), 151), // token 10 was deleted at 140
            acq(2, Phase::Invoke, None, 150),
            acq(2, Phase::Ok, Some(77), 151), // never held
        ];
        assert_eq!(unmatched(&clients, &h), 2);
    }
}
