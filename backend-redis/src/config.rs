//! Configuration: from a URL or the builder, validated before connecting.

use std::{fmt, time::Duration};

use fenced_api::{
    url::{params, parse_duration, redact, split_query, split_userinfo, Userinfo},
    Error, Result,
};
use redis::{ConnectionInfo, IntoConnectionInfo, ProtocolVersion};

mod topology;

use topology::{parse_address_map, PLACEHOLDER_HOST};
pub(crate) use topology::{AddressPair, ClusterSettings, SentinelSettings};

/// Default key prefix (the namespace).
pub const DEFAULT_PREFIX: &str = "fenced";
/// Default bound on connecting.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Default bound on one command's reply.
pub const DEFAULT_OPERATION_TIMEOUT: Duration = Duration::from_secs(5);
/// Default cap on how long a waiter sleeps between two checks of a held key
/// when no hand-over message reaches it (the fallback behind pub/sub; each
/// check also refreshes the waiter's place in the queue).
pub const DEFAULT_RECHECK_INTERVAL: Duration = Duration::from_secs(1);
/// Default bound on waiting for replicas to acknowledge a grant or renewal
/// (with `min_replicas` ≥ 1 only).
pub const DEFAULT_REPLICA_TIMEOUT: Duration = Duration::from_millis(50);
/// Most replicas a grant may be made to wait for.
pub const MAX_MIN_REPLICAS: u32 = 64;

/// A validated key prefix: the namespace two applications sharing one Redis
/// use to keep their locks apart.
///
/// 1 to [`Prefix::MAX_LEN`] bytes of ASCII letters, digits and `_ . : -`.
/// Never `/`, `{` or `}`: the prefix ends at the first `/` of every Redis key
/// this crate writes (`{prefix/lock key}:l`), which is what keeps two
/// namespaces from ever producing the same Redis key, and braces would move
/// the Cluster hash tag.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Prefix(String);

impl Prefix {
    /// Longest prefix accepted, in bytes.
    pub const MAX_LEN: usize = 64;

    /// Validates a prefix.
    ///
    /// # Errors
    ///
    /// [`Error::Config`] naming the rule that was broken.
    pub fn new(prefix: &str) -> Result<Self> {
        if prefix.is_empty() || prefix.len() > Self::MAX_LEN {
            return Err(Error::config(format!(
                "the redis key prefix {prefix:?} must be 1 to {} bytes long",
                Self::MAX_LEN
            )));
        }
        if let Some(bad) = prefix
            .chars()
            .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | ':' | '-')))
        {
            return Err(Error::config(format!(
                "the redis key prefix {prefix:?} contains {bad:?}; use ASCII letters, digits and `_ . : -`"
            )));
        }
        Ok(Prefix(prefix.to_owned()))
    }

    /// The prefix.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for Prefix {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Everything needed to connect; built from a URL or [`RedisLockBuilder`](crate::RedisLockBuilder).
///
/// `Debug` never shows the password: the URL is shown redacted, and the
/// `redis` crate's settings (which hold it) not at all.
#[derive(Clone, Debug)]
pub struct RedisConfig {
    pub(crate) connection: Connection,
    /// The URL with the password replaced and fenced's parameters removed.
    pub(crate) display_url: String,
    pub(crate) tls: bool,
    pub(crate) prefix: Prefix,
    pub(crate) connect_timeout: Duration,
    pub(crate) operation_timeout: Duration,
    pub(crate) recheck_interval: Duration,
    /// Where to ask for the primary, when it is found through Sentinel.
    pub(crate) sentinel: Option<SentinelSettings>,
    /// The seed nodes, for a Redis Cluster.
    pub(crate) cluster: Option<ClusterSettings>,
    /// Replicas that must acknowledge a grant or renewal (`WAIT`); 0: none.
    pub(crate) min_replicas: u32,
    /// Bound on that wait.
    pub(crate) replica_timeout: Duration,
}

