//! The one place where `redis` errors become fenced errors.

use std::{future::Future, time::Duration};

use fenced_api::{Error, Result};
use redis::{ErrorKind, RedisError, ServerErrorKind};

pub(crate) const BACKEND: &str = "redis";

/// Maps a `redis` error to [`Error::Backend`], or [`Error::Config`] where the
/// fix is configuration (a replica, missing permissions, no RESP3, a Redis
/// Cluster node that does not serve the key's slot).
pub(crate) fn map(e: RedisError) -> Error {
    map_with(e, Topology::Fixed)
}

/// How the client finds the server a call goes to: what a failover or a
/// moved slot means for its errors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Topology {
    /// One server, named in the URL.
    Fixed,
    /// The primary Sentinel names, followed through failovers.
    Sentinel,
    /// A Redis Cluster: each key's slot on the node that serves it.
    Cluster,
}

/// [`map`], for a client that follows topology changes (`following`: through
/// Sentinel, or as a Cluster client): there a read-only reply means the
/// server it talks to was demoted by a failover, and a redirection that the
/// client could not follow means the slot moved meanwhile — retryable
/// errors, not configuration.
pub(crate) fn map_with(e: RedisError, topology: Topology) -> Error {
    let following = topology != Topology::Fixed;
    match e.kind() {
        ErrorKind::Server(ServerErrorKind::ReadOnly) if following => {
            return Error::backend(
                BACKEND,
                true,
                format!("the server is no longer the primary ({e}); looking for the new one"),
            )
        }
        ErrorKind::Server(ServerErrorKind::ReadOnly) => {
            return Error::config(format!(
                "the redis server is a read-only replica ({e}); locks must live on the primary"
            ))
        }
        ErrorKind::Server(ServerErrorKind::NoPerm) => {
            return Error::config(format!(
            "the redis user lacks a permission fenced needs ({e}); it runs EVALSHA, SCRIPT LOAD, \
                 SUBSCRIBE and CONFIG GET on its keys and channels (and WAIT with min_replicas)"
        ))
        }
        // A Cluster client sends a redirected command again until the
        // call's bound; one that still surfaces means the slot kept moving
        // (a resharding or failover under way): worth another try.
        ErrorKind::Server(ServerErrorKind::Moved | ServerErrorKind::Ask)
            if topology == Topology::Cluster =>
        {
            return Error::backend(
                BACKEND,
                true,
                format!("the cluster moved this lock's slot while it was asked ({e})"),
            )
        }
        // A `redis://` client talks to one node and never follows a
        // redirection: retrying cannot help, so say what to change instead.
        ErrorKind::Server(ServerErrorKind::Moved | ServerErrorKind::Ask) => {
            return Error::config(format!(
                "the redis server is a Redis Cluster node that does not serve this lock's hash \
                 slot (it answered {} {}); a redis:// url connects to that one node and does \
                 not follow cluster redirections: use redis+cluster://host:port,… for a cluster",
                e.code().unwrap_or("MOVED"),
                e.detail().unwrap_or("")
            ))
        }
        ErrorKind::RESP3NotSupported => {
            return Error::config(format!(
                "the redis server does not speak RESP3 ({e}); fenced-redis needs Redis 6 or later"
            ))
        }
        _ => {}
    }
    // A TLS handshake that refused the server's certificate: trying again
    // meets the same certificate. The redis crate gives rustls's reason as
    // text only.
    if e.is_io_error() {
        let text = e.to_string();
        if text.contains("invalid peer certificate") {
            return Error::config(format!(
                "the redis server's TLS certificate was refused ({e}): it must be valid now, \
                 name the address the client connects to (in a cluster, each node's announced \
                 address or its address_map target) and be signed by a CA the client trusts \
                 (SSL_CERT_FILE adds one; a url ending in #insecure skips the check, for tests \
                 only)"
            ));
        }
        if text.contains("CertificateRequired") {
            return Error::config(format!(
                "the redis server asks for a client certificate ({e}), which fenced-redis does \
                 not send: set `tls-auth-clients no` (or `optional`) on the server"
            ));
        }
    }
    // BUSY: a script is running on the server and ours did not run; safe to retry.
    let busy = e.code().is_some_and(|c| c == "BUSY");
    // ClusterConnectionNotFound: a cluster client lost every connection to
    // the node it needed (its connections are being rebuilt).
    let retryable = busy
        || e.kind() == ErrorKind::ClusterConnectionNotFound
        || e.is_io_error()
        || e.is_timeout()
        || e.is_connection_dropped()
        || e.is_connection_refusal()
        || matches!(
            e.kind(),
            ErrorKind::Server(
                ServerErrorKind::BusyLoading
                    | ServerErrorKind::TryAgain
                    | ServerErrorKind::ClusterDown
                    | ServerErrorKind::MasterDown
            )
        );
    // The redis crate's error does not expose the socket's `io::Error` as
    // its source; its own predicates say what kind of failure it was, and
    // carrying that kind lets `Error::connecting` name the cause.
    let kind = if e.is_connection_refusal() {
        Some(std::io::ErrorKind::ConnectionRefused)
    } else if e.is_timeout() {
        Some(std::io::ErrorKind::TimedOut)
    } else if e.is_connection_dropped() {
        Some(std::io::ErrorKind::ConnectionReset)
    } else {
        None
    };
    match kind {
        Some(kind) => Error::backend(BACKEND, retryable, std::io::Error::new(kind, e)),
        None => Error::backend(BACKEND, retryable, e),
    }
}

