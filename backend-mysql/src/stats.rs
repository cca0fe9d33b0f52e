//! Table growth metrics for every strategy: row counts of the strategy's
//! tables, published as `metrics` gauges and logged with `tracing`.

use std::fmt;

use fenced_api::{DistributedLock, Result};
use sqlx::{Row, SqlStr};

use crate::config::{Strategy, TableName};
use crate::error::SqlResultExt;
use crate::lock::MySqlLock;
use crate::sql::sql;
use crate::strategy::row_lock::LIFETIME_KEY;

/// Gauge: rows in one of the lock store's tables (labels `backend`, e.g.
/// `mysql/unique_key`, and `table`). Set by every reaper pass and by
/// [`MySqlLock::record_table_stats`].
pub const METRIC_TABLE_ROWS: &str = "fenced_table_rows";
/// Gauge: of those rows, the ones whose lease has expired (same labels).
pub const METRIC_TABLE_EXPIRED_ROWS: &str = "fenced_table_expired_rows";
/// Counter: expired `unique_key` rows deleted by the reaper (same labels).
pub const METRIC_REAPED_ROWS: &str = "fenced_reaped_rows_total";

/// Expired `unique_key` rows from which a pass warns: that many dead rows
/// mean releases are being skipped (or the reaper is not running). Held
/// keys never count here, only dead ones.
const EXPIRED_WARN: u64 = 10_000;

/// Row counts of the tables a strategy uses, for monitoring growth (a
/// table that keeps growing means releases are being skipped, or keys are
/// made up per request).
///
/// What grows, per strategy:
///
/// | strategy | main table ([`rows`](Self::rows)) | grows with | [`expired`](Self::expired) counts | other tables |
/// |---|---|---|---|---|
/// | `unique_key` | `<base>` | held keys (a release deletes the row) | rows past `expire_time`, waiting for takeover or the reaper | — |
/// | `optimistic` | `<base>_optimistic` | distinct keys ever locked (rows are kept: the version is the token) | rows whose holder's lease ran out without a release | — |
/// | `row_lock` | `<base>_rows` | distinct keys ever locked (or shards, or fixed ids) | 0 (lock rows never expire) | `<base>_live` (the latest grant per key; expired descriptions are pruned by later grants), `<base>_fence` (the lifetime epoch) |
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct TableStats {
    /// The strategy whose tables were counted.
    pub strategy: Strategy,
    /// Rows in the strategy's main table (see the table above).
    pub rows: u64,
    /// Of those, rows whose lease has expired.
    pub expired: u64,
    /// Every table of the strategy, the main one first.
    pub tables: Vec<TableRows>,
}

/// Row counts of one table.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct TableRows {
    /// The table's name in the database.
    pub table: String,
    /// All rows (`row_lock`'s `<base>_live` without its bookkeeping row).
    pub rows: u64,
    /// Rows whose lease has expired (0 for tables without an expiry).
    pub expired: u64,
}

impl fmt::Display for TableStats {
    /// One line, e.g. `unique_key: fenced_locks 12 rows (3 expired)`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:", self.strategy)?;
        for (i, t) in self.tables.iter().enumerate() {
            let sep = if i == 0 { " " } else { ", " };
            write!(
                f,
                "{sep}{} {} rows ({} expired)",
                t.table, t.rows, t.expired
            )?;
        }
        Ok(())
    }
}

/// One statement per strategy: `(rows, expired)` of each table, in order,
/// as scalar subqueries — one round trip however many tables.
fn count_sql(strategy: Strategy, base: &TableName) -> (Vec<String>, SqlStr) {
    let now = "UTC_TIMESTAMP(6)";
    let pair = |t: &str, expired: &str, filter: &str| {
        format!(
            "(SELECT COUNT(*) FROM {t}{filter}), \
             (SELECT CAST(COALESCE(SUM({expired}), 0) AS SIGNED) FROM {t}{filter})"
        )
    };
    match strategy {
        Strategy::UniqueKey => {
            let t = base.quoted("");
            (
                vec![base.as_str().to_owned()],
                sql!("SELECT {}", pair(&t, &format!("expire_time <= {now}"), "")),
            )
        }
        Strategy::Optimistic => {
            let t = base.quoted("_optimistic");
            (
                vec![format!("{base}_optimistic")],
                sql!(
                    "SELECT {}",
                    pair(
                        &t,
                        &format!("holder IS NOT NULL AND expire_time <= {now}"),
                        ""
                    )
                ),
            )
        }
        Strategy::RowLock => {
            let (rows, live, fence) = (
                base.quoted("_rows"),
                base.quoted("_live"),
                base.quoted("_fence"),
            );
            (
                vec![
                    format!("{base}_rows"),
                    format!("{base}_live"),
                    format!("{base}_fence"),
                ],
                sql!(
                    "SELECT {}, {}, {}",
                    pair(&rows, "0", ""),
                    // The lifetime row is bookkeeping, not a key (bound twice).
                    pair(
                        &live,
                        &format!("expire_time <= {now}"),
                        " WHERE lock_key <> ?"
                    ),
                    pair(&fence, "0", "")
                ),
            )
        }
    }
}