/// The `redis` crate's connection settings. They hold the password, so
/// `Debug` shows nothing of them.
#[derive(Clone)]
pub(crate) struct Connection(ConnectionInfo);

impl std::ops::Deref for Connection {
    type Target = ConnectionInfo;

    fn deref(&self) -> &ConnectionInfo {
        &self.0
    }
}

impl fmt::Debug for Connection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ConnectionInfo { .. }")
    }
}

/// The characters of a password that the `redis` crate's URL parser would
/// read as the end of the userinfo, host or path.
const RESERVED: [char; 7] = ['/', '?', '#', '@', '[', ']', ' '];

/// `url` with the reserved characters of its password ([`RESERVED`])
/// percent-encoded, or `None` when nothing needs encoding. The userinfo is
/// found by [`split_userinfo`]; `%` is left alone, so a password the caller
/// already encoded stays as it was.
fn encode_userinfo(url: &str) -> Option<String> {
    let (scheme, rest) = url.split_once("://")?;
    let (
        Some(Userinfo {
            user,
            password: Some(password),
        }),
        host,
    ) = split_userinfo(rest)
    else {
        return None;
    };
    if !password.contains(RESERVED) {
        return None;
    }
    let mut enc = String::with_capacity(password.len() * 3);
    for c in password.chars() {
        if RESERVED.contains(&c) {
            enc.push_str(&format!("%{:02X}", c as u32));
        } else {
            enc.push(c);
        }
    }
    Some(format!("{scheme}://{user}:{enc}@{host}"))
}

/// The URL parameters: fenced's, then the two handed on to the `redis` crate.
const KNOWN: &[&str] = &[
    "prefix",
    "connect_timeout",
    "operation_timeout|timeout",
    "recheck_interval",
    "min_replicas",
    "replica_timeout",
    "address_map",
    "protocol",
    "db",
];

