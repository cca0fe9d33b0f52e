//! C4 and C12: owner checks and reentrancy.

use std::time::Duration;

use fenced_api::{
    DistributedLock, Error, FencingToken, Lease, LockClient, LockKey, LockOptions, Owner,
    ReleaseOutcome,
};
use tokio::time::Instant;

use super::{acquire_within, expiry_slack, fresh_key, one_of_two_holds, rises, ttl_opts};
use crate::{
    check::{ensure, fail, some, CaseResult, Failure, Outcome},
    Harness,
};

/// C4: after A's lease expired and B took the key, A's release and extend
/// return NotHeld / LeaseLost and leave B's lock alone.
pub async fn stale_lease_never_touches_new_holder(h: &dyn Harness) -> CaseResult {
    let (a, b, c) = (h.client().await?, h.client().await?, h.client().await?);
    let key = fresh_key("c04s");
    let short = ttl_opts(h.base_ttl())?;
    let stale = some(a.try_acquire(&key, &short).await?, "a lease on a free key")?;
    let long = ttl_opts(h.base_ttl() * 20)?;
    let (current, _) = acquire_within(&b, &key, &long, expiry_slack(stale.ttl)).await?;
    rises(
        current.token,
        stale.token,
        "of the takeover over the stale holder",
    )?;

    match a.extend(&stale, h.base_ttl() * 20).await {
        Err(Error::LeaseLost { .. }) => {}
        other => fail!("extend with a stale lease returned {other:?}, expected LeaseLost"),
    }
    let rel = a.release(&stale).await?;
    ensure!(
        rel == ReleaseOutcome::NotHeld,
        "release with a stale lease returned {rel:?}"
    );
    ensure!(
        c.try_acquire(&key, &long).await?.is_none(),
        "a stale release freed the new holder's lock"
    );
    let info = some(c.inspect(&key).await?, "the new holder's lock")?;
    ensure!(
        info.token == current.token && info.owner == current.owner,
        "the new holder changed: {info:?}"
    );
    b.release(&current).await?;
    Ok(Outcome::Passed)
}

/// C4: forged leases — right token with a foreign owner, right owner with a
/// wrong token — can neither release nor extend the holder's lock.
pub async fn forged_lease_rejected(h: &dyn Harness) -> CaseResult {
    let (a, b, key, _opts, lease) = one_of_two_holds(h, "c04f", h.base_ttl() * 20).await?;
    let forgeries = [
        Lease::new(
            key.clone(),
            Owner::random(),
            lease.token,
            lease.ttl,
            Instant::now(),
        ),
        Lease::new(
            key.clone(),
            lease.owner.clone(),
            FencingToken::new(lease.token.get() + 1),
            lease.ttl,
            Instant::now(),
        ),
        Lease::new(
            key.clone(),
            lease.owner.clone(),
            FencingToken::new(lease.token.get() + 1_000_000),
            lease.ttl,
            Instant::now(),
        ),
    ];
    for forged in &forgeries {
        let rel = b.release(forged).await?;
        ensure!(
            rel == ReleaseOutcome::NotHeld,
            "release with forged {forged:?} returned {rel:?}"
        );
        match b.extend(forged, h.base_ttl() * 20).await {
            Err(Error::LeaseLost { .. }) => {}
            other => fail!("extend with forged {forged:?} returned {other:?}"),
        }
    }
    let info = some(b.inspect(&key).await?, "the holder's lock")?;
    ensure!(
        info.token == lease.token && info.owner == lease.owner,
        "holder changed: {info:?}"
    );
    ensure!(
        a.release(&lease).await? == ReleaseOutcome::Released,
        "the real holder's release"
    );
    Ok(Outcome::Passed)
}

/// C4: a release by a non-holder of a *free* key does nothing either.
pub async fn release_of_free_key_is_not_held(h: &dyn Harness) -> CaseResult {
    let a = h.client().await?;
    let key = fresh_key("c04n");
    let ghost = Lease::new(
        key.clone(),
        Owner::random(),
        FencingToken::new(1),
        Duration::from_secs(5),
        Instant::now(),
    );
    ensure!(
        a.release(&ghost).await? == ReleaseOutcome::NotHeld,
        "release of a never-held key"
    );
    match a.extend(&ghost, Duration::from_secs(5)).await {
        Err(Error::LeaseLost { .. }) => {}
        other => fail!("extend of a never-held key returned {other:?}"),
    }
    ensure!(a.inspect(&key).await?.is_none(), "extend created a lock");
    Ok(Outcome::Passed)
}

