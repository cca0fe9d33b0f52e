//! migrate_mysql_to_redis: the five phases of a live migration.

use std::{sync::Arc, time::Duration};

use fenced::{DistributedLock, DualLock, LockKey, LockOptions, TokenSource, WaitPolicy};

use crate::BoxError;

/// What one phase of the migration saw.
#[derive(Debug, Clone)]
pub struct Phase {
    /// Which nodes ran (e.g. `"2: old + dual(old tokens)"`).
    pub name: &'static str,
    /// The fencing tokens of the phase's holds, in the order they were granted.
    pub tokens: Vec<u64>,
}

/// Moves a lock from MySQL to Redis while two "nodes" keep taking it:
/// old → old + dual → dual (new tokens) → dual + new → new. In every phase
/// the two nodes contend `rounds` times each on one key; an overlap is an
/// error. The tokens of all phases, in order, must strictly increase (the
/// caller checks); Redis tokens start far above MySQL ids, so no seeding is
/// needed for this pair.
///
/// # Errors
///
/// Whatever connecting or locking fails with, or an overlap.
pub async fn migrate_mysql_to_redis(
    mysql_url: &str,
    redis_url: &str,
    rounds: usize,
) -> Result<Vec<Phase>, BoxError> {
    fenced::migrate(mysql_url).await?;
    let old = || fenced::connect(mysql_url);
    let new = || fenced::connect(redis_url);
    async fn dual(
        old: &str,
        new: &str,
        src: TokenSource,
    ) -> Result<Arc<dyn DistributedLock>, BoxError> {
        Ok(Arc::new(
            DualLock::new(fenced::connect(old).await?, fenced::connect(new).await?).tokens(src),
        ))
    }
    let (m, r) = (mysql_url, redis_url);
    type Node = Arc<dyn DistributedLock>;
    let plan: Vec<(&'static str, Node, Node)> = vec![
        ("1: old", old().await?, old().await?),
        (
            "2: old + dual(old tokens)",
            old().await?,
            dual(m, r, TokenSource::Old).await?,
        ),
        (
            "3: dual(new tokens)",
            dual(m, r, TokenSource::New).await?,
            dual(m, r, TokenSource::New).await?,
        ),
        (
            "4: dual(new tokens) + new",
            dual(m, r, TokenSource::New).await?,
            new().await?,
        ),
        ("5: new", new().await?, new().await?),
    ];
    let key = LockKey::new(format!("orders:{}", uuid::Uuid::new_v4().simple()))?;
    let opts = LockOptions::builder()
        .ttl(Duration::from_secs(10))
        .wait(WaitPolicy::Timeout(Duration::from_secs(20)))
        .build()?;
    let inside = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut phases = Vec::new();
    for (name, a, b) in plan {
        let tokens = Arc::new(std::sync::Mutex::new(Vec::new()));
        let mut tasks = Vec::new();
        for node in [a, b] {
            let (key, opts, inside, tokens) =
                (key.clone(), opts.clone(), inside.clone(), tokens.clone());
            tasks.push(tokio::spawn(async move {
                for _ in 0..rounds {
                    let lease = node.acquire(&key, &opts).await?;
                    if inside.fetch_add(1, std::sync::atomic::Ordering::SeqCst) != 0 {
                        return Err::<(), BoxError>("two nodes held the lock at once".into());
                    }
                    tokens
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .push(lease.token.get());
                    tokio::time::sleep(Duration::from_millis(5)).await;
                    inside.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
                    node.release(&lease).await?;
                }
                Ok(())
            }));
        }
        for t in tasks {
            t.await??;
        }
        let tokens = tokens.lock().unwrap_or_else(|p| p.into_inner()).clone();
        phases.push(Phase { name, tokens });
    }
    Ok(phases)
}
