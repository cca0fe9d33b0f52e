//! Configuration: from a `zk://h1:2181,h2:2181/chroot/prefix?…` URL (or
//! `zks://…` for TLS) or the builder, validated before connecting.

use std::{
    fmt,
    path::{Path, PathBuf},
    time::Duration,
};

use fenced_api::url::{
    credentials, host_list, params, parse_duration, percent_decode, redact, split_query,
};
use fenced_api::{Error, Result};

/// Default namespace: the znode under which every lock lives.
pub const DEFAULT_NAMESPACE: &str = "/fenced";
/// Default session timeout asked of the server (it may negotiate another):
/// `LockClient`'s default TTL, so that a client with default settings holds
/// its locks on one session (a longer TTL needs a session of its own).
pub const DEFAULT_SESSION_TIMEOUT: Duration = Duration::from_secs(30);
/// Default bound on connecting (establishing the session).
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Default bound on one request.
pub const DEFAULT_OPERATION_TIMEOUT: Duration = Duration::from_secs(5);

/// The port of a host named without one.
const DEFAULT_PORT: u16 = 2181;

/// The URL parameters, one entry per parameter (`|` between spellings).
const KNOWN: &[&str] = &[
    "session_timeout",
    "connect_timeout",
    "operation_timeout|timeout",
    "ca",
    "cert",
    "key",
];

/// The schemes of plaintext and of TLS connections.
const PLAIN: &[&str] = &["zk", "zookeeper"];
const TLS: &[&str] = &["zks", "zookeeper+tls"];

/// Connection and namespace settings. `Debug` never shows the password
/// (nor any key: the TLS files are held as paths and read when a session
/// opens).
#[derive(Clone)]
pub struct ZkConfig {
    pub(crate) hosts: Vec<String>,
    pub(crate) namespace: String,
    pub(crate) user: Option<(String, String)>,
    /// `zks://`: every connection is TLS.
    pub(crate) tls: bool,
    /// PEM file of the CA(s) the servers' certificates must chain to.
    pub(crate) ca: Option<PathBuf>,
    /// PEM files of the client certificate (chain) and its private key.
    pub(crate) identity: Option<(PathBuf, PathBuf)>,
    pub(crate) session_timeout: Duration,
    pub(crate) connect_timeout: Duration,
    pub(crate) operation_timeout: Duration,
}

impl fmt::Debug for ZkConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ZkConfig")
            .field("hosts", &self.hosts)
            .field("namespace", &self.namespace)
            .field("user", &self.user.as_ref().map(|(u, _)| format!("{u}:***")))
            .field("tls", &self.tls)
            .field("ca", &self.ca)
            .field("identity", &self.identity)
            .field("session_timeout", &self.session_timeout)
            .field("connect_timeout", &self.connect_timeout)
            .field("operation_timeout", &self.operation_timeout)
            .finish()
    }
}

