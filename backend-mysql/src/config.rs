//! Configuration: from a URL or the builder, validated before connecting.

use std::{fmt, str::FromStr, time::Duration};

use fenced_api::url::{params, parse_bool, parse_duration, redact, split_query};
use fenced_api::{Error, Result};
use sqlx::mysql::MySqlConnectOptions;

/// How the lock is taken. See the crate documentation for when to choose which.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Strategy {
    /// INSERT a row per held key, DELETE it on release; the row id is the token.
    #[default]
    UniqueKey,
    /// `SELECT … FOR UPDATE` on a pre-existing row inside an open transaction.
    RowLock,
    /// One permanent row per key, taken with a conditional UPDATE; the version is the token.
    Optimistic,
}

impl Strategy {
    /// The name used in URLs (`?strategy=…`).
    pub fn as_str(self) -> &'static str {
        match self {
            Strategy::UniqueKey => "unique_key",
            Strategy::RowLock => "row_lock",
            Strategy::Optimistic => "optimistic",
        }
    }
}

impl FromStr for Strategy {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "unique_key" => Ok(Strategy::UniqueKey),
            "row_lock" => Ok(Strategy::RowLock),
            "optimistic" => Ok(Strategy::Optimistic),
            other => Err(Error::config(format!(
                "unknown mysql strategy `{other}`; use unique_key, row_lock or optimistic"
            ))),
        }
    }
}

impl fmt::Display for Strategy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A validated base table name: `[A-Za-z_][A-Za-z0-9_]*`, at most
/// [`TableName::MAX_LEN`] characters, so that derived names
/// (`<base>_rows`, `<base>_migrations`…) stay within MySQL's 64-character limit.
/// Always used backtick-quoted, so reserved words are fine.
pub type TableName = fenced_sql::TableName<sqlx::MySql>;

/// Everything needed to connect; built from a URL or [`MySqlLockBuilder`](crate::MySqlLockBuilder).
#[derive(Clone)]
pub struct MySqlConfig {
    pub(crate) connect: MySqlConnectOptions,
    /// The URL with the password replaced, for messages and scopes.
    pub(crate) display_url: String,
    pub(crate) strategy: Strategy,
    pub(crate) table: TableName,
    pub(crate) max_connections: u32,
    pub(crate) connect_timeout: Duration,
    pub(crate) operation_timeout: Duration,
    pub(crate) row_lock_one_statement: bool,
}

impl fmt::Debug for MySqlConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Never print the password: only the redacted URL.
        f.debug_struct("MySqlConfig")
            .field("url", &self.display_url)
            .field("strategy", &self.strategy)
            .field("table", &self.table)
            .field("max_connections", &self.max_connections)
            .field("connect_timeout", &self.connect_timeout)
            .field("operation_timeout", &self.operation_timeout)
            .field("row_lock_one_statement", &self.row_lock_one_statement)
            .finish()
    }
}

/// Default base table name.
pub const DEFAULT_TABLE: &str = "fenced_locks";
/// Default pool size of the lock's own pool.
pub const DEFAULT_MAX_CONNECTIONS: u32 = 10;
/// Default bound on connecting (and on waiting for a pooled connection).
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Default bound on one operation (a silent network never hangs a call longer).
pub const DEFAULT_OPERATION_TIMEOUT: Duration = Duration::from_secs(10);
/// [`DEFAULT_OPERATION_TIMEOUT`] under its shorter name.
pub const DEFAULT_OP_TIMEOUT: Duration = DEFAULT_OPERATION_TIMEOUT;

/// The parameters [`MySqlConfig::from_url`] accepts (`a|b`: two spellings
/// of one parameter). The ones after `row_lock_one_statement` go to sqlx.
const KNOWN: &[&str] = &[
    "strategy",
    "table",
    "max_connections",
    "connect_timeout",
    "operation_timeout|timeout",
    "row_lock_one_statement",
    "ssl-mode|sslmode",
    "ssl-ca|sslca",
    "ssl-cert|sslcert",
    "ssl-key|sslkey",
    "socket",
    "charset",
    "collation",
    "timezone|time-zone",
    "statement-cache-capacity",
];

