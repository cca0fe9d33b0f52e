//! Versioned schema, applied by `migrate` with the shared runner
//! ([`fenced_sql::migrate`]), checked on connect.

use std::future::Future;

use fenced_api::{Error, Result};
use fenced_sql::migrate::{self, Hooks, Migration};
use sqlx::{AssertSqlSafe, MySql, MySqlConnection, MySqlPool, Row};

use crate::{
    config::TableName,
    error::{MySqlBackend, SqlResultExt},
};

/// The migrations, in order. Applied by an explicit `migrate` only, so no
/// step is applied on connect (`compatible` is not used here).
const MIGRATIONS: &[Migration] = &[
    step(1, "initial", include_str!("../migrations/0001_initial.sql")),
    step(
        2,
        "row_lock_live",
        include_str!("../migrations/0002_row_lock_live.sql"),
    ),
    step(
        3,
        "unique_key_by_lock_key",
        include_str!("../migrations/0003_unique_key_by_lock_key.sql"),
    ),
    step(
        4,
        "holder_label",
        include_str!("../migrations/0004_holder_label.sql"),
    ),
    step(5, "permits", include_str!("../migrations/0005_permits.sql")),
];

const fn step(version: u32, name: &'static str, sql: &'static str) -> Migration {
    Migration {
        version,
        name,
        sql,
        compatible: false,
    }
}

/// The schema version this build needs.
pub const SCHEMA_VERSION: u32 = 5;

/// How long `migrate` waits for another node's migration of the same tables.
const MIGRATE_LOCK_WAIT_S: u32 = 120;

/// Creates or upgrades every table of `base`. Idempotent and safe to run
/// from several nodes at once: it holds a named lock (`GET_LOCK`, on one
/// connection) while it reads the migration log and applies what is
/// missing, so each migration runs once even where a statement (an `ALTER`)
/// could not run twice. Returns the migrations applied by this call.
pub(crate) async fn migrate(pool: &MySqlPool, base: &TableName) -> Result<Vec<u32>> {
    let mut conn = pool.acquire().await.db()?;
    // MySQL caps lock names at 64 characters; a cut name only serialises
    // two long base names that share a prefix.
    let name: String = format!("fenced:migrate:{}", base.as_str())
        .chars()
        .take(64)
        .collect();
    let got: Option<i64> = sqlx::query("SELECT GET_LOCK(?, ?)")
        .bind(&name)
        .bind(MIGRATE_LOCK_WAIT_S)
        .fetch_one(&mut *conn)
        .await
        .db()?
        .try_get(0)
        .db()?;
    if got != Some(1) {
        return Err(Error::backend(
            crate::error::BACKEND,
            true,
            format!(
                "another migration of `{base}` held the migration lock for {MIGRATE_LOCK_WAIT_S}s; try again"
            ),
        ));
    }
    let result = apply_missing(&mut conn, base).await;
    // Also released when the connection closes; errors here change nothing.
    let _ = sqlx::query("SELECT RELEASE_LOCK(?)")
        .bind(&name)
        .execute(&mut *conn)
        .await;
    result
}

async fn apply_missing(conn: &mut MySqlConnection, base: &TableName) -> Result<Vec<u32>> {
    migrate::apply::<MySqlBackend>(conn, base, MIGRATIONS, &Resume).await
}

/// Finishing a migrate that stopped halfway: DDL commits on its own, so a
/// step's statements and its log row cannot be one transaction.
struct Resume;

impl Hooks<MySql> for Resume {
    fn already_in_place<'c>(
        &'c self,
        conn: &'c mut MySqlConnection,
        m: &'c Migration,
        base: &'c TableName,
    ) -> impl Future<Output = Result<bool>> + Send + 'c {
        already_in_place(conn, m.version, base)
    }

    fn statement_in_place<'c>(
        &'c self,
        conn: &'c mut MySqlConnection,
        statement: &'c str,
    ) -> impl Future<Output = Result<bool>> + Send + 'c {
        column_in_place(conn, statement)
    }

    fn recorded(&self, base: &TableName, m: &Migration) {
        tracing::info!(table = %base, version = m.version, name = m.name, "fenced schema migration applied");
    }
}