impl RedisConfig {
    /// Parses `redis://[user:pass@]host[:port][/db]?prefix=…&connect_timeout=…`
    /// (or `rediss://` for TLS; append `#insecure` to skip certificate checks),
    /// or `redis+sentinel://[user:pass@]s1[:26379],s2[:26379]/primary-name[/db]?…`
    /// for a primary found through Sentinel (the credentials and database
    /// are the primary's; the sentinels are asked without a password, over
    /// plain TCP) — see "Sentinel" in the crate docs — or
    /// `redis+cluster://[user:pass@]h1[:6379],h2[:6379]?…` for a Redis
    /// Cluster (any reachable node names the rest; every lock lives on the
    /// shard of its key's slot — see "Redis Cluster" in the crate docs), or
    /// `rediss+cluster://…` for one that speaks TLS (`#insecure` as above).
    /// With either of the last two, `address_map=10.0.0.5:6379>db.example:7000,…`
    /// connects to the address on the right of `>` wherever a cluster node
    /// announces, or the sentinels name as the primary, the one on the left:
    /// NAT, a container network, a proxy.
    ///
    /// fenced's parameters: `prefix` (the namespace, default `fenced`),
    /// `connect_timeout` and `operation_timeout` (also spelt `timeout`;
    /// `500ms`, `5s`; default 5 s each), `recheck_interval` (default 1 s: how
    /// long a waiter sleeps at most when no hand-over message reaches it; a
    /// waiter's place in the queue lapses after three missed re-checks plus a
    /// second); `min_replicas` (default 0) and `replica_timeout` (default
    /// 50 ms; only with `min_replicas`): every grant and renewal waits, with
    /// `WAIT`, until that many replicas acknowledged it or the timeout passed,
    /// and one that fell short is given back (a grant) and reported as a
    /// retryable [`Error::Backend`] — see "Replicas" in the crate docs;
    /// `protocol` and `db` go to the `redis` crate; any other
    /// parameter, or one given twice, is an error
    /// ([`fenced_api::url::params`]). The connection always speaks RESP3
    /// (Redis ≥ 6), which lets one connection carry both the scripts and the
    /// release subscriptions.
    ///
    /// # Errors
    ///
    /// [`Error::Config`] for a malformed URL or parameter; nothing is connected.
    pub fn from_url(url: &str) -> Result<Self> {
        // The userinfo first: a password may hold unencoded `/`, `?`, `#` or
        // `@`, which must neither cut the URL nor reach a parameter or message.
        let owned = encode_userinfo(url);
        let url_for_parsing = owned.as_deref().unwrap_or(url);
        // With the password encoded, the first `#` starts the fragment.
        let (without_fragment, fragment) = match url_for_parsing.split_once('#') {
            Some((u, f)) => (u, Some(f)),
            None => (url_for_parsing, None),
        };
        let (base, query) = split_query(without_fragment);
        let scheme = base.split_once("://").map(|(s, _)| s).unwrap_or_default();
        let tls = match scheme {
            "redis" | "redis+sentinel" | "redis+cluster" => false,
            "rediss" | "rediss+cluster" => true,
            "rediss+sentinel" => {
                return Err(Error::config(
                    "rediss+sentinel:// is not supported: Sentinel discovery speaks plain TCP \
                     (use redis+sentinel://, or rediss:// to a fixed primary)",
                ))
            }
            _ => {
                return Err(Error::config(format!(
                    "expected a redis://, rediss://, redis+sentinel://, redis+cluster:// or \
                     rediss+cluster:// url, got `{}`",
                    redact(url)
                )))
            }
        };
        // `redis+sentinel://[user:pw@]s1:26379,s2:26379/master[/db]`: the
        // sentinels are asked for the primary; the rest is the primary's.
        let (base, mut sentinel) = match base.strip_prefix("redis+sentinel://") {
            Some(rest) => {
                let (settings, node_base) = SentinelSettings::parse(rest)?;
                (node_base, Some(settings))
            }
            None => (base.to_owned(), None),
        };
        // `redis+cluster://[user:pw@]h1:7000,h2:7001`: the nodes name the
        // rest of the cluster; the credentials are every node's.
        // `rediss+cluster://`: the same over TLS to every node.
        let cluster_rest = base
            .strip_prefix("redis+cluster://")
            .or_else(|| base.strip_prefix("rediss+cluster://"));
        let (base, mut cluster) = match cluster_rest {
            Some(rest) => {
                let (settings, node_base) = ClusterSettings::parse(rest, tls)?;
                (node_base, Some(settings))
            }
            None => (base, None),
        };
        let base = base.as_str();
        if tls && !cfg!(feature = "tls") {
            return Err(Error::config(format!(
                "{scheme}:// needs the `tls` feature of fenced-redis"
            )));
        }
        let mut prefix = Prefix::new(DEFAULT_PREFIX)?;
        let mut connect_timeout = DEFAULT_CONNECT_TIMEOUT;
        let mut operation_timeout = DEFAULT_OPERATION_TIMEOUT;
        let mut recheck_interval = DEFAULT_RECHECK_INTERVAL;
        let mut min_replicas = 0;
        let mut replica_timeout = None;
        let mut passthrough = Vec::new();
        // A repeated or misspelt parameter must not silently fall back to a
        // default: `prefx=billing` would share the default namespace.
        for p in params("redis", query, KNOWN)? {
            match p.name {
                "prefix" => prefix = Prefix::new(p.value)?,
                "connect_timeout" => connect_timeout = parse_duration(p.value)?,
                "operation_timeout" => operation_timeout = parse_duration(p.value)?,
                "recheck_interval" => recheck_interval = parse_recheck(p.value)?,
                "min_replicas" => {
                    min_replicas = p.value.parse().map_err(|_| {
                        Error::config(format!(
                            "min_replicas={} is not a number of replicas (0 to {MAX_MIN_REPLICAS})",
                            p.value
                        ))
                    })?
                }
                "replica_timeout" => replica_timeout = Some(parse_duration(p.value)?),
                "address_map" => match (cluster.as_mut(), sentinel.as_mut()) {
                    (Some(c), _) => c.address_map = parse_address_map(p.value)?,
                    (None, Some(s)) => s.address_map = parse_address_map(p.value)?,
                    (None, None) => {
                        return Err(Error::config(
                            "address_map applies to redis+cluster:// (the addresses the \
                             cluster's nodes announce) and redis+sentinel:// (the primary's \
                             address as the sentinels name it) only",
                        ))
                    }
                },
                "db" if cluster.is_some() && p.value != "0" => {
                    return Err(Error::config(format!(
                        "db={} with redis+cluster://: a Redis Cluster has database 0 only",
                        p.value
                    )))
                }
                "protocol" if !p.value.eq_ignore_ascii_case("resp3") && p.value != "3" => {
                    return Err(Error::config(format!(
                        "protocol={} is not supported: fenced-redis speaks RESP3 (Redis 6 or later)",
                        p.value
                    )))
                }
                // `protocol` and `db`: understood by the `redis` crate itself.
                _ => passthrough.push(p.raw),
            }
        }
        let redis_url = format!(
            "{base}{}{}{}",
            if passthrough.is_empty() { "" } else { "?" },
            passthrough.join("&"),
            fragment.map(|f| format!("#{f}")).unwrap_or_default()
        );
        let info = redis_url
            .as_str()
            .into_connection_info()
            .map_err(|e| Error::config(format!("invalid redis url `{}`: {e}", redact(url))))?;
        let settings = info
            .redis_settings()
            .clone()
            .set_protocol(ProtocolVersion::RESP3)
            .set_lib_name("fenced-redis", env!("CARGO_PKG_VERSION"));
        if replica_timeout.is_some() && min_replicas == 0 {
            return Err(Error::config(
                "replica_timeout has no effect without min_replicas (the number of replicas a \
                 grant waits for)",
            ));
        }
        let userinfo = || {
            base.strip_prefix("redis://")
                .or_else(|| base.strip_prefix("rediss://"))
                .and_then(|r| r.rsplit_once('@'))
                .map(|(userinfo, _)| format!("{userinfo}@"))
                .unwrap_or_default()
        };
        let display_url = match (&sentinel, &cluster) {
            // The primary's database, when the URL names one (`…/master/3`).
            (Some(st), _) => redact(&format!(
                "redis+sentinel://{}{}/{}{}",
                userinfo(),
                st.nodes.join(","),
                st.master,
                base.rsplit_once(PLACEHOLDER_HOST).map_or("", |(_, db)| db)
            )),
            (None, Some(cl)) => redact(&format!(
                "{}://{}{}",
                if tls {
                    "rediss+cluster"
                } else {
                    "redis+cluster"
                },
                userinfo(),
                cl.nodes
                    .iter()
                    .map(|(h, p)| format!("{h}:{p}"))
                    .collect::<Vec<_>>()
                    .join(",")
            )),
            (None, None) => redact(base),
        };
        let config = RedisConfig {
            connection: Connection(info.set_redis_settings(settings)),
            display_url,
            sentinel,
            cluster,
            tls,
            prefix,
            connect_timeout,
            operation_timeout,
            recheck_interval,
            min_replicas,
            replica_timeout: replica_timeout.unwrap_or(DEFAULT_REPLICA_TIMEOUT),
        };
        config.check_replicas()?;
        Ok(config)
    }

