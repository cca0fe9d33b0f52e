//! The history of a fault run and the checks on it.
//!
//! Every client appends [`Event`]s (JSON lines on disk) stamped with one
//! monotonic clock shared by the run: the recorder and the client-belief
//! check are the conformance suite's ([`fenced_conformance::history`]),
//! re-exported here. The checks on a run:
//!
//! * **client belief** ([`belief_overlaps`]): intervals during which two
//!   clients both believed they held a key. Under pauses longer than the TTL
//!   these are unavoidable (the paused process cannot know), so they are
//!   counted and measured, not forbidden;
//! * **effects** (with [`FencedResource`](crate::resource::FencedResource)):
//!   stale writes accepted and lost updates must be zero when fencing is on;
//! * **server truth** (grants as the store recorded them): checked by
//!   [`check_server_grants`] on [`ServerGrant`]s collected from the store.

use std::collections::BTreeMap;

pub use fenced_conformance::history::{belief_overlaps, BeliefOverlap, Event, History, Op, Phase};
use serde::{Deserialize, Serialize};

/// A grant as the store itself recorded it: the key, the token, and the
/// store's own interval (from its clock or its event order).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ServerGrant {
    /// The key.
    pub key: String,
    /// The fencing token the store handed out.
    pub token: u64,
    /// Start of the grant on the store's clock or event order.
    pub from: u64,
    /// End (release, expiry or takeover) on the same scale.
    pub to: u64,
}

/// What the server-truth check found.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ServerTruth {
    /// Grants checked.
    pub grants: usize,
    /// Pairs of grants on one key whose intervals intersect (must be 0).
    pub overlaps: usize,
    /// Grants whose token did not exceed the previous grant's (must be 0).
    pub token_regressions: usize,
    /// Grants a client reported that the store's record does not vouch for
    /// (no such token granted, or — where the record allows judging it —
    /// already over before the client asked). Must be 0.
    pub unmatched_client_grants: usize,
    /// Set when the record cannot tell overlaps (then `overlaps` is 0 and
    /// means nothing): why.
    #[serde(deserialize_with = "unjudged_reason")]
    pub overlaps_unjudged: Option<Reason>,
}

/// Why `row_lock` overlaps are not judged on a MariaDB binary log: one of
/// the reasons a [`ServerTruth`] can carry, kept beside the type that reads
/// them back.
pub const ROW_LOCK_UNJUDGED: &str = "row_lock: the lock is an open transaction's row lock; a dead holder's rollback leaves no trace in the binary log";

/// Why overlaps are not judged on the family's sampled holders: one of the
/// reasons a [`ServerTruth`] can carry.
pub const FAMILY_SAMPLED: &str = "semaphores and reader-writer locks: the store's list of holders applies the store's own rule, so no look can show more holders than the capacity; client grants the list does not show are counted as unvouched instead";

/// A fixed explanation. An alias, not `&'static str` spelt out: serde's
/// derive takes a literal `&str` field as borrowed from the input, which
/// would tie a deserialized `ServerTruth` to its line.
pub type Reason = &'static str;

/// Reads a stored `overlaps_unjudged` back (`fenced-faults --resume`) as one
/// of the reasons this crate writes, so the field can stay `&'static str`
/// and `ServerTruth` stay `Copy`.
fn unjudged_reason<'de, D: serde::Deserializer<'de>>(
    d: D,
) -> Result<Option<&'static str>, D::Error> {
    const KNOWN: &[&str] = &[ROW_LOCK_UNJUDGED, FAMILY_SAMPLED];
    let stored: Option<String> = Option::deserialize(d)?;
    Ok(stored.map(|s| {
        KNOWN
            .iter()
            .copied()
            .find(|k| *k == s)
            .unwrap_or("a reason this build does not know (written by another version)")
    }))
}

/// Per key, in order of grant start: no two grants intersect and tokens
/// strictly increase.
pub fn check_server_grants(grants: &[ServerGrant]) -> ServerTruth {
    let mut by_key: BTreeMap<&str, Vec<&ServerGrant>> = BTreeMap::new();
    for g in grants {
        by_key.entry(&g.key).or_default().push(g);
    }
    let mut t = ServerTruth {
        grants: grants.len(),
        ..ServerTruth::default()
    };
    for (_, mut v) in by_key {
        v.sort_by_key(|g| (g.from, g.token));
        for w in v.windows(2) {
            if w[1].from < w[0].to {
                t.overlaps += 1;
            }
            if w[1].token <= w[0].token {
                t.token_regressions += 1;
            }
        }
    }
    t
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn server_truth_catches_overlaps_and_token_regressions() {
        let g = |token, from, to| ServerGrant {
            key: "k".into(),
            token,
            from,
            to,
        };
        assert_eq!(
            check_server_grants(&[g(1, 0, 10), g(2, 10, 20)]),
            ServerTruth {
                grants: 2,
                overlaps: 0,
                token_regressions: 0,
                unmatched_client_grants: 0,
                overlaps_unjudged: None
            }
        );
        let bad = check_server_grants(&[g(1, 0, 10), g(2, 5, 20), g(2, 20, 30)]);
        assert_eq!((bad.overlaps, bad.token_regressions), (1, 1));
    }
}
