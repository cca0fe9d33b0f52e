//! C1–C3, C11, C17, C20: the plain acquire / release cycle.

use std::time::Duration;

use fenced_api::{
    DistributedLock, Error, Lease, LockInfo, LockKey, LockOptions, ReleaseOutcome, WaitPolicy,
};
use tokio::time::Instant;

use super::{fresh_key, held_with, one_of_two_holds, ttl_opts};
use crate::{
    check::{ensure, fail, some, CaseResult, Failure, Outcome},
    Harness,
};

/// C1: a free key is granted with a token ≥ 1 and a lease that describes it.
pub async fn free_key_grants_token(h: &dyn Harness) -> CaseResult {
    let lock = h.client().await?;
    let key = fresh_key("c01");
    let opts = ttl_opts(h.base_ttl() * 4)?;
    let sent = Instant::now();
    let lease = some(
        lock.try_acquire(&key, &opts).await?,
        "a lease on a free key",
    )?;
    let returned = Instant::now();
    ensure!(lease.token.get() >= 1, "token {} is below 1", lease.token);
    ensure!(
        lease.key == key,
        "lease names {:?}, expected {:?}",
        lease.key,
        key
    );
    ensure!(
        lease.ttl >= opts.ttl(),
        "effective ttl {:?} is below the requested {:?}",
        lease.ttl,
        opts.ttl()
    );
    // The deadline counts from a send time inside the call — never from
    // after the reply arrived.
    ensure!(
        lease.deadline >= sent + lease.ttl && lease.deadline <= returned + lease.ttl,
        "the lease deadline must be ttl after a send time within the call"
    );
    ensure!(
        lock.release(&lease).await? == ReleaseOutcome::Released,
        "release of a fresh lease"
    );
    Ok(Outcome::Passed)
}

/// C2: a held key is refused at once — `None`, not an error, not a wait.
pub async fn held_key_refused_at_once(h: &dyn Harness) -> CaseResult {
    let (a, b, key, opts, lease) = one_of_two_holds(h, "c02", h.base_ttl() * 10).await?;
    let start = Instant::now();
    let second = b.try_acquire(&key, &opts).await?;
    let took = start.elapsed();
    ensure!(
        second.is_none(),
        "a second holder got {second:?} while the key was held"
    );
    // Generous: catches a sleep-and-retry loop hiding in try_acquire, not slowness.
    ensure!(
        took < Duration::from_secs(2),
        "try_acquire on a held key took {took:?}"
    );
    a.release(&lease).await?;
    Ok(Outcome::Passed)
}

/// C2/C9: `acquire` with `NoWait` on a held key fails with `Timeout` at once.
pub async fn nowait_acquire_times_out_at_once(h: &dyn Harness) -> CaseResult {
    let (a, b, key, opts, lease) = one_of_two_holds(h, "c02n", h.base_ttl() * 10).await?;
    let nowait = opts.to_builder().wait(WaitPolicy::NoWait).build()?;
    let start = Instant::now();
    match b.acquire(&key, &nowait).await {
        Err(Error::Timeout { .. }) => {}
        other => fail!("NoWait acquire on a held key returned {other:?}, expected Timeout"),
    }
    ensure!(
        start.elapsed() < Duration::from_secs(2),
        "NoWait took {:?}",
        start.elapsed()
    );
    a.release(&lease).await?;
    Ok(Outcome::Passed)
}

/// C3: release frees the key; the next acquire succeeds immediately.
pub async fn release_frees_key(h: &dyn Harness) -> CaseResult {
    let (a, b, key, opts, lease) = one_of_two_holds(h, "c03", h.base_ttl() * 10).await?;
    ensure!(
        a.release(&lease).await? == ReleaseOutcome::Released,
        "release by the holder"
    );
    ensure!(
        b.inspect(&key).await?.is_none(),
        "inspect shows a released key as held"
    );
    let next = b.try_acquire(&key, &opts).await?;
    ensure!(next.is_some(), "the key was not free right after release");
    if let Some(l) = next {
        b.release(&l).await?;
    }
    Ok(Outcome::Passed)
}

