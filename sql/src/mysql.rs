//! The MySQL / MariaDB dialect: backtick-quoted, mixed-case names, `?`
//! placeholders, unsigned 64-bit tokens.
//!
//! The fence statements run unchanged on MariaDB 10.3+ and MySQL 8.0+. The
//! token is bound twice rather than read back with `VALUES(token)`, which
//! MySQL 8.0.20+ deprecates and whose replacement, the row alias `… AS new`,
//! MariaDB does not have.

use sqlx::{AssertSqlSafe, MySql, MySqlConnection, Row};

use crate::dialect::{
    engine::{Engine, Entry, FenceSql, LogSql, Raised},
    shared_engine_methods, Dialect,
};

impl Dialect for MySql {
    const QUOTE: char = '`';
    const MIXED_CASE: bool = true;
    const LOWERCASE_BECAUSE: &'static str = "";
    const RESERVED_PREFIX: Option<&'static str> = None;
    const MAX_TOKEN: u64 = u64::MAX;
    const MAX_IDENTIFIER_LEN: usize = 64;

    fn placeholder(_: usize) -> String {
        "?".to_owned()
    }
}

impl Engine for MySql {
    fn fence_sql(t: &str) -> FenceSql {
        FenceSql {
            create: format!(
                "CREATE TABLE IF NOT EXISTS {t} (\
                 resource VARBINARY(255) NOT NULL, \
                 token BIGINT UNSIGNED NOT NULL, \
                 updated_at DATETIME(6) NOT NULL, \
                 PRIMARY KEY (resource)) ENGINE=InnoDB"
            ),
            // `updated_at` first: assignments run left to right, so its
            // condition still sees the old token (and under MariaDB's
            // SIMULTANEOUS_ASSIGNMENT it sees the old one anyway). The
            // upsert takes the row's exclusive lock until the transaction
            // ends, so writers of one resource are serialised.
            raise: format!(
                "INSERT INTO {t} (resource, token, updated_at) VALUES (?, ?, UTC_TIMESTAMP(6)) \
                 ON DUPLICATE KEY UPDATE updated_at = IF(? >= token, UTC_TIMESTAMP(6), updated_at), \
                 token = GREATEST(token, ?)"
            )
            .into(),
            read: format!("SELECT token FROM {t} WHERE resource = ?").into(),
            // A locking read: a plain `SELECT` under REPEATABLE READ may
            // answer from a snapshot older than the upsert's current read
            // (when the upsert changed nothing).
            read_current: format!("SELECT token FROM {t} WHERE resource = ? FOR UPDATE").into(),
        }
    }

    async fn fence_raise(
        conn: &mut MySqlConnection,
        sql: &FenceSql,
        Entry { resource, token }: Entry<'_>,
    ) -> Result<Raised, sqlx::Error> {
        sqlx::query(AssertSqlSafe(sql.raise.clone()))
            .bind(resource.as_bytes())
            .bind(token)
            .bind(token)
            .bind(token)
            .execute(&mut *conn)
            .await?;
        // Decided from the row, not from the statement's affected-rows
        // count: that count (0, 1 or 2, and 1 vs 0 for "unchanged"
        // depending on CLIENT_FOUND_ROWS) cannot tell an equal token
        // from a stale one.
        let highest: u64 = sqlx::query(AssertSqlSafe(sql.read_current.clone()))
            .bind(resource.as_bytes())
            .fetch_one(&mut *conn)
            .await?
            .try_get(0)?;
        Ok(Raised {
            stored: None,
            highest: i128::from(highest),
        })
    }

    fn log_sql(log: &str) -> LogSql {
        LogSql {
            create: format!(
                "CREATE TABLE IF NOT EXISTS {log} (version INT UNSIGNED NOT NULL PRIMARY KEY, \
                 name VARCHAR(100) NOT NULL, applied_at DATETIME(6) NOT NULL) ENGINE=InnoDB"
            ),
            versions: format!("SELECT version FROM {log}"),
            // IGNORE: a version recorded by a migrate that ran beside this one.
            record: format!(
                "INSERT IGNORE INTO {log} (version, name, applied_at) VALUES (?, ?, UTC_TIMESTAMP(6))"
            ),
        }
    }

    shared_engine_methods!(MySqlConnection, u64, str::as_bytes);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fence_statements_never_use_the_values_function() {
        let sql = MySql::fence_sql(&MySql::quote("orders_fence"));
        assert!(sql.raise.contains("`orders_fence`"));
        assert!(!sql.raise.contains("VALUES(token)"));
        assert!(sql.read_current.ends_with("FOR UPDATE"));
        assert!(!sql.read.contains("FOR UPDATE"));
    }
}