    /// `min_replicas` at most [`MAX_MIN_REPLICAS`]; `replica_timeout` from
    /// 1 ms and below the operation timeout, which bounds the `WAIT` call.
    pub(crate) fn check_replicas(&self) -> Result<()> {
        if self.min_replicas > MAX_MIN_REPLICAS {
            return Err(Error::config(format!(
                "min_replicas {} is more than {MAX_MIN_REPLICAS}",
                self.min_replicas
            )));
        }
        if self.min_replicas == 0 {
            // Unused: an operation timeout of any length is fine.
            return Ok(());
        }
        let t = self.replica_timeout;
        if t < Duration::from_millis(1) || t >= self.operation_timeout {
            return Err(Error::config(format!(
                "replica_timeout {t:?} must be at least 1ms and below the operation timeout ({:?})",
                self.operation_timeout
            )));
        }
        Ok(())
    }

    /// Replicas every grant and renewal waits for (0: none).
    pub fn min_replicas(&self) -> u32 {
        self.min_replicas
    }

    /// How long a grant or renewal waits for them.
    pub fn replica_timeout(&self) -> Duration {
        self.replica_timeout
    }

    /// The key prefix (namespace).
    pub fn prefix(&self) -> &Prefix {
        &self.prefix
    }

    /// The server address with any password redacted, for messages.
    pub fn display_url(&self) -> &str {
        &self.display_url
    }
}

