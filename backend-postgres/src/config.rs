//! Configuration: from a URL or the builder, validated before connecting.

use std::{fmt, str::FromStr, time::Duration};

use fenced_api::url::{params, parse_duration, redact, split_query};
use fenced_api::{Error, Result};
use sqlx::postgres::PgConnectOptions;

/// How the lock is taken. See the crate documentation for when to choose which.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Strategy {
    /// A row per key in the lock table, taken by one conditional upsert;
    /// expiry on the database clock; the token from a sequence; waiters
    /// woken across processes by `LISTEN`/`NOTIFY`.
    #[default]
    Lease,
    /// A session-level advisory lock on a connection held for the lock;
    /// the server's own lock queue for waiting; the token from the same
    /// kind of sequence, taken once the lock is held.
    Advisory,
}

impl Strategy {
    /// The name used in URLs (`?strategy=…`).
    pub fn as_str(self) -> &'static str {
        match self {
            Strategy::Lease => "lease",
            Strategy::Advisory => "advisory",
        }
    }
}

impl FromStr for Strategy {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "lease" => Ok(Strategy::Lease),
            "advisory" => Ok(Strategy::Advisory),
            other => Err(Error::config(format!(
                "unknown postgres strategy `{other}`; use lease or advisory"
            ))),
        }
    }
}

impl fmt::Display for Strategy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A validated base table name (see [`fenced_sql::TableName`]); always used
/// double-quoted, so reserved words are fine. Derived names (the token
/// sequence, the migration log, the advisory table, the `NOTIFY` channel)
/// are the base name plus a suffix.
pub type TableName = fenced_sql::TableName<sqlx::Postgres>;

/// Everything needed to connect; built from a URL or
/// [`PostgresLockBuilder`](crate::PostgresLockBuilder).
#[derive(Clone)]
pub struct PostgresConfig {
    pub(crate) connect: PgConnectOptions,
    /// The URL with the password replaced, for messages and scopes.
    pub(crate) display_url: String,
    pub(crate) strategy: Strategy,
    pub(crate) table: TableName,
    pub(crate) max_connections: u32,
    pub(crate) max_lock_connections: u32,
    pub(crate) connect_timeout: Duration,
    pub(crate) operation_timeout: Duration,
    pub(crate) recheck_interval: Duration,
}

impl fmt::Debug for PostgresConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Never print the password: only the redacted URL.
        f.debug_struct("PostgresConfig")
            .field("url", &self.display_url)
            .field("strategy", &self.strategy)
            .field("table", &self.table)
            .field("max_connections", &self.max_connections)
            .field("max_lock_connections", &self.max_lock_connections)
            .field("connect_timeout", &self.connect_timeout)
            .field("operation_timeout", &self.operation_timeout)
            .field("recheck_interval", &self.recheck_interval)
            .finish()
    }
}

/// Default base table name.
pub const DEFAULT_TABLE: &str = "fenced_locks";
/// Default size of the pool that runs the short statements (every
/// `lease` operation; `advisory`'s inspect, list and token bookkeeping).
pub const DEFAULT_MAX_CONNECTIONS: u32 = 10;
/// Default bound on the connections `advisory` holds: one per held lock
/// and one per waiting `acquire`.
pub const DEFAULT_MAX_LOCK_CONNECTIONS: u32 = 64;
/// Default bound on connecting (and on waiting for a pooled connection).
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Default bound on one operation (a silent network never hangs a call longer).
pub const DEFAULT_OPERATION_TIMEOUT: Duration = Duration::from_secs(10);
/// Default pause between a `lease` waiter's re-checks of a held key: the
/// fallback behind `LISTEN`/`NOTIFY`, which wakes waiters at once on a
/// release. It bounds how late a waiter sees a key freed without a
/// notification — a holder's lease that expired, a notification lost while
/// the listening connection was down.
pub const DEFAULT_RECHECK_INTERVAL: Duration = Duration::from_millis(500);
/// Bounds of `recheck_interval`.
const RECHECK_BOUNDS: (Duration, Duration) = (Duration::from_millis(10), Duration::from_secs(10));

/// The parameters [`PostgresConfig::from_url`] accepts (`a|b`: two
/// spellings of one parameter). The ones after `recheck_interval` go to
/// sqlx.
const KNOWN: &[&str] = &[
    "strategy",
    "table",
    "max_connections",
    "max_lock_connections",
    "connect_timeout",
    "operation_timeout|timeout",
    "recheck_interval",
    "sslmode|ssl-mode",
    "sslrootcert|ssl-root-cert",
    "sslcert|ssl-cert",
    "sslkey|ssl-key",
    "application_name",
    "host",
    "statement-cache-capacity",
];

