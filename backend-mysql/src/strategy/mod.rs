//! The three strategies, each a `DistributedLock` over the shared pool.

use std::time::Duration;

use fenced_api::{FencingToken, Label, LockInfo, LockKey, Owner, Result};
use sqlx::{mysql::MySqlRow, Row};

use crate::error::{self, SqlResultExt};

pub(crate) mod optimistic;
pub(crate) mod row_lock;
pub(crate) mod unique_key;

/// A TTL as whole microseconds, for `UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND`.
/// TTLs are validated (≤ 24 h), so this cannot overflow.
pub(crate) fn micros(ttl: Duration) -> u64 {
    ttl.as_micros().min(u128::from(u64::MAX)) as u64
}

/// Builds a `LockInfo` from a row `(owner, token, hold_count, remaining_us,
/// label)`.
pub(crate) fn info_from_row(key: &LockKey, row: &MySqlRow) -> Result<LockInfo> {
    let owner: Vec<u8> = row.try_get(0).db()?;
    let token: u64 = row.try_get(1).db()?;
    let count: u32 = row.try_get(2).db()?;
    let remaining_us: i64 = row.try_get(3).db()?;
    let label: Option<Vec<u8>> = row.try_get(4).db()?;
    let owner = Owner::new(String::from_utf8_lossy(&owner)).unwrap_or_else(|_| Owner::random());
    Ok(LockInfo::new(
        key.clone(),
        owner,
        FencingToken::new(token),
        Duration::from_micros(remaining_us.max(0) as u64),
        count,
    )
    .with_label(label.and_then(|l| stored_label(key, &l))))
}

/// A label column's value. One that is no valid label (edited by hand) is
/// shown as none rather than failing `inspect`: it is for people, not for
/// the lock.
pub(crate) fn stored_label(key: &LockKey, raw: &[u8]) -> Option<Label> {
    std::str::from_utf8(raw)
        .map_err(|e| fenced_api::Error::config(e.to_string()))
        .and_then(Label::new)
        .inspect_err(|e| tracing::warn!(key = %key, error = %e, "ignoring an invalid stored label"))
        .ok()
}

/// The label to store for an acquisition: NULL without one.
pub(crate) fn label_param(opts: &fenced_api::LockOptions) -> Option<&[u8]> {
    opts.label().map(|l| l.as_str().as_bytes())
}

/// Builds the `LockInfo`s of a listing: rows `(owner, token, hold_count,
/// remaining_us, label, lock_key)`. A `lock_key` that is no valid key (the table was
/// edited by hand) is an error naming it, never a panic.
pub(crate) fn infos_from_rows(rows: &[MySqlRow]) -> Result<Vec<LockInfo>> {
    let mut held = Vec::with_capacity(rows.len());
    for row in rows {
        let raw: Vec<u8> = row.try_get(5).db()?;
        let key = std::str::from_utf8(&raw)
            .ok()
            .and_then(|k| LockKey::new(k).ok())
            .ok_or_else(|| {
                fenced_api::Error::backend(
                    error::BACKEND,
                    false,
                    format!(
                        "a lock row has an invalid lock_key {:?}; was the table edited by hand?",
                        String::from_utf8_lossy(&raw)
                    ),
                )
            })?;
        held.push(info_from_row(&key, row)?);
    }
    Ok(held)
}

/// A listing's `limit` as a SQL `LIMIT` argument.
pub(crate) fn sql_limit(limit: usize) -> u64 {
    u64::try_from(limit).unwrap_or(u64::MAX)
}

/// How long a release keeps retrying statements that lost a deadlock or a
/// lock wait (it stays within the operation timeout the caller bounds it by).
const CONFLICT_RETRY_FOR: Duration = Duration::from_secs(3);

/// Runs a statement (or transaction) that may lose a deadlock or a lock wait
/// to a concurrent one — concurrent releases of re-entered entries do, and
/// so does a holder's DELETE against contenders whose refused
/// `INSERT … ON DUPLICATE KEY UPDATE` locks the same row — and retries it,
/// with a short jittered pause, for up to 3 s: the loser was rolled back
/// and changed nothing, and a release that gave up would leave the key
/// taken until its TTL.
pub(crate) async fn retry_lock_conflicts<T, F, Fut>(mut op: F) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = std::result::Result<T, sqlx::Error>>,
{
    let start = tokio::time::Instant::now();
    let mut attempt: u64 = 0;
    loop {
        match op().await {
            Err(e) if error::is_lock_conflict(&e) && start.elapsed() < CONFLICT_RETRY_FOR => {
                attempt += 1;
                let bound = attempt.min(10) * 2;
                tokio::time::sleep(Duration::from_micros(500 + fastrand_u64(bound * 1000))).await;
            }
            other => return other.map_err(error::map),
        }
    }
}

/// A cheap pseudo-random number below `n` (jitter only; no crate needed).
fn fastrand_u64(n: u64) -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(n);
    h.finish() % n.max(1)
}