/// An unexpected reply shape: a bug or a foreign value under our key.
pub(crate) fn protocol(what: impl Into<String>) -> Error {
    Error::backend(BACKEND, false, what.into())
}

/// Runs one round trip to `server` within `limit` ([`fenced_api::bounded`]),
/// mapping its error with [`map`]: an unreachable or stalled server yields a
/// retryable error naming the call, the server and the bound, not a hang.
pub(crate) async fn bounded<T>(
    limit: Duration,
    what: &str,
    server: &str,
    topology: Topology,
    fut: impl Future<Output = redis::RedisResult<T>>,
) -> Result<T> {
    fenced_api::bounded(BACKEND, format!("{what} at {server}"), limit, async {
        fut.await.map_err(|e| map_with(e, topology))
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refused_connection_is_named_by_its_kind() {
        let refused: RedisError =
            std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "os error 111").into();
        let text = map(refused).connecting("127.0.0.1:1").to_string();
        assert!(text.contains("127.0.0.1:1: connection refused ("), "{text}");
    }

    #[test]
    fn classification() {
        let refused: RedisError =
            std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "refused").into();
        assert!(map(refused).is_retryable());
        let reset: RedisError =
            std::io::Error::new(std::io::ErrorKind::ConnectionReset, "reset").into();
        assert!(map(reset).is_retryable());
        let parse: RedisError = (ErrorKind::UnexpectedReturnType, "bad reply").into();
        assert!(!map(parse).is_retryable());
        assert!(protocol("x").to_string().starts_with("redis backend error"));
    }

    /// A cluster redirection, parsed from the reply a Redis Cluster node
    /// sends: for a `redis://` client a configuration error naming the fix,
    /// never retryable; for a Cluster client (which follows redirections
    /// itself, so one that surfaces is a slot moving again) retryable.
    #[test]
    fn cluster_redirections_are_configuration_errors() {
        for (reply, code) in [
            (&b"-MOVED 3999 127.0.0.1:6381\r\n"[..], "MOVED"),
            (&b"-ASK 3999 127.0.0.1:6381\r\n"[..], "ASK"),
        ] {
            let e = redis::parse_redis_value(reply)
                .and_then(|v| v.extract_error())
                .unwrap_err();
            let mapped = map(e);
            assert!(!mapped.is_retryable(), "{mapped}");
            let Error::Config { reason } = &mapped else {
                panic!("{code} mapped to {mapped:?}");
            };
            assert!(reason.contains(code), "{reason}");
            assert!(reason.contains("3999 127.0.0.1:6381"), "{reason}");
            assert!(reason.contains("redis+cluster://"), "{reason}");
            let e = redis::parse_redis_value(reply)
                .and_then(|v| v.extract_error())
                .unwrap_err();
            assert!(map_with(e.clone(), Topology::Cluster).is_retryable());
            // A Sentinel-led client talks to one primary: a redirection is
            // still its configuration.
            assert!(matches!(
                map_with(e, Topology::Sentinel),
                Error::Config { .. }
            ));
        }
        // Other cluster states stay retryable backend errors.
        let down = redis::parse_redis_value(b"-CLUSTERDOWN The cluster is down\r\n")
            .and_then(|v| v.extract_error())
            .unwrap_err();
        assert!(map(down).is_retryable());
    }

    #[tokio::test(start_paused = true)]
    async fn bounded_turns_a_hang_into_a_retryable_error() {
        let never = std::future::pending::<redis::RedisResult<()>>();
        let e = bounded(
            Duration::from_millis(50),
            "PING",
            "redis://h",
            Topology::Fixed,
            never,
        )
        .await
        .unwrap_err();
        assert!(e.is_retryable(), "{e}");
        assert!(e.to_string().contains("within 50ms"), "{e}");
    }
}