/// The re-check interval is a fallback, not a poll loop: 10 ms to 10 s.
pub(crate) fn parse_recheck(v: &str) -> Result<Duration> {
    let d = parse_duration(v)?;
    check_recheck(d)
}

pub(crate) fn check_recheck(d: Duration) -> Result<Duration> {
    if d < Duration::from_millis(10) || d > Duration::from_secs(10) {
        return Err(Error::config(format!(
            "recheck_interval {d:?} must be from 10ms to 10s"
        )));
    }
    Ok(d)
}

#[cfg(test)]
mod tests {
    use super::*;
    use redis::ConnectionAddr;

    struct Case {
        url: &'static str,
        prefix: &'static str,
        timeouts: (Duration, Duration, Duration),
        addr: (&'static str, u16, i64),
        tls: bool,
    }

    #[test]
    fn passwords_with_reserved_characters_stay_in_the_password() {
        for sep in ['/', '?', '#', '@'] {
            let url = format!("redis://:Alpha{sep}Bravo@127.0.0.1:1/0?prefix=p");
            let c = RedisConfig::from_url(&url).unwrap_or_else(|e| panic!("{sep}: {e}"));
            assert_eq!(c.prefix().as_str(), "p");
            assert_eq!(
                c.connection.redis_settings().password(),
                Some(format!("Alpha{sep}Bravo").as_str()),
                "{sep}"
            );
            assert!(!format!("{c:?}").contains("Bravo"), "{sep}");
            let e = RedisConfig::from_url(&format!("redis://:Alpha{sep}Bravo@127.0.0.1:1?nope=1"))
                .unwrap_err();
            assert!(!e.to_string().contains("Bravo"), "{sep}: {e}");
        }
        // Already encoded: unchanged.
        let c = RedisConfig::from_url("redis://:p%40ss@h").unwrap();
        assert_eq!(c.connection.redis_settings().password(), Some("p@ss"));
    }

    #[test]
    fn url_table() {
        let s = Duration::from_secs;
        let ms = Duration::from_millis;
        let defaults = (s(5), s(5), s(1));
        let cases = [
            Case {
                url: "redis://127.0.0.1:6379",
                prefix: "fenced",
                timeouts: defaults,
                addr: ("127.0.0.1", 6379, 0),
                tls: false,
            },
            Case {
                url: "redis://127.0.0.1",
                prefix: "fenced",
                timeouts: defaults,
                addr: ("127.0.0.1", 6379, 0),
                tls: false,
            },
            Case {
                url: "redis://:pw@cache.internal:6380/3?prefix=billing:locks",
                prefix: "billing:locks",
                timeouts: defaults,
                addr: ("cache.internal", 6380, 3),
                tls: false,
            },
            Case {
                url:
                    "redis://h/1?connect_timeout=250ms&operation_timeout=2s&recheck_interval=100ms",
                prefix: "fenced",
                timeouts: (ms(250), s(2), ms(100)),
                addr: ("h", 6379, 1),
                tls: false,
            },
            Case {
                url: "redis://h?protocol=resp3&prefix=a-b_c.d",
                prefix: "a-b_c.d",
                timeouts: defaults,
                addr: ("h", 6379, 0),
                tls: false,
            },
            Case {
                url: "rediss://user:pw@secure.example:6390/0?prefix=x#insecure",
                prefix: "x",
                timeouts: defaults,
                addr: ("secure.example", 6390, 0),
                tls: true,
            },
        ];
        for Case {
            url,
            prefix,
            timeouts,
            addr: (host, port, db),
            tls,
        } in cases
        {
            let c = RedisConfig::from_url(url).unwrap_or_else(|e| panic!("{url}: {e}"));
            assert_eq!(c.prefix.as_str(), prefix, "{url}");
            assert_eq!(
                (c.connect_timeout, c.operation_timeout, c.recheck_interval),
                timeouts,
                "{url}"
            );
            assert_eq!(c.tls, tls, "{url}");
            assert_eq!(c.connection.redis_settings().db(), db, "{url}");
            assert_eq!(
                c.connection.redis_settings().protocol(),
                ProtocolVersion::RESP3,
                "{url}"
            );
            match c.connection.addr() {
                ConnectionAddr::Tcp(h, p) => {
                    assert!(!tls, "{url}");
                    assert_eq!((h.as_str(), *p), (host, port), "{url}");
                }
                #[cfg(feature = "tls")]
                ConnectionAddr::TcpTls {
                    host: h,
                    port: p,
                    insecure,
                    ..
                } => {
                    assert!(tls && *insecure, "{url}");
                    assert_eq!((h.as_str(), *p), (host, port), "{url}");
                }
                other => panic!("{url}: unexpected address {other:?}"),
            }
        }
    }

