//! Per-acquisition options: TTL, wait policy, owner, reentrancy.

use std::{fmt, sync::Arc, time::Duration};

use crate::{Error, LockKey, Result};

/// How long `acquire` may wait for a held key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum WaitPolicy {
    /// Try once and fail with [`Error::Timeout`] (waited 0) if the key is held.
    NoWait,
    /// Wait up to this long, then fail with [`Error::Timeout`].
    ///
    /// Bounds too large to add to a clock reading are treated as [`WaitPolicy::Forever`].
    Timeout(Duration),
    /// Wait until the lock is granted. Still cancellable: drop the future.
    #[default]
    Forever,
}

/// The identity of a lock holder: the value stores compare on release and extend.
///
/// Generated for every acquisition unless given explicitly: 128 bits from the
/// operating system's CSPRNG as 32 lowercase hex digits ([`Owner::random`]).
/// Give one explicitly only for cross-process reentrancy or to make
/// [`inspect`](crate::DistributedLock::inspect) output readable; it must then be
/// unique per logical holder, or two holders would pass each other's owner check.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct Owner(Arc<str>);

impl Owner {
    /// Longest owner accepted, in bytes.
    pub const MAX_LEN: usize = 128;

    /// Validates an explicit owner.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidOptions`] if it is empty, longer than [`Owner::MAX_LEN`]
    /// bytes or contains control characters.
    pub fn new(owner: impl AsRef<str>) -> Result<Self> {
        let owner = owner.as_ref();
        check_name("the owner", owner, Self::MAX_LEN)?;
        Ok(Owner(Arc::from(owner)))
    }

    /// A fresh random owner: 128 bits from the operating system's CSPRNG,
    /// as 32 lowercase hex digits. The owner is the capability to extend
    /// and release a lock (see SECURITY.md), so it must not be guessable.
    pub fn random() -> Self {
        let mut bytes = [0u8; 16];
        if getrandom::fill(&mut bytes).is_err() {
            // No OS entropy at all (never seen on a supported platform):
            // a v4 UUID still carries 122 random bits.
            bytes = uuid::Uuid::new_v4().into_bytes();
        }
        Owner(Arc::from(
            uuid::Uuid::from_bytes(bytes).simple().to_string(),
        ))
    }

    /// The owner as a string.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for Owner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for Owner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&*self.0, f)
    }
}

/// A human-readable name for a holder — `web-3:4242`, `nightly-report` —
/// stored beside the owner and shown by [`inspect`](crate::DistributedLock::inspect),
/// [`list`](crate::DistributedLock::list) and `fenced status`.
///
/// Unlike the [`Owner`], a label is not a capability and carries no
/// meaning for the store: it is there so that an operator can tell who holds
/// a key. Several holders may share a label. [`LockClient`](crate::LockClient)
/// labels every acquisition with its own label, by default
/// [`Label::host_pid`].
///
/// ```
/// use fenced_api::Label;
/// let label = Label::new("billing-worker-2")?;
/// assert_eq!(label.as_str(), "billing-worker-2");
/// assert!(Label::new("two\nlines").is_err());
/// # Ok::<(), fenced_api::Error>(())
/// ```
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct Label(Arc<str>);

impl Label {
    /// Longest label accepted, in bytes.
    pub const MAX_LEN: usize = 128;

    /// Validates a label.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidOptions`] if it is empty, longer than [`Label::MAX_LEN`]
    /// bytes or contains control characters.
    pub fn new(label: impl AsRef<str>) -> Result<Self> {
        let label = label.as_ref();
        check_name("the holder label", label, Self::MAX_LEN)?;
        Ok(Label(Arc::from(label)))
    }

