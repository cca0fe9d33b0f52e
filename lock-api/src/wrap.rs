//! Stores built around another store: change a few calls, forward the rest.

use std::time::Duration;

use async_trait::async_trait;
use tokio_util::sync::CancellationToken;

use crate::{
    Capabilities, DistributedLock, Lease, LockInfo, LockKey, LockOptions, ReleaseOutcome, Result,
};

/// A store that wraps another one: implement [`inner`](WrapLock::inner)
/// and override only the calls that differ; every other call goes to the
/// inner store unchanged; [`wrap_lock!`](crate::wrap_lock) makes the
/// type a [`DistributedLock`].
///
/// For instrumentation (count or log calls), read-only views, and test
/// doubles that break one thing on purpose.
///
/// Name the trait by its path in the `impl` (`impl fenced_api::WrapLock for
/// …`) rather than importing it: with both traits in scope a call such as
/// `store.try_acquire(…)` would be ambiguous between them.
///
/// ```
/// use std::sync::atomic::{AtomicUsize, Ordering};
/// use fenced_api::{async_trait, DistributedLock, Lease, LockKey, LockOptions, MemoryLock, Result};
///
/// /// Counts the grants of the store it wraps.
/// #[derive(Debug, Default)]
/// struct Counted { inner: MemoryLock, grants: AtomicUsize }
///
/// #[async_trait]
/// impl fenced_api::WrapLock for Counted {
///     fn inner(&self) -> &dyn DistributedLock { &self.inner }
///     async fn try_acquire(&self, key: &LockKey, opts: &LockOptions) -> Result<Option<Lease>> {
///         let lease = self.inner.try_acquire(key, opts).await?;
///         self.grants.fetch_add(usize::from(lease.is_some()), Ordering::Relaxed);
///         Ok(lease)
///     }
/// }
/// fenced_api::wrap_lock!(Counted);
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<()> {
/// let store = Counted::default();
/// let lease = store.try_acquire(&LockKey::new("job")?, &LockOptions::default()).await?;
/// assert!(lease.is_some());
/// assert_eq!(store.grants.load(Ordering::Relaxed), 1);
/// # Ok(()) }
/// ```
#[async_trait]
pub trait WrapLock: Send + Sync + std::fmt::Debug {
    /// The store every call not overridden goes to.
    fn inner(&self) -> &dyn DistributedLock;

    /// [`DistributedLock::try_acquire`]; forwards by default.
    async fn try_acquire(&self, key: &LockKey, opts: &LockOptions) -> Result<Option<Lease>> {
        self.inner().try_acquire(key, opts).await
    }

    /// [`DistributedLock::acquire`]; forwards by default.
    async fn acquire(&self, key: &LockKey, opts: &LockOptions) -> Result<Lease> {
        self.inner().acquire(key, opts).await
    }

    /// [`DistributedLock::extend`]; forwards by default.
    async fn extend(&self, lease: &Lease, ttl: Duration) -> Result<Lease> {
        self.inner().extend(lease, ttl).await
    }

    /// [`DistributedLock::extend_many`]; forwards by default.
    async fn extend_many(&self, leases: &[Lease], ttl: Duration) -> Vec<Result<Lease>> {
        self.inner().extend_many(leases, ttl).await
    }

    /// [`DistributedLock::release`]; forwards by default.
    async fn release(&self, lease: &Lease) -> Result<ReleaseOutcome> {
        self.inner().release(lease).await
    }

    /// [`DistributedLock::inspect`]; forwards by default.
    async fn inspect(&self, key: &LockKey) -> Result<Option<LockInfo>> {
        self.inner().inspect(key).await
    }

    /// [`DistributedLock::force_release`]; forwards by default.
    async fn force_release(&self, key: &LockKey) -> Result<bool> {
        self.inner().force_release(key).await
    }

    /// [`DistributedLock::list`]; forwards by default.
    async fn list(&self, limit: usize) -> Result<Vec<LockInfo>> {
        self.inner().list(limit).await
    }

    /// [`DistributedLock::loss_signal`]; forwards by default.
    fn loss_signal(&self, lease: &Lease) -> Option<CancellationToken> {
        self.inner().loss_signal(lease)
    }

    /// [`DistributedLock::capabilities`]; forwards by default.
    fn capabilities(&self) -> Capabilities {
        self.inner().capabilities()
    }

    /// [`DistributedLock::semaphores`]; by default the inner store's, which
    /// the overrides above do not touch: a wrapper that must change
    /// semaphores too overrides this.
    fn semaphores(&self) -> Option<std::sync::Arc<dyn crate::SemaphoreStore>> {
        self.inner().semaphores()
    }
}

/// Makes a [`WrapLock`] type a [`DistributedLock`] (every call goes to its
/// `WrapLock` methods): `fenced_api::wrap_lock!(MyWrapper);`.
///
/// A macro rather than a blanket impl, so that `Box<dyn DistributedLock>`
/// and `Arc<…>` stay locks too.
#[macro_export]
macro_rules! wrap_lock {
    ($($ty:ty),+ $(,)?) => {$(
        #[deny(clippy::missing_trait_methods)]
        #[$crate::async_trait]
        impl $crate::DistributedLock for $ty {
            async fn try_acquire(
                &self,
                key: &$crate::LockKey,
                opts: &$crate::LockOptions,
            ) -> $crate::Result<Option<$crate::Lease>> {
                $crate::WrapLock::try_acquire(self, key, opts).await
            }
            async fn acquire(
                &self,
                key: &$crate::LockKey,
                opts: &$crate::LockOptions,
            ) -> $crate::Result<$crate::Lease> {
                $crate::WrapLock::acquire(self, key, opts).await
            }
            async fn extend(
                &self,
                lease: &$crate::Lease,
                ttl: ::std::time::Duration,
            ) -> $crate::Result<$crate::Lease> {
                $crate::WrapLock::extend(self, lease, ttl).await
            }
            async fn extend_many(
                &self,
                leases: &[$crate::Lease],
                ttl: ::std::time::Duration,
            ) -> Vec<$crate::Result<$crate::Lease>> {
                $crate::WrapLock::extend_many(self, leases, ttl).await
            }
            async fn release(&self, lease: &$crate::Lease) -> $crate::Result<$crate::ReleaseOutcome> {
                $crate::WrapLock::release(self, lease).await
            }
            async fn inspect(&self, key: &$crate::LockKey) -> $crate::Result<Option<$crate::LockInfo>> {
                $crate::WrapLock::inspect(self, key).await
            }
            async fn force_release(&self, key: &$crate::LockKey) -> $crate::Result<bool> {
                $crate::WrapLock::force_release(self, key).await
            }
            async fn list(&self, limit: usize) -> $crate::Result<Vec<$crate::LockInfo>> {
                $crate::WrapLock::list(self, limit).await
            }
            fn loss_signal(
                &self,
                lease: &$crate::Lease,
            ) -> Option<$crate::CancellationToken> {
                $crate::WrapLock::loss_signal(self, lease)
            }
            fn capabilities(&self) -> $crate::Capabilities {
                $crate::WrapLock::capabilities(self)
            }
            fn semaphores(
                &self,
            ) -> Option<::std::sync::Arc<dyn $crate::SemaphoreStore>> {
                $crate::WrapLock::semaphores(self)
            }
        }
    )+};
}
