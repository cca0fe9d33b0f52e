//! Following a primary that Sentinel manages: the lookup (which sentinel
//! names which primary, checked with `ROLE`, through the URL's
//! `address_map`) and what a connection keeps to follow a failover.

use std::{
    sync::{Mutex, OnceLock},
    time::Duration,
};

use fenced_api::{Error, Result};
use redis::{
    aio::ConnectionManagerConfig, AsyncConnectionConfig, ErrorKind, RedisError, RedisResult, Value,
};
use tokio::time::Instant;

use crate::{config::RedisConfig, error, scripts};

/// At most one sentinel lookup per this interval: a burst of failing calls
/// during a failover asks once, not once per call.
pub(crate) const MIN_LOOKUP_GAP: Duration = Duration::from_millis(100);

/// Following a primary that Sentinel manages.
pub(crate) struct Follow {
    /// Held while the sentinels are asked: one lookup at a time.
    pub(crate) lookup: tokio::sync::Mutex<()>,
    /// The primary's address the connection goes to.
    pub(crate) primary: Mutex<String>,
    /// When the sentinels were last asked (after connect).
    pub(crate) asked: Mutex<Option<Instant>>,
    /// For the connection to a new primary (same push sender).
    pub(crate) manager_config: ConnectionManagerConfig,
    /// Run after a switch (the router wakes its waiters).
    pub(crate) on_switch: OnceLock<Box<dyn Fn() + Send + Sync>>,
}

impl Follow {
    pub(crate) fn new(primary: String, manager_config: ConnectionManagerConfig) -> Self {
        Follow {
            lookup: tokio::sync::Mutex::new(()),
            primary: Mutex::new(primary),
            asked: Mutex::new(None),
            manager_config,
            on_switch: OnceLock::new(),
        }
    }
}

/// The primary the sentinels name: a client for it (at its address after
/// the URL's `address_map`) and the address as the sentinels named it —
/// what a failover changes, so what [`Follow`] compares.
pub(crate) struct Found {
    pub(crate) client: redis::Client,
    pub(crate) named: String,
}

/// The current primary as the sentinels name it (`ROLE`-checked), within
/// the connect timeout: at connect and after a failure a failover explains.
///
/// Every sentinel in the URL is asked at once (`SENTINEL MASTER <name>`);
/// the first that names a primary it does not see down, which then answers
/// `ROLE` as a primary at its mapped address, wins. The address goes
/// through the URL's `address_map` for the check and the connection alike;
/// with a map, an address it does not list is not used (it may be another
/// server on the client's network).
///
/// Errors: every sentinel unreachable — retryable, naming each; a primary
/// that refuses the client (credentials, permissions, RESP3) — that error,
/// which a retry cannot mend; otherwise — retryable, with what each
/// sentinel said (a failover under way looks like this until a replica is
/// promoted, and so does a name the sentinels do not monitor).
pub(crate) async fn ask_sentinels(config: &RedisConfig) -> Result<Found> {
    use futures_util::StreamExt as _;
    let Some(st) = &config.sentinel else {
        return Err(Error::config(format!(
            "{} is not a redis+sentinel:// URL",
            config.display_url
        )));
    };
    let limit = config.connect_timeout;
    let deadline = Instant::now() + limit;
    let mut asks: futures_util::stream::FuturesUnordered<_> = st
        .nodes
        .iter()
        .map(|node| async move { (node, ask_sentinel(node, st, config, limit).await) })
        .collect();
    let mut said = Vec::new();
    let mut answered = std::collections::HashSet::new();
    let mut refused = None;
    let mut reached_one = false;
    loop {
        let (node, outcome) = match tokio::time::timeout_at(deadline, asks.next()).await {
            Ok(Some(next)) => next,
            Ok(None) => break,
            Err(_) => {
                for node in st.nodes.iter().filter(|n| !answered.contains(n)) {
                    said.push(format!("{node}: no answer within {limit:?}"));
                }
                reached_one = true;
                break;
            }
        };
        answered.insert(node);
        match outcome {
            Outcome::Primary(found) => return Ok(*found),
            Outcome::Nothing(why) => {
                reached_one = true;
                said.push(format!("{node}: {why}"));
            }
            Outcome::Refused(why, e) => {
                reached_one = true;
                said.push(format!("{node}: {why}"));
                refused = Some(e);
            }
            Outcome::Unreachable(e) => said.push(format!("{node}: {e}")),
        }
    }
    if let Some(e) = refused {
        return Err(e);
    }
    let said = said.join("; ");
    if !reached_one {
        return Err(Error::backend(
            error::BACKEND,
            true,
            format!(
                "cannot connect to any sentinel of {} ({said}): are they running and reachable?",
                config.display_url
            ),
        ));
    }
    Err(Error::backend(
        error::BACKEND,
        true,
        format!(
            "no sentinel of {} names a primary that is up as `{}` now (a failover under way, \
             or a name the sentinels do not monitor): {said}",
            config.display_url, st.master
        ),
    ))
}