impl PostgresConfig {
    /// Parses `postgres://user:pass@host:5432/db?strategy=…&table=…`
    /// (also `postgresql://`).
    ///
    /// fenced's parameters: `strategy` (`lease`, the default, or
    /// `advisory`), `table` (default `fenced_locks`), `max_connections`
    /// (the statement pool, default 10), `max_lock_connections` (the
    /// connections `advisory` holds for locks and waits, default 64),
    /// `connect_timeout` (`500ms`, `5s`; default 5 s) and
    /// `operation_timeout` or `timeout` (bound on one operation; default
    /// 10 s) and `recheck_interval` (how often a `lease` waiter looks at a
    /// held key when no notification came: 10 ms to 10 s, default 500 ms).
    ///
    /// Passed to sqlx: `sslmode` (`disable`, `allow`, `prefer` — the
    /// default —, `require`, `verify-ca`, `verify-full`), `sslrootcert` (a
    /// PEM file with the CA to trust), `sslcert` / `sslkey` (client
    /// certificate), `application_name`, `host` (e.g. a Unix socket
    /// directory) and `statement-cache-capacity`.
    ///
    /// Any other parameter, or one given twice (in either spelling), is an
    /// [`Error::Config`] naming it: a typo such as `tabel=jobs` must not
    /// silently put the application in the default namespace.
    ///
    /// # Errors
    ///
    /// [`Error::Config`] for a malformed URL or parameter; nothing is connected.
    pub fn from_url(url: &str) -> Result<Self> {
        let (base, query) = split_query(url);
        let Some(("postgres" | "postgresql", rest)) = base.split_once("://") else {
            return Err(Error::config(format!(
                "expected a postgres:// or postgresql:// url, got `{}`",
                redact(url)
            )));
        };
        let mut config = PostgresConfig {
            connect: PgConnectOptions::new_without_pgpass(),
            display_url: redact(base),
            strategy: Strategy::default(),
            table: TableName::new(DEFAULT_TABLE)?,
            max_connections: DEFAULT_MAX_CONNECTIONS,
            max_lock_connections: DEFAULT_MAX_LOCK_CONNECTIONS,
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            operation_timeout: DEFAULT_OPERATION_TIMEOUT,
            recheck_interval: DEFAULT_RECHECK_INTERVAL,
        };
        let mut passthrough = Vec::new();
        for p in params("postgres", query, KNOWN)? {
            match p.name {
                "strategy" => config.strategy = p.value.parse()?,
                "table" => config.table = TableName::new(p.value)?,
                "max_connections" => {
                    config.max_connections = parse_count(p.name, p.value, 1000)?;
                }
                "max_lock_connections" => {
                    config.max_lock_connections = parse_count(p.name, p.value, 10_000)?;
                }
                "connect_timeout" => config.connect_timeout = parse_duration(p.value)?,
                "operation_timeout" => config.operation_timeout = parse_duration(p.value)?,
                "recheck_interval" => {
                    config.recheck_interval = check_recheck(parse_duration(p.value)?)?;
                }
                // sqlx knows only the first spelling of each.
                "sslmode" | "sslrootcert" | "sslcert" | "sslkey" => {
                    passthrough.push(format!("{}={}", p.name, p.value));
                }
                _ => passthrough.push(p.raw.to_owned()),
            }
        }
        if base.split_once("://").is_some_and(|(_, r)| r.is_empty()) {
            return Err(Error::config("the postgres url names no server"));
        }
        let sqlx_url = if passthrough.is_empty() {
            format!("postgres://{rest}")
        } else {
            format!("postgres://{rest}?{}", passthrough.join("&"))
        };
        config.connect = PgConnectOptions::from_str(&sqlx_url)
            .map_err(|e| Error::config(format!("invalid postgres url `{}`: {e}", redact(url))))?;
        Ok(config)
    }

    /// The strategy.
    pub fn strategy(&self) -> Strategy {
        self.strategy
    }

    /// The base table name.
    pub fn table(&self) -> &TableName {
        &self.table
    }

    /// The bound on one operation.
    pub fn operation_timeout(&self) -> Duration {
        self.operation_timeout
    }

    /// The bound on connecting.
    pub fn connect_timeout(&self) -> Duration {
        self.connect_timeout
    }

