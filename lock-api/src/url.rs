//! URL helpers shared by the backends, so that every store treats passwords
//! and durations in its URL the same way.

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
    // The userinfo ends at the first `@` followed by something that looks
    // like a host list. Scanning for it (rather than cutting at the first
    // `/`, `?` or `#`) keeps a password with unencoded `/`, `?`, `#` or `@`
    // out of the output too.
    let Some(end) = userinfo_end(rest) else {
        // No recognisable host after any `@`: hide everything.
        return format!("{scheme}://***");
    };
    let (userinfo, host) = (&rest[..end], &rest[end + 1..]);
    match userinfo.split_once(':') {
        Some((user, _)) => format!("{scheme}://{user}:***@{host}"),
        None => url.to_owned(),
    }
}

/// Where the userinfo of `rest` (a URL after `scheme://`) ends: the first
/// `@` followed by something that looks like a host list, so a password
/// with unencoded `/`, `?`, `#` or `@` stays inside the userinfo. `None`
/// when there is no such `@` (no userinfo, or no recognisable host).
pub fn userinfo_end(rest: &str) -> Option<usize> {
    rest.match_indices('@')
        .map(|(i, _)| i)
        .find(|&i| looks_like_hosts(&rest[i + 1..]))
}

/// Whether `s` starts with `host[:port][,host[:port]…]` and then ends or
/// goes on with `/`, `?` or `#`.
fn looks_like_hosts(s: &str) -> bool {
    let end = s.find(['/', '?', '#']).unwrap_or(s.len());
    let hosts = &s[..end];
    !hosts.is_empty()
        && hosts.chars().all(|c| {
            c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_' | ':' | ',' | '[' | ']')
        })
}

/// Parses a URL duration parameter: `250ms`, `5s`, `2m`, or a bare number
/// of seconds; above zero and at most one hour.
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
    let bad = || Error::config(format!("invalid duration `{v}`; use e.g. 500ms, 5s or 2m"));
    let (num, unit) = match v.find(|c: char| !c.is_ascii_digit()) {
        Some(i) => v.split_at(i),
        None => (v, "s"),
    };
    let n: u64 = num.parse().map_err(|_| bad())?;
    let d = match unit {
        "ms" => Duration::from_millis(n),
        "s" => Duration::from_secs(n),
        "m" => Duration::from_secs(n.saturating_mul(60)),
        _ => return Err(bad()),
    };
    if d.is_zero() || d > Duration::from_secs(3600) {
        return Err(Error::config(format!(
            "duration `{v}` must be above zero and at most 1h"
        )));
    }
    Ok(d)
}