/// What one sentinel led to.
enum Outcome {
    /// A primary that answers `ROLE` as one.
    Primary(Box<Found>),
    /// No usable primary, and why.
    Nothing(String),
    /// The primary it named refused this client (an error no retry mends),
    /// and the step that failed.
    Refused(String, Error),
    /// The sentinel could not be asked.
    Unreachable(RedisError),
}

/// Asks the sentinel at `node` (`host:port`) for the primary and checks it,
/// each connection and reply within `limit`.
async fn ask_sentinel(
    node: &str,
    st: &crate::config::SentinelSettings,
    config: &RedisConfig,
    limit: Duration,
) -> Outcome {
    let within = AsyncConnectionConfig::new()
        .set_connection_timeout(Some(limit))
        .set_response_timeout(Some(limit));
    let sentinel = match redis::Client::open(format!("redis://{node}")) {
        Ok(c) => c,
        Err(e) => return Outcome::Unreachable(e),
    };
    let mut s = match sentinel
        .get_multiplexed_async_connection_with_config(&within)
        .await
    {
        Ok(s) => s,
        Err(e) => return Outcome::Unreachable(e),
    };
    let fields: RedisResult<Vec<String>> = redis::cmd("SENTINEL")
        .arg("MASTER")
        .arg(&st.master)
        .query_async(&mut s)
        .await;
    let fields = match fields {
        Ok(f) => f,
        Err(e) if e.detail().is_some_and(|d| d.contains("No such master")) => {
            return Outcome::Nothing(format!("knows no primary `{}`", st.master))
        }
        // It answered, with an error (not a sentinel?).
        Err(e) if !e.is_io_error() && !e.is_timeout() => return Outcome::Nothing(e.to_string()),
        Err(e) => return Outcome::Unreachable(e),
    };
    let field = |name: &str| {
        fields
            .chunks(2)
            .find(|kv| kv.first().is_some_and(|k| k == name))
            .and_then(|kv| kv.get(1))
            .map(String::as_str)
    };
    let (Some(host), Some(port), flags) = (field("ip"), field("port"), field("flags")) else {
        return Outcome::Nothing("named no address".into());
    };
    let Ok(port) = port.parse::<u16>() else {
        return Outcome::Nothing(format!("named the port `{port}`"));
    };
    let named = host_port(host, port);
    let flags = flags.unwrap_or_default();
    if flags
        .split(',')
        .any(|f| matches!(f, "s_down" | "o_down" | "disconnected"))
    {
        return Outcome::Nothing(format!("names {named}, which it sees down ({flags})"));
    }
    let Some((host, port)) = mapped(&st.address_map, host, port) else {
        return Outcome::Nothing(format!("named {named}, which address_map does not list"));
    };
    let at = host_port(&host, port);
    let reached = if at == named {
        named.clone()
    } else {
        format!("{named} (reached at {at})")
    };
    let info = (*config.connection)
        .clone()
        .set_addr(redis::ConnectionAddr::Tcp(host, port));
    let client = match redis::Client::open(info) {
        Ok(c) => c,
        Err(e) => return Outcome::Refused(format!("named {reached}"), error::map(e)),
    };
    // A failure the primary's answer explains (credentials, permissions,
    // RESP3) is kept apart: no other sentinel or retry mends it.
    let failed = |step: &str, e: RedisError| {
        let why = format!("named {reached}, {step}: {e}");
        let refused = e.kind() == ErrorKind::AuthenticationFailed
            || matches!(e.code(), Some("WRONGPASS" | "NOAUTH"));
        let mapped = if refused {
            Error::backend(
                error::BACKEND,
                false,
                format!("{reached} refused the credentials: {e}"),
            )
        } else {
            error::map(e)
        };
        if mapped.is_retryable() {
            Outcome::Nothing(why)
        } else {
            Outcome::Refused(why, mapped)
        }
    };
    let mut primary = match client
        .get_multiplexed_async_connection_with_config(&within)
        .await
    {
        Ok(c) => c,
        Err(e) => return failed("unreachable", e),
    };
    let role: Vec<Value> = match redis::cmd("ROLE").query_async(&mut primary).await {
        Ok(r) => r,
        Err(e) => return failed("ROLE failed", e),
    };
    match role.first().and_then(scripts::text) {
        Some(r) if r == "master" => Outcome::Primary(Box::new(Found { client, named })),
        r => Outcome::Nothing(format!(
            "named {reached}, whose ROLE is {}",
            r.as_deref().unwrap_or("unknown")
        )),
    }
}

