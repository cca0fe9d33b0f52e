//! The connection pool on the database file: the directory and the file
//! created if missing, WAL, the busy timeout, the sync mode, and the SQLite
//! version checked.

use std::time::Duration;

use fenced_api::{Error, Result};
use sqlx::{
    sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteSynchronous},
    Row, SqlitePool,
};

use crate::{
    config::{SqliteConfig, Synchronous},
    error,
};

/// Oldest SQLite with everything used here (`unixepoch('subsec')`: 3.42;
/// `STRICT` tables: 3.37; `RETURNING`: 3.35). The bundled library is newer.
const MIN_SQLITE: (u32, u32) = (3, 42);

/// Creates the directory and file if missing and opens a pool with WAL,
/// the busy timeout and the sync mode; checks the SQLite version.
pub(crate) async fn open(config: &SqliteConfig) -> Result<SqlitePool> {
    let path = &config.path;
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        tokio::fs::create_dir_all(dir)
            .await
            .map_err(|e| error::create_dir_failed(dir, e))?;
    }
    let options = SqliteConnectOptions::new()
        .filename(path)
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal)
        .synchronous(match config.synchronous {
            Synchronous::Full => SqliteSynchronous::Full,
            Synchronous::Normal => SqliteSynchronous::Normal,
        })
        .busy_timeout(config.busy_timeout);
    let pool_options = SqlitePoolOptions::new()
        .max_connections(config.max_connections)
        .min_connections(0)
        // Waiting for a pooled connection is bounded like waiting for the file.
        .acquire_timeout(config.busy_timeout + Duration::from_secs(1))
        // Connections to a local file do not go stale like sockets.
        .test_before_acquire(false);
    // Switching a new file to WAL needs an exclusive lock that SQLite does
    // not wait for (no busy handler): processes opening a fresh file
    // together get SQLITE_BUSY at once. Retry that within the busy timeout.
    let start = tokio::time::Instant::now();
    let mut pause = Duration::from_millis(2);
    let pool = loop {
        match pool_options.clone().connect_with(options.clone()).await {
            Ok(pool) => break pool,
            Err(e) if error::is_busy(&e) && start.elapsed() < config.busy_timeout => {
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(Duration::from_millis(50));
            }
            Err(e) => return Err(error::open_failed(path, e)),
        }
    };
    if let Err(e) = check_version(&pool).await {
        pool.close().await;
        return Err(e);
    }
    Ok(pool)
}

async fn check_version(pool: &SqlitePool) -> Result<()> {
    let version: String = sqlx::query("SELECT sqlite_version()")
        .fetch_one(pool)
        .await
        .map_err(error::map)?
        .try_get(0)
        .map_err(error::map)?;
    let mut parts = version.split('.').map(|p| p.parse::<u32>().unwrap_or(0));
    let found = (parts.next().unwrap_or(0), parts.next().unwrap_or(0));
    if found < MIN_SQLITE {
        return Err(Error::config(format!(
            "SQLite {version} is too old: fenced-sqlite needs {}.{} or newer \
             (build with sqlx's bundled SQLite, the `sqlite` feature)",
            MIN_SQLITE.0, MIN_SQLITE.1
        )));
    }
    Ok(())
}
