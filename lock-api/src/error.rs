//! The one semantic error type shared by every backend.

use std::{fmt, time::Duration};

use crate::{FencingToken, LockKey};

/// Boxed source error carried by [`Error::Backend`].
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Result alias used throughout fenced.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong when taking, keeping or giving back a lock.
///
/// The variants are *semantic*: the same situation yields the same variant on
/// every backend, so callers (and the conformance suite) can match on them
/// without knowing which store is behind the trait. Contention is **not** an
/// error: [`DistributedLock::try_acquire`](crate::DistributedLock::try_acquire)
/// returns `Ok(None)` when the key is held by someone else.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The wait bound of an `acquire` elapsed while another holder kept the key.
    #[error("timed out after {waited:?} waiting for lock `{key}`")]
    Timeout {
        /// The contended key.
        key: LockKey,
        /// How long the caller actually waited.
        waited: Duration,
    },

    /// The lease is no longer valid: it expired, was force-released, or the
    /// key now belongs to another holder. The caller must stop acting on it.
    #[error("lease on `{key}` (token {token}) was lost: {reason}")]
    LeaseLost {
        /// The key the lease was for.
        key: LockKey,
        /// The fencing token of the lost lease.
        token: FencingToken,
        /// Why the lease is considered lost.
        reason: String,
    },

    /// The caller already holds this key: the same owner on a store without
    /// reentrant options, or — through [`LockClient`](crate::LockClient) —
    /// the task that acquired it (or work inside the hold's scope) asking
    /// again on a client that is not reentrant.
    ///
    /// Returned immediately, instead of letting the caller wait on itself.
    #[error(
        "lock `{key}` is already held by this holder; release it first, or re-enter it \
         (a reentrant client, or LockGuard::reenter)"
    )]
    AlreadyHeld {
        /// The key that is already held.
        key: LockKey,
    },

    /// The key is in use as another kind of lock: a semaphore with another
    /// number of permits, or a semaphore where a reader-writer lock was asked
    /// for (see [`Permits`](crate::Permits)). Every holder of a key must ask
    /// for the same kind; the request changed nothing.
    #[error("lock `{key}` is in use as {held_as}, not as {asked_as}; every holder of a key must ask for the same kind of lock")]
    KindMismatch {
        /// The key.
        key: LockKey,
        /// What the key's current holders and waiters agreed on, e.g. `a semaphore of 4 permits`.
        held_as: String,
        /// What this request asked for.
        asked_as: String,
    },

    /// The key failed validation (see [`LockKey`]). Nothing was sent to the store.
    #[error("invalid lock key: {reason}")]
    InvalidKey {
        /// What is wrong with the key.
        reason: String,
    },

    /// The lock options failed validation (TTL, wait bound, owner, renewal interval).
    /// Nothing was sent to the store.
    #[error("invalid lock options: {reason}")]
    InvalidOptions {
        /// What is wrong with the options.
        reason: String,
    },

    /// The backend configuration (URL, table name, namespace, …) is invalid.
    #[error("invalid configuration: {reason}")]
    Config {
        /// What is wrong with the configuration, and how to fix it.
        reason: String,
    },

    /// The backend cannot do what was asked (see [`Capabilities`](crate::Capabilities)).
    #[error("the {backend} backend does not support {what}")]
    Unsupported {
        /// The backend's name, e.g. `"redis"`.
        backend: &'static str,
        /// The missing capability or operation.
        what: String,
    },

    /// The store failed or could not be reached.
    #[error("{backend} backend error: {source}")]
    Backend {
        /// The backend's name, e.g. `"mysql"`.
        backend: &'static str,
        /// Whether retrying the same operation may succeed (connection refused,
        /// timeout, deadlock victim…), as opposed to a permanent failure
        /// (missing table, permission denied).
        retryable: bool,
        /// The underlying error.
        #[source]
        source: BoxError,
    },
}

impl Error {
    /// Whether retrying the operation later may succeed.
    ///
    /// True for [`Error::Timeout`] and for retryable [`Error::Backend`] errors;
    /// false for everything that will fail the same way again.
    pub fn is_retryable(&self) -> bool {
        match self {
            Error::Timeout { .. } => true,
            Error::Backend { retryable, .. } => *retryable,
            _ => false,
        }
    }

    /// Shorthand for [`Error::InvalidOptions`].
    pub fn invalid_options(reason: impl Into<String>) -> Self {
        Error::InvalidOptions {
            reason: reason.into(),
        }
    }

    /// Shorthand for [`Error::Config`].
    pub fn config(reason: impl Into<String>) -> Self {
        Error::Config {
            reason: reason.into(),
        }
    }

    /// Shorthand for [`Error::Backend`].
    pub fn backend(backend: &'static str, retryable: bool, source: impl Into<BoxError>) -> Self {
        Error::Backend {
            backend,
            retryable,
            source: source.into(),
        }
    }

    /// Rewrites a retryable [`Error::Backend`] raised while connecting as
    /// one line that names the server and says what to check: `cannot
    /// connect to redis at 127.0.0.1:6379: connection refused (is the server
    /// running and reachable?)`. `at` must already be free of passwords.
    /// Other errors (configuration, authentication) pass unchanged.
    ///
    /// The cause is read from the kinds in the error's source chain (an
    /// [`std::io::Error`]'s [`kind`](std::io::Error::kind), a
    /// [`NoAnswer`]), never from message text; when none says more, the
    /// driver's own message is kept, on one line. A backend whose driver
    /// hides the socket's error carries its kind by making the source
    /// `io::Error::new(kind, driver_error)`.
    pub fn connecting(self, at: &str) -> Self {
        let Error::Backend {
            backend,
            retryable: true,
            source,
        } = self
        else {
            return self;
        };
        let cause = connect_cause(source.as_ref())
            .unwrap_or_else(|| source.to_string().replace(['\n', '\r'], " "));
        Error::backend(
            backend,
            true,
            format!("cannot connect to {backend} at {at}: {cause} (is the server running and reachable?)"),
        )
    }