/// `host:port`, an IPv6 host in brackets.
fn host_port(host: &str, port: u16) -> String {
    if host.contains(':') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

/// `host:port` after the URL's `address_map`: the pair's right side where
/// its left side is this address (IP addresses compared as addresses,
/// names without regard to case; IPv6 brackets dropped). With a map that
/// does not list the address, `None`; with no map, the address itself.
pub(crate) fn mapped(
    map: &[crate::config::AddressPair],
    host: &str,
    port: u16,
) -> Option<(String, u16)> {
    let bare = |h: &str| h.trim_start_matches('[').trim_end_matches(']').to_owned();
    let same =
        |a: &str, b: &str| match (a.parse::<std::net::IpAddr>(), b.parse::<std::net::IpAddr>()) {
            (Ok(a), Ok(b)) => a == b,
            _ => a.eq_ignore_ascii_case(b),
        };
    if map.is_empty() {
        return Some((bare(host), port));
    }
    map.iter()
        .find(|((fh, fp), _)| *fp == port && same(&bare(fh), &bare(host)))
        .map(|(_, (th, tp))| (bare(th), *tp))
}

#[cfg(test)]
mod tests {
    use super::mapped;

    #[test]
    fn mapped_addresses() {
        let map = vec![
            (("10.0.0.5".to_owned(), 6379), ("proxy".to_owned(), 7000)),
            (
                ("[2001:DB8::1]".to_owned(), 6379),
                ("[::1]".to_owned(), 7001),
            ),
            (("Redis-A".to_owned(), 6379), ("127.0.0.1".to_owned(), 7002)),
        ];
        assert_eq!(mapped(&map, "10.0.0.5", 6379), Some(("proxy".into(), 7000)));
        assert_eq!(
            mapped(&map, "2001:db8::1", 6379),
            Some(("::1".into(), 7001))
        );
        assert_eq!(
            mapped(&map, "redis-a", 6379),
            Some(("127.0.0.1".into(), 7002))
        );
        // Another port, another address: not listed.
        assert_eq!(mapped(&map, "10.0.0.5", 6380), None);
        assert_eq!(mapped(&map, "10.0.0.6", 6379), None);
        // No map: the address as named.
        assert_eq!(
            mapped(&[], "10.0.0.6", 6379),
            Some(("10.0.0.6".into(), 6379))
        );
        assert_eq!(mapped(&[], "[::1]", 1), Some(("::1".into(), 1)));
    }
}
