//! The one place where ZooKeeper client errors become fenced errors, and the
//! bound every call to ZooKeeper runs under.

use std::{future::Future, time::Duration};

use fenced_api::{Error, Result};
use zookeeper_client::Error as ZkError;

pub(crate) const BACKEND: &str = "zookeeper";

/// What a ZooKeeper error means to the lock recipe.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    /// The request may or may not have been applied; the session may live
    /// (connection loss, the client's dropped-connection errors, timeout, a
    /// moved session, throttling).
    Retryable,
    /// A node the recipe expected is absent: a mechanism signal.
    NoNode,
    /// A node the recipe creates exists already: a mechanism signal.
    NodeExists,
    /// A guarded write found another version: a mechanism signal.
    BadVersion,
    /// The session ended: every ephemeral node of it is gone.
    SessionLost,
    /// Anything else: a configuration or permission problem, not retried.
    Fatal,
}

/// Classifies a client error by its variant.
pub(crate) fn kind(e: &ZkError) -> Kind {
    match e {
        // `Custom` is what the client gives pending requests when it
        // drops a connection it found silent ("no response from
        // connection") or broken (an I/O error): transport failures.
        ZkError::ConnectionLoss
        | ZkError::Custom(_)
        | ZkError::Timeout
        | ZkError::SessionMoved
        | ZkError::Throttled
        | ZkError::NoHosts
        | ZkError::NotReadOnly => Kind::Retryable,
        ZkError::NoNode => Kind::NoNode,
        ZkError::NodeExists => Kind::NodeExists,
        ZkError::BadVersion => Kind::BadVersion,
        ZkError::SessionExpired | ZkError::ClientClosed => Kind::SessionLost,
        _ => Kind::Fatal,
    }
}

/// Maps a client error; availability failures and a lost session are
/// retryable (the next call gets a new session).
pub(crate) fn map(e: ZkError) -> Error {
    let retryable = matches!(kind(&e), Kind::Retryable | Kind::SessionLost);
    // The client hides the socket's error; a server that cannot be reached
    // is reported as one of these variants, carried as `ConnectionRefused`
    // / `TimedOut` so that `Error::connecting` can name the cause.
    let io = match e {
        ZkError::NoHosts | ZkError::ConnectionLoss => Some(std::io::ErrorKind::ConnectionRefused),
        ZkError::Timeout => Some(std::io::ErrorKind::TimedOut),
        _ => None,
    };
    match io {
        Some(kind) => Error::backend(BACKEND, retryable, std::io::Error::new(kind, e)),
        None => Error::backend(BACKEND, retryable, e),
    }
}

/// Runs `call` (a ZooKeeper request) for at most `limit`: its answer, left
/// to the caller to classify, or the retryable no-answer error of
/// [`fenced_api::bounded`] naming `what`.
pub(crate) async fn bounded<T>(
    what: &str,
    limit: Duration,
    call: impl Future<Output = std::result::Result<T, ZkError>>,
) -> Result<std::result::Result<T, ZkError>> {
    fenced_api::bounded(BACKEND, what, limit, async { Ok(call.await) }).await
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;

    #[test]
    fn errors_by_kind() {
        for (e, k, retryable) in [
            (ZkError::ConnectionLoss, Kind::Retryable, true),
            (ZkError::Timeout, Kind::Retryable, true),
            (ZkError::SessionMoved, Kind::Retryable, true),
            (ZkError::NoNode, Kind::NoNode, false),
            (ZkError::NodeExists, Kind::NodeExists, false),
            (ZkError::BadVersion, Kind::BadVersion, false),
            (ZkError::SessionExpired, Kind::SessionLost, true),
            (ZkError::NoAuth, Kind::Fatal, false),
            (ZkError::AuthFailed, Kind::Fatal, false),
        ] {
            assert_eq!(kind(&e), k, "{e}");
            assert_eq!(map(e.clone()).is_retryable(), retryable, "{e}");
        }
        let text = map(ZkError::ConnectionLoss)
            .connecting("127.0.0.1:1")
            .to_string();
        assert!(text.contains("connection refused"), "{text}");
    }

    #[tokio::test]
    async fn a_silent_call_is_a_retryable_no_answer() {
        let never = std::future::pending::<std::result::Result<(), ZkError>>();
        let e = bounded("get", Duration::from_millis(20), never)
            .await
            .unwrap_err();
        assert!(e.is_retryable(), "{e}");
    }
}
