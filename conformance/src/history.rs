//! A recorder of lock operations and the checks on what was recorded.
//!
//! Each client appends [`Event`]s stamped with one monotonic clock shared by
//! the history, taken *outside* the store call (an acquire's `Ok` is stamped
//! after the call returned; a release's `Invoke` before it is sent), so the
//! intervals the checks see are conservative: if two of them overlap, the
//! clients really believed they held the key at the same time.
//!
//! A client believes it holds a key from an acquire `Ok` to its next release
//! `Invoke` on that key or the lease's loss signal ([`Op::Lost`]), whichever
//! comes first; a belief still open runs to the end of the history. On those
//! intervals:
//!
//! * [`check_exclusive`] demands that, per key, no two intersect and tokens
//!   strictly increase (the conformance suite's mutual-exclusion check);
//! * [`belief_overlaps`] measures the intersections instead (the fault suite,
//!   where a client paused past its TTL cannot know it lost the lock).

use std::{
    collections::BTreeMap,
    sync::{Arc, Mutex},
    time::Instant,
};

use fenced_api::{FencingToken, LockKey};
use serde::{Deserialize, Serialize};

/// The operation an event describes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Op {
    /// Taking the lock.
    Acquire,
    /// Giving it back.
    Release,
    /// Writing the protected resource.
    Write,
    /// The lease's loss signal fired.
    Lost,
    /// A fault was injected (detail says which) or lifted.
    Fault,
}

/// Where in an operation an event was taken.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    /// Before the request was sent.
    Invoke,
    /// It succeeded.
    Ok,
    /// It failed with no effect (a refusal, a timeout of a wait).
    Fail,
    /// It failed in a way that may or may not have taken effect.
    Unknown,
}

/// One line of history.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Event {
    /// Which client (task, thread or process).
    #[serde(alias = "client")]
    pub process: usize,
    /// The operation.
    pub op: Op,
    /// The phase.
    pub phase: Phase,
    /// The key.
    pub key: String,
    /// The fencing token, once known.
    pub token: Option<u64>,
    /// Monotonic nanoseconds since the history started.
    pub t_ns: u64,
    /// Free text: an error, a fault name, a write outcome.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub detail: String,
}

impl Event {
    /// An event without detail.
    pub fn new(
        process: usize,
        op: Op,
        phase: Phase,
        key: &str,
        token: Option<u64>,
        t_ns: u64,
    ) -> Self {
        Event {
            process,
            op,
            phase,
            key: key.to_owned(),
            token,
            t_ns,
            detail: String::new(),
        }
    }
}

/// A line of history under the conformance suite's name for it.
pub type Record = Event;

/// A shared, append-only history. Clone it into every client task.
#[derive(Debug, Clone)]
pub struct History {
    start: Instant,
    events: Arc<Mutex<Vec<Event>>>,
}

impl Default for History {
    fn default() -> Self {
        Self::new()
    }
}

impl History {
    /// An empty history whose clock starts now.
    pub fn new() -> Self {
        History {
            start: Instant::now(),
            events: Arc::default(),
        }
    }

    /// Nanoseconds since the start of the history.
    pub fn now_ns(&self) -> u64 {
        self.at_ns(Instant::now())
    }

    /// Nanoseconds from the start of the history to `t` (0 before it).
    pub fn at_ns(&self, t: Instant) -> u64 {
        t.saturating_duration_since(self.start).as_nanos() as u64
    }

    /// Appends an event stamped now.
    pub fn push(
        &self,
        process: usize,
        op: Op,
        phase: Phase,
        key: &str,
        token: Option<u64>,
        detail: impl Into<String>,
    ) {
        let e = Event {
            detail: detail.into(),
            ..Event::new(process, op, phase, key, token, self.now_ns())
        };
        self.lock().push(e);
    }

    /// Appends a lock operation of `client` on `key`, stamped now.
    pub fn record(
        &self,
        client: usize,
        op: Op,
        phase: Phase,
        key: &LockKey,
        token: Option<FencingToken>,
    ) {
        let token = token.map(FencingToken::get);
        self.push(client, op, phase, key.as_str(), token, String::new());
    }

    /// A copy of the events so far, in recording order.
    pub fn records(&self) -> Vec<Event> {
        self.lock().clone()
    }

    /// A copy of the events so far, in time order.
    pub fn events(&self) -> Vec<Event> {
        let mut v = self.records();
        v.sort_by_key(|e| e.t_ns);
        v
    }

