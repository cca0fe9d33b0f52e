//! Test support shared by the SQLite test binaries: the conformance harness
//! over one temporary database file per test process, private files for the
//! restart case, and a file held locked by another connection for C19.

#![allow(dead_code, unreachable_pub, clippy::unwrap_used, clippy::expect_used)]

use std::{
    path::{Path, PathBuf},
    sync::{Arc, Mutex, OnceLock},
    time::Duration,
};

use async_trait::async_trait;
use fenced_api::{DistributedLock, Error, Result};
use fenced_conformance::Harness;
use fenced_sqlite::SqliteLock;
use sqlx::{
    sqlite::{SqliteConnectOptions, SqliteLockingMode},
    ConnectOptions, Connection, SqliteConnection,
};

const DIR_PREFIX: &str = "fenced-sqlite-test-";

/// A directory unique to this test process, under the system temp dir.
/// Directories left by earlier test processes that are gone are removed.
pub fn run_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let tmp = std::env::temp_dir();
        remove_dead_run_dirs(&tmp);
        let dir = tmp.join(format!(
            "{DIR_PREFIX}{}-{}",
            std::process::id(),
            &uuid::Uuid::new_v4().simple().to_string()[..8]
        ));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    })
}

/// Linux only: a run directory whose process no longer exists is garbage.
fn remove_dead_run_dirs(tmp: &Path) {
    if !Path::new("/proc/self").exists() {
        return;
    }
    let Ok(entries) = std::fs::read_dir(tmp) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name
            .to_str()
            .and_then(|n| n.strip_prefix(DIR_PREFIX))
            .and_then(|rest| rest.split('-').next())
            .and_then(|pid| pid.parse::<u32>().ok())
        else {
            continue;
        };
        if !Path::new(&format!("/proc/{pid}")).exists() {
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
}

/// A fresh file name in this process's run directory.
pub fn fresh_file(tag: &str) -> PathBuf {
    run_dir().join(format!(
        "{tag}-{}.db",
        &uuid::Uuid::new_v4().simple().to_string()[..12]
    ))
}

/// The URL of `file` with `table` and extra parameters.
pub fn url_for(file: &Path, table: &str, extra: &str) -> String {
    format!("sqlite://{}?table={table}{extra}", file.display())
}

/// Opens a connection that takes SQLite's exclusive lock on `file` and keeps
/// it until dropped: every other connection then gets `SQLITE_BUSY`, readers
/// included. No other connection may have the file open when it is called.
pub async fn block_file(file: &Path) -> SqliteConnection {
    let mut conn = SqliteConnectOptions::new()
        .filename(file)
        .locking_mode(SqliteLockingMode::Exclusive)
        .connect()
        .await
        .unwrap();
    // The first write in exclusive locking mode takes the lock for good.
    sqlx::query("CREATE TABLE IF NOT EXISTS fenced_test_blocker (x INTEGER)")
        .execute(&mut conn)
        .await
        .unwrap();
    sqlx::query("INSERT INTO fenced_test_blocker VALUES (1)")
        .execute(&mut conn)
        .await
        .unwrap();
    conn
}

/// Opens a connection that holds SQLite's write lock on `file` (an open
/// `BEGIN IMMEDIATE` transaction) until dropped: writers get `SQLITE_BUSY`,
/// readers still read (WAL).
pub async fn hold_write_lock(file: &Path) -> SqliteConnection {
    let mut conn = SqliteConnectOptions::new()
        .filename(file)
        .connect()
        .await
        .unwrap();
    sqlx::query("BEGIN IMMEDIATE")
        .execute(&mut conn)
        .await
        .unwrap();
    conn
}

/// Runs the suite: every client is a separate `SqliteLock` (own pool) on one
/// file — the view of separate processes.
pub struct SqliteHarness {
    file: PathBuf,
    table: String,
    /// For private stores: every instance handed out, so a "restart" can
    /// close them all.
    opened: Option<Mutex<Vec<SqliteLock>>>,
    /// Connections keeping files locked for C19, until the harness is dropped.
    blockers: tokio::sync::Mutex<Vec<SqliteConnection>>,
    /// Removed on drop (private stores only).
    private_dir: Option<PathBuf>,
}

impl SqliteHarness {
    /// On this process's shared file, in the table `fenced_t`.
    pub async fn new() -> Self {
        SqliteHarness {
            file: run_dir().join("locks.db"),
            table: "fenced_t".into(),
            opened: None,
            blockers: tokio::sync::Mutex::new(Vec::new()),
            private_dir: None,
        }
    }

    pub fn url(&self) -> String {
        url_for(&self.file, &self.table, "")
    }

    pub fn file(&self) -> &Path {
        &self.file
    }

    pub async fn lock(&self) -> SqliteLock {
        SqliteLock::connect(&self.url()).await.unwrap()
    }

    fn track(&self, lock: &SqliteLock) {
        if let Some(opened) = &self.opened {
            opened.lock().unwrap().push(lock.clone());
        }
    }
}

impl Drop for SqliteHarness {
    fn drop(&mut self) {
        if let Some(dir) = &self.private_dir {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

/// The busy timeout of the C19 client: the bound within which it must fail.
const UNREACHABLE_BUSY: Duration = Duration::from_secs(1);

#[async_trait]
impl Harness for SqliteHarness {
    async fn client(&self) -> Result<Arc<dyn DistributedLock>> {
        let lock = SqliteLock::connect(&self.url()).await?;
        self.track(&lock);
        Ok(Arc::new(lock))
    }

    async fn client_in_namespace(&self, suffix: &str) -> Result<Arc<dyn DistributedLock>> {
        let clean: String = suffix
            .chars()
            .map(|c| match c {
                'a'..='z' | '0'..='9' => c,
                'A'..='Z' => c.to_ascii_lowercase(),
                _ => '_',
            })
            .collect();
        let table = format!("{}_{clean}", self.table);
        let lock = SqliteLock::connect(&url_for(&self.file, &table, "")).await?;
        self.track(&lock);
        Ok(Arc::new(lock))
    }

    /// SQLite lives on this host and cannot be "unreachable"; the nearest
    /// equivalent is a file another process keeps exclusively locked, so
    /// every statement hits `SQLITE_BUSY` once the busy timeout passes.
    async fn unreachable_client(&self) -> Option<Result<Arc<dyn DistributedLock>>> {
        let file = fresh_file("unreachable");
        let url = url_for(&file, &self.table, "");
        // Create the file and table, then close: exclusive locking mode
        // needs every other connection to the file gone.
        match SqliteLock::connect(&url).await {
            Ok(setup) => setup.close().await,
            Err(e) => return Some(Err(e)),
        }
        self.blockers.lock().await.push(block_file(&file).await);
        Some(
            SqliteLock::builder(&url)
                .map(|b| b.busy_timeout(UNREACHABLE_BUSY))
                .unwrap()
                .connect()
                .await
                .map(|l| Arc::new(l) as Arc<dyn DistributedLock>),
        )
    }

    fn connect_timeout(&self) -> Duration {
        UNREACHABLE_BUSY
    }

    /// A "restart" of an embedded store: every connection to the file is
    /// closed — SQLite then checkpoints and deletes the write-ahead log —
    /// and later clients reopen the file from disk.
    async fn restart_store(&self) -> Option<Result<()>> {
        let opened = self.opened.as_ref()?;
        let locks: Vec<SqliteLock> = std::mem::take(&mut *opened.lock().unwrap());
        for lock in &locks {
            lock.close().await;
        }
        let wal = PathBuf::from(format!("{}-wal", self.file.display()));
        if wal.exists() {
            return Some(Err(Error::backend(
                "sqlite-test",
                false,
                format!(
                    "{} still exists after closing every connection: something keeps the file open",
                    wal.display()
                ),
            )));
        }
        Some(Ok(()))
    }

    async fn private_store(&self) -> Option<Result<Box<dyn Harness>>> {
        let dir = run_dir().join(format!(
            "private-{}",
            &uuid::Uuid::new_v4().simple().to_string()[..12]
        ));
        Some(Ok(Box::new(SqliteHarness {
            file: dir.join("locks.db"),
            table: "fenced_private".into(),
            opened: Some(Mutex::new(Vec::new())),
            blockers: tokio::sync::Mutex::new(Vec::new()),
            private_dir: Some(dir),
        })))
    }

    /// One second, as for the server stores. A renewal must commit on a
    /// file the other running cases write too, and a commit can stall for
    /// a few hundred milliseconds (its fsync with `synchronous=full`, or an
    /// unfair turn at the write lock): 500 ms leaves a renewal about 333 ms,
    /// too little margin for such a stall (C13 can lose a renewed lock).
    fn base_ttl(&self) -> Duration {
        Duration::from_secs(1)
    }
}

/// Closes a connection taken by [`block_file`].
pub async fn unblock(conn: SqliteConnection) {
    conn.close().await.unwrap();
}
