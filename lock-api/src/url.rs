//! The URL toolkit every backend parses its URL with, so that all stores
//! agree on where a password ends, how `%XX` escapes, durations and flags
//! are read, and what happens to an unknown or repeated parameter.
//!
//! A backend's `config.rs` splits its URL with [`split_userinfo`] and
//! [`split_query`], checks the query with [`params`] and reads values with
//! [`parse_duration`], [`parse_bool`] and [`percent_decode`]; every message
//! it builds from the URL uses [`redact`].
//!
//! ```
//! use fenced_api::url::{params, parse_duration, split_query};
//! let (base, query) = split_query("redis://:p?w@cache:6379/0?prefix=billing&operation_timeout=2s");
//! assert_eq!(base, "redis://:p?w@cache:6379/0");
//! let mut timeout = None;
//! for p in params("redis", query, &["prefix", "operation_timeout"])? {
//!     match p.name {
//!         "operation_timeout" => timeout = Some(parse_duration(p.value)?),
//!         _ => assert_eq!((p.name, p.value), ("prefix", "billing")),
//!     }
//! }
//! assert_eq!(timeout, Some(std::time::Duration::from_secs(2)));
//! // A typo is never silently ignored, nor is a repeat.
//! assert!(params("redis", "prefx=billing", &["prefix"]).is_err());
//! assert!(params("redis", "prefix=a&prefix=b", &["prefix"]).is_err());
//! # Ok::<(), fenced_api::Error>(())
//! ```

use std::time::Duration;

use crate::{Error, Result};

/// The URL with the password (if any) replaced by `***`, for messages, logs
/// and `Debug` output.
///
/// ```
/// use fenced_api::url::redact;
/// assert_eq!(redact("mysql://app:hunter2@db:3306/app"), "mysql://app:***@db:3306/app");
/// assert_eq!(redact("redis://:hunter2@cache/0#insecure"), "redis://:***@cache/0#insecure");
/// assert_eq!(redact("etcd://h1:2379,h2:2379/ns"), "etcd://h1:2379,h2:2379/ns");
/// // Unencoded reserved characters in the password are hidden too.
/// assert_eq!(redact("mysql://app:pa/ss?#@db/app"), "mysql://app:***@db/app");
/// assert_eq!(redact("mysql://app:p@ss@db/app?x=y"), "mysql://app:***@db/app?x=y");
/// ```
pub fn redact(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_owned();
    };
    if !rest.contains('@') {
        return url.to_owned();
    }
    match split_userinfo(rest) {
        (
            Some(Userinfo {
                user,
                password: Some(_),
            }),
            host,
        ) => format!("{scheme}://{user}:***@{host}"),
        (Some(_), _) => url.to_owned(),
        // An `@` but no recognisable host after any: hide everything.
        (None, _) => format!("{scheme}://***"),
    }
}

/// The `user[:password]` part of a URL, as written (not percent-decoded).
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Userinfo<'a> {
    /// The user name (may be empty, as in `redis://:password@host`).
    pub user: &'a str,
    /// The password, if a `:` follows the user name.
    pub password: Option<&'a str>,
}

impl std::fmt::Debug for Userinfo<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Userinfo")
            .field("user", &self.user)
            .field("password", &self.password.map(|_| "***"))
            .finish()
    }
}

/// Splits `rest` (a URL after `scheme://`) into its userinfo and what
/// follows the userinfo's `@` (hosts, path, query, fragment).
///
/// The userinfo ends at the first `@` followed by something that looks like
/// a host list (`host[:port][,host[:port]…]`, `[v6]` and `%zone` included)
/// and then the end, `/`, `?` or `#`: so a password with unencoded `/`,
/// `?`, `#` or `@` stays inside the userinfo and never reaches a path, a
/// parameter or a message. Without such an `@` there is no userinfo and
/// `rest` comes back whole.
///
/// ```
/// use fenced_api::url::{split_userinfo, Userinfo};
/// let (info, hosts) = split_userinfo("app:p/ss?w@rd@db1:3306,db2/app");
/// assert_eq!(info, Some(Userinfo { user: "app", password: Some("p/ss?w@rd") }));
/// assert_eq!(hosts, "db1:3306,db2/app");
/// assert_eq!(split_userinfo("h:2379/ns").0, None);
/// ```
pub fn split_userinfo(rest: &str) -> (Option<Userinfo<'_>>, &str) {
    match userinfo_end(rest) {
        Some(at) => {
            let userinfo = &rest[..at];
            let (user, password) = match userinfo.split_once(':') {
                Some((u, p)) => (u, Some(p)),
                None => (userinfo, None),
            };
            (Some(Userinfo { user, password }), &rest[at + 1..])
        }
        None => (None, rest),
    }
}