    /// The history as JSON lines (in time order), for offline re-checking.
    pub fn to_jsonl(&self) -> String {
        self.events()
            .iter()
            .filter_map(|e| serde_json::to_string(e).ok())
            .map(|l| l + "\n")
            .collect()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Event>> {
        self.events
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// One client's belief that it held a key: `[from, to]` in nanoseconds.
#[derive(Debug, Clone, Copy)]
struct Hold {
    process: usize,
    token: Option<u64>,
    from: u64,
    to: u64,
}

/// An acquire `Ok` that [`check_exclusive`] refuses.
#[derive(Debug, Clone, Copy)]
enum Anomaly<'a> {
    /// No token came with the grant.
    NoToken(&'a Event),
    /// The client was granted a key it already believed it held.
    Reacquired(&'a Event),
}

/// The holds in `events` (taken in the order given), per key in order of
/// their start, and the acquire `Ok`s that break the rules of a clean
/// history in the order met. A second acquire `Ok` of a key the client still
/// holds starts its hold anew.
fn holds<'a>(events: &[&'a Event]) -> (BTreeMap<String, Vec<Hold>>, Vec<Anomaly<'a>>) {
    let end = events.iter().map(|e| e.t_ns).max().unwrap_or(0);
    let mut open: BTreeMap<(&str, usize), (Option<u64>, u64)> = BTreeMap::new();
    let mut by_key: BTreeMap<String, Vec<Hold>> = BTreeMap::new();
    let mut anomalies = Vec::new();
    let mut close = |key: &str, process, (token, from), to| {
        by_key.entry(key.to_owned()).or_default().push(Hold {
            process,
            token,
            from,
            to,
        });
    };
    for e in events.iter().copied() {
        match (e.op, e.phase) {
            (Op::Acquire, Phase::Ok) => {
                if e.token.is_none() {
                    anomalies.push(Anomaly::NoToken(e));
                }
                if open
                    .insert((&e.key, e.process), (e.token, e.t_ns))
                    .is_some()
                {
                    anomalies.push(Anomaly::Reacquired(e));
                }
            }
            (Op::Release, Phase::Invoke) | (Op::Lost, _) => {
                if let Some(start) = open.remove(&(e.key.as_str(), e.process)) {
                    close(&e.key, e.process, start, e.t_ns);
                }
            }
            _ => {}
        }
    }
    for ((key, process), start) in open {
        close(key, process, start, end);
    }
    for v in by_key.values_mut() {
        v.sort_by_key(|h| h.from);
    }
    (by_key, anomalies)
}

/// What a clean history contained.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Summary {
    /// Completed holds (acquire ok … release invoke) checked.
    pub holds: usize,
    /// Distinct keys seen.
    pub keys: usize,
}

/// Checks that, per key, no two holds overlap and tokens strictly increase in
/// the order the holds began.
///
/// # Errors
///
/// A description of the first violation: an acquire `Ok` without a token, a
/// client granted a key it still held, the two holds that overlap, or the
/// two tokens out of order.
pub fn check_exclusive(events: &[Event]) -> Result<Summary, String> {
    let mut sorted: Vec<&Event> = events.iter().collect();
    sorted.sort_by_key(|e| e.t_ns);
    let (by_key, anomalies) = holds(&sorted);
    match anomalies.first() {
        Some(Anomaly::NoToken(e)) => return Err(format!("acquire ok without a token: {e:?}")),
        Some(Anomaly::Reacquired(e)) => {
            return Err(format!(
                "client {} acquired `{}` again without releasing it",
                e.process, e.key
            ))
        }
        None => {}
    }
    let mut summary = Summary {
        keys: by_key.len(),
        ..Summary::default()
    };
    for (key, holds) in by_key {
        for pair in holds.windows(2) {
            let (a, b) = (pair[0], pair[1]);
            // No anomaly: every hold has its token.
            let (at, bt) = (a.token.unwrap_or_default(), b.token.unwrap_or_default());
            if b.from < a.to {
                return Err(format!(
                    "overlapping holds on `{key}`: client {} (token {at}) held it from {} to {} ns, \
                     client {} (token {bt}) acquired it at {} ns",
                    a.process, a.from, a.to, b.process, b.from
                ));
            }
            if bt <= at {
                return Err(format!(
                    "fencing tokens on `{key}` did not increase: token {at} (client {}) was followed by token {bt} (client {})",
                    a.process, b.process
                ));
            }
        }
        summary.holds += holds.len();
    }
    Ok(summary)
}

/// Two clients believing at once that they hold the same key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct BeliefOverlap {
    /// The earlier holder.
    pub first: usize,
    /// The later one.
    pub second: usize,
    /// How long both believed it, in nanoseconds.
    pub ns: u64,
}

