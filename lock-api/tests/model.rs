//! Model-based test: random interleavings of try_acquire / extend / release /
//! time advance by 3 clients on 2 keys, checked step by step against a small
//! reference model, on `MemoryLock` with tokio's clock paused.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::{collections::HashMap, time::Duration};

use fenced_api::{DistributedLock, Error, Lease, LockKey, LockOptions, MemoryLock, ReleaseOutcome};
use proptest::prelude::*;
use tokio::time::Instant;

const TTL_MS: u64 = 1_000;
const CLIENTS: usize = 3;
const KEYS: usize = 2;

#[derive(Debug, Clone)]
enum Op {
    TryAcquire { client: usize, key: usize },
    Extend { client: usize, key: usize },
    Release { client: usize, key: usize },
    ForceRelease { key: usize },
    Advance { ms: u64 },
}

fn op() -> impl Strategy<Value = Op> {
    let c = 0..CLIENTS;
    let k = 0..KEYS;
    prop_oneof![
        3 => (c.clone(), k.clone()).prop_map(|(client, key)| Op::TryAcquire { client, key }),
        2 => (c.clone(), k.clone()).prop_map(|(client, key)| Op::Extend { client, key }),
        2 => (c, k.clone()).prop_map(|(client, key)| Op::Release { client, key }),
        1 => k.prop_map(|key| Op::ForceRelease { key }),
        // Around the TTL, so expiry races with extend and release.
        3 => prop_oneof![0u64..50, 300u64..700, 950u64..1050, 1500u64..2500]
            .prop_map(|ms| Op::Advance { ms }),
    ]
}

/// The reference model: who holds each key until when, and the last token.
#[derive(Debug, Default)]
struct Model {
    now_ms: u64,
    holder: HashMap<usize, (usize, u64, u64)>, // key -> (client, token, expires_ms)
    last_token: HashMap<usize, u64>,
}

impl Model {
    fn current(&self, key: usize) -> Option<(usize, u64, u64)> {
        self.holder
            .get(&key)
            .copied()
            .filter(|&(_, _, exp)| self.now_ms < exp)
    }
}

fn run(ops: Vec<Op>) -> Result<(), TestCaseError> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .unwrap();
    rt.block_on(async move {
        let store = MemoryLock::new();
        let clients: Vec<MemoryLock> = (0..CLIENTS).map(|_| store.clone()).collect();
        let keys: Vec<LockKey> = (0..KEYS)
            .map(|k| LockKey::new(format!("key-{k}")).unwrap())
            .collect();
        let opts = LockOptions::builder()
            .ttl(Duration::from_millis(TTL_MS))
            .build()
            .unwrap();
        let ttl = opts.ttl();
        let mut model = Model::default();
        let mut leases: HashMap<(usize, usize), Lease> = HashMap::new();
        let start = Instant::now();

        for (step, op) in ops.into_iter().enumerate() {
            model.now_ms = start.elapsed().as_millis() as u64;
            match op {
                Op::TryAcquire { client, key } => {
                    let got = clients[client]
                        .try_acquire(&keys[key], &opts)
                        .await
                        .unwrap();
                    match (model.current(key), got) {
                        (Some(_), None) => {}
                        (None, Some(lease)) => {
                            let last = model.last_token.get(&key).copied().unwrap_or(0);
                            prop_assert!(
                                lease.token.get() > last,
                                "step {step}: token {} after {last}",
                                lease.token
                            );
                            model.last_token.insert(key, lease.token.get());
                            model
                                .holder
                                .insert(key, (client, lease.token.get(), model.now_ms + TTL_MS));
                            leases.insert((client, key), lease);
                        }
                        (expected, got) => prop_assert!(
                            false,
                            "step {step}: model holder {expected:?}, store granted {got:?}"
                        ),
                    }
                }
                Op::Extend { client, key } => {
                    let Some(lease) = leases.get(&(client, key)).cloned() else {
                        continue;
                    };
                    let current = model
                        .current(key)
                        .is_some_and(|(c, t, _)| c == client && t == lease.token.get());
                    match clients[client].extend(&lease, ttl).await {
                        Ok(renewed) => {
                            prop_assert!(
                                current,
                                "step {step}: extend of a non-current lease succeeded"
                            );
                            prop_assert_eq!(renewed.token, lease.token);
                            model
                                .holder
                                .insert(key, (client, lease.token.get(), model.now_ms + TTL_MS));
                            leases.insert((client, key), renewed);
                        }
                        Err(Error::LeaseLost { .. }) => {
                            prop_assert!(!current, "step {step}: current lease refused")
                        }
                        Err(e) => prop_assert!(false, "step {step}: {e}"),
                    }
                }
                Op::Release { client, key } => {
                    let Some(lease) = leases.get(&(client, key)).cloned() else {
                        continue;
                    };
                    let current = model
                        .current(key)
                        .is_some_and(|(c, t, _)| c == client && t == lease.token.get());
                    let out = clients[client].release(&lease).await.unwrap();
                    if current {
                        prop_assert_eq!(out, ReleaseOutcome::Released, "step {}", step);
                        model.holder.remove(&key);
                    } else {
                        prop_assert_eq!(out, ReleaseOutcome::NotHeld, "step {}", step);
                    }
                }
                Op::ForceRelease { key } => {
                    let removed = store.force_release(&keys[key]).await.unwrap();
                    prop_assert_eq!(removed, model.current(key).is_some(), "step {}", step);
                    model.holder.remove(&key);
                }
                Op::Advance { ms } => tokio::time::advance(Duration::from_millis(ms)).await,
            }
            // After every step, inspect agrees with the model on every key.
            model.now_ms = start.elapsed().as_millis() as u64;
            for (k, key) in keys.iter().enumerate() {
                let seen = store.inspect(key).await.unwrap().map(|i| i.token.get());
                let want = model.current(k).map(|(_, t, _)| t);
                prop_assert_eq!(seen, want, "step {}: inspect of key {}", step, k);
            }
        }
        Ok(())
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]
    #[test]
    fn memory_lock_matches_the_model(ops in proptest::collection::vec(op(), 1..60)) {
        run(ops)?;
    }
}
