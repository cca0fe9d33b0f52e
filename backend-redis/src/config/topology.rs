//! Where the servers are: the sentinels of `redis+sentinel://`, the seed
//! nodes of `redis+cluster://` and `rediss+cluster://`, and `address_map`.

use fenced_api::{Error, Result};

/// A primary found through Sentinel: the sentinels (`host:port`) and the
/// name they know it by.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct SentinelSettings {
    pub(crate) nodes: Vec<String>,
    pub(crate) master: String,
    /// Where to connect instead of the primary's address as the sentinels
    /// name it (NAT, a proxy, a container network).
    pub(crate) address_map: Vec<AddressPair>,
}

/// The port sentinels listen on unless told otherwise.
const SENTINEL_PORT: u16 = 26379;

/// The host of the placeholder URL the settings of servers found later are
/// parsed from (a primary Sentinel names, the nodes of a Cluster).
pub(super) const PLACEHOLDER_HOST: &str = "discovered-node.invalid";

impl SentinelSettings {
    /// Parses what follows `redis+sentinel://` (no query, no fragment):
    /// `[userinfo@]host[:port],…/master[/db]`. Returns the settings and a
    /// `redis://[userinfo@]<placeholder>[/db]` URL for the primary's own
    /// settings (credentials, database).
    pub(super) fn parse(rest: &str) -> Result<(SentinelSettings, String)> {
        let (userinfo, hosts, path) = split_hosts(rest);
        let nodes = parse_nodes(hosts, SENTINEL_PORT, "redis+sentinel://", "sentinel")?
            .into_iter()
            .map(|(host, port)| format!("{host}:{port}"))
            .collect();
        let mut segments = path.split('/');
        let master = segments.next().unwrap_or_default();
        if master.is_empty() {
            return Err(Error::config(
                "redis+sentinel:// needs the primary's name as the path: \
                 redis+sentinel://s1:26379,s2:26379/mymaster",
            ));
        }
        if !master
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-'))
        {
            return Err(Error::config(format!(
                "the sentinel primary name {master:?} may hold ASCII letters, digits and `_ . -`"
            )));
        }
        let db = segments.next().filter(|d| !d.is_empty());
        if segments.next().is_some() {
            return Err(Error::config(
                "redis+sentinel:// takes /primary-name[/db] as its path, nothing more",
            ));
        }
        let node_base = format!(
            "redis://{}{PLACEHOLDER_HOST}{}",
            userinfo.map(|u| format!("{u}@")).unwrap_or_default(),
            db.map(|d| format!("/{d}")).unwrap_or_default()
        );
        Ok((
            SentinelSettings {
                nodes,
                master: master.to_owned(),
                address_map: Vec::new(),
            },
            node_base,
        ))
    }
}

/// The nodes of a Redis Cluster to learn its layout from (`host`, `port`):
/// any reachable one names all others.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct ClusterSettings {
    pub(crate) nodes: Vec<(String, u16)>,
    /// Where to connect instead of the address a node announces (NAT, a
    /// proxy, a container network).
    pub(crate) address_map: Vec<AddressPair>,
}

/// A host and port.
pub(crate) type HostPort = (String, u16);

/// An address a cluster node announces (or the sentinels name as the
/// primary), and the one to connect to instead.
pub(crate) type AddressPair = (HostPort, HostPort);

/// The port cluster nodes listen on unless told otherwise.
const CLUSTER_PORT: u16 = 6379;

impl ClusterSettings {
    /// Parses what follows `redis+cluster://` or `rediss+cluster://` (no
    /// query, no fragment): `[userinfo@]host[:port],…[/]`. Returns the
    /// settings and a `redis://[userinfo@]<placeholder>` URL (`rediss://`
    /// with `tls`) for the nodes' own settings (credentials, TLS).
    pub(super) fn parse(rest: &str, tls: bool) -> Result<(ClusterSettings, String)> {
        let (userinfo, hosts, path) = split_hosts(rest);
        let scheme = if tls {
            "rediss+cluster://"
        } else {
            "redis+cluster://"
        };
        let nodes = parse_nodes(hosts, CLUSTER_PORT, scheme, "cluster node")?;
        if !path.is_empty() && path != "0" {
            return Err(Error::config(format!(
                "{scheme} takes no path: a Redis Cluster has database 0 only, got `/{path}`"
            )));
        }
        let node_base = format!(
            "{}://{}{PLACEHOLDER_HOST}",
            if tls { "rediss" } else { "redis" },
            userinfo.map(|u| format!("{u}@")).unwrap_or_default(),
        );
        Ok((
            ClusterSettings {
                nodes,
                address_map: Vec::new(),
            },
            node_base,
        ))
    }
}

/// `[userinfo@]hosts[/path]` → (userinfo, hosts, path). The password is
/// percent-encoded by now: the first `/` ends the authority, its last `@`
/// the userinfo.
fn split_hosts(rest: &str) -> (Option<&str>, &str, &str) {
    let (authority, path) = rest.split_once('/').unwrap_or((rest, ""));
    match authority.rsplit_once('@') {
        Some((u, h)) => (Some(u), h, path),
        None => (None, authority, path),
    }
}

/// A comma-separated list of `host`, `host:port`, `[v6]` or `[v6]:port`,
/// each with `default_port` unless it names one.
fn parse_nodes(
    hosts: &str,
    default_port: u16,
    scheme: &str,
    what: &str,
) -> Result<Vec<(String, u16)>> {
    let mut nodes = Vec::new();
    for h in hosts.split(',') {
        let split = if h.starts_with('[') {
            h.find("]:").map(|i| (&h[..=i], &h[i + 2..]))
        } else {
            h.split_once(':')
        };
        let (host, port) = match split {
            Some((host, port)) => {
                let port: u16 = port
                    .parse()
                    .map_err(|_| Error::config(format!("{what} `{h}` has an invalid port")))?;
                (host, port)
            }
            None => (h, default_port),
        };
        if host.is_empty() || port == 0 {
            return Err(Error::config(format!(
                "{scheme} needs `host[:port]` for every {what}, got `{h}`"
            )));
        }
        nodes.push((host.to_owned(), port));
    }
    Ok(nodes)
}

/// `host:port>host:port,…`: each address a cluster node announces (or the
/// sentinels name as the primary), and the one to connect to instead.
pub(super) fn parse_address_map(v: &str) -> Result<Vec<AddressPair>> {
    let pairs: Vec<AddressPair> = v
        .split(',')
        .map(|pair| {
            let (from, to) = pair.split_once('>').ok_or_else(|| {
                Error::config(format!(
                    "address_map entry `{pair}` is not `announced-host:port>reachable-host:port`"
                ))
            })?;
            let one = |a: &str| -> Result<HostPort> {
                let mut nodes = parse_nodes(a, 0, "address_map", "address")?;
                match (nodes.pop(), nodes.is_empty()) {
                    (Some(n), true) => Ok(n),
                    _ => Err(Error::config(format!(
                        "address_map needs one `host:port` on each side of `>`, got `{a}`"
                    ))),
                }
            };
            Ok((one(from)?, one(to)?))
        })
        .collect::<Result<_>>()?;
    for (i, (from, _)) in pairs.iter().enumerate() {
        if pairs[..i].iter().any(|(f, _)| f == from) {
            return Err(Error::config(format!(
                "address_map maps `{}:{}` twice",
                from.0, from.1
            )));
        }
    }
    Ok(pairs)
}
