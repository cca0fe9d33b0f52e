//! SQLite-specific behaviour beyond the shared suite: separate processes
//! contending on one file, a killed holder process, tokens across reopening
//! and deleted rows, busy files, paths that cannot be created, injection-safe
//! table names, the per-user default store, schema creation.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::{
    io::{Read, Seek, Write},
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::Duration,
};

use common::{block_file, fresh_file, hold_write_lock, run_dir, unblock, url_for};
use fenced_api::{DistributedLock, Error, LockKey, LockOptions, ReleaseOutcome};
use fenced_sqlite::{SqliteLock, SCHEMES};
use tokio::time::Instant;

fn key(tag: &str) -> LockKey {
    LockKey::new(format!("{tag}/{}", uuid::Uuid::new_v4().simple())).unwrap()
}

fn ttl(d: Duration) -> LockOptions {
    LockOptions::builder().ttl(d).build().unwrap()
}

async fn open(file: &Path, table: &str) -> SqliteLock {
    SqliteLock::connect(&url_for(file, table, ""))
        .await
        .unwrap()
}

async fn raw(file: &Path) -> sqlx::SqlitePool {
    sqlx::SqlitePool::connect_with(sqlx::sqlite::SqliteConnectOptions::new().filename(file))
        .await
        .unwrap()
}

// ---------------------------------------------------------------------------
// Child processes. The parent tests below re-run this test binary with
// `--exact child_process --ignored`; the environment says what to do.

const CHILD_MODE: &str = "FENCED_SQLITE_CHILD";
const CHILD_URL: &str = "FENCED_SQLITE_CHILD_URL";
const CHILD_KEY: &str = "FENCED_SQLITE_CHILD_KEY";
const CHILD_SHARED: &str = "FENCED_SQLITE_CHILD_SHARED";
const CHILD_ROUNDS: &str = "FENCED_SQLITE_CHILD_ROUNDS";

fn child(mode: &str, envs: &[(&str, String)]) -> Command {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args(["child_process", "--exact", "--ignored", "--nocapture"])
        .env(CHILD_MODE, mode)
        .env("RUST_BACKTRACE", "0")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (k, v) in envs {
        cmd.env(k, v);
    }
    cmd
}