impl ZkConfig {
    /// Parses `zk://[user:password@]h1:2181[,h2:2181…][/chroot/prefix][?session_timeout=30s&connect_timeout=5s&operation_timeout=5s]`
    /// (`zookeeper://` too), or `zks://…?ca=…[&cert=…&key=…]` for TLS
    /// (`zookeeper+tls://` too; connecting needs the `tls` cargo feature).
    ///
    /// The path is the namespace: the znode every lock lives under (default
    /// [`DEFAULT_NAMESPACE`]); two namespaces never see each other's locks.
    /// It must be a valid znode path: no empty, `.` or `..` segment, no
    /// control character; the root `/` and `/zookeeper` are refused. A host
    /// without a port means 2181; a port must be a number from 1 to 65535.
    /// `user:password` is sent as `digest` authentication.
    ///
    /// Parameters, each at most once:
    ///
    /// * `session_timeout` — the session timeout asked of the server
    ///   (default 30 s; the server clamps it to its `minSessionTimeout` ..
    ///   `maxSessionTimeout`, by default 2 to 20 tick times): the longest
    ///   TTL the client's base session carries, and how long a dead
    ///   client's shorter locks may linger;
    /// * `connect_timeout` — bound on establishing the session (default 5 s);
    /// * `operation_timeout` (or `timeout`) — bound on every request
    ///   (default 5 s);
    /// * `ca=<path>` (`zks://` only, required there) — a PEM file with the
    ///   certificate authority (or authorities) that signed the servers'
    ///   certificates; only these are trusted, and each server's certificate
    ///   must name the host as the URL writes it;
    /// * `cert=<path>&key=<path>` (`zks://` only, both or neither) — PEM
    ///   files of the client certificate (chain) and its private key, for a
    ///   server that requires client certificates (`ssl.clientAuth`, on by
    ///   default).
    ///
    /// Percent-encode a path with `&`, `#` or `%` in it. The files are read
    /// when a session opens, before anything is sent.
    ///
    /// ```
    /// # use fenced_zookeeper::ZkConfig;
    /// let c = ZkConfig::from_url("zk://10.0.0.1,10.0.0.2:2182/apps/billing?session_timeout=6s")?;
    /// assert_eq!(c.namespace(), "/apps/billing");
    /// assert_eq!(c.hosts(), ["10.0.0.1:2181", "10.0.0.2:2182"]);
    /// # Ok::<(), fenced_api::Error>(())
    /// ```
    ///
    /// # Errors
    ///
    /// [`Error::Config`] for a malformed URL (a bad port, a bad namespace,
    /// an unknown or repeated parameter, a TLS parameter on a plaintext URL,
    /// `zks://` without `ca`, `cert` without `key` or the reverse); nothing
    /// is connected, and no message ever shows the password.
    pub fn from_url(url: &str) -> Result<Self> {
        let (scheme, _) = url
            .split_once("://")
            .ok_or_else(|| Error::config(format!("expected a zk:// url, got `{}`", redact(url))))?;
        let tls = TLS.contains(&scheme);
        if !tls && !PLAIN.contains(&scheme) {
            return Err(Error::config(format!(
                "expected a zk://, zookeeper:// or zks:// url, got `{}`",
                redact(url)
            )));
        }
        let (base, query) = split_query(url);
        let rest = &base[scheme.len() + 3..];
        let (user, rest) = userinfo(rest)?;
        let (hosts, path) = match rest.find('/') {
            Some(i) => (&rest[..i], &rest[i..]),
            None => (rest, ""),
        };
        if hosts.split(',').all(str::is_empty) {
            return Err(Error::config(format!(
                "no ZooKeeper host in `{}`",
                redact(url)
            )));
        }
        let hosts = host_list("ZooKeeper", hosts, DEFAULT_PORT)?;
        let namespace = match path.trim_end_matches('/') {
            "" => DEFAULT_NAMESPACE.to_owned(),
            p => percent_decode(p)?,
        };
        validate_namespace(&namespace)?;
        let mut config = ZkConfig {
            hosts,
            namespace,
            user,
            tls,
            ca: None,
            identity: None,
            session_timeout: DEFAULT_SESSION_TIMEOUT,
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            operation_timeout: DEFAULT_OPERATION_TIMEOUT,
        };
        let (mut cert, mut key) = (None, None);
        for p in params("zookeeper", query, KNOWN)? {
            match p.name {
                "ca" => config.ca = Some(tls_path(tls, p.name, p.value)?),
                "cert" => cert = Some(tls_path(tls, p.name, p.value)?),
                "key" => key = Some(tls_path(tls, p.name, p.value)?),
                name => {
                    let d = parse_duration(p.value)?;
                    match name {
                        "session_timeout" => config.session_timeout = d,
                        "connect_timeout" => config.connect_timeout = d,
                        _ => config.operation_timeout = d,
                    }
                }
            }
        }
        config.identity = match (cert, key) {
            (Some(cert), Some(key)) => Some((cert, key)),
            (None, None) => None,
            (Some(_), None) => {
                return Err(Error::config(
                    "the zookeeper url parameter `cert` needs `key` too: the PEM file of the client certificate's private key",
                ))
            }
            (None, Some(_)) => {
                return Err(Error::config(
                    "the zookeeper url parameter `key` needs `cert` too: the PEM file of the client certificate",
                ))
            }
        };
        if tls && config.ca.is_none() {
            return Err(Error::config(
                "zks:// needs `ca=<path>`: a PEM file with the CA that signed the ZooKeeper servers' certificates",
            ));
        }
        Ok(config)
    }

    /// Checks what the builder may have changed: the namespace and the bounds.
    pub(crate) fn validate(&self) -> Result<()> {
        validate_namespace(&self.namespace)?;
        fenced_api::url::check_duration("the zookeeper session_timeout", self.session_timeout)?;
        fenced_api::url::check_duration("the zookeeper connect_timeout", self.connect_timeout)?;
        fenced_api::url::check_duration("the zookeeper operation_timeout", self.operation_timeout)?;
        Ok(())
    }

    /// The namespace: the znode path every lock lives under.
    pub fn namespace(&self) -> &str {
        &self.namespace
    }

    /// The servers, as `host:port`.
    pub fn hosts(&self) -> &[String] {
        &self.hosts
    }

    /// The session timeout asked of the server.
    pub fn session_timeout(&self) -> Duration {
        self.session_timeout
    }

