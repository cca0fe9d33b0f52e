//! What a backend can truthfully promise, checked at start-up.

use std::time::Duration;

use crate::{Error, Result};

/// What a backend can promise. Declared by each backend, used by the
/// conformance suite to gate cases, and by applications at start-up through
/// [`Capabilities::require`], so that switching stores fails loudly at boot
/// rather than at the first contended request.
///
/// ```
/// use fenced_api::{Capabilities, DistributedLock, MemoryLock};
///
/// let lock = MemoryLock::new();
/// // An app that relies on FIFO hand-off and fencing checks it once at start-up:
/// lock.capabilities().require(&Capabilities::none().fifo(true).fencing(true))?;
/// // …and a store that forgets locks on restart is refused when durability is needed.
/// assert!(lock.capabilities().require(&Capabilities::none().durable(true)).is_err());
/// # Ok::<(), fenced_api::Error>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Capabilities {
    backend: &'static str,
    native_wait: bool,
    durable: bool,
    fifo: bool,
    transaction_scoped: bool,
    fencing: bool,
    reentrant: bool,
    min_ttl: Duration,
}

macro_rules! flags {
    ($($(#[$doc:meta])* $name:ident, $getter:ident;)*) => {
        $(
            $(#[$doc])*
            #[must_use]
            pub const fn $name(mut self, yes: bool) -> Self {
                self.$name = yes;
                self
            }

            #[doc = concat!("Whether `", stringify!($name), "` is declared.")]
            pub const fn $getter(&self) -> bool {
                self.$name
            }
        )*

        fn flag_list(&self) -> [(&'static str, bool); 6] {
            [$((stringify!($name), self.$name)),*]
        }
    };
}

impl Capabilities {
    /// No capability at all; start here and switch on what the backend does.
    pub const fn none() -> Self {
        Capabilities {
            backend: "unknown",
            native_wait: false,
            durable: false,
            fifo: false,
            transaction_scoped: false,
            fencing: false,
            reentrant: false,
            min_ttl: Duration::ZERO,
        }
    }

    /// Names the backend in `require` error messages.
    #[must_use]
    pub const fn backend(mut self, name: &'static str) -> Self {
        self.backend = name;
        self
    }

    /// The backend's name.
    pub const fn backend_name(&self) -> &'static str {
        self.backend
    }

    flags! {
        /// Waiters are woken by the store (watch, pub/sub, blocking statement),
        /// not only by polling.
        native_wait, has_native_wait;
        /// Locks and fencing counters survive a restart of the store.
        durable, is_durable;
        /// Waiters are granted the lock in arrival order.
        fifo, is_fifo;
        /// Offers a transaction-scoped API (business writes commit with the release).
        transaction_scoped, is_transaction_scoped;
        /// Fencing tokens strictly increase per key across every acquisition
        /// (while the store's data survives).
        fencing, has_fencing;
        /// The same owner can re-enter a key it holds, with a count.
        reentrant, is_reentrant;
    }

    /// The shortest TTL the store honours exactly (etcd leases, for example,
    /// are whole seconds with a minimum); shorter requests are rounded up and the
    /// effective TTL is reported in the lease.
    #[must_use]
    pub const fn min_ttl(mut self, ttl: Duration) -> Self {
        self.min_ttl = ttl;
        self
    }

    /// The declared minimum TTL.
    pub const fn get_min_ttl(&self) -> Duration {
        self.min_ttl
    }

    /// Checks that every capability switched on in `needed` is offered here.
    ///
    /// # Errors
    ///
    /// [`Error::Unsupported`] listing every missing capability, so one start-up
    /// check reports all of them.
    pub fn require(&self, needed: &Capabilities) -> Result<()> {
        let missing: Vec<&str> = needed
            .flag_list()
            .iter()
            .zip(self.flag_list())
            .filter(|((_, want), (_, have))| *want && !*have)
            .map(|((name, _), _)| *name)
            .collect();
        if missing.is_empty() {
            Ok(())
        } else {
            Err(Error::Unsupported {
                backend: self.backend,
                what: format!("the required capabilities: {}", missing.join(", ")),
            })
        }
    }
}

impl Default for Capabilities {
    fn default() -> Self {
        Self::none()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn require_lists_every_missing_flag() {
        let have = Capabilities::none().backend("x").fencing(true).fifo(true);
        have.require(&Capabilities::none()).unwrap();
        have.require(&Capabilities::none().fencing(true)).unwrap();
        let err = have
            .require(
                &Capabilities::none()
                    .durable(true)
                    .fencing(true)
                    .reentrant(true),
            )
            .unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains("durable") && msg.contains("reentrant"),
            "{msg}"
        );
        assert!(!msg.contains("fencing"), "{msg}");
        assert!(msg.contains("the x backend"), "{msg}");
    }

    #[test]
    fn getters() {
        let c = Capabilities::none()
            .native_wait(true)
            .transaction_scoped(true)
            .min_ttl(Duration::from_secs(2));
        assert!(c.has_native_wait() && c.is_transaction_scoped());
        assert!(!c.is_durable() && !c.is_fifo() && !c.has_fencing() && !c.is_reentrant());
        assert_eq!(c.get_min_ttl(), Duration::from_secs(2));
    }
}
