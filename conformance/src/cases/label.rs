//! C17: the holder's label, as stored by the backend.

use std::time::Duration;

use fenced_api::{DistributedLock, Error, Label, LockInfo, LockKey, LockOptions, ReleaseOutcome};

use super::{acquire_within, expiry_slack, fresh_key};
use crate::{
    check::{ensure, some, CaseResult, Failure, Outcome},
    Harness,
};

/// A label of exactly [`Label::MAX_LEN`] bytes with what breaks careless
/// storage: spaces, both quotes, SQL wildcards, backslashes, Lua/JSON/glob
/// punctuation and multi-byte characters (a cut inside one is invalid UTF-8).
fn awkward_label() -> Result<Label, Failure> {
    let mut s = String::from("web 1 'o''k' \"q\" 100%_\\% *?[a]{b}:, é ü 日本 😀 --;");
    while s.len() < Label::MAX_LEN {
        s.push(if s.len() % 2 == 0 { '_' } else { '%' });
    }
    ensure!(
        s.len() == Label::MAX_LEN,
        "suite label is {} bytes",
        s.len()
    );
    Ok(Label::new(s)?)
}

/// Fails unless `info` carries exactly `want` as its label.
fn check_label(info: &LockInfo, want: Option<&Label>, how: &str) -> Result<(), Failure> {
    ensure!(
        info.label.as_ref() == want,
        "{how} shows `{}` labelled {:?}, the holder gave {:?}",
        info.key,
        info.label,
        want
    );
    Ok(())
}

/// What `list` shows for `key`, or `None` when the backend cannot list.
async fn listed(
    lock: &std::sync::Arc<dyn DistributedLock>,
    key: &LockKey,
) -> Result<Option<LockInfo>, Failure> {
    match lock.list(100).await {
        Err(Error::Unsupported { .. }) => Ok(None),
        Err(e) => Err(e.into()),
        Ok(all) => Ok(Some(some(
            all.into_iter().find(|i| i.key == *key),
            &format!("`{key}` in list"),
        )?)),
    }
}

/// C17: `inspect` (from another client) and `list` show the label a lease
/// was taken with, byte for byte; a lease taken without one shows `None`,
/// also on a key whose previous holder — released or expired — had one.
pub async fn inspect_shows_the_label(h: &dyn Harness) -> CaseResult {
    let (a, b) = (
        h.client_in_namespace("label").await?,
        h.client_in_namespace("label").await?,
    );
    let label = awkward_label()?;
    let ttl = h.base_ttl() * 10;
    let labelled = LockOptions::builder()
        .ttl(ttl)
        .label(label.as_str())
        .build()?;
    let plain = LockOptions::builder().ttl(ttl).build()?;

    let with = fresh_key("c17label/with");
    let without = fresh_key("c17label/without");
    let lease = some(
        a.try_acquire(&with, &labelled).await?,
        "a lease on a free key",
    )?;
    let other = some(
        a.try_acquire(&without, &plain).await?,
        "a lease on a free key",
    )?;
    for (key, want) in [(&with, Some(&label)), (&without, None)] {
        let info = some(b.inspect(key).await?, "inspect of a held key")?;
        check_label(&info, want, "inspect by another client")?;
        if let Some(info) = listed(&b, key).await? {
            check_label(&info, want, "list by another client")?;
        }
    }

    // Released, then granted without a label: nothing of the old grant shows.
    ensure!(
        a.release(&lease).await? == ReleaseOutcome::Released,
        "release of `{with}`"
    );
    let again = some(
        b.try_acquire(&with, &plain).await?,
        "a lease on a released key",
    )?;
    let info = some(a.inspect(&with).await?, "inspect of a held key")?;
    check_label(&info, None, "inspect after release and a new grant")?;
    if let Some(info) = listed(&a, &with).await? {
        check_label(&info, None, "list after release and a new grant")?;
    }
    b.release(&again).await?;
    a.release(&other).await?;

    // Expired, then taken over without a label: the store overwrites the
    // expired grant in place, label included.
    let short = LockOptions::builder()
        .ttl(h.base_ttl())
        .label(label.as_str())
        .build()?;
    let expired = fresh_key("c17label/expired");
    let first = some(
        a.try_acquire(&expired, &short).await?,
        "a lease on a free key",
    )?;
    let plain_short = LockOptions::builder().ttl(h.base_ttl() * 4).build()?;
    let (next, _) = acquire_within(
        &b,
        &expired,
        &plain_short,
        expiry_slack(first.ttl) + Duration::from_millis(500),
    )
    .await?;
    let info = some(a.inspect(&expired).await?, "inspect of a held key")?;
    check_label(&info, None, "inspect after expiry and a new grant")?;
    if let Some(info) = listed(&a, &expired).await? {
        check_label(&info, None, "list after expiry and a new grant")?;
    }
    b.release(&next).await?;
    Ok(Outcome::Passed)
}
