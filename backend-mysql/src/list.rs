//! `inspect` and `list`: the rows every strategy answers them with, read
//! into [`LockInfo`]s.
//!
//! What each strategy scans: `unique_key` and `optimistic` one `SELECT`
//! along their table's primary key (`lock_key`, so in key order) with the
//! remaining TTL computed on the server's clock (`strategy/rows.rs`);
//! `row_lock` the grant descriptions of `<base>_live`, each confirmed by a
//! probe (`strategy/row_lock/list.rs`). All of them return rows of the
//! shape `(owner, token, hold_count, remaining_us, label[, lock_key])`,
//! decoded here.

use std::time::Duration;

use fenced_api::{FencingToken, LockInfo, LockKey, Owner, Result};
use fenced_sql::rows::{stored_key, stored_label};
use sqlx::{mysql::MySqlRow, Row};

use crate::error::{MySqlBackend, SqlResultExt};

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

/// Builds the `LockInfo`s of a listing: rows `(owner, token, hold_count,
/// remaining_us, label, lock_key)`. A `lock_key` that is no valid key (the table was
/// edited by hand) is an error naming it, never a panic.
pub(crate) fn infos_from_rows(rows: &[MySqlRow]) -> Result<Vec<LockInfo>> {
    let mut held = Vec::with_capacity(rows.len());
    for row in rows {
        let raw: Vec<u8> = row.try_get(5).db()?;
        let key = stored_key::<MySqlBackend>(&raw)?;
        held.push(info_from_row(&key, row)?);
    }
    Ok(held)
}

/// A listing's `limit` as a SQL `LIMIT` argument.
pub(crate) fn sql_limit(limit: usize) -> u64 {
    u64::try_from(limit).unwrap_or(u64::MAX)
}
