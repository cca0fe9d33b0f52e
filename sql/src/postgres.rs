//! The PostgreSQL dialect: double-quoted, lowercase names (`pg_` is the
//! system's), numbered `$n` placeholders, signed 64-bit tokens, and
//! dollar-quoted bodies kept whole when a migration is split into statements.
//!
//! # Table names
//!
//! Quoted names are case-sensitive in PostgreSQL, so `"Locks"` and
//! `"locks"` would be two tables; mixed case would be safe for the
//! statements written here, which always quote. Names are lowercase anyway
//! because PostgreSQL folds every *unquoted* name to lowercase, and names
//! travel further than these statements: an operator typing
//! `SELECT * FROM Locks` in `psql` reads `locks`, `nextval('Locks_token')`
//! names the sequence `locks_token`, and `LISTEN Locks` waits on channel
//! `locks` while `pg_notify('Locks', …)` notifies `Locks`. With lowercase
//! names quoted and unquoted spellings are one object, so none of those can
//! silently name something else.
//!
//! Identifiers are at most 63 bytes (`NAMEDATALEN - 1`); a longer one is
//! truncated with only a `NOTICE`, so two derived names could become one
//! table. A [`TableName`](crate::TableName) of at most 48 characters leaves
//! room for a suffix of up to 15 ([`TableName::MAX_SUFFIX_LEN`](crate::TableName::MAX_SUFFIX_LEN)).
//! `pg_` is refused: it is the catalogs' prefix, and `pg_catalog` is searched
//! before any other schema, so a table named like a catalog would be shadowed.
//!
//! # The fence
//!
//! One statement, `INSERT … ON CONFLICT (resource) DO UPDATE SET token =
//! GREATEST(token, excluded.token) … RETURNING token`, creates the row or
//! raises its token, never lowers it, and returns the highest token: equal
//! to the caller's, accepted; higher, stale. It always updates (a stale check
//! writes the row back unchanged) so that the row comes back in every case,
//! read from the version the statement locked rather than from a second
//! statement's snapshot. The row's lock is held until the transaction ends,
//! so checks of one resource are serialised.
//!
//! What a check in a transaction whose snapshot predates a newer token does
//! depends on the isolation level:
//!
//! * READ COMMITTED (PostgreSQL's default): `ON CONFLICT DO UPDATE` waits for
//!   the row and then works on its latest committed version, whatever the
//!   statement's snapshot: the answer is `Stale` with the newest token.
//! * REPEATABLE READ and SERIALIZABLE: PostgreSQL refuses to update a row
//!   changed after the transaction's snapshot: the check fails with a
//!   serialization failure (SQLSTATE `40001`, retryable) instead of answering
//!   from the old snapshot. Where the snapshot is current, the check answers
//!   as under READ COMMITTED. SERIALIZABLE may also fail the commit (`40001`).
//!
//! No level answers `Accepted` for a token below the stored one.

use sqlx::{AssertSqlSafe, PgConnection, Postgres, Row};

use crate::dialect::{
    engine::{Engine, Entry, FenceSql, LogSql, Raised},
    shared_engine_methods, Dialect,
};

impl Dialect for Postgres {
    const QUOTE: char = '"';
    const MIXED_CASE: bool = false;
    const LOWERCASE_BECAUSE: &'static str = "PostgreSQL folds unquoted names to lowercase";
    const RESERVED_PREFIX: Option<&'static str> = Some("pg_");
    const MAX_TOKEN: u64 = i64::MAX as u64;
    const MAX_IDENTIFIER_LEN: usize = 63;

    fn placeholder(n: usize) -> String {
        format!("${n}")
    }
}

/// `create` (a `CREATE TABLE IF NOT EXISTS`), made safe to run beside
/// itself: two sessions creating one table at once can both pass the `IF
/// NOT EXISTS` test, and the later one then fails once the first commits —
/// on the catalog's unique index (`duplicate key value violates unique
/// constraint "pg_type_typname_nsp_index"`, `23505`), or with `type … already
/// exists` (`42710`) or `relation … already exists` (`42P07`), depending on
/// where it was. Each means the table now exists, which is all `create` asks.
fn create_if_missing(create: &str) -> String {
    format!(
        "DO $fenced$ BEGIN {create}; \
         EXCEPTION WHEN unique_violation OR duplicate_table OR duplicate_object THEN NULL; \
         END $fenced$"
    )
}

impl Engine for Postgres {
    const DOLLAR_QUOTING: bool = true;

