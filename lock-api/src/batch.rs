//! Renewing many leases with few statements: the shared half of
//! [`DistributedLock::extend_many`] for stores that can renew a batch at
//! once (the SQL backends).
//!
//! A store implements [`ExtendChunk`] — one statement for a chunk of leases,
//! each checked against its own owner and token — and forwards
//! `extend_many` to [`extend_in_chunks`], which validates, chunks, computes
//! the new deadlines and, whenever a
//! statement cannot say exactly which leases it renewed, falls back to one
//! `extend` per lease. A lease that is not current therefore never reads as
//! renewed, whatever the store's statement could report.

use std::{collections::HashSet, time::Duration};

use async_trait::async_trait;
use tokio::time::Instant;

use crate::{DistributedLock, Error, FencingToken, Lease, LockOptions, Result};

/// What one batch statement found.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum ChunkVerdict {
    /// Every lease of the chunk was current and is renewed.
    All,
    /// Exactly the leases with these tokens were renewed; the others were
    /// not current and nothing was changed for them. Only for stores whose
    /// tokens are unique across keys (a row id).
    Exactly(HashSet<FencingToken>),
    /// Per lease of the chunk, in its order: whether that one was renewed
    /// (the others were not current and nothing was changed for them). An
    /// answer of another length than the chunk's counts as
    /// [`Unknown`](Self::Unknown).
    Each(Vec<bool>),
    /// Some were not renewed and the statement cannot say which: every
    /// lease of the chunk is renewed again one by one.
    Unknown,
}

/// One statement renewing a chunk of leases.
#[async_trait]
pub trait ExtendChunk: DistributedLock {
    /// Renews `chunk` (1 to the chunk size of [`extend_in_chunks`] leases,
    /// no lease twice — but one key may come with two tokens) for the
    /// already validated `ttl`, with the same checks as `extend`, per lease:
    /// its owner, its token, not expired.
    ///
    /// The leases of a chunk have different owners as a rule: a
    /// [`LockClient`](crate::LockClient) gives every acquisition its own
    /// owner unless one is configured, and its renewals of all of them come
    /// as one batch. A statement that checked one owner for the whole chunk
    /// would renew one lease per statement.
    ///
    /// # Errors
    ///
    /// When the statement fails; the chunk is then renewed one by one.
    async fn extend_chunk(&self, chunk: &[&Lease], ttl: Duration) -> Result<ChunkVerdict>;
}

/// `extend` for each lease, up to [`EXTEND_MANY_CONCURRENCY`](crate::EXTEND_MANY_CONCURRENCY)
/// at a time: the default [`DistributedLock::extend_many`].
pub async fn extend_each<L: DistributedLock + ?Sized>(
    lock: &L,
    leases: &[Lease],
    ttl: Duration,
) -> Vec<Result<Lease>> {
    use futures_util::StreamExt as _;
    // The futures are built first (they do nothing until polled): a closure
    // inside the stream would not be `Send` for every lifetime.
    let renewals: Vec<_> = leases.iter().map(|l| lock.extend(l, ttl)).collect();
    futures_util::stream::iter(renewals)
        .buffered(crate::EXTEND_MANY_CONCURRENCY)
        .collect()
        .await
}