/// C3/C4: releasing twice is harmless: the second release is `NotHeld`.
pub async fn double_release_is_not_held(h: &dyn Harness) -> CaseResult {
    let (a, b, key, opts, lease) = one_of_two_holds(h, "c03d", h.base_ttl() * 10).await?;
    a.release(&lease).await?;
    let other = some(b.try_acquire(&key, &opts).await?, "the key after release")?;
    let again = a.release(&lease).await?;
    ensure!(
        again == ReleaseOutcome::NotHeld,
        "second release returned {again:?}"
    );
    held_with(
        &*b,
        &key,
        other.token,
        "a repeated release disturbed the next holder",
    )
    .await?;
    b.release(&other).await?;
    Ok(Outcome::Passed)
}

/// C11: different keys never block each other, including near-identical ones.
pub async fn different_keys_independent(h: &dyn Harness) -> CaseResult {
    let (a, b) = (h.client().await?, h.client().await?);
    let base = fresh_key("c11");
    let opts = ttl_opts(h.base_ttl() * 10)?;
    let first = some(a.try_acquire(&base, &opts).await?, "the first key")?;
    let mut held = vec![];
    for suffix in ["/child", "x", "/", "2"] {
        let k = fenced_api::LockKey::new(format!("{base}{suffix}"))?;
        let l = b.try_acquire(&k, &opts).await?;
        ensure!(l.is_some(), "`{k}` was blocked by `{base}`");
        held.extend(l);
    }
    for l in held {
        b.release(&l).await?;
    }
    a.release(&first).await?;
    Ok(Outcome::Passed)
}

/// C17: inspect shows holder, token and remaining TTL; `None` when free.
pub async fn inspect_shows_holder(h: &dyn Harness) -> CaseResult {
    let (a, b) = (h.client().await?, h.client().await?);
    let key = fresh_key("c17");
    ensure!(
        b.inspect(&key).await?.is_none(),
        "inspect of a never-used key is not None"
    );
    let ttl = h.base_ttl() * 10;
    let opts = LockOptions::builder()
        .ttl(ttl)
        .owner(format!("inspector-{}", key.as_str()))
        .build()?;
    let lease = some(a.try_acquire(&key, &opts).await?, "a lease on a free key")?;
    let info = some(b.inspect(&key).await?, "inspect of a held key")?;
    ensure!(info.key == key, "inspect key {:?}", info.key);
    ensure!(
        info.owner == lease.owner,
        "inspect owner {:?}, holder {:?}",
        info.owner,
        lease.owner
    );
    ensure!(
        info.token == lease.token,
        "inspect token {}, holder {}",
        info.token,
        lease.token
    );
    one_live_hold(&info, &lease)?;
    a.release(&lease).await?;
    ensure!(
        b.inspect(&key).await?.is_none(),
        "inspect after release is not None"
    );
    Ok(Outcome::Passed)
}

/// `info` (from `inspect` or `list`) shows one hold with some of the TTL of
/// `lease` left.
fn one_live_hold(info: &LockInfo, lease: &Lease) -> Result<(), Failure> {
    ensure!(info.hold_count == 1, "hold count {}", info.hold_count);
    ensure!(
        info.remaining_ttl > Duration::ZERO && info.remaining_ttl <= lease.ttl,
        "remaining ttl {:?} of `{}` outside (0, {:?}]",
        info.remaining_ttl,
        info.key,
        lease.ttl
    );
    Ok(())
}

