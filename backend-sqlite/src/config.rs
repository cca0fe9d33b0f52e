//! Configuration: from a URL, a path or the builder, validated before any file is touched.

use std::{
    ffi::OsString,
    fmt,
    path::{Path, PathBuf},
    str::FromStr,
    time::Duration,
};

use fenced_api::url::{params, parse_duration, percent_decode};
use fenced_api::{Error, Result};

/// Default table name.
pub const DEFAULT_TABLE: &str = "fenced_locks";
/// Default bound on waiting for SQLite's write lock (`busy_timeout`).
pub const DEFAULT_BUSY_TIMEOUT: Duration = Duration::from_secs(5);
/// Default size of each [`SqliteLock`](crate::SqliteLock)'s own connection pool.
pub const DEFAULT_MAX_CONNECTIONS: u32 = 4;

/// How hard SQLite pushes each commit to disk (`PRAGMA synchronous`).
///
/// The default is [`Synchronous::Full`]: every acquire and release is on disk
/// before it returns. With [`Synchronous::Normal`] a power loss or OS crash
/// (not a process crash) can roll back the last commits — including the
/// `AUTOINCREMENT` counter, so a fencing token already handed out could be
/// handed out again after the reboot. Choose `normal` only when the
/// protected resource would lose the same writes (e.g. it lives in the same
/// file system with the same settings) or tokens do not matter to you.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Synchronous {
    /// Sync the write-ahead log at every commit (durable across power loss).
    #[default]
    Full,
    /// Sync only at checkpoints (durable across process crashes only).
    Normal,
}

impl Synchronous {
    /// The name used in URLs (`?synchronous=…`).
    pub fn as_str(self) -> &'static str {
        match self {
            Synchronous::Full => "full",
            Synchronous::Normal => "normal",
        }
    }
}

impl FromStr for Synchronous {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "full" | "FULL" => Ok(Synchronous::Full),
            "normal" | "NORMAL" => Ok(Synchronous::Normal),
            other => Err(Error::config(format!(
                "unknown sqlite synchronous mode `{other}`; use full or normal"
            ))),
        }
    }
}

impl fmt::Display for Synchronous {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A validated table name — the namespace: `[a-z_][a-z0-9_]*`, at most
/// [`TableName::MAX_LEN`] characters, not starting with `sqlite_`.
///
/// Lowercase only because SQLite compares table names case-insensitively:
/// `Locks` and `locks` would silently be one namespace. Always used
/// double-quoted, so reserved words are fine.
pub type TableName = fenced_sql::TableName<sqlx::Sqlite>;

/// Everything needed to open the store; built from a URL or
/// [`SqliteLockBuilder`](crate::SqliteLockBuilder). Holds no secret.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SqliteConfig {
    pub(crate) path: PathBuf,
    pub(crate) table: TableName,
    pub(crate) busy_timeout: Duration,
    pub(crate) synchronous: Synchronous,
    pub(crate) max_connections: u32,
}

impl SqliteConfig {
    /// Defaults for the database file at `path`.
    ///
    /// # Errors
    ///
    /// [`Error::Config`] for an empty, in-memory or NUL-containing path.
    pub fn for_path(path: impl Into<PathBuf>) -> Result<Self> {
        let path = path.into();
        check_path(&path)?;
        Ok(SqliteConfig {
            path,
            table: TableName::new(DEFAULT_TABLE)?,
            busy_timeout: DEFAULT_BUSY_TIMEOUT,
            synchronous: Synchronous::default(),
            max_connections: DEFAULT_MAX_CONNECTIONS,
        })
    }

