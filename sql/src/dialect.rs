//! What differs between the SQL stores ([`Dialect`]) and between the
//! backends built on them ([`SqlBackend`]).

use std::future::Future;

use fenced_api::Error;

/// The SQL dialect of a store, implemented for the sqlx databases fenced
/// supports ([`sqlx::MySql`], [`sqlx::Sqlite`], [`sqlx::Postgres`]). Sealed:
/// the statements each dialect needs are written in this crate.
///
/// The store's name in messages is sqlx's [`Database::NAME`](sqlx::Database::NAME)
/// (`MySQL`, `SQLite`, `PostgreSQL`).
pub trait Dialect: engine::Engine {
    /// The character that quotes identifiers.
    const QUOTE: char;
    /// Whether table names may hold uppercase letters. Not where the store
    /// compares table names case-insensitively (SQLite: `Locks` and `locks`
    /// would silently be one namespace), nor where it folds unquoted names
    /// to lowercase (PostgreSQL: `Locks` could only ever be named quoted,
    /// and any tool or statement naming it unquoted would reach `locks`).
    const MIXED_CASE: bool;
    /// Why names are lowercase only, said in the error that refuses an
    /// uppercase letter; empty where [`MIXED_CASE`](Self::MIXED_CASE).
    const LOWERCASE_BECAUSE: &'static str;
    /// A prefix of table names the store reserves for itself.
    const RESERVED_PREFIX: Option<&'static str>;
    /// The largest fencing token a fence table keeps (the store's integer type).
    const MAX_TOKEN: u64;
    /// The longest identifier the store keeps, in bytes (`usize::MAX`: no
    /// limit). Every derived name `<table><suffix>` must fit: see
    /// [`TableName::MAX_SUFFIX_LEN`](crate::TableName::MAX_SUFFIX_LEN).
    const MAX_IDENTIFIER_LEN: usize;

    /// Bound parameter number `n` (from 1) as written in a statement.
    fn placeholder(n: usize) -> String;

    /// `ident`, quoted. Only for validated names: a quote inside is not escaped.
    fn quote(ident: &str) -> String {
        format!("{q}{ident}{q}", q = Self::QUOTE)
    }
}

/// What a backend crate tells the shared code: its store's dialect and how
/// its store errors become [`fenced_api::Error`]s. Implemented by each SQL
/// backend on a marker type, so [`fence::Fence`](crate::fence::Fence) and
/// [`migrate::apply`](crate::migrate::apply) classify errors the way the
/// rest of that backend does.
pub trait SqlBackend: Send + Sync + 'static {
    /// The store's dialect.
    type Db: Dialect;
    /// The backend's name in errors (`mysql`, `sqlite`, `postgres`).
    const BACKEND: &'static str;
    /// The backend's mapping of any store error.
    fn map(e: sqlx::Error) -> Error;
    /// Whether `e` says that a table does not exist.
    fn is_missing_table(e: &sqlx::Error) -> bool;
    /// Whether `e` says that a column does not exist.
    fn is_missing_column(e: &sqlx::Error) -> bool;
    /// Whether the server error `e` ended the session it came on (the
    /// server killed or terminated it, or is shutting down): that
    /// connection is not reused. None by default (SQLite has no session).
    fn ends_session(_e: &sqlx::Error) -> bool {
        false
    }
}

/// Whether a connection that just returned `e` is still in sync with a live
/// server session and may be reused: yes for errors the server reported
/// about the statement (a duplicate key, a lock timeout…) unless
/// [`SqlBackend::ends_session`], no for I/O and protocol failures.
pub fn leaves_session_usable<B: SqlBackend>(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Database(_) => !B::ends_session(e),
        sqlx::Error::RowNotFound => true,
        _ => false,
    }
}

/// A backend for this crate's tests: any dialect, every error a plain
/// backend error named `test`.
#[cfg(test)]
pub(crate) struct Plain<D>(std::marker::PhantomData<fn() -> D>);

#[cfg(test)]
impl<D: Dialect> SqlBackend for Plain<D> {
    type Db = D;
    const BACKEND: &'static str = "test";
    fn map(e: sqlx::Error) -> Error {
        Error::backend("test", false, e)
    }
    fn is_missing_table(_: &sqlx::Error) -> bool {
        false
    }
    fn is_missing_column(_: &sqlx::Error) -> bool {
        false
    }
}

/// The statements that cannot be written the same way in every dialect, and
/// their execution, one implementation per store (`mysql.rs`, `sqlite.rs`,
/// `postgres.rs`).
pub(crate) mod engine {
    use super::Future;

    /// The fence table's statements for one table.
    #[derive(Debug, Clone)]
    pub struct FenceSql {
        /// Creates the table if missing.
        pub create: String,
        /// Records a token: never lowers the stored one.
        pub raise: std::sync::Arc<str>,
        /// Reads the stored token (a plain read).
        pub read: std::sync::Arc<str>,
        /// Reads the stored token as a writer sees it, whatever the
        /// transaction's snapshot (or fails where the store refuses to read
        /// past it). Where `raise` returns the token itself, unused.
        pub read_current: std::sync::Arc<str>,
    }

