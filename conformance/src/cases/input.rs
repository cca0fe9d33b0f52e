//! C18 and C19: bad input and unreachable stores.

use std::time::Duration;

use fenced_api::{DistributedLock, Error, LockKey, LockOptions};
use tokio::time::Instant;

use super::{fresh_key, ttl_opts};
use crate::{
    check::{ensure, fail, some, CaseResult, Failure, Outcome},
    Harness,
};

/// The awkward-but-legal spellings every backend must keep apart, byte-exact.
fn awkward_suffixes() -> Vec<&'static str> {
    vec![
        "plain",
        "Plain",  // case: no case-insensitive collation
        "plain ", // trailing space: no PAD SPACE comparison
        " plain",
        "it's \"quoted\"",
        "100%",
        "100_",
        "1000", // what `100%` / `100_` would match as LIKE patterns
        r"back\slash",
        r"back\\slash",
        "\u{e9}",   // é, NFC
        "e\u{301}", // é, NFD
        "鍵-ключ-🔒",
        "`; DROP TABLE locks;--",
        "a/b",
        "a:b",
    ]
}

/// C18: keys with quotes, `%`, `_`, `\`, spaces and non-ASCII are accepted,
/// kept byte-exact and never collide — all can be held at once.
pub async fn awkward_keys_distinct_and_exact(h: &dyn Harness) -> CaseResult {
    let (a, b) = (h.client().await?, h.client().await?);
    let base = fresh_key("c18k");
    let opts = ttl_opts(h.base_ttl() * 20)?;
    let mut leases = Vec::new();
    for suffix in awkward_suffixes() {
        let key = LockKey::new(format!("{base}/{suffix}"))?;
        let lease = a.try_acquire(&key, &opts).await?;
        let lease = some(
            lease,
            &format!("a lease on `{key}`, distinct from the keys before it"),
        )?;
        let info = some(b.inspect(&key).await?, &format!("inspect of `{key}`"))?;
        ensure!(
            info.key.as_bytes() == key.as_bytes(),
            "inspect returned key {:?} for {:?}",
            info.key,
            key
        );
        ensure!(
            info.token == lease.token,
            "inspect of `{key}` shows token {}",
            info.token
        );
        leases.push(lease);
    }
    let longest = LockKey::new(format!(
        "{base}/{}",
        "x".repeat(LockKey::MAX_LEN - base.as_bytes().len() - 1)
    ))?;
    ensure!(
        longest.as_bytes().len() == LockKey::MAX_LEN,
        "suite error: key length"
    );
    leases.push(some(
        a.try_acquire(&longest, &opts).await?,
        "a lease on a 255-byte key",
    )?);
    for lease in &leases {
        ensure!(
            b.try_acquire(&lease.key, &opts).await?.is_none(),
            "`{}` was free while held",
            lease.key
        );
    }
    for lease in leases {
        a.release(&lease).await?;
    }
    Ok(Outcome::Passed)
}

/// C18: invalid keys and options are rejected with clear errors before any
/// I/O, and an invalid `extend` changes nothing.
pub async fn bad_input_rejected_and_changes_nothing(h: &dyn Harness) -> CaseResult {
    for bad in [
        String::new(),
        "x".repeat(256),
        "nul\0byte".into(),
        "new\nline".into(),
    ] {
        match LockKey::new(&bad) {
            Err(Error::InvalidKey { .. }) => {}
            other => fail!("LockKey::new({bad:?}) returned {other:?}"),
        }
    }
    for ttl in [Duration::ZERO, Duration::MAX, LockOptions::MAX_TTL * 2] {
        match LockOptions::builder().ttl(ttl).build() {
            Err(Error::InvalidOptions { .. }) => {}
            other => fail!("ttl {ttl:?} gave {other:?}"),
        }
    }
    let a = h.client().await?;
    let key = fresh_key("c18b");
    let opts = ttl_opts(h.base_ttl() * 20)?;
    let lease = some(a.try_acquire(&key, &opts).await?, "a free key")?;
    let before = some(a.inspect(&key).await?, "the held lock")?;
    for ttl in [Duration::ZERO, Duration::MAX, Duration::from_millis(1)] {
        match a.extend(&lease, ttl).await {
            Err(Error::InvalidOptions { .. }) => {}
            other => fail!("extend with ttl {ttl:?} returned {other:?}, expected InvalidOptions"),
        }
    }
    let after = some(
        a.inspect(&key).await?,
        "the held lock after invalid extends",
    )?;
    ensure!(
        after.token == before.token,
        "an invalid extend changed the token"
    );
    ensure!(
        after.remaining_ttl <= before.remaining_ttl + Duration::from_millis(50),
        "an invalid extend changed the expiry ({:?} → {:?})",
        before.remaining_ttl,
        after.remaining_ttl
    );
    a.release(&lease).await?;
    Ok(Outcome::Passed)
}

