//! Requests of many locks, sent together: ownership checks (reads) in one
//! read-only transaction, releases and expiry deletions (guarded deletes,
//! each a nested transaction) in one write — up to 128 / 64 per request.
//!
//! Nothing waits to fill a batch: an operation goes out at once unless
//! `MAX_RUNNING` batches of its kind are in flight, in which case it joins
//! the next one. One task releasing locks one by one sends them one by one;
//! 10 000 locks renewing every few seconds, or released all at once (a
//! dropped client), cost a few requests a second instead of thousands.

use std::{
    collections::HashSet,
    sync::{Arc, Mutex},
};

use etcd_client::{Txn, TxnOp, TxnOpResponse};
use fenced_api::{Error, Result};
use tokio::sync::oneshot;

use crate::{client::Etcd, error};

/// Most gets etcd accepts in one transaction (`--max-txn-ops`, default 128).
const MAX_READS: usize = 128;
/// Nested transactions per batch: etcd 3.4 refused 128 with the default
/// `--max-txn-ops` (127 passed); half leaves room.
const MAX_WRITES: usize = 64;
/// Batches of one kind in flight at once.
const MAX_RUNNING: usize = 2;

/// Reads or writes: never mixed (a read-only transaction skips raft).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    Reads,
    Writes,
}

type Reply = std::result::Result<TxnOpResponse, String>;

struct Pending {
    /// The key the operation touches: one operation per key and batch
    /// (etcd refuses a transaction that writes a key twice).
    key: Vec<u8>,
    op: TxnOp,
    tx: oneshot::Sender<Reply>,
}

#[derive(Default)]
struct Queue {
    waiting: Vec<Pending>,
    running: usize,
}

/// One queue per kind, and the transport the batches go out on.
pub(crate) struct Batches {
    etcd: Etcd,
    reads: Mutex<Queue>,
    writes: Mutex<Queue>,
}

impl Batches {
    pub(crate) fn new(etcd: Etcd) -> Batches {
        Batches {
            etcd,
            reads: Mutex::default(),
            writes: Mutex::default(),
        }
    }

    fn queue(&self, kind: Kind) -> std::sync::MutexGuard<'_, Queue> {
        let q = match kind {
            Kind::Reads => &self.reads,
            Kind::Writes => &self.writes,
        };
        q.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Batches {
    /// Sends `op` (touching `key`) in the next batch of its kind; returns its answer.
    /// Alone (nothing queued, a batch slot free), it goes out at once from
    /// the caller's task: no hand-over to a batch task on the way.
    pub(crate) async fn batched(
        self: &Arc<Self>,
        kind: Kind,
        key: &[u8],
        op: TxnOp,
    ) -> Result<TxnOpResponse> {
        let alone = {
            let mut q = self.queue(kind);
            let alone = q.waiting.is_empty() && q.running < MAX_RUNNING;
            if alone {
                q.running += 1;
            }
            alone
        };
        if alone {
            let slot = Slot(self, kind, false);
            let sent = self
                .etcd
                .call(what(kind), |mut c| {
                    let txn = Txn::new().and_then([op.clone()]);
                    async move { c.txn(txn).await }
                })
                .await;
            // Others may have queued meanwhile: the slot passes to them.
            drop(slot);
            let resp = sent?;
            return resp
                .op_responses()
                .into_iter()
                .next()
                .ok_or_else(|| Error::backend(error::BACKEND, true, "etcd answered no operation"));
        }
        let (tx, rx) = oneshot::channel();
        self.queue(kind).waiting.push(Pending {
            key: key.to_vec(),
            op,
            tx,
        });
        self.start_runner(kind);
        match rx.await {
            Ok(Ok(r)) => Ok(r),
            Ok(Err(msg)) => Err(Error::backend(error::BACKEND, true, msg)),
            Err(_) => Err(Error::backend(
                error::BACKEND,
                true,
                "the batched request was dropped",
            )),
        }
    }

    /// Starts a batch task if operations wait and a slot is free.
    fn start_runner(self: &Arc<Self>, kind: Kind) {
        let start = {
            let mut q = self.queue(kind);
            let start = !q.waiting.is_empty() && q.running < MAX_RUNNING;
            if start {
                q.running += 1;
            }
            start
        };
        if start {
            tokio::spawn(Arc::clone(self).run(kind));
        }
    }

    /// Sends batches until the queue is empty (holding one slot).
    async fn run(self: Arc<Self>, kind: Kind) {
        let mut slot = Slot(&self, kind, false);
        loop {
            let batch = {
                let mut q = self.queue(kind);
                if q.waiting.is_empty() {
                    q.running -= 1;
                    slot.2 = true;
                    return;
                }
                take_batch(
                    &mut q.waiting,
                    match kind {
                        Kind::Reads => MAX_READS,
                        Kind::Writes => MAX_WRITES,
                    },
                )
            };
            let (ops, txs): (Vec<TxnOp>, Vec<_>) = batch.into_iter().map(|p| (p.op, p.tx)).unzip();
            let txn = Txn::new().and_then(ops);
            let sent = self
                .etcd
                .call(what(kind), |mut c| {
                    let txn = txn.clone();
                    async move { c.txn(txn).await }
                })
                .await;
            match sent {
                Ok(resp) => {
                    let mut answers = resp.op_responses().into_iter();
                    for tx in txs {
                        let reply = answers
                            .next()
                            .ok_or_else(|| "etcd answered fewer operations than sent".to_owned());
                        let _ = tx.send(reply);
                    }
                }
                Err(e) => {
                    let msg = e.to_string();
                    for tx in txs {
                        let _ = tx.send(Err(msg.clone()));
                    }
                }
            }
        }
    }
}

/// The state of a lock key as one batched check saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct KeyState {
    pub(crate) create_revision: i64,
    pub(crate) value: Vec<u8>,
    pub(crate) lease: i64,
}