    /// `host:pid` of this process: the host name (`/proc/sys/kernel/hostname`,
    /// else `$HOSTNAME`, else `localhost`) and the process id. What
    /// [`LockClient`](crate::LockClient) and `fenced run` label holds with
    /// unless told otherwise.
    pub fn host_pid() -> Self {
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .ok()
            .or_else(|| std::env::var("HOSTNAME").ok())
            .map(|h| h.trim().to_owned())
            .filter(|h| !h.is_empty() && !h.chars().any(char::is_control))
            .unwrap_or_else(|| "localhost".to_owned());
        let pid = std::process::id();
        // A host name is at most 64 bytes on Linux; cut on a char boundary
        // anyway so that an odd one can never make the label invalid.
        let mut host = host.as_str();
        while host.len() > Self::MAX_LEN - 11 {
            let mut end = host.len() - 1;
            while !host.is_char_boundary(end) {
                end -= 1;
            }
            host = &host[..end];
        }
        Label(Arc::from(format!("{host}:{pid}")))
    }

    /// The label as a string.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for Label {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for Label {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&*self.0, f)
    }
}

/// The rules owners and labels share: not empty, at most `max` bytes, no
/// control characters (they end up in logs, tables and terminals).
fn check_name(what: &str, name: &str, max: usize) -> Result<()> {
    if name.is_empty() {
        return Err(Error::invalid_options(format!("{what} is empty")));
    }
    if name.len() > max {
        return Err(Error::invalid_options(format!(
            "{what} is {} bytes long; the maximum is {max}",
            name.len()
        )));
    }
    if name.chars().any(char::is_control) {
        return Err(Error::invalid_options(format!(
            "{what} contains control characters"
        )));
    }
    Ok(())
}

/// Options for one acquisition. Always valid: build them with
/// [`LockOptions::builder`], which checks every bound before any I/O.
///
/// ```
/// use std::time::Duration;
/// use fenced_api::{LockOptions, WaitPolicy};
///
/// let opts = LockOptions::builder()
///     .ttl(Duration::from_secs(10))
///     .wait(WaitPolicy::Timeout(Duration::from_secs(3)))
///     .build()?;
/// assert_eq!(opts.ttl(), Duration::from_secs(10));
///
/// // A TTL of zero is rejected before reaching any store.
/// assert!(LockOptions::builder().ttl(Duration::ZERO).build().is_err());
/// # Ok::<(), fenced_api::Error>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LockOptions {
    ttl: Duration,
    wait: WaitPolicy,
    owner: Option<Owner>,
    label: Option<Label>,
    reentrant: bool,
}

impl LockOptions {
    /// What a store without owner reentrancy answers an acquire whose
    /// explicit owner (these options') already holds `key`: `AlreadyHeld`,
    /// or `Unsupported` when re-entry was asked for (through `LockClient`,
    /// per task, it works on every store).
    pub fn refuse_reentry(&self, backend: &'static str, key: &LockKey) -> Error {
        if self.is_reentrant() {
            Error::Unsupported {
                backend,
                what: "owner reentrancy (use LockClient::builder(..).reentrant(true))".into(),
            }
        } else {
            Error::AlreadyHeld { key: key.clone() }
        }
    }

    /// TTL used when none is given: 30 s (with the default watchdog, renewed every 10 s).
    pub const DEFAULT_TTL: Duration = Duration::from_secs(30);
    /// Shortest TTL accepted: 10 ms. Anything shorter is below a network round trip.
    /// Backends with a coarser clock round up and report the effective TTL in the lease.
    pub const MIN_TTL: Duration = Duration::from_millis(10);
    /// Longest TTL accepted: 24 h. Longer "locks" are configuration, not leases;
    /// and huge values overflow stores (Redis has expired keys at once on
    /// overflowing `PX`, `DATE_ADD` overflows to `NULL`).
    pub const MAX_TTL: Duration = Duration::from_secs(24 * 60 * 60);

    /// Default options: 30 s TTL, wait forever, generated owner, not reentrant.
    pub fn new() -> Self {
        LockOptions {
            ttl: Self::DEFAULT_TTL,
            wait: WaitPolicy::Forever,
            owner: None,
            label: None,
            reentrant: false,
        }
    }

