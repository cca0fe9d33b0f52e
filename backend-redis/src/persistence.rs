//! What the server keeps across a restart, read once at connect time (not
//! re-read: a running client does not see a later `CONFIG SET`).

use std::{collections::HashMap, fmt};

use fenced_api::Result;
use redis::{aio::ConnectionLike, ErrorKind};

use crate::{conn::Link, error};

/// How the connected Redis persists data, from `CONFIG GET appendonly`,
/// `appendfsync` and `save` at connect time.
///
/// Read **once, at connect**: [`is_durable`](Self::is_durable) (and the
/// `durable` capability built from it) reflects the configuration at that
/// moment. A later `CONFIG SET appendonly …`, or a restart of Redis with a
/// different configuration, is not seen by a running [`RedisLock`](crate::RedisLock);
/// connect again to read it anew.
///
/// Only [`Persistence::AppendOnly`] with `appendfsync always` makes
/// [`Capabilities::is_durable`](fenced_api::Capabilities::is_durable) true:
/// every acknowledged grant is on disk before the reply. `everysec` survives
/// a restart of the process but can lose the last second of grants when the
/// host crashes; snapshots go back to the last `save` point. Without
/// durability a restart forgets held locks (a second holder can get one at
/// once); fencing tokens still never go backwards — see the crate docs.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Persistence {
    /// Nothing on disk (`appendonly no`, `save ""`): a restart forgets every lock.
    None,
    /// RDB snapshots only: a restart goes back to the last snapshot.
    Snapshots {
        /// The `save` rules, e.g. `3600 1 300 100`.
        save: String,
    },
    /// The append-only file is on.
    AppendOnly {
        /// The `appendfsync` policy: `always`, `everysec` or `no`.
        fsync: String,
    },
    /// `CONFIG GET` was refused (renamed or forbidden by ACL): nothing is assumed to survive.
    Unknown {
        /// The server's answer.
        reason: String,
    },
}

impl Persistence {
    /// Whether held locks and fence counters survive a crash of the server:
    /// AOF with `appendfsync always` — as configured when the client
    /// connected.
    pub fn is_durable(&self) -> bool {
        matches!(self, Persistence::AppendOnly { fsync } if fsync == "always")
    }

    /// What survives a crash, as a rank: nothing (or unknown) < snapshots
    /// < an append-only file < one synced on every write.
    fn strength(&self) -> u8 {
        match self {
            Persistence::None | Persistence::Unknown { .. } => 0,
            Persistence::Snapshots { .. } => 1,
            Persistence::AppendOnly { fsync } if fsync == "always" => 3,
            Persistence::AppendOnly { .. } => 2,
        }
    }

    fn from_config(config: &HashMap<String, String>) -> Self {
        let get = |k: &str| config.get(k).map(|v| v.trim().to_ascii_lowercase());
        if get("appendonly").as_deref() == Some("yes") {
            return Persistence::AppendOnly {
                fsync: get("appendfsync").unwrap_or_else(|| "everysec".into()),
            };
        }
        match get("save") {
            Some(save) if !save.is_empty() => Persistence::Snapshots { save },
            _ => Persistence::None,
        }
    }
}

impl fmt::Display for Persistence {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Persistence::None => f.write_str("no persistence"),
            Persistence::Snapshots { save } => write!(f, "RDB snapshots only (save {save})"),
            Persistence::AppendOnly { fsync } => write!(f, "append-only file, appendfsync {fsync}"),
            Persistence::Unknown { reason } => write!(f, "unknown ({reason})"),
        }
    }
}

/// Reads the configuration in one round trip. A refused `CONFIG` gives
/// [`Persistence::Unknown`]; a connection failure is an error.
pub(crate) async fn probe(
    conn: &mut impl ConnectionLike,
    limit: std::time::Duration,
    server: &str,
) -> Result<Persistence> {
    let mut pipe = redis::pipe();
    for name in ["appendonly", "appendfsync", "save"] {
        pipe.cmd("CONFIG").arg("GET").arg(name);
    }
    let reply = fenced_api::bounded(
        error::BACKEND,
        format!("CONFIG GET at {server} while connecting"),
        limit,
        async { Ok(pipe.query_async::<Vec<HashMap<String, String>>>(conn).await) },
    )
    .await?;
    match reply {
        Ok(maps) => Ok(Persistence::from_config(
            &maps.into_iter().flatten().collect(),
        )),
        // Not a refused CONFIG but a refused client: wrong or missing
        // credentials must fail the connect, not the first lock.
        Err(e)
            if e.kind() == ErrorKind::AuthenticationFailed
                || matches!(e.code(), Some("WRONGPASS" | "NOAUTH")) =>
        {
            Err(fenced_api::Error::backend(
                error::BACKEND,
                false,
                format!("{server} refused the credentials: {e}"),
            ))
        }
        Err(e) if matches!(e.kind(), ErrorKind::Server(_) | ErrorKind::Extension) => {
            tracing::warn!(server, error = %e, "CONFIG GET refused; assuming the server persists nothing");
            Ok(Persistence::Unknown {
                reason: e.to_string(),
            })
        }
        Err(e) => Err(error::map(e)),
    }
}

/// [`probe`] of every primary (one server, or each Cluster primary): the
/// weakest answer, so a Cluster counts as durable only when every primary
/// is. Each node within `limit`.
pub(crate) async fn probe_primaries(
    link: &Link,
    limit: std::time::Duration,
    server: &str,
) -> Result<Persistence> {
    let nodes = fenced_api::bounded(
        error::BACKEND,
        format!("CLUSTER SLOTS at {server} while connecting"),
        limit,
        async { link.primaries().await.map_err(error::map) },
    )
    .await?;
    let mut weakest: Option<Persistence> = None;
    for mut node in nodes {
        let at = format!("{server} ({node})");
        let p = probe(&mut node, limit, &at).await?;
        weakest = Some(match weakest {
            Some(w) if w.strength() <= p.strength() => w,
            _ => p,
        });
    }
    weakest.ok_or_else(|| {
        fenced_api::Error::backend(
            error::BACKEND,
            true,
            format!("{server}: the cluster has no primary serving slots yet"),
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn detection_table() {
        let cases = [
            (
                cfg(&[
                    ("appendonly", "no"),
                    ("save", ""),
                    ("appendfsync", "everysec"),
                ]),
                Persistence::None,
                false,
            ),
            (
                cfg(&[("appendonly", "no"), ("save", "3600 1 300 100")]),
                Persistence::Snapshots {
                    save: "3600 1 300 100".into(),
                },
                false,
            ),
            (
                cfg(&[
                    ("appendonly", "yes"),
                    ("appendfsync", "everysec"),
                    ("save", ""),
                ]),
                Persistence::AppendOnly {
                    fsync: "everysec".into(),
                },
                false,
            ),
            (
                cfg(&[("appendonly", "yes"), ("appendfsync", "always")]),
                Persistence::AppendOnly {
                    fsync: "always".into(),
                },
                true,
            ),
            (cfg(&[]), Persistence::None, false),
        ];
        for (config, want, durable) in cases {
            let got = Persistence::from_config(&config);
            assert_eq!(got, want, "{config:?}");
            assert_eq!(got.is_durable(), durable, "{config:?}");
        }
        assert!(!Persistence::Unknown { reason: "x".into() }.is_durable());
    }
}
