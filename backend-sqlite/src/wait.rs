//! How waiters wait. SQLite cannot tell a connection that a row went away,
//! so a waiter polls `try_acquire` with backoff and jitter
//! ([`fenced_api::wait::Polling`]); releases through any [`SqliteLock`] of
//! this process on the same file and table wake its waiters at once.
//!
//! [`SqliteLock`]: crate::SqliteLock

use fenced_api::wait::Polling;

use crate::config::SqliteConfig;

/// The waiting of one store handle. Its scope names the file (canonical,
/// however the path was spelled) and the table, so handles on one namespace
/// share one line of waiters and one release signal.
pub(crate) async fn polling(config: &SqliteConfig) -> Polling {
    let file = tokio::fs::canonicalize(&config.path)
        .await
        .unwrap_or_else(|_| config.path.clone());
    Polling::new(format!("sqlite://{}#{}", file.display(), config.table))
}