    /// Starts a builder from the defaults.
    pub fn builder() -> LockOptionsBuilder {
        LockOptionsBuilder {
            ttl: Self::DEFAULT_TTL,
            wait: WaitPolicy::Forever,
            owner: None,
            label: None,
            reentrant: false,
        }
    }

    /// Starts a builder from these options, to change some of them.
    pub fn to_builder(&self) -> LockOptionsBuilder {
        LockOptionsBuilder {
            ttl: self.ttl,
            wait: self.wait,
            owner: self.owner.as_ref().map(|o| o.as_str().to_owned()),
            label: self.label.as_ref().map(|l| l.as_str().to_owned()),
            reentrant: self.reentrant,
        }
    }

    /// How long the lock lives without renewal, measured on the store's clock.
    pub fn ttl(&self) -> Duration {
        self.ttl
    }

    /// The wait policy honoured by `acquire` (ignored by `try_acquire`).
    pub fn wait(&self) -> WaitPolicy {
        self.wait
    }

    /// The explicit owner, if one was given.
    pub fn owner(&self) -> Option<&Owner> {
        self.owner.as_ref()
    }

    /// The holder's label, if one was given: stored with the lock and shown
    /// by `inspect` (see [`Label`]).
    pub fn label(&self) -> Option<&Label> {
        self.label.as_ref()
    }

    /// Whether the same owner may re-enter a key it holds (counted).
    pub fn is_reentrant(&self) -> bool {
        self.reentrant
    }

    /// The owner to use for an acquisition: the explicit one, or a fresh random one.
    pub fn owner_or_random(&self) -> Owner {
        self.owner.clone().unwrap_or_else(Owner::random)
    }

    /// Checks a TTL against [`LockOptions::MIN_TTL`]..=[`LockOptions::MAX_TTL`].
    /// Backends call it on `extend` before any I/O.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidOptions`] naming the bound that was crossed.
    pub fn validate_ttl(ttl: Duration) -> Result<Duration> {
        if ttl.is_zero() {
            return Err(Error::invalid_options(
                "the ttl is zero; a lock needs a lifetime (e.g. 30s)",
            ));
        }
        if ttl < Self::MIN_TTL {
            return Err(Error::invalid_options(format!(
                "the ttl {ttl:?} is below the minimum {:?}",
                Self::MIN_TTL
            )));
        }
        if ttl > Self::MAX_TTL {
            return Err(Error::invalid_options(format!(
                "the ttl {ttl:?} is above the maximum {:?}; hold long jobs with a shorter ttl and renewal",
                Self::MAX_TTL
            )));
        }
        Ok(ttl)
    }
}

impl Default for LockOptions {
    fn default() -> Self {
        Self::new()
    }
}

/// Builder for [`LockOptions`]; [`build`](LockOptionsBuilder::build) validates.
#[derive(Debug, Clone)]
#[must_use]
pub struct LockOptionsBuilder {
    ttl: Duration,
    wait: WaitPolicy,
    owner: Option<String>,
    label: Option<String>,
    reentrant: bool,
}

impl LockOptionsBuilder {
    /// Lease lifetime without renewal (default 30 s).
    pub fn ttl(mut self, ttl: Duration) -> Self {
        self.ttl = ttl;
        self
    }

    /// Wait policy for `acquire` (default [`WaitPolicy::Forever`]).
    pub fn wait(mut self, wait: WaitPolicy) -> Self {
        self.wait = wait;
        self
    }

    /// Shorthand for `wait(WaitPolicy::Timeout(d))`.
    pub fn wait_timeout(self, d: Duration) -> Self {
        self.wait(WaitPolicy::Timeout(d))
    }

    /// An explicit owner identity (default: random per acquisition).
    pub fn owner(mut self, owner: impl Into<String>) -> Self {
        self.owner = Some(owner.into());
        self
    }

