//! Connections: the session every connection fenced opens gets, the check
//! of the server made before anything else (a primary, a version this build
//! supports), and the statement pool.
//!
//! Every session runs one set-up statement right after it is opened:
//!
//! * `synchronous_commit = on`, whatever the server, database or role
//!   default: a grant's commit — and with it the WAL record of the
//!   `nextval` that made its token — is on disk before the client hears of
//!   it, so no token is handed out twice after a crash;
//! * `statement_timeout` = the operation timeout: a statement the client
//!   gave up on (its call is bounded by the same duration) does not keep
//!   running, holding a row lock, on the server;
//! * `pg_is_in_recovery()` and the server version, so that a pool
//!   connection that lands on a hot standby (after a failover behind one
//!   address) is refused instead of used.
//!
//! `application_name` is `fenced` unless the URL names one (it shows in
//! `pg_stat_activity`).

use std::{future::Future, io, time::Duration};

use fenced_api::{Error, Result};
use sqlx::{
    postgres::{PgConnectOptions, PgPoolOptions},
    ConnectOptions, Connection, PgConnection, PgPool, Row,
};

use crate::{
    config::{server_name, PostgresConfig, Strategy},
    error,
};

/// The oldest server the `lease` strategy runs on. Its statements need 10
/// (`CREATE SEQUENCE … AS BIGINT`); 12 is the oldest release this crate
/// supports at all (older ones are past their end of life).
pub(crate) const MIN_VERSION: i32 = 120_000;
/// The oldest server `advisory` runs on: it needs `idle_session_timeout` (14).
pub(crate) const MIN_VERSION_ADVISORY: i32 = 140_000;

/// A pooled connection idle for longer than this is pinged before it is
/// handed out (a server restart or an idle disconnect is found before a
/// statement is sent on it); a busier one is used as it is, saving a round
/// trip per operation. The same bound as the hot-connection cache's
/// ([`fenced_sql::Conns`]), whose stale connections come back this way.
const FRESH: Duration = fenced_sql::conns::FRESH;

/// The options every connection uses: the URL's, with `application_name`
/// `fenced` unless the URL set one.
pub(crate) fn connect_options(config: &PostgresConfig) -> PgConnectOptions {
    let o = config.connect.clone();
    if o.get_application_name().is_some() {
        o
    } else {
        o.application_name("fenced")
    }
}

/// What the set-up statement learnt about the server.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Server {
    pub(crate) in_recovery: bool,
    /// `server_version_num`, e.g. 150020.
    pub(crate) version: i32,
}

/// Runs the session set-up statement on a new connection (one round trip).
pub(crate) async fn set_up(
    conn: &mut PgConnection,
    statement_timeout: Duration,
) -> std::result::Result<Server, sqlx::Error> {
    let row = sqlx::query(
        "SELECT set_config('synchronous_commit', 'on', false), \
         set_config('statement_timeout', $1, false), \
         pg_is_in_recovery(), current_setting('server_version_num')::int",
    )
    .bind(format!("{}ms", statement_timeout.as_millis().max(1)))
    .fetch_one(conn)
    .await?;
    Ok(Server {
        in_recovery: row.try_get(2)?,
        version: row.try_get(3)?,
    })
}

/// The minimum server version of a strategy.
fn min_version(strategy: Strategy) -> i32 {
    match strategy {
        Strategy::Lease => MIN_VERSION,
        Strategy::Advisory => MIN_VERSION_ADVISORY,
    }
}

/// `150020` as `15.20`, `90624` as `9.6.24`.
fn version_text(v: i32) -> String {
    if v >= 100_000 {
        format!("{}.{}", v / 10_000, v % 10_000)
    } else {
        format!("{}.{}.{}", v / 10_000, v / 100 % 100, v % 100)
    }
}

/// Refuses a hot standby and a server older than `strategy` needs.
pub(crate) fn check_server(server: Server, at: &str, strategy: Strategy) -> Result<()> {
    if server.in_recovery {
        return Err(Error::config(format!(
            "the postgres server at {at} is a hot standby (pg_is_in_recovery() is true): \
             locks must live on the primary; connect to the primary instead"
        )));
    }
    let needed = min_version(strategy);
    if server.version < needed {
        return Err(Error::config(format!(
            "the postgres server at {at} runs PostgreSQL {}; the {strategy} strategy needs {} \
             or later",
            version_text(server.version),
            version_text(needed)
        )));
    }
    Ok(())
}

/// Opens one connection directly, checks the server and closes it.
///
/// A pool retries a refused connection until its timeout and then reports
/// only "pool timed out", which hides the cause (refused? wrong host? TLS?
/// a standby?); this one fails fast with it. The pool then starts empty.
pub(crate) async fn check_first(config: &PostgresConfig) -> Result<()> {
    let at = server_name(&config.connect);
    let opts = connect_options(config);
    let first = tokio::time::timeout(config.connect_timeout, async {
        let mut conn = opts.connect().await?;
        let server = set_up(&mut conn, config.operation_timeout).await;
        // Closed cleanly, but never waited on for long.
        let _ = tokio::time::timeout(config.connect_timeout, conn.close()).await;
        server
    })
    .await;
    match first {
        Ok(Ok(server)) => check_server(server, &at, config.strategy),
        Ok(Err(e)) => Err(error::connect_failed(&at, e)),
        Err(_) => Err(
            fenced_api::no_answer(error::BACKEND, "connect", config.connect_timeout)
                .connecting(&at),
        ),
    }
}