/// Per key, the beliefs of different clients that intersect, with how long
/// they did. `events` are taken in the order given (time order, as
/// [`History::events`] returns them).
pub fn belief_overlaps(events: &[Event]) -> Vec<BeliefOverlap> {
    let events: Vec<&Event> = events.iter().collect();
    let (by_key, _) = holds(&events);
    let mut out = Vec::new();
    for v in by_key.values() {
        for (i, a) in v.iter().enumerate() {
            for b in &v[i + 1..] {
                if b.from >= a.to {
                    break;
                }
                if a.process != b.process {
                    out.push(BeliefOverlap {
                        first: a.process,
                        second: b.process,
                        ns: a.to.min(b.to) - b.from,
                    });
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(client: usize, op: Op, phase: Phase, token: Option<u64>, t_ns: u64) -> Event {
        Event::new(client, op, phase, "k", token, t_ns)
    }

    fn ev(process: usize, op: Op, phase: Phase, t_ns: u64) -> Event {
        rec(process, op, phase, Some(process as u64), t_ns)
    }

    #[test]
    fn clean_history_passes() {
        let h = [
            rec(0, Op::Acquire, Phase::Invoke, None, 0),
            rec(0, Op::Acquire, Phase::Ok, Some(1), 10),
            rec(1, Op::Acquire, Phase::Invoke, None, 11),
            rec(0, Op::Release, Phase::Invoke, Some(1), 20),
            rec(1, Op::Acquire, Phase::Ok, Some(2), 25),
            rec(1, Op::Release, Phase::Invoke, Some(2), 30),
        ];
        assert_eq!(check_exclusive(&h).unwrap(), Summary { holds: 2, keys: 1 });
    }

    #[test]
    fn overlap_is_caught() {
        let h = [
            rec(0, Op::Acquire, Phase::Ok, Some(1), 10),
            rec(1, Op::Acquire, Phase::Ok, Some(2), 15),
            rec(0, Op::Release, Phase::Invoke, Some(1), 20),
            rec(1, Op::Release, Phase::Invoke, Some(2), 30),
        ];
        let err = check_exclusive(&h).unwrap_err();
        assert!(err.contains("overlapping"), "{err}");
    }

    #[test]
    fn unreleased_hold_runs_to_the_end() {
        let h = [
            rec(0, Op::Acquire, Phase::Ok, Some(1), 10),
            rec(1, Op::Acquire, Phase::Ok, Some(2), 50),
            rec(1, Op::Release, Phase::Invoke, Some(2), 60),
        ];
        assert!(check_exclusive(&h).unwrap_err().contains("overlapping"));
    }

    #[test]
    fn token_regression_is_caught() {
        let h = [
            rec(0, Op::Acquire, Phase::Ok, Some(5), 10),
            rec(0, Op::Release, Phase::Invoke, Some(5), 20),
            rec(1, Op::Acquire, Phase::Ok, Some(5), 25),
            rec(1, Op::Release, Phase::Invoke, Some(5), 30),
        ];
        assert!(check_exclusive(&h)
            .unwrap_err()
            .contains("did not increase"));
    }

    #[test]
    fn grants_without_a_token_or_while_held_are_refused() {
        let h = [rec(0, Op::Acquire, Phase::Ok, None, 10)];
        assert!(check_exclusive(&h).unwrap_err().contains("without a token"));
        let h = [
            rec(0, Op::Acquire, Phase::Ok, Some(1), 10),
            rec(0, Op::Acquire, Phase::Ok, Some(2), 20),
        ];
        assert!(check_exclusive(&h)
            .unwrap_err()
            .contains("again without releasing"));
    }

    #[test]
    fn jsonl_round_trips() {
        let h = History::new();
        let k = LockKey::new("k").unwrap();
        h.record(3, Op::Acquire, Phase::Ok, &k, Some(FencingToken::new(9)));
        let line = h.to_jsonl();
        let back: Event = serde_json::from_str(line.trim()).unwrap();
        assert_eq!(back.process, 3);
        assert_eq!(back.token, Some(9));
        assert!(line.contains("\"op\":\"acquire\""));
        let old: Event = serde_json::from_str(
            r#"{"client":1,"op":"release","phase":"invoke","key":"k","token":2,"t_ns":5}"#,
        )
        .unwrap();
        assert_eq!((old.process, old.detail.as_str()), (1, ""));
    }

    #[test]
    fn beliefs_that_touch_do_not_overlap_but_intersections_count() {
        let clean = [
            ev(0, Op::Acquire, Phase::Ok, 0),
            ev(0, Op::Release, Phase::Invoke, 10),
            ev(1, Op::Acquire, Phase::Ok, 10),
            ev(1, Op::Release, Phase::Invoke, 20),
        ];
        assert!(belief_overlaps(&clean).is_empty());
        let paused = [
            ev(0, Op::Acquire, Phase::Ok, 0),
            ev(1, Op::Acquire, Phase::Ok, 50),
            ev(1, Op::Release, Phase::Invoke, 60),
            ev(0, Op::Release, Phase::Invoke, 100),
        ];
        assert_eq!(
            belief_overlaps(&paused),
            vec![BeliefOverlap {
                first: 0,
                second: 1,
                ns: 10
            }]
        );
    }

    #[test]
    fn a_loss_signal_ends_the_belief() {
        let h = [
            ev(0, Op::Acquire, Phase::Ok, 0),
            ev(0, Op::Lost, Phase::Ok, 40),
            ev(1, Op::Acquire, Phase::Ok, 50),
            ev(0, Op::Release, Phase::Invoke, 100),
            ev(1, Op::Release, Phase::Invoke, 110),
        ];
        assert!(belief_overlaps(&h).is_empty());
        assert_eq!(check_exclusive(&h).unwrap(), Summary { holds: 2, keys: 1 });
    }
}
