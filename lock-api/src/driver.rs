//! The entry a backend crate contributes to the `fenced::connect(url)` registry.

use std::{fmt, future::Future, pin::Pin, sync::Arc};

use crate::{DistributedLock, Result};

/// A boxed future returned by driver functions.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// A driver's connect function: URL in, store out.
pub type ConnectFn = fn(String) -> BoxFuture<'static, Result<Arc<dyn DistributedLock>>>;

/// A driver's migrate function: URL in, schema created or upgraded.
pub type MigrateFn = fn(String) -> BoxFuture<'static, Result<()>>;

/// How the facade turns a URL into a store: one value per backend crate,
/// returned by its `driver()` function. No global registration — the facade
/// keeps an explicit list of the drivers compiled in.
#[derive(Clone, Copy)]
pub struct Driver {
    /// The backend's name, which is also the facade's cargo feature (`mysql`).
    pub name: &'static str,
    /// The URL schemes it serves (`mysql`, `mariadb`).
    pub schemes: &'static [&'static str],
    /// Connects to the store named by the URL.
    pub connect: ConnectFn,
    /// Creates or upgrades the store's schema (SQL stores); `None` when the
    /// store needs no schema.
    pub migrate: Option<MigrateFn>,
}

impl Driver {
    /// A connect function's body: `connect: |url| Driver::boxed(async move {
    /// MyLock::connect(&url).await })` turns the backend's own `connect`
    /// into the shared store type.
    pub fn boxed<L: DistributedLock + 'static>(
        connect: impl Future<Output = Result<L>> + Send + 'static,
    ) -> BoxFuture<'static, Result<Arc<dyn DistributedLock>>> {
        Box::pin(async move { Ok(Arc::new(connect.await?) as Arc<dyn DistributedLock>) })
    }

    /// Whether this driver serves `url` (by its scheme, before `://`).
    pub fn serves(&self, url: &str) -> bool {
        url.split_once("://")
            .is_some_and(|(scheme, _)| self.schemes.contains(&scheme))
    }
}

impl fmt::Debug for Driver {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Driver")
            .field("name", &self.name)
            .field("schemes", &self.schemes)
            .field("migrate", &self.migrate.is_some())
            .finish()
    }
}