    /// Parses `sqlite:///abs/path.db` or `sqlite://relative/path.db`, with
    /// optional `?table=…&busy_timeout=…&synchronous=…&max_connections=…`.
    ///
    /// * The path is percent-decoded (`%20` for a space, `%3F` for `?`,
    ///   `%23` for `#`); a relative path is relative to the working directory.
    /// * `table` (default `fenced_locks`): the namespace, see [`TableName`].
    /// * `busy_timeout` (`250ms`, `5s`, `1m`; default 5 s): how long a write
    ///   waits for another connection's write lock before failing with a
    ///   retryable error.
    /// * `synchronous` (`full` or `normal`; default `full`): see [`Synchronous`].
    /// * `max_connections` (1–64; default 4): size of this instance's pool.
    ///
    /// Unknown or repeated parameters are errors, so a typo is not ignored.
    ///
    /// # Errors
    ///
    /// [`Error::Config`] for a malformed URL or parameter; nothing is opened.
    pub fn from_url(url: &str) -> Result<Self> {
        let Some(rest) = url.strip_prefix("sqlite://") else {
            return Err(Error::config(format!(
                "expected a sqlite:// url such as sqlite:///var/lib/app/locks.db, got `{url}`"
            )));
        };
        if rest.contains('#') {
            return Err(Error::config(format!(
                "sqlite url `{url}` contains `#`; write it as %23 in file names"
            )));
        }
        let (raw_path, query) = rest.split_once('?').unwrap_or((rest, ""));
        let path = percent_decode(raw_path).map_err(|e| {
            Error::config(format!("invalid path in sqlite url `{url}`: {}", reason(e)))
        })?;
        if path.is_empty() {
            return Err(Error::config(format!(
                "sqlite url `{url}` names no file; use sqlite:///absolute/path.db \
                 or sqlite://relative/path.db"
            )));
        }
        // `mode=memory` asks for a database private to one connection.
        if query.split('&').any(|p| p == "mode=memory") {
            return Err(in_memory());
        }
        let mut config = SqliteConfig::for_path(PathBuf::from(path))?;
        for p in params("sqlite", query, KNOWN)? {
            match p.name {
                "table" => config.table = TableName::new(p.value)?,
                "busy_timeout" => config.busy_timeout = parse_duration(p.value)?,
                "synchronous" => config.synchronous = p.value.parse()?,
                // `max_connections`, the last name in KNOWN.
                _ => config.max_connections = parse_pool_size(p.value)?,
            }
        }
        Ok(config)
    }

    /// The database file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The table name (namespace).
    pub fn table(&self) -> &TableName {
        &self.table
    }

    /// How long a write waits for SQLite's write lock.
    pub fn busy_timeout(&self) -> Duration {
        self.busy_timeout
    }

    /// The `synchronous` setting.
    pub fn synchronous(&self) -> Synchronous {
        self.synchronous
    }

    /// The pool size.
    pub fn max_connections(&self) -> u32 {
        self.max_connections
    }

    pub(crate) fn validate(&self) -> Result<()> {
        check_path(&self.path)?;
        if !(1..=64).contains(&self.max_connections) {
            return Err(Error::config("max_connections must be from 1 to 64"));
        }
        fenced_api::url::check_duration("busy_timeout", self.busy_timeout)?;
        Ok(())
    }
}

/// The URL parameters, in the order messages list them.
const KNOWN: &[&str] = &["table", "busy_timeout", "synchronous", "max_connections"];

/// The reason of a configuration error, for a message that adds context.
fn reason(e: Error) -> String {
    match e {
        Error::Config { reason } => reason,
        other => other.to_string(),
    }
}

fn in_memory() -> Error {
    Error::config(
        "an in-memory SQLite database is private to one connection and cannot coordinate \
         anything; use memory:// for in-process locks or a file path",
    )
}

fn check_path(path: &Path) -> Result<()> {
    let s = path.as_os_str();
    if s.is_empty() {
        return Err(Error::config("the sqlite database path is empty"));
    }
    if s == ":memory:" || s.as_encoded_bytes().starts_with(b"file:") {
        return Err(in_memory());
    }
    if s.as_encoded_bytes().contains(&0) {
        return Err(Error::config(
            "the sqlite database path contains a NUL byte",
        ));
    }
    Ok(())
}