/// Waits for a child and checks that it really ran the child test and passed.
fn finish(child: std::process::Child) {
    let out = child.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && stdout.contains("1 passed"),
        "child failed ({}):\n{stdout}\n{stderr}",
        out.status
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a child process of the cross-process tests, driven by FENCED_SQLITE_CHILD"]
async fn child_process() {
    let mode = std::env::var(CHILD_MODE).expect("run by a parent test");
    let env = |name: &str| std::env::var(name).unwrap();
    match mode.as_str() {
        // Many rounds of: acquire, non-atomic read-modify-write of a shared
        // file, release. Overlap or a non-increasing token is recorded.
        "contend" => {
            let lock = SqliteLock::connect(&env(CHILD_URL)).await.unwrap();
            let key = LockKey::new(env(CHILD_KEY)).unwrap();
            let shared = PathBuf::from(env(CHILD_SHARED));
            let inside = shared.with_extension("inside");
            let rounds: usize = env(CHILD_ROUNDS).parse().unwrap();
            let opts = LockOptions::builder()
                .ttl(Duration::from_secs(30))
                .wait_timeout(Duration::from_secs(60))
                .build()
                .unwrap();
            for _ in 0..rounds {
                let lease = lock.acquire(&key, &opts).await.unwrap();
                // Nobody else may be inside: create_new fails if the marker exists.
                std::fs::OpenOptions::new()
                    .write(true)
                    .create_new(true)
                    .open(&inside)
                    .expect("another process was inside the critical section");
                let mut f = std::fs::OpenOptions::new()
                    .read(true)
                    .write(true)
                    .open(&shared)
                    .unwrap();
                let mut text = String::new();
                f.read_to_string(&mut text).unwrap();
                let mut parts = text.split_whitespace().map(|p| p.parse::<u64>().unwrap());
                let (count, last) = (parts.next().unwrap(), parts.next().unwrap());
                assert!(
                    lease.token.get() > last,
                    "token {} after {last}",
                    lease.token
                );
                std::thread::sleep(Duration::from_millis(1));
                f.set_len(0).unwrap();
                f.rewind().unwrap();
                write!(f, "{} {}", count + 1, lease.token.get()).unwrap();
                f.sync_all().unwrap();
                std::fs::remove_file(&inside).unwrap();
                assert_eq!(
                    lock.release(&lease).await.unwrap(),
                    ReleaseOutcome::Released
                );
            }
        }
        // Takes the lock and dies without releasing it (or closing anything).
        "crash" => {
            let lock = SqliteLock::connect(&env(CHILD_URL)).await.unwrap();
            let key = LockKey::new(env(CHILD_KEY)).unwrap();
            let lease = lock
                .try_acquire(&key, &ttl(Duration::from_millis(800)))
                .await
                .unwrap()
                .unwrap();
            std::fs::write(env(CHILD_SHARED), lease.token.get().to_string()).unwrap();
            std::process::exit(0);
        }
        // The per-user default store, under the FENCED_HOME the parent set.
        "default" => {
            let home = PathBuf::from(env("FENCED_HOME"));
            assert_eq!(SqliteLock::default_path().unwrap(), home.join("locks.db"));
            let url = SqliteLock::default_url().unwrap();
            let lock = SqliteLock::connect_default().await.unwrap();
            assert_eq!(lock.path(), home.join("locks.db"));
            let lease = lock
                .try_acquire(&key("default"), &LockOptions::default())
                .await
                .unwrap()
                .unwrap();
            lock.release(&lease).await.unwrap();
            assert!(home.join("locks.db").is_file());
            // The URL form names the same file.
            let again = SqliteLock::connect(&url).await.unwrap();
            assert_eq!(again.path(), home.join("locks.db"));
        }
        other => panic!("unknown child mode {other}"),
    }
}

/// Separate processes on one file: never two inside, no lost update, tokens
/// strictly increasing in critical-section order.
#[tokio::test]
async fn separate_processes_exclude_each_other() {
    const PROCESSES: usize = 4;
    const ROUNDS: usize = 15;
    let file = fresh_file("processes");
    let url = url_for(&file, "fenced_procs", "");
    let shared = run_dir().join(format!("counter-{}", uuid::Uuid::new_v4().simple()));
    std::fs::write(&shared, "0 0").unwrap();
    let k = key("procs");
    let children: Vec<_> = (0..PROCESSES)
        .map(|_| {
            child(
                "contend",
                &[
                    (CHILD_URL, url.clone()),
                    (CHILD_KEY, k.as_str().to_owned()),
                    (CHILD_SHARED, shared.display().to_string()),
                    (CHILD_ROUNDS, ROUNDS.to_string()),
                ],
            )
            .spawn()
            .unwrap()
        })
        .collect();
    tokio::task::spawn_blocking(move || children.into_iter().for_each(finish))
        .await
        .unwrap();
    let text = std::fs::read_to_string(&shared).unwrap();
    let count: usize = text.split_whitespace().next().unwrap().parse().unwrap();
    assert_eq!(count, PROCESSES * ROUNDS, "lost updates: {text}");
    let lock = open(&file, "fenced_procs").await;
    assert!(lock.inspect(&k).await.unwrap().is_none(), "left held");
}

/// A holder process killed mid-hold: the key is taken over after its TTL
/// (inline, no reaper) with a larger token; the dead lease is not current.
#[tokio::test]
async fn killed_holder_process_is_taken_over_after_ttl() {
    let file = fresh_file("crash");
    let url = url_for(&file, "fenced_crash", "");
    let out = run_dir().join(format!("token-{}", uuid::Uuid::new_v4().simple()));
    let k = key("crash");
    let c = child(
        "crash",
        &[
            (CHILD_URL, url.clone()),
            (CHILD_KEY, k.as_str().to_owned()),
            (CHILD_SHARED, out.display().to_string()),
        ],
    )
    .spawn()
    .unwrap();
    let status = tokio::task::spawn_blocking(move || c.wait_with_output().unwrap().status)
        .await
        .unwrap();
    assert!(status.success());
    let dead: u64 = std::fs::read_to_string(&out).unwrap().parse().unwrap();
    let lock = SqliteLock::connect(&url).await.unwrap();
    // Before the inspect: the row expires `remaining_ttl` after the inspect
    // at the earliest, so at least that long after `start`.
    let start = Instant::now();
    let info = lock.inspect(&k).await.unwrap();
    let opts = LockOptions::builder()
        .ttl(Duration::from_secs(10))
        .wait_timeout(Duration::from_secs(5))
        .build()
        .unwrap();
    let lease = lock.acquire(&k, &opts).await.unwrap();
    assert!(lease.token.get() > dead, "{} after {dead}", lease.token);
    if let Some(info) = info {
        assert_eq!(info.token.get(), dead, "the dead holder's row");
        assert!(start.elapsed() >= info.remaining_ttl.saturating_sub(Duration::from_millis(50)));
    }
    lock.release(&lease).await.unwrap();
}

/// `connect_default` honours FENCED_HOME (in a child process, so this
/// process's environment is never changed under other tests).
#[tokio::test]
async fn default_store_lives_under_fenced_home() {
    let home = run_dir().join(format!("home-{}", uuid::Uuid::new_v4().simple()));
    let c = child("default", &[("FENCED_HOME", home.display().to_string())])
        .spawn()
        .unwrap();
    tokio::task::spawn_blocking(move || finish(c))
        .await
        .unwrap();
    assert!(home.join("locks.db").is_file());
}

// ---------------------------------------------------------------------------

/// Tokens are AUTOINCREMENT ids: they keep increasing after the file is
/// closed and reopened, after every row is deleted, and after VACUUM.
#[tokio::test]
async fn tokens_increase_across_reopen_deleted_rows_and_vacuum() {
    let file = fresh_file("tokens");
    let opts = ttl(Duration::from_secs(10));
    let k = key("tokens");
    let mut last = 0;
    let mut check = |token: u64, when: &str| {
        assert!(token > last, "{when}: token {token} after {last}");
        last = token;
    };
    let lock = open(&file, "fenced_tokens").await;
    for _ in 0..3 {
        let l = lock.try_acquire(&k, &opts).await.unwrap().unwrap();
        check(l.token.get(), "release");
        lock.release(&l).await.unwrap();
    }
    // Holding the newest row, then deleting it by hand: a plain INTEGER
    // PRIMARY KEY would hand out the same id again.
    let held = lock.try_acquire(&k, &opts).await.unwrap().unwrap();
    check(held.token.get(), "held");
    lock.close().await;
    let pool = raw(&file).await;
    sqlx::query("DELETE FROM fenced_tokens")
        .execute(&pool)
        .await
        .unwrap();
    sqlx::query("VACUUM").execute(&pool).await.unwrap();
    pool.close().await;

    let reopened = open(&file, "fenced_tokens").await;
    let l = reopened.try_acquire(&k, &opts).await.unwrap().unwrap();
    check(l.token.get(), "after delete, vacuum and reopen");
    // The old lease is not current any more.
    assert_eq!(
        reopened.release(&held).await.unwrap(),
        ReleaseOutcome::NotHeld
    );
    reopened.release(&l).await.unwrap();
}

/// Another connection keeping the write lock: writes fail with a retryable
/// backend error once busy_timeout passes — also from a waiting `acquire`,
/// which must not hang — reads still work (WAL), and all works again after.
#[tokio::test]
async fn busy_file_is_a_retryable_error_within_busy_timeout() {
    let file = fresh_file("busy");
    let url = url_for(&file, "fenced_busy", "&busy_timeout=300ms");
    let lock = SqliteLock::connect(&url).await.unwrap();
    let k = key("busy");
    let opts = ttl(Duration::from_secs(10));
    let held = lock.try_acquire(&k, &opts).await.unwrap().unwrap();
    let writer = hold_write_lock(&file).await;

    let other = key("busy-other");
    let start = Instant::now();
    let e = lock.try_acquire(&other, &opts).await.unwrap_err();
    let took = start.elapsed();
    assert!(
        matches!(
            e,
            Error::Backend {
                retryable: true,
                ..
            }
        ),
        "{e:?}"
    );
    assert!(
        took >= Duration::from_millis(250) && took < Duration::from_secs(3),
        "failed after {took:?}"
    );
    let waiting = opts
        .to_builder()
        .wait_timeout(Duration::from_secs(3600))
        .build()
        .unwrap();
    let e = tokio::time::timeout(Duration::from_secs(3), lock.acquire(&other, &waiting))
        .await
        .expect("a waiting acquire on a busy file hung")
        .unwrap_err();
    assert!(e.is_retryable(), "{e:?}");
    let e = lock.release(&held).await.unwrap_err();
    assert!(e.is_retryable(), "{e:?}");
    // WAL: readers are not blocked by the writer.
    assert_eq!(lock.inspect(&k).await.unwrap().unwrap().token, held.token);

    unblock(writer).await;
    assert_eq!(lock.release(&held).await.unwrap(), ReleaseOutcome::Released);

    // A file held in exclusive locking mode cannot even be opened: connect
    // fails the same way, bounded by busy_timeout.
    lock.close().await;
    let blocker = block_file(&file).await;
    let start = Instant::now();
    let e = SqliteLock::connect(&url).await.unwrap_err();
    assert!(
        matches!(
            e,
            Error::Backend {
                retryable: true,
                ..
            }
        ),
        "{e:?}"
    );
    assert!(e.to_string().contains("locked"), "{e}");
    assert!(start.elapsed() < Duration::from_secs(3));
    unblock(blocker).await;
    let lock = SqliteLock::connect(&url).await.unwrap();
    let l = lock.try_acquire(&k, &opts).await.unwrap().unwrap();
    lock.release(&l).await.unwrap();
}

/// The directory and file are created on connect; a location that cannot
/// be created fails at once with a non-retryable error naming it.
#[tokio::test]
async fn creates_missing_directories_and_refuses_impossible_paths() {
    let nested = run_dir()
        .join(format!("a-{}", uuid::Uuid::new_v4().simple()))
        .join("b c")
        .join("locks.db");
    let url = fenced_sqlite_url(&nested);
    let lock = SqliteLock::connect(&url).await.unwrap();
    assert!(nested.is_file());
    assert!(lock
        .try_acquire(&key("dir"), &LockOptions::default())
        .await
        .unwrap()
        .is_some());

    for (path, what) in [
        ("/proc/fenced-cannot-exist/locks.db", "directory"),
        ("/proc/self/fenced-locks.db", "open"),
    ] {
        let start = Instant::now();
        let e = SqliteLock::connect(&format!("sqlite://{path}"))
            .await
            .unwrap_err();
        assert!(
            matches!(
                e,
                Error::Backend {
                    retryable: false,
                    ..
                }
            ),
            "{path}: {e:?}"
        );
        let msg = e.to_string();
        assert!(
            msg.contains(path.rsplit_once('/').unwrap().0) && msg.contains(what),
            "{msg}"
        );
        assert!(start.elapsed() < Duration::from_secs(1), "{path}");
    }

    // A file that is not a database: a clear, permanent error.
    let junk = fresh_file("junk");
    std::fs::write(&junk, vec![0x42u8; 8192]).unwrap();
    let e = SqliteLock::connect(&url_for(&junk, "t", ""))
        .await
        .unwrap_err();
    assert!(!e.is_retryable(), "{e:?}");
    assert!(e.to_string().contains(&junk.display().to_string()), "{e}");
}

fn fenced_sqlite_url(path: &Path) -> String {
    format!(
        "sqlite://{}",
        path.display().to_string().replace(' ', "%20")
    )
}

/// Table names are validated identifiers: injection attempts are
/// configuration errors that touch nothing; reserved words work (quoted).
#[tokio::test]
async fn table_names_are_injection_safe() {
    let file = fresh_file("inject");
    let victim = open(&file, "victim").await;
    let k = key("victim");
    let held = victim
        .try_acquire(&k, &LockOptions::default())
        .await
        .unwrap()
        .unwrap();
    for table in [
        "victim\"; DROP TABLE victim; --",
        "victim;DELETE FROM victim",
        "x%22%3B%20DROP%20TABLE%20victim",
        "Victim",
        "sqlite_master",
        "a b",
    ] {
        match SqliteLock::connect(&url_for(&file, table, "")).await {
            Err(Error::Config { .. }) => {}
            other => panic!("table {table:?}: {other:?}"),
        }
        let builder = SqliteLock::builder(&url_for(&file, "ok", "")).unwrap();
        assert!(matches!(
            builder.table(table).connect().await,
            Err(Error::Config { .. })
        ));
    }
    assert_eq!(victim.inspect(&k).await.unwrap().unwrap().token, held.token);
    for reserved in ["select", "order", "table"] {
        let l = open(&file, reserved).await;
        let lease = l.try_acquire(&k, &LockOptions::default()).await.unwrap();
        assert!(lease.is_some(), "`{reserved}` is its own namespace");
    }
}

/// Processes starting together on a file that does not exist yet all get
/// it (WAL switch and schema creation race) and share one table.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_first_opens_of_a_new_file_all_succeed() {
    for _ in 0..3 {
        let file = fresh_file("race");
        let url = url_for(&file, "fenced_race", "");
        let opens: Vec<_> = (0..8)
            .map(|_| {
                let url = url.clone();
                tokio::spawn(async move { SqliteLock::connect(&url).await })
            })
            .collect();
        let mut locks = Vec::new();
        for o in opens {
            locks.push(o.await.unwrap().unwrap());
        }
        let k = key("race");
        let opts = ttl(Duration::from_secs(10));
        let first = locks[0].try_acquire(&k, &opts).await.unwrap().unwrap();
        for other in &locks[1..] {
            assert!(other.try_acquire(&k, &opts).await.unwrap().is_none());
        }
        locks[0].release(&first).await.unwrap();
    }
}