    /// The URL without its password.
    pub fn display_url(&self) -> &str {
        &self.display_url
    }

    /// The pause between a `lease` waiter's re-checks when no notification came.
    pub fn recheck_interval(&self) -> Duration {
        self.recheck_interval
    }

    /// The size of the statement pool.
    pub fn max_connections(&self) -> u32 {
        self.max_connections
    }

    /// The bound on the connections `advisory` holds.
    pub fn max_lock_connections(&self) -> u32 {
        self.max_lock_connections
    }

    /// Checks the settings a builder may have changed.
    pub(crate) fn validate(&self) -> Result<()> {
        use fenced_api::url::check_duration;
        check_duration("connect_timeout", self.connect_timeout)?;
        check_duration("operation_timeout", self.operation_timeout)?;
        check_count("max_connections", self.max_connections, 1000)?;
        check_count("max_lock_connections", self.max_lock_connections, 10_000)?;
        check_recheck(self.recheck_interval)?;
        Ok(())
    }
}

fn check_recheck(d: Duration) -> Result<Duration> {
    let (min, max) = RECHECK_BOUNDS;
    if (min..=max).contains(&d) {
        Ok(d)
    } else {
        Err(Error::config(format!(
            "recheck_interval must be from {min:?} to {max:?}, got {d:?}"
        )))
    }
}

/// `host:port` (or the socket directory) the options connect to, for
/// messages: never the user or password.
pub(crate) fn server_name(o: &PgConnectOptions) -> String {
    match o.get_socket() {
        Some(path) => format!("socket {}", path.display()),
        None if o.get_host().contains(':') => format!("[{}]:{}", o.get_host(), o.get_port()),
        None => format!("{}:{}", o.get_host(), o.get_port()),
    }
}

fn parse_count(name: &str, v: &str, max: u32) -> Result<u32> {
    match v.parse::<u32>() {
        Ok(n) => check_count(name, n, max).map(|()| n),
        Err(_) => Err(count_error(name, max, v)),
    }
}

fn check_count(name: &str, n: u32, max: u32) -> Result<()> {
    if (1..=max).contains(&n) {
        Ok(())
    } else {
        Err(count_error(name, max, &n.to_string()))
    }
}

