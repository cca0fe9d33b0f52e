//! quickstart, swap_by_config, cron_job.

use std::{
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc,
    },
    time::Duration,
};

use fenced::{LockClient, WaitPolicy};

use crate::BoxError;

/// Takes a lock on the store named by `url` (use [`fenced::default_url`] for
/// the embedded SQLite file), runs a tiny job under it, and returns the job's
/// fencing token.
///
/// # Errors
///
/// Whatever connecting or locking fails with.
pub async fn quickstart(url: &str) -> Result<u64, BoxError> {
    let store = fenced::connect(url).await?;
    let client = LockClient::builder(store)
        .ttl(Duration::from_secs(10))
        .wait(WaitPolicy::Timeout(Duration::from_secs(10)))
        .build()?;
    let token = client
        .with_lock("quickstart", |lease| async move {
            // The protected work: pass the token along with every write.
            lease.token().get()
        })
        .await?;
    Ok(token)
}

/// The same code for every store: `workers` independent clients (one
/// connection each, like separate nodes) each run a job `rounds` times under
/// one key. Returns the tokens in the order the jobs ran; the caller checks
/// they strictly increase. The store comes from configuration only.
///
/// # Errors
///
/// Whatever connecting or locking fails with, or a detected overlap.
pub async fn swap_by_config(
    url: &str,
    workers: usize,
    rounds: usize,
) -> Result<Vec<u64>, BoxError> {
    let inside = Arc::new(AtomicUsize::new(0));
    let tokens = Arc::new(std::sync::Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for _ in 0..workers {
        let client = LockClient::builder(fenced::connect(url).await?)
            .ttl(Duration::from_secs(10))
            .wait(WaitPolicy::Timeout(Duration::from_secs(30)))
            .build()?;
        let (inside, tokens) = (inside.clone(), tokens.clone());
        tasks.push(tokio::spawn(async move {
            for _ in 0..rounds {
                let (inside, tokens) = (inside.clone(), tokens.clone());
                client
                    .with_lock("nightly-report", |lease| async move {
                        if inside.fetch_add(1, Ordering::SeqCst) != 0 {
                            return Err("two workers ran the job at once");
                        }
                        tokens
                            .lock()
                            .unwrap_or_else(|p| p.into_inner())
                            .push(lease.token().get());
                        tokio::time::sleep(Duration::from_millis(5)).await;
                        inside.fetch_sub(1, Ordering::SeqCst);
                        Ok(())
                    })
                    .await??;
            }
            Ok::<(), BoxError>(())
        }));
    }
    for t in tasks {
        t.await??;
    }
    let tokens = tokens.lock().unwrap_or_else(|p| p.into_inner()).clone();
    Ok(tokens)
}

/// A cron job deployed on `workers` nodes: at every tick each node tries
/// the lock once, without waiting; the one that gets it runs the job, the
/// others skip the tick. Returns how many nodes ran the job at each tick
/// (always 1: none skip when the lock is free, exactly one wins).
///
/// # Errors
///
/// Whatever connecting or locking fails with.
pub async fn cron_job(url: &str, workers: usize, ticks: usize) -> Result<Vec<usize>, BoxError> {
    let mut nodes = Vec::new();
    for _ in 0..workers {
        nodes.push(
            LockClient::builder(fenced::connect(url).await?)
                .ttl(Duration::from_secs(10))
                .wait(WaitPolicy::NoWait)
                .build()?,
        );
    }
    let key = format!("cron:report:{}", uuid::Uuid::new_v4().simple());
    let mut ran = Vec::new();
    for _ in 0..ticks {
        let runs = Arc::new(AtomicUsize::new(0));
        let barrier = Arc::new(tokio::sync::Barrier::new(workers));
        let mut tasks = Vec::new();
        for node in &nodes {
            let (node, runs, barrier, key) =
                (node.clone(), runs.clone(), barrier.clone(), key.clone());
            tasks.push(tokio::spawn(async move {
                barrier.wait().await; // the tick fires on every node at once
                if let Some(guard) = node.try_acquire(key.as_str()).await? {
                    runs.fetch_add(1, Ordering::SeqCst);
                    // The job outlasts everyone else's attempt.
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    guard.release().await?;
                }
                Ok::<(), fenced::Error>(())
            }));
        }
        for t in tasks {
            t.await??;
        }
        ran.push(runs.load(Ordering::SeqCst));
    }
    Ok(ran)
}