/// The `user[:password]` of `rest` (a URL after `scheme://`), owned, and
/// what follows it — for stores that authenticate with both. An `@` with no
/// host list after it (`user:password@` then nothing a host could be) is an
/// error naming the user only, never reading the password as a host.
///
/// ```
/// use fenced_api::url::credentials;
/// let (user, rest) = credentials("zookeeper", "app:s3cr@t@h1:2181/fenced", "zk://user:password@host:2181/path")?;
/// assert_eq!(user, Some(("app".to_owned(), "s3cr@t".to_owned())));
/// assert_eq!(rest, "h1:2181/fenced");
/// let e = credentials("zookeeper", "app:hunter2@", "zk://user:password@host:2181/path").unwrap_err();
/// assert!(!e.to_string().contains("hunter2"));
/// # Ok::<(), fenced_api::Error>(())
/// ```
///
/// # Errors
///
/// [`Error::Config`] for `user:password@` with no host after it.
pub fn credentials<'a>(
    store: &str,
    rest: &'a str,
    example: &str,
) -> Result<(Option<(String, String)>, &'a str)> {
    match split_userinfo(rest) {
        (Some(info), rest) => Ok((
            Some((
                info.user.to_owned(),
                info.password.unwrap_or_default().to_owned(),
            )),
            rest,
        )),
        (None, rest) => match rest.split_once('@') {
            Some((userinfo, _)) if userinfo.contains(':') => {
                let user = userinfo.split(':').next().unwrap_or_default();
                Err(Error::config(format!(
                    "no {store} host after `{user}:***@` (expected {example})"
                )))
            }
            _ => Ok((None, rest)),
        },
    }
}

/// A host list `h1[:p1],h2[:p2],[v6]:p3` as `host:port` strings
/// (`[v6]:port` for IPv6), `default_port` where a host names none. A port
/// must be a number from 1 to 65535 — never silently replaced by the
/// default.
///
/// ```
/// use fenced_api::url::host_list;
/// assert_eq!(host_list("zookeeper", "a,b:2182,[::1]", 2181)?, ["a:2181", "b:2182", "[::1]:2181"]);
/// assert!(host_list("zookeeper", "a:0", 2181).is_err() && host_list("zookeeper", "a:x", 2181).is_err());
/// assert!(host_list("zookeeper", ",", 2181).is_err());
/// # Ok::<(), fenced_api::Error>(())
/// ```
///
/// # Errors
///
/// [`Error::Config`] naming the bad host, or saying there is none.
pub fn host_list(store: &str, hosts: &str, default_port: u16) -> Result<Vec<String>> {
    let list = hosts
        .split(',')
        .filter(|h| !h.is_empty())
        .map(|h| host_port(store, h, default_port))
        .collect::<Result<Vec<String>>>()?;
    if list.is_empty() {
        return Err(Error::config(format!("no {store} host in `{hosts}`")));
    }
    Ok(list)
}

fn host_port(store: &str, h: &str, default_port: u16) -> Result<String> {
    let (host, port) = if let Some(v6) = h.strip_prefix('[') {
        match v6.split_once(']') {
            Some((addr, "")) => (addr, None),
            Some((addr, p)) => match p.strip_prefix(':') {
                Some(p) => (addr, Some(p)),
                None => {
                    return Err(Error::config(format!(
                        "bad {store} host `{h}`: expected [address]:port"
                    )))
                }
            },
            None => {
                return Err(Error::config(format!(
                    "bad {store} host `{h}`: missing `]`"
                )))
            }
        }
    } else {
        match h.rsplit_once(':') {
            Some((host, p)) => (host, Some(p)),
            None => (h, None),
        }
    };
    if host.is_empty() {
        return Err(Error::config(format!("no host name in {store} host `{h}`")));
    }
    let port = match port {
        None => default_port,
        Some(p) => match p.parse::<u16>() {
            Ok(n) if n > 0 && p.bytes().all(|b| b.is_ascii_digit()) => n,
            _ => {
                return Err(Error::config(format!(
                    "bad port `{}` in {store} host `{host}`: expected a number from 1 to 65535",
                    p.chars().take(20).collect::<String>()
                )))
            }
        },
    };
    Ok(if h.starts_with('[') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    })
}

