//! The three strategies, each a `DistributedLock` over the shared pool.

use std::time::Duration;

use fenced_api::{FencingToken, LockInfo, LockKey, Owner, Result};
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

/// Builds a `LockInfo` from a row `(owner, token, hold_count, remaining_us)`.
pub(crate) fn info_from_row(key: &LockKey, row: &MySqlRow) -> Result<LockInfo> {
    let owner: Vec<u8> = row.try_get(0).db()?;
    let token: u64 = row.try_get(1).db()?;
    let count: u32 = row.try_get(2).db()?;
    let remaining_us: i64 = row.try_get(3).db()?;
    let owner = Owner::new(String::from_utf8_lossy(&owner)).unwrap_or_else(|_| Owner::random());
    Ok(LockInfo::new(
        key.clone(),
        owner,
        FencingToken::new(token),
        Duration::from_micros(remaining_us.max(0) as u64),
        count,
    ))
}

/// Runs a statement (or transaction) that may lose a deadlock or a lock wait
/// to a concurrent one — concurrent releases of re-entered entries do — and
/// retries it a few times: the loser was rolled back and changed nothing.
pub(crate) async fn retry_lock_conflicts<T, F, Fut>(mut op: F) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = std::result::Result<T, sqlx::Error>>,
{
    let mut attempt: u64 = 0;
    loop {
        match op().await {
            Err(e) if error::is_lock_conflict(&e) && attempt < 5 => {
                attempt += 1;
                tokio::time::sleep(Duration::from_millis(attempt * 3)).await;
            }
            other => return other.map_err(error::map),
        }
    }
}