    #[test]
    fn bad_urls_are_config_errors() {
        for url in [
            "mysql://h/db",
            "redis//h",
            "redis://h?prefix=",
            "redis://h?prefix=a/b",
            "redis://h?prefix={tag}",
            "redis://h?prefix=has space",
            "redis://h?prefix=%41",
            "redis://h?connect_timeout=forever",
            "redis://h?connect_timeout=0s",
            "redis://h?operation_timeout=2h",
            "redis://h?recheck_interval=1ms",
            "redis://h?protocol=resp2",
            "redis://h/notanumber",
            "redis://h?nope=1",
            "redis://h?prefix=a&prefix=b",
            "redis://h?operation_timeout=1s&timeout=2s",
            "redis://h?min_replicas=-1",
            "redis://h?min_replicas=one",
            "redis://h?min_replicas=65",
            "redis://h?replica_timeout=50ms",
            "redis://h?min_replicas=0&replica_timeout=50ms",
            "redis://h?min_replicas=1&replica_timeout=0ms",
            "redis://h?min_replicas=1&replica_timeout=5s",
            "redis://h?min_replicas=1&timeout=100ms&replica_timeout=200ms",
            "redis://h?min_replicas=1&min_replicas=2",
        ] {
            let got = RedisConfig::from_url(url);
            assert!(matches!(got, Err(Error::Config { .. })), "{url}: {got:?}");
        }
    }

    #[test]
    fn replicas() {
        // Without min_replicas the replica timeout is unused: any operation timeout goes.
        assert!(RedisConfig::from_url("redis://h?timeout=20ms").is_ok());
        let c = RedisConfig::from_url("redis://h").unwrap();
        assert_eq!(
            (c.min_replicas(), c.replica_timeout()),
            (0, DEFAULT_REPLICA_TIMEOUT)
        );
        let c = RedisConfig::from_url("redis://h?min_replicas=2").unwrap();
        assert_eq!(
            (c.min_replicas(), c.replica_timeout()),
            (2, DEFAULT_REPLICA_TIMEOUT)
        );
        let c = RedisConfig::from_url("redis://h?min_replicas=1&replica_timeout=250ms").unwrap();
        assert_eq!(
            (c.min_replicas(), c.replica_timeout()),
            (1, Duration::from_millis(250))
        );
    }