/// Where the userinfo of `rest` (a URL after `scheme://`) ends: the index
/// of the `@` described in [`split_userinfo`], or `None`. A candidate whose
/// user name (the part before its first `:`) holds `/`, `?` or `#` is not a
/// userinfo: that `@` belongs to a path or a query (`?prefix=team@x`).
pub fn userinfo_end(rest: &str) -> Option<usize> {
    rest.match_indices('@').map(|(i, _)| i).find(|&i| {
        let user = rest[..i].split(':').next().unwrap_or_default();
        !user.contains(['/', '?', '#']) && looks_like_hosts(&rest[i + 1..])
    })
}

/// Whether `s` starts with `host[:port][,host[:port]…]` and then ends or
/// goes on with `/`, `?` or `#`. A `%` counts only inside `[…]` (an IPv6
/// zone, `[fe80::1%25eth0]`).
fn looks_like_hosts(s: &str) -> bool {
    let end = s.find(['/', '?', '#']).unwrap_or(s.len());
    let hosts = &s[..end];
    let mut in_brackets = false;
    !hosts.is_empty()
        && hosts.chars().all(|c| match c {
            '[' => {
                in_brackets = true;
                true
            }
            ']' => {
                in_brackets = false;
                true
            }
            '%' => in_brackets,
            c => c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_' | ':' | ','),
        })
}

/// Splits `url` into the part before the query and the query (without the
/// `?`; empty when there is none). The query starts at the first `?` after
/// the userinfo, so a password holding an unencoded `?` is not taken for
/// parameters. A fragment (`#…`) stays with the query; stores that use one
/// split it off themselves.
///
/// ```
/// use fenced_api::url::split_query;
/// assert_eq!(split_query("mysql://u:p?q@h:1/db?table=t"), ("mysql://u:p?q@h:1/db", "table=t"));
/// assert_eq!(split_query("mysql://h/db"), ("mysql://h/db", ""));
/// ```
pub fn split_query(url: &str) -> (&str, &str) {
    let after_scheme = url.find("://").map_or(0, |i| i + 3);
    let rest = &url[after_scheme..];
    let host_start = userinfo_end(rest).map_or(0, |at| at + 1);
    let from = after_scheme + host_start;
    match url[from..].find('?') {
        Some(q) => (&url[..from + q], &url[from + q + 1..]),
        None => (url, ""),
    }
}

/// One checked `name=value` of a URL's query.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Param<'a> {
    /// The parameter's name: the first spelling of its entry in the list it
    /// was checked against, whichever spelling the URL used.
    pub name: &'static str,
    /// The value as written (not percent-decoded; empty for a bare `name`).
    pub value: &'a str,
    /// `name=value` exactly as written, for handing on to a driver.
    pub raw: &'a str,
}

