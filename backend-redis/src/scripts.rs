//! The Lua scripts (`scripts/*.lua`) and their replies.
//!
//! Each script is `scripts/prelude.lua` (the state format and the hand-over
//! to the next waiter, shared by all) followed by its own file. Each runs with
//! EVALSHA; [`redis::Script`] loads it with `SCRIPT LOAD` and retries once
//! when the server answers NOSCRIPT (after a restart, a failover or
//! `SCRIPT FLUSH`). A NOSCRIPT reply means the script did not run, so the
//! retry can never apply an operation twice.

use std::{sync::LazyLock, time::Duration};

use fenced_api::{FencingToken, Label, LockInfo, LockKey, Owner, Result};
use redis::{Script, ScriptInvocation, Value};

use crate::{error, keys::Keys};

macro_rules! script {
    ($name:ident, $file:literal) => {
        pub(crate) static $name: LazyLock<Script> = LazyLock::new(|| {
            Script::new(concat!(
                include_str!("../scripts/prelude.lua"),
                include_str!(concat!("../scripts/", $file))
            ))
        });
    };
}

script!(ACQUIRE, "acquire.lua");
script!(EXTEND, "extend.lua");
script!(RELEASE, "release.lua");
script!(FORCE_RELEASE, "force_release.lua");
script!(LEAVE, "leave.lua");
script!(INSPECT, "inspect.lua");

/// Every script.
#[cfg(test)]
pub(crate) fn all() -> [&'static Script; 6] {
    [
        &ACQUIRE,
        &EXTEND,
        &RELEASE,
        &FORCE_RELEASE,
        &LEAVE,
        &INSPECT,
    ]
}

/// What one acquire step found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Attempt {
    /// Granted by this very step: the lease counts from its send time.
    Granted { token: FencingToken, count: u32 },
    /// A release handed the key to this waiter earlier (the step found it).
    HandedOver { token: FencingToken },
    /// Held by someone else (or queued waiters go first), for `pttl` more
    /// (server clock); `entry` is the waiter's place in the queue, if queued.
    Busy {
        pttl: Option<Duration>,
        entry: Option<Entry>,
    },
    /// Held by this owner, who may not re-enter.
    AlreadyHeld,
}

/// A waiter's place in a key's queue: the zset member and its score (the
/// arrival time), sent back on the next attempt to keep the place.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Entry {
    pub(crate) member: String,
    pub(crate) score: String,
}

/// Whole milliseconds, rounded up (expiries have millisecond resolution, and
/// a lease must never be shorter than asked).
pub(crate) fn millis_ceil(d: Duration) -> u64 {
    let ms = d.as_nanos().div_ceil(1_000_000);
    u64::try_from(ms).unwrap_or(u64::MAX)
}

/// What a queued attempt adds to a plain try.
pub(crate) struct Queued<'a> {
    pub(crate) id: &'a str,
    pub(crate) channel: &'a str,
    pub(crate) lease_ms: u64,
    pub(crate) entry: Option<&'a Entry>,
}

pub(crate) struct AcquireArgs<'a> {
    pub(crate) owner: &'a str,
    /// The holder's label, "" for none.
    pub(crate) label: &'a str,
    pub(crate) ttl_ms: u64,
    pub(crate) reentrant: bool,
    pub(crate) queued: Option<Queued<'a>>,
}