impl MySqlLock {
    /// Row counts of this strategy's tables (every strategy; see
    /// [`TableStats`] for what each count means). One statement.
    ///
    /// For a `fenced status` style report this is the call to make:
    /// `MySqlLock::connect(url).await?.table_stats().await?` — its
    /// `Display` is one line per store.
    ///
    /// Cost: a `COUNT(*)` over each table, i.e. a scan of its smallest
    /// index. Cheap for `unique_key` (held keys only); for `optimistic` and
    /// `row_lock` tables with millions of distinct keys, call it minutes
    /// apart, not seconds.
    ///
    /// # Errors
    ///
    /// [`Error::Backend`](fenced_api::Error::Backend) when the server fails
    /// or does not answer within the operation timeout.
    pub async fn table_stats(&self) -> Result<TableStats> {
        self.bounded("table_stats", self.count_tables()).await
    }

    async fn count_tables(&self) -> Result<TableStats> {
        let strategy = self.config().strategy();
        let (names, text) = count_sql(strategy, self.config().table());
        let mut query = sqlx::query(text);
        if strategy == Strategy::RowLock {
            query = query.bind(LIFETIME_KEY).bind(LIFETIME_KEY);
        }
        let row = self.fetch_one(query).await?;
        let mut tables = Vec::with_capacity(names.len());
        for (i, table) in names.into_iter().enumerate() {
            let rows: i64 = row.try_get(2 * i).db()?;
            let expired: i64 = row.try_get(2 * i + 1).db()?;
            tables.push(TableRows {
                table,
                rows: rows.max(0) as u64,
                expired: expired.max(0) as u64,
            });
        }
        let (rows, expired) = tables.first().map_or((0, 0), |t| (t.rows, t.expired));
        Ok(TableStats {
            strategy,
            rows,
            expired,
            tables,
        })
    }

    /// [`table_stats`](Self::table_stats), then publishes the counts as the
    /// gauges [`METRIC_TABLE_ROWS`] and [`METRIC_TABLE_EXPIRED_ROWS`] (labels
    /// `backend`, `table`) through the `metrics` facade, and logs them
    /// (`tracing`, debug; a warning when `unique_key` holds 10 000 or more
    /// expired rows). Every reaper pass does this; call it yourself to
    /// publish on another schedule.
    ///
    /// # Errors
    ///
    /// As [`table_stats`](Self::table_stats).
    pub async fn record_table_stats(&self) -> Result<TableStats> {
        let stats = self.table_stats().await?;
        let backend = self.capabilities().backend_name();
        for t in &stats.tables {
            metrics::gauge!(METRIC_TABLE_ROWS, "backend" => backend, "table" => t.table.clone())
                .set(t.rows as f64);
            metrics::gauge!(METRIC_TABLE_EXPIRED_ROWS, "backend" => backend, "table" => t.table.clone())
                .set(t.expired as f64);
            tracing::debug!(backend, table = %t.table, rows = t.rows, expired = t.expired, "lock table size");
        }
        if stats.strategy == Strategy::UniqueKey && stats.expired >= EXPIRED_WARN {
            tracing::warn!(
                table = %self.config().table(),
                rows = stats.rows,
                expired = stats.expired,
                "many expired lock rows: are releases being skipped, or is the reaper not running?"
            );
        }
        Ok(stats)
    }
}

/// Counts rows the reaper deleted (see [`METRIC_REAPED_ROWS`]).
pub(crate) fn reaped(lock: &MySqlLock, n: u64) {
    metrics::counter!(
        METRIC_REAPED_ROWS,
        "backend" => lock.capabilities().backend_name(),
        "table" => lock.config().table().as_str().to_owned()
    )
    .increment(n);
}
