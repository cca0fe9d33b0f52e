//! `inspect` and `list`: the lowest entry of a queue is its holder.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use fenced_api::{FencingToken, LockInfo, LockKey, Result};
use zookeeper_client::Stat;

use crate::{
    entry,
    error::{self, kind, Kind},
    keys::{self, in_order, Keys},
    session::Session,
    track::Tracker,
};

/// The holder of a queue: its node path, data and stat.
#[derive(Debug)]
pub(crate) struct Holder {
    pub(crate) path: String,
    pub(crate) data: Vec<u8>,
    pub(crate) stat: Stat,
}

/// The lowest entry of the queue of `key`, read: `None` when nobody holds.
pub(crate) async fn holder(s: &Session, keys: &Keys, key: &LockKey) -> Result<Option<Holder>> {
    let queue = keys.queue(key);
    // A holder deleted between the two reads: read the queue again.
    for _ in 0..8 {
        let children = match s
            .run("get children", s.client().list_children(&queue))
            .await?
        {
            Ok(c) => in_order(c),
            Err(e) if kind(&e) == Kind::NoNode => return Ok(None),
            Err(e) => return Err(error::map(e)),
        };
        let Some(first) = children.first() else {
            return Ok(None);
        };
        let path = format!("{queue}/{first}");
        match s.run("get", s.client().get_data(&path)).await? {
            Ok((data, stat)) => return Ok(Some(Holder { path, data, stat })),
            Err(e) if kind(&e) == Kind::NoNode => continue,
            Err(e) => return Err(error::map(e)),
        }
    }
    Ok(None)
}

/// What `inspect` shows of a holder. The remaining TTL is this client's
/// own deadline when it holds the lock, otherwise the entry's TTL counted
/// from its last write (an extend rewrites it) on the server's clock.
pub(crate) fn info(tracker: &Tracker, key: LockKey, h: &Holder) -> LockInfo {
    let e = entry::decode(&h.data);
    let remaining = match tracker.deadline(&(h.path.clone(), h.stat.czxid)) {
        Some(deadline) => deadline.saturating_duration_since(tokio::time::Instant::now()),
        None => {
            let now_ms = SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_millis() as i64);
            let age = Duration::from_millis(now_ms.saturating_sub(h.stat.mtime).max(0) as u64);
            e.ttl.saturating_sub(age)
        }
    };
    LockInfo::new(
        key,
        e.owner,
        FencingToken::new(h.stat.czxid as u64),
        remaining.max(Duration::from_millis(1)),
        1,
    )
    .with_label(e.label)
}

/// The holders in the namespace, sorted by key, at most `limit`. Cost: one
/// children read of the namespace, then two reads per queue until `limit`
/// holders are found.
pub(crate) async fn list(
    s: &Session,
    keys: &Keys,
    tracker: &Tracker,
    limit: usize,
) -> Result<Vec<LockInfo>> {
    let names = match s
        .run("get children", s.client().list_children(keys.namespace()))
        .await?
    {
        Ok(c) => c,
        Err(e) if kind(&e) == Kind::NoNode => return Ok(Vec::new()),
        Err(e) => return Err(error::map(e)),
    };
    let mut locked: Vec<LockKey> = names.iter().filter_map(|n| keys::decode(n)).collect();
    locked.sort_by(|a, b| a.as_str().cmp(b.as_str()));
    let mut out = Vec::new();
    for key in locked {
        if out.len() >= limit {
            break;
        }
        if let Some(h) = holder(s, keys, &key).await? {
            out.push(info(tracker, key, &h));
        }
    }
    Ok(out)
}