/// connect creates a missing schema; migrate is idempotent; a schema newer
/// than this build (a later migration logged) is accepted as it is.
#[tokio::test]
async fn schema_is_created_on_connect_and_migrate_is_idempotent() {
    let file = fresh_file("schema");
    let url = url_for(&file, "fenced_schema", "");
    assert_eq!(SqliteLock::migrate(&url).await.unwrap(), vec![1, 2, 3]);
    assert!(SqliteLock::migrate(&url).await.unwrap().is_empty());
    let other = url_for(&file, "fenced_other", "");
    SqliteLock::connect(&other).await.unwrap();
    assert!(
        SqliteLock::migrate(&other).await.unwrap().is_empty(),
        "connect created the current schema"
    );

    let pool = raw(&file).await;
    sqlx::query("INSERT INTO fenced_schema_migrations VALUES (1000, 'from a newer build', 0)")
        .execute(&pool)
        .await
        .unwrap();
    pool.close().await;
    let lock = SqliteLock::connect(&url).await.unwrap();
    assert!(SqliteLock::migrate(&url).await.unwrap().is_empty());
    let l = lock
        .try_acquire(&key("schema"), &LockOptions::default())
        .await
        .unwrap();
    assert!(l.is_some());
}

/// A file made by a build of schema version 1 (no `label` column) opens on
/// connect, without a `migrate`: its held row stays held and shows no label,
/// and new grants store theirs.
#[tokio::test]
async fn a_version_1_file_opens_and_gains_labels() {
    let file = fresh_file("v1");
    let pool = sqlx::SqlitePool::connect_with(
        sqlx::sqlite::SqliteConnectOptions::new()
            .filename(&file)
            .create_if_missing(true),
    )
    .await
    .unwrap();
    let v1 = include_str!("../migrations/0001_initial.sql").replace("{base}", "fenced_v1");
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "{v1}; CREATE TABLE fenced_v1_migrations (version INTEGER PRIMARY KEY, \
         name TEXT NOT NULL, applied_at INTEGER NOT NULL) STRICT; \
         INSERT INTO fenced_v1_migrations VALUES (1, 'initial', 0); \
         INSERT INTO fenced_v1 (lock_key, owner, expire_at, created_at) \
         VALUES (CAST('old' AS BLOB), CAST('old-owner' AS BLOB), \
         (unixepoch() + 600) * 1000000, 0)"
    )))
    .execute(&pool)
    .await
    .unwrap();
    pool.close().await;

    let lock = open(&file, "fenced_v1").await;
    let old = lock.inspect(&LockKey::new("old").unwrap()).await.unwrap();
    let old = old.expect("the v1 row is still held");
    assert_eq!(old.owner.as_str(), "old-owner");
    assert_eq!(old.label, None);
    let k = key("v1");
    let opts = LockOptions::builder().label("after v2").build().unwrap();
    let lease = lock.try_acquire(&k, &opts).await.unwrap().unwrap();
    let info = lock.inspect(&k).await.unwrap().unwrap();
    assert_eq!(info.label.as_ref().map(|l| l.as_str()), Some("after v2"));
    lock.release(&lease).await.unwrap();
    assert!(
        SqliteLock::migrate(&url_for(&file, "fenced_v1", ""))
            .await
            .unwrap()
            .is_empty(),
        "connect applied version 2"
    );
}