    /// The display URL of a Sentinel or Cluster URL names every node, the
    /// primary's name and database, never the password.
    #[test]
    fn sentinel_and_cluster_display_urls() {
        let c =
            RedisConfig::from_url("redis+sentinel://:pw@s1,s2:26380/mymaster/3?prefix=p").unwrap();
        assert_eq!(
            c.display_url(),
            "redis+sentinel://:***@s1:26379,s2:26380/mymaster/3"
        );
        assert_eq!(c.connection.redis_settings().db(), 3);
        let c = RedisConfig::from_url("redis+sentinel://s1/mymaster").unwrap();
        assert_eq!(c.display_url(), "redis+sentinel://s1:26379/mymaster");
        let c = RedisConfig::from_url(
            "redis+cluster://u:pw@h1:7000,h2?address_map=h1:7000>10.0.0.1:17000",
        )
        .unwrap();
        assert_eq!(c.display_url(), "redis+cluster://u:***@h1:7000,h2:6379");
        let cl = c.cluster.as_ref().unwrap();
        assert_eq!(
            cl.address_map,
            vec![(("h1".into(), 7000), ("10.0.0.1".into(), 17000))]
        );
        assert!(!format!("{c:?}").contains("pw"));
        assert!(!c.tls);
        // TLS to every node: the placeholder address carries it (and
        // `#insecure`) to the nodes the cluster client connects to.
        #[cfg(feature = "tls")]
        {
            let c =
                RedisConfig::from_url("rediss+cluster://u:pw@h1:7000,h2:7001#insecure").unwrap();
            assert!(c.tls);
            assert_eq!(c.display_url(), "rediss+cluster://u:***@h1:7000,h2:7001");
            assert!(matches!(
                c.connection.addr(),
                ConnectionAddr::TcpTls { insecure: true, .. }
            ));
            assert_eq!(c.connection.redis_settings().password(), Some("pw"));
        }
        let c = RedisConfig::from_url(
            "redis+sentinel://s1/mymaster?address_map=10.0.0.5:6379>[::1]:16379,h:1>h:2",
        )
        .unwrap();
        assert_eq!(
            c.sentinel.as_ref().unwrap().address_map,
            vec![
                (("10.0.0.5".into(), 6379), ("[::1]".into(), 16379)),
                (("h".into(), 1), ("h".into(), 2))
            ]
        );
    }

    #[test]
    fn an_address_mapped_twice_is_refused() {
        let e =
            RedisConfig::from_url("redis+sentinel://s1/m?address_map=h:1>a:2,h:1>b:3").unwrap_err();
        assert!(e.to_string().contains("maps `h:1` twice"), "{e}");
    }

    #[test]
    fn timeout_is_another_spelling_of_operation_timeout() {
        let c = RedisConfig::from_url("redis://h?timeout=2s").unwrap();
        assert_eq!(c.operation_timeout, Duration::from_secs(2));
        let e = RedisConfig::from_url("redis://h?timeout=1s&operation_timeout=2s").unwrap_err();
        assert!(
            e.to_string().contains("`operation_timeout` is given twice"),
            "{e}"
        );
    }

    #[test]
    fn prefixes() {
        for ok in ["fenced", "a", "app:locks", "a.b-c_d", &"p".repeat(64)] {
            assert!(Prefix::new(ok).is_ok(), "{ok}");
        }
        for bad in ["", "a/b", "{a}", "a}", "a b", "é", "a*", &"p".repeat(65)] {
            assert!(Prefix::new(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn passwords_never_shown() {
        let c = RedisConfig::from_url("redis://app:hunter2@h:6379/0?prefix=p").unwrap();
        let dbg = format!("{c:?}");
        assert!(!dbg.contains("hunter2"), "{dbg}");
        assert!(dbg.contains("app:***@h:6379/0"), "{dbg}");
        let c = RedisConfig::from_url("redis://:hunter2@h").unwrap();
        assert!(!format!("{c:?}").contains("hunter2"));
        let err = RedisConfig::from_url("redis://u:hunter2@h?prefix=a/b").unwrap_err();
        assert!(!err.to_string().contains("hunter2"), "{err}");
        let err = RedisConfig::from_url("memcache://u:hunter2@h").unwrap_err();
        assert!(!err.to_string().contains("hunter2"), "{err}");
    }
}