/// The statement pool: at most `max_connections`, connecting lazily (the
/// server was checked by [`check_first`]), each session set up as the
/// module docs say.
pub(crate) fn pool(config: &PostgresConfig) -> PgPool {
    let op = config.operation_timeout;
    PgPoolOptions::new()
        .max_connections(config.max_connections)
        .min_connections(0)
        .acquire_timeout(config.connect_timeout)
        .test_before_acquire(false)
        .before_acquire(|conn, meta| {
            Box::pin(async move {
                if meta.idle_for >= FRESH {
                    conn.ping().await?;
                }
                Ok(true)
            })
        })
        .after_connect(move |conn, _| {
            Box::pin(async move {
                let server = set_up(conn, op).await?;
                if server.in_recovery {
                    // The pool retries until its acquire timeout; the
                    // caller then gets a retryable "pool timed out".
                    return Err(sqlx::Error::Configuration(
                        "the server is a hot standby (pg_is_in_recovery()); locks must live \
                         on the primary"
                            .into(),
                    ));
                }
                Ok(())
            })
        })
        .connect_lazy_with(connect_options(config))
}

/// Whether `e` says the connection was dead before the statement could
/// be answered: the server closed it (it restarted, or ended the session)
/// since the connection was last used.
fn dead_connection(e: &sqlx::Error) -> bool {
    matches!(e, sqlx::Error::Io(io) if matches!(
        io.kind(),
        io::ErrorKind::UnexpectedEof
            | io::ErrorKind::ConnectionReset
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::BrokenPipe
    ))
}

/// Runs a one-statement operation on the pool, again on another connection
/// while the one it got was dead — at most `pool_size` times more, since
/// each dead connection is closed when it fails.
///
/// After a server restart every pooled connection is dead, and one used in
/// the last 2 s is not pinged before use: without this each of them would
/// fail one caller's operation. The statements retried are safe to repeat
/// (a renewal, a read) or, if a lost reply hid a commit, end as a
/// cancelled call would (a grant nobody hears of expires after its TTL; a
/// release repeated answers `NotHeld`).
pub(crate) async fn on_live_connection<T, F, Fut>(
    pool_size: u32,
    mut op: F,
) -> std::result::Result<T, sqlx::Error>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = std::result::Result<T, sqlx::Error>>,
{
    let mut dead = 0;
    loop {
        match op().await {
            Err(e) if dead_connection(&e) && dead < pool_size => {
                dead += 1;
                tracing::debug!(error = %e, "a pooled connection was dead; trying another");
            }
            other => return other,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn only_dead_connections_are_retried_and_only_pool_size_times() {
        use std::sync::atomic::{AtomicU32, Ordering};
        let calls = AtomicU32::new(0);
        let eof = || sqlx::Error::Io(io::Error::new(io::ErrorKind::UnexpectedEof, "eof"));
        let r: std::result::Result<(), _> = on_live_connection(3, || {
            calls.fetch_add(1, Ordering::SeqCst);
            async { Err(eof()) }
        })
        .await;
        assert!(r.is_err());
        assert_eq!(calls.load(Ordering::SeqCst), 4);
        calls.store(0, Ordering::SeqCst);
        let r = on_live_connection(3, || {
            let n = calls.fetch_add(1, Ordering::SeqCst);
            async move {
                if n < 2 {
                    Err(eof())
                } else {
                    Ok(n)
                }
            }
        })
        .await;
        assert_eq!(r.unwrap(), 2);
        calls.store(0, Ordering::SeqCst);
        let r: std::result::Result<(), _> = on_live_connection(3, || {
            calls.fetch_add(1, Ordering::SeqCst);
            async { Err(sqlx::Error::PoolTimedOut) }
        })
        .await;
        assert!(r.is_err());
        assert_eq!(calls.load(Ordering::SeqCst), 1, "not a dead connection");
    }

    #[test]
    fn versions_are_named_as_people_write_them() {
        assert_eq!(version_text(150_020), "15.20");
        assert_eq!(version_text(120_000), "12.0");
        assert_eq!(version_text(90_624), "9.6.24");
    }

    #[test]
    fn standbys_and_old_servers_are_refused_by_name() {
        let standby = Server {
            in_recovery: true,
            version: 150_000,
        };
        let e = check_server(standby, "db:5432", Strategy::Lease).unwrap_err();
        let text = e.to_string();
        assert!(matches!(e, Error::Config { .. }), "{e:?}");
        assert!(
            text.contains("hot standby") && text.contains("primary"),
            "{text}"
        );
        let old = Server {
            in_recovery: false,
            version: 110_022,
        };
        let e = check_server(old, "db:5432", Strategy::Lease).unwrap_err();
        assert!(e.to_string().contains("11.22"), "{e}");
        let v13 = Server {
            in_recovery: false,
            version: 130_010,
        };
        assert!(check_server(v13, "db", Strategy::Lease).is_ok());
        let e = check_server(v13, "db", Strategy::Advisory).unwrap_err();
        assert!(
            e.to_string().contains("advisory strategy needs 14.0"),
            "{e}"
        );
    }
}