/// C12: an explicit owner with reentrant options re-enters with a count;
/// only the last release frees the key.
pub async fn reentrant_owner_counts(h: &dyn Harness) -> CaseResult {
    let (a, b) = (h.client().await?, h.client().await?);
    if !a.capabilities().is_reentrant() {
        return Ok(Outcome::Skipped(
            "the backend declares no owner reentrancy".into(),
        ));
    }
    let key = fresh_key("c12r");
    let opts = LockOptions::builder()
        .ttl(h.base_ttl() * 20)
        .owner(format!("reentrant-{}", key.as_str()))
        .reentrant(true)
        .build()?;
    let first = some(a.try_acquire(&key, &opts).await?, "the first entry")?;
    let second = some(a.acquire(&key, &opts).await.map(Some)?, "the second entry")?;
    ensure!(
        second.token == first.token,
        "re-entry changed the token {} → {}",
        first.token,
        second.token
    );
    let info = some(b.inspect(&key).await?, "the held lock")?;
    ensure!(
        info.hold_count == 2,
        "hold count after re-entry is {}",
        info.hold_count
    );
    let r1 = a.release(&second).await?;
    ensure!(
        r1 == ReleaseOutcome::StillHeld { remaining: 1 },
        "first release returned {r1:?}"
    );
    ensure!(
        b.try_acquire(&key, &ttl_opts(h.base_ttl())?)
            .await?
            .is_none(),
        "the key was free after one of two releases"
    );
    let r2 = a.release(&first).await?;
    ensure!(
        r2 == ReleaseOutcome::Released,
        "last release returned {r2:?}"
    );
    ensure!(
        b.inspect(&key).await?.is_none(),
        "the key is still held after the last release"
    );
    Ok(Outcome::Passed)
}

/// C12: the same owner without reentrancy gets `AlreadyHeld` at once — from
/// `try_acquire` and from a waiting `acquire` — instead of waiting on itself.
pub async fn non_reentrant_owner_already_held(h: &dyn Harness) -> CaseResult {
    let a = h.client().await?;
    let key = fresh_key("c12n");
    let opts = LockOptions::builder()
        .ttl(h.base_ttl() * 20)
        .owner(format!("single-{}", key.as_str()))
        .wait_timeout(h.base_ttl() * 10)
        .build()?;
    let lease = some(a.try_acquire(&key, &opts).await?, "the first entry")?;
    match a.try_acquire(&key, &opts).await {
        Err(Error::AlreadyHeld { .. }) => {}
        other => fail!("try_acquire by the holding owner returned {other:?}, expected AlreadyHeld"),
    }
    let start = Instant::now();
    match a.acquire(&key, &opts).await {
        Err(Error::AlreadyHeld { .. }) => {}
        other => fail!("acquire by the holding owner returned {other:?}, expected AlreadyHeld"),
    }
    ensure!(
        start.elapsed() < h.base_ttl() * 5,
        "AlreadyHeld came only after {:?}",
        start.elapsed()
    );
    ensure!(
        a.release(&lease).await? == ReleaseOutcome::Released,
        "the holder's release"
    );
    Ok(Outcome::Passed)
}

/// C12: `LockClient` re-entry is per holder: a reentrant client re-enters
/// a key from the task that acquired it (and from inside its hold's scope),
/// while another task sharing the same client is refused like any other
/// holder; a non-reentrant client tells the holding task `AlreadyHeld` at
/// once, and its other tasks see plain contention.
pub async fn client_reentrancy(h: &dyn Harness) -> CaseResult {
    let key = fresh_key("c12c");
    let ttl = h.base_ttl() * 10;
    let reentrant = LockClient::builder(h.client().await?)
        .ttl(ttl)
        .reentrant(true)
        .build()?;
    let plain = LockClient::builder(h.client().await?).ttl(ttl).build()?;
    let g1 = reentrant.acquire(&key).await?;
    let g2 = reentrant.acquire(&key).await?;
    ensure!(g1.token() == g2.token(), "re-entry changed the token");
    let g2s = g1.scope(reentrant.acquire(&key)).await?;
    ensure!(
        g2s.token() == g1.token(),
        "re-entry inside the hold's scope changed the token"
    );
    g2s.release().await?;
    ensure!(
        plain.try_acquire(&key).await?.is_none(),
        "another client got a held key"
    );
    ensure!(
        other_task_try(&reentrant, &key).await?.is_none(),
        "another task sharing the reentrant client entered the key it holds"
    );
    g2.release().await?;
    ensure!(
        plain.try_acquire(&key).await?.is_none(),
        "the key was free after one of two releases"
    );
    g1.release().await?;
    let g3 = some(
        plain.try_acquire(&key).await?,
        "the key after both releases",
    )?;
    match plain.try_acquire(&key).await {
        Err(Error::AlreadyHeld { .. }) => {}
        other => {
            fail!("the holding task asking again returned {other:?}, expected AlreadyHeld")
        }
    }
    ensure!(
        other_task_try(&plain, &key).await?.is_none(),
        "another task sharing the client got the key it holds"
    );
    g3.release().await?;
    ensure!(
        other_task_try(&plain, &key).await?.is_some(),
        "another task of the client could not take the released key"
    );
    Ok(Outcome::Passed)
}

/// `try_acquire` of `key` from a task of its own, through `client`; the
/// guard it may get is released before this returns. `Ok(Some(()))` when
/// that task got the key.
async fn other_task_try(client: &LockClient, key: &LockKey) -> Result<Option<()>, Failure> {
    let (client, key) = (client.clone(), key.clone());
    tokio::spawn(async move {
        match client.try_acquire(&key).await? {
            Some(guard) => {
                guard.release().await?;
                Ok(Some(()))
            }
            None => Ok(None),
        }
    })
    .await
    .map_err(|e| Failure(format!("the other task panicked: {e}")))?
    .map_err(|e: Error| Failure(format!("the other task's try_acquire failed: {e}")))
}
