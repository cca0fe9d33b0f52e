//! Checking fencing tokens where the protected resource lives: in-process
//! fences, and the HTTP convention for services that accept fenced writes.
//!
//! A lock alone cannot stop a holder that was paused (GC, SIGSTOP, a slow
//! network) past its TTL: it wakes up still believing it holds the lock and
//! writes, while the next holder — granted a higher [`FencingToken`] — writes
//! too. The resource has to refuse the late write: it remembers the highest
//! token it has accepted and rejects lower ones. The check and the write must
//! be **one atomic step**; otherwise a writer that passed the check can still
//! land its write after a newer one.
//!
//! | the resource | the helper |
//! |---|---|
//! | rows in MySQL / MariaDB | `fenced_mysql::fence::Fence::check`, in the business transaction |
//! | rows in SQLite | `fenced_sqlite::fence::Fence::check`, in the business transaction |
//! | a value in Redis | `fenced_redis::fence::set` (one Lua script) |
//! | state in this process | [`Fenced`] (check and write under one mutex) |
//! | a service over HTTP | the headers below, with one of the above on the server |
//!
//! ```
//! use fenced_api::{fence::Fenced, FencingToken};
//!
//! let config = Fenced::new(String::from("v1"));
//! // The new holder (token 8) writes first …
//! config.write(FencingToken::new(8), |c| *c = "v2 from the new holder".into())?;
//! // … then the paused ex-holder (token 7) wakes up and tries: refused.
//! let late = config.write(FencingToken::new(7), |c| *c = "v2 from the ex-holder".into());
//! assert_eq!(late.unwrap_err().highest, FencingToken::new(8));
//! assert_eq!(config.read(|c| c.clone()), "v2 from the new holder");
//! # Ok::<(), fenced_api::fence::StaleToken>(())
//! ```
//!
//! # HTTP: fenced requests to a service
//!
//! A client holding a lock sends its token with every write it makes under
//! that lock; the service fences the write with one of the helpers above
//! (keyed by the lock key, or by whatever resource the key protects) and
//! answers:
//!
//! | request | response |
//! |---|---|
//! | [`TOKEN_HEADER`] `Fencing-Token: 1796033680636908` — the decimal token, 1 to 2^64 − 1 | |
//! | [`KEY_HEADER`] `Fencing-Key: order:1001` — the lock key the token belongs to (tokens of different keys are not comparable) | |
//! | token at least the highest seen for the key | the write's own success status (`200`, `204` …); the write happened |
//! | token lower than the highest seen | [`STATUS_STALE`] `409 Conflict` with [`HIGHEST_HEADER`] `Fencing-Highest-Token: <highest>`; nothing was written. The client must stop: its lease is gone, a newer holder exists. Do not retry with the same token |
//! | a fenced endpoint without the headers | [`STATUS_MISSING`] `428 Precondition Required` |
//! | a header that does not parse ([`parse_token`]), or token 0 | `400 Bad Request` |
//!
//! The key header names the fence; a service that fences one fixed resource
//! per endpoint may ignore it, but should then still refuse a request whose
//! key is not the one that endpoint expects. Header names are
//! case-insensitive in HTTP; the constants use the canonical spelling. A
//! `409` is the resource's answer, so it is never retried by proxies or by
//! the client; a timeout is not an answer — the write may or may not have
//! happened, and retrying it with the same token is safe (an equal token is
//! accepted).
//!
//! ```
//! use fenced_api::fence::{self, Fenced};
//!
//! // Inside a handler (any framework): the headers as `Option<&str>`.
//! fn put(doc: &Fenced<String>, token: Option<&str>, body: &str) -> (u16, Option<String>) {
//!     let Some(token) = token else {
//!         return (fence::STATUS_MISSING, None);
//!     };
//!     let Some(token) = fence::parse_token(token) else {
//!         return (400, None);
//!     };
//!     match doc.write(token, |d| *d = body.to_owned()) {
//!         Ok(()) => (204, None),
//!         // Sent back as `Fencing-Highest-Token: <highest>`.
//!         Err(stale) => (fence::STATUS_STALE, Some(stale.highest.to_string())),
//!     }
//! }
//! let doc = Fenced::new(String::new());
//! assert_eq!(put(&doc, Some("12"), "from the new holder"), (204, None));
//! assert_eq!(put(&doc, Some("11"), "from a paused ex-holder"), (409, Some("12".into())));
//! assert_eq!(put(&doc, Some("0"), "?"), (400, None));
//! assert_eq!(put(&doc, None, "?"), (428, None));
//! assert_eq!(doc.read(String::clone), "from the new holder");
//! ```

