//! `inspect` and `list`: reading the live rows of one table.

use std::time::Duration;

use fenced_api::{Error, LockInfo, LockKey, Owner, Result};
use fenced_sql::{
    rows::{stored_key, stored_label},
    sql,
    sqlite::NOW_US as NOW,
};
use sqlx::{sqlite::SqliteRow, Row, SqlStr, SqlitePool};

use crate::{
    config::TableName,
    error::{self, SqlResultExt, SqliteBackend},
    unique_key::{token, RESOLUTION_US},
};

/// The scans of one table, built once.
#[derive(Debug)]
pub(crate) struct Scans {
    pool: SqlitePool,
    inspect: SqlStr,
    list: SqlStr,
}

impl Scans {
    pub(crate) fn new(pool: SqlitePool, table: &TableName) -> Self {
        let t = &table.quoted("");
        Scans {
            pool,
            inspect: sql!(
                "SELECT owner, id, reentrant_count, expire_at - ({NOW} + {RESOLUTION_US}), label \
                 FROM {t} WHERE lock_key = ?1 AND expire_at > {NOW}"
            ),
            // The unique index on lock_key gives the order (byte order).
            list: sql!(
                "SELECT owner, id, reentrant_count, expire_at - ({NOW} + {RESOLUTION_US}), label, \
                 lock_key \
                 FROM {t} WHERE expire_at > {NOW} ORDER BY lock_key LIMIT ?1"
            ),
        }
    }

    pub(crate) async fn inspect(&self, key: &LockKey) -> Result<Option<LockInfo>> {
        let row = sqlx::query(self.inspect.clone())
            .bind(key.as_bytes())
            .fetch_optional(&self.pool)
            .await
            .db()?;
        row.map(|r| info_from_row(key, &r)).transpose()
    }

    pub(crate) async fn list(&self, limit: usize) -> Result<Vec<LockInfo>> {
        let rows = sqlx::query(self.list.clone())
            .bind(i64::try_from(limit).unwrap_or(i64::MAX))
            .fetch_all(&self.pool)
            .await
            .db()?;
        let mut held = Vec::with_capacity(rows.len());
        for row in &rows {
            let raw: Vec<u8> = row.try_get(5).db()?;
            let key = stored_key::<SqliteBackend>(&raw)?;
            held.push(info_from_row(&key, row)?);
        }
        Ok(held)
    }
}

pub(crate) fn info_from_row(key: &LockKey, row: &SqliteRow) -> Result<LockInfo> {
    let owner: Vec<u8> = row.try_get(0).db()?;
    let id: i64 = row.try_get(1).db()?;
    let count: i64 = row.try_get(2).db()?;
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
        token(id),
        Duration::from_micros(u64::try_from(remaining_us).unwrap_or(0)),
        u32::try_from(count).unwrap_or(u32::MAX),
    )
    .with_label(label.and_then(|l| stored_label(key, l.as_bytes()))))
}
