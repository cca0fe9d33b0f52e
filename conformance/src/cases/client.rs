//! C10, C13 and C14 through `LockClient`: tasks sharing one client, the
//! watchdog, `max_hold`, and loss signals.

use std::{
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc,
    },
    time::Duration,
};

use fenced_api::{DistributedLock, Error, LockClient, LossReason};
use tokio::time::Instant;

use super::{acquire_within, client_and_store, expiry_slack, fresh_key, rises, ttl_opts};
use crate::{
    check::{ensure, fail, CaseResult, Failure, Outcome},
    Harness,
};

/// C10 through one shared `LockClient`: 16 tasks of one process, one
/// client (one store instance) between them — the shape of a server with
/// its client in shared state — contend for one key. Each acquisition is its
/// own holder: every round completes, never two tasks inside at once, tokens
/// rise, and nobody is told `AlreadyHeld`.
pub async fn tasks_sharing_a_client_take_turns(h: &dyn Harness) -> CaseResult {
    const TASKS: usize = 16;
    const ROUNDS: usize = 4;
    let key = fresh_key("c10s");
    let client = LockClient::builder(h.client().await?)
        .ttl(h.base_ttl() * 10)
        .wait(fenced_api::WaitPolicy::Timeout(h.base_ttl() * 60))
        .build()?;
    let inside = Arc::new(AtomicUsize::new(0));
    let most = Arc::new(AtomicUsize::new(0));
    let tokens = Arc::new(std::sync::Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for task in 0..TASKS {
        let (client, key) = (client.clone(), key.clone());
        let (inside, most, tokens) = (inside.clone(), most.clone(), tokens.clone());
        tasks.push(tokio::spawn(async move {
            for round in 0..ROUNDS {
                let guard = client.acquire(&key).await.map_err(|e| {
                    Failure(format!("task {task}, round {round}: acquire returned {e}"))
                })?;
                let now = inside.fetch_add(1, Ordering::SeqCst) + 1;
                most.fetch_max(now, Ordering::SeqCst);
                tokens
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .push(guard.token());
                tokio::time::sleep(Duration::from_millis(2)).await;
                inside.fetch_sub(1, Ordering::SeqCst);
                guard
                    .release()
                    .await
                    .map_err(|e| Failure(format!("task {task}: release returned {e}")))?;
            }
            Ok::<(), Failure>(())
        }));
    }
    for t in tasks {
        t.await
            .map_err(|e| Failure(format!("a task panicked: {e}")))??;
    }
    let most = most.load(Ordering::SeqCst);
    ensure!(most == 1, "{most} tasks of one client held the key at once");
    let tokens = tokens.lock().unwrap_or_else(|p| p.into_inner()).clone();
    ensure!(
        tokens.len() == TASKS * ROUNDS,
        "{} of {} rounds completed",
        tokens.len(),
        TASKS * ROUNDS
    );
    ensure!(
        tokens.windows(2).all(|w| w[0] < w[1]),
        "tokens did not rise from one holder to the next: {tokens:?}"
    );
    Ok(Outcome::Passed)
}

/// C13: the watchdog renews a held lock past several TTLs; contenders fail.
pub async fn watchdog_renews_past_ttl(h: &dyn Harness) -> CaseResult {
    let ttl = h.base_ttl();
    let (key, client, other) = client_and_store(h, "c13", ttl).await?;
    let guard = client.acquire(&key).await?;
    let start = Instant::now();
    let until = start + ttl * 3;
    let opts = ttl_opts(ttl)?;
    while Instant::now() < until {
        if guard.is_lost() {
            // The reason tells a renewal the store refused (a bug) from one
            // that did not come back before the deadline (a slow store).
            let reason = tokio::time::timeout(Duration::ZERO, guard.lost())
                .await
                .map_or_else(|_| "no reason recorded".to_owned(), |r| r.to_string());
            fail!(
                "the guard reported loss while renewing, {:?} into the hold with a {ttl:?} ttl: {reason:?}",
                start.elapsed()
            )
        }
        ensure!(
            other.try_acquire(&key, &opts).await?.is_none(),
            "a contender got a renewed lock"
        );
        tokio::time::sleep(ttl / 4).await;
    }
    ensure!(
        guard.valid_for() > Duration::ZERO,
        "valid_for is zero on a renewed lock"
    );
    guard.release().await?;
    Ok(Outcome::Passed)
}

/// C13: at `max_hold` renewal stops, the guard reports loss, and the key
/// becomes free after the TTL.
pub async fn max_hold_stops_renewal(h: &dyn Harness) -> CaseResult {
    let key = fresh_key("c13m");
    let ttl = h.base_ttl();
    let max_hold = ttl * 2;
    let client = LockClient::builder(h.client().await?)
        .ttl(ttl)
        .max_hold(max_hold)
        .build()?;
    let other = h.client().await?;
    // max_hold counts from the grant, which happens during this call.
    let start = Instant::now();
    let guard = client.acquire(&key).await?;
    let reason = tokio::time::timeout(max_hold + ttl * 2, guard.lost())
        .await
        .map_err(|_| Failure(format!("no loss reported {:?} after max_hold", ttl * 2)))?;
    ensure!(
        reason == LossReason::MaxHoldExceeded,
        "loss reason {reason:?}"
    );
    ensure!(
        start.elapsed() + Duration::from_millis(50) >= max_hold,
        "loss reported before max_hold"
    );
    ensure!(
        guard.valid_for() == Duration::ZERO,
        "valid_for after loss is not zero"
    );
    // The last renewal may have landed just before max_hold, with the
    // granted (possibly rounded-up) TTL on top.
    let granted = guard.handle().lease().ttl;
    let (lease, _) =
        acquire_within(&other, &key, &ttl_opts(ttl)?, expiry_slack(granted) + ttl).await?;
    rises(lease.token, guard.token(), "after max_hold")?;
    other.release(&lease).await?;
    Ok(Outcome::Passed)
}

/// C14: a force-release is noticed at the next renewal: `lost()` resolves
/// and `release` reports `LeaseLost`.
pub async fn loss_signalled_after_force_release(h: &dyn Harness) -> CaseResult {
    let ttl = h.base_ttl() * 2;
    let (key, client, admin) = client_and_store(h, "c14", ttl).await?;
    let guard = client.acquire(&key).await?;
    let token = guard.handle().lost_token();
    ensure!(
        admin.force_release(&key).await?,
        "force_release removed nothing"
    );
    let reason = tokio::time::timeout(ttl * 2, guard.lost())
        .await
        .map_err(|_| Failure("lost() did not resolve after a force release".into()))?;
    ensure!(
        matches!(
            reason,
            LossReason::RenewalRefused | LossReason::DeadlinePassed
        ),
        "loss reason {reason:?}"
    );
    ensure!(
        token.is_cancelled(),
        "the lost CancellationToken was not cancelled"
    );
    match guard.release().await {
        Err(Error::LeaseLost { .. }) => {}
        other => fail!("release of a lost guard returned {other:?}, expected LeaseLost"),
    }
    Ok(Outcome::Passed)
}

/// C14: `with_lock` cancels the work when the lock is lost and returns `LeaseLost`.
pub async fn with_lock_cancels_work_on_loss(h: &dyn Harness) -> CaseResult {
    let ttl = h.base_ttl() * 2;
    let (key, client, admin) = client_and_store(h, "c14w", ttl).await?;
    let (started_tx, started_rx) = tokio::sync::oneshot::channel();
    let work = {
        let key = key.clone();
        async move {
            client
                .with_lock(&key, |_lease| async move {
                    let _ = started_tx.send(());
                    tokio::time::sleep(Duration::from_secs(3600)).await;
                    "finished"
                })
                .await
        }
    };
    let task = tokio::spawn(work);
    started_rx
        .await
        .map_err(|_| Failure("with_lock never started the work".into()))?;
    ensure!(
        admin.force_release(&key).await?,
        "force_release removed nothing"
    );
    let res = tokio::time::timeout(ttl * 3, task)
        .await
        .map_err(|_| Failure("with_lock kept running after the lock was lost".into()))?
        .map_err(|e| Failure(format!("with_lock task panicked: {e}")))?;
    match res {
        Err(Error::LeaseLost { .. }) => Ok(Outcome::Passed),
        other => fail!("with_lock returned {other:?}, expected LeaseLost"),
    }
}
