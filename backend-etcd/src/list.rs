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

use crate::{entry, lock::EtcdLock};

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
fn range_end(prefix: &[u8]) -> Vec<u8> {
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

impl EtcdLock {
    /// See [`DistributedLock::list`](fenced_api::DistributedLock::list) on
    /// [`EtcdLock`] and the module docs.
    pub(crate) async fn list_held(&self, limit: usize) -> Result<Vec<LockInfo>> {
        if limit == 0 {
            return Ok(Vec::new());
        }
        let mut base = self.inner.config.prefix.as_bytes().to_vec();
        base.extend_from_slice(b"\0lock\0");
        let end = range_end(&base);
        let mut from = base.clone();
        let mut revision = 0;
        let mut lines: Vec<Line> = Vec::new();
        let mut current: Option<Line> = None;
        'pages: loop {
            let opts = GetOptions::new()
                .with_range(end.clone())
                .with_limit(PAGE)
                .with_revision(revision);
            let resp = self
                .call("list range", |mut c| {
                    let (from, opts) = (from.clone(), opts.clone());
                    async move { c.get(from, Some(opts)).await }
                })
                .await?;
            if revision == 0 {
                revision = resp.header().map_or(0, |h| h.revision());
            }
            for kv in resp.kvs() {
                let Some(rest) = kv.key().strip_prefix(base.as_slice()) else {
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
        self.infos(lines).await
    }

    /// Each holder as `inspect` shows it: remaining TTL from its session
    /// lease (one `LeaseTimeToLive` per distinct lease: holders of one
    /// client share one), capped by this client's own deadline if it holds
    /// the lock.
    async fn infos(&self, lines: Vec<Line>) -> Result<Vec<LockInfo>> {
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
            let mut ttl = match ttls.get(&line.lease) {
                Some(t) => *t,
                None => {
                    let id = line.lease;
                    let t = match self
                        .call("lease ttl", |mut c| async move {
                            c.lease_time_to_live(id, None).await
                        })
                        .await
                    {
                        Ok(r) => Duration::from_secs(r.ttl().max(0) as u64),
                        Err(_) => Duration::ZERO,
                    };
                    ttls.insert(id, t);
                    t
                }
            };
            if let Some(deadline) = self.inner.tracker.deadline(
                &self.entry_path(&key, entry::owner_bytes(&line.value)),
                line.revision,
            ) {
                ttl = ttl.min(deadline.saturating_duration_since(Instant::now()));
            }
            let (owner, label) = entry::decode(&key, &line.value);
            held.push(
                LockInfo::new(key, owner, FencingToken::new(line.revision as u64), ttl, 1)
                    .with_label(label),
            );
        }
        Ok(held)
    }
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
