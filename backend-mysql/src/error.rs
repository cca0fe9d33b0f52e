//! The one place where sqlx errors become fenced errors.

use fenced_api::Error;

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
/// password) and the cause: refused, timed out, unknown host, TLS.
pub(crate) fn connect_failed(cfg: &crate::MySqlConfig, e: sqlx::Error) -> Error {
    let at = crate::config::server_name(&cfg.connect);
    let (cause, retryable) = match &e {
        sqlx::Error::Io(io) => (
            match io.kind() {
                std::io::ErrorKind::ConnectionRefused => {
                    "connection refused (is the server running?)".to_owned()
                }
                std::io::ErrorKind::TimedOut => {
                    "connection timed out (is the host reachable?)".to_owned()
                }
                _ => io.to_string(),
            },
            true,
        ),
        sqlx::Error::Tls(t) => (format!("TLS failed: {t}"), true),
        // Wrong password, unknown database…: the server answered; retrying
        // the same settings will not help.
        sqlx::Error::Database(_) => return map(e),
        sqlx::Error::Configuration(c) => (format!("invalid settings: {c}"), false),
        other => (other.to_string(), true),
    };
    // One line, whatever the OS or the TLS library put in the message.
    let cause = cause.replace(['\n', '\r'], " ");
    Error::backend(
        BACKEND,
        retryable,
        format!("cannot connect to mysql at {at}: {cause}"),
    )
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

/// Whether a connection that just returned `e` is still in sync with a live
/// server session and may be reused: yes for errors the server reported
/// about the statement (duplicate key, lock wait timeout…), no for I/O and
/// protocol failures or errors that end the session.
pub(crate) fn leaves_session_usable(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Database(_) => !matches!(number(e), Some(1053 | 1927 | 4031 | 2006 | 2013)),
        sqlx::Error::RowNotFound => true,
        _ => false,
    }
}
