//! Configuration: from a URL or the builder, validated before connecting.

use std::{fmt, str::FromStr, time::Duration};

pub(crate) use fenced_api::url::{parse_duration, redact};
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
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct TableName(String);

impl TableName {
    /// Longest base name accepted.
    pub const MAX_LEN: usize = 48;

    /// Validates a base table name.
    ///
    /// # Errors
    ///
    /// [`Error::Config`] naming the rule that was broken.
    pub fn new(name: &str) -> Result<Self> {
        let mut chars = name.chars();
        let valid_start = chars
            .next()
            .is_some_and(|c| c.is_ascii_alphabetic() || c == '_');
        if !valid_start || !chars.all(|c| c.is_ascii_alphanumeric() || c == '_') {
            return Err(Error::config(format!(
                "invalid table name {name:?}: use ASCII letters, digits and `_`, not starting with a digit"
            )));
        }
        if name.len() > Self::MAX_LEN {
            return Err(Error::config(format!(
                "table name {name:?} is {} characters long; the maximum is {}",
                name.len(),
                Self::MAX_LEN
            )));
        }
        Ok(TableName(name.to_owned()))
    }

    /// The base name.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The backtick-quoted physical table `<base><suffix>`.
    pub(crate) fn quoted(&self, suffix: &str) -> String {
        format!("`{}{}`", self.0, suffix)
    }
}

impl fmt::Display for TableName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

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
    pub(crate) op_timeout: Duration,
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
            .field("op_timeout", &self.op_timeout)
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
pub const DEFAULT_OP_TIMEOUT: Duration = Duration::from_secs(10);

impl MySqlConfig {
    /// Parses `mysql://user:pass@host:port/db?strategy=…&table=…&max_connections=…&connect_timeout=…`.
    ///
    /// fenced's parameters: `strategy` (default `unique_key`), `table`
    /// (default `fenced_locks`), `max_connections` (default 10),
    /// `connect_timeout` (`500ms`, `5s`; default 5 s), `timeout` (bound on
    /// one operation; default 10 s) and `row_lock_one_statement`
    /// (`true`/`false`, default `true`: on MariaDB `row_lock` takes the row
    /// lock and its fencing token in one statement; `false` forces the
    /// portable two-statement grant that MySQL uses anyway — for comparison
    /// and tests).
    ///
    /// Passed to sqlx: `ssl-mode` (`DISABLED`, `PREFERRED` — the default,
    /// TLS if the server offers it, unverified —, `REQUIRED`, `VERIFY_CA`,
    /// `VERIFY_IDENTITY`), `ssl-ca` (a PEM file with the CA to trust, on top
    /// of the system's roots), `ssl-cert` / `ssl-key` (client certificate),
    /// `socket`, `charset`, `collation`, `timezone`,
    /// `statement-cache-capacity` (and the spellings `sslmode`, `sslca`,
    /// `sslcert`, `sslkey`, `time-zone`).
    ///
    /// Any other parameter, or one given twice, is an [`Error::Config`]
    /// naming it: a typo such as `tabel=jobs` must not silently put the
    /// application in the default namespace, shared with everybody else
    /// who kept it.
    ///
    /// # Errors
    ///
    /// [`Error::Config`] for a malformed URL or parameter; nothing is connected.
    pub fn from_url(url: &str) -> Result<Self> {
        let (base, query) = split_query(url);
        let scheme = base.split_once("://").map(|(s, _)| s).unwrap_or_default();
        if !matches!(scheme, "mysql" | "mariadb") {
            return Err(Error::config(format!(
                "expected a mysql:// or mariadb:// url, got `{}`",
                redact(url)
            )));
        }
        let mut strategy = Strategy::default();
        let mut table = TableName::new(DEFAULT_TABLE)?;
        let mut max_connections = DEFAULT_MAX_CONNECTIONS;
        let mut connect_timeout = DEFAULT_CONNECT_TIMEOUT;
        let mut op_timeout = DEFAULT_OP_TIMEOUT;
        let mut row_lock_one_statement = true;
        let mut passthrough = Vec::new();
        let mut seen: Vec<&str> = Vec::new();
        for pair in query.split('&').filter(|p| !p.is_empty()) {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            let Some(name) = canonical_param(k) else {
                return Err(Error::config(format!(
                    "unknown mysql url parameter {}; known: {KNOWN_PARAMS}",
                    shown_param(k)
                )));
            };
            // `ssl-mode=REQUIRED&sslmode=DISABLED` is as ambiguous as a
            // plain repeat: spellings of one parameter count as one.
            if seen.contains(&name) {
                return Err(Error::config(format!(
                    "the mysql url parameter `{name}` is given twice"
                )));
            }
            seen.push(name);
            match name {
                "strategy" => strategy = v.parse()?,
                "table" => table = TableName::new(v)?,
                "max_connections" => max_connections = parse_pool_size(v)?,
                "connect_timeout" => connect_timeout = parse_duration(v)?,
                "timeout" => op_timeout = parse_duration(v)?,
                "row_lock_one_statement" => {
                    row_lock_one_statement = match v {
                        "true" | "1" => true,
                        "false" | "0" => false,
                        _ => {
                            return Err(Error::config(format!(
                                "row_lock_one_statement must be true or false, got `{v}`"
                            )))
                        }
                    }
                }
                _ => passthrough.push(pair),
            }
        }
        let sqlx_url = format!(
            "mysql://{}{}{}",
            base.split_once("://").map(|(_, r)| r).unwrap_or_default(),
            if passthrough.is_empty() { "" } else { "?" },
            passthrough.join("&")
        );
        let connect = MySqlConnectOptions::from_str(&sqlx_url)
            .map_err(|e| Error::config(format!("invalid mysql url `{}`: {e}", redact(url))))?;
        Ok(MySqlConfig {
            connect,
            display_url: redact(base),
            strategy,
            table,
            max_connections,
            connect_timeout,
            op_timeout,
            row_lock_one_statement,
        })
    }

