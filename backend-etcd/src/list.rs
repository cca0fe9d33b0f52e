//! `list`: the holders of every line under the prefix.
//!
//! Entries are `<prefix>\0lock\0<key>\0<owner>`. NUL occurs in no key, so
//! in etcd's key order the entries of one key are contiguous, and the
//! lines come in key order. The range `<prefix>\0lock\0` … is read in
//! pages of [`PAGE`] entries, all at the revision of the first page (one
//! consistent snapshot); of each line only the oldest entry (lowest create
//! revision) holds — the others are waiters and are not listed. Reading
//! stops once `limit` lines are complete.

use std::collections::HashMap;
use std::time::Duration;

use etcd_client::GetOptions;
use fenced_api::{FencingToken, LockInfo, LockKey, Result};
use tokio::time::Instant;

use crate::{client::Etcd, entry, keys::Keys, track::Tracker};

/// Entries read per range request.
pub(crate) const PAGE: i64 = 500;

/// The holder of one line, so far: (key bytes, entry value, create revision, lease).
struct Line {
    key: Vec<u8>,
    value: Vec<u8>,
    revision: i64,
    lease: i64,
}

/// The first key after every key that starts with `prefix` (which ends in
/// NUL here, so incrementing its last byte is enough).
pub(crate) fn range_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    // All 0xff: to the end of the keyspace.
    vec![0]
}

/// The holders under the prefix of `keys`, first `limit` in key order (see
/// the module docs).
pub(crate) async fn list(
    etcd: &Etcd,
    keys: &Keys,
    tracker: &Tracker,
    limit: usize,
) -> Result<Vec<LockInfo>> {
    if limit == 0 {
        return Ok(Vec::new());
    }
    let lines = holders(etcd, keys, limit).await?;
    // One `LeaseTimeToLive` per distinct lease: holders of one client share one.
    let mut ttls: HashMap<i64, Duration> = HashMap::new();
    let mut held = Vec::with_capacity(lines.len());
    for line in lines {
        let Some(key) = std::str::from_utf8(&line.key)
            .ok()
            .and_then(|k| LockKey::new(k).ok())
        else {
            tracing::warn!(entry = ?String::from_utf8_lossy(&line.key), "an entry under the lock prefix names no valid key; not listed");
            continue;
        };
        let ttl = match ttls.get(&line.lease) {
            Some(t) => *t,
            None => {
                let t = lease_ttl(etcd, line.lease).await;
                ttls.insert(line.lease, t);
                t
            }
        };
        held.push(info(keys, tracker, key, &line.value, line.revision, ttl));
    }
    Ok(held)
}

/// The holder of each of the first `limit` (at least one) lines, read at one
/// revision.
async fn holders(etcd: &Etcd, keys: &Keys, limit: usize) -> Result<Vec<Line>> {
    let base = keys.lines();
    let end = range_end(base);
    let mut from = base.to_vec();
    let mut revision = 0;
    let mut lines: Vec<Line> = Vec::new();
    let mut current: Option<Line> = None;
    'pages: loop {
        let opts = GetOptions::new()
            .with_range(end.clone())
            .with_limit(PAGE)
            .with_revision(revision);
        let resp = etcd
            .call("list range", |mut c| {
                let (from, opts) = (from.clone(), opts.clone());
                async move { c.get(from, Some(opts)).await }
            })
            .await?;
        if revision == 0 {
            revision = resp.header().map_or(0, |h| h.revision());
        }
        for kv in resp.kvs() {
            let Some(rest) = kv.key().strip_prefix(base) else {
                continue;
            };
            let Some(nul) = rest.iter().position(|b| *b == 0) else {
                continue;
            };
            let entry = Line {
                key: rest[..nul].to_vec(),
                value: kv.value().to_vec(),
                revision: kv.create_revision(),
                lease: kv.lease(),
            };
            match current.as_mut() {
                Some(line) if line.key == entry.key => {
                    if entry.revision < line.revision {
                        *line = entry;
                    }
                }
                _ => {
                    if let Some(done) = current.replace(entry) {
                        lines.push(done);
                        if lines.len() >= limit {
                            break 'pages;
                        }
                    }
                }
            }
        }
        match resp.kvs().last() {
            Some(last) if resp.more() => {
                from = last.key().to_vec();
                from.push(0);
            }
            _ => {
                lines.extend(current.take());
                break;
            }
        }
    }
    lines.truncate(limit);
    Ok(lines)
}

/// What is left of a session lease, as etcd reports it: the latest a key on
/// it lives if its client stops now (zero when etcd does not say).
pub(crate) async fn lease_ttl(etcd: &Etcd, lease: i64) -> Duration {
    match etcd.lease_ttl(lease).await {
        Ok(secs) => Duration::from_secs(secs.max(0) as u64),
        Err(_) => Duration::ZERO,
    }
}

/// A holder as `inspect` and `list` show it: its entry's value decoded, its
/// create revision as token, and the remaining TTL of its session lease —
/// capped by this client's own deadline when the lock is held through it.
pub(crate) fn info(
    keys: &Keys,
    tracker: &Tracker,
    key: LockKey,
    value: &[u8],
    revision: i64,
    lease_ttl: Duration,
) -> LockInfo {
    let mut ttl = lease_ttl;
    let entry = keys.entry(&key, entry::owner_bytes(value));
    if let Some(deadline) = tracker.deadline(&(entry, revision)) {
        ttl = ttl.min(deadline.saturating_duration_since(Instant::now()));
    }
    let (owner, label) = entry::decode(&key, value);
    LockInfo::new(key, owner, FencingToken::new(revision as u64), ttl, 1).with_label(label)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn range_end_covers_exactly_the_prefix() {
        assert_eq!(range_end(b"app\0lock\0"), b"app\0lock\x01".to_vec());
        assert_eq!(range_end(b"a\xff"), b"b".to_vec());
        assert_eq!(range_end(b"\xff"), vec![0]);
    }
}
