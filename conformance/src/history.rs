//! A recorder of lock operations and a checker of what they must satisfy.
//!
//! Each client appends records with a monotonic timestamp taken *outside* the
//! store call (an acquire's `Ok` is stamped after the call returned; a
//! release's `Invoke` before it is sent), so the intervals the checker sees
//! are conservative: if two of them overlap, the clients really believed they
//! held the key at the same time.

use std::{
    collections::BTreeMap,
    sync::{Arc, Mutex},
    time::Instant,
};

use fenced_api::{FencingToken, LockKey};
use serde::{Deserialize, Serialize};

/// The operation a record describes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Op {
    /// Taking the lock.
    Acquire,
    /// Giving it back.
    Release,
}

/// Where in an operation a record was taken.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    /// Before the request was sent.
    Invoke,
    /// After it succeeded.
    Ok,
    /// After it failed (definitely no effect).
    Fail,
}

/// One line of history.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Record {
    /// Which client (process, task) did it.
    pub client: usize,
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
}

/// A shared, append-only history. Clone it into every client task.
#[derive(Debug, Clone)]
pub struct History {
    start: Instant,
    records: Arc<Mutex<Vec<Record>>>,
}

impl Default for History {
    fn default() -> Self {
        Self::new()
    }
}

impl History {
    /// An empty history starting now.
    pub fn new() -> Self {
        History {
            start: Instant::now(),
            records: Arc::default(),
        }
    }

    /// Appends a record stamped now.
    pub fn record(
        &self,
        client: usize,
        op: Op,
        phase: Phase,
        key: &LockKey,
        token: Option<FencingToken>,
    ) {
        let t_ns = self.start.elapsed().as_nanos() as u64;
        let rec = Record {
            client,
            op,
            phase,
            key: key.as_str().to_owned(),
            token: token.map(FencingToken::get),
            t_ns,
        };
        self.records
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(rec);
    }

    /// A copy of the records so far, in recording order.
    pub fn records(&self) -> Vec<Record> {
        self.records
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// The history as JSON lines, for offline re-checking.
    pub fn to_jsonl(&self) -> String {
        self.records()
            .iter()
            .filter_map(|r| serde_json::to_string(r).ok())
            .map(|l| l + "\n")
            .collect()
    }
}

/// What a clean history contained.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Summary {
    /// Completed holds (acquire ok … release invoke) checked.
    pub holds: usize,
    /// Distinct keys seen.
    pub keys: usize,
}

/// A hold reconstructed from the history: `[acquired, released]` in ns.
#[derive(Debug, Clone, Copy)]
struct Hold {
    client: usize,
    token: u64,
    from: u64,
    to: u64,
}

/// Checks that, per key, no two holds overlap and tokens strictly increase in
/// the order the holds began. A hold runs from an acquire `Ok` to the same
/// client's next release `Invoke` on that key (or to the end of the history).
///
/// # Errors
///
/// A description of the first violation: the two holds that overlap, or the
/// two tokens out of order.
pub fn check_exclusive(records: &[Record]) -> Result<Summary, String> {
    let mut by_key: BTreeMap<&str, Vec<Hold>> = BTreeMap::new();
    let mut open: BTreeMap<(&str, usize), (u64, u64)> = BTreeMap::new();
    let end = records.iter().map(|r| r.t_ns).max().unwrap_or(0);
    let mut sorted: Vec<&Record> = records.iter().collect();
    sorted.sort_by_key(|r| r.t_ns);
    for r in sorted {
        match (r.op, r.phase) {
            (Op::Acquire, Phase::Ok) => {
                let token = r
                    .token
                    .ok_or_else(|| format!("acquire ok without a token: {r:?}"))?;
                if open.insert((&r.key, r.client), (token, r.t_ns)).is_some() {
                    return Err(format!(
                        "client {} acquired `{}` again without releasing it",
                        r.client, r.key
                    ));
                }
            }
            (Op::Release, Phase::Invoke) => {
                if let Some((token, from)) = open.remove(&(r.key.as_str(), r.client)) {
                    by_key.entry(&r.key).or_default().push(Hold {
                        client: r.client,
                        token,
                        from,
                        to: r.t_ns,
                    });
                }
            }
            _ => {}
        }
    }
    for ((key, client), (token, from)) in open {
        by_key.entry(key).or_default().push(Hold {
            client,
            token,
            from,
            to: end,
        });
    }
    let mut summary = Summary {
        keys: by_key.len(),
        ..Summary::default()
    };
    for (key, mut holds) in by_key {
        holds.sort_by_key(|h| h.from);
        for pair in holds.windows(2) {
            let (a, b) = (pair[0], pair[1]);
            if b.from < a.to {
                return Err(format!(
                    "overlapping holds on `{key}`: client {} (token {}) held it from {} to {} ns, \
                     client {} (token {}) acquired it at {} ns",
                    a.client, a.token, a.from, a.to, b.client, b.token, b.from
                ));
            }
            if b.token <= a.token {
                return Err(format!(
                    "fencing tokens on `{key}` did not increase: token {} (client {}) was followed by token {} (client {})",
                    a.token, a.client, b.token, b.client
                ));
            }
        }
        summary.holds += holds.len();
    }
    Ok(summary)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(client: usize, op: Op, phase: Phase, token: Option<u64>, t_ns: u64) -> Record {
        Record {
            client,
            op,
            phase,
            key: "k".into(),
            token,
            t_ns,
        }
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
    fn jsonl_round_trips() {
        let h = History::new();
        let k = LockKey::new("k").unwrap();
        h.record(3, Op::Acquire, Phase::Ok, &k, Some(FencingToken::new(9)));
        let line = h.to_jsonl();
        let back: Record = serde_json::from_str(line.trim()).unwrap();
        assert_eq!(back.client, 3);
        assert_eq!(back.token, Some(9));
        assert!(line.contains("\"op\":\"acquire\""));
    }
}
