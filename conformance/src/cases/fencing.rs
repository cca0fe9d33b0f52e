//! C7 and C10: fencing tokens and mutual exclusion under contention.

use std::{
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc,
    },
    time::Duration,
};

use fenced_api::{DistributedLock, FencingToken, LockOptions};

use super::{acquire_within, expiry_slack, fresh_key, one_of_two_holds, rises, ttl_opts};
use crate::{
    check::{ensure, fail, some, CaseResult, Failure, Outcome},
    history::{check_exclusive, History, Op, Phase},
    Harness,
};

/// C7: tokens strictly increase across release → acquire, from many clients.
pub async fn tokens_increase_after_release(h: &dyn Harness) -> CaseResult {
    let key = fresh_key("c07r");
    let opts = ttl_opts(h.base_ttl() * 10)?;
    let mut last = FencingToken::new(0);
    for round in 0..6 {
        let lock = h.client().await?;
        let lease = some(lock.try_acquire(&key, &opts).await?, "a released key")?;
        ensure!(
            lease.token > last,
            "round {round}: token {} after {}",
            lease.token,
            last
        );
        last = lease.token;
        lock.release(&lease).await?;
    }
    Ok(Outcome::Passed)
}

/// C7: the token of a takeover after expiry is larger than the expired one.
pub async fn tokens_increase_after_expiry(h: &dyn Harness) -> CaseResult {
    let (a, b, key, opts, first) = one_of_two_holds(h, "c07e", h.base_ttl()).await?;
    let (second, _) = acquire_within(&b, &key, &opts, expiry_slack(first.ttl)).await?;
    rises(second.token, first.token, "after expired")?;
    let (third, _) = acquire_within(&a, &key, &opts, expiry_slack(second.ttl)).await?;
    rises(third.token, second.token, "after expired")?;
    a.release(&third).await?;
    Ok(Outcome::Passed)
}

/// C7: force-release, then acquire: the token still increases.
pub async fn tokens_increase_after_force_release(h: &dyn Harness) -> CaseResult {
    let (_a, admin, key, opts, first) = one_of_two_holds(h, "c07f", h.base_ttl() * 10).await?;
    ensure!(
        admin.force_release(&key).await?,
        "force_release reported nothing removed"
    );
    ensure!(
        !admin.force_release(&key).await?,
        "a second force_release removed something"
    );
    let second = some(
        admin.try_acquire(&key, &opts).await?,
        "a force-released key",
    )?;
    rises(second.token, first.token, "after force-released")?;
    admin.release(&second).await?;
    Ok(Outcome::Passed)
}

/// C7: on a durable store, a held lock and the token counter survive a
/// restart of the store (a private one, never the shared test server).
pub async fn tokens_increase_after_restart(h: &dyn Harness) -> CaseResult {
    if !h.client().await?.capabilities().is_durable() {
        return Ok(Outcome::Skipped(
            "the backend declares no durability across restarts".into(),
        ));
    }
    let Some(private) = h.private_store().await else {
        fail!("the backend declares durability, but its harness offers no private store to restart and prove it");
    };
    let p = private?;
    let a = p.client().await?;
    let key = fresh_key("c07d");
    let opts = ttl_opts(p.base_ttl() * 60)?;
    let before = some(a.try_acquire(&key, &opts).await?, "a free key")?;
    let Some(restarted) = p.restart_store().await else {
        fail!("the private store cannot be restarted");
    };
    restarted?;
    let b = p.client().await?;
    let info = some(b.inspect(&key).await?, "the lock held before the restart")?;
    ensure!(
        info.token == before.token,
        "the held lock changed across the restart: {info:?}"
    );
    ensure!(
        b.try_acquire(&key, &opts).await?.is_none(),
        "the lock held before the restart could be taken after it"
    );
    ensure!(b.force_release(&key).await?, "force release after restart");
    let after = some(b.try_acquire(&key, &opts).await?, "the key after restart")?;
    rises(after.token, before.token, "after restart")?;
    b.release(&after).await?;
    Ok(Outcome::Passed)
}

/// C10: N independent clients × M rounds on one key. An in-process holder
/// count never exceeds 1, every round completes, and the recorded history
/// has no overlapping holds and strictly increasing tokens.
pub async fn mutual_exclusion_under_contention(h: &dyn Harness) -> CaseResult {
    const CLIENTS: usize = 8;
    const ROUNDS: usize = 10;
    let key = fresh_key("c10");
    let opts = LockOptions::builder()
        .ttl(h.base_ttl() * 10)
        .wait_timeout(h.base_ttl() * 60)
        .build()?;
    let inside = Arc::new(AtomicUsize::new(0));
    let max_inside = Arc::new(AtomicUsize::new(0));
    let done = Arc::new(AtomicUsize::new(0));
    let history = History::new();
    let mut tasks = Vec::new();
    for client in 0..CLIENTS {
        let lock = h.client().await?;
        let (key, opts, history) = (key.clone(), opts.clone(), history.clone());
        let (inside, max_inside, done) = (inside.clone(), max_inside.clone(), done.clone());
        tasks.push(tokio::spawn(async move {
            for _ in 0..ROUNDS {
                history.record(client, Op::Acquire, Phase::Invoke, &key, None);
                let lease = lock.acquire(&key, &opts).await.map_err(Failure::from)?;
                history.record(client, Op::Acquire, Phase::Ok, &key, Some(lease.token));
                let now = inside.fetch_add(1, Ordering::SeqCst) + 1;
                max_inside.fetch_max(now, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(2)).await;
                inside.fetch_sub(1, Ordering::SeqCst);
                history.record(client, Op::Release, Phase::Invoke, &key, Some(lease.token));
                let outcome = lock.release(&lease).await.map_err(Failure::from)?;
                if outcome != fenced_api::ReleaseOutcome::Released {
                    return Err(Failure(format!(
                        "client {client} released with {outcome:?}"
                    )));
                }
                done.fetch_add(1, Ordering::SeqCst);
            }
            Ok::<(), Failure>(())
        }));
    }
    for t in tasks {
        t.await
            .map_err(|e| Failure(format!("client task panicked: {e}")))??;
    }
    let max = max_inside.load(Ordering::SeqCst);
    ensure!(
        max == 1,
        "{max} clients were inside the critical section at once"
    );
    let total = done.load(Ordering::SeqCst);
    ensure!(
        total == CLIENTS * ROUNDS,
        "{total} of {} rounds completed",
        CLIENTS * ROUNDS
    );
    let summary = check_exclusive(&history.records()).map_err(Failure)?;
    ensure!(
        summary.holds == CLIENTS * ROUNDS,
        "history holds {} holds",
        summary.holds
    );
    Ok(Outcome::Passed)
}
