//! The one place where sqlx errors become fenced errors.

use std::{future::Future, time::Duration};

use fenced_api::{Error, Result};

pub(crate) const BACKEND: &str = "mysql";

/// MySQL/MariaDB error numbers we act on.
pub(crate) mod code {
    /// ER_LOCK_WAIT_TIMEOUT (also MariaDB's answer to `NOWAIT`).
    pub(crate) const LOCK_WAIT_TIMEOUT: u16 = 1205;
    /// ER_LOCK_DEADLOCK: this statement was the deadlock victim.
    pub(crate) const DEADLOCK: u16 = 1213;
    /// ER_NO_SUCH_TABLE.
    pub(crate) const NO_SUCH_TABLE: u16 = 1146;
    /// ER_LOCK_NOWAIT (MySQL 8's answer to `NOWAIT`).
    pub(crate) const LOCK_NOWAIT: u16 = 3572;
    /// ER_OPTION_PREVENTS_STATEMENT (`--read-only`).
    pub(crate) const READ_ONLY: u16 = 1290;
    /// Server shutdown, connection killed, too many connections, query
    /// interrupted, MySQL 8's inactivity disconnect.
    pub(crate) const TRANSIENT: [u16; 5] = [1053, 1927, 1040, 1317, 4031];
    /// Errors that end the session: server shutdown, connection killed,
    /// MySQL 8's inactivity disconnect, server gone away, lost connection.
    pub(crate) const SESSION_ENDED: [u16; 5] = [1053, 1927, 4031, 2006, 2013];
    /// ER_NO_SUCH_THREAD: `KILL` of a connection that is gone.
    pub(crate) const NO_SUCH_THREAD: u16 = 1094;
}

/// The server's error number, if `e` came from the server.
pub(crate) fn number(e: &sqlx::Error) -> Option<u16> {
    match e {
        sqlx::Error::Database(db) => db
            .try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>()
            .map(|m| m.number()),
        _ => None,
    }
}

/// Lock wait timeout, `NOWAIT` refusal or deadlock victim: not acquired —
/// never to be read as success.
pub(crate) fn is_lock_conflict(e: &sqlx::Error) -> bool {
    matches!(
        number(e),
        Some(code::LOCK_WAIT_TIMEOUT | code::LOCK_NOWAIT | code::DEADLOCK)
    )
}

/// Maps any other sqlx error to `Error::Backend`, or `Error::Config` where
/// the fix is configuration (missing table, read-only server).
pub(crate) fn map(e: sqlx::Error) -> Error {
    match number(&e) {
        Some(code::NO_SUCH_TABLE) => {
            return Error::config(format!(
                "the lock table does not exist ({e}); create it once with `MySqlLock::migrate()` \
                 (or `fenced migrate --url …`)"
            ))
        }
        Some(code::READ_ONLY) => {
            return Error::config(format!(
                "the server is read-only ({e}); locks must live on the primary, never on a replica"
            ))
        }
        _ => {}
    }
    let retryable = match &e {
        sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::Protocol(_)
        | sqlx::Error::WorkerCrashed => true,
        sqlx::Error::Database(_) => number(&e).is_some_and(|n| {
            code::TRANSIENT.contains(&n) || matches!(n, code::LOCK_WAIT_TIMEOUT | code::DEADLOCK)
        }),
        _ => false,
    };
    Error::backend(BACKEND, retryable, e)
}

/// A failed first connection, as one line naming the server (never the
/// password) and the cause.
///
/// The server's own refusals (wrong password, unknown database) are mapped
/// like any statement's error: retrying the same settings will not help.
/// Transport failures go through [`Error::connecting`], which reads the
/// cause from the I/O error's kind (refused, unreachable, no answer) and adds
/// what to check; a TLS failure keeps the TLS library's reason.
pub(crate) fn connect_failed(at: &str, e: sqlx::Error) -> Error {
    match e {
        sqlx::Error::Database(_) => map(e),
        sqlx::Error::Configuration(c) => {
            cannot_connect(at, false, format!("invalid settings: {c}"))
        }
        sqlx::Error::Tls(t) => cannot_connect(at, true, format!("TLS failed: {t}")),
        other => Error::backend(BACKEND, true, other).connecting(at),
    }
}

fn cannot_connect(at: &str, retryable: bool, cause: String) -> Error {
    // One line, whatever the OS or the TLS library put in the message.
    let cause = cause.replace(['\n', '\r'], " ");
    Error::backend(
        BACKEND,
        retryable,
        format!("cannot connect to mysql at {at}: {cause}"),
    )
}

/// Bounds one call to the server by `limit`: a silent network or a stalled
/// server yields a retryable [`Error::Backend`] naming `what` and the bound.
pub(crate) async fn bounded<T>(
    what: &str,
    limit: Duration,
    call: impl Future<Output = Result<T>>,
) -> Result<T> {
    fenced_api::bounded(BACKEND, what, limit, call).await
}

/// `?`-friendly conversion for query results.
pub(crate) trait SqlResultExt<T> {
    fn db(self) -> Result<T>;
}

impl<T> SqlResultExt<T> for std::result::Result<T, sqlx::Error> {
    fn db(self) -> Result<T> {
        self.map_err(map)
    }
}

/// Whether a connection that just returned `e` is still in sync with a live
/// server session and may be reused ([`fenced_sql::leaves_session_usable`]).
pub(crate) fn leaves_session_usable(e: &sqlx::Error) -> bool {
    fenced_sql::leaves_session_usable::<MySqlBackend>(e)
}

/// How the shared SQL code (`fenced_sql`: the fence, the migration runner)
/// sees this backend: MySQL, with this crate's error mapping.
#[derive(Debug, Clone, Copy)]
pub struct MySqlBackend;

/// ER_BAD_FIELD_ERROR: unknown column.
const ER_BAD_FIELD: u16 = 1054;

impl fenced_sql::SqlBackend for MySqlBackend {
    type Db = sqlx::MySql;
    const BACKEND: &'static str = BACKEND;
    fn map(e: sqlx::Error) -> Error {
        map(e)
    }
    fn is_missing_table(e: &sqlx::Error) -> bool {
        number(e) == Some(code::NO_SUCH_TABLE)
    }
    fn is_missing_column(e: &sqlx::Error) -> bool {
        number(e) == Some(ER_BAD_FIELD)
    }
    fn ends_session(e: &sqlx::Error) -> bool {
        number(e).is_some_and(|n| code::SESSION_ENDED.contains(&n))
    }
}
