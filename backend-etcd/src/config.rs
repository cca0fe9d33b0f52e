//! Configuration: from an `etcd://h1:2379,h2:2379/prefix?…` URL or the
//! builder, validated before connecting.

use std::{fmt, path::PathBuf, time::Duration};

use fenced_api::url::{credentials, host_list, params, parse_duration, percent_decode, redact};
use fenced_api::{Error, Result};

/// Default key prefix (the namespace).
pub const DEFAULT_PREFIX: &str = "fenced";
/// Default bound on connecting.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Default bound on one request.
pub const DEFAULT_OPERATION_TIMEOUT: Duration = Duration::from_secs(5);

/// The port of a host named without one.
const DEFAULT_PORT: u16 = 2379;

/// The URL parameters, one entry per parameter (`|` between spellings).
const KNOWN: &[&str] = &["connect_timeout", "operation_timeout|timeout", "ca"];

/// Connection and namespace settings. `Debug` never shows the password.
#[derive(Clone)]
pub struct EtcdConfig {
    pub(crate) endpoints: Vec<String>,
    pub(crate) prefix: String,
    pub(crate) user: Option<(String, String)>,
    pub(crate) tls: bool,
    /// PEM file of the CA(s) to trust for `etcds://` instead of the
    /// platform's roots.
    pub(crate) ca: Option<PathBuf>,
    pub(crate) connect_timeout: Duration,
    pub(crate) operation_timeout: Duration,
}

impl fmt::Debug for EtcdConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EtcdConfig")
            .field("endpoints", &self.endpoints)
            .field("prefix", &self.prefix)
            .field("user", &self.user.as_ref().map(|(u, _)| format!("{u}:***")))
            .field("tls", &self.tls)
            .field("ca", &self.ca)
            .field("connect_timeout", &self.connect_timeout)
            .field("operation_timeout", &self.operation_timeout)
            .finish()
    }
}