use std::{
    fmt,
    sync::{
        atomic::{AtomicU64, Ordering},
        Mutex,
    },
};

use crate::{Error, FencingToken, Result};

/// Request header carrying the writer's fencing token, in decimal.
pub const TOKEN_HEADER: &str = "Fencing-Token";

/// Request header naming the lock key the token was granted for.
pub const KEY_HEADER: &str = "Fencing-Key";

/// Response header of a refused write: the highest token the service has
/// accepted for the key.
pub const HIGHEST_HEADER: &str = "Fencing-Highest-Token";

/// The status of a refused (stale) write: `409 Conflict`.
pub const STATUS_STALE: u16 = 409;

/// The status of a request to a fenced endpoint without a token:
/// `428 Precondition Required`.
pub const STATUS_MISSING: u16 = 428;

/// Refuses token 0, which no store grants (tokens are ≥ 1): a fencing
/// helper given it was handed an unset token, not a lease's. Every helper
/// (SQL, Redis) checks this before any I/O.
///
/// # Errors
///
/// [`Error::InvalidOptions`] for token 0.
pub fn check_token(token: FencingToken) -> Result<()> {
    if token.get() == 0 {
        return Err(Error::invalid_options(
            "fencing token 0 is not a token any store grants (tokens are >= 1); pass the \
             lease's token",
        ));
    }
    Ok(())
}

/// Parses a [`TOKEN_HEADER`] value: a decimal number from 1 to 2^64 − 1,
/// surrounding spaces or tabs allowed (HTTP's optional whitespace), nothing
/// else — no sign, no leading `0`, no other base.
///
/// ```
/// use fenced_api::{fence::parse_token, FencingToken};
/// assert_eq!(parse_token(" 42 "), Some(FencingToken::new(42)));
/// for bad in ["", "0", "-1", "+1", "042", "4 2", "0x2a", "18446744073709551616"] {
///     assert_eq!(parse_token(bad), None, "{bad:?}");
/// }
/// ```
pub fn parse_token(value: &str) -> Option<FencingToken> {
    let digits = value.trim_matches([' ', '\t']);
    let canonical = !digits.is_empty()
        && digits.bytes().all(|b| b.is_ascii_digit())
        && !digits.starts_with('0');
    // `u64::from_str` alone would accept `+1` and leading zeros.
    canonical
        .then(|| digits.parse::<u64>().ok())
        .flatten()
        .map(FencingToken::new)
}

/// The verdict of a fencing check.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[must_use = "a stale token means the write must not happen"]
pub enum FenceOutcome {
    /// The token is at least the highest seen, which now records it.
    Accepted,
    /// A higher token was seen first: a newer holder exists, and the
    /// caller's write must not land.
    Stale {
        /// The highest token seen.
        highest: FencingToken,
    },
}

impl FenceOutcome {
    /// Whether the write may go ahead.
    pub fn is_accepted(self) -> bool {
        matches!(self, FenceOutcome::Accepted)
    }
}

/// The highest token seen, lock-free: an admission check.
///
/// [`check`](Self::check) raises the highest token atomically
/// (`fetch_max`) and answers whether the caller's token was current **at
/// that instant**. It does not order what the caller does next: two writers
/// with tokens 7 and 8 can both pass (7 first), and 7's write can still land
/// after 8's. Use it where that cannot matter — rejecting stale requests
/// early, or where the write is itself fenced again — and use [`Fenced`]
/// where the check must cover the write.
#[derive(Debug, Default)]
pub struct TokenFence {
    highest: AtomicU64,
}

impl TokenFence {
    /// A fence that has seen no token: it accepts any.
    pub const fn new() -> Self {
        TokenFence {
            highest: AtomicU64::new(0),
        }
    }

    /// Records `token` if it is the highest so far, and answers whether it
    /// is at least the highest seen (equal included: one holder writing
    /// twice).
    pub fn check(&self, token: FencingToken) -> FenceOutcome {
        let before = self.highest.fetch_max(token.get(), Ordering::AcqRel);
        if token.get() >= before {
            FenceOutcome::Accepted
        } else {
            FenceOutcome::Stale {
                highest: FencingToken::new(before),
            }
        }
    }

    /// The highest token seen, if any.
    pub fn highest(&self) -> Option<FencingToken> {
        match self.highest.load(Ordering::Acquire) {
            0 => None,
            t => Some(FencingToken::new(t)),
        }
    }
}

