//! The one place where sqlx / file-system errors become fenced errors.

use std::{fmt, path::Path};

use fenced_api::Error;
use sqlx::error::ErrorKind;

pub(crate) const BACKEND: &str = "sqlite";

/// SQLite primary result codes we act on (the low byte of the extended code).
mod code {
    /// A generic error: a missing table or column, a syntax error, …
    pub(super) const ERROR: i32 = 1;
    /// Another connection holds the lock we need, past `busy_timeout`.
    pub(super) const BUSY: i32 = 5;
    /// A table is locked by this process's shared cache.
    pub(super) const LOCKED: i32 = 6;
    /// A write to a read-only file or directory.
    pub(super) const READONLY: i32 = 8;
    /// The file is malformed.
    pub(super) const CORRUPT: i32 = 11;
    /// The disk is full.
    pub(super) const FULL: i32 = 13;
    /// The file (or its directory, for the WAL) cannot be opened.
    pub(super) const CANTOPEN: i32 = 14;
    /// WAL locking protocol race; SQLite documents it as transient.
    pub(super) const PROTOCOL: i32 = 15;
    /// The file is not a database.
    pub(super) const NOTADB: i32 = 26;
}

/// SQLite's primary result code, if `e` came from SQLite.
fn primary_code(e: &sqlx::Error) -> Option<i32> {
    match e {
        sqlx::Error::Database(db) => db
            .code()
            .and_then(|c| c.parse::<i32>().ok())
            .map(|c| c & 0xff),
        _ => None,
    }
}

/// A UNIQUE violation: somebody holds the key.
pub(crate) fn is_unique_violation(e: &sqlx::Error) -> bool {
    matches!(e, sqlx::Error::Database(db) if db.kind() == ErrorKind::UniqueViolation)
}

/// Whether `e` means "another connection held the database past `busy_timeout`".
pub(crate) fn is_busy(e: &sqlx::Error) -> bool {
    matches!(primary_code(e), Some(code::BUSY | code::LOCKED))
}

/// Whether `e` says that a table does not exist.
///
/// SQLite reports it only in the text of a generic `SQLITE_ERROR` (no code
/// of its own, no sqlx error kind): the text refines that code, nothing else.
pub(crate) fn is_no_such_table(e: &sqlx::Error) -> bool {
    generic_error_says(e, "no such table")
}

/// Whether `e` says that a column does not exist: as [`is_no_such_table`],
/// only in the text of a generic `SQLITE_ERROR`.
pub(crate) fn is_no_such_column(e: &sqlx::Error) -> bool {
    generic_error_says(e, "no such column")
}

/// Whether `e` is a generic `SQLITE_ERROR` whose message starts with `what`.
fn generic_error_says(e: &sqlx::Error, what: &str) -> bool {
    match e {
        sqlx::Error::Database(db) => {
            primary_code(e) == Some(code::ERROR) && db.message().starts_with(what)
        }
        _ => false,
    }
}

/// Maps any other sqlx error to `Error::Backend` — retryable when waiting
/// may help (busy, disk full, pool exhausted) — or `Error::Config` where the
/// fix is configuration (a table dropped behind our back).
pub(crate) fn map(e: sqlx::Error) -> Error {
    if is_no_such_table(&e) {
        return Error::config(format!(
            "the lock table does not exist ({e}); it is created by `SqliteLock::connect` \
             (or `fenced migrate --url …`) — was it dropped while in use?"
        ));
    }
    let retryable = match &e {
        sqlx::Error::Io(_) | sqlx::Error::PoolTimedOut | sqlx::Error::WorkerCrashed => true,
        sqlx::Error::Database(_) => matches!(
            primary_code(&e),
            Some(code::BUSY | code::LOCKED | code::FULL | code::PROTOCOL)
        ),
        _ => false,
    };
    Error::backend(BACKEND, retryable, e)
}