    /// A token to record for a resource (both validated).
    #[derive(Debug, Clone, Copy)]
    pub struct Entry<'a> {
        /// The resource's name.
        pub resource: &'a str,
        /// The token.
        pub token: u64,
    }

    /// What recording a token found.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub struct Raised {
        /// Whether the statement says it stored the token; `None` when it
        /// cannot say (then `highest` decides).
        pub stored: Option<bool>,
        /// The stored token right after the statement (wide enough for any
        /// store's integer, so a bad row is reported as it is).
        pub highest: i128,
    }

    /// The migration log's statements for one log table.
    #[derive(Debug, Clone)]
    pub struct LogSql {
        /// Creates the log if missing.
        pub create: String,
        /// Every applied version.
        pub versions: String,
        /// Records one version (binds: version, name).
        pub record: String,
    }

    /// Sealed: implemented in this crate for each supported sqlx database.
    pub trait Engine: sqlx::Database {
        /// Whether `$tag$ … $tag$` quotes a string (a function body), whose
        /// `;` then ends no statement when a migration is split.
        const DOLLAR_QUOTING: bool = false;
        /// The fence table `t` (quoted).
        fn fence_sql(t: &str) -> FenceSql;
        /// Records `entry` and reads the stored token back.
        fn fence_raise<'c>(
            conn: &'c mut Self::Connection,
            sql: &'c FenceSql,
            entry: Entry<'c>,
        ) -> impl Future<Output = Result<Raised, sqlx::Error>> + Send + 'c;
        /// The stored token of `resource`, read with `sql`.
        fn fence_read<'c>(
            conn: &'c mut Self::Connection,
            sql: &'c str,
            resource: &'c str,
        ) -> impl Future<Output = Result<Option<i128>, sqlx::Error>> + Send + 'c;
        /// Runs one statement without parameters.
        fn execute<'c>(
            conn: &'c mut Self::Connection,
            sql: String,
        ) -> impl Future<Output = Result<(), sqlx::Error>> + Send + 'c;
        /// The migration log `log` (quoted).
        fn log_sql(log: &str) -> LogSql;
        /// The versions in the log.
        fn log_versions<'c>(
            conn: &'c mut Self::Connection,
            sql: &'c LogSql,
        ) -> impl Future<Output = Result<Vec<u32>, sqlx::Error>> + Send + 'c;
        /// Records a version in the log.
        fn log_record<'c>(
            conn: &'c mut Self::Connection,
            sql: &'c LogSql,
            version: u32,
            name: &'static str,
        ) -> impl Future<Output = Result<(), sqlx::Error>> + Send + 'c;
    }
}

/// The [`engine::Engine`] methods every store writes the same way: `$conn`
/// is its connection, `$int` the integer it stores tokens and versions as,
/// and `$resource` the function from a resource name to the value bound for
/// it (its bytes, or the text itself).
macro_rules! shared_engine_methods {
    ($conn:ty, $int:ty, $resource:expr) => {
        async fn fence_read<'c>(
            conn: &'c mut $conn,
            sql: &'c str,
            resource: &'c str,
        ) -> Result<Option<i128>, sqlx::Error> {
            let token: Option<$int> = sqlx::query(sqlx::AssertSqlSafe(sql))
                .bind(($resource)(resource))
                .fetch_optional(conn)
                .await?
                .map(|r| sqlx::Row::try_get(&r, 0))
                .transpose()?;
            Ok(token.map(i128::from))
        }

        async fn execute(conn: &mut $conn, sql: String) -> Result<(), sqlx::Error> {
            sqlx::query(sqlx::AssertSqlSafe(sql))
                .execute(conn)
                .await
                .map(|_| ())
        }

        async fn log_versions<'c>(
            conn: &'c mut $conn,
            sql: &'c LogSql,
        ) -> Result<Vec<u32>, sqlx::Error> {
            let rows = sqlx::query(sqlx::AssertSqlSafe(sql.versions.as_str()))
                .fetch_all(conn)
                .await?;
            let mut versions = Vec::with_capacity(rows.len());
            for row in &rows {
                // A version this build cannot name is none of its own.
                if let Ok(v) = u32::try_from(sqlx::Row::try_get::<$int, _>(row, 0)?) {
                    versions.push(v);
                }
            }
            Ok(versions)
        }

        async fn log_record<'c>(
            conn: &'c mut $conn,
            sql: &'c LogSql,
            version: u32,
            name: &'static str,
        ) -> Result<(), sqlx::Error> {
            sqlx::query(sqlx::AssertSqlSafe(sql.record.as_str()))
                .bind(<$int>::from(version))
                .bind(name)
                .execute(conn)
                .await
                .map(|_| ())
        }
    };
}
pub(crate) use shared_engine_methods;