    fn fence_sql(t: &str) -> FenceSql {
        FenceSql {
            // `COLLATE "C"`: the key's order is byte order, not the
            // database's locale (whose rules change with the C library);
            // equality is byte-exact under any deterministic collation.
            create: create_if_missing(&format!(
                "CREATE TABLE IF NOT EXISTS {t} (\
                 resource TEXT COLLATE \"C\" NOT NULL PRIMARY KEY, \
                 token BIGINT NOT NULL, \
                 updated_at TIMESTAMPTZ NOT NULL)"
            )),
            // Every `SET` expression reads the row as it was before the
            // update, so `updated_at` moves only when the token is stored.
            raise: format!(
                "INSERT INTO {t} (resource, token, updated_at) \
                 VALUES ($1, $2, statement_timestamp()) \
                 ON CONFLICT (resource) DO UPDATE SET \
                 token = GREATEST({t}.token, excluded.token), \
                 updated_at = CASE WHEN excluded.token >= {t}.token \
                 THEN excluded.updated_at ELSE {t}.updated_at END \
                 RETURNING token"
            )
            .into(),
            read: format!("SELECT token FROM {t} WHERE resource = $1").into(),
            // The raise returns the token itself; this is the read a writer
            // would make: the latest committed version under READ COMMITTED,
            // a serialization failure under REPEATABLE READ when the row
            // changed after the snapshot.
            read_current: format!("SELECT token FROM {t} WHERE resource = $1 FOR UPDATE").into(),
        }
    }

    async fn fence_raise(
        conn: &mut PgConnection,
        sql: &FenceSql,
        Entry { resource, token }: Entry<'_>,
    ) -> Result<Raised, sqlx::Error> {
        let t = i64::try_from(token).map_err(|e| sqlx::Error::Encode(Box::new(e)))?;
        let highest: i64 = sqlx::query(AssertSqlSafe(sql.raise.clone()))
            .bind(resource)
            .bind(t)
            .fetch_one(&mut *conn)
            .await?
            .try_get(0)?;
        // The statement stores either way (an unchanged row for a stale
        // token): the highest token decides.
        Ok(Raised {
            stored: None,
            highest: i128::from(highest),
        })
    }

    fn log_sql(log: &str) -> LogSql {
        LogSql {
            // BIGINT: the shared code reads versions as `i64`, and sqlx
            // decodes an `i64` from an INT8 column only.
            create: create_if_missing(&format!(
                "CREATE TABLE IF NOT EXISTS {log} (version BIGINT PRIMARY KEY, \
                 name TEXT NOT NULL, applied_at TIMESTAMPTZ NOT NULL)"
            )),
            versions: format!("SELECT version FROM {log}"),
            // DO NOTHING: a version recorded by a migrate that ran beside this one.
            record: format!(
                "INSERT INTO {log} (version, name, applied_at) \
                 VALUES ($1, $2, statement_timestamp()) ON CONFLICT (version) DO NOTHING"
            ),
        }
    }

    shared_engine_methods!(PgConnection, i64, std::convert::identity::<&str>);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn placeholders_are_numbered_with_a_dollar() {
        assert_eq!(Postgres::placeholder(1), "$1");
        assert_eq!(Postgres::placeholder(12), "$12");
        assert_eq!(Postgres::quote("jobs_keys"), "\"jobs_keys\"");
    }

    #[test]
    fn fence_statements_name_the_table_quoted_and_never_lower_a_token() {
        let sql = Postgres::fence_sql(&Postgres::quote("orders_fence"));
        assert!(sql
            .create
            .starts_with("DO $fenced$ BEGIN CREATE TABLE IF NOT EXISTS \"orders_fence\" ("));
        assert!(sql.create.contains("EXCEPTION WHEN unique_violation"));
        assert!(sql
            .raise
            .contains("token = GREATEST(\"orders_fence\".token, excluded.token)"));
        assert!(sql.raise.ends_with("RETURNING token"));
        assert_eq!(
            &*sql.read,
            "SELECT token FROM \"orders_fence\" WHERE resource = $1"
        );
        assert!(sql.read_current.ends_with("FOR UPDATE"));
        let log = Postgres::log_sql(&Postgres::quote("jobs_migrations"));
        assert!(log
            .create
            .contains("\"jobs_migrations\" (version BIGINT PRIMARY KEY"));
        assert!(log.record.contains("VALUES ($1, $2, "));
    }
}
