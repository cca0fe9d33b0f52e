//! The one place where etcd client errors become fenced errors.

use fenced_api::Error;
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
    Error::backend(BACKEND, retryable, e)
}

/// An operation that did not answer within the configured timeout.
pub(crate) fn timed_out(what: &str, after: std::time::Duration) -> Error {
    Error::backend(
        BACKEND,
        true,
        format!("{what}: no answer from etcd within {after:?}"),
    )
}

/// Whether the request certainly never reached a server (the connection to
/// the chosen endpoint was refused), so that retrying it cannot apply it twice.
pub(crate) fn never_sent(e: &etcd_client::Error) -> bool {
    match e {
        etcd_client::Error::GRpcStatus(s) => {
            s.code() == Code::Unavailable && s.message().contains("tcp connect error")
        }
        _ => false,
    }
}

/// Whether etcd refused a request because a lease it names does not exist
/// (expired or revoked): the keys on it are gone.
pub(crate) fn lease_not_found(e: &etcd_client::Error) -> bool {
    match e {
        etcd_client::Error::GRpcStatus(s) => {
            s.code() == Code::NotFound && s.message().contains("lease not found")
        }
        etcd_client::Error::LeaseKeepAliveError(m) => m.contains("lease not found"),
        _ => false,
    }
}