    /// Whether the same owner may re-enter a key it already holds (default false:
    /// re-acquiring fails at once with [`Error::AlreadyHeld`]).
    pub fn reentrant(mut self, reentrant: bool) -> Self {
        self.reentrant = reentrant;
        self
    }

    /// A human-readable holder label stored with the lock (default none;
    /// see [`Label`]).
    pub fn label(mut self, label: impl Into<String>) -> Self {
        self.label = Some(label.into());
        self
    }

    /// Validates and builds.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidOptions`] for a TTL outside the bounds, an invalid
    /// owner or an invalid label.
    pub fn build(self) -> Result<LockOptions> {
        let ttl = LockOptions::validate_ttl(self.ttl)?;
        let owner = self.owner.map(Owner::new).transpose()?;
        let label = self.label.map(Label::new).transpose()?;
        Ok(LockOptions {
            ttl,
            wait: self.wait,
            owner,
            label,
            reentrant: self.reentrant,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_valid() {
        let o = LockOptions::default();
        assert_eq!(o.ttl(), LockOptions::DEFAULT_TTL);
        assert_eq!(o.wait(), WaitPolicy::Forever);
        assert!(o.owner().is_none());
        assert!(!o.is_reentrant());
        assert_eq!(LockOptions::builder().build().unwrap(), o);
    }

    #[test]
    fn ttl_bounds() {
        for bad in [
            Duration::ZERO,
            Duration::from_millis(9),
            LockOptions::MAX_TTL + Duration::from_nanos(1),
            Duration::MAX,
        ] {
            let err = LockOptions::builder().ttl(bad).build().unwrap_err();
            assert!(
                matches!(err, Error::InvalidOptions { .. }),
                "{bad:?}: {err}"
            );
        }
        for good in [
            LockOptions::MIN_TTL,
            Duration::from_secs(1),
            LockOptions::MAX_TTL,
        ] {
            assert_eq!(
                LockOptions::builder().ttl(good).build().unwrap().ttl(),
                good
            );
        }
    }

    #[test]
    fn owner_rules() {
        assert!(LockOptions::builder().owner("").build().is_err());
        assert!(LockOptions::builder()
            .owner("x".repeat(129))
            .build()
            .is_err());
        assert!(LockOptions::builder().owner("a\nb").build().is_err());
        let o = LockOptions::builder().owner("node-1").build().unwrap();
        assert_eq!(o.owner().unwrap().as_str(), "node-1");
        assert_eq!(o.owner_or_random().as_str(), "node-1");
        let r = LockOptions::default();
        assert_ne!(r.owner_or_random(), r.owner_or_random());
        // 128 bits as 32 lowercase hex digits.
        let random = r.owner_or_random();
        assert!(
            random.as_str().len() == 32
                && random
                    .as_str()
                    .bytes()
                    .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)),
            "{random}"
        );
    }

    #[test]
    fn to_builder_round_trips() {
        let o = LockOptions::builder()
            .ttl(Duration::from_secs(5))
            .wait_timeout(Duration::from_secs(1))
            .owner("me")
            .label("host-1:42")
            .reentrant(true)
            .build()
            .unwrap();
        assert_eq!(o.to_builder().build().unwrap(), o);
        assert_eq!(o.label().unwrap().as_str(), "host-1:42");
    }

    #[test]
    fn label_rules() {
        assert!(Label::new("").is_err());
        assert!(Label::new("x".repeat(129)).is_err());
        assert!(Label::new("a\tb").is_err());
        assert!(LockOptions::builder().label("a\nb").build().is_err());
        assert_eq!(Label::new("web-1 (eu)").unwrap().as_str(), "web-1 (eu)");
        let own = Label::host_pid();
        assert!(own.as_str().ends_with(&format!(":{}", std::process::id())));
        assert!(Label::new(own.as_str()).is_ok());
    }
}
