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

use crate::{
    history::{Event, History, Op, Phase, ServerTruth, FAMILY_SAMPLED},
    model::Primitive,
};

/// A running sampler.
#[derive(Debug)]
pub struct Sampler {
    stop: oneshot::Sender<()>,
    task: tokio::task::JoinHandle<Result<Samples, String>>,
}

/// One look: when it was asked and answered (the run's history clock, ns)
/// and the tokens the store listed as holders.
#[derive(Debug, Clone)]
struct Sample {
    sent: u64,
    answered: u64,
    tokens: Vec<u64>,
}

#[derive(Debug, Default)]
struct Samples {
    looks: Vec<Sample>,
    errors: usize,
}

impl Samples {
    /// Tokens first seen below a token seen in an earlier look: a later
    /// arrival let in ahead of an earlier one (tokens number arrivals).
    fn out_of_order(&self) -> usize {
        let mut seen = BTreeSet::new();
        let mut n = 0;
        for s in &self.looks {
            let max_before = seen.last().copied();
            for t in &s.tokens {
                if seen.insert(*t) && max_before.is_some_and(|m| *t < m) {
                    n += 1;
                }
            }
        }
        n
    }

    fn seen(&self) -> usize {
        self.looks
            .iter()
            .flat_map(|s| s.tokens.iter().copied())
            .collect::<BTreeSet<u64>>()
            .len()
    }

    /// Client holds that a look made wholly inside them did not list: the
    /// client was told it holds, the store's own rule says it does not.
    /// Holds during which their client suffered a fault are left out (a
    /// frozen or cut-off holder outlives its lease by design).
    fn unvouched(&self, events: &[Event]) -> usize {
        let mut open: std::collections::HashMap<usize, (u64, u64)> = Default::default();
        let mut faulted: BTreeSet<usize> = BTreeSet::new();
        let mut holds = Vec::new();
        for e in events {
            match (e.op, e.phase) {
                (Op::Acquire, Phase::Ok) => {
                    if let Some(t) = e.token {
                        open.insert(e.process, (t, e.t_ns));
                        faulted.remove(&e.process);
                    }
                }
                (Op::Fault, Phase::Invoke) => {
                    faulted.insert(e.process);
                }
                (Op::Release, Phase::Invoke) | (Op::Lost, _) => {
                    if let Some((t, from)) = open.remove(&e.process) {
                        if !faulted.remove(&e.process) {
                            holds.push((t, from, e.t_ns));
                        }
                    }
                }
                _ => {}
            }
        }
        holds
            .iter()
            .filter(|(t, from, to)| {
                self.looks
                    .iter()
                    .any(|s| s.sent >= *from && s.answered <= *to && !s.tokens.contains(t))
            })
            .count()
    }
}

impl Sampler {
    /// Starts sampling `key`'s holders on the store at `url` (straight to
    /// the server), stamping each look on `history`'s clock.
    ///
    /// # Errors
    ///
    /// When the store cannot be reached (naming `scripts/services.sh`).
    pub async fn start(
        url: &str,
        key: &str,
        primitive: Primitive,
        history: &History,
    ) -> Result<Sampler, String> {
        let lock = fenced::connect(url).await.map_err(|e| {
            format!("family truth: connect: {e}; are the services up? run scripts/services.sh")
        })?;
        let client = LockClient::new(lock);
        let key = key.to_owned();
        // A bad key or capacity is a set-up error, before the run starts.
        look(&client, &key, primitive)
            .await
            .map_err(|e| format!("family truth: first look: {e}"))?;
        let history = history.clone();
        let (stop, mut stopped) = oneshot::channel();
        let task = tokio::spawn(async move {
            let mut s = Samples::default();
            loop {
                let sent = history.now_ns();
                match look(&client, &key, primitive).await {
                    Ok(h) => s.looks.push(Sample {
                        sent,
                        answered: history.now_ns(),
                        tokens: h
                            .map(|h| h.holders.iter().map(|p| p.info.token.get()).collect())
                            .unwrap_or_default(),
                    }),
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

    /// Stops sampling and checks what was seen against the clients'
    /// `events`.
    ///
    /// # Errors
    ///
    /// When the sampler failed, or most of its looks did.
    pub async fn finish(self, events: &[Event]) -> Result<ServerTruth, String> {
        let _ = self.stop.send(());
        let s = self
            .task
            .await
            .map_err(|e| format!("family truth: sampler: {e}"))??;
        if s.errors > s.looks.len() {
            return Err(format!(
                "family truth: {} of {} looks at the holders failed",
                s.errors,
                s.looks.len() + s.errors
            ));
        }
        Ok(ServerTruth {
            grants: s.seen(),
            overlaps: 0,
            token_regressions: s.out_of_order(),
            unmatched_client_grants: s.unvouched(events),
            overlaps_unjudged: Some(FAMILY_SAMPLED),
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
    use super::*;

    fn ev(process: usize, op: Op, phase: Phase, token: Option<u64>, t_ns: u64) -> Event {
        Event {
            process,
            op,
            phase,
            key: "k".into(),
            token,
            t_ns,
            detail: String::new(),
        }
    }

    fn looks(v: &[(u64, u64, &[u64])]) -> Samples {
        Samples {
            looks: v
                .iter()
                .map(|(sent, answered, tokens)| Sample {
                    sent: *sent,
                    answered: *answered,
                    tokens: tokens.to_vec(),
                })
                .collect(),
            errors: 0,
        }
    }

    #[test]
    fn a_client_grant_the_store_does_not_list_is_unvouched() {
        // Client 0 holds token 1 from 10 to 50; client 1 token 3 from 20
        // to 40, which the store's list leaves out (a third permit of two).
        let events = [
            ev(0, Op::Acquire, Phase::Ok, Some(1), 10),
            ev(1, Op::Acquire, Phase::Ok, Some(3), 20),
            ev(1, Op::Release, Phase::Invoke, Some(3), 40),
            ev(0, Op::Release, Phase::Invoke, Some(1), 50),
        ];
        let s = looks(&[(21, 25, &[1, 2]), (45, 47, &[1])]);
        assert_eq!(s.unvouched(&events), 1);
        // Listed: vouched. A look that straddles the hold's end judges nothing.
        let s = looks(&[(21, 25, &[1, 3]), (35, 45, &[1])]);
        assert_eq!(s.unvouched(&events), 0);
        // A hold its client suffered a fault in is not judged.
        let mut faulted = events.to_vec();
        faulted.insert(2, ev(1, Op::Fault, Phase::Invoke, Some(3), 30));
        let s = looks(&[(21, 25, &[1, 2])]);
        assert_eq!(s.unvouched(&faulted), 0);
    }

    #[test]
    fn a_later_arrival_let_in_first_is_out_of_order() {
        assert_eq!(looks(&[(0, 1, &[5, 6]), (2, 3, &[6, 7])]).out_of_order(), 0);
        assert_eq!(looks(&[(0, 1, &[5, 6]), (2, 3, &[4, 6])]).out_of_order(), 1);
    }
}