    /// Whether connections are TLS (`zks://`).
    pub fn tls(&self) -> bool {
        self.tls
    }

    /// The CA file trusted for `zks://` (the `ca` parameter).
    pub fn ca(&self) -> Option<&Path> {
        self.ca.as_deref()
    }

    /// The client certificate and key files (the `cert` and `key`
    /// parameters), if any.
    pub fn identity(&self) -> Option<(&Path, &Path)> {
        self.identity
            .as_ref()
            .map(|(c, k)| (c.as_path(), k.as_path()))
    }

    /// The connect string for the client: `h1:2181,h2:2181`.
    pub(crate) fn connect_string(&self) -> String {
        self.hosts.join(",")
    }
}

/// The value of the file parameter `name` (`ca`, `cert`, `key`),
/// percent-decoded: a path, on a TLS URL only.
fn tls_path(tls: bool, name: &str, value: &str) -> Result<PathBuf> {
    if !tls {
        return Err(Error::config(format!(
            "the zookeeper url parameter `{name}` needs TLS: use zks://"
        )));
    }
    let path = percent_decode(value)?;
    if path.is_empty() {
        return Err(Error::config(format!(
            "the zookeeper url parameter `{name}` needs a path to a PEM file"
        )));
    }
    Ok(path.into())
}

/// `(user, password)`, percent-decoded, and what follows them; see
/// [`credentials`].
fn userinfo(rest: &str) -> Result<(Option<(String, String)>, &str)> {
    let (found, rest) = credentials("ZooKeeper", rest, "zk://user:password@host:2181/ns")?;
    let Some((user, password)) = found else {
        return Ok((None, rest));
    };
    let user = percent_decode(&user)?;
    if user.is_empty() {
        return Err(Error::config(
            "the ZooKeeper digest user is empty (expected zk://user:password@host:2181/ns)",
        ));
    }
    let password = percent_decode(&password)
        .map_err(|_| Error::config("the ZooKeeper password has a bad %XX escape"))?;
    Ok((Some((user, password)), rest))
}

/// The znode path rules ZooKeeper applies, checked before connecting: an
/// absolute path, no empty, `.` or `..` segment, no character ZooKeeper
/// refuses in a path; not the root and not ZooKeeper's own `/zookeeper`.
fn validate_namespace(ns: &str) -> Result<()> {
    let bad = |why: &str| {
        Err(Error::config(format!(
            "invalid ZooKeeper namespace {ns:?}: {why}"
        )))
    };
    if !ns.starts_with('/') {
        return bad("it must start with `/`");
    }
    if ns == "/" {
        return bad("the root cannot be the namespace; name a znode such as /fenced");
    }
    if ns.len() > 512 {
        return bad("at most 512 bytes");
    }
    if let Some(c) = ns.chars().find(|&c| !allowed_in_path(c)) {
        return bad(&format!(
            "the character {c:?} is not allowed in a znode path"
        ));
    }
    for segment in ns[1..].split('/') {
        match segment {
            "" => return bad("an empty segment (`//` or a trailing `/`)"),
            "." | ".." => return bad("a `.` or `..` segment"),
            _ => {}
        }
    }
    if ns == "/zookeeper" || ns.starts_with("/zookeeper/") {
        return bad("/zookeeper is ZooKeeper's own subtree");
    }
    Ok(())
}

