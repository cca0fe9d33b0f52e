//! The one place where sqlx / file-system errors become fenced errors.

use std::{fmt, path::Path};

use fenced_api::Error;
use sqlx::error::ErrorKind;

pub(crate) const BACKEND: &str = "sqlite";

/// SQLite primary result codes we act on (the low byte of the extended code).
mod code {
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

/// Maps any other sqlx error to `Error::Backend` — retryable when waiting
/// may help (busy, disk full, pool exhausted) — or `Error::Config` where the
/// fix is configuration (a table dropped behind our back).
pub(crate) fn map(e: sqlx::Error) -> Error {
    if let sqlx::Error::Database(db) = &e {
        if db.message().contains("no such table") {
            return Error::config(format!(
                "the lock table does not exist ({e}); it is created by `SqliteLock::connect` \
                 (or `fenced migrate --url …`) — was it dropped while in use?"
            ));
        }
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

/// `?`-friendly conversion for query results.
pub(crate) trait SqlResultExt<T> {
    fn db(self) -> fenced_api::Result<T>;
}

impl<T> SqlResultExt<T> for Result<T, sqlx::Error> {
    fn db(self) -> fenced_api::Result<T> {
        self.map_err(map)
    }
}
