//! The migration runner: versioned steps of `;`-separated statements, applied
//! once each and recorded in a log table `<base>_migrations`.
//!
//! A backend lists its [`Migration`]s (SQL files with `{base}` where the
//! table name goes), decides when to run them (MySQL: on an explicit
//! `migrate`, under a named lock; SQLite: on connect, in one `BEGIN
//! IMMEDIATE` transaction) and calls [`apply`] on its connection. What only
//! one store needs — finishing a step that stopped halfway, where DDL
//! commits on its own (MySQL) — comes in through [`Hooks`]. On SQLite and
//! PostgreSQL DDL is transactional: [`apply`] in a transaction applies all
//! of its steps or, rolled back, none.

use std::future::Future;

use fenced_api::Result;
use sqlx::Database;

use crate::{dialect::engine::Engine, Dialect, SqlBackend, TableName};

/// One schema step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Migration {
    /// Its version: 1, 2, … in order.
    pub version: u32,
    /// A short name, recorded in the log.
    pub name: &'static str,
    /// `;`-separated statements; `--` lines are comments, `{base}` is the
    /// table name (quoted by the template itself).
    pub sql: &'static str,
    /// Whether processes built against the previous version keep working
    /// once it is applied (a nullable column they never name, for
    /// instance). A store that migrates on connect may apply such steps
    /// itself; any other step needs an explicit `migrate`.
    pub compatible: bool,
}

/// The statements of `template` for the tables of `base`: split at `;`,
/// except inside a dollar-quoted string (`$$ … $$`, `$body$ … $body$`: a
/// PostgreSQL function or `DO` body) on a store that has them.
pub fn statements<D: Dialect>(template: &str, base: &TableName<D>) -> Vec<String> {
    let sql: String = template
        .lines()
        .filter(|l| !l.trim_start().starts_with("--"))
        .collect::<Vec<_>>()
        .join("\n");
    split(&sql, D::DOLLAR_QUOTING)
        .into_iter()
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| s.replace("{base}", base.as_str()))
        .collect()
}

/// `sql` cut at every `;` outside dollar-quoted strings (when `dollar`).
fn split(sql: &str, dollar: bool) -> Vec<&str> {
    let mut parts = Vec::new();
    let (mut start, mut i) = (0, 0);
    while let Some(c) = sql.as_bytes().get(i) {
        match c {
            b';' => {
                parts.push(&sql[start..i]);
                start = i + 1;
                i += 1;
            }
            // `$` inside an identifier (`a$b`) opens nothing.
            b'$' if dollar && !after_identifier(sql, i) => match dollar_tag(&sql[i..]) {
                Some(tag) => {
                    let body = i + tag.len();
                    // An unterminated string runs to the end, as the server reads it.
                    i = sql[body..]
                        .find(tag)
                        .map_or(sql.len(), |end| body + end + tag.len());
                }
                None => i += 1,
            },
            _ => i += 1,
        }
    }
    parts.push(&sql[start..]);
    parts
}

/// Whether byte `i` of `sql` follows a character of an identifier.
fn after_identifier(sql: &str, i: usize) -> bool {
    i.checked_sub(1)
        .and_then(|p| sql.as_bytes().get(p))
        .is_some_and(|&b| b.is_ascii_alphanumeric() || b == b'_' || b == b'$' || !b.is_ascii())
}

/// The opening tag (`$$`, `$name$`) at the start of `s`, if one is there.
/// A tag is an identifier, so a placeholder (`$1`) opens none.
fn dollar_tag(s: &str) -> Option<&str> {
    let end = s.get(1..)?.find('$')? + 1;
    let name = &s[1..end];
    let identifier = !name.starts_with(|c: char| c.is_ascii_digit())
        && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
    identifier.then(|| &s[..=end])
}

/// Whether `migrations` are versions 1, 2, … up to `schema_version`.
pub fn consecutive(migrations: &[Migration], schema_version: u32) -> bool {
    migrations
        .iter()
        .enumerate()
        .all(|(i, m)| usize::try_from(m.version).is_ok_and(|v| v == i + 1))
        && migrations.last().map(|m| m.version) == Some(schema_version)
}

/// What a store adds to [`apply`]. Every method has a default that adds
/// nothing.
pub trait Hooks<D: Dialect>: Sync {
    /// Whether `m`'s changes are already in the tables though the log does
    /// not say so (a step whose statements cannot run twice, on a store
    /// where DDL commits on its own). It is then only recorded.
    fn already_in_place<'c>(
        &'c self,
        conn: &'c mut D::Connection,
        m: &'c Migration,
        base: &'c TableName<D>,
    ) -> impl Future<Output = Result<bool>> + Send + 'c {
        let _ = (conn, m, base);
        async { Ok(false) }
    }

    /// Whether one statement's change is already in place (a column a
    /// migration that stopped halfway added); it is then skipped.
    fn statement_in_place<'c>(
        &'c self,
        conn: &'c mut D::Connection,
        statement: &'c str,
    ) -> impl Future<Output = Result<bool>> + Send + 'c {
        let _ = (conn, statement);
        async { Ok(false) }
    }

    /// `m` was applied and recorded (in the caller's transaction, if any).
    fn recorded(&self, base: &TableName<D>, m: &Migration) {
        let _ = (base, m);
    }
}