/// Whether migration `version`'s changes are already in the tables though
/// the log does not say so. Versions 1 and 2 only create tables `IF NOT
/// EXISTS` and run again harmlessly; version 3's `ALTER` cannot run twice
/// (the primary key it drops is gone), so it is skipped when `lock_key`
/// already is the primary key. One `ALTER` is atomic on MariaDB ≥ 10.6
/// and MySQL 8 (and InnoDB's table rebuild is all or nothing before that),
/// so "primary key on lock_key" means the whole of v3 is in place.
async fn already_in_place(
    conn: &mut MySqlConnection,
    version: u32,
    base: &TableName,
) -> Result<bool> {
    if version != 3 {
        return Ok(false);
    }
    let primary: Option<String> = sqlx::query(
        "SELECT GROUP_CONCAT(COLUMN_NAME ORDER BY SEQ_IN_INDEX) FROM information_schema.STATISTICS \
         WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = ? AND INDEX_NAME = 'PRIMARY'",
    )
    .bind(base.as_str())
    .fetch_one(&mut *conn)
    .await
    .db()?
    .try_get(0)
    .db()?;
    Ok(primary.is_some_and(|cols| cols.eq_ignore_ascii_case("lock_key")))
}

/// `ALTER TABLE `t` ADD COLUMN c …` as `(t, c)`.
fn added_column(stmt: &str) -> Option<(&str, &str)> {
    let rest = stmt.strip_prefix("ALTER TABLE `")?;
    let (table, rest) = rest.split_once('`')?;
    let column = rest.trim_start().strip_prefix("ADD COLUMN ")?;
    Some((table, column.split_whitespace().next()?))
}

/// Whether `stmt` adds a column that the table already has: an `ADD
/// COLUMN` cannot run twice (MySQL has no `IF NOT EXISTS` for it), and a
/// migration of several of them may have stopped after some.
async fn column_in_place(conn: &mut MySqlConnection, stmt: &str) -> Result<bool> {
    let Some((table, column)) = added_column(stmt) else {
        return Ok(false);
    };
    let found = sqlx::query(
        "SELECT 1 FROM information_schema.COLUMNS \
         WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = ? AND COLUMN_NAME = ?",
    )
    .bind(table)
    .bind(column)
    .fetch_optional(&mut *conn)
    .await
    .db()?;
    Ok(found.is_some())
}

/// Refuses read-only servers and schemas older than this build needs.
pub(crate) async fn check(pool: &MySqlPool, base: &TableName) -> Result<()> {
    let read_only: i64 = sqlx::query("SELECT @@global.read_only")
        .fetch_one(pool)
        .await
        .db()?
        .try_get(0)
        .db()?;
    if read_only != 0 {
        return Err(Error::config(
            "the server is read-only (@@read_only = 1): locks must live on the primary, never on a replica",
        ));
    }
    let log = base.quoted("_migrations");
    let version: Option<u32> =
        sqlx::query(AssertSqlSafe(format!("SELECT MAX(version) FROM {log}")))
            .fetch_one(pool)
            .await
            .db()?
            .try_get(0)
            .db()?;
    match version {
        Some(v) if v >= SCHEMA_VERSION => Ok(()),
        found => Err(Error::config(format!(
            "the fenced tables for `{base}` are at schema version {}, this build needs {SCHEMA_VERSION}; \
             run `MySqlLock::migrate()` (or `fenced migrate --url …`) once",
            found.unwrap_or(0)
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statements_are_split_and_named() {
        let base = TableName::new("jobs").unwrap();
        let statements = |m: &Migration| migrate::statements(m.sql, &base);
        let stmts = statements(&MIGRATIONS[0]);
        assert_eq!(stmts.len(), 4);
        assert!(stmts[0].starts_with("CREATE TABLE IF NOT EXISTS `jobs` ("));
        assert!(stmts
            .iter()
            .all(|s| !s.contains("{base}") && !s.contains("--")));
        assert!(stmts[3].contains("`jobs_fence`"));
        let v2 = statements(&MIGRATIONS[1]);
        assert_eq!(v2.len(), 1);
        assert!(v2[0].starts_with("CREATE TABLE IF NOT EXISTS `jobs_live` ("));
        assert!(v2[0].ends_with("ENGINE=MEMORY"));
        let v3 = statements(&MIGRATIONS[2]);
        assert_eq!(v3.len(), 1);
        assert!(v3[0].starts_with("ALTER TABLE `jobs`"));
        assert!(v3[0].contains("ADD PRIMARY KEY (lock_key)"));
        assert_eq!(added_column(&v3[0]), None);
        let v4 = statements(&MIGRATIONS[3]);
        let added: Vec<_> = v4.iter().filter_map(|s| added_column(s)).collect();
        assert_eq!(
            added,
            [
                ("jobs", "label"),
                ("jobs_optimistic", "label"),
                ("jobs_live", "label")
            ]
        );
    }

    #[test]
    fn versions_are_consecutive_up_to_the_schema_version() {
        assert!(migrate::consecutive(MIGRATIONS, SCHEMA_VERSION));
    }
}