/// [`DistributedLock::extend_many`] through [`ExtendChunk`]: `chunk_size`
/// leases at most per statement, whatever their owners.
pub async fn extend_in_chunks<L: ExtendChunk + ?Sized>(
    lock: &L,
    leases: &[Lease],
    ttl: Duration,
    chunk_size: usize,
) -> Vec<Result<Lease>> {
    // A bad TTL, or nothing to batch: `extend` says it per lease.
    if leases.len() < 2 || LockOptions::validate_ttl(ttl).is_err() {
        return extend_each(lock, leases, ttl).await;
    }
    let mut out: Vec<Option<Result<Lease>>> = leases.iter().map(|_| None).collect();
    let mut retry: Vec<usize> = Vec::new();
    // One lease twice (a caller's duplicate) is one row: keep the chunks'
    // leases distinct and renew the repeats one by one.
    let mut seen = HashSet::new();
    let (unique, repeats): (Vec<usize>, Vec<usize>) =
        (0..leases.len()).partition(|&i| seen.insert((&leases[i].key, leases[i].token)));
    retry.extend(repeats);
    for chunk in unique.chunks(chunk_size.max(1)) {
        let refs: Vec<&Lease> = chunk.iter().map(|&i| &leases[i]).collect();
        let sent = Instant::now();
        match lock.extend_chunk(&refs, ttl).await {
            Ok(ChunkVerdict::All) => {
                for &i in chunk {
                    out[i] = Some(Ok(leases[i].renewed(ttl, sent)));
                }
            }
            Ok(ChunkVerdict::Exactly(renewed)) => {
                for &i in chunk {
                    let lease = &leases[i];
                    out[i] = Some(verdict(lease, renewed.contains(&lease.token), ttl, sent));
                }
            }
            Ok(ChunkVerdict::Each(renewed)) if renewed.len() == chunk.len() => {
                for (&i, renewed) in chunk.iter().zip(renewed) {
                    out[i] = Some(verdict(&leases[i], renewed, ttl, sent));
                }
            }
            Ok(ChunkVerdict::Unknown | ChunkVerdict::Each(_)) => retry.extend_from_slice(chunk),
            Err(e) => {
                tracing::debug!(error = %e, leases = chunk.len(), "batch renewal failed; renewing one by one");
                retry.extend_from_slice(chunk);
            }
        }
    }
    let again: Vec<Lease> = retry.iter().map(|&i| leases[i].clone()).collect();
    for (i, result) in retry.into_iter().zip(extend_each(lock, &again, ttl).await) {
        out[i] = Some(result);
    }
    out.into_iter()
        .zip(leases)
        .map(|(r, lease)| {
            // Every position is filled above; an empty one would be a bug here.
            r.unwrap_or_else(|| {
                Err(Error::lease_lost(
                    &lease.key,
                    lease.token,
                    "internal: no renewal result",
                ))
            })
        })
        .collect()
}

/// One lease's result from a batch statement that said whether it was
/// renewed.
fn verdict(lease: &Lease, renewed: bool, ttl: Duration, sent: Instant) -> Result<Lease> {
    if renewed {
        return Ok(lease.renewed(ttl, sent));
    }
    tracing::debug!(key = %lease.key, token = %lease.token, "extend refused: the lease expired or was taken over");
    Err(Error::lease_lost(
        &lease.key,
        lease.token,
        "the lease expired or belongs to another holder",
    ))
}