fn count_error(name: &str, max: u32, got: &str) -> Error {
    Error::config(format!(
        "{name} must be a number from 1 to {max}, got `{got}`"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn url_table() {
        // Each URL, then what it must give: strategy, table, pool sizes, connect timeout.
        let cases = "\
            postgres://postgres@127.0.0.1:5432/fenced_test                Lease fenced_locks 10 64 5s
            postgresql://u:p@h/db?strategy=advisory                       Advisory fenced_locks 10 64 5s
            postgres://h/db?strategy=lease&table=jobs_lock                Lease jobs_lock 10 64 5s
            postgres://h/db?max_connections=3&connect_timeout=250ms       Lease fenced_locks 3 64 250ms
            postgres://h/db?max_lock_connections=500&sslmode=disable      Lease fenced_locks 10 500 5s";
        for line in cases.lines() {
            let (url, expected) = line.trim().split_once(' ').unwrap();
            let c = PostgresConfig::from_url(url).unwrap_or_else(|e| panic!("{url}: {e}"));
            let got = format!(
                "{:?} {} {} {} {:?}",
                c.strategy, c.table, c.max_connections, c.max_lock_connections, c.connect_timeout
            );
            assert_eq!(got, expected.trim(), "{url}");
        }
    }

    #[test]
    fn the_server_and_database_come_from_the_url() {
        let c = PostgresConfig::from_url("postgres://app@db.internal:6543/locks").unwrap();
        assert_eq!(c.connect.get_host(), "db.internal");
        assert_eq!(c.connect.get_port(), 6543);
        assert_eq!(c.connect.get_database(), Some("locks"));
        assert_eq!(c.connect.get_username(), "app");
        assert_eq!(server_name(&c.connect), "db.internal:6543");
    }

    #[test]
    fn operation_timeout_has_two_spellings() {
        for url in [
            "postgres://h/db?operation_timeout=2s",
            "postgres://h/db?timeout=2s",
        ] {
            let c = PostgresConfig::from_url(url).unwrap_or_else(|e| panic!("{url}: {e}"));
            assert_eq!(c.operation_timeout(), Duration::from_secs(2), "{url}");
        }
        let c = PostgresConfig::from_url("postgres://h/db").unwrap();
        assert_eq!(c.operation_timeout(), DEFAULT_OPERATION_TIMEOUT);
        assert_eq!(c.recheck_interval(), DEFAULT_RECHECK_INTERVAL);
        let c = PostgresConfig::from_url("postgres://h/db?recheck_interval=2s").unwrap();
        assert_eq!(c.recheck_interval(), Duration::from_secs(2));
        let e = PostgresConfig::from_url("postgres://h/db?timeout=1s&operation_timeout=2s")
            .unwrap_err();
        assert!(e.to_string().contains("`operation_timeout`"), "{e}");
    }

    #[test]
    fn tls_parameters_reach_sqlx_in_either_spelling() {
        use sqlx::postgres::PgSslMode;
        for url in [
            "postgres://h/db?sslmode=verify-full&sslrootcert=/tmp/ca.pem",
            "postgres://h/db?ssl-mode=verify-full&ssl-root-cert=/tmp/ca.pem",
        ] {
            let c = PostgresConfig::from_url(url).unwrap_or_else(|e| panic!("{url}: {e}"));
            assert!(
                matches!(c.connect.get_ssl_mode(), PgSslMode::VerifyFull),
                "{url}"
            );
        }
        let c = PostgresConfig::from_url("postgres://h/db?sslmode=require").unwrap();
        assert!(matches!(c.connect.get_ssl_mode(), PgSslMode::Require));
    }

    #[test]
    fn bad_urls_are_config_errors() {
        for url in [
            "mysql://h/db",
            "postgres://h/db?strategy=mutex",
            "postgres://h/db?table=locks;DROP",
            "postgres://h/db?table=\"x\"",
            "postgres://h/db?table=1abc",
            "postgres://h/db?table=",
            "postgres://h/db?max_connections=0",
            "postgres://h/db?max_lock_connections=0",
            "postgres://h/db?max_lock_connections=many",
            "postgres://h/db?connect_timeout=forever",
            "postgres://h/db?connect_timeout=0s",
            "postgres://h/db?recheck_interval=1ms",
            "postgres://h/db?recheck_interval=1m",
            "postgres://h/db?sslmode=sometimes",
            "postgres://",
        ] {
            match PostgresConfig::from_url(url) {
                Err(Error::Config { .. }) => {}
                other => panic!("{url}: expected a config error, got {other:?}"),
            }
        }
    }

    #[test]
    fn unknown_and_repeated_parameters_are_named() {
        for (url, named) in [
            ("postgres://h/db?strategyy=lease", "`strategyy`"),
            ("postgres://h/db?tabel=jobs", "`tabel`"),
            ("postgres://h/db?table=a&table=b", "`table`"),
            (
                "postgres://h/db?strategy=lease&strategy=advisory",
                "`strategy`",
            ),
            (
                "postgres://h/db?sslmode=require&ssl-mode=disable",
                "`sslmode`",
            ),
            ("postgres://h/db?ssl_mode=require", "`ssl_mode`"),
            ("postgres://h/db?options=-c%20x=1", "`options`"),
        ] {
            match PostgresConfig::from_url(url) {
                Err(e @ Error::Config { .. }) => {
                    assert!(e.to_string().contains(named), "{url}: {e}")
                }
                other => panic!("{url}: expected a config error, got {other:?}"),
            }
        }
    }

    #[test]
    fn passwords_never_shown() {
        let c =
            PostgresConfig::from_url("postgres://app:hunter2@h:5432/db?strategy=advisory").unwrap();
        let dbg = format!("{c:?}");
        assert!(!dbg.contains("hunter2"), "{dbg}");
        assert!(dbg.contains("app:***@h:5432/db"), "{dbg}");
        let err =
            PostgresConfig::from_url("postgres://app:hunter2@h/db?strategy=nope").unwrap_err();
        assert!(!err.to_string().contains("hunter2"));
        let err = PostgresConfig::from_url("pg://app:hunter2@h/db").unwrap_err();
        assert!(!err.to_string().contains("hunter2"), "{err}");
        let url = "postgres://app:Alpha?Bravo=1&x@127.0.0.1:1/test?strategy=lease";
        let shown = match PostgresConfig::from_url(url) {
            Ok(c) => format!("{c:?}"),
            Err(e) => format!("{e} {e:?}"),
        };
        assert!(
            !shown.contains("Alpha") && !shown.contains("Bravo"),
            "{shown}"
        );
    }
}