/// C18: `%` and `_` are literal characters, never patterns.
pub async fn wildcards_are_literal(h: &dyn Harness) -> CaseResult {
    let (a, b) = (h.client().await?, h.client().await?);
    let base = fresh_key("c18w");
    let opts = ttl_opts(h.base_ttl() * 20)?;
    let pct = LockKey::new(format!("{base}/%"))?;
    let under = LockKey::new(format!("{base}/_"))?;
    let l1 = some(a.try_acquire(&pct, &opts).await?, "a lease on `%`")?;
    let l2 = some(a.try_acquire(&under, &opts).await?, "a lease on `_`")?;
    for other in ["x", "xy", ""] {
        let k = LockKey::new(format!("{base}/{other}"))?;
        let l = b.try_acquire(&k, &opts).await?;
        ensure!(l.is_some(), "`{k}` was blocked by a wildcard-looking key");
        if let Some(l) = l {
            ensure!(b.force_release(&k).await?, "force release of `{k}`");
            ensure!(
                b.release(&l).await? == fenced_api::ReleaseOutcome::NotHeld,
                "released twice"
            );
        }
    }
    ensure!(
        b.inspect(&pct).await?.is_some() && b.inspect(&under).await?.is_some(),
        "force release hit a wildcard key"
    );
    a.release(&l1).await?;
    a.release(&l2).await?;
    Ok(Outcome::Passed)
}

/// C19: an unreachable store gives a retryable `Error::Backend` within the
/// connect timeout — no hang, no panic.
pub async fn unreachable_store_fails_fast(h: &dyn Harness) -> CaseResult {
    let bound = h.connect_timeout() + Duration::from_secs(2);
    let start = Instant::now();
    let Some(made) = tokio::time::timeout(bound, h.unreachable_client())
        .await
        .map_err(|_| {
            Failure(format!(
                "creating a client for an unreachable store hung past {bound:?}"
            ))
        })?
    else {
        if h.in_process() {
            return Ok(Outcome::Skipped(
                "the store lives in this process and cannot be unreachable".into(),
            ));
        }
        fail!("the harness offers no client for an unreachable store; implement Harness::unreachable_client");
    };
    let lock = match made {
        Ok(lock) => lock,
        Err(e) => {
            ensure!(
                matches!(
                    e,
                    Error::Backend {
                        retryable: true,
                        ..
                    }
                ),
                "connecting gave {e:?}, expected a retryable Backend error"
            );
            return Ok(Outcome::Passed);
        }
    };
    let key = fresh_key("c19");
    let opts = ttl_opts(h.base_ttl())?
        .to_builder()
        .wait_timeout(Duration::from_secs(3600))
        .build()?;
    let res = tokio::time::timeout(bound, lock.acquire(&key, &opts))
        .await
        .map_err(|_| {
            Failure(format!(
                "acquire on an unreachable store hung past {bound:?}"
            ))
        })?;
    match res {
        Err(Error::Backend { retryable: true, .. }) => {}
        other => fail!("acquire on an unreachable store returned {other:?}, expected a retryable Backend error"),
    }
    ensure!(
        start.elapsed() <= bound,
        "failing took {:?}",
        start.elapsed()
    );
    Ok(Outcome::Passed)
}