fn parse_pool_size(v: &str) -> Result<u32> {
    match v.parse::<u32>() {
        Ok(n) if (1..=64).contains(&n) => Ok(n),
        _ => Err(Error::config(format!(
            "max_connections must be a number from 1 to 64, got `{v}`"
        ))),
    }
}

/// Escapes everything but unreserved characters and `/`.
fn percent_encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'/' | b'-' | b'.' | b'_' | b'~') {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// The per-user default database file, from the environment read by `var`.
///
/// 1. `$FENCED_HOME/locks.db` if `FENCED_HOME` is set (must be absolute);
/// 2. `$XDG_STATE_HOME/fenced/locks.db` if `XDG_STATE_HOME` is set and absolute
///    (the XDG spec says to ignore relative values);
/// 3. `$HOME/.local/state/fenced/locks.db`.
pub(crate) fn default_path_from(var: impl Fn(&str) -> Option<OsString>) -> Result<PathBuf> {
    let set = |name: &str| var(name).filter(|v| !v.is_empty()).map(PathBuf::from);
    if let Some(home) = set("FENCED_HOME") {
        if !home.is_absolute() {
            return Err(Error::config(format!(
                "FENCED_HOME must be an absolute directory, got {home:?}"
            )));
        }
        return Ok(home.join("locks.db"));
    }
    if let Some(state) = set("XDG_STATE_HOME").filter(|p| p.is_absolute()) {
        return Ok(state.join("fenced").join("locks.db"));
    }
    if let Some(home) = set("HOME").filter(|p| p.is_absolute()) {
        return Ok(home.join(".local/state/fenced/locks.db"));
    }
    Err(Error::config(
        "no default lock file: none of FENCED_HOME, XDG_STATE_HOME or HOME is set; \
         set FENCED_HOME or pass a sqlite:// url",
    ))
}

/// The `sqlite://` URL of an absolute path.
pub(crate) fn url_for_path(path: &Path) -> Result<String> {
    let s = path.to_str().ok_or_else(|| {
        Error::config(format!(
            "the path {path:?} is not UTF-8 and cannot be written as a url"
        ))
    })?;
    Ok(format!("sqlite://{}", percent_encode(s)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn url_table() {
        struct Want {
            path: &'static str,
            table: &'static str,
            busy: Duration,
            sync: Synchronous,
            pool: u32,
        }
        let at = |path| Want {
            path,
            table: "fenced_locks",
            busy: Duration::from_secs(5),
            sync: Synchronous::Full,
            pool: 4,
        };
        let cases = [
            (
                "sqlite:///var/lib/app/locks.db",
                at("/var/lib/app/locks.db"),
            ),
            ("sqlite://locks.db", at("locks.db")),
            (
                "sqlite://./data/locks.db?table=jobs",
                Want {
                    table: "jobs",
                    ..at("./data/locks.db")
                },
            ),
            (
                "sqlite:///tmp/x.db?busy_timeout=250ms&synchronous=normal",
                Want {
                    busy: Duration::from_millis(250),
                    sync: Synchronous::Normal,
                    ..at("/tmp/x.db")
                },
            ),
            (
                "sqlite:///tmp/x.db?busy_timeout=2&max_connections=1&table=select",
                Want {
                    table: "select",
                    busy: Duration::from_secs(2),
                    pool: 1,
                    ..at("/tmp/x.db")
                },
            ),
            (
                "sqlite:///tmp/with%20space/%3Fodd%23.db",
                at("/tmp/with space/?odd#.db"),
            ),
            (
                "sqlite:///tmp/%C3%A9t%C3%A9.db?busy_timeout=1m",
                Want {
                    busy: Duration::from_secs(60),
                    ..at("/tmp/été.db")
                },
            ),
        ];
        for (url, want) in cases {
            let c = SqliteConfig::from_url(url).unwrap_or_else(|e| panic!("{url}: {e}"));
            assert_eq!(c.path(), Path::new(want.path), "{url}");
            assert_eq!(c.table().as_str(), want.table, "{url}");
            assert_eq!(c.busy_timeout(), want.busy, "{url}");
            assert_eq!(c.synchronous(), want.sync, "{url}");
            assert_eq!(c.max_connections(), want.pool, "{url}");
        }
    }

    #[test]
    fn bad_urls_are_config_errors() {
        for url in [
            "sqlite:",
            "sqlite:locks.db",
            "sqlite://",
            "sqlite://?table=x",
            "mysql://h/db",
            "sqlite://:memory:",
            "sqlite://x.db?mode=memory",
            "sqlite://file:x.db",
            "sqlite://x.db#frag",
            "sqlite://x%2.db",
            "sqlite://x%00.db",
            "sqlite://x%FF.db",
            "sqlite://x.db?table=locks;DROP",
            "sqlite://x.db?table=\"x\"",
            "sqlite://x.db?table=Locks",
            "sqlite://x.db?table=1abc",
            "sqlite://x.db?table=",
            "sqlite://x.db?table=sqlite_master",
            "sqlite://x.db?tabel=x",
            "sqlite://x.db?table=a&table=b",
            "sqlite://x.db?busy_timeout=0",
            "sqlite://x.db?busy_timeout=forever",
            "sqlite://x.db?busy_timeout=2h",
            "sqlite://x.db?synchronous=off",
            "sqlite://x.db?max_connections=0",
            "sqlite://x.db?max_connections=65",
        ] {
            match SqliteConfig::from_url(url) {
                Err(Error::Config { .. }) => {}
                other => panic!("{url}: expected a config error, got {other:?}"),
            }
        }
    }

    #[test]
    fn default_path_follows_the_documented_order() {
        type Vars = &'static [(&'static str, &'static str)];
        let env = |pairs: Vars| {
            move |name: &str| {
                pairs
                    .iter()
                    .find(|(k, _)| *k == name)
                    .map(|(_, v)| OsString::from(v))
            }
        };
        let cases: [(Vars, Option<&str>); 7] = [
            (
                &[
                    ("FENCED_HOME", "/srv/fenced"),
                    ("XDG_STATE_HOME", "/x"),
                    ("HOME", "/home/u"),
                ],
                Some("/srv/fenced/locks.db"),
            ),
            (
                &[("XDG_STATE_HOME", "/x/state"), ("HOME", "/home/u")],
                Some("/x/state/fenced/locks.db"),
            ),
            (
                &[("HOME", "/home/u")],
                Some("/home/u/.local/state/fenced/locks.db"),
            ),
            // Empty values count as unset; relative XDG_STATE_HOME is ignored.
            (
                &[
                    ("FENCED_HOME", ""),
                    ("XDG_STATE_HOME", "rel"),
                    ("HOME", "/h"),
                ],
                Some("/h/.local/state/fenced/locks.db"),
            ),
            (&[("FENCED_HOME", "relative")], None),
            (&[("HOME", "")], None),
            (&[], None),
        ];
        for (vars, want) in cases {
            let got = default_path_from(env(vars));
            match want {
                Some(p) => assert_eq!(got.unwrap(), PathBuf::from(p), "{vars:?}"),
                None => assert!(matches!(got, Err(Error::Config { .. })), "{vars:?}"),
            }
        }
    }

    #[test]
    fn paths_round_trip_through_urls() {
        for p in [
            "/home/u/.local/state/fenced/locks.db",
            "/tmp/with space/100%/a?b#c&d=e.db",
            "/tmp/ключ/🔒.db",
        ] {
            let url = url_for_path(Path::new(p)).unwrap();
            assert!(url.starts_with("sqlite:///"), "{url}");
            let back = SqliteConfig::from_url(&url).unwrap_or_else(|e| panic!("{url}: {e}"));
            assert_eq!(back.path(), Path::new(p), "{url}");
        }
    }
}
