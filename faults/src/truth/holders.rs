//! Server truth of the family cells: the store's own list of the key's
//! current holders, asked again and again for the whole run.
//!
//! Semaphores and reader-writer locks keep their lines apart from the
//! locks (tables, hashes, key ranges, znodes of their own), which the
//! mutex's records ([`super::Recorder`]) do not read. What every store can
//! show instead is who holds a key *now*, in one read of its own state
//! (`Semaphore::holders`, `RwLock::holders`: one statement, one script, one
//! range read at a revision, one listing of the line's znodes) decided by
//! the store's rule on the store's clock. A sampler asks that straight
//! from the server (no proxy, its own connection) in a loop for the whole
//! run, and each answer is checked: the holders' weights never above the
//! capacity (no third permit of two, no writer beside anyone), and grants
//! in line order (a token first seen below one seen before it would be a
//! later arrival let in ahead). It is sampled: a hold shorter than a
//! round trip can fall between two looks, so client grants the sampler
//! never saw are not counted as unvouched.

use std::{collections::BTreeSet, time::Duration};

use fenced_api::{permits::KeyHolders, LockClient};
use tokio::sync::oneshot;

use crate::{history::ServerTruth, model::Primitive};

/// A running sampler.
#[derive(Debug)]
pub struct Sampler {
    stop: oneshot::Sender<()>,
    task: tokio::task::JoinHandle<Result<Samples, String>>,
}

#[derive(Debug, Default)]
struct Samples {
    looks: usize,
    over_capacity: usize,
    out_of_order: usize,
    seen: BTreeSet<u64>,
    errors: usize,
}

impl Samples {
    fn add(&mut self, h: &KeyHolders) {
        self.looks += 1;
        let weight: u64 = h
            .holders
            .iter()
            .map(|p| u64::from(p.permits.weight()))
            .sum();
        if weight > u64::from(h.capacity) {
            self.over_capacity += 1;
        }
        let max_before = self.seen.last().copied();
        for p in &h.holders {
            let t = p.info.token.get();
            if self.seen.insert(t) && max_before.is_some_and(|m| t < m) {
                self.out_of_order += 1;
            }
        }
    }
}

impl Sampler {
    /// Starts sampling `key`'s holders on the store at `url` (straight to
    /// the server).
    ///
    /// # Errors
    ///
    /// When the store cannot be reached (naming `scripts/services.sh`).
    pub async fn start(url: &str, key: &str, primitive: Primitive) -> Result<Sampler, String> {
        let lock = fenced::connect(url).await.map_err(|e| {
            format!("family truth: connect: {e}; are the services up? run scripts/services.sh")
        })?;
        let client = LockClient::new(lock);
        let key = key.to_owned();
        // A bad key or capacity is a set-up error, before the run starts.
        look(&client, &key, primitive)
            .await
            .map_err(|e| format!("family truth: first look: {e}"))?;
        let (stop, mut stopped) = oneshot::channel();
        let task = tokio::spawn(async move {
            let mut s = Samples::default();
            loop {
                match look(&client, &key, primitive).await {
                    Ok(Some(h)) => s.add(&h),
                    Ok(None) => s.looks += 1,
                    // The store is busy or the look raced a change: the next
                    // look counts. Many failures mean no record at all.
                    Err(_) => s.errors += 1,
                }
                tokio::select! {
                    _ = &mut stopped => return Ok(s),
                    () = tokio::time::sleep(Duration::from_millis(1)) => {}
                }
            }
        });
        Ok(Sampler { stop, task })
    }

    /// Stops sampling and checks what was seen.
    ///
    /// # Errors
    ///
    /// When the sampler failed, or most of its looks did.
    pub async fn finish(self) -> Result<ServerTruth, String> {
        let _ = self.stop.send(());
        let s = self
            .task
            .await
            .map_err(|e| format!("family truth: sampler: {e}"))??;
        if s.errors > s.looks {
            return Err(format!(
                "family truth: {} of {} looks at the holders failed",
                s.errors,
                s.looks + s.errors
            ));
        }
        Ok(ServerTruth {
            grants: s.seen.len(),
            overlaps: s.over_capacity,
            token_regressions: s.out_of_order,
            unmatched_client_grants: 0,
            overlaps_unjudged: None,
        })
    }
}

async fn look(
    client: &LockClient,
    key: &str,
    primitive: Primitive,
) -> fenced_api::Result<Option<KeyHolders>> {
    match primitive {
        Primitive::Semaphore => {
            client
                .semaphore(key, crate::model::SEMAPHORE_PERMITS)?
                .holders()
                .await
        }
        _ => client.rw_lock(key)?.holders().await,
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use fenced_api::{permits::PermitHolder, FencingToken, LockInfo, LockKey, Owner, Permits};

    use super::*;

    fn look(capacity: u32, holders: &[(u64, Permits)]) -> KeyHolders {
        let key = LockKey::new("k").unwrap();
        let holders = holders
            .iter()
            .map(|(t, p)| {
                let info = LockInfo::new(
                    key.clone(),
                    Owner::new(format!("o{t}")).unwrap(),
                    FencingToken::new(*t),
                    Duration::from_secs(1),
                    1,
                );
                PermitHolder::new(info, *p)
            })
            .collect();
        KeyHolders::new(key, capacity, holders, 0)
    }

    #[test]
    fn over_capacity_and_out_of_order_grants_are_counted() {
        let one = Permits::semaphore(2).unwrap();
        let mut s = Samples::default();
        s.add(&look(2, &[(1, one), (2, one)]));
        s.add(&look(2, &[(2, one), (3, one)]));
        assert_eq!((s.over_capacity, s.out_of_order, s.seen.len()), (0, 0, 3));
        // A third permit of two; then a token below one already seen.
        s.add(&look(2, &[(3, one), (4, one), (5, one)]));
        s.add(&look(2, &[(5, one), (0, one)]));
        assert_eq!((s.over_capacity, s.out_of_order), (1, 1));
        // A writer beside a reader is over a reader-writer lock's capacity.
        let mut rw = Samples::default();
        let cap = Permits::RW_CAPACITY;
        rw.add(&look(cap, &[(1, Permits::read()), (2, Permits::read())]));
        assert_eq!(rw.over_capacity, 0);
        rw.add(&look(cap, &[(2, Permits::read()), (3, Permits::write())]));
        assert_eq!(rw.over_capacity, 1);
    }
}
