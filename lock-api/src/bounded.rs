//! Bounding one call to a store, so that a silent network or a stalled
//! server yields a retryable error instead of a hang.

use std::{fmt, future::Future, time::Duration};

use tokio::time::Instant;

use crate::{error::NoAnswer, Error, Result};

/// Runs `call` for at most `limit`.
///
/// ```
/// use std::time::Duration;
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// let stalled = std::future::pending::<fenced_api::Result<()>>();
/// let e = fenced_api::bounded("redis", "PING", Duration::from_millis(20), stalled)
///     .await
///     .unwrap_err();
/// assert!(e.is_retryable());
/// assert_eq!(e.to_string(), "redis backend error: no answer from redis to PING within 20ms");
/// # }
/// ```
///
/// # Errors
///
/// `call`'s own error, or a retryable [`Error::Backend`] whose source is a
/// [`NoAnswer`] when `limit` passes first (the call is dropped then: it
/// must be cancel safe, or its effect must be harmless to repeat).
pub async fn bounded<T>(
    backend: &'static str,
    what: impl fmt::Display,
    limit: Duration,
    call: impl Future<Output = Result<T>>,
) -> Result<T> {
    match tokio::time::timeout(limit, call).await {
        Ok(r) => r,
        Err(_) => Err(no_answer(backend, what, limit)),
    }
}

/// [`bounded`] with an instant instead of a duration (the bound reported is
/// the time from the call to `deadline`).
///
/// # Errors
///
/// As [`bounded`].
pub async fn bounded_until<T>(
    backend: &'static str,
    what: impl fmt::Display,
    deadline: Instant,
    call: impl Future<Output = Result<T>>,
) -> Result<T> {
    let limit = deadline.saturating_duration_since(Instant::now());
    match tokio::time::timeout_at(deadline, call).await {
        Ok(r) => r,
        Err(_) => Err(no_answer(backend, what, limit)),
    }
}

/// The retryable error of a call that got no answer within `limit`.
pub fn no_answer(backend: &'static str, what: impl fmt::Display, limit: Duration) -> Error {
    Error::backend(
        backend,
        true,
        NoAnswer {
            backend,
            what: what.to_string(),
            limit,
        },
    )
}