/// The placeholder count for a chunk of `n`: the next power of two, so a
/// store prepares a handful of distinct statements, not one per size. The
/// extra places repeat the chunk's last value (harmless in an `IN` list).
pub fn padded_len(n: usize) -> usize {
    n.max(1).next_power_of_two()
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use super::*;
    use crate::{LockKey, MemoryLock};

    /// A store renewing through [`extend_in_chunks`] that records the size
    /// of every chunk it is sent and renews each lease of it on a
    /// [`MemoryLock`] (whose tokens are unique across keys).
    #[derive(Debug, Default)]
    struct Chunked {
        inner: MemoryLock,
        chunks: Mutex<Vec<usize>>,
        size: usize,
        answer: Answer,
    }

    /// How [`Chunked`] says what it renewed.
    #[derive(Debug, Default, Clone, Copy, PartialEq)]
    enum Answer {
        /// [`ChunkVerdict::Exactly`] the renewed tokens.
        #[default]
        Tokens,
        /// [`ChunkVerdict::Each`], one flag per lease.
        Each,
        /// [`ChunkVerdict::Each`] with the last flag missing.
        ShortEach,
    }

    #[async_trait]
    impl crate::WrapLock for Chunked {
        fn inner(&self) -> &dyn DistributedLock {
            &self.inner
        }
        async fn extend_many(&self, leases: &[Lease], ttl: Duration) -> Vec<Result<Lease>> {
            extend_in_chunks(self, leases, ttl, self.size).await
        }
    }
    crate::wrap_lock!(Chunked);

    #[async_trait]
    impl ExtendChunk for Chunked {
        async fn extend_chunk(&self, chunk: &[&Lease], ttl: Duration) -> Result<ChunkVerdict> {
            self.chunks.lock().unwrap().push(chunk.len());
            let mut renewed = HashSet::new();
            let mut each = Vec::new();
            for lease in chunk {
                let ok = self.inner.extend(lease, ttl).await.is_ok();
                if ok {
                    renewed.insert(lease.token);
                }
                each.push(ok);
            }
            Ok(match self.answer {
                Answer::Tokens => ChunkVerdict::Exactly(renewed),
                Answer::Each => ChunkVerdict::Each(each),
                Answer::ShortEach => {
                    each.pop();
                    ChunkVerdict::Each(each)
                }
            })
        }
    }

    /// `n` leases on distinct keys, each with its own random owner (what a
    /// `LockClient` without a configured owner holds).
    async fn leases(store: &Chunked, n: usize) -> Vec<Lease> {
        let mut out = Vec::new();
        for i in 0..n {
            let key = LockKey::new(format!("k{i}")).unwrap();
            let opts = LockOptions::builder()
                .ttl(Duration::from_secs(5))
                .build()
                .unwrap();
            out.push(store.try_acquire(&key, &opts).await.unwrap().unwrap());
        }
        out
    }

    #[tokio::test]
    async fn leases_of_many_owners_share_a_statement() {
        let store = Chunked {
            size: 4,
            ..Chunked::default()
        };
        let held = leases(&store, 10).await;
        let owners: HashSet<_> = held.iter().map(|l| l.owner.clone()).collect();
        assert_eq!(owners.len(), 10, "each lease has its own owner");
        let results = store.extend_many(&held, Duration::from_secs(9)).await;
        assert!(results.iter().all(Result::is_ok), "{results:?}");
        assert_eq!(*store.chunks.lock().unwrap(), [4, 4, 2]);
    }

    #[tokio::test]
    async fn a_lease_not_current_is_refused_alone() {
        for answer in [Answer::Tokens, Answer::Each] {
            let store = Chunked {
                size: 256,
                answer,
                ..Chunked::default()
            };
            let held = leases(&store, 3).await;
            store.release(&held[1]).await.unwrap();
            // The same lease twice is renewed once in the batch, once alone.
            let mut asked = held.clone();
            asked.push(held[0].clone());
            let results = store.extend_many(&asked, Duration::from_secs(9)).await;
            assert!(
                results[0].is_ok() && results[2].is_ok() && results[3].is_ok(),
                "{answer:?}: {results:?}"
            );
            assert!(
                matches!(&results[1], Err(Error::LeaseLost { .. })),
                "{answer:?}: {:?}",
                results[1]
            );
            assert_eq!(*store.chunks.lock().unwrap(), [3], "{answer:?}");
        }
    }

    /// A per-lease answer that does not cover the chunk proves nothing for
    /// any of its leases: each is asked again alone, and the one not
    /// current is still refused.
    #[tokio::test]
    async fn a_short_answer_is_renewed_one_by_one() {
        let store = Chunked {
            size: 256,
            answer: Answer::ShortEach,
            ..Chunked::default()
        };
        let held = leases(&store, 3).await;
        store.release(&held[2]).await.unwrap();
        let results = store.extend_many(&held, Duration::from_secs(9)).await;
        assert!(results[0].is_ok() && results[1].is_ok(), "{results:?}");
        assert!(
            matches!(&results[2], Err(Error::LeaseLost { .. })),
            "{:?}",
            results[2]
        );
    }

    #[test]
    fn padded_lengths_are_few() {
        assert_eq!(padded_len(0), 1);
        assert_eq!(padded_len(1), 1);
        assert_eq!(padded_len(3), 4);
        assert_eq!(padded_len(256), 256);
        assert_eq!(padded_len(257), 512);
    }
}
