//! The one place where sqlx errors become fenced errors, by SQLSTATE.

use std::{future::Future, time::Duration};

use fenced_api::{Error, Result};

pub(crate) const BACKEND: &str = "postgres";

/// The SQLSTATEs acted on (PostgreSQL's Appendix A).
pub(crate) mod state {
    /// unique_violation.
    #[allow(dead_code)] // for the advisory strategy
    pub(crate) const UNIQUE_VIOLATION: &str = "23505";
    /// undefined_table.
    pub(crate) const UNDEFINED_TABLE: &str = "42P01";
    /// undefined_column.
    pub(crate) const UNDEFINED_COLUMN: &str = "42703";
    /// undefined_object (e.g. a sequence that does not exist).
    pub(crate) const UNDEFINED_OBJECT: &str = "42704";
    /// insufficient_privilege: the role may not read, write or create the tables.
    pub(crate) const INSUFFICIENT_PRIVILEGE: &str = "42501";
    /// read_only_sql_transaction: a hot standby, or `default_transaction_read_only`.
    pub(crate) const READ_ONLY: &str = "25006";
    /// lock_not_available: `lock_timeout` passed, or `NOWAIT` refused.
    pub(crate) const LOCK_NOT_AVAILABLE: &str = "55P03";
    /// query_canceled: `statement_timeout` passed, or a cancel request.
    #[allow(dead_code)] // for the advisory strategy
    pub(crate) const QUERY_CANCELED: &str = "57014";
    /// serialization_failure.
    #[allow(dead_code)] // for the advisory strategy
    pub(crate) const SERIALIZATION_FAILURE: &str = "40001";
    /// deadlock_detected.
    #[allow(dead_code)] // for the advisory strategy
    pub(crate) const DEADLOCK: &str = "40P01";
    /// idle_session_timeout: the server ended a session idle past the limit
    /// (what ends a frozen `advisory` holder's session).
    #[allow(dead_code)] // for the advisory strategy
    pub(crate) const IDLE_SESSION_TIMEOUT: &str = "57P05";

    /// Classes and codes after which the same statement may well succeed:
    /// connection exceptions (08), transaction rollbacks — serialization
    /// failures, deadlocks (40), insufficient resources such as too many
    /// connections (53), operator intervention — shutdown, terminated
    /// backend, cancelled statement, the server starting up (57), and
    /// lock_not_available (55P03).
    pub(crate) fn is_transient(code: &str) -> bool {
        code.starts_with("08")
            || code.starts_with("40")
            || code.starts_with("53")
            || code.starts_with("57")
            || code == LOCK_NOT_AVAILABLE
    }

    /// Codes that end the session: whatever the connection held (an
    /// advisory lock) is gone with it. Connection exceptions (08) and the
    /// operator interventions of class 57P: shutdown, crash,
    /// `pg_terminate_backend` (57P01), a dropped database, the
    /// `idle_session_timeout` (57P05) — and 25P03, the
    /// `idle_in_transaction_session_timeout` that ends a transaction-scoped
    /// advisory holder gone silent.
    pub(crate) fn ends_session(code: &str) -> bool {
        code.starts_with("08") || code.starts_with("57P") || code == "25P03"
    }
}

/// The SQLSTATE, if `e` came from the server.
pub(crate) fn sqlstate(e: &sqlx::Error) -> Option<String> {
    match e {
        sqlx::Error::Database(db) => db.code().map(|c| c.into_owned()),
        _ => None,
    }
}

fn has_state(e: &sqlx::Error, code: &str) -> bool {
    sqlstate(e).as_deref() == Some(code)
}

/// A duplicate key: another row holds the unique value.
#[allow(dead_code)] // for the advisory strategy
pub(crate) fn is_unique_violation(e: &sqlx::Error) -> bool {
    has_state(e, state::UNIQUE_VIOLATION)
}

/// `lock_timeout` passed or `NOWAIT` refused: not acquired — never to be
/// read as success.
#[allow(dead_code)] // for the advisory strategy
pub(crate) fn is_lock_not_available(e: &sqlx::Error) -> bool {
    has_state(e, state::LOCK_NOT_AVAILABLE)
}

/// Maps any sqlx error to `Error::Backend`, or `Error::Config` where the
/// fix is configuration (missing table, read-only server).
pub(crate) fn map(e: sqlx::Error) -> Error {
    match sqlstate(&e).as_deref() {
        Some(state::UNDEFINED_TABLE | state::UNDEFINED_OBJECT) => {
            return Error::config(format!(
                "the lock tables do not exist ({e}); create them once with \
                 `PostgresLock::migrate()` (or `fenced migrate --url …`)"
            ))
        }
        Some(state::INSUFFICIENT_PRIVILEGE) => {
            return Error::config(format!(
                "the role lacks a privilege on the lock tables ({e}); grant it, or create the \
                 tables with `PostgresLock::migrate()` (or `fenced migrate --url …`) as a role \
                 that may"
            ))
        }
        Some(state::READ_ONLY) => {
            return Error::config(format!(
                "the server is read-only ({e}); locks must live on the primary, never on a \
                 hot standby"
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
        sqlx::Error::Database(_) => sqlstate(&e).is_some_and(|c| state::is_transient(&c)),
        _ => false,
    };
    Error::backend(BACKEND, retryable, e)
}

/// A failed first connection, as one line naming the server (never the
/// password) and the cause.
///
/// The server's own refusals (wrong password, unknown database, no
/// `pg_hba.conf` entry) are mapped like any statement's error: retrying the
/// same settings will not help. Transport failures go through
/// [`Error::connecting`], which reads the cause from the I/O error's kind
/// (refused, unreachable, no answer) and adds what to check; a TLS failure
/// keeps the TLS library's reason.
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
        format!("cannot connect to postgres at {at}: {cause}"),
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
    fenced_sql::leaves_session_usable::<PostgresBackend>(e)
}

/// How the shared SQL code (`fenced_sql`: the fence, the migration runner)
/// sees this backend: PostgreSQL, with this crate's error mapping.
#[derive(Debug, Clone, Copy)]
pub struct PostgresBackend;

impl fenced_sql::SqlBackend for PostgresBackend {
    type Db = sqlx::Postgres;
    const BACKEND: &'static str = BACKEND;
    fn map(e: sqlx::Error) -> Error {
        map(e)
    }
    fn is_missing_table(e: &sqlx::Error) -> bool {
        has_state(e, state::UNDEFINED_TABLE)
    }
    fn is_missing_column(e: &sqlx::Error) -> bool {
        has_state(e, state::UNDEFINED_COLUMN)
    }
    fn ends_session(e: &sqlx::Error) -> bool {
        sqlstate(e).is_some_and(|c| state::ends_session(&c))
    }
}

#[cfg(test)]
mod tests {
    use super::state;

    #[test]
    fn transient_states() {
        for code in [
            "08006", "08001", "40001", "40P01", "53300", "57P01", "57014", "55P03",
        ] {
            assert!(state::is_transient(code), "{code}");
        }
        for code in ["23505", "42P01", "28P01", "3D000", "22P02", "25006"] {
            assert!(!state::is_transient(code), "{code}");
        }
    }

    #[test]
    fn states_that_end_the_session() {
        for code in ["57P01", "57P02", "57P05", "08006", "25P03"] {
            assert!(state::ends_session(code), "{code}");
        }
        for code in ["57014", "55P03", "23505", "40001"] {
            assert!(!state::ends_session(code), "{code}");
        }
    }
}