/// The driver entry serves sqlite:// URLs and connects and migrates through them.
#[tokio::test]
async fn driver_connects_by_url() {
    let d = fenced_sqlite::driver();
    assert_eq!(d.schemes, SCHEMES);
    assert!(d.serves("sqlite:///tmp/x.db") && !d.serves("mysql://h/db"));
    let file = fresh_file("driver");
    let url = url_for(&file, "fenced_driver", "");
    (d.migrate.unwrap())(url.clone()).await.unwrap();
    let lock = (d.connect)(url).await.unwrap();
    assert!(lock.capabilities().is_durable() && lock.capabilities().has_fencing());
    assert!(!lock.capabilities().has_native_wait() && !lock.capabilities().is_fifo());
    let l = lock
        .try_acquire(&key("driver"), &LockOptions::default())
        .await
        .unwrap();
    assert!(l.is_some());
}

/// Expiry is on SQLite's clock with the stored value in whole microseconds;
/// the stored expiry is never before the holder's local deadline.
#[tokio::test]
async fn expiry_is_stored_as_microseconds_from_sqlites_clock() {
    let file = fresh_file("clock");
    let lock = open(&file, "fenced_clock").await;
    let k = key("clock");
    let before = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_micros() as i64;
    let lease = lock
        .try_acquire(&k, &ttl(Duration::from_secs(7)))
        .await
        .unwrap()
        .unwrap();
    let after = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_micros() as i64;
    let pool = raw(&file).await;
    let expire_at: i64 = sqlx::Row::get(
        &sqlx::query("SELECT expire_at FROM fenced_clock WHERE lock_key = ?")
            .bind(k.as_bytes())
            .fetch_one(&pool)
            .await
            .unwrap(),
        0,
    );
    assert!(
        expire_at >= before + 7_000_000,
        "{expire_at} < {before} + 7 s"
    );
    assert!(
        expire_at <= after + 7_000_000 + 1_000,
        "{expire_at} > {after} + 7 s + 1 ms"
    );
    assert_eq!(expire_at % 1000, 0);
    lock.release(&lease).await.unwrap();
}