/// Whether ZooKeeper accepts `c` in a path (`PathUtils.validatePath`): no
/// NUL, no control characters, no private-use or special characters, and
/// nothing beyond U+FFFF (ZooKeeper checks UTF-16 units, and refuses the
/// surrogates such a character is written with).
pub(crate) fn allowed_in_path(c: char) -> bool {
    !matches!(c,
        '\u{0}'..='\u{1f}'
        | '\u{7f}'..='\u{9f}'
        | '\u{e000}'..='\u{f8ff}'
        | '\u{fff0}'..)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;

    #[test]
    fn url_table() {
        let cases: [(&str, &[&str], &str, bool); 6] = [
            ("zk://127.0.0.1:2181", &["127.0.0.1:2181"], "/fenced", false),
            (
                "zk://h1:2181,h2:2182/app/locks",
                &["h1:2181", "h2:2182"],
                "/app/locks",
                false,
            ),
            ("zookeeper://h1/ns/", &["h1:2181"], "/ns", false),
            ("zk://u:p@h:2181/x", &["h:2181"], "/x", true),
            (
                "zk://[::1]:2182,[::1]/p",
                &["[::1]:2182", "[::1]:2181"],
                "/p",
                false,
            ),
            (
                "zk://h/my%20locks?timeout=2s",
                &["h:2181"],
                "/my locks",
                false,
            ),
        ];
        for (url, hosts, ns, auth) in cases {
            let c = ZkConfig::from_url(url).unwrap_or_else(|e| panic!("{url}: {e}"));
            assert_eq!(c.hosts, hosts, "{url}");
            assert_eq!(c.namespace, ns, "{url}");
            assert_eq!(c.user.is_some(), auth, "{url}");
            assert!(c.validate().is_ok(), "{url}");
        }
        let c = ZkConfig::from_url(
            "zk://u:secret@h/p?connect_timeout=250ms&timeout=3s&session_timeout=4s",
        )
        .unwrap();
        assert_eq!(c.user, Some(("u".into(), "secret".into())));
        assert_eq!(c.connect_timeout, Duration::from_millis(250));
        assert_eq!(c.operation_timeout, Duration::from_secs(3));
        assert_eq!(c.session_timeout, Duration::from_secs(4));
        assert_eq!(c.connect_string(), "h:2181");
    }

    #[test]
    fn both_spellings_of_the_operation_timeout_and_defaults() {
        for url in ["zk://h/p?operation_timeout=3s", "zk://h/p?timeout=3s"] {
            let c = ZkConfig::from_url(url).unwrap_or_else(|e| panic!("{url}: {e}"));
            assert_eq!(c.operation_timeout, Duration::from_secs(3), "{url}");
        }
        let c = ZkConfig::from_url("zk://h/p").unwrap();
        assert_eq!(c.connect_timeout, DEFAULT_CONNECT_TIMEOUT);
        assert_eq!(c.operation_timeout, DEFAULT_OPERATION_TIMEOUT);
        assert_eq!(c.session_timeout, DEFAULT_SESSION_TIMEOUT);
    }

    /// Every bad URL is a `Config` error whose message names what is wrong.
    #[test]
    fn bad_urls_name_what_is_wrong() {
        for (url, says) in [
            ("redis://h", "zk://"),
            ("nourl", "zk://"),
            ("zk://", "no ZooKeeper host"),
            ("zk:///p", "no ZooKeeper host"),
            ("zk://h/p?nope=1", "nope"),
            ("zk://h/p?timeout=x", "x"),
            ("zk://h/p?timeout=1s&operation_timeout=2s", "given twice"),
            (
                "zk://h/p?session_timeout=1s&session_timeout=1s",
                "given twice",
            ),
            ("zk://h:99999/p", "port"),
            ("zk://h:0/p", "port"),
            ("zk://h:abc/p", "port"),
            ("zk://h:+80/p", "port"),
            ("zk://h:/p", "port"),
            ("zk://h1,h2:99999/p", "port"),
            ("zk://:2181/p", "host"),
            ("zk://[::1/p", "]"),
            ("zk://h/a//b", "empty segment"),
            ("zk://h/a/./b", "`.`"),
            ("zk://h/a/..", "`..`"),
            ("zk://h/zookeeper", "/zookeeper"),
            ("zk://h/zookeeper/quota", "/zookeeper"),
            ("zk://h/a%01b", "not allowed"),
            ("zk://h/a%zz", "%"),
            ("zk://u:p@", "no ZooKeeper host"),
        ] {
            match ZkConfig::from_url(url) {
                Err(e @ Error::Config { .. }) => {
                    assert!(e.to_string().contains(says), "{url}: {e}")
                }
                other => panic!("{url}: {other:?}"),
            }
        }
    }

    #[test]
    fn tls_urls() {
        let c = ZkConfig::from_url(
            "zks://h1,h2:2282/ns?ca=/etc/zk/ca.pem&cert=/etc/zk/me.pem&key=/etc/zk/me%26.key&timeout=2s",
        )
        .unwrap();
        assert!(c.tls());
        assert_eq!(c.hosts, ["h1:2181", "h2:2282"]);
        assert_eq!(c.namespace, "/ns");
        assert_eq!(c.ca(), Some(Path::new("/etc/zk/ca.pem")));
        assert_eq!(
            c.identity(),
            Some((Path::new("/etc/zk/me.pem"), Path::new("/etc/zk/me&.key")))
        );
        assert_eq!(c.operation_timeout, Duration::from_secs(2));
        for url in [
            "zks://h/p?ca=/ca.pem",
            "zookeeper+tls://h/p?ca=/ca.pem",
            "zks://u:p@[::1]:2281/p?key=/k.pem&ca=/ca.pem&cert=/c.pem",
        ] {
            let c = ZkConfig::from_url(url).unwrap_or_else(|e| panic!("{url}: {e}"));
            assert!(c.tls(), "{url}");
            assert_eq!(c.ca(), Some(Path::new("/ca.pem")), "{url}");
        }
        for url in ["zk://h/p", "zookeeper://h/p"] {
            let c = ZkConfig::from_url(url).unwrap();
            assert!(
                !c.tls() && c.ca().is_none() && c.identity().is_none(),
                "{url}"
            );
        }
    }

    /// TLS parameters are checked before anything connects: on a TLS URL
    /// only, `ca` required, `cert` and `key` together, each once, a path.
    #[test]
    fn bad_tls_urls_name_what_is_wrong() {
        for (url, says) in [
            ("zk://h/p?ca=/ca.pem", "`ca` needs TLS: use zks://"),
            ("zookeeper://h/p?cert=/c.pem", "`cert` needs TLS"),
            ("zk://h/p?key=/k.pem", "`key` needs TLS"),
            ("zks://h/p", "zks:// needs `ca=<path>`"),
            ("zookeeper+tls://h/p?cert=/c&key=/k", "needs `ca=<path>`"),
            ("zks://h/p?ca=/ca.pem&cert=/c.pem", "`cert` needs `key` too"),
            ("zks://h/p?ca=/ca.pem&key=/k.pem", "`key` needs `cert` too"),
            ("zks://h/p?ca=", "needs a path"),
            ("zks://h/p?ca=/a&cert=&key=/k", "needs a path"),
            ("zks://h/p?ca=%zz", "%"),
            ("zks://h/p?ca=/a&ca=/b", "given twice"),
            ("zks://h/p?ca=/a&cert=/c&key=/k&key=/k", "given twice"),
            ("zks://h/p?ca=/a&crt=/c", "crt"),
            ("zkss://h/p?ca=/a", "zks://"),
            ("zookeeper+ssl://h/p", "zks://"),
        ] {
            match ZkConfig::from_url(url) {
                Err(e @ Error::Config { .. }) => {
                    assert!(e.to_string().contains(says), "{url}: {e}")
                }
                other => panic!("{url}: {other:?}"),
            }
        }
    }

    #[test]
    fn every_scheme_of_the_driver_parses() {
        // Plaintext schemes refuse `ca`, TLS ones require it.
        for scheme in crate::SCHEMES {
            let plain = ZkConfig::from_url(&format!("{scheme}://h/p"));
            let tls = ZkConfig::from_url(&format!("{scheme}://h/p?ca=/ca.pem"));
            match (plain, tls) {
                (Ok(p), Err(_)) => assert!(!p.tls(), "{scheme}"),
                (Err(_), Ok(t)) => assert!(t.tls(), "{scheme}"),
                other => panic!("{scheme}: {other:?}"),
            }
        }
    }

    #[test]
    fn the_root_is_refused_as_a_namespace() {
        let mut c = ZkConfig::from_url("zk://h/p").unwrap();
        for ns in ["/", "", "p", "/a/", "/zookeeper"] {
            c.namespace = ns.into();
            assert!(matches!(c.validate(), Err(Error::Config { .. })), "{ns:?}");
        }
    }

    #[test]
    fn passwords_never_shown() {
        for pw in ["hunter2", "Alpha?Bravo", "Alpha/Bravo", "Alpha@Bravo"] {
            let url = format!("zk://root:{pw}@127.0.0.1:1/p?timeout=2s");
            let c = ZkConfig::from_url(&url).unwrap_or_else(|e| panic!("{pw}: {e}"));
            assert_eq!(c.user, Some(("root".into(), pw.into())));
            assert_eq!(c.hosts, ["127.0.0.1:1"]);
            assert!(!format!("{c:?}").contains(pw));
            let tls = format!("zks://root:{pw}@127.0.0.1:1/p?ca=/ca.pem&cert=/c.pem&key=/k.pem");
            let c = ZkConfig::from_url(&tls).unwrap_or_else(|e| panic!("{pw}: {e}"));
            assert!(!format!("{c:?}").contains(pw));
            for bad in [
                format!("zk://root:{pw}@127.0.0.1:1/p?nope=1"),
                format!("zk://root:{pw}@/p"),
                format!("zk://root:{pw}@"),
                format!("zk://root:{pw}@h:0/p"),
                format!("zk://root:{pw}@h/p?ca=/ca.pem"),
                format!("zks://root:{pw}@h/p"),
                format!("zks://root:{pw}@h/p?ca=/ca.pem&cert=/c.pem"),
            ] {
                let e = ZkConfig::from_url(&bad).unwrap_err();
                assert!(!e.to_string().contains(pw), "{e}");
            }
        }
    }
}
