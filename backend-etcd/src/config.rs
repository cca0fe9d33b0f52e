//! Configuration from `etcd://h1:2379,h2:2379/prefix?…` URLs.

use std::{fmt, time::Duration};

pub(crate) use fenced_api::url::{parse_duration, redact};
use fenced_api::{Error, Result};

/// Connection and namespace settings. `Debug` never shows the password.
#[derive(Clone)]
pub struct EtcdConfig {
    pub(crate) endpoints: Vec<String>,
    pub(crate) prefix: String,
    pub(crate) user: Option<(String, String)>,
    pub(crate) tls: bool,
    pub(crate) connect_timeout: Duration,
    pub(crate) op_timeout: Duration,
}

impl fmt::Debug for EtcdConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EtcdConfig")
            .field("endpoints", &self.endpoints)
            .field("prefix", &self.prefix)
            .field("user", &self.user.as_ref().map(|(u, _)| format!("{u}:***")))
            .field("tls", &self.tls)
            .field("connect_timeout", &self.connect_timeout)
            .field("op_timeout", &self.op_timeout)
            .finish()
    }
}

/// Default key prefix (namespace).
pub const DEFAULT_PREFIX: &str = "fenced";

impl EtcdConfig {
    /// Parses `etcd://[user:password@]h1:2379[,h2:2379…][/prefix][?connect_timeout=5s&timeout=5s]`
    /// (`etcds://` for TLS, which needs the `tls` cargo feature).
    ///
    /// The prefix is the namespace: two prefixes never see each other's locks.
    ///
    /// # Errors
    ///
    /// [`Error::Config`] for a malformed URL; nothing is connected.
    pub fn from_url(url: &str) -> Result<Self> {
        let (scheme, rest) = url.split_once("://").ok_or_else(|| {
            Error::config(format!("expected an etcd:// url, got `{}`", redact(url)))
        })?;
        let tls = match scheme {
            "etcd" | "http" => false,
            "etcds" | "https" => true,
            _ => {
                return Err(Error::config(format!(
                    "expected an etcd:// or etcds:// url, got `{}`",
                    redact(url)
                )))
            }
        };
        let (rest, query) = rest.split_once('?').unwrap_or((rest, ""));
        let (authority, path) = rest.split_once('/').unwrap_or((rest, ""));
        let (user, hosts) = match authority.rsplit_once('@') {
            Some((userinfo, hosts)) => {
                let (u, p) = userinfo.split_once(':').unwrap_or((userinfo, ""));
                (Some((u.to_owned(), p.to_owned())), hosts)
            }
            None => (None, authority),
        };
        let http = if tls { "https" } else { "http" };
        let endpoints: Vec<String> = hosts
            .split(',')
            .filter(|h| !h.is_empty())
            .map(|h| {
                if h.contains(':') {
                    format!("{http}://{h}")
                } else {
                    format!("{http}://{h}:2379")
                }
            })
            .collect();
        if endpoints.is_empty() {
            return Err(Error::config(format!(
                "no etcd endpoint in `{}`",
                redact(url)
            )));
        }
        let prefix = if path.is_empty() {
            DEFAULT_PREFIX
        } else {
            path.trim_end_matches('/')
        };
        validate_prefix(prefix)?;
        let mut config = EtcdConfig {
            endpoints,
            prefix: prefix.to_owned(),
            user,
            tls,
            connect_timeout: Duration::from_secs(5),
            op_timeout: Duration::from_secs(5),
        };
        for pair in query.split('&').filter(|p| !p.is_empty()) {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            match k {
                "connect_timeout" => config.connect_timeout = parse_duration(v)?,
                "timeout" => config.op_timeout = parse_duration(v)?,
                other => {
                    return Err(Error::config(format!(
                        "unknown etcd url parameter `{other}`; known: connect_timeout, timeout"
                    )))
                }
            }
        }
        Ok(config)
    }

    /// The namespace prefix.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// The endpoints, as URIs.
    pub fn endpoints(&self) -> &[String] {
        &self.endpoints
    }
}

pub(crate) fn validate_prefix(prefix: &str) -> Result<()> {
    if prefix.is_empty() || prefix.len() > 128 || prefix.chars().any(char::is_control) {
        return Err(Error::config(format!(
            "invalid etcd prefix {prefix:?}: 1 to 128 bytes, no control characters"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn url_table() {
        let cases: [(&str, &[&str], &str, bool); 5] = [
            (
                "etcd://127.0.0.1:2379",
                &["http://127.0.0.1:2379"],
                "fenced",
                false,
            ),
            (
                "etcd://h1:2379,h2:2380/app/locks",
                &["http://h1:2379", "http://h2:2380"],
                "app/locks",
                false,
            ),
            ("etcd://h1/ns/", &["http://h1:2379"], "ns", false),
            ("etcds://u:p@h:2379/x", &["https://h:2379"], "x", true),
            (
                "http://127.0.0.1:2379/p?timeout=2s",
                &["http://127.0.0.1:2379"],
                "p",
                false,
            ),
        ];
        for (url, endpoints, prefix, tls) in cases {
            let c = EtcdConfig::from_url(url).unwrap_or_else(|e| panic!("{url}: {e}"));
            assert_eq!(c.endpoints, endpoints, "{url}");
            assert_eq!(c.prefix, prefix, "{url}");
            assert_eq!(c.tls, tls, "{url}");
        }
        let c =
            EtcdConfig::from_url("etcd://u:secret@h/p?connect_timeout=250ms&timeout=3s").unwrap();
        assert_eq!(c.user, Some(("u".into(), "secret".into())));
        assert_eq!(c.connect_timeout, Duration::from_millis(250));
        assert_eq!(c.op_timeout, Duration::from_secs(3));
    }

    #[test]
    fn bad_urls() {
        for url in [
            "redis://h",
            "etcd://",
            "etcd:///p",
            "etcd://h/p?nope=1",
            "etcd://h/p?timeout=x",
            "nourl",
        ] {
            assert!(
                matches!(EtcdConfig::from_url(url), Err(Error::Config { .. })),
                "{url}"
            );
        }
    }

    #[test]
    fn passwords_never_shown() {
        let c = EtcdConfig::from_url("etcd://root:hunter2@h:2379/p").unwrap();
        assert!(!format!("{c:?}").contains("hunter2"));
        let e = EtcdConfig::from_url("etcd://root:hunter2@h/p?bad=1").unwrap_err();
        assert!(!e.to_string().contains("hunter2"));
        assert_eq!(redact("etcd://root:hunter2@h/p"), "etcd://root:***@h/p");
    }
}