impl EtcdConfig {
    /// Parses `etcd://[user:password@]h1:2379[,h2:2379…][/prefix][?connect_timeout=5s&operation_timeout=5s]`
    /// (`etcds://` for TLS, which needs the `tls` cargo feature).
    ///
    /// The prefix is the namespace: two prefixes never see each other's locks
    /// (default [`DEFAULT_PREFIX`]; 1 to 128 bytes, no control characters).
    /// A host without a port means 2379; a port must be a number from 1 to
    /// 65535.
    ///
    /// Parameters, each at most once:
    ///
    /// * `connect_timeout` — bound on connecting (default 5 s);
    /// * `operation_timeout` (or `timeout`) — bound on every request
    ///   (default 5 s);
    /// * `ca=<path>` (`etcds://` only) — a PEM file with the certificate
    ///   authority (or authorities) that signed the servers' certificates;
    ///   only these are trusted then. Without it the platform's roots are
    ///   trusted (the system store; `SSL_CERT_FILE` / `SSL_CERT_DIR` when
    ///   set). Percent-encode a path with `&`, `#` or `%` in it.
    ///
    /// Durations are a number of seconds or `250ms`, `5s`, `2m`, above zero
    /// and at most one hour.
    ///
    /// ```
    /// # use fenced_etcd::EtcdConfig;
    /// let c = EtcdConfig::from_url("etcds://10.0.0.1:2379/billing?ca=/etc/etcd/ca.pem")?;
    /// assert_eq!(c.ca(), Some(std::path::Path::new("/etc/etcd/ca.pem")));
    /// # Ok::<(), fenced_api::Error>(())
    /// ```
    ///
    /// # Errors
    ///
    /// [`Error::Config`] for a malformed URL (a bad port, an unknown or
    /// repeated parameter, `ca` on a plaintext URL); nothing is connected,
    /// and no message ever shows the password.
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
        let (user, rest) = credentials("etcd", rest, "etcd://user:password@host:2379/prefix")?;
        // The userinfo is off: the first `?` starts the query.
        let (rest, query) = rest.split_once('?').unwrap_or((rest, ""));
        let (hosts, path) = rest.split_once('/').unwrap_or((rest, ""));
        let http = if tls { "https" } else { "http" };
        if hosts.split(',').all(str::is_empty) {
            return Err(Error::config(format!(
                "no etcd endpoint in `{}`",
                redact(url)
            )));
        }
        let endpoints = host_list("etcd", hosts, DEFAULT_PORT)?
            .into_iter()
            .map(|h| format!("{http}://{h}"))
            .collect();
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
            ca: None,
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            operation_timeout: DEFAULT_OPERATION_TIMEOUT,
        };
        for p in params("etcd", query, KNOWN)? {
            match p.name {
                "connect_timeout" => config.connect_timeout = parse_duration(p.value)?,
                "operation_timeout" => config.operation_timeout = parse_duration(p.value)?,
                // `ca`, the last name in KNOWN.
                _ => config.ca = Some(ca_path(tls, p.value)?),
            }
        }
        Ok(config)
    }

    /// Checks what the builder may have changed: the prefix and both bounds.
    pub(crate) fn validate(&self) -> Result<()> {
        validate_prefix(&self.prefix)?;
        fenced_api::url::check_duration("the etcd connect_timeout", self.connect_timeout)?;
        fenced_api::url::check_duration("the etcd operation_timeout", self.operation_timeout)?;
        Ok(())
    }

    /// The CA file trusted for `etcds://` (the `ca` parameter), if any.
    pub fn ca(&self) -> Option<&std::path::Path> {
        self.ca.as_deref()
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

/// The value of the `ca` parameter, percent-decoded.
fn ca_path(tls: bool, value: &str) -> Result<PathBuf> {
    if !tls {
        return Err(Error::config(
            "the etcd url parameter `ca` needs TLS: use etcds://",
        ));
    }
    let path = percent_decode(value)?;
    if path.is_empty() {
        return Err(Error::config(
            "the etcd url parameter `ca` needs a path to a PEM file",
        ));
    }
    Ok(path.into())
}

fn validate_prefix(prefix: &str) -> Result<()> {
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
        assert_eq!(c.operation_timeout, Duration::from_secs(3));
    }

    #[test]
    fn both_spellings_of_the_operation_timeout() {
        for url in ["etcd://h/p?operation_timeout=3s", "etcd://h/p?timeout=3s"] {
            let c = EtcdConfig::from_url(url).unwrap_or_else(|e| panic!("{url}: {e}"));
            assert_eq!(c.operation_timeout, Duration::from_secs(3), "{url}");
        }
        let c = EtcdConfig::from_url("etcd://h/p").unwrap();
        assert_eq!(c.connect_timeout, DEFAULT_CONNECT_TIMEOUT);
        assert_eq!(c.operation_timeout, DEFAULT_OPERATION_TIMEOUT);
    }

    /// A repeat never silently overrides: one of the two values would be
    /// ignored.
    #[test]
    fn a_repeated_parameter_is_an_error() {
        for url in [
            "etcd://h/p?timeout=1s&timeout=2s",
            "etcd://h/p?operation_timeout=1s&timeout=2s",
            "etcd://h/p?connect_timeout=1s&connect_timeout=1s",
            "etcds://h/p?ca=/a.pem&ca=/b.pem",
        ] {
            match EtcdConfig::from_url(url) {
                Err(e @ Error::Config { .. }) => {
                    assert!(e.to_string().contains("given twice"), "{url}: {e}")
                }
                other => panic!("{url}: {other:?}"),
            }
        }
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
    fn bad_ports_are_config_errors_never_defaults() {
        for url in [
            "etcd://127.0.0.1:99999/fz",
            "etcd://127.0.0.1:abc/fz",
            "etcd://127.0.0.1:0/fz",
            "etcd://127.0.0.1:+80/fz",
            "etcd://127.0.0.1:/fz",
            "etcd://127.0.0.1:2379,127.0.0.1:99999/fz",
            "etcd://:2379/fz",
        ] {
            match EtcdConfig::from_url(url) {
                Err(e @ Error::Config { .. }) => {
                    assert!(
                        e.to_string().contains("port") || e.to_string().contains("host"),
                        "{url}: {e}"
                    )
                }
                other => panic!("{url}: {other:?}"),
            }
        }
        let c = EtcdConfig::from_url("etcd://[::1]:2380,[::1]/p").unwrap();
        assert_eq!(c.endpoints, ["http://[::1]:2380", "http://[::1]:2379"]);
    }

    #[test]
    fn ca_parameter() {
        let c = EtcdConfig::from_url("etcds://h:2379/p?ca=/etc/my%26ca.pem&timeout=2s").unwrap();
        assert_eq!(c.ca(), Some(std::path::Path::new("/etc/my&ca.pem")));
        assert_eq!(EtcdConfig::from_url("etcds://h/p").unwrap().ca(), None);
        for url in [
            "etcd://h/p?ca=/x.pem",
            "etcds://h/p?ca=",
            "etcds://h/p?ca=%zz",
        ] {
            assert!(
                matches!(EtcdConfig::from_url(url), Err(Error::Config { .. })),
                "{url}"
            );
        }
    }

    #[test]
    fn passwords_with_reserved_characters_stay_in_the_userinfo() {
        for pw in [
            "Alpha?Bravo",
            "Alpha/Bravo",
            "Alpha#Bravo",
            "Alpha@Bravo",
            "a?b=c&d",
        ] {
            let url = format!("etcd://root:{pw}@127.0.0.1:1/p?timeout=2s");
            let c = EtcdConfig::from_url(&url).unwrap_or_else(|e| panic!("{pw}: {e}"));
            assert_eq!(c.user, Some(("root".into(), pw.into())));
            assert_eq!(c.endpoints, ["http://127.0.0.1:1"]);
            assert_eq!(c.prefix, "p");
            for bad in [
                format!("etcd://root:{pw}@127.0.0.1:1/p?nope=1"),
                format!("etcds://root:{pw}@/p"),
                format!("etcd://root:{pw}@"),
            ] {
                let e = EtcdConfig::from_url(&bad).unwrap_err();
                assert!(!e.to_string().contains("Bravo"), "{e}");
                assert!(!e.to_string().contains("Alpha"), "{e}");
            }
            let bad = format!("etcd://root:{pw}@127.0.0.1:1/p?nope=1");
            let e = EtcdConfig::from_url(&bad).unwrap_err();
            assert!(!e.to_string().contains("Bravo"), "{e}");
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
