//! The lock family: a semaphore, a reader-writer lock, a multi-lock and
//! leader election, on one store.

use std::{
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc,
    },
    time::Duration,
};

use fenced::{Label, LockClient, WaitPolicy};
use futures_util::StreamExt;

use crate::BoxError;

/// What [`family`] saw.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FamilyReport {
    /// The most jobs that held a permit of the semaphore at once.
    pub most_at_once: usize,
    /// The semaphore's permits.
    pub permits: u32,
    /// Whether every writer's token was above every reader's before it.
    pub writers_fenced: bool,
    /// The members' tokens of the multi-lock.
    pub transfer_tokens: Vec<u64>,
    /// The leaders the observer saw, in order (their labels).
    pub leaders_seen: Vec<String>,
}

/// Runs each member of the family once on the store named by `url`.
///
/// # Errors
///
/// Whatever connecting or locking fails with.
pub async fn family(url: &str) -> Result<FamilyReport, BoxError> {
    let store = fenced::connect(url).await?;
    let client = LockClient::builder(store)
        .ttl(Duration::from_secs(10))
        .wait(WaitPolicy::Timeout(Duration::from_secs(30)))
        .build()?;
    let run = uuid::Uuid::new_v4().simple().to_string();

    // Semaphore: six jobs, at most two at once.
    let permits = 2;
    let pool = client.semaphore(format!("family/{run}/gpu"), permits)?;
    let (inside, most) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let jobs: Vec<_> = (0..6)
        .map(|_| {
            let (pool, inside, most) = (pool.clone(), Arc::clone(&inside), Arc::clone(&most));
            tokio::spawn(async move {
                let permit = pool.acquire().await?;
                let now = inside.fetch_add(1, Ordering::SeqCst) + 1;
                most.fetch_max(now, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(50)).await;
                inside.fetch_sub(1, Ordering::SeqCst);
                permit.release().await
            })
        })
        .collect();
    for job in jobs {
        job.await??;
    }

    // Reader-writer lock: readers together, then a writer whose token is
    // above every reader's (a resource that saw the readers accepts it).
    let config = client.rw_lock(format!("family/{run}/config"))?;
    let readers: Vec<_> = (0..3)
        .map(|_| {
            let config = config.clone();
            tokio::spawn(async move {
                let reader = config.read().await?;
                let token = reader.token();
                tokio::time::sleep(Duration::from_millis(30)).await;
                reader.release().await?;
                Ok::<_, fenced::Error>(token)
            })
        })
        .collect();
    let mut highest_read = None;
    for r in readers {
        highest_read = highest_read.max(Some(r.await??));
    }
    let writer = config.write().await?;
    let writers_fenced = highest_read.is_some_and(|r| writer.token() > r);
    writer.release().await?;

    // Multi-lock: both accounts or neither, in any order, deadlock-free.
    let (from, to) = (
        format!("family/{run}/acct:7"),
        format!("family/{run}/acct:3"),
    );
    let both = client.acquire_all([from, to]).await?;
    let transfer_tokens = both.tokens().into_iter().map(|(_, t)| t.get()).collect();
    both.release().await?;

    // Leader election: an observer sees node-a, then node-b after a resigns.
    let key = format!("family/{run}/leader");
    let observer = client
        .election(key.as_str())?
        .observe_every(Duration::from_millis(20));
    let mut changes = observer.observe();
    let mut leaders_seen = Vec::new();
    for node in ["node-a", "node-b"] {
        let leadership = client
            .with_label(Label::new(node)?)
            .election(key.as_str())?
            .campaign()
            .await?;
        while let Some(seen) = tokio::time::timeout(Duration::from_secs(10), changes.next()).await?
        {
            if let Some(leader) = seen? {
                if leader.term == leadership.term() {
                    leaders_seen.extend(leader.label.map(|l| l.as_str().to_owned()));
                    break;
                }
            }
        }
        leadership.resign().await?;
    }

    Ok(FamilyReport {
        most_at_once: most.load(Ordering::SeqCst),
        permits,
        writers_fenced,
        transfer_tokens,
        leaders_seen,
    })
}
