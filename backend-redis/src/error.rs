//! The one place where `redis` errors become fenced errors.

use std::{future::Future, time::Duration};

use fenced_api::{Error, Result};
use redis::{ErrorKind, RedisError, ServerErrorKind};

pub(crate) const BACKEND: &str = "redis";

/// Maps a `redis` error to [`Error::Backend`], or [`Error::Config`] where the
/// fix is configuration (a replica, missing permissions, no RESP3).
pub(crate) fn map(e: RedisError) -> Error {
    match e.kind() {
        ErrorKind::Server(ServerErrorKind::ReadOnly) => {
            return Error::config(format!(
                "the redis server is a read-only replica ({e}); locks must live on the primary"
            ))
        }
        ErrorKind::Server(ServerErrorKind::NoPerm) => {
            return Error::config(format!(
            "the redis user lacks a permission fenced needs ({e}); it runs EVALSHA, SCRIPT LOAD, \
                 SUBSCRIBE and CONFIG GET on its keys and channels"
        ))
        }
        ErrorKind::RESP3NotSupported => {
            return Error::config(format!(
                "the redis server does not speak RESP3 ({e}); fenced-redis needs Redis 6 or later"
            ))
        }
        _ => {}
    }
    // BUSY: a script is running on the server and ours did not run; safe to retry.
    let busy = e.code().is_some_and(|c| c == "BUSY");
    let retryable = busy
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
    Error::backend(BACKEND, retryable, e)
}

/// An unexpected reply shape: a bug or a foreign value under our key.
pub(crate) fn protocol(what: impl Into<String>) -> Error {
    Error::backend(BACKEND, false, what.into())
}

/// Runs one round trip with a bound, so an unreachable or stalled server
/// yields a retryable error instead of a hang.
pub(crate) async fn bounded<T>(
    limit: Duration,
    what: &str,
    server: &str,
    fut: impl Future<Output = redis::RedisResult<T>>,
) -> Result<T> {
    match tokio::time::timeout(limit, fut).await {
        Ok(r) => r.map_err(map),
        Err(_) => Err(Error::backend(
            BACKEND,
            true,
            format!("no reply from {server} to {what} within {limit:?}"),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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

    #[tokio::test(start_paused = true)]
    async fn bounded_turns_a_hang_into_a_retryable_error() {
        let never = std::future::pending::<redis::RedisResult<()>>();
        let e = bounded(Duration::from_millis(50), "PING", "redis://h", never)
            .await
            .unwrap_err();
        assert!(e.is_retryable(), "{e}");
        assert!(e.to_string().contains("within 50ms"), "{e}");
    }
}