/// A refused write: the caller's token and the higher one seen first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StaleToken {
    /// The caller's token.
    pub token: FencingToken,
    /// The highest token seen.
    pub highest: FencingToken,
}

impl fmt::Display for StaleToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "stale fencing token {}: token {} was already seen; a newer holder exists",
            self.token, self.highest
        )
    }
}

impl std::error::Error for StaleToken {}

/// A value whose writes are fenced: each write runs only if its token is at
/// least the highest seen, and the check and the write happen under one
/// mutex, so an accepted write can never land after a newer one.
#[derive(Debug, Default)]
pub struct Fenced<T> {
    state: Mutex<(u64, T)>,
}

impl<T> Fenced<T> {
    /// A fenced `value` that has seen no token.
    pub const fn new(value: T) -> Self {
        Fenced {
            state: Mutex::new((0, value)),
        }
    }

    /// Runs `write` on the value if `token` is at least the highest seen
    /// (equal included), recording the token; otherwise runs nothing.
    ///
    /// # Errors
    ///
    /// [`StaleToken`] when a higher token was seen: the value is untouched.
    pub fn write<R>(
        &self,
        token: FencingToken,
        write: impl FnOnce(&mut T) -> R,
    ) -> Result<R, StaleToken> {
        // A panic in an earlier write leaves the value as that write left
        // it; the token was recorded before the write ran, so the fence
        // itself is intact.
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if token.get() < state.0 {
            return Err(StaleToken {
                token,
                highest: FencingToken::new(state.0),
            });
        }
        state.0 = token.get();
        Ok(write(&mut state.1))
    }

    /// Reads the value.
    pub fn read<R>(&self, read: impl FnOnce(&T) -> R) -> R {
        let state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        read(&state.1)
    }

    /// The highest token seen, if any.
    pub fn highest(&self) -> Option<FencingToken> {
        let state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        (state.0 > 0).then(|| FencingToken::new(state.0))
    }

    /// The value, consuming the fence.
    pub fn into_inner(self) -> T {
        self.state.into_inner().unwrap_or_else(|p| p.into_inner()).1
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;

    fn t(n: u64) -> FencingToken {
        FencingToken::new(n)
    }

    #[test]
    fn token_fence_accepts_current_and_equal_refuses_lower() {
        let f = TokenFence::new();
        assert_eq!(f.highest(), None);
        assert!(f.check(t(5)).is_accepted());
        assert!(f.check(t(5)).is_accepted());
        assert_eq!(f.check(t(4)), FenceOutcome::Stale { highest: t(5) });
        assert!(f.check(t(u64::MAX)).is_accepted());
        assert_eq!(f.highest(), Some(t(u64::MAX)));
    }

    #[test]
    fn fenced_refuses_stale_writes_and_leaves_the_value() {
        let v = Fenced::new(Vec::new());
        v.write(t(2), |v| v.push(2)).unwrap();
        v.write(t(2), |v| v.push(22)).unwrap();
        assert_eq!(
            v.write(t(1), |v| v.push(1)).unwrap_err(),
            StaleToken {
                token: t(1),
                highest: t(2)
            }
        );
        assert_eq!(v.highest(), Some(t(2)));
        assert_eq!(v.into_inner(), vec![2, 22]);
    }

    /// Threads with scrambled tokens: the accepted writes, in the order they
    /// ran, never go down, and the highest one is last.
    #[test]
    fn concurrent_writes_land_in_token_order() {
        let v = Arc::new(Fenced::new(Vec::new()));
        let threads: Vec<_> = (1..=64u64)
            .map(|n| (n * 37) % 64 + 1)
            .map(|n| {
                let v = v.clone();
                std::thread::spawn(move || {
                    let _ = v.write(t(n), |log| log.push(n));
                })
            })
            .collect();
        for th in threads {
            th.join().unwrap();
        }
        let log = v.read(Vec::clone);
        assert!(log.windows(2).all(|p| p[0] <= p[1]), "{log:?}");
        assert_eq!(log.last(), Some(&64));
    }

    #[test]
    fn headers_parse_strictly() {
        assert_eq!(parse_token("1"), Some(t(1)));
        assert_eq!(parse_token("\t18446744073709551615 "), Some(t(u64::MAX)));
        for bad in ["", " ", "0", "00", "01", "-5", "+5", "5a", "1e3", "5,6"] {
            assert_eq!(parse_token(bad), None, "{bad:?}");
        }
        assert_eq!(STATUS_STALE, 409);
        assert_eq!(HIGHEST_HEADER, "Fencing-Highest-Token");
    }
}
