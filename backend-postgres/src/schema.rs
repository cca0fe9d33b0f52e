//! Versioned schema with the shared runner ([`fenced_sql::migrate`]):
//! missing tables are created on connect, anything else is left to
//! `migrate`.

use fenced_api::{Error, Result};
use fenced_sql::migrate::{self, Migration, NoHooks};
use sqlx::{AssertSqlSafe, PgPool, Row};

use crate::{
    config::TableName,
    error::{PostgresBackend, SqlResultExt},
};

/// The migrations, in order. A `compatible` step is one that processes
/// built against the previous version tolerate: `connect` applies it itself.
const MIGRATIONS: &[Migration] = &[
    Migration {
        version: 1,
        name: "initial",
        sql: include_str!("../migrations/0001_initial.sql"),
        compatible: false,
    },
    Migration {
        version: 2,
        name: "advisory_unlogged",
        sql: include_str!("../migrations/0002_advisory_unlogged.sql"),
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

/// The first key of the two-key advisory locks fenced takes for its own
/// housekeeping (`"fenc"`); the second is `hashtext(<what>:<base table>)`.
/// The two-key form is a key space of its own in `pg_locks` (`objsubid =
/// 2`), apart from the single 64-bit keys of the `advisory` strategy, so
/// no lock key can ever collide with these guards.
pub(crate) const GUARD_CLASS: i32 = 0x6665_6e63;

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
async fn version(pool: &PgPool, base: &TableName) -> Result<u32> {
    let log = base.quoted("_migrations");
    let exists: bool = sqlx::query("SELECT to_regclass($1) IS NOT NULL")
        .bind(&log)
        .fetch_one(pool)
        .await
        .db()?
        .try_get(0)
        .db()?;
    if !exists {
        return Ok(0);
    }
    let v: Option<i64> = sqlx::query(AssertSqlSafe(format!("SELECT MAX(version) FROM {log}")))
        .fetch_one(pool)
        .await
        .db()?
        .try_get(0)
        .db()?;
    Ok(v.and_then(|v| u32::try_from(v).ok()).unwrap_or(0))
}

/// Brings the tables of `base` to [`SCHEMA_VERSION`]; returns the
/// migrations applied by this call.
///
/// Idempotent and safe from several processes at once: the work is one
/// transaction (DDL is transactional in PostgreSQL: a step applies whole or
/// not at all) that first takes a transaction-level advisory lock of the
/// table name, then re-reads the log. Without that lock two sessions would
/// both pass `CREATE … IF NOT EXISTS` and the later one fail on the
/// catalog's unique index (SQLSTATE 23505 on `pg_type`).
pub(crate) async fn ensure(pool: &PgPool, base: &TableName, mode: Upgrade) -> Result<Vec<u32>> {
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
             {SCHEMA_VERSION}; stop older processes, then run `PostgresLock::migrate()` \
             (or `fenced migrate --url …`) once"
        )));
    }
    let mut tx = pool.begin().await.db()?;
    sqlx::query("SELECT pg_advisory_xact_lock($1, hashtext($2))")
        .bind(GUARD_CLASS)
        .bind(format!("migrate:{base}"))
        .execute(&mut *tx)
        .await
        .db()?;
    let applied = migrate::apply::<PostgresBackend>(&mut tx, base, MIGRATIONS, &NoHooks).await?;
    tx.commit().await.db()?;
    for version in &applied {
        tracing::info!(table = %base, version, "fenced postgres schema migration applied");
    }
    Ok(applied)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statements_are_split_and_named() {
        let base = TableName::new("jobs").unwrap();
        let stmts = migrate::statements::<sqlx::Postgres>(MIGRATIONS[0].sql, &base);
        assert_eq!(stmts.len(), 3, "{stmts:#?}");
        assert_eq!(
            stmts[0],
            "CREATE SEQUENCE IF NOT EXISTS \"jobs_token\" AS BIGINT"
        );
        assert!(stmts[1].starts_with("CREATE TABLE IF NOT EXISTS \"jobs\" ("));
        assert!(stmts[2].starts_with("CREATE TABLE IF NOT EXISTS \"jobs_advisory\" ("));
        assert!(stmts
            .iter()
            .all(|s| !s.contains("{base}") && !s.contains("--")));
    }

    #[test]
    fn versions_are_consecutive_up_to_the_schema_version() {
        assert!(migrate::consecutive(MIGRATIONS, SCHEMA_VERSION));
    }
}