/// `list` (what `fenced status` prints with no key): the unexpired rows of
/// this table, in key byte order, at most `limit`, each as `inspect` sees it.
#[tokio::test]
async fn list_shows_the_current_holds_of_the_table_in_key_order() {
    let file = fresh_file("list");
    let lock = open(&file, "fenced_list").await;
    let other = open(&file, "fenced_list_other").await;
    let opts = ttl(Duration::from_secs(30));
    let names = ["b 'quoted' %_", "a/\u{e9}t\u{e9}", "c\\d", "expired"];
    let mut leases = Vec::new();
    for n in names {
        leases.push(
            lock.try_acquire(&LockKey::new(n).unwrap(), &opts)
                .await
                .unwrap()
                .unwrap(),
        );
    }
    other
        .try_acquire(&LockKey::new("other-table").unwrap(), &opts)
        .await
        .unwrap()
        .unwrap();
    // A crashed holder's row: expired on SQLite's clock, still in the table.
    let pool = raw(&file).await;
    sqlx::query("UPDATE fenced_list SET expire_at = 0 WHERE lock_key = ?")
        .bind("expired".as_bytes())
        .execute(&pool)
        .await
        .unwrap();
    pool.close().await;

    let all = lock.list(100).await.unwrap();
    let keys: Vec<&str> = all.iter().map(|i| i.key.as_str()).collect();
    assert_eq!(keys, ["a/\u{e9}t\u{e9}", "b 'quoted' %_", "c\\d"]);
    for info in &all {
        assert_eq!(
            Some(info.token),
            lock.inspect(&info.key).await.unwrap().map(|i| i.token)
        );
        assert!(info.remaining_ttl > Duration::from_secs(1));
    }
    let first: Vec<LockKey> = lock
        .list(2)
        .await
        .unwrap()
        .into_iter()
        .map(|i| i.key)
        .collect();
    assert_eq!(first.len(), 2);
    assert_eq!(first[0].as_str(), "a/\u{e9}t\u{e9}");
    lock.release(&leases[0]).await.unwrap();
    assert_eq!(lock.list(100).await.unwrap().len(), 2);
}