    /// Shorthand for [`Error::LeaseLost`].
    pub fn lease_lost(key: &LockKey, token: FencingToken, reason: impl Into<String>) -> Self {
        Error::LeaseLost {
            key: key.clone(),
            token,
            reason: reason.into(),
        }
    }
}

/// The source of the [`Error::Backend`] that [`bounded`](crate::bounded) returns when the
/// store did not answer in time. [`Error::connecting`] reads it as "no
/// answer in time".
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NoAnswer {
    /// The store's name, e.g. `"redis"`.
    pub backend: &'static str,
    /// What was asked, e.g. `"EVALSHA acquire"` (may name the server, never a password).
    pub what: String,
    /// The bound that passed.
    pub limit: Duration,
}

impl fmt::Display for NoAnswer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "no answer from {} to {} within {:?}",
            self.backend, self.what, self.limit
        )
    }
}

impl std::error::Error for NoAnswer {}

/// What the first error in `e`'s source chain that has a kind says about a
/// failed connection.
fn connect_cause(e: &(dyn std::error::Error + 'static)) -> Option<String> {
    use std::io::ErrorKind as K;
    let mut next = Some(e);
    while let Some(e) = next {
        if let Some(io) = e.downcast_ref::<std::io::Error>() {
            let cause = match io.kind() {
                K::ConnectionRefused => Some("connection refused"),
                K::TimedOut => Some("no answer in time"),
                K::HostUnreachable | K::NetworkUnreachable => Some("network unreachable"),
                K::ConnectionReset | K::ConnectionAborted | K::BrokenPipe | K::UnexpectedEof => {
                    Some("the connection was closed before the server answered")
                }
                _ => None,
            };
            if let Some(cause) = cause {
                return Some(cause.to_owned());
            }
        }
        if let Some(n) = e.downcast_ref::<NoAnswer>() {
            return Some(format!("no answer within {:?}", n.limit));
        }
        next = e.source();
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn assert_good_error<E: std::error::Error + Send + Sync + 'static>() {}

    #[test]
    fn error_is_send_sync_static() {
        assert_good_error::<Error>();
    }

    #[test]
    fn retryability() {
        let key = LockKey::new("k").unwrap();
        assert!(Error::Timeout {
            key: key.clone(),
            waited: Duration::from_secs(1)
        }
        .is_retryable());
        assert!(Error::backend("memory", true, "refused").is_retryable());
        assert!(!Error::backend("memory", false, "no table").is_retryable());
        assert!(!Error::AlreadyHeld { key }.is_retryable());
        assert!(!Error::invalid_options("ttl").is_retryable());
    }

    #[test]
    fn messages_are_lowercase() {
        let key = LockKey::new("k").unwrap();
        let errors = [
            Error::Timeout {
                key: key.clone(),
                waited: Duration::from_millis(5),
            },
            Error::lease_lost(&key, FencingToken::new(3), "expired"),
            Error::AlreadyHeld { key },
            Error::InvalidKey {
                reason: "empty".into(),
            },
            Error::invalid_options("ttl is zero"),
            Error::config("bad url"),
            Error::Unsupported {
                backend: "memory",
                what: "durability".into(),
            },
            Error::backend("memory", true, "boom"),
        ];
        for e in errors {
            let msg = e.to_string();
            let first = msg.chars().next().unwrap();
            assert!(!first.is_uppercase(), "{msg}");
        }
    }

    #[test]
    fn connect_causes_come_from_kinds() {
        use std::io::{Error as Io, ErrorKind};
        let refused = Error::backend(
            "redis",
            true,
            Io::new(ErrorKind::ConnectionRefused, "os error 111"),
        );
        assert_eq!(
            refused.connecting("127.0.0.1:1").to_string(),
            "redis backend error: cannot connect to redis at 127.0.0.1:1: connection refused \
             (is the server running and reachable?)"
        );
        // A kind deeper in the chain counts; the message text never does.
        #[derive(Debug, thiserror::Error)]
        #[error("transport error")]
        struct Wrapper(#[source] Io);
        let nested = Error::backend("etcd", true, Wrapper(Io::new(ErrorKind::TimedOut, "x")));
        assert!(nested
            .connecting("h:2379")
            .to_string()
            .contains(": no answer in time ("));
        let elapsed = crate::no_answer("redis", "PING", Duration::from_secs(1));
        assert!(elapsed
            .connecting("h")
            .to_string()
            .contains(": no answer within 1s ("));
        let misleading = Error::backend(
            "redis",
            true,
            "connection refused? no: DNS lookup failed\nfor h",
        );
        let text = misleading.connecting("h").to_string();
        assert!(
            text.contains(": connection refused? no: DNS lookup failed for h ("),
            "{text}"
        );
        // Not retryable (authentication, configuration): unchanged.
        let auth = Error::backend("redis", false, "WRONGPASS");
        assert_eq!(
            auth.connecting("h").to_string(),
            "redis backend error: WRONGPASS"
        );
    }
}