    /// The strategy.
    pub fn strategy(&self) -> Strategy {
        self.strategy
    }

    /// The base table name.
    pub fn table(&self) -> &TableName {
        &self.table
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

/// The parameters [`MySqlConfig::from_url`] accepts, for error messages.
const KNOWN_PARAMS: &str = "strategy, table, max_connections, connect_timeout, timeout, \
     row_lock_one_statement, ssl-mode, ssl-ca, ssl-cert, ssl-key, socket, charset, collation, \
     timezone, statement-cache-capacity";

/// The one name of a known URL parameter (sqlx accepts two spellings of
/// some), or `None` for an unknown one.
fn canonical_param(k: &str) -> Option<&'static str> {
    Some(match k {
        "strategy" => "strategy",
        "table" => "table",
        "max_connections" => "max_connections",
        "connect_timeout" => "connect_timeout",
        "timeout" => "timeout",
        "row_lock_one_statement" => "row_lock_one_statement",
        "ssl-mode" | "sslmode" => "ssl-mode",
        "ssl-ca" | "sslca" => "ssl-ca",
        "ssl-cert" | "sslcert" => "ssl-cert",
        "ssl-key" | "sslkey" => "ssl-key",
        "socket" => "socket",
        "charset" => "charset",
        "collation" => "collation",
        "timezone" | "time-zone" => "timezone",
        "statement-cache-capacity" => "statement-cache-capacity",
        _ => return None,
    })
}

/// An unknown parameter's name for a message — only if it looks like a
/// name: after a password with an unencoded `?` the "parameter" may be
/// the rest of that password.
fn shown_param(k: &str) -> String {
    let plain = !k.is_empty()
        && k.len() <= 40
        && k.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'));
    if plain {
        format!("`{k}`")
    } else {
        "(name not shown: it does not look like one; is a `?` in the password not percent-encoded?)"
            .to_owned()
    }
}

/// Splits `url` into the part before the query and the query. The query
/// starts at the first `?` after the user info, so a password holding an
/// unencoded `?` is not taken for parameters (and echoed in an error).
fn split_query(url: &str) -> (&str, &str) {
    let after_scheme = url.find("://").map_or(0, |i| i + 3);
    let rest = &url[after_scheme..];
    // The user info ends at the first `@` followed by something that looks
    // like `host[:port]` up to `/`, `?`, `#` or the end.
    let host_start = rest
        .match_indices('@')
        .map(|(i, _)| i + 1)
        .find(|&i| {
            let tail = &rest[i..];
            let end = tail.find(['/', '?', '#']).unwrap_or(tail.len());
            let host = &tail[..end];
            !host.is_empty()
                && host.chars().all(|c| {
                    c.is_ascii_alphanumeric()
                        || matches!(c, '.' | '-' | '_' | ':' | '[' | ']' | '%')
                })
        })
        .unwrap_or(0);
    let from = after_scheme + host_start;
    match url[from..].find('?') {
        Some(q) => (&url[..from + q], &url[from + q + 1..]),
        None => (url, ""),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn url_table() {
        let cases: [(&str, Strategy, &str, u32, Duration); 5] = [
            (
                "mysql://root@127.0.0.1:3306/test",
                Strategy::UniqueKey,
                "fenced_locks",
                10,
                Duration::from_secs(5),
            ),
            (
                "mysql://root@h/db?strategy=row_lock",
                Strategy::RowLock,
                "fenced_locks",
                10,
                Duration::from_secs(5),
            ),
            (
                "mariadb://u:p@h/db?strategy=optimistic&table=jobs_lock",
                Strategy::Optimistic,
                "jobs_lock",
                10,
                Duration::from_secs(5),
            ),
            (
                "mysql://h/db?max_connections=3&connect_timeout=250ms",
                Strategy::UniqueKey,
                "fenced_locks",
                3,
                Duration::from_millis(250),
            ),
            (
                "mysql://h/db?ssl-mode=disabled&table=t",
                Strategy::UniqueKey,
                "t",
                10,
                Duration::from_secs(5),
            ),
        ];
        for (url, strategy, table, pool, timeout) in cases {
            let c = MySqlConfig::from_url(url).unwrap_or_else(|e| panic!("{url}: {e}"));
            assert_eq!(c.strategy, strategy, "{url}");
            assert_eq!(c.table.as_str(), table, "{url}");
            assert_eq!(c.max_connections, pool, "{url}");
            assert_eq!(c.connect_timeout, timeout, "{url}");
        }
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