/// The batch statement itself (`extend_many` would hide a failing one
/// behind its one-by-one fallback): leases of different owners in one
/// chunk are renewed, and a forged one beside them (another owner, a
/// current token) is not.
#[tokio::test]
async fn one_batch_statement_checks_each_lease_against_its_owner() {
    use fenced_api::batch::{ChunkVerdict, ExtendChunk};
    let file = fresh_file("batch");
    let lock = open(&file, "fenced_batch").await;
    let opts = ttl(Duration::from_secs(2));
    let mut leases = Vec::new();
    for i in 0..3 {
        let k = key(&format!("batch{i}"));
        leases.push(lock.try_acquire(&k, &opts).await.unwrap().unwrap());
    }
    assert_ne!(leases[0].owner, leases[1].owner);
    let forged = fenced_api::Lease::new(
        leases[2].key.clone(),
        fenced_api::Owner::random(),
        leases[2].token,
        leases[2].ttl,
        Instant::now(),
    );
    let chunk = [&leases[0], &leases[1], &forged];
    let verdict = lock
        .extend_chunk(&chunk, Duration::from_secs(60))
        .await
        .unwrap();
    let renewed = [leases[0].token, leases[1].token].into_iter().collect();
    assert_eq!(verdict, ChunkVerdict::Exactly(renewed));
    // Past the leases' first TTL: the two renewed are held, the third
    // (not renewed through its forged copy) has expired.
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    let other = open(&file, "fenced_batch").await;
    for (i, lease) in leases.iter().enumerate() {
        let free = other
            .try_acquire(&lease.key, &opts)
            .await
            .unwrap()
            .is_some();
        assert_eq!(free, i == 2, "lease {i} after the batch");
    }
}
