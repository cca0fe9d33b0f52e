//! [`SafetyMargin`]: how long before a lease's deadline a guard gives up.

use std::time::Duration;

use crate::{Error, Result};

/// How long before a lease's own deadline a [`LockGuard`](crate::LockGuard) gives it up:
/// `max(ttl × drift, floor)`, at most a quarter of the TTL.
///
/// A lease's deadline on the client is its TTL counted from when the
/// granting (or renewing) request was *sent*, so it never falls after the
/// store's expiry on account of the network. Two things can still put it
/// after that expiry, and the margin covers both:
///
/// * **Clock-rate drift.** The store measures the TTL with its clock, the
///   client with its own; crystal oscillators differ by up to ~100 ppm and
///   NTP slews a clock by up to 500 ppm. The default drift, 1 %, is twenty
///   times that, for virtual machines whose clocks are steered in jumps
///   (the same factor Redlock uses).
/// * **Reaction time.** Between the deadline and the moment the work has
///   really stopped lie a timer firing on a busy runtime, the loss signal
///   reaching the work, and — for `fenced run` — a signal to the command and
///   the kernel ending it. The default floor, 100 ms, is several times the
///   scheduling delays seen on a loaded two-core machine.
///
/// The cap of a quarter of the TTL keeps room for renewals (sent every
/// third of the TTL) with very short TTLs, where the floor alone would
/// leave none: below 400 ms the margin is `ttl / 4`.
///
/// ```
/// use std::time::Duration;
/// use fenced_api::SafetyMargin;
///
/// let m = SafetyMargin::default();
/// assert_eq!(m.for_ttl(Duration::from_secs(30)), Duration::from_millis(300));
/// assert_eq!(m.for_ttl(Duration::from_secs(2)), Duration::from_millis(100));
/// assert_eq!(m.for_ttl(Duration::from_millis(200)), Duration::from_millis(50));
/// assert!(SafetyMargin::new(0.6, Duration::ZERO).is_err());
/// # Ok::<(), fenced_api::Error>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SafetyMargin {
    drift: f64,
    floor: Duration,
}

impl SafetyMargin {
    /// 1 % of the TTL, at least 100 ms (see the type's docs for why).
    pub const DEFAULT: SafetyMargin = SafetyMargin {
        drift: 0.01,
        floor: Duration::from_millis(100),
    };

    /// No margin: the guard gives up exactly at the lease's deadline, when
    /// the store may already be granting the key to someone else. For
    /// tests that need the bare lease timing.
    pub const NONE: SafetyMargin = SafetyMargin {
        drift: 0.0,
        floor: Duration::ZERO,
    };

    /// A margin of `drift` × TTL, at least `floor` (and at most a quarter of
    /// the TTL).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidOptions`] if `drift` is not a number from 0 to 0.25.
    pub fn new(drift: f64, floor: Duration) -> Result<Self> {
        if !(0.0..=0.25).contains(&drift) {
            return Err(Error::invalid_options(format!(
                "the clock drift {drift} must be from 0 to 0.25 (0.01 is 1 %)"
            )));
        }
        Ok(SafetyMargin { drift, floor })
    }

    /// The margin for a lease of this TTL.
    pub fn for_ttl(&self, ttl: Duration) -> Duration {
        ttl.mul_f64(self.drift).max(self.floor).min(ttl / 4)
    }
}

impl Default for SafetyMargin {
    fn default() -> Self {
        SafetyMargin::DEFAULT
    }
}