/// Checks the query of a `store` URL against the parameters the store
/// knows and returns them in order.
///
/// Each entry of `known` is a parameter name, or several spellings of one
/// parameter separated by `|` (`"ssl-mode|sslmode"`): spellings of one
/// parameter count as one.
///
/// # Errors
///
/// [`Error::Config`] for an unknown parameter (named only when it looks like
/// a name: after a password with an unencoded `?` the "parameter" may be the
/// rest of that password) or one given twice. A misspelt or repeated
/// parameter must never fall back to a default: `tabel=jobs` would put the
/// application in the namespace everybody else shares.
pub fn params<'a>(store: &str, query: &'a str, known: &[&'static str]) -> Result<Vec<Param<'a>>> {
    let mut out: Vec<Param<'a>> = Vec::new();
    for raw in query.split('&').filter(|p| !p.is_empty()) {
        let (k, value) = raw.split_once('=').unwrap_or((raw, ""));
        let Some(name) = known
            .iter()
            .find(|entry| entry.split('|').any(|spelling| spelling == k))
            .map(|entry| entry.split('|').next().unwrap_or(entry))
        else {
            let names: Vec<&str> = known
                .iter()
                .map(|e| e.split('|').next().unwrap_or(e))
                .collect();
            return Err(Error::config(format!(
                "unknown {store} url parameter {}; known: {}",
                shown_name(k),
                names.join(", ")
            )));
        };
        if out.iter().any(|p| p.name == name) {
            return Err(Error::config(format!(
                "the {store} url parameter `{name}` is given twice"
            )));
        }
        out.push(Param { name, value, raw });
    }
    Ok(out)
}

/// An unknown parameter's name for a message, if it looks like a name.
fn shown_name(k: &str) -> String {
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

/// Decodes `%XX` escapes (a path or value with `?`, `#`, `&`, `%` or a
/// space in it).
///
/// ```
/// use fenced_api::url::percent_decode;
/// assert_eq!(percent_decode("/var/my%20locks/a%23b.db")?, "/var/my locks/a#b.db");
/// assert!(percent_decode("100%").is_err() && percent_decode("%zz").is_err());
/// # Ok::<(), fenced_api::Error>(())
/// ```
///
/// # Errors
///
/// [`Error::Config`] for a `%` not followed by two hex digits, or escapes
/// that do not decode to UTF-8.
pub fn percent_decode(v: &str) -> Result<String> {
    let b = v.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' {
            let hex = v
                .get(i + 1..i + 3)
                .filter(|h| h.bytes().all(|c| c.is_ascii_hexdigit()))
                .and_then(|h| u8::from_str_radix(h, 16).ok())
                .ok_or_else(|| {
                    Error::config(format!(
                        "invalid percent-encoding in `{v}`: `%` must be followed by two hex digits (write `%25` for `%`)"
                    ))
                })?;
            out.push(hex);
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8(out)
        .map_err(|_| Error::config(format!("`{v}` does not percent-decode to UTF-8")))
}

/// Parses a duration the way every fenced setting does, in URLs and on the
/// command line: a bare number of seconds (`3`), or whole numbers with a
/// unit — `ms`, `s`, `m`, `h`, `d` — one term or several (`250ms`, `5s`, `2m`,
/// `1h`, `1m 30s`, `3s 400ms`, the form fenced prints durations in). No
/// fractions and no space between a number and its unit, so `1.5s` and
/// `1 s` are errors rather than guesses. No bounds: callers apply theirs.
///
/// ```
/// use std::time::Duration;
/// use fenced_api::url::parse_duration_syntax;
/// assert_eq!(parse_duration_syntax("1m 30s")?, Duration::from_secs(90));
/// assert_eq!(parse_duration_syntax("3s 400ms")?, Duration::from_millis(3400));
/// assert_eq!(parse_duration_syntax("0")?, Duration::ZERO);
/// assert!(parse_duration_syntax("1.5s").is_err() && parse_duration_syntax("10us").is_err());
/// # Ok::<(), fenced_api::Error>(())
/// ```
///
/// # Errors
///
/// [`Error::Config`] saying what a valid value looks like.
pub fn parse_duration_syntax(v: &str) -> Result<Duration> {
    let bad = || Error::config(format!("invalid duration `{v}`; use e.g. 500ms, 5s or 2m"));
    if !v.is_empty() && v.bytes().all(|b| b.is_ascii_digit()) {
        return v.parse().map(Duration::from_secs).map_err(|_| bad());
    }
    let mut total = Duration::ZERO;
    let mut terms = 0;
    let mut rest = v;
    loop {
        rest = rest.trim_start_matches(' ');
        if rest.is_empty() {
            break;
        }
        let digits = rest
            .find(|c: char| !c.is_ascii_digit())
            .unwrap_or(rest.len());
        let n: u64 = rest[..digits].parse().map_err(|_| bad())?;
        let after = &rest[digits..];
        let letters = after
            .find(|c: char| !c.is_ascii_alphabetic())
            .unwrap_or(after.len());
        let secs = |per: u64| n.checked_mul(per).map(Duration::from_secs);
        let term = match &after[..letters] {
            "ms" => Some(Duration::from_millis(n)),
            "s" => Some(Duration::from_secs(n)),
            "m" => secs(60),
            "h" => secs(3600),
            "d" => secs(86_400),
            _ => None,
        };
        total = term.and_then(|t| total.checked_add(t)).ok_or_else(bad)?;
        terms += 1;
        rest = &after[letters..];
    }
    if terms == 0 {
        return Err(bad());
    }
    Ok(total)
}

/// Parses a URL duration parameter ([`parse_duration_syntax`]): above zero
/// and at most one hour.
///
/// ```
/// use std::time::Duration;
/// use fenced_api::url::parse_duration;
/// assert_eq!(parse_duration("250ms")?, Duration::from_millis(250));
/// assert_eq!(parse_duration("3")?, Duration::from_secs(3));
/// assert!(parse_duration("0s").is_err() && parse_duration("2h").is_err() && parse_duration("soon").is_err());
/// # Ok::<(), fenced_api::Error>(())
/// ```
///
/// # Errors
///
/// [`Error::Config`] saying what a valid value looks like.
pub fn parse_duration(v: &str) -> Result<Duration> {
    let d = parse_duration_syntax(v)?;
    if d.is_zero() || d > Duration::from_secs(3600) {
        return Err(Error::config(format!(
            "duration `{v}` must be above zero and at most 1h"
        )));
    }
    Ok(d)
}

/// Checks a duration set through a builder against the bounds URL
/// durations have: above zero and at most one hour.
///
/// # Errors
///
/// [`Error::Config`] naming the setting.
pub fn check_duration(name: &str, d: Duration) -> Result<Duration> {
    if d.is_zero() || d > Duration::from_secs(3600) {
        return Err(Error::config(format!(
            "{name} {d:?} must be above zero and at most 1h"
        )));
    }
    Ok(d)
}

/// Parses a URL flag `name`: `true`/`1` or `false`/`0`.
///
/// # Errors
///
/// [`Error::Config`] naming the parameter.
pub fn parse_bool(name: &str, v: &str) -> Result<bool> {
    match v {
        "true" | "1" => Ok(true),
        "false" | "0" => Ok(false),
        _ => Err(Error::config(format!(
            "{name} must be true or false, got `{v}`"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spellings_count_as_one_parameter() {
        let known = ["table", "ssl-mode|sslmode"];
        let p = params("mysql", "sslmode=DISABLED&table=t", &known).unwrap();
        assert_eq!(p[0].name, "ssl-mode");
        assert_eq!(p[0].raw, "sslmode=DISABLED");
        assert_eq!(p[1].value, "t");
        let e = params("mysql", "ssl-mode=REQUIRED&sslmode=DISABLED", &known).unwrap_err();
        assert!(e.to_string().contains("`ssl-mode` is given twice"), "{e}");
        let e = params("mysql", "tabel=jobs", &known).unwrap_err();
        assert!(e.to_string().contains("`tabel`"), "{e}");
        assert!(e.to_string().contains("known: table, ssl-mode"), "{e}");
        let e = params("mysql", "Bravo%20x=1", &known).unwrap_err();
        assert!(!e.to_string().contains("Bravo"), "{e}");
        assert!(params("mysql", "", &known).unwrap().is_empty());
    }

    #[test]
    fn userinfo_ends_before_the_host_list() {
        for (rest, user, password, after) in [
            ("u:p@h", "u", Some("p"), "h"),
            ("u@h:1/x", "u", None, "h:1/x"),
            (":p/q?r#s@h?x=1", "", Some("p/q?r#s"), "h?x=1"),
            ("u:a@b@[::1]:5/db", "u", Some("a@b"), "[::1]:5/db"),
            (
                "u:p@[fe80::1%25eth0]:5/db",
                "u",
                Some("p"),
                "[fe80::1%25eth0]:5/db",
            ),
            ("u:Ab@12%/x@cache:6379", "u", Some("Ab@12%/x"), "cache:6379"),
        ] {
            let (info, rest_after) = split_userinfo(rest);
            assert_eq!(info, Some(Userinfo { user, password }), "{rest}");
            assert_eq!(rest_after, after, "{rest}");
        }
        assert!(!format!("{:?}", split_userinfo("u:hunter2@h").0).contains("hunter2"));
        // An `@` in a path or a query is not the end of a userinfo.
        assert_eq!(split_userinfo("h?prefix=team@x"), (None, "h?prefix=team@x"));
        assert_eq!(split_userinfo("h/a@b"), (None, "h/a@b"));
        assert_eq!(
            split_query("redis://h?prefix=team@x"),
            ("redis://h", "prefix=team@x")
        );
    }

    #[test]
    fn durations_share_one_syntax() {
        assert_eq!(parse_duration("1m 30s").unwrap(), Duration::from_secs(90));
        assert_eq!(parse_duration("1m30s").unwrap(), Duration::from_secs(90));
        assert_eq!(parse_duration("1h").unwrap(), Duration::from_secs(3600));
        assert_eq!(
            parse_duration_syntax("1h 2m 3s 4ms").unwrap(),
            Duration::from_millis(3_723_004)
        );
        assert_eq!(
            parse_duration_syntax("1d").unwrap(),
            Duration::from_secs(86_400)
        );
        assert!(
            parse_duration("1d").is_err(),
            "above the 1h bound of URL durations"
        );
        for bad in [
            "",
            " ",
            "s",
            "-1s",
            "5 parsecs",
            "1h 1s",
            "1.5s",
            "1 s",
            "10us",
            "1min",
            "5s,",
            "0x10s",
            "99999999999999999999s",
        ] {
            assert!(parse_duration(bad).is_err(), "{bad}");
        }
        assert!(parse_bool("x", "1").unwrap());
        assert!(parse_bool("x", "yes").is_err());
    }
}
