//! The SQLite dialect: double-quoted, lowercase names (SQLite compares
//! table names case-insensitively; `sqlite_` is its own), numbered `?N`
//! placeholders, signed 64-bit tokens, and the clock both the lock table and
//! the fence table keep ([`NOW_US`]).

use sqlx::{AssertSqlSafe, Row, Sqlite, SqliteConnection};

use crate::dialect::{
    engine::{Engine, Entry, FenceSql, LogSql, Raised},
    shared_engine_methods, Dialect,
};

/// SQLite's clock in whole microseconds since the Unix epoch, as SQL.
/// `'now'` reads the host's wall clock with millisecond resolution,
/// truncated, and is constant within one statement; `ROUND` undoes the binary
/// fraction of `unixepoch('subsec')`, so the value is an exact multiple of 1000.
pub const NOW_US: &str = "(CAST(ROUND(unixepoch('subsec') * 1000) AS INTEGER) * 1000)";

impl Dialect for Sqlite {
    const QUOTE: char = '"';
    const MIXED_CASE: bool = false;
    const LOWERCASE_BECAUSE: &'static str = "SQLite table names are case-insensitive";
    const RESERVED_PREFIX: Option<&'static str> = Some("sqlite_");
    const MAX_TOKEN: u64 = i64::MAX as u64;
    const MAX_IDENTIFIER_LEN: usize = usize::MAX;

    fn placeholder(n: usize) -> String {
        format!("?{n}")
    }
}

impl Engine for Sqlite {
    fn fence_sql(t: &str) -> FenceSql {
        let read: std::sync::Arc<str> = format!("SELECT token FROM {t} WHERE resource = ?1").into();
        FenceSql {
            create: format!(
                "CREATE TABLE IF NOT EXISTS {t} (\
                 resource TEXT NOT NULL PRIMARY KEY, \
                 token INTEGER NOT NULL, \
                 updated_at INTEGER NOT NULL) STRICT, WITHOUT ROWID"
            ),
            // A row comes back exactly when the token was stored (inserted,
            // or the `WHERE` let the update through): it never lowers one.
            raise: format!(
                "INSERT INTO {t} (resource, token, updated_at) VALUES (?1, ?2, {NOW_US}) \
                 ON CONFLICT (resource) DO UPDATE SET token = excluded.token, \
                 updated_at = excluded.updated_at WHERE excluded.token >= {t}.token \
                 RETURNING token"
            )
            .into(),
            // One writer at a time: after the raise, within the same write
            // transaction, a plain read is current.
            read_current: read.clone(),
            read,
        }
    }

    async fn fence_raise(
        conn: &mut SqliteConnection,
        sql: &FenceSql,
        Entry { resource, token }: Entry<'_>,
    ) -> Result<Raised, sqlx::Error> {
        let t = i64::try_from(token).map_err(|e| sqlx::Error::Encode(Box::new(e)))?;
        let stored: Option<i64> = sqlx::query(AssertSqlSafe(sql.raise.clone()))
            .bind(resource)
            .bind(t)
            .fetch_optional(&mut *conn)
            .await?
            .map(|r| r.try_get(0))
            .transpose()?;
        Ok(match stored {
            Some(h) => Raised {
                stored: Some(true),
                highest: i128::from(h),
            },
            // Only for a stale token is the highest read.
            None => Raised {
                stored: Some(false),
                highest: Self::fence_read(conn, &sql.read_current, resource)
                    .await?
                    .unwrap_or(0),
            },
        })
    }

    fn log_sql(log: &str) -> LogSql {
        LogSql {
            create: format!(
                "CREATE TABLE IF NOT EXISTS {log} (version INTEGER PRIMARY KEY, \
                 name TEXT NOT NULL, applied_at INTEGER NOT NULL) STRICT"
            ),
            versions: format!("SELECT version FROM {log}"),
            record: format!(
                "INSERT INTO {log} (version, name, applied_at) VALUES (?, ?, unixepoch())"
            ),
        }
    }

    shared_engine_methods!(SqliteConnection, i64, std::convert::identity::<&str>);
}
