//! Following a primary that Sentinel manages: the lookup (which sentinel
//! names which primary, checked with `ROLE`, through the URL's
//! `address_map`) and what a connection keeps to follow a failover.

use std::{
    sync::{Mutex, OnceLock},
    time::Duration,
};

use fenced_api::{Error, Result};
use redis::{aio::ConnectionManagerConfig, RedisResult, Value};
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

/// The current primary as the sentinels name it (`ROLE`-checked), within
/// the connect timeout: at connect and after a failure a failover explains.
///
/// The sentinels are asked in the URL's order (`SENTINEL
/// GET-MASTER-ADDR-BY-NAME`), each within its share of the timeout, so one
/// that hangs does not use up the others' time. The first that names a
/// primary which answers `ROLE` as one wins; the address it names goes
/// through the URL's `address_map` first, for the check and the connection
/// alike, so a primary behind NAT or a proxy is reached where it can be.
pub(crate) async fn ask_sentinels(config: &RedisConfig) -> Result<redis::Client> {
    let Some(st) = &config.sentinel else {
        return Err(Error::config(format!(
            "{} is not a redis+sentinel:// URL",
            config.display_url
        )));
    };
    let limit = config.connect_timeout;
    let started = Instant::now();
    // What each sentinel said, for the error; the last I/O failure, kept
    // while no sentinel has answered at all.
    let mut said = Vec::new();
    let mut unreachable = None;
    let mut answered = false;
    for (i, node) in st.nodes.iter().enumerate() {
        let left = limit.saturating_sub(started.elapsed());
        if left.is_zero() {
            said.push(format!(
                "{node}: not asked (the connect timeout {limit:?} ran out)"
            ));
            continue;
        }
        // An equal share of what is left with each sentinel not yet asked.
        let share = left / u32::try_from(st.nodes.len() - i).unwrap_or(u32::MAX);
        match tokio::time::timeout(share, ask_sentinel(node, st, config)).await {
            Ok(Ok(Named::Primary(client))) => return Ok(*client),
            Ok(Ok(Named::Nothing(why))) => {
                answered = true;
                said.push(format!("{node}: {why}"));
            }
            Ok(Err(e)) => {
                said.push(format!("{node}: {e}"));
                if e.is_io_error() || e.is_connection_refusal() {
                    unreachable = Some(e);
                } else {
                    // It answered, with an error (not a sentinel?).
                    answered = true;
                }
            }
            Err(_) => said.push(format!("{node}: no answer within {share:?}")),
        }
    }
    // No sentinel answered, and one could not be connected to: the error
    // says why, as for any other connection that cannot be made.
    if let (Some(e), false) = (unreachable, answered) {
        return Err(error::map(e).connecting(&config.display_url));
    }
    // Some answered without a primary that is up: during a failover that
    // lasts until a replica is promoted, so it is worth another try (a
    // wrong primary name looks the same).
    Err(Error::backend(
        error::BACKEND,
        true,
        format!(
            "no sentinel of {} names a primary that is up as `{}` now (a failover under way, \
             or a name the sentinels do not monitor): {}",
            config.display_url,
            st.master,
            said.join("; ")
        ),
    ))
}

/// What one sentinel said.
enum Named {
    /// A primary that answers `ROLE` as one.
    Primary(Box<redis::Client>),
    /// No such primary, and why.
    Nothing(String),
}

/// Asks the sentinel at `node` (`host:port`) for the primary and checks it.
async fn ask_sentinel(
    node: &str,
    st: &crate::config::SentinelSettings,
    config: &RedisConfig,
) -> RedisResult<Named> {
    let sentinel = redis::Client::open(format!("redis://{node}"))?;
    let mut s = sentinel.get_multiplexed_async_connection().await?;
    let named: Option<(String, String)> = redis::cmd("SENTINEL")
        .arg("GET-MASTER-ADDR-BY-NAME")
        .arg(&st.master)
        .query_async(&mut s)
        .await?;
    let Some((host, port)) = named else {
        return Ok(Named::Nothing(format!("knows no primary `{}`", st.master)));
    };
    let Ok(port) = port.parse::<u16>() else {
        return Ok(Named::Nothing(format!("named the port `{port}`")));
    };
    let (host, port) = mapped(&st.address_map, host, port);
    let info = (*config.connection)
        .clone()
        .set_addr(redis::ConnectionAddr::Tcp(host.clone(), port));
    let client = redis::Client::open(info)?;
    let mut primary = match client.get_multiplexed_async_connection().await {
        Ok(c) => c,
        Err(e) => {
            return Ok(Named::Nothing(format!(
                "named {host}:{port}, unreachable: {e}"
            )))
        }
    };
    let role: Vec<Value> = redis::cmd("ROLE").query_async(&mut primary).await?;
    match role.first().and_then(scripts::text) {
        Some(r) if r == "master" => Ok(Named::Primary(Box::new(client))),
        r => Ok(Named::Nothing(format!(
            "named {host}:{port}, whose ROLE is {}",
            r.as_deref().unwrap_or("unknown")
        ))),
    }
}

/// `host:port` after the URL's `address_map` (brackets of IPv6 addresses
/// are not compared, and dropped from the result).
pub(crate) fn mapped(map: &[crate::config::AddressPair], host: String, port: u16) -> (String, u16) {
    let bare = |h: &str| h.trim_start_matches('[').trim_end_matches(']').to_owned();
    let found = map
        .iter()
        .find(|((fh, fp), _)| *fp == port && bare(fh) == bare(&host));
    match found {
        Some((_, (th, tp))) => (bare(th), *tp),
        None => (bare(&host), port),
    }
}