impl Batches {
    /// The current state of the key at `path` (`None`: absent), read in the
    /// next batch of reads.
    pub(crate) async fn check(self: &Arc<Self>, path: &[u8]) -> Result<Option<KeyState>> {
        let r = self
            .batched(Kind::Reads, path, TxnOp::get(path.to_vec(), None))
            .await?;
        Ok(match r {
            TxnOpResponse::Get(g) => g.kvs().first().map(|kv| KeyState {
                create_revision: kv.create_revision(),
                value: kv.value().to_vec(),
                lease: kv.lease(),
            }),
            _ => None,
        })
    }
}

fn what(kind: Kind) -> &'static str {
    match kind {
        Kind::Reads => "batched reads",
        Kind::Writes => "batched writes",
    }
}

/// A batch slot; given back on drop unless already given back (`.2`), so a
/// cancelled sender never leaks one. Operations that queued up behind it
/// get a batch task.
struct Slot<'a>(&'a Arc<Batches>, Kind, bool);

impl Drop for Slot<'_> {
    fn drop(&mut self) {
        if self.2 {
            return;
        }
        let start = {
            let mut q = self.0.queue(self.1);
            let start = !q.waiting.is_empty();
            if !start {
                q.running -= 1;
            }
            start
        };
        if start {
            // The slot passes to a new batch task.
            match tokio::runtime::Handle::try_current() {
                Ok(rt) => {
                    rt.spawn(Arc::clone(self.0).run(self.1));
                }
                Err(_) => self.0.queue(self.1).running -= 1,
            }
        }
    }
}

/// Up to `max` waiting operations, in order, at most one per key (a second
/// one for a key waits for the next batch).
fn take_batch(waiting: &mut Vec<Pending>, max: usize) -> Vec<Pending> {
    let mut keys = HashSet::new();
    let mut batch = Vec::new();
    let mut rest = Vec::new();
    let mut all = std::mem::take(waiting).into_iter();
    for p in all.by_ref() {
        if keys.insert(p.key.clone()) {
            batch.push(p);
            if batch.len() == max {
                break;
            }
        } else {
            rest.push(p);
        }
    }
    rest.extend(all);
    *waiting = rest;
    batch
}