/// Hooks that add nothing.
#[derive(Debug, Clone, Copy, Default)]
pub struct NoHooks;

impl<D: Dialect> Hooks<D> for NoHooks {}

/// Applies the `migrations` that the log of `base` does not list, in order,
/// on `conn` (a plain connection, or the caller's transaction), creating the
/// log if missing. Returns the versions applied by this call.
///
/// # Errors
///
/// The backend's mapping of the first failing statement; the steps before
/// it stay applied and recorded unless the caller rolls its transaction back.
pub async fn apply<B: SqlBackend>(
    conn: &mut <B::Db as Database>::Connection,
    base: &TableName<B::Db>,
    migrations: &[Migration],
    hooks: &impl Hooks<B::Db>,
) -> Result<Vec<u32>> {
    let log = B::Db::log_sql(&base.quoted("_migrations"));
    B::Db::execute(conn, log.create.clone())
        .await
        .map_err(B::map)?;
    let done = B::Db::log_versions(conn, &log).await.map_err(B::map)?;
    let mut applied = Vec::new();
    for m in migrations {
        if done.contains(&m.version) {
            continue;
        }
        if hooks.already_in_place(conn, m, base).await? {
            tracing::warn!(
                table = %base,
                version = m.version,
                name = m.name,
                "fenced schema migration was already in place but not recorded (an earlier migrate stopped halfway); recording it"
            );
        } else {
            for statement in statements(m.sql, base) {
                if hooks.statement_in_place(conn, &statement).await? {
                    continue;
                }
                B::Db::execute(conn, statement).await.map_err(B::map)?;
            }
        }
        B::Db::log_record(conn, &log, m.version, m.name)
            .await
            .map_err(B::map)?;
        hooks.recorded(base, m);
        applied.push(m.version);
    }
    Ok(applied)
}

#[cfg(test)]
mod tests {
    use super::*;

    const STEPS: &[Migration] = &[
        Migration {
            version: 1,
            name: "initial",
            sql: "-- a comment; with a semicolon\nCREATE TABLE \"{base}\" (id INTEGER);\n\n\
                  CREATE INDEX \"{base}_id\" ON \"{base}\" (id);",
            compatible: false,
        },
        Migration {
            version: 2,
            name: "label",
            sql: "ALTER TABLE \"{base}\" ADD COLUMN label TEXT",
            compatible: true,
        },
    ];

    #[test]
    fn statements_are_split_named_and_free_of_comments() {
        let base = TableName::<sqlx::Sqlite>::new("jobs").unwrap();
        assert_eq!(
            statements(STEPS[0].sql, &base),
            [
                "CREATE TABLE \"jobs\" (id INTEGER)",
                "CREATE INDEX \"jobs_id\" ON \"jobs\" (id)"
            ]
        );
        assert_eq!(
            statements(STEPS[1].sql, &base),
            ["ALTER TABLE \"jobs\" ADD COLUMN label TEXT"]
        );
    }

    #[test]
    fn dollar_quoted_bodies_stay_whole_on_postgresql_only() {
        let template = "CREATE TABLE \"{base}\" (id BIGINT);\n\
             CREATE FUNCTION \"{base}_f\"() RETURNS trigger AS $body$\n\
             BEGIN PERFORM pg_notify('{base}', 'x'); RETURN NULL; END;\n\
             $body$ LANGUAGE plpgsql;\n\
             DO $$ BEGIN RAISE NOTICE 'a;b'; END $$;\n\
             SELECT $1, $2::text; SELECT '$'";
        let pg = TableName::<sqlx::Postgres>::new("jobs").unwrap();
        assert_eq!(
            statements(template, &pg),
            [
                "CREATE TABLE \"jobs\" (id BIGINT)",
                "CREATE FUNCTION \"jobs_f\"() RETURNS trigger AS $body$\n\
                 BEGIN PERFORM pg_notify('jobs', 'x'); RETURN NULL; END;\n\
                 $body$ LANGUAGE plpgsql",
                "DO $$ BEGIN RAISE NOTICE 'a;b'; END $$",
                "SELECT $1, $2::text",
                "SELECT '$'",
            ]
        );
        // Elsewhere `$` is an ordinary character.
        let lite = TableName::<sqlx::Sqlite>::new("jobs").unwrap();
        assert_eq!(statements("SELECT '$$;$$'", &lite), ["SELECT '$$", "$$'"]);
        // An unterminated body runs to the end.
        assert_eq!(statements("DO $x$ a; b", &pg), ["DO $x$ a; b"]);
        assert_eq!(split("a$", true), ["a$"]);
        assert_eq!(
            split("SELECT a$b$c; $x$;$x$", true),
            ["SELECT a$b$c", " $x$;$x$"]
        );
    }

    #[test]
    fn versions_must_be_consecutive_up_to_the_schema_version() {
        assert!(consecutive(STEPS, 2));
        assert!(!consecutive(STEPS, 3));
        assert!(!consecutive(&STEPS[1..], 2));
        assert!(!consecutive(&[], 0));
    }
}