/// The acquire script's call for `keys` with `a`.
pub(crate) fn acquire(keys: &Keys, a: &AcquireArgs<'_>) -> ScriptInvocation<'static> {
    let mut inv = ACQUIRE.key(&keys.lock);
    inv.key(&keys.queue)
        .arg(a.owner)
        .arg(a.ttl_ms)
        .arg(if a.reentrant { "1" } else { "0" })
        .arg(a.label);
    if let Some(q) = &a.queued {
        inv.arg(q.id).arg(q.channel).arg(q.lease_ms);
        match q.entry {
            Some(e) => inv.arg(&e.member).arg(&e.score),
            None => inv.arg("").arg(""),
        };
    } else {
        inv.arg("");
    }
    inv
}

pub(crate) fn parse_acquire(v: Value) -> Result<Attempt> {
    let items = array(v, "acquire")?;
    match items.first().and_then(int) {
        Some(1) => Ok(Attempt::Granted {
            token: token(items.get(1), "acquire")?,
            count: count(items.get(2), "acquire")?,
        }),
        Some(2) => Ok(Attempt::HandedOver {
            token: token(items.get(1), "acquire")?,
        }),
        Some(0) => {
            let entry = match (items.get(2).and_then(text), items.get(3).and_then(text)) {
                (Some(member), Some(score)) => Some(Entry { member, score }),
                (None, None) if items.len() == 2 => None,
                _ => {
                    return Err(error::protocol(format!(
                        "unexpected reply to the acquire script: {items:?}"
                    )))
                }
            };
            Ok(Attempt::Busy {
                pttl: items
                    .get(1)
                    .and_then(int)
                    .and_then(|ms| u64::try_from(ms).ok())
                    .map(Duration::from_millis),
                entry,
            })
        }
        Some(-1) => Ok(Attempt::AlreadyHeld),
        _ => Err(error::protocol(format!(
            "unexpected reply to the acquire script: {items:?}"
        ))),
    }
}

/// `(released, remaining)`: `Some(0)` released, `Some(n)` still held n times, `None` not current.
pub(crate) fn parse_release(v: Value) -> Result<Option<u32>> {
    let items = array(v, "release")?;
    match items.first().and_then(int) {
        Some(2) => Ok(Some(0)),
        Some(1) => Ok(Some(count(items.get(1), "release")?)),
        Some(0) => Ok(None),
        _ => Err(error::protocol(format!(
            "unexpected reply to the release script: {items:?}"
        ))),
    }
}

/// A held lock as the inspect script reports it.
pub(crate) struct Held {
    pub(crate) owner: String,
    pub(crate) token: FencingToken,
    pub(crate) count: u32,
    pub(crate) pttl: Duration,
    /// `None` when the holder gave no label.
    pub(crate) label: Option<String>,
}

impl Held {
    /// The description of `key`, whose state is stored under `name`.
    pub(crate) fn info(self, key: &LockKey, name: &str) -> Result<LockInfo> {
        let owner = Owner::new(&self.owner)
            .map_err(|e| error::protocol(format!("`{name}` holds an invalid owner: {e}")))?;
        // A label is for people, not for the lock: one the state should
        // never hold is shown as none rather than failing the call.
        let label = self.label.and_then(|l| {
            Label::new(l)
                .inspect_err(
                    |e| tracing::warn!(key = %key, error = %e, "ignoring an invalid stored label"),
                )
                .ok()
        });
        Ok(LockInfo::new(key.clone(), owner, self.token, self.pttl, self.count).with_label(label))
    }
}

pub(crate) fn parse_inspect(v: Value) -> Result<Option<Held>> {
    let items = array(v, "inspect")?;
    match items.first().and_then(int) {
        Some(0) => Ok(None),
        Some(1) => Ok(Some(Held {
            owner: items
                .get(1)
                .and_then(text)
                .ok_or_else(|| error::protocol("inspect: the lock has no owner"))?,
            token: token(items.get(2), "inspect")?,
            count: count(items.get(3), "inspect")?,
            // -1 (no expiry) cannot happen for our keys; report zero rather than invent one.
            pttl: items
                .get(4)
                .and_then(int)
                .and_then(|ms| u64::try_from(ms).ok())
                .map(Duration::from_millis)
                .unwrap_or_default(),
            label: items.get(5).and_then(text).filter(|l| !l.is_empty()),
        })),
        _ => Err(error::protocol(format!(
            "unexpected reply to the inspect script: {items:?}"
        ))),
    }
}

fn array(v: Value, what: &str) -> Result<Vec<Value>> {
    match v {
        Value::Array(items) => Ok(items),
        other => Err(error::protocol(format!(
            "unexpected reply to the {what} script: {other:?}"
        ))),
    }
}

pub(crate) fn int(v: &Value) -> Option<i64> {
    match v {
        Value::Int(i) => Some(*i),
        other => text(other)?.parse().ok(),
    }
}

pub(crate) fn text(v: &Value) -> Option<String> {
    match v {
        Value::BulkString(b) => String::from_utf8(b.clone()).ok(),
        Value::SimpleString(s) => Some(s.clone()),
        Value::Int(i) => Some(i.to_string()),
        _ => None,
    }
}

fn token(v: Option<&Value>, what: &str) -> Result<FencingToken> {
    v.and_then(text)
        .and_then(|t| t.parse::<u64>().ok())
        .filter(|t| *t >= 1)
        .map(FencingToken::new)
        .ok_or_else(|| error::protocol(format!("{what}: no valid fencing token in {v:?}")))
}

fn count(v: Option<&Value>, what: &str) -> Result<u32> {
    v.and_then(int)
        .and_then(|c| u32::try_from(c).ok())
        .ok_or_else(|| error::protocol(format!("{what}: no valid hold count in {v:?}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bulk(s: &str) -> Value {
        Value::BulkString(s.as_bytes().to_vec())
    }

    #[test]
    fn acquire_replies() {
        let granted = Value::Array(vec![Value::Int(1), bulk("1796033680636908"), Value::Int(1)]);
        assert_eq!(
            parse_acquire(granted).unwrap(),
            Attempt::Granted {
                token: FencingToken::new(1_796_033_680_636_908),
                count: 1
            }
        );
        let handed = Value::Array(vec![Value::Int(2), bulk("1796033680636909")]);
        assert_eq!(
            parse_acquire(handed).unwrap(),
            Attempt::HandedOver {
                token: FencingToken::new(1_796_033_680_636_909),
            }
        );
        let busy = Value::Array(vec![Value::Int(0), Value::Int(1500)]);
        assert_eq!(
            parse_acquire(busy).unwrap(),
            Attempt::Busy {
                pttl: Some(Duration::from_millis(1500)),
                entry: None,
            }
        );
        let queued = Value::Array(vec![
            Value::Int(0),
            Value::Int(20),
            bulk("1796033680637|30000|ab12|{p/}:w:cd|me"),
            bulk("1796033680636908"),
        ]);
        assert_eq!(
            parse_acquire(queued).unwrap(),
            Attempt::Busy {
                pttl: Some(Duration::from_millis(20)),
                entry: Some(Entry {
                    member: "1796033680637|30000|ab12|{p/}:w:cd|me".into(),
                    score: "1796033680636908".into(),
                }),
            }
        );
        assert_eq!(
            parse_acquire(Value::Array(vec![Value::Int(-1)])).unwrap(),
            Attempt::AlreadyHeld
        );
        for bad in [
            Value::Nil,
            Value::Array(vec![]),
            Value::Array(vec![Value::Int(1), bulk("0"), Value::Int(1)]),
            Value::Array(vec![Value::Int(1), bulk("x"), Value::Int(1)]),
            Value::Array(vec![Value::Int(2)]),
            Value::Array(vec![Value::Int(0), Value::Int(5), bulk("member only")]),
            Value::Array(vec![Value::Int(7)]),
        ] {
            assert!(parse_acquire(bad.clone()).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn release_and_inspect_replies() {
        assert_eq!(
            parse_release(Value::Array(vec![Value::Int(2)])).unwrap(),
            Some(0)
        );
        assert_eq!(
            parse_release(Value::Array(vec![Value::Int(1), Value::Int(2)])).unwrap(),
            Some(2)
        );
        assert_eq!(
            parse_release(Value::Array(vec![Value::Int(0)])).unwrap(),
            None
        );
        assert!(parse_inspect(Value::Array(vec![Value::Int(0)]))
            .unwrap()
            .is_none());
        // A held lock: owner `me`, token 42, `count` holds, 900 ms left, and
        // the label if there is one.
        let reply = |count: i64, label: Option<&str>| {
            let mut items = vec![
                Value::Int(1),
                bulk("me"),
                bulk("42"),
                Value::Int(count),
                Value::Int(900),
            ];
            items.extend(label.map(bulk));
            Value::Array(items)
        };
        let held = parse_inspect(reply(3, None)).unwrap().unwrap();
        assert_eq!(held.owner, "me");
        assert_eq!(held.token, FencingToken::new(42));
        assert_eq!(held.count, 3);
        assert_eq!(held.pttl, Duration::from_millis(900));
        assert_eq!(held.label, None);
        let labelled = parse_inspect(reply(1, Some("web 1|x"))).unwrap().unwrap();
        assert_eq!(labelled.label.as_deref(), Some("web 1|x"));
    }

    #[test]
    fn ttl_rounds_up_to_whole_milliseconds() {
        assert_eq!(millis_ceil(Duration::from_millis(10)), 10);
        assert_eq!(millis_ceil(Duration::from_micros(10_001)), 11);
        assert_eq!(millis_ceil(Duration::MAX), u64::MAX);
    }

    #[test]
    fn scripts_are_distinct() {
        let hashes: std::collections::HashSet<_> = all().iter().map(|s| s.get_hash()).collect();
        assert_eq!(hashes.len(), 6);
    }
}
