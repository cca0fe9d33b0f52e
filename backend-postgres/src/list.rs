//! `inspect` and `list` of the `lease` strategy: the rows of one table
//! whose expiry has not passed on the server's clock.
//!
//! Both read along the primary key (`lock_key`, `BYTEA`: byte order). A
//! listing reads released rows too until the reaper deletes them (a row
//! stays after its release, see `strategy/lease.rs`), so it costs O(rows
//! read), at worst the table, and stops after `limit` held ones. Remaining
//! TTLs are computed on the server's clock, at the time of the read.

use std::time::Duration;

use fenced_api::{Error, LockInfo, LockKey, Owner, Result};
use fenced_sql::{
    rows::{stored_key, stored_label},
    sql,
};
use sqlx::{postgres::PgRow, PgPool, Row, SqlStr};

use crate::{
    config::TableName,
    conn,
    error::{self, PostgresBackend, SqlResultExt},
    strategy::lease::token,
};

/// The remaining TTL of a row in whole microseconds (≥ 0 for a live row).
const REMAINING_US: &str =
    "(EXTRACT(EPOCH FROM (expire_at - clock_timestamp())) * 1000000)::bigint";

/// The scans of one table, built once.
#[derive(Debug)]
pub(crate) struct Scans {
    pool: PgPool,
    inspect: SqlStr,
    list: SqlStr,
}

impl Scans {
    pub(crate) fn new(pool: PgPool, table: &TableName) -> Self {
        let t = &table.quoted("");
        Scans {
            pool,
            inspect: sql!(
                "SELECT owner, token, reentrant_count, {REMAINING_US}, label \
                 FROM {t} WHERE lock_key = $1 AND expire_at > clock_timestamp()"
            ),
            list: sql!(
                "SELECT owner, token, reentrant_count, {REMAINING_US}, label, lock_key \
                 FROM {t} WHERE expire_at > clock_timestamp() ORDER BY lock_key LIMIT $1"
            ),
        }
    }

    /// Runs one statement, on another connection when the pool handed out
    /// a dead one (see [`conn::on_live_connection`]).
    async fn live<T, F, Fut>(&self, op: F) -> std::result::Result<T, sqlx::Error>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = std::result::Result<T, sqlx::Error>>,
    {
        conn::on_live_connection(self.pool.options().get_max_connections(), op).await
    }

    pub(crate) async fn inspect(&self, key: &LockKey) -> Result<Option<LockInfo>> {
        let row = self
            .live(|| {
                sqlx::query(self.inspect.clone())
                    .bind(key.as_bytes())
                    .fetch_optional(&self.pool)
            })
            .await
            .db()?;
        row.map(|r| info_from_row(key, &r)).transpose()
    }

    pub(crate) async fn list(&self, limit: usize) -> Result<Vec<LockInfo>> {
        let rows = self
            .live(|| {
                sqlx::query(self.list.clone())
                    .bind(i64::try_from(limit).unwrap_or(i64::MAX))
                    .fetch_all(&self.pool)
            })
            .await
            .db()?;
        let mut held = Vec::with_capacity(rows.len());
        for row in &rows {
            let raw: Vec<u8> = row.try_get(5).db()?;
            let key = stored_key::<PostgresBackend>(&raw)?;
            held.push(info_from_row(&key, row)?);
        }
        Ok(held)
    }
}

/// A `LockInfo` from a row `(owner, token, reentrant_count, remaining_us,
/// label)`. An owner that is no valid owner (the table was edited by hand)
/// is an error naming the key, never a panic.
pub(crate) fn info_from_row(key: &LockKey, row: &PgRow) -> Result<LockInfo> {
    let owner: Vec<u8> = row.try_get(0).db()?;
    let t: i64 = row.try_get(1).db()?;
    let count: i32 = row.try_get(2).db()?;
    let remaining_us: i64 = row.try_get(3).db()?;
    let label: Option<String> = row.try_get(4).db()?;
    let owner = std::str::from_utf8(&owner)
        .ok()
        .and_then(|o| Owner::new(o).ok())
        .ok_or_else(|| {
            Error::backend(
                error::BACKEND,
                false,
                format!("the row of `{key}` has an invalid owner; was the table edited by hand?"),
            )
        })?;
    Ok(LockInfo::new(
        key.clone(),
        owner,
        token(t),
        Duration::from_micros(u64::try_from(remaining_us).unwrap_or(0)),
        u32::try_from(count).unwrap_or(1).max(1),
    )
    .with_label(label.and_then(|l| stored_label(key, l.as_bytes()))))
}