/// C17: `list` shows exactly the locks held in the namespace — not the
/// released one, not the expired one — each as `inspect` shows it (owner,
/// token, hold count, remaining TTL), sorted by key, keys byte-exact
/// (glob and tag characters included), at most `limit`. Runs in a
/// namespace of its own, listed from another client than the holder's; a
/// backend that answers `Unsupported` skips.
pub async fn list_shows_held_locks(h: &dyn Harness) -> CaseResult {
    let (a, b, c) = (
        h.client_in_namespace("list").await?,
        h.client_in_namespace("list").await?,
        h.client_in_namespace("list").await?,
    );
    match b.list(10).await {
        Err(Error::Unsupported { backend, what }) => {
            return Ok(Outcome::Skipped(format!(
                "the backend ({backend}) cannot list: {what}"
            )))
        }
        Err(e) => return Err(e.into()),
        Ok(found) => ensure!(
            found.is_empty(),
            "list of a fresh namespace shows {:?}",
            found.iter().map(|i| i.key.as_str()).collect::<Vec<_>>()
        ),
    }
    let id = uuid::Uuid::new_v4().simple().to_string();
    let id = &id[..8];
    let key = |name: &str| LockKey::new(format!("c17l/{id}/{name}"));
    let owned = |ttl: Duration, who: &str| {
        LockOptions::builder()
            .ttl(ttl)
            .owner(format!("lister-{who}-{id}"))
            .build()
    };
    // Expired first, so the waiting eats nothing of the held locks' TTLs;
    // by a third client, which stays alive but never renews.
    let short = h.base_ttl();
    let expired_key = key("expired")?;
    let expired = some(
        c.try_acquire(&expired_key, &owned(short, "expired")?)
            .await?,
        "a lease on a free key",
    )?;
    let bound = Instant::now() + super::expiry_slack(expired.ttl) + short;
    while b.inspect(&expired_key).await?.is_some() {
        ensure!(
            Instant::now() < bound,
            "`{expired_key}` still held {:?} after its ttl",
            super::expiry_slack(expired.ttl) + short
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let long = h.base_ttl() * 10;
    let released_key = key("released")?;
    let released = some(
        a.try_acquire(&released_key, &owned(long, "released")?)
            .await?,
        "a lease on a free key",
    )?;
    ensure!(
        a.release(&released).await? == ReleaseOutcome::Released,
        "release of `{released_key}`"
    );
    let names = ["a*?[x]{y}}:l", "plain", "é 100%_'\\\" \\*"];
    let mut held = Vec::new();
    for (i, name) in names.iter().enumerate() {
        let k = key(name)?;
        let lease = some(
            a.try_acquire(&k, &owned(long, &i.to_string())?).await?,
            "a lease on a free key",
        )?;
        held.push(lease);
    }
    held.sort_by(|x, y| x.key.cmp(&y.key));
    for (who, lister) in [("another client", &b), ("the holder", &a)] {
        let all = lister.list(100).await?;
        let keys: Vec<&str> = all.iter().map(|i| i.key.as_str()).collect();
        let want: Vec<&str> = held.iter().map(|l| l.key.as_str()).collect();
        ensure!(
            keys == want,
            "list by {who} shows {keys:?}, held are {want:?}"
        );
        for (info, lease) in all.iter().zip(&held) {
            ensure!(
                info.owner == lease.owner && info.token == lease.token,
                "list by {who} shows `{}` held by {:?} with token {}, the holder is {:?} with {}",
                info.key,
                info.owner,
                info.token,
                lease.owner,
                lease.token
            );
            one_live_hold(info, lease)?;
        }
    }
    let two = b.list(2).await?;
    ensure!(two.len() == 2, "list(2) returned {} locks", two.len());
    ensure!(two[0].key < two[1].key, "list(2) is not sorted by key");
    for info in &two {
        ensure!(
            held.iter()
                .any(|l| l.key == info.key && l.token == info.token),
            "list(2) shows `{}` with token {}, which is not held so",
            info.key,
            info.token
        );
    }
    ensure!(b.list(0).await?.is_empty(), "list(0) is not empty");
    for lease in &held {
        a.release(lease).await?;
    }
    let left = b.list(10).await?;
    ensure!(
        left.is_empty(),
        "list after releasing everything shows {:?}",
        left.iter().map(|i| i.key.as_str()).collect::<Vec<_>>()
    );
    drop(c);
    Ok(Outcome::Passed)
}

/// C20: two namespaces on one store never see each other's locks.
pub async fn namespaces_isolate(h: &dyn Harness) -> CaseResult {
    let ns1 = h.client_in_namespace("app-one").await?;
    let ns2 = h.client_in_namespace("app-two").await?;
    let ns1_again = h.client_in_namespace("app-one").await?;
    let key = fresh_key("c20");
    let opts = ttl_opts(h.base_ttl() * 10)?;
    let l1 = some(
        ns1.try_acquire(&key, &opts).await?,
        "a lease in namespace one",
    )?;
    let l2 = ns2.try_acquire(&key, &opts).await?;
    ensure!(l2.is_some(), "namespace two was blocked by namespace one");
    ensure!(
        ns1_again.try_acquire(&key, &opts).await?.is_none(),
        "a second client of namespace one did not see its lock"
    );
    ensure!(
        ns2.force_release(&key).await?,
        "force release in namespace two"
    );
    held_with(
        &*ns1_again,
        &key,
        l1.token,
        "force release in namespace two touched namespace one",
    )
    .await?;
    ns1.release(&l1).await?;
    Ok(Outcome::Passed)
}