impl MySqlConfig {
    /// Parses `mysql://user:pass@host:port/db?strategy=…&table=…&max_connections=…&connect_timeout=…`.
    ///
    /// fenced's parameters: `strategy` (default `unique_key`), `table`
    /// (default `fenced_locks`), `max_connections` (default 10),
    /// `connect_timeout` (`500ms`, `5s`; default 5 s), `operation_timeout`
    /// or `timeout` (bound on one operation; default 10 s) and
    /// `row_lock_one_statement` (`true`/`false`, default `true`: on MariaDB
    /// `row_lock` takes the row lock and its fencing token in one
    /// statement; `false` forces the portable two-statement grant that
    /// MySQL uses anyway — for comparison and tests).
    ///
    /// Passed to sqlx: `ssl-mode` (`DISABLED`, `PREFERRED` — the default,
    /// TLS if the server offers it, unverified —, `REQUIRED`, `VERIFY_CA`,
    /// `VERIFY_IDENTITY`), `ssl-ca` (a PEM file with the CA to trust, on top
    /// of the system's roots), `ssl-cert` / `ssl-key` (client certificate),
    /// `socket`, `charset`, `collation`, `timezone`,
    /// `statement-cache-capacity` (and the spellings `sslmode`, `sslca`,
    /// `sslcert`, `sslkey`, `time-zone`).
    ///
    /// Any other parameter, or one given twice (in either spelling), is an
    /// [`Error::Config`] naming it: a typo such as `tabel=jobs` must not
    /// silently put the application in the default namespace, shared with
    /// everybody else who kept it.
    ///
    /// # Errors
    ///
    /// [`Error::Config`] for a malformed URL or parameter; nothing is connected.
    pub fn from_url(url: &str) -> Result<Self> {
        let (base, query) = split_query(url);
        let Some(("mysql" | "mariadb", rest)) = base.split_once("://") else {
            return Err(Error::config(format!(
                "expected a mysql:// or mariadb:// url, got `{}`",
                redact(url)
            )));
        };
        let mut config = MySqlConfig {
            connect: MySqlConnectOptions::new(),
            display_url: redact(base),
            strategy: Strategy::default(),
            table: TableName::new(DEFAULT_TABLE)?,
            max_connections: DEFAULT_MAX_CONNECTIONS,
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            operation_timeout: DEFAULT_OPERATION_TIMEOUT,
            row_lock_one_statement: true,
        };
        let mut passthrough = Vec::new();
        for p in params("mysql", query, KNOWN)? {
            match p.name {
                "strategy" => config.strategy = p.value.parse()?,
                "table" => config.table = TableName::new(p.value)?,
                "max_connections" => config.max_connections = parse_pool_size(p.value)?,
                "connect_timeout" => config.connect_timeout = parse_duration(p.value)?,
                "operation_timeout" => config.operation_timeout = parse_duration(p.value)?,
                "row_lock_one_statement" => {
                    config.row_lock_one_statement = parse_bool(p.name, p.value)?;
                }
                _ => passthrough.push(p.raw),
            }
        }
        let sqlx_url = if passthrough.is_empty() {
            format!("mysql://{rest}")
        } else {
            format!("mysql://{rest}?{}", passthrough.join("&"))
        };
        config.connect = MySqlConnectOptions::from_str(&sqlx_url)
            .map_err(|e| Error::config(format!("invalid mysql url `{}`: {e}", redact(url))))?;
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
}

/// `host:port` (or the socket path) the options connect to, for messages:
/// never the user or password.
pub(crate) fn server_name(o: &MySqlConnectOptions) -> String {
    match o.get_socket() {
        Some(path) => format!("socket {}", path.display()),
        None if o.get_host().contains(':') => format!("[{}]:{}", o.get_host(), o.get_port()),
        None => format!("{}:{}", o.get_host(), o.get_port()),
    }
}

fn parse_pool_size(v: &str) -> Result<u32> {
    match v.parse::<u32>() {
        Ok(n) if (1..=1000).contains(&n) => Ok(n),
        _ => Err(Error::config(format!(
            "max_connections must be a number from 1 to 1000, got `{v}`"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn url_table() {
        // Each URL, then what it must give: strategy, table, pool size, connect timeout.
        let cases = "\
            mysql://root@127.0.0.1:3306/test                         UniqueKey fenced_locks 10 5s
            mysql://root@h/db?strategy=row_lock                      RowLock fenced_locks 10 5s
            mariadb://u:p@h/db?strategy=optimistic&table=jobs_lock   Optimistic jobs_lock 10 5s
            mysql://h/db?max_connections=3&connect_timeout=250ms     UniqueKey fenced_locks 3 250ms
            mysql://h/db?ssl-mode=disabled&table=t                   UniqueKey t 10 5s";
        for line in cases.lines() {
            let (url, expected) = line.trim().split_once(' ').unwrap();
            let c = MySqlConfig::from_url(url).unwrap_or_else(|e| panic!("{url}: {e}"));
            let got = format!(
                "{:?} {} {} {:?}",
                c.strategy, c.table, c.max_connections, c.connect_timeout
            );
            assert_eq!(got, expected.trim(), "{url}");
        }
    }

    #[test]
    fn operation_timeout_has_two_spellings() {
        for url in [
            "mysql://h/db?operation_timeout=2s",
            "mysql://h/db?timeout=2s",
        ] {
            let c = MySqlConfig::from_url(url).unwrap_or_else(|e| panic!("{url}: {e}"));
            assert_eq!(c.operation_timeout(), Duration::from_secs(2), "{url}");
        }
        let c = MySqlConfig::from_url("mysql://h/db").unwrap();
        assert_eq!(c.operation_timeout(), DEFAULT_OPERATION_TIMEOUT);
        let e = MySqlConfig::from_url("mysql://h/db?timeout=1s&operation_timeout=2s").unwrap_err();
        assert!(e.to_string().contains("`operation_timeout`"), "{e}");
    }

    #[test]
    fn bad_urls_are_config_errors() {
        for url in [
            "postgres://h/db",
            "mysql://h/db?strategy=mutex",
            "mysql://h/db?table=locks;DROP",
            "mysql://h/db?table=`x`",
            "mysql://h/db?table=1abc",
            "mysql://h/db?table=",
            "mysql://h/db?max_connections=0",
            "mysql://h/db?connect_timeout=forever",
            "mysql://h/db?connect_timeout=0s",
            "mysql://h/db?row_lock_one_statement=maybe",
        ] {
            match MySqlConfig::from_url(url) {
                Err(Error::Config { .. }) => {}
                other => panic!("{url}: expected a config error, got {other:?}"),
            }
        }
    }

    #[test]
    fn unknown_and_repeated_parameters_are_named() {
        for (url, named) in [
            ("mysql://h/db?strategyy=row_lock", "`strategyy`"),
            ("mysql://h/db?tabel=jobs", "`tabel`"),
            ("mysql://h/db?table=a&table=b", "`table`"),
            (
                "mysql://h/db?strategy=row_lock&strategy=optimistic",
                "`strategy`",
            ),
            (
                "mysql://h/db?ssl-mode=REQUIRED&sslmode=DISABLED",
                "`ssl-mode`",
            ),
            ("mysql://h/db?ssl_mode=REQUIRED", "`ssl_mode`"),
        ] {
            match MySqlConfig::from_url(url) {
                Err(e @ Error::Config { .. }) => {
                    assert!(e.to_string().contains(named), "{url}: {e}")
                }
                other => panic!("{url}: expected a config error, got {other:?}"),
            }
        }
        // Every documented sqlx parameter is still accepted, once.
        let c = MySqlConfig::from_url(
            "mysql://h/db?ssl-mode=VERIFY_CA&ssl-ca=/tmp/ca.pem&charset=utf8mb4&timezone=%2B00:00&statement-cache-capacity=10",
        )
        .unwrap();
        assert!(matches!(
            c.connect.get_ssl_mode(),
            sqlx::mysql::MySqlSslMode::VerifyCa
        ));
    }

    #[test]
    fn a_password_with_an_unencoded_question_mark_is_not_echoed() {
        let url = "mysql://app:Alpha?Bravo=1&x@127.0.0.1:1/test?strategy=row_lock";
        let shown = match MySqlConfig::from_url(url) {
            Ok(c) => format!("{c:?}"),
            Err(e) => format!("{e} {e:?}"),
        };
        assert!(
            !shown.contains("Alpha") && !shown.contains("Bravo"),
            "{shown}"
        );
        assert_eq!(
            split_query("mysql://u:p?q@h:1/db?table=t"),
            ("mysql://u:p?q@h:1/db", "table=t")
        );
        assert_eq!(split_query("mysql://h/db"), ("mysql://h/db", ""));
    }

    #[test]
    fn table_names() {
        for ok in ["locks", "_x", "Locks_2", "select", &"a".repeat(48)] {
            assert!(TableName::new(ok).is_ok(), "{ok}");
        }
        for bad in ["", "9x", "a-b", "a.b", "a b", "`a`", "é", &"a".repeat(49)] {
            assert!(TableName::new(bad).is_err(), "{bad}");
        }
        assert_eq!(
            TableName::new("select").unwrap().quoted("_rows"),
            "`select_rows`"
        );
    }

    #[test]
    fn passwords_never_shown() {
        let c = MySqlConfig::from_url("mysql://root:hunter2@h:3306/db?strategy=row_lock").unwrap();
        let dbg = format!("{c:?}");
        assert!(!dbg.contains("hunter2"), "{dbg}");
        assert!(dbg.contains("root:***@h:3306/db"), "{dbg}");
        let err = MySqlConfig::from_url("mysql://root:hunter2@h/db?strategy=nope").unwrap_err();
        assert!(!err.to_string().contains("hunter2"));
        let err = MySqlConfig::from_url("pg://root:hunter2@h/db").unwrap_err();
        assert!(!err.to_string().contains("hunter2"), "{err}");
    }
}
