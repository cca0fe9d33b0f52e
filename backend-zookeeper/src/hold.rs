//! Extend and release of one node this client tracks, in any queue (a
//! lock's, or a semaphore's): one write each, with no read first, since a
//! node's path (a nonce and a sequence) names one grant for good.

use std::time::Duration;

use fenced_api::{batch::ChunkVerdict, deadlines::Tracked, Error, Lease, ReleaseOutcome, Result};
use tokio::time::Instant;

use crate::{
    entry,
    error::{self, kind, Kind},
    session::{self, Sessions},
    track::{self, Tracker},
};

/// The tracked node of `lease` in `queue`: the one with its token as
/// creation zxid.
pub(crate) fn tracked_in(tracker: &Tracker, queue: &str, lease: &Lease) -> Option<(String, i64)> {
    let queue = format!("{queue}/");
    track::node_of(tracker, lease.token.get() as i64).filter(|(path, _)| path.starts_with(&queue))
}

/// Rewrites the TTL in the data of the tracked `node` of `lease` through
/// the node's own session: the write keeps that session alive on the
/// server at least one negotiated timeout past its send time, which is
/// where the renewed lease counts from. `Ok(None)`: the node is not
/// tracked here after all (the caller reads it first).
pub(crate) async fn extend_tracked(
    sessions: &Sessions,
    tracker: &Tracker,
    node: (String, i64),
    lease: &Lease,
    ttl: Duration,
) -> Result<Option<Lease>> {
    let lost = |why: &str| Error::lease_lost(&lease.key, lease.token, why);
    let held = match tracker.begin_extend(&node) {
        Tracked::Expired => return Err(lost("its TTL passed without an extend")),
        Tracked::Lost => return Err(lost("its session ended or its node was deleted")),
        Tracked::Yes(held) => held,
        Tracked::No => return Ok(None),
    };
    let mut ending = tracker.extending(Some(node.clone()));
    if held.owner != lease.owner {
        tracing::debug!(key = %lease.key, token = %lease.token, "extend refused: another owner's lease");
        return Err(lost("the lock belongs to another owner"));
    }
    let Some(s) = sessions.by_id(held.session) else {
        tracker.lose(&node);
        return Err(lost("its session ended"));
    };
    let ttl = session::granted(ttl, s.negotiated());
    let data = entry::data(&held.owner, ttl, held.label.as_ref());
    let sent = Instant::now();
    match s
        .run("set", s.client().set_data(&node.0, &data, None))
        .await?
    {
        Ok(_) => {
            let renewed = lease.renewed(ttl, sent);
            ending.renewed(renewed.deadline, held);
            Ok(Some(renewed))
        }
        Err(e) if kind(&e) == Kind::NoNode => {
            tracing::debug!(key = %lease.key, token = %lease.token, "extend refused: the lock is gone");
            drop(ending);
            tracker.forget(&node);
            Err(lost("its node was deleted or expired"))
        }
        Err(e) => Err(error::map(e)),
    }
}

/// Renews `chunk` in one `multi` of `setData`s when every lease of it is
/// tracked here, current, of the owner its node names and on one session
/// that grants the whole `ttl`: a `multi` applies all its writes or none,
/// so its success renews exactly the chunk. Anything else — a lease not
/// tracked, expired or lost, two sessions, a shorter session timeout, a
/// node gone (the `multi` fails) — is [`ChunkVerdict::Unknown`], and
/// [`extend_in_chunks`](fenced_api::batch::extend_in_chunks) renews the
/// chunk one lease at a time, which says per lease what happened.
pub(crate) async fn extend_tracked_chunk(
    sessions: &Sessions,
    tracker: &Tracker,
    chunk: &[(&Lease, (String, i64))],
    ttl: Duration,
) -> Result<ChunkVerdict> {
    let mut endings = Vec::with_capacity(chunk.len());
    let mut session = None;
    for (lease, node) in chunk {
        // Every extend begun is ended by its guard: renewed on success,
        // left as it was otherwise.
        let held = match tracker.begin_extend(node) {
            Tracked::Yes(held) => held,
            Tracked::No => return Ok(ChunkVerdict::Unknown),
            Tracked::Expired | Tracked::Lost => return Ok(ChunkVerdict::Unknown),
        };
        let ending = tracker.extending(Some(node.clone()));
        let same_session = *session.get_or_insert(held.session) == held.session;
        endings.push((ending, held.clone()));
        if held.owner != lease.owner || !same_session {
            return Ok(ChunkVerdict::Unknown);
        }
    }
    let Some(s) = session.and_then(|id| sessions.by_id(id)) else {
        return Ok(ChunkVerdict::Unknown);
    };
    // `extend_in_chunks` counts a renewed lease's TTL as asked.
    if session::granted(ttl, s.negotiated()) != ttl {
        return Ok(ChunkVerdict::Unknown);
    }
    let mut writer = s.client().new_multi_writer();
    for ((_, node), (_, held)) in chunk.iter().zip(&endings) {
        let data = entry::data(&held.owner, ttl, held.label.as_ref());
        writer
            .add_set_data(&node.0, &data, None)
            .map_err(error::map)?;
    }
    let sent = Instant::now();
    let commit = writer.commit();
    match s
        .run("multi", async move {
            commit.await.map_err(zookeeper_client::Error::from)
        })
        .await?
    {
        Ok(_) => {
            for ((lease, _), (ending, held)) in chunk.iter().zip(endings.iter_mut()) {
                ending.renewed(lease.renewed(ttl, sent).deadline, held.clone());
            }
            Ok(ChunkVerdict::All)
        }
        // A node of the chunk is gone: nothing was written.
        Err(e) if kind(&e) == Kind::NoNode => Ok(ChunkVerdict::Unknown),
        Err(e) => Err(error::map(e)),
    }
}

/// Deletes the node at `path` (the grant with creation zxid `token`) and
/// stops tracking it. Deleting the path deletes exactly this grant and
/// hands its place to the next in line. On an error the node stays
/// tracked: the reaper deletes it at its deadline.
pub(crate) async fn delete(
    sessions: &Sessions,
    tracker: &Tracker,
    path: String,
    token: i64,
) -> Result<ReleaseOutcome> {
    let s = sessions.get().await?;
    let outcome = match s.run("delete", s.client().delete(&path, None)).await? {
        Ok(()) => ReleaseOutcome::Released,
        Err(e) if kind(&e) == Kind::NoNode => ReleaseOutcome::NotHeld,
        Err(e) => return Err(error::map(e)),
    };
    tracker.forget(&(path, token));
    Ok(outcome)
}
