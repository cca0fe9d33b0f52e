//! Configuration: from a URL, a path or the builder, validated before any file is touched.

use std::{
    ffi::OsString,
    fmt,
    path::{Path, PathBuf},
    str::FromStr,
    time::Duration,
};

use fenced_api::url::parse_duration;
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
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct TableName(String);

impl TableName {
    /// Longest name accepted (derived names add `_migrations`).
    pub const MAX_LEN: usize = 48;

    /// Validates a table name.
    ///
    /// # Errors
    ///
    /// [`Error::Config`] naming the rule that was broken.
    pub fn new(name: &str) -> Result<Self> {
        let mut chars = name.chars();
        let valid_start = chars
            .next()
            .is_some_and(|c| c.is_ascii_lowercase() || c == '_');
        if !valid_start || !chars.all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
        {
            return Err(Error::config(format!(
                "invalid table name {name:?}: use lowercase ASCII letters, digits and `_`, \
                 not starting with a digit (SQLite table names are case-insensitive)"
            )));
        }
        if name.len() > Self::MAX_LEN {
            return Err(Error::config(format!(
                "table name {name:?} is {} characters long; the maximum is {}",
                name.len(),
                Self::MAX_LEN
            )));
        }
        if name.starts_with("sqlite_") {
            return Err(Error::config(format!(
                "table name {name:?} starts with `sqlite_`, which SQLite reserves for itself"
            )));
        }
        Ok(TableName(name.to_owned()))
    }

    /// The name.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The double-quoted physical table `<name><suffix>`.
    pub(crate) fn quoted(&self, suffix: &str) -> String {
        format!("\"{}{}\"", self.0, suffix)
    }
}

impl fmt::Display for TableName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

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
        let path = percent_decode(raw_path)
            .map_err(|why| Error::config(format!("invalid path in sqlite url `{url}`: {why}")))?;
        if path.is_empty() {
            return Err(Error::config(format!(
                "sqlite url `{url}` names no file; use sqlite:///absolute/path.db \
                 or sqlite://relative/path.db"
            )));
        }
        let mut config = SqliteConfig::for_path(PathBuf::from(path))?;
        let mut seen = Vec::new();
        for pair in query.split('&').filter(|p| !p.is_empty()) {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            if seen.contains(&k) {
                return Err(Error::config(format!(
                    "parameter `{k}` is given twice in sqlite url `{url}`"
                )));
            }
            seen.push(k);
            match k {
                "table" => config.table = TableName::new(v)?,
                "busy_timeout" => config.busy_timeout = parse_duration(v)?,
                "synchronous" => config.synchronous = v.parse()?,
                "max_connections" => config.max_connections = parse_pool_size(v)?,
                "mode" if v == "memory" => return Err(in_memory()),
                other => {
                    return Err(Error::config(format!(
                        "unknown parameter `{other}` in sqlite url `{url}`; \
                         known: table, busy_timeout, synchronous, max_connections"
                    )))
                }
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
        if self.busy_timeout.is_zero() || self.busy_timeout > MAX_BUSY_TIMEOUT {
            return Err(Error::config(format!(
                "busy_timeout must be above zero and at most {MAX_BUSY_TIMEOUT:?}"
            )));
        }
        Ok(())
    }
}

const MAX_BUSY_TIMEOUT: Duration = Duration::from_secs(3600);

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

/// Decodes `%XX` escapes; the result must be UTF-8.
fn percent_decode(s: &str) -> std::result::Result<String, String> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = bytes
                .get(i + 1..i + 3)
                .and_then(|h| std::str::from_utf8(h).ok())
                .and_then(|h| u8::from_str_radix(h, 16).ok())
                .ok_or_else(|| format!("bad escape at byte {i}"))?;
            out.push(hex);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).map_err(|_| "the decoded path is not UTF-8".to_owned())
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
        let cases: [(&str, &str, &str, Duration, Synchronous, u32); 7] = [
            (
                "sqlite:///var/lib/app/locks.db",
                "/var/lib/app/locks.db",
                "fenced_locks",
                Duration::from_secs(5),
                Synchronous::Full,
                4,
            ),
            (
                "sqlite://locks.db",
                "locks.db",
                "fenced_locks",
                Duration::from_secs(5),
                Synchronous::Full,
                4,
            ),
            (
                "sqlite://./data/locks.db?table=jobs",
                "./data/locks.db",
                "jobs",
                Duration::from_secs(5),
                Synchronous::Full,
                4,
            ),
            (
                "sqlite:///tmp/x.db?busy_timeout=250ms&synchronous=normal",
                "/tmp/x.db",
                "fenced_locks",
                Duration::from_millis(250),
                Synchronous::Normal,
                4,
            ),
            (
                "sqlite:///tmp/x.db?busy_timeout=2&max_connections=1&table=select",
                "/tmp/x.db",
                "select",
                Duration::from_secs(2),
                Synchronous::Full,
                1,
            ),
            (
                "sqlite:///tmp/with%20space/%3Fodd%23.db",
                "/tmp/with space/?odd#.db",
                "fenced_locks",
                Duration::from_secs(5),
                Synchronous::Full,
                4,
            ),
            (
                "sqlite:///tmp/%C3%A9t%C3%A9.db?busy_timeout=1m",
                "/tmp/été.db",
                "fenced_locks",
                Duration::from_secs(60),
                Synchronous::Full,
                4,
            ),
        ];
        for (url, path, table, busy, sync, pool) in cases {
            let c = SqliteConfig::from_url(url).unwrap_or_else(|e| panic!("{url}: {e}"));
            assert_eq!(c.path(), Path::new(path), "{url}");
            assert_eq!(c.table().as_str(), table, "{url}");
            assert_eq!(c.busy_timeout(), busy, "{url}");
            assert_eq!(c.synchronous(), sync, "{url}");
            assert_eq!(c.max_connections(), pool, "{url}");
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
    fn table_names() {
        for ok in ["locks", "_x", "locks_2", "select", "order", &"a".repeat(48)] {
            assert!(TableName::new(ok).is_ok(), "{ok}");
        }
        for bad in [
            "",
            "9x",
            "a-b",
            "a.b",
            "a b",
            "\"a\"",
            "a\"; DROP TABLE t; --",
            "Locks",
            "é",
            "sqlite_x",
            &"a".repeat(49),
        ] {
            assert!(TableName::new(bad).is_err(), "{bad}");
        }
        assert_eq!(
            TableName::new("select").unwrap().quoted("_migrations"),
            "\"select_migrations\""
        );
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