/// Maps a failure to open or prepare the database file, naming the file and
/// what to do about it.
pub(crate) fn open_failed(path: &Path, e: sqlx::Error) -> Error {
    let hint = match primary_code(&e) {
        Some(code::BUSY | code::LOCKED) => {
            "another process holds the file locked; retry later, or raise busy_timeout"
        }
        Some(code::CANTOPEN | code::READONLY) => {
            "check that the file and its directory exist and are writable by this user \
             (SQLite also creates `-wal` and `-shm` files beside it)"
        }
        Some(code::NOTADB | code::CORRUPT) => {
            "the file is not a healthy SQLite database; point the url at another file"
        }
        _ => "check the path in the sqlite:// url",
    };
    let retryable = map_retryable(&e);
    Error::backend(
        BACKEND,
        retryable,
        Context {
            what: format!("cannot open the lock database {}; {hint}", path.display()),
            source: Box::new(e),
        },
    )
}

/// A failure to create the directory that holds the database file.
pub(crate) fn create_dir_failed(dir: &Path, e: std::io::Error) -> Error {
    Error::backend(
        BACKEND,
        false,
        Context {
            what: format!(
                "cannot create the directory {} for the lock database; choose a writable \
                 location (sqlite:///path/to/locks.db, or FENCED_HOME for the default)",
                dir.display()
            ),
            source: Box::new(e),
        },
    )
}

fn map_retryable(e: &sqlx::Error) -> bool {
    matches!(
        primary_code(e),
        Some(code::BUSY | code::LOCKED | code::FULL | code::PROTOCOL)
    ) || matches!(e, sqlx::Error::PoolTimedOut)
}

/// A message that says what failed, with the underlying error as its source.
#[derive(Debug)]
struct Context {
    what: String,
    source: Box<dyn std::error::Error + Send + Sync + 'static>,
}

impl fmt::Display for Context {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.what, self.source)
    }
}

impl std::error::Error for Context {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&*self.source)
    }
}

/// How the shared SQL code (`fenced_sql`: the fence, the migration runner)
/// sees this backend: SQLite, with this crate's error mapping.
#[derive(Debug, Clone, Copy)]
pub struct SqliteBackend;

impl fenced_sql::SqlBackend for SqliteBackend {
    type Db = sqlx::Sqlite;
    const BACKEND: &'static str = BACKEND;
    fn map(e: sqlx::Error) -> Error {
        map(e)
    }
    fn is_missing_table(e: &sqlx::Error) -> bool {
        is_no_such_table(e)
    }
    fn is_missing_column(e: &sqlx::Error) -> bool {
        is_no_such_column(e)
    }
}

/// `?`-friendly conversion for query results.
pub(crate) trait SqlResultExt<T> {
    fn db(self) -> fenced_api::Result<T>;
}

impl<T> SqlResultExt<T> for Result<T, sqlx::Error> {
    fn db(self) -> fenced_api::Result<T> {
        self.map_err(map)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sqlx::{Connection, SqliteConnection};

    #[tokio::test]
    async fn missing_tables_and_columns_are_told_apart_from_other_errors() {
        let mut conn = SqliteConnection::connect("sqlite::memory:").await.unwrap();
        sqlx::query("CREATE TABLE t (a INTEGER)")
            .execute(&mut conn)
            .await
            .unwrap();
        let fail = |sql: &'static str| sqlx::query(sql);
        let no_table = fail("SELECT a FROM nowhere")
            .execute(&mut conn)
            .await
            .unwrap_err();
        let no_column = fail("SELECT b FROM t")
            .execute(&mut conn)
            .await
            .unwrap_err();
        let syntax = fail("SELEC 1").execute(&mut conn).await.unwrap_err();
        assert!(is_no_such_table(&no_table), "{no_table}");
        assert!(!is_no_such_column(&no_table), "{no_table}");
        assert!(is_no_such_column(&no_column), "{no_column}");
        assert!(!is_no_such_table(&no_column), "{no_column}");
        assert!(!is_no_such_table(&syntax) && !is_no_such_column(&syntax));
        assert!(!is_no_such_table(&sqlx::Error::RowNotFound));
        assert!(matches!(map(no_table), Error::Config { .. }));
        assert!(matches!(
            map(syntax),
            Error::Backend {
                retryable: false,
                ..
            }
        ));
    }
}
