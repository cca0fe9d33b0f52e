//! Versioned schema: created on first use, upgraded by `migrate`, with the
//! shared runner ([`fenced_sql::migrate`]).

use fenced_api::{Error, Result};
use fenced_sql::migrate::{self, Migration, NoHooks};
use sqlx::{AssertSqlSafe, Row, SqlitePool};

use crate::{
    config::TableName,
    error::{SqlResultExt, SqliteBackend},
};

/// The migrations, in order. A `compatible` step is one that processes
/// built against the previous version tolerate: `connect` applies it itself,
/// so files made by an older build open without a `migrate`.
const MIGRATIONS: &[Migration] = &[
    Migration {
        version: 1,
        name: "initial",
        sql: include_str!("../migrations/0001_initial.sql"),
        compatible: false,
    },
    Migration {
        version: 2,
        name: "holder_label",
        sql: include_str!("../migrations/0002_holder_label.sql"),
        compatible: true,
    },
    Migration {
        version: 3,
        name: "permits",
        sql: include_str!("../migrations/0003_permits.sql"),
        compatible: true,
    },
];

/// The schema version this build needs.
pub const SCHEMA_VERSION: u32 = 3;

/// What to do when the tables of a name are older than this build.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Upgrade {
    /// Create missing tables and apply steps that older processes
    /// tolerate; refuse any other change to an existing older schema
    /// (processes built against it may still be running).
    CreateOnly,
    /// Apply every missing migration.
    Apply,
}

/// The highest applied version, 0 when the tables do not exist.
async fn version(pool: &SqlitePool, base: &TableName) -> Result<u32> {
    let log = format!("{base}_migrations");
    let exists = sqlx::query("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?")
        .bind(&log)
        .fetch_optional(pool)
        .await
        .db()?
        .is_some();
    if !exists {
        return Ok(0);
    }
    let v: Option<i64> = sqlx::query(AssertSqlSafe(format!(
        "SELECT MAX(version) FROM {}",
        base.quoted("_migrations")
    )))
    .fetch_one(pool)
    .await
    .db()?
    .try_get(0)
    .db()?;
    Ok(v.and_then(|v| u32::try_from(v).ok()).unwrap_or(0))
}

/// Brings the tables of `base` to [`SCHEMA_VERSION`]. Idempotent and safe
/// from several processes at once: the work happens in one `BEGIN IMMEDIATE`
/// transaction (one writer at a time) that re-reads what is applied.
/// Returns the migrations applied by this call.
pub(crate) async fn ensure(pool: &SqlitePool, base: &TableName, mode: Upgrade) -> Result<Vec<u32>> {
    let current = version(pool, base).await?;
    if current >= SCHEMA_VERSION {
        return Ok(Vec::new());
    }
    let needs_migrate = MIGRATIONS
        .iter()
        .any(|m| m.version > current && !m.compatible);
    if current > 0 && mode == Upgrade::CreateOnly && needs_migrate {
        return Err(Error::config(format!(
            "the fenced tables for `{base}` are at schema version {current}, this build needs \
             {SCHEMA_VERSION}; stop older processes, then run `SqliteLock::migrate()` \
             (or `fenced migrate --url …`) once"
        )));
    }
    let mut tx = pool.begin_with("BEGIN IMMEDIATE").await.db()?;
    let applied = migrate::apply::<SqliteBackend>(&mut tx, base, MIGRATIONS, &NoHooks).await?;
    tx.commit().await.db()?;
    for version in &applied {
        tracing::info!(table = %base, version, "fenced sqlite schema migration applied");
    }
    Ok(applied)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statements_are_split_and_named() {
        let base = TableName::new("jobs").unwrap();
        let stmts = migrate::statements(MIGRATIONS[0].sql, &base);
        assert_eq!(stmts.len(), 2);
        assert!(stmts[0].starts_with("CREATE TABLE IF NOT EXISTS \"jobs\" ("));
        assert!(stmts[0].contains("AUTOINCREMENT"));
        assert!(stmts
            .iter()
            .all(|s| !s.contains("{base}") && !s.contains("--")));
        assert!(stmts[1].contains("\"jobs_expire_at\""));
        let label = migrate::statements(MIGRATIONS[1].sql, &base);
        assert_eq!(label, ["ALTER TABLE \"jobs\" ADD COLUMN label TEXT"]);
    }

    #[test]
    fn versions_are_consecutive_up_to_the_schema_version() {
        assert!(migrate::consecutive(MIGRATIONS, SCHEMA_VERSION));
    }
}
