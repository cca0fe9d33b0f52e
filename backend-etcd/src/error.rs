//! The one place where etcd client errors become fenced errors, and the
//! bound every call to etcd runs under.

use std::{future::Future, time::Duration};

use fenced_api::{Error, Result};
use tonic::Code;

pub(crate) const BACKEND: &str = "etcd";

/// Maps an etcd client error; transport and availability failures are retryable.
pub(crate) fn map(e: etcd_client::Error) -> Error {
    use etcd_client::Error as E;
    let retryable = match &e {
        E::IoError(_) | E::TransportError(_) | E::WatchError(_) | E::LeaseKeepAliveError(_) => true,
        E::GRpcStatus(status) => matches!(
            status.code(),
            Code::Unavailable
                | Code::DeadlineExceeded
                | Code::Unknown
                | Code::Aborted
                | Code::ResourceExhausted
                | Code::Cancelled
        ),
        _ => false,
    };
    // etcd-client's error has no source; the kind of the socket failure
    // below it (in the gRPC status or the transport error) is carried along
    // so that `Error::connecting` can name the cause.
    match io_kind(&e) {
        Some(kind) => Error::backend(BACKEND, retryable, std::io::Error::new(kind, e)),
        None => Error::backend(BACKEND, retryable, e),
    }
}

/// The kind of the first `std::io::Error` below a status or transport error.
fn io_kind(e: &etcd_client::Error) -> Option<std::io::ErrorKind> {
    let mut next: Option<&(dyn std::error::Error + 'static)> = match e {
        etcd_client::Error::GRpcStatus(s) => std::error::Error::source(s),
        etcd_client::Error::TransportError(t) => std::error::Error::source(t),
        etcd_client::Error::IoError(io) => return Some(io.kind()),
        _ => None,
    };
    while let Some(cause) = next {
        if let Some(io) = cause.downcast_ref::<std::io::Error>() {
            return Some(io.kind());
        }
        next = cause.source();
    }
    None
}

/// Runs `call` for at most `limit`: its own output (etcd's answer, left to
/// the caller to classify), or the retryable no-answer error of
/// [`fenced_api::bounded`] naming `what`.
pub(crate) async fn bounded<T>(
    what: &str,
    limit: Duration,
    call: impl Future<Output = T>,
) -> Result<T> {
    fenced_api::bounded(BACKEND, what, limit, async { Ok(call.await) }).await
}

/// Whether the request certainly never reached a server, so that retrying it
/// (on another member) cannot apply it twice: the channel could not open a
/// TCP connection to the chosen endpoint (refused, unreachable, or no answer
/// to the connect). Decided by the types and kinds in the status's source
/// chain: tonic keeps the connector's failure there as a
/// [`tonic::ConnectError`], with the socket's [`std::io::Error`] below it.
/// A TLS or DNS failure while connecting has other kinds and is not retried.
pub(crate) fn never_sent(e: &etcd_client::Error) -> bool {
    use std::io::ErrorKind as K;
    let etcd_client::Error::GRpcStatus(s) = e else {
        return false;
    };
    if s.code() != Code::Unavailable {
        return false;
    }
    let mut connecting = false;
    let mut next: Option<&(dyn std::error::Error + 'static)> = std::error::Error::source(s);
    while let Some(cause) = next {
        connecting |= cause.is::<tonic::ConnectError>();
        if let Some(io) = cause.downcast_ref::<std::io::Error>() {
            return connecting
                && matches!(
                    io.kind(),
                    K::ConnectionRefused | K::TimedOut | K::HostUnreachable | K::NetworkUnreachable
                );
        }
        next = cause.source();
    }
    false
}

/// Whether etcd refused a request because a lease it names does not exist
/// (expired or revoked): the keys on it are gone. etcd answers `NotFound`
/// for that and for other missing things (users, roles): the code decides,
/// the message tells which.
pub(crate) fn lease_not_found(e: &etcd_client::Error) -> bool {
    match e {
        etcd_client::Error::GRpcStatus(s) => {
            s.code() == Code::NotFound && says_lease_not_found(s.message())
        }
        // etcd-client's own error when a keep-alive stream opens on a lease
        // whose TTL is already 0; the variant also carries send failures,
        // so only the text tells them apart.
        etcd_client::Error::LeaseKeepAliveError(m) => says_lease_not_found(m),
        _ => false,
    }
}

/// The text check behind [`lease_not_found`]: etcd reports a missing lease
/// as `etcdserver: requested lease not found`, etcd-client as `lease not
/// found`, and neither carries a finer code.
fn says_lease_not_found(message: &str) -> bool {
    message.contains("lease not found")
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;

    #[test]
    fn lease_not_found_needs_the_code_and_the_text() {
        let status =
            |code, msg: &str| etcd_client::Error::GRpcStatus(tonic::Status::new(code, msg));
        assert!(lease_not_found(&status(
            Code::NotFound,
            "etcdserver: requested lease not found"
        )));
        assert!(!lease_not_found(&status(
            Code::NotFound,
            "etcdserver: user name not found"
        )));
        assert!(!lease_not_found(&status(
            Code::Unavailable,
            "etcdserver: requested lease not found"
        )));
        assert!(lease_not_found(&etcd_client::Error::LeaseKeepAliveError(
            "lease not found".into()
        )));
        assert!(!lease_not_found(&etcd_client::Error::LeaseKeepAliveError(
            "channel closed".into()
        )));
    }

    /// A request to a port nobody listens on fails before it is sent, and
    /// the decision comes from the error's kind: a status with the same
    /// code and message but no source is not taken for one.
    #[tokio::test]
    async fn a_refused_connection_is_never_sent() {
        let mut c = etcd_client::Client::connect(["http://127.0.0.1:1"], None)
            .await
            .unwrap();
        let e = c.status().await.unwrap_err();
        assert!(never_sent(&e), "{e:?}");
        let etcd_client::Error::GRpcStatus(s) = &e else {
            panic!("{e:?}");
        };
        let bare = etcd_client::Error::GRpcStatus(tonic::Status::new(s.code(), s.message()));
        assert!(!never_sent(&bare), "{bare:?}");
        assert!(!never_sent(&etcd_client::Error::GRpcStatus(
            tonic::Status::new(Code::Unknown, "tcp connect error")
        )));
        // The same kind names the cause when connecting fails.
        let text = map(e).connecting("127.0.0.1:1").to_string();
        assert!(text.contains("127.0.0.1:1: connection refused ("), "{text}");
    }
}
