//! Bad inputs, on every backend (memory, sqlite, mysql ×3 strategies, redis,
//! etcd).
//!
//! Every rejected input must give a typed [`fenced::Error`] whose `Display`
//! is one line saying what is wrong, and must leave the store untouched —
//! checked through `inspect` *and* by looking at the store directly (rows in
//! the lock tables, Redis keys under the prefix, etcd keys under the prefix).
//! Every awkward-but-legal key must be accepted, kept byte-exact and never
//! collide with a near-identical one.
//!
//! Server-backed cases use the shared services (a fresh namespace per test)
//! and, for wrong passwords and read-only servers, private servers started
//! here; a shared service that is down fails the test naming
//! `scripts/services.sh`.

// Test helpers outside #[test] functions panic and print on purpose, like
// the tests.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stdout)]

mod support;

use std::{
    collections::BTreeSet,
    path::PathBuf,
    sync::Arc,
    time::{Duration, Instant},
};

use fenced::{
    etcd::etcd_client::{self, DeleteOptions, GetOptions},
    mysql::sqlx::{self, AssertSqlSafe, Row},
    redis::redis,
    DistributedLock, Error, Lease, LockClient, LockKey, LockOptions, ReleaseOutcome, WaitPolicy,
};
use fenced_faults::private::{
    EtcdOptions, MariaDbOptions, PrivateEtcd, PrivateMariaDb, PrivateRedis, RedisOptions,
};
use support::{
    bounded, etcd_server, hex, mysql_server, redis_server, with_params, TempMysqlUser, HANG,
};

const STRATEGIES: [&str; 3] = ["unique_key", "row_lock", "optimistic"];

// ---------------------------------------------------------------- helpers

/// `url` with `user:password@` as its user info (replacing any).
fn with_user(url: &str, user: &str, password: &str) -> String {
    let (scheme, rest) = url.split_once("://").expect("a URL with a scheme");
    let end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(end);
    let host = authority.rsplit_once('@').map_or(authority, |(_, h)| h);
    format!("{scheme}://{user}:{password}@{host}{tail}")
}

/// The error's `Display`, after checking it is one line (and, for
/// validation errors, short: the offending input is not echoed whole).
fn one_line(context: &str, e: &Error) -> String {
    let s = e.to_string();
    assert!(
        !s.contains('\n') && !s.contains('\r'),
        "{context}: the error message spans several lines: {s:?}"
    );
    assert!(!s.trim().is_empty(), "{context}: empty error message");
    if matches!(
        e,
        Error::InvalidKey { .. } | Error::InvalidOptions { .. } | Error::Config { .. }
    ) {
        assert!(
            s.len() <= 400,
            "{context}: a validation message of {} bytes (echoes the input?): {:?}",
            s.len(),
            &s[..s.len().min(200)]
        );
    }
    s
}

fn assert_mentions(context: &str, message: &str, any_of: &[&str]) {
    let lower = message.to_lowercase();
    assert!(
        any_of.iter().any(|w| lower.contains(&w.to_lowercase())),
        "{context}: the message should say what is wrong (one of {any_of:?}): {message}"
    );
}

fn opts(owner: &str) -> LockOptions {
    LockOptions::builder()
        .ttl(Duration::from_secs(30))
        .owner(owner)
        .build()
        .expect("valid options")
}

// ----------------------------------------------------- the seven backends

#[derive(Debug, Clone, PartialEq, Eq)]
enum Ns {
    Memory,
    Sqlite {
        path: PathBuf,
        table: String,
    },
    MySql {
        table: String,
        strategy: &'static str,
    },
    Redis {
        prefix: String,
    },
    Etcd {
        prefix: String,
    },
}

struct Backend {
    name: String,
    ns: Ns,
    lock: Arc<dyn DistributedLock>,
}

impl Backend {
    /// Takes a fresh `<prefix>-…` key with `opts`; the store must grant it
    /// (`what` names the case in failures).
    async fn take_fresh(&self, prefix: &str, opts: &LockOptions, what: &str) -> (LockKey, Lease) {
        let key = LockKey::new(format!("{prefix}-{}", hex(6))).expect("key");
        let lease = bounded(what, self.lock.try_acquire(&key, opts))
            .await
            .unwrap_or_else(|e| panic!("{what}: {e}"))
            .unwrap_or_else(|| panic!("{what}: refused"));
        (key, lease)
    }

    /// `server` as `user:password`, in this backend's namespace; `None`
    /// unless this is a MySQL backend.
    fn mysql_url(&self, server: &str, user: &str, password: &str) -> Option<String> {
        let Ns::MySql { table, strategy } = &self.ns else {
            return None;
        };
        Some(with_params(
            &with_user(server, user, password),
            &format!("strategy={strategy}&table={table}"),
        ))
    }

    /// Releases `lease`, which must still be held.
    async fn release_held(&self, lease: &Lease, what: &str) {
        assert_eq!(
            bounded(what, self.lock.release(lease))
                .await
                .expect("release"),
            ReleaseOutcome::Released,
            "{what}"
        );
    }
}

/// Every backend, each in a namespace of its own, plus admin handles to
/// look at the stores directly.
struct Stores {
    _dir: tempfile::TempDir,
    mysql_url: String,
    redis_url: String,
    etcd_hp: String,
    mysql: sqlx::MySqlPool,
    redis: redis::aio::MultiplexedConnection,
    etcd: etcd_client::Client,
    backends: Vec<Backend>,
}

impl Stores {
    async fn open() -> Stores {
        let (mysql_url, redis_url, etcd_hp) =
            tokio::join!(mysql_server(), redis_server(), etcd_server());
        let dir = tempfile::tempdir().expect("temp dir");
        let mut backends = Vec::new();

        let memory = fenced::connect("memory://").await.expect("memory://");
        backends.push(Backend {
            name: "memory".into(),
            ns: Ns::Memory,
            lock: memory,
        });

        let path = dir.path().join("locks.db");
        let table = format!("fz_{}", hex(12));
        let url = format!("sqlite://{}?table={table}", path.display());
        backends.push(Backend {
            name: "sqlite".into(),
            ns: Ns::Sqlite {
                path: path.clone(),
                table,
            },
            lock: bounded("sqlite connect", fenced::connect(&url))
                .await
                .unwrap_or_else(|e| panic!("{url}: {e}")),
        });

        let base = format!("fz_{}", hex(12));
        for strategy in STRATEGIES {
            // One base table per strategy: row_lock and optimistic keep a
            // row per key after release, which must not show up elsewhere.
            let table = format!("{base}_{}", &strategy[..1]);
            let url = with_params(
                &mysql_url,
                &format!("strategy={strategy}&table={table}&connect_timeout=5s"),
            );
            bounded("mysql migrate", fenced::migrate(&url))
                .await
                .unwrap_or_else(|e| panic!("migrating {table}: {e}"));
            backends.push(Backend {
                name: format!("mysql/{strategy}"),
                ns: Ns::MySql { table, strategy },
                lock: bounded("mysql connect", fenced::connect(&url))
                    .await
                    .unwrap_or_else(|e| panic!("{url}: {e}")),
            });
        }

        let prefix = format!("fz-{}", hex(12));
        let url = with_params(&redis_url, &format!("prefix={prefix}"));
        backends.push(Backend {
            name: "redis".into(),
            ns: Ns::Redis {
                prefix: prefix.clone(),
            },
            lock: bounded("redis connect", fenced::connect(&url))
                .await
                .unwrap_or_else(|e| panic!("{url}: {e}")),
        });

        let prefix = format!("fz/{}", hex(12));
        let url = format!("etcd://{etcd_hp}/{prefix}");
        backends.push(Backend {
            name: "etcd".into(),
            ns: Ns::Etcd { prefix },
            lock: bounded("etcd connect", fenced::connect(&url))
                .await
                .unwrap_or_else(|e| panic!("{url}: {e}")),
        });

        let mysql = sqlx::MySqlPool::connect(&mysql_url)
            .await
            .expect("admin pool");
        let redis = redis::Client::open(redis_url.as_str())
            .expect("redis url")
            .get_multiplexed_async_connection()
            .await
            .expect("redis admin connection");
        let etcd = etcd_client::Client::connect([format!("http://{etcd_hp}")], None)
            .await
            .expect("etcd admin client");
        Stores {
            _dir: dir,
            mysql_url,
            redis_url,
            etcd_hp,
            mysql,
            redis,
            etcd,
            backends,
        }
    }

    /// Everything the store holds in `b`'s namespace, one sorted line per
    /// record with its full content (every column of every table, each
    /// Redis value as DUMPed, each etcd key with its mod revision), so that
    /// two snapshots differ whenever anything was written. Layout-independent.
    async fn snapshot(&self, b: &Backend) -> Vec<String> {
        let mut out = match &b.ns {
            // The in-process store has no outside view but its Debug.
            Ns::Memory => vec![format!("{:?}", b.lock)],
            Ns::Sqlite { path, .. } => sqlite_snapshot(path).await,
            Ns::MySql { table, .. } => mysql_snapshot(&self.mysql, table).await,
            Ns::Redis { prefix } => {
                let mut conn = self.redis.clone();
                let mut out = Vec::new();
                for name in self.redis_names(&format!("*{prefix}*")).await {
                    let dump: Option<Vec<u8>> = redis::cmd("DUMP")
                        .arg(&name)
                        .query_async(&mut conn)
                        .await
                        .expect("DUMP");
                    out.push(format!("redis {:?} = {dump:?}", lossy(&name)));
                }
                out
            }
            Ns::Etcd { prefix } => {
                let mut c = self.etcd.clone();
                c.get(prefix.as_str(), Some(GetOptions::new().with_prefix()))
                    .await
                    .expect("etcd range")
                    .kvs()
                    .iter()
                    .map(|kv| {
                        format!(
                            "etcd {:?} = {:?} @{}",
                            lossy(kv.key()),
                            lossy(kv.value()),
                            kv.mod_revision()
                        )
                    })
                    .collect()
            }
        };
        out.sort();
        out
    }

    /// The lock keys the store has a record of in `b`'s namespace, decoded
    /// from its layout (`None` for memory, which has no outside view).
    /// Internal records under names no `LockKey` can have (control
    /// characters, e.g. a `\x01epoch` row) are left out.
    async fn stored_keys(&self, b: &Backend) -> Option<BTreeSet<Vec<u8>>> {
        let keys: BTreeSet<Vec<u8>> = match &b.ns {
            Ns::Memory => return None,
            Ns::Sqlite { path, .. } => {
                let mut conn = sqlite_conn(path).await;
                let mut out = BTreeSet::new();
                for t in sqlite_tables(&mut conn).await {
                    let cols = sqlite_columns(&mut conn, &t).await;
                    if cols.iter().any(|c| c == "lock_key") {
                        for r in sqlx::query(AssertSqlSafe(format!("SELECT lock_key FROM \"{t}\"")))
                            .fetch_all(&mut conn)
                            .await
                            .expect("reading a sqlite table")
                        {
                            out.insert(r.get::<Vec<u8>, _>(0));
                        }
                    }
                }
                out
            }
            Ns::MySql { table, .. } => {
                let mut out = BTreeSet::new();
                for (t, cols) in mysql_tables(&self.mysql, table).await {
                    if !cols.iter().any(|c| c == "lock_key") {
                        continue;
                    }
                    for r in sqlx::query(AssertSqlSafe(format!("SELECT lock_key FROM `{t}`")))
                        .fetch_all(&self.mysql)
                        .await
                        .unwrap_or_else(|e| panic!("reading {t}: {e}"))
                    {
                        out.insert(r.get::<Vec<u8>, _>(0));
                    }
                }
                out
            }
            Ns::Redis { prefix } => {
                // `{<prefix>/<key>}:<role>`, role one character.
                let head = format!("{{{prefix}/");
                self.redis_names(&format!("{{{prefix}/*"))
                    .await
                    .into_iter()
                    .map(|n| {
                        assert!(
                            n.starts_with(head.as_bytes())
                                && n.len() >= head.len() + 3
                                && n[n.len() - 3..n.len() - 1] == *b"}:",
                            "unexpected redis key layout: {:?}",
                            lossy(&n)
                        );
                        n[head.len()..n.len() - 3].to_vec()
                    })
                    .collect()
            }
            Ns::Etcd { prefix } => {
                // `<prefix>\0<role>\0<key>[\0…]`.
                let mut out = BTreeSet::new();
                let mut c = self.etcd.clone();
                let resp = c
                    .get(
                        prefix.as_str(),
                        Some(GetOptions::new().with_prefix().with_keys_only()),
                    )
                    .await
                    .expect("etcd range");
                for kv in resp.kvs() {
                    let k = kv.key();
                    let mut parts = k[prefix.len()..].split(|&c| c == 0);
                    match (parts.next(), parts.next(), parts.next()) {
                        (Some(b""), Some(b"lock" | b"queue"), Some(key)) => {
                            out.insert(key.to_vec());
                        }
                        (Some(b""), Some(_), _) => {} // another role: no lock key in it
                        _ => panic!("unexpected etcd key layout: {:?}", lossy(k)),
                    }
                }
                out
            }
        };
        Some(
            keys.into_iter()
                .filter(|k| std::str::from_utf8(k).is_ok_and(|s| LockKey::new(s).is_ok()))
                .collect(),
        )
    }

    async fn redis_names(&self, pattern: &str) -> Vec<Vec<u8>> {
        use redis::AsyncCommands as _;
        let mut conn = self.redis.clone();
        let scan = redis::ScanOptions::default()
            .with_pattern(pattern)
            .with_count(1000);
        let mut names = conn.scan_options::<Vec<u8>>(scan).await.expect("SCAN");
        let mut out = Vec::new();
        while let Some(name) = names.next_item().await {
            out.push(name.expect("SCAN"));
        }
        out
    }

    /// Asserts that `b`'s namespace is exactly as `before` (a [`snapshot`](Self::snapshot)).
    async fn assert_untouched(&self, b: &Backend, before: &[String], after: &str) {
        let now = self.snapshot(b).await;
        let added: Vec<&String> = now.iter().filter(|r| !before.contains(r)).collect();
        let removed: Vec<&String> = before.iter().filter(|r| !now.contains(r)).collect();
        assert!(
            added.is_empty() && removed.is_empty(),
            "{}: {after} wrote to the store: added {added:?}, removed {removed:?}",
            b.name
        );
    }

    /// Snapshots of every backend, in order.
    async fn snapshots(&self) -> Vec<Vec<String>> {
        let mut out = Vec::new();
        for b in &self.backends {
            out.push(self.snapshot(b).await);
        }
        out
    }

    /// Drops this run's namespaces (see `Drop`).
    async fn cleanup(self) {
        drop(self);
    }
}

impl Drop for Stores {
    /// Drops this run's tables and keys (best effort; the names are unique),
    /// on its own thread and runtime so that it also runs when a test panics.
    fn drop(&mut self) {
        let (mysql, redis_url, etcd_hp) = (
            self.mysql_url.clone(),
            self.redis_url.clone(),
            self.etcd_hp.clone(),
        );
        let namespaces: Vec<Ns> = self.backends.iter().map(|b| b.ns.clone()).collect();
        let _ = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            rt.block_on(async {
                let pool = sqlx::MySqlPool::connect(&mysql).await.ok();
                let redis = match redis::Client::open(redis_url.as_str()) {
                    Ok(c) => c.get_multiplexed_async_connection().await.ok(),
                    Err(_) => None,
                };
                let etcd = etcd_client::Client::connect([format!("http://{etcd_hp}")], None)
                    .await
                    .ok();
                for ns in namespaces {
                    match (ns, &pool, &redis, &etcd) {
                        (Ns::MySql { table, .. }, Some(pool), _, _) => {
                            for (t, _) in mysql_tables(pool, &table).await {
                                let sql = format!("DROP TABLE IF EXISTS `{t}`");
                                let _ = sqlx::query(AssertSqlSafe(sql)).execute(pool).await;
                            }
                        }
                        (Ns::Redis { prefix }, _, Some(conn), _) => {
                            let mut conn = conn.clone();
                            let names: Vec<Vec<u8>> = redis::cmd("KEYS")
                                .arg(format!("*{prefix}*"))
                                .query_async(&mut conn)
                                .await
                                .unwrap_or_default();
                            if !names.is_empty() {
                                let _: redis::RedisResult<i64> =
                                    redis::cmd("DEL").arg(names).query_async(&mut conn).await;
                            }
                        }
                        (Ns::Etcd { prefix }, _, _, Some(c)) => {
                            let _ = c
                                .clone()
                                .delete(prefix.as_str(), Some(DeleteOptions::new().with_prefix()))
                                .await;
                        }
                        _ => {}
                    }
                }
                if let Some(pool) = pool {
                    pool.close().await;
                }
            });
            Ok::<(), std::io::Error>(())
        })
        .join();
    }
}

/// The tables of namespace `base` (`base` and `base_*`, migrations log
/// included) in the current database, with their columns.
async fn mysql_tables(pool: &sqlx::MySqlPool, base: &str) -> Vec<(String, Vec<String>)> {
    let rows = sqlx::query(
        "SELECT table_name, column_name FROM information_schema.columns \
         WHERE table_schema = DATABASE() AND (table_name = ? OR table_name LIKE ?) \
         ORDER BY table_name, ordinal_position",
    )
    .bind(base)
    .bind(format!("{}\\_%", base.replace('_', "\\_")))
    .fetch_all(pool)
    .await
    .expect("information_schema");
    let mut out: Vec<(String, Vec<String>)> = Vec::new();
    for r in rows {
        let (t, c): (String, String) = (r.get(0), r.get(1));
        match out.last_mut() {
            Some((last, cols)) if *last == t => cols.push(c),
            _ => out.push((t, vec![c])),
        }
    }
    out
}

/// Every row of every table of namespace `base`, all columns in hex.
async fn mysql_snapshot(pool: &sqlx::MySqlPool, base: &str) -> Vec<String> {
    let mut out = Vec::new();
    for (t, cols) in mysql_tables(pool, base).await {
        let expr = cols
            .iter()
            .map(|c| format!("IFNULL(HEX(`{c}`), 'NULL')"))
            .collect::<Vec<_>>()
            .join(", ");
        for r in sqlx::query(AssertSqlSafe(format!(
            "SELECT CONCAT_WS(',', {expr}) FROM `{t}`"
        )))
        .fetch_all(pool)
        .await
        .unwrap_or_else(|e| panic!("reading {t}: {e}"))
        {
            out.push(format!("{t}: {}", r.get::<String, _>(0)));
        }
    }
    out
}

async fn sqlite_tables(conn: &mut sqlx::SqliteConnection) -> Vec<String> {
    sqlx::query("SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name")
        .fetch_all(conn)
        .await
        .expect("sqlite_master")
        .iter()
        .map(|r| r.get::<String, _>(0))
        .collect()
}

async fn sqlite_columns(conn: &mut sqlx::SqliteConnection, table: &str) -> Vec<String> {
    sqlx::query(AssertSqlSafe(format!(
        "SELECT name FROM pragma_table_info('{table}')"
    )))
    .fetch_all(conn)
    .await
    .expect("pragma_table_info")
    .iter()
    .map(|r| r.get::<String, _>(0))
    .collect()
}

/// Every row of every table in the SQLite file, all columns quoted.
async fn sqlite_snapshot(path: &std::path::Path) -> Vec<String> {
    let mut conn = sqlite_conn(path).await;
    let mut out = Vec::new();
    for t in sqlite_tables(&mut conn).await {
        let cols = sqlite_columns(&mut conn, &t).await;
        let expr = cols
            .iter()
            .map(|c| format!("quote(\"{c}\")"))
            .collect::<Vec<_>>()
            .join(" || ',' || ");
        for r in sqlx::query(AssertSqlSafe(format!("SELECT {expr} FROM \"{t}\"")))
            .fetch_all(&mut conn)
            .await
            .expect("reading a sqlite table")
        {
            out.push(format!("{t}: {}", r.get::<String, _>(0)));
        }
    }
    out
}

async fn sqlite_conn(path: &std::path::Path) -> sqlx::SqliteConnection {
    use sqlx::{sqlite::SqliteConnectOptions, ConnectOptions};
    SqliteConnectOptions::new()
        .filename(path)
        .read_only(true)
        .connect()
        .await
        .expect("opening the sqlite file read-only")
}

fn lossy(b: &[u8]) -> String {
    let s = String::from_utf8_lossy(b);
    if s.len() > 80 {
        format!("{}…({} bytes)", &s[..s.floor_char_boundary(80)], b.len())
    } else {
        s.into_owned()
    }
}

// ------------------------------------------------------------------ keys

/// Keys that must be refused, with a word the reason must contain.
fn invalid_keys() -> Vec<(String, &'static str)> {
    vec![
        (String::new(), "empty"),
        ("x".repeat(256), "256 bytes"),
        ("é".repeat(128), "256 bytes"),
        ("🔒".repeat(64), "256 bytes"),
        ("k".repeat(1 << 20), "bytes"),
        ("\0".into(), "control character"),
        ("a\0b".into(), "control character"),
        ("line\nbreak".into(), "control character"),
        ("cr\r".into(), "control character"),
        ("tab\there".into(), "control character"),
        ("\u{1b}[31mred".into(), "control character"),
        ("del\u{7f}".into(), "control character"),
        ("c1\u{85}".into(), "control character"),
        ("c1\u{9f}".into(), "control character"),
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_keys_are_refused_before_any_io_on_every_backend() {
    let stores = Stores::open().await;
    let before = stores.snapshots().await;
    for (b, before) in stores.backends.iter().zip(&before) {
        let client = LockClient::builder(b.lock.clone())
            .ttl(Duration::from_secs(30))
            .wait(WaitPolicy::Timeout(Duration::from_secs(1)))
            .build()
            .expect("client");
        for (key, reason) in invalid_keys() {
            let what = format!("{}: key {:?}", b.name, lossy(key.as_bytes()));
            let direct = LockKey::new(&key).expect_err(&what);
            let via_try = bounded(&what, client.try_acquire(key.as_str()))
                .await
                .expect_err(&what);
            let via_acquire = bounded(&what, client.acquire(key.as_str()))
                .await
                .expect_err(&what);
            let via_with_lock = bounded(
                &what,
                client.with_lock(key.as_str(), |_| async {
                    unreachable!("ran under a bad key")
                }),
            )
            .await
            .expect_err(&what);
            for e in [direct, via_try, via_acquire, via_with_lock] {
                assert!(matches!(e, Error::InvalidKey { .. }), "{what}: {e:?}");
                assert!(!e.is_retryable(), "{what}: retryable {e}");
                let msg = one_line(&what, &e);
                assert_mentions(&what, &msg, &[reason]);
            }
        }
        stores
            .assert_untouched(b, before, "refusing invalid keys")
            .await;
        // Nor is a "repaired" spelling held: truncated, or control characters dropped.
        for (key, _) in invalid_keys() {
            let cut = &key[..key.floor_char_boundary(LockKey::MAX_LEN)];
            let stripped: String = key.chars().filter(|c| !c.is_control()).collect();
            for near in [cut.to_owned(), stripped] {
                let Ok(near) = LockKey::new(&near) else {
                    continue;
                };
                let info = bounded(&b.name, b.lock.inspect(&near))
                    .await
                    .expect("inspect");
                assert!(info.is_none(), "{}: {near:?} is held: {info:?}", b.name);
            }
        }
    }
    stores.cleanup().await;
}

/// Legal keys that break naive SQL, glob, hash-tag or path handling.
fn awkward_keys() -> Vec<String> {
    let mut keys: Vec<String> = [
        "'; DROP TABLE x;--",
        "\"; DROP TABLE x;--",
        "`; DROP TABLE x;--",
        "') OR ('1'='1",
        "%",
        "_",
        "\\",
        "`",
        "%%",
        "a%b",
        "a_b",
        "\\%",
        "\\_",
        "\\\\",
        "'",
        "\"",
        "*",
        "?",
        "[a-z]",
        "{",
        "}",
        "{x}",
        "}{",
        "x}:l",
        ":",
        "/",
        "a/b",
        "..",
        " ",
        "a ",
        " a",
        "Lock",
        "lock",
        "\u{e9}",
        "e\u{301}",
        "\u{212b}",
        "\u{c5}",
        "\u{fb01}",
        "🔒",
        "\u{200b}",
        "\u{202e}rtl",
        "NULL",
        "0",
        "-1",
        "$1",
        "?1",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    keys.push("x".repeat(255));
    keys.push(format!("{}a", "x".repeat(254)));
    keys.push(format!("{}b", "x".repeat(254)));
    keys.push(format!("{}abc", "🔒".repeat(63)));
    keys.push("é".repeat(127));
    keys.sort();
    keys.dedup();
    keys
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn awkward_keys_are_accepted_and_kept_byte_exact() {
    let stores = Stores::open().await;
    let keys = awkward_keys();
    let want: BTreeSet<Vec<u8>> = keys.iter().map(|k| k.as_bytes().to_vec()).collect();
    for b in &stores.backends {
        // In chunks: a row_lock holder keeps a pooled connection per lock.
        for (c, chunk) in keys.chunks(6).enumerate() {
            let mut held: Vec<Lease> = Vec::new();
            for (i, k) in chunk.iter().enumerate() {
                let what = format!("{}: key {:?}", b.name, lossy(k.as_bytes()));
                let key = LockKey::new(k).unwrap_or_else(|e| panic!("{what}: refused: {e}"));
                let lease = bounded(&what, b.lock.try_acquire(&key, &opts(&format!("o{c}-{i}"))))
                    .await
                    .unwrap_or_else(|e| panic!("{what}: {e}"))
                    .unwrap_or_else(|| panic!("{what}: reported as held by someone else"));
                assert_eq!(lease.key.as_bytes(), k.as_bytes(), "{what}");
                held.push(lease);
            }
            // The chunk is held at once, each key by its own owner.
            for lease in &held {
                let what = format!("{}: key {:?}", b.name, lossy(lease.key.as_bytes()));
                let info = bounded(&what, b.lock.inspect(&lease.key))
                    .await
                    .unwrap_or_else(|e| panic!("{what}: inspect: {e}"))
                    .unwrap_or_else(|| panic!("{what}: inspect says free while held"));
                assert_eq!(info.key.as_bytes(), lease.key.as_bytes(), "{what}");
                assert_eq!(info.owner, lease.owner, "{what}: another holder");
                assert_eq!(info.token, lease.token, "{what}");
            }
            // The store holds exactly these bytes: no trimmed, folded,
            // escaped or truncated spelling beside or instead of them.
            if let Some(stored) = stores.stored_keys(b).await {
                let extra: Vec<String> = stored.difference(&want).map(|k| lossy(k)).collect();
                let missing: Vec<String> = chunk
                    .iter()
                    .filter(|k| !stored.contains(k.as_bytes()))
                    .map(|k| lossy(k.as_bytes()))
                    .collect();
                assert!(
                    extra.is_empty() && missing.is_empty(),
                    "{}: the store does not hold the keys byte-exact: extra {extra:?}, missing {missing:?}",
                    b.name
                );
            }
            for lease in &held {
                let what = format!("{}: key {:?}", b.name, lossy(lease.key.as_bytes()));
                let out = bounded(&what, b.lock.release(lease))
                    .await
                    .unwrap_or_else(|e| panic!("{what}: release: {e}"));
                assert_eq!(out, ReleaseOutcome::Released, "{what}");
                let info = bounded(&what, b.lock.inspect(&lease.key))
                    .await
                    .expect("inspect");
                assert!(info.is_none(), "{what}: still held after release: {info:?}");
            }
        }
    }
    // The injection attempts left every lock table in place.
    for b in &stores.backends {
        if let Ns::MySql { table, .. } = &b.ns {
            let tables: Vec<String> = mysql_tables(&stores.mysql, table)
                .await
                .into_iter()
                .map(|(t, _)| t)
                .collect();
            for t in [table.clone(), format!("{table}_migrations")] {
                assert!(
                    tables.contains(&t),
                    "{t} is gone after the injection keys: {tables:?}"
                );
            }
        }
    }
    stores.cleanup().await;
}

/// Pairs that a store folding case, trimming, normalising Unicode, matching
/// patterns or truncating would confuse.
fn near_identical_pairs() -> Vec<(String, String)> {
    let mut pairs: Vec<(String, String)> = [
        ("Lock", "lock"),
        ("LOCK", "lock"),
        ("a", "a "),
        ("a", " a"),
        ("a", "a  "),
        ("\u{e9}", "e\u{301}"),
        ("\u{c5}", "\u{212b}"),
        ("\u{fb01}", "fi"),
        ("ß", "ss"),
        ("a", "\u{ff41}"),
        ("a_c", "abc"),
        ("a%", "ab"),
        ("%", "x"),
        ("\\", "\\\\"),
        ("x*", "xy"),
        ("x?", "xy"),
        ("[ab]", "a"),
        ("{a}", "a"),
        ("x}:l", "x"),
        ("a/b", "a"),
        ("a\u{200b}", "a"),
    ]
    .iter()
    .map(|(a, b)| (a.to_string(), b.to_string()))
    .collect();
    pairs.push((
        format!("{}a", "x".repeat(254)),
        format!("{}b", "x".repeat(254)),
    ));
    pairs
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn near_identical_keys_never_collide() {
    let stores = Stores::open().await;
    for b in &stores.backends {
        for (i, (x, y)) in near_identical_pairs().into_iter().enumerate() {
            let what = format!(
                "{}: {:?} vs {:?}",
                b.name,
                lossy(x.as_bytes()),
                lossy(y.as_bytes())
            );
            let (kx, ky) = (LockKey::new(&x).expect("x"), LockKey::new(&y).expect("y"));
            let lx = bounded(&what, b.lock.try_acquire(&kx, &opts(&format!("x{i}"))))
                .await
                .unwrap_or_else(|e| panic!("{what}: {e}"))
                .unwrap_or_else(|| panic!("{what}: first key refused"));
            let ly = bounded(&what, b.lock.try_acquire(&ky, &opts(&format!("y{i}"))))
                .await
                .unwrap_or_else(|e| panic!("{what}: {e}"))
                .unwrap_or_else(|| panic!("{what}: the two keys collide (second refused)"));
            for (k, l) in [(&kx, &lx), (&ky, &ly)] {
                let info = bounded(&what, b.lock.inspect(k))
                    .await
                    .expect("inspect")
                    .unwrap_or_else(|| panic!("{what}: {k:?} free while held"));
                assert_eq!(info.owner, l.owner, "{what}: {k:?} shows the other holder");
            }
            // Releasing one leaves the other held.
            b.release_held(&lx, &what).await;
            let info = bounded(&what, b.lock.inspect(&ky)).await.expect("inspect");
            assert_eq!(
                info.map(|i| i.owner),
                Some(ly.owner.clone()),
                "{what}: releasing {x:?} freed {y:?}"
            );
            b.release_held(&ly, &what).await;
        }
    }
    stores.cleanup().await;
}

// ----------------------------------------------------------- TTL and wait

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_ttls_are_refused_and_change_nothing() {
    let bad = [
        Duration::ZERO,
        Duration::from_millis(1),
        Duration::from_millis(9),
        LockOptions::MAX_TTL + Duration::from_nanos(1),
        Duration::from_secs(u64::MAX),
        Duration::MAX,
    ];
    for ttl in bad {
        let what = format!("ttl {ttl:?}");
        let e = LockOptions::builder().ttl(ttl).build().expect_err(&what);
        assert!(matches!(e, Error::InvalidOptions { .. }), "{what}: {e:?}");
        assert_mentions(&what, &one_line(&what, &e), &["ttl"]);
        let e = LockClient::builder(Arc::new(fenced::MemoryLock::new()))
            .ttl(ttl)
            .build()
            .expect_err(&what);
        assert!(matches!(e, Error::InvalidOptions { .. }), "{what}: {e:?}");
        assert_mentions(&what, &one_line(&what, &e), &["ttl"]);
    }

    let stores = Stores::open().await;
    for b in &stores.backends {
        let (key, lease) = b.take_fresh("ttl", &opts("holder"), &b.name).await;
        let before = stores.snapshot(b).await;
        for ttl in bad {
            let what = format!("{}: extend to {ttl:?}", b.name);
            let e = bounded(&what, b.lock.extend(&lease, ttl))
                .await
                .expect_err(&what);
            assert!(matches!(e, Error::InvalidOptions { .. }), "{what}: {e:?}");
            one_line(&what, &e);
            let info = bounded(&what, b.lock.inspect(&key))
                .await
                .expect("inspect")
                .unwrap_or_else(|| panic!("{what}: the refused extend freed the key"));
            assert_eq!((info.owner, info.token), (lease.owner.clone(), lease.token));
            assert!(
                info.remaining_ttl <= Duration::from_secs(31),
                "{what}: the refused extend changed the expiry: {:?}",
                info.remaining_ttl
            );
        }
        stores.assert_untouched(b, &before, "refused extends").await;
        b.release_held(&lease, &b.name).await;

        // The bounds themselves are accepted and honoured.
        let max = LockOptions::builder()
            .ttl(LockOptions::MAX_TTL)
            .build()
            .expect("24h");
        let what = format!("{}: ttl 24h", b.name);
        let (key, lease) = b.take_fresh("ttlmax", &max, &what).await;
        let info = bounded(&what, b.lock.inspect(&key))
            .await
            .expect("inspect")
            .unwrap_or_else(|| panic!("{what}: free right after acquire (ttl overflowed?)"));
        assert!(
            info.remaining_ttl > Duration::from_secs(23 * 3600)
                && info.remaining_ttl <= LockOptions::MAX_TTL + Duration::from_secs(1),
            "{what}: remaining {:?}",
            info.remaining_ttl
        );
        bounded(&what, b.lock.extend(&lease, LockOptions::MAX_TTL))
            .await
            .unwrap_or_else(|e| panic!("{what}: extend: {e}"));
        b.release_held(&lease, &what).await;

        let min = LockOptions::builder()
            .ttl(LockOptions::MIN_TTL)
            .build()
            .expect("10ms");
        let what = format!("{}: ttl 10ms", b.name);
        let (key, lease) = b.take_fresh("ttlmin", &min, &what).await;
        assert!(lease.ttl >= LockOptions::MIN_TTL, "{what}: {:?}", lease.ttl);
        // It expires (rounded up by coarse stores): another owner gets it.
        let start = Instant::now();
        loop {
            if let Some(l) = b.lock.try_acquire(&key, &opts("next")).await.expect(&what) {
                assert!(l.token > lease.token, "{what}: token did not increase");
                b.lock.release(&l).await.expect("release");
                break;
            }
            assert!(
                start.elapsed() < HANG,
                "{what}: never expired (lease ttl {:?})",
                lease.ttl
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    stores.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zero_and_huge_wait_bounds() {
    let stores = Stores::open().await;
    for b in &stores.backends {
        let key = LockKey::new(format!("wait-{}", hex(6))).expect("key");
        let with_wait = |w: WaitPolicy| {
            LockOptions::builder()
                .ttl(Duration::from_secs(30))
                .wait(w)
                .build()
                .expect("options")
        };
        // Free key: every bound acquires, none overflows.
        for w in [
            WaitPolicy::NoWait,
            WaitPolicy::Timeout(Duration::ZERO),
            WaitPolicy::Timeout(Duration::MAX),
            WaitPolicy::Forever,
        ] {
            let what = format!("{}: free key, {w:?}", b.name);
            let l = bounded(&what, b.lock.acquire(&key, &with_wait(w)))
                .await
                .unwrap_or_else(|e| panic!("{what}: {e}"));
            b.lock.release(&l).await.expect("release");
        }
        // Held key: zero bounds give up at once with Timeout.
        let holder = b
            .lock
            .try_acquire(&key, &opts("holder"))
            .await
            .expect("acquire")
            .expect("free");
        for w in [
            WaitPolicy::NoWait,
            WaitPolicy::Timeout(Duration::ZERO),
            WaitPolicy::Timeout(Duration::from_millis(1)),
        ] {
            let what = format!("{}: held key, {w:?}", b.name);
            let e = bounded(&what, b.lock.acquire(&key, &with_wait(w)))
                .await
                .expect_err(&what);
            assert!(matches!(e, Error::Timeout { .. }), "{what}: {e:?}");
            assert!(e.is_retryable(), "{what}");
            assert_mentions(&what, &one_line(&what, &e), &["timed out"]);
        }
        // A huge bound waits (no overflow, no early give-up) and gets the
        // key when the holder releases.
        let lock = b.lock.clone();
        let k = key.clone();
        let waiter = tokio::spawn(async move {
            lock.acquire(&k, &with_wait(WaitPolicy::Timeout(Duration::MAX)))
                .await
        });
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(
            !waiter.is_finished(),
            "{}: a Duration::MAX wait returned early: {:?}",
            b.name,
            waiter.await
        );
        b.lock.release(&holder).await.expect("release");
        let got = bounded(&b.name, waiter)
            .await
            .expect("task")
            .unwrap_or_else(|e| panic!("{}: huge wait: {e}", b.name));
        assert!(got.token > holder.token);
        b.lock.release(&got).await.expect("release");
        let info = b.lock.inspect(&key).await.expect("inspect");
        assert!(info.is_none(), "{}: {info:?}", b.name);
    }
    stores.cleanup().await;
}

// ------------------------------------------------------------------ URLs

/// `(url, words one of which the message must contain)`; every URL points at
/// port 1 (nothing listens), so a backend that validated *after* trying to
/// connect would answer with a connection error instead of `Config`.
fn malformed_urls(dir: &std::path::Path) -> Vec<(String, &'static [&'static str])> {
    let db = dir.join("never.db");
    let db = db.display();
    let m = "mysql://root@127.0.0.1:1/test";
    let r = "redis://127.0.0.1:1";
    let e = "etcd://127.0.0.1:1/fz";
    let mut cases: Vec<(String, &'static [&'static str])> = vec![
        // Unknown schemes / no scheme.
        ("consul://127.0.0.1:1".into(), &["unknown store scheme"]),
        // ZooKeeper: a bad port, a reserved namespace, an unknown parameter.
        ("zk://127.0.0.1:99999/fz".into(), &["port"]),
        ("zk://127.0.0.1:1/zookeeper".into(), &["zookeeper"]),
        (
            "zookeeper://127.0.0.1:1/fz?nope=1".into(),
            &["unknown", "nope"],
        ),
        (
            "mysqlx://root@127.0.0.1:1/test".into(),
            &["unknown store scheme"],
        ),
        (
            "postgresx://u@127.0.0.1:1/db".into(),
            &["unknown store scheme"],
        ),
        // PostgreSQL: an unknown parameter, a bad strategy.
        (
            "postgres://u@127.0.0.1:1/db?nope=1".into(),
            &["unknown", "nope"],
        ),
        (
            "postgres://u@127.0.0.1:1/db?strategy=row_lock".into(),
            &["strategy"],
        ),
        ("://127.0.0.1:1".into(), &["unknown store scheme"]),
        ("".into(), &["no scheme"]),
        ("127.0.0.1:3306".into(), &["no scheme"]),
        ("mysql:/root@127.0.0.1:1/test".into(), &["no scheme"]),
        // Bad ports.
        ("mysql://root@127.0.0.1:99999/test".into(), &["port"]),
        ("mysql://root@127.0.0.1:abc/test".into(), &["port"]),
        ("redis://127.0.0.1:99999".into(), &["port", "url"]),
        ("redis://127.0.0.1:abc".into(), &["port", "url"]),
        // etcd ports: see `etcd_urls_with_a_bad_port_are_config_errors`.
        // Bad strategies.
        (format!("{m}?strategy=mutex"), &["strategy"]),
        (format!("{m}?strategy="), &["strategy"]),
        (format!("{m}?strategy=ROW_LOCK"), &["strategy"]),
        (format!("{m}?strategy=row_lock;DROP"), &["strategy"]),
        // Unknown options with a fenced meaning elsewhere.
        (format!("{e}?nope=1"), &["unknown", "nope"]),
        (format!("sqlite://{db}?nope=1"), &["unknown", "nope"]),
        // Bad prefixes / db numbers / protocols.
        (format!("{r}?prefix=a/b"), &["prefix"]),
        (format!("{r}?prefix="), &["prefix"]),
        (format!("{r}?prefix={{tag}}"), &["prefix"]),
        (format!("{r}/notanumber"), &["database", "db"]),
        (format!("{r}?protocol=resp2"), &["resp3", "protocol"]),
        ("etcd://127.0.0.1:1/a\nb".into(), &["prefix"]),
        ("etcd:///fz".into(), &["endpoint"]),
        // SQLite files and options.
        ("sqlite://".into(), &["no file"]),
        (format!("sqlite://{db}#frag"), &["#"]),
        (format!("sqlite://{db}?synchronous=off"), &["synchronous"]),
        (
            format!("sqlite://{db}?max_connections=0"),
            &["max_connections"],
        ),
        (
            format!("sqlite://{db}?table=a&table=b"),
            &["repeated", "twice", "table"],
        ),
        (format!("{m}?max_connections=0"), &["max_connections"]),
    ];
    // Bad durations, for every backend's duration options.
    for v in [
        "forever",
        "0s",
        "0",
        "2h",
        "-1s",
        "1.5s",
        "10us",
        "",
        "1 s",
        "99999999999999999999",
    ] {
        cases.push((
            format!("{m}?connect_timeout={v}"),
            &["duration", "connect_timeout"],
        ));
        cases.push((format!("{m}?timeout={v}"), &["duration", "timeout"]));
        cases.push((
            format!("{r}?connect_timeout={v}"),
            &["duration", "connect_timeout"],
        ));
        cases.push((
            format!("{r}?operation_timeout={v}"),
            &["duration", "operation_timeout"],
        ));
        cases.push((
            format!("{e}?connect_timeout={v}"),
            &["duration", "connect_timeout"],
        ));
        cases.push((format!("{e}?timeout={v}"), &["duration", "timeout"]));
        cases.push((
            format!("sqlite://{db}?busy_timeout={v}"),
            &["duration", "busy_timeout"],
        ));
        cases.push((
            format!("zk://127.0.0.1:1/fz?session_timeout={v}"),
            &["duration", "session_timeout"],
        ));
    }
    cases
}

#[tokio::test]
async fn malformed_urls_are_config_errors_before_any_io() {
    let dir = tempfile::tempdir().expect("temp dir");
    let mut failures = Vec::new();
    for (url, words) in malformed_urls(dir.path()) {
        let what = format!("{url:?}");
        let mut ops = vec![(
            "connect",
            bounded(&what, fenced::connect(&url)).await.map(|_| ()),
        )];
        // Only SQL stores have a schema; migrate of the others is a no-op
        // (see `migrate_validates_urls_of_schemaless_stores`).
        if !url.starts_with("redis") && !url.starts_with("etcd") {
            ops.push((
                "migrate",
                bounded(&what, fenced::migrate(&url)).await.map(|_| ()),
            ));
        }
        for (op, result) in ops {
            match result {
                Err(e @ Error::Config { .. }) => {
                    let msg = one_line(&what, &e);
                    let lower = msg.to_lowercase();
                    if !words.iter().any(|w| lower.contains(&w.to_lowercase())) {
                        failures.push(format!("{op} {what}: message does not say what is wrong (want one of {words:?}): {msg}"));
                    }
                }
                Err(e) => failures.push(format!("{op} {what}: expected Config, got {e:?}")),
                Ok(()) => failures.push(format!("{op} {what}: accepted")),
            }
        }
    }
    assert!(
        !dir.path().join("never.db").exists(),
        "a malformed sqlite URL created the database file"
    );
    assert!(
        failures.is_empty(),
        "{} malformed URLs mishandled:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

/// Parameters nobody knows must be errors too: a typo such as `prefx=` or
/// `tabel=` otherwise silently puts the application in the *default*
/// namespace, shared with every other application that also kept it.
#[tokio::test]
async fn unknown_url_parameters_are_config_errors() {
    let cases = [
        "mysql://root@127.0.0.1:1/test?strategyy=row_lock",
        "mysql://root@127.0.0.1:1/test?tabel=jobs",
        "mysql://root@127.0.0.1:1/test?strategy=row_lock&strategy=optimistic",
        "redis://127.0.0.1:1?prefx=billing",
        "redis://127.0.0.1:1?prefix=a&prefix=b",
        "memory://?nope=1",
        "memory://somewhere",
    ];
    assert_connect_refuses_as_config(&cases, |_| None).await;
}

/// `connect` to each of `urls` must fail with a one-line `Config` error
/// whose message `check` finds nothing wrong with (it says what is wrong,
/// if anything); the test fails listing every URL handled otherwise.
async fn assert_connect_refuses_as_config(urls: &[&str], check: impl Fn(&str) -> Option<String>) {
    let mut failures = Vec::new();
    for &url in urls {
        match bounded(url, fenced::connect(url)).await {
            Err(e @ Error::Config { .. }) => {
                if let Some(wrong) = check(&one_line(url, &e)) {
                    failures.push(format!("{url}: {wrong}"));
                }
            }
            Err(e) => failures.push(format!("{url}: expected Config, got {e}")),
            Ok(_) => failures.push(format!("{url}: accepted")),
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// A port that is not a number from 1 to 65535 must not be replaced by a
/// default (which would make `etcd://127.0.0.1:99999/fz` dial 127.0.0.1:80).
#[tokio::test]
async fn etcd_urls_with_a_bad_port_are_config_errors() {
    let urls = [
        "etcd://127.0.0.1:99999/fz",
        "etcd://127.0.0.1:abc/fz",
        "etcd://127.0.0.1:0/fz",
        "etcd://127.0.0.1:2379,127.0.0.1:99999/fz",
    ];
    assert_connect_refuses_as_config(&urls, |msg| {
        (!msg.contains("port")).then(|| format!("message does not name the port: {msg}"))
    })
    .await;
}

/// `fenced migrate --url …` (and `fenced::migrate`) must not report success
/// for a URL that `connect` would refuse.
#[tokio::test]
async fn migrate_validates_urls_of_schemaless_stores() {
    let mut failures = Vec::new();
    for url in [
        "redis://127.0.0.1:1?prefix=a/b",
        "redis://127.0.0.1:1?connect_timeout=forever",
        "etcd://127.0.0.1:1/fz?nope=1",
        "etcd:///fz",
        "memory://?nope=1",
    ] {
        match bounded(url, fenced::migrate(url)).await {
            Err(Error::Config { .. }) => {}
            other => failures.push(format!("{url}: expected Config, got {other:?}")),
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// An unreachable server is a retryable `Backend` error (C19) whose one
/// line says what happened — refused, unreachable, timed out connecting —
/// rather than an internal symptom.
#[tokio::test]
async fn unreachable_stores_say_so() {
    let mut failures = Vec::new();
    for url in [
        "mysql://root@127.0.0.1:1/test?connect_timeout=1s",
        "redis://127.0.0.1:1?connect_timeout=1s",
        "etcd://127.0.0.1:1/fz?connect_timeout=1s",
    ] {
        match bounded(url, fenced::connect(url)).await {
            Err(e @ Error::Backend { .. }) if e.is_retryable() => {
                let msg = one_line(url, &e).to_lowercase();
                if !["refused", "unreachable", "connect"]
                    .iter()
                    .any(|w| msg.contains(w))
                {
                    failures.push(format!("{url}: {e}"));
                }
                // "connect" alone is also in "pool timed out while waiting
                // for an open connection": every store must name the server
                // and the cause, on one line, and say what to check.
                if !(msg.contains("127.0.0.1:1")
                    && msg.contains("refused")
                    && msg.contains("is the server running"))
                {
                    failures.push(format!(
                        "{url}: does not name the server and the cause: {e}"
                    ));
                }
            }
            other => failures.push(format!(
                "{url}: expected a retryable Backend error, got {other:?}"
            )),
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

// --------------------------------------------------------------- tables

fn invalid_tables(marker: &str) -> Vec<String> {
    vec![
        String::new(),
        format!("{marker}'x"),
        format!("{marker}\"x"),
        format!("{marker}`x"),
        format!("{marker}.x"),
        format!("test.{marker}"),
        format!("{marker};x"),
        format!("{marker} x"),
        format!("{marker}-x"),
        format!("{marker}%"),
        format!("{marker}\\x"),
        format!("{marker}/*x*/"),
        format!("{marker}é"),
        format!("1{marker}"),
        format!("{marker}{}", "a".repeat(49 - marker.len())),
        format!("{marker}{}", "a".repeat(65 - marker.len())),
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_table_names_are_config_errors_before_any_sql() {
    let server = mysql_server().await;
    let marker = format!("fzt{}", hex(10));
    let dir = tempfile::tempdir().expect("temp dir");
    let mut sqlite_bad = invalid_tables(&marker);
    sqlite_bad.extend([
        format!("{marker}UPPER"),
        "sqlite_master".into(),
        "sqlite_x".into(),
    ]);
    let mut failures = Vec::new();
    let mut check = |what: String, r: fenced::Result<()>| {
        if let Some(f) = table_failure(&what, r) {
            failures.push(f);
        }
    };
    for t in invalid_tables(&marker) {
        for strategy in STRATEGIES {
            // Port 1: a Config error here cannot have come from the server.
            let url = format!("mysql://root@127.0.0.1:1/test?strategy={strategy}&table={t}");
            check(
                format!("connect {url:?}"),
                fenced::connect(&url).await.map(|_| ()),
            );
            // The real server: still refused, and nothing created.
            let url = with_params(&server, &format!("strategy={strategy}&table={t}"));
            check(
                format!("migrate {url:?}"),
                fenced::migrate(&url).await.map(|_| ()),
            );
            check(
                format!("connect {url:?}"),
                fenced::connect(&url).await.map(|_| ()),
            );
            // The builder validates the same way.
            let built = async {
                fenced::mysql::MySqlLock::builder(&with_params(
                    &server,
                    &format!("strategy={strategy}"),
                ))?
                .table(t.clone())
                .migrate()
                .await
                .map(|_| ())
            };
            check(format!("builder table {t:?}"), built.await);
        }
    }
    for t in &sqlite_bad {
        let path = dir.path().join(format!("{}.db", hex(8)));
        let url = format!("sqlite://{}?table={t}", path.display());
        check(
            format!("connect {url:?}"),
            fenced::connect(&url).await.map(|_| ()),
        );
        check(
            format!("migrate {url:?}"),
            fenced::migrate(&url).await.map(|_| ()),
        );
        let built = async {
            fenced::sqlite::SqliteLock::builder(&format!("sqlite://{}", path.display()))?
                .table(t.clone())
                .connect()
                .await
                .map(|_| ())
        };
        check(format!("sqlite builder table {t:?}"), built.await);
        check(
            format!("sqlite table {t:?}: file created"),
            if path.exists() {
                Ok(())
            } else {
                Err(Error::config("table: not created"))
            },
        );
    }
    let pool = sqlx::MySqlPool::connect(&server).await.expect("admin pool");
    let created: Vec<String> = sqlx::query(
        "SELECT table_name FROM information_schema.tables WHERE table_name LIKE CONCAT(?, '%')",
    )
    .bind(&marker)
    .fetch_all(&pool)
    .await
    .expect("information_schema")
    .iter()
    .map(|r| r.get::<String, _>(0))
    .collect();
    pool.close().await;
    assert!(
        created.is_empty(),
        "tables created from invalid names: {created:?}"
    );
    assert!(
        failures.is_empty(),
        "{} cases mishandled:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

/// `None` when `r` is a one-line `Config` error naming the table.
fn table_failure(what: &str, r: fenced::Result<()>) -> Option<String> {
    match r {
        Err(e @ Error::Config { .. }) => {
            let msg = one_line(what, &e);
            (!msg.to_lowercase().contains("table"))
                .then(|| format!("{what}: message does not name the table: {msg}"))
        }
        Err(e) => Some(format!("{what}: expected Config, got {e}")),
        Ok(()) => Some(format!("{what}: accepted")),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reserved_words_and_the_longest_table_name_work() {
    let server = mysql_server().await;
    let database = format!("fzdb_{}", hex(12));
    let pool = sqlx::MySqlPool::connect(&server).await.expect("admin pool");
    sqlx::query(AssertSqlSafe(format!("CREATE DATABASE `{database}`")))
        .execute(&pool)
        .await
        .expect("create database");
    let (base, _) = server.split_once('?').unwrap_or((&server, ""));
    let db_url = format!(
        "{}/{database}",
        base.rsplit_once('/').expect("a /db in the URL").0
    );
    let longest = format!("fz{}", "l".repeat(46));
    assert_eq!(longest.len(), 48);
    let dir = tempfile::tempdir().expect("temp dir");
    let outcome = async {
        for table in ["select", "order", "key", "lock", longest.as_str()] {
            for strategy in STRATEGIES {
                let url = with_params(&db_url, &format!("strategy={strategy}&table={table}"));
                round_trip(&url).await.map_err(|e| format!("{url}: {e}"))?;
            }
            let url = format!(
                "sqlite://{}?table={table}",
                dir.path().join("r.db").display()
            );
            round_trip(&url).await.map_err(|e| format!("{url}: {e}"))?;
        }
        Ok::<(), String>(())
    }
    .await;
    let _ = sqlx::query(AssertSqlSafe(format!("DROP DATABASE `{database}`")))
        .execute(&pool)
        .await;
    pool.close().await;
    outcome.unwrap_or_else(|e| panic!("{e}"));
}

/// migrate + connect + acquire + inspect + release through the facade.
async fn round_trip(url: &str) -> fenced::Result<()> {
    bounded(url, fenced::migrate(url)).await?;
    let store = bounded(url, fenced::connect(url)).await?;
    let key = LockKey::new("rt")?;
    let lease = bounded(url, store.try_acquire(&key, &opts("rt")))
        .await?
        .ok_or_else(|| Error::config("free key reported held"))?;
    let info = bounded(url, store.inspect(&key)).await?;
    if info.map(|i| i.token) != Some(lease.token) {
        return Err(Error::config("inspect does not show the lease"));
    }
    if bounded(url, store.release(&lease)).await? != ReleaseOutcome::Released {
        return Err(Error::config("release did not release"));
    }
    Ok(())
}

// ------------------------------------------------- passwords and read-only

/// The error of a connect, or of the first acquire if the connect
/// succeeded. Never a success, never "held by someone else".
async fn first_failure(url: &str, key: &str) -> Error {
    let store = match bounded(url, fenced::connect(url)).await {
        Err(e) => return e,
        Ok(s) => s,
    };
    let key = LockKey::new(key).expect("key");
    match bounded(url, store.try_acquire(&key, &opts("intruder"))).await {
        Err(e) => {
            let waited = bounded(
                url,
                store.acquire(
                    &key,
                    &LockOptions::builder()
                        .wait_timeout(Duration::from_secs(1))
                        .build()
                        .expect("options"),
                ),
            )
            .await
            .expect_err("acquire after a failed try_acquire succeeded");
            assert!(
                !matches!(waited, Error::Timeout { .. }),
                "{url}: acquire reports a contended key instead of the real failure: {waited}"
            );
            e
        }
        Ok(Some(_)) => panic!("{}: acquire reported success", fenced::redact(url)),
        Ok(None) => panic!(
            "{}: acquire reported the key as held by someone else instead of an error",
            fenced::redact(url)
        ),
    }
}

/// The error of `url` as [`first_failure`] finds it, checked to be a clear
/// refusal: a `Backend` or `Config` error that retrying cannot cure (`why`
/// says what should not be retried), on one line that mentions one of
/// `any_of`. Returns the error and that line.
async fn clear_refusal(
    url: &str,
    key: &str,
    what: &str,
    why: &str,
    any_of: &[&str],
) -> (Error, String) {
    let e = first_failure(url, key).await;
    assert!(
        matches!(e, Error::Backend { .. } | Error::Config { .. }),
        "{what}: {e:?}"
    );
    assert!(!e.is_retryable(), "{what}: {why} not retryable: {e}");
    let msg = one_line(what, &e);
    println!("{what}: {msg}");
    assert_mentions(what, &msg, any_of);
    (e, msg)
}

/// The shared MariaDB's URL, a user made there for this test with
/// `password` and `grant`, and every backend opened, with a snapshot of each
/// store taken before the test.
async fn mysql_user_and_stores(
    prefix: &str,
    password: &str,
    grant: &str,
) -> (String, TempMysqlUser, Stores, Vec<Vec<String>>) {
    let server = mysql_server().await;
    let temp = TempMysqlUser::create(&server, prefix, password, grant, None).await;
    let stores = Stores::open().await;
    let before = stores.snapshots().await;
    (server, temp, stores, before)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_mysql_password_is_a_clear_error_and_writes_nothing() {
    let right = format!("Right-{}", hex(8));
    let wrong = format!("Wrong-{}", hex(8));
    let (server, temp, stores, before) = mysql_user_and_stores("fzu", &right, "ALL").await;
    for (b, before) in stores.backends.iter().zip(&before) {
        let Some(url) = b.mysql_url(&server, &temp.name, &wrong) else {
            continue;
        };
        let what = format!("{}: wrong password", b.name);
        let (e, msg) = clear_refusal(
            &url,
            "pw",
            &what,
            "a wrong password is",
            &["access denied", "password", "authentication"],
        )
        .await;
        assert!(
            !msg.contains(&wrong) && !format!("{e:?}").contains(&wrong),
            "{what}: {msg}"
        );
        stores.assert_untouched(b, before, "a wrong password").await;
        // The right password works: the test can fail.
        let url = b.mysql_url(&server, &temp.name, &right).expect("MySQL");
        let store = bounded(&what, fenced::connect(&url))
            .await
            .unwrap_or_else(|e| panic!("{what}: the right password fails too: {e}"));
        let key = LockKey::new("pw").expect("key");
        let lease = store
            .try_acquire(&key, &opts("me"))
            .await
            .expect("acquire")
            .expect("free");
        store.release(&lease).await.expect("release");
    }
    stores.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn read_only_mysql_user_never_reports_success() {
    let pw = format!("Ro-{}", hex(8));
    let (server, temp, stores, before) = mysql_user_and_stores("fzr", &pw, "SELECT").await;
    for (b, before) in stores.backends.iter().zip(&before) {
        let Some(url) = b.mysql_url(&server, &temp.name, &pw) else {
            continue;
        };
        let what = format!("{}: SELECT-only user", b.name);
        clear_refusal(
            &url,
            "ro",
            &what,
            "missing privileges are",
            &["denied", "read-only", "read only", "privilege"],
        )
        .await;
        stores.assert_untouched(b, before, "a read-only user").await;
    }
    stores.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn read_only_mysql_server_is_refused() {
    let db = PrivateMariaDb::start(MariaDbOptions::default())
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let table = "fz_ro";
    for strategy in STRATEGIES {
        fenced::migrate(&with_params(
            &db.url(),
            &format!("strategy={strategy}&table={table}"),
        ))
        .await
        .expect("migrate");
    }
    let pool = sqlx::MySqlPool::connect(&db.url()).await.expect("pool");
    let before = mysql_snapshot(&pool, table).await;
    db.set_read_only(true).await.expect("read_only");
    for strategy in STRATEGIES {
        let url = with_params(&db.url(), &format!("strategy={strategy}&table={table}"));
        let what = format!("read_only server, {strategy}");
        clear_refusal(
            &url,
            "ro",
            &what,
            "a read-only server is",
            &["read-only", "read only", "read_only"],
        )
        .await;
    }
    assert_eq!(
        mysql_snapshot(&pool, table).await,
        before,
        "rows written to a read-only server"
    );
    pool.close().await;
}

/// Each of `cases` (a URL with bad credentials and what is bad about them)
/// is a [`clear_refusal`] naming one of `any_of` and neither of `secrets`.
async fn refuse_credentials(
    store: &str,
    cases: &[(String, &str)],
    any_of: &[&str],
    secrets: [&str; 2],
) {
    for (url, what) in cases {
        let what = format!("{store}, {what}");
        let (_, msg) = clear_refusal(url, "pw", &what, "authentication failures are", any_of).await;
        assert!(
            !msg.contains(secrets[0]) && !msg.contains(secrets[1]),
            "{what}: {msg}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_redis_password_is_a_clear_error_and_writes_nothing() {
    let right = format!("Right-{}", hex(8));
    let wrong = format!("Wrong-{}", hex(8));
    let server = PrivateRedis::start(RedisOptions {
        password: Some(right.clone()),
        ..RedisOptions::default()
    })
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    let port = server.port();
    let cases = [
        (
            format!("redis://:{wrong}@127.0.0.1:{port}?prefix=fz"),
            "wrong password",
        ),
        (
            format!("redis://default:{wrong}@127.0.0.1:{port}?prefix=fz"),
            "wrong password (user)",
        ),
        (
            format!("redis://nobody:{right}@127.0.0.1:{port}?prefix=fz"),
            "unknown user",
        ),
        (format!("redis://127.0.0.1:{port}?prefix=fz"), "no password"),
    ];
    refuse_credentials(
        "redis",
        &cases,
        &["auth", "password", "wrongpass", "noauth"],
        [&right, &wrong],
    )
    .await;
    let mut admin = server.admin().await.expect("admin");
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg("*")
        .query_async(&mut admin)
        .await
        .expect("KEYS");
    assert!(keys.is_empty(), "written without the password: {keys:?}");
    // The right password works: the test can fail.
    round_trip(&format!("redis://:{right}@127.0.0.1:{port}?prefix=fz"))
        .await
        .unwrap_or_else(|e| panic!("the right password fails too: {e}"));
}

/// A misconfigured password should fail at start-up (`connect`), as it does
/// for MySQL and etcd, not at the first lock request in production.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_redis_password_fails_at_connect() {
    let right = format!("Right-{}", hex(8));
    let server = PrivateRedis::start(RedisOptions {
        password: Some(right),
        ..RedisOptions::default()
    })
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    for url in [
        format!("redis://:Wrong-{}@127.0.0.1:{}", hex(8), server.port()),
        format!("redis://127.0.0.1:{}", server.port()),
    ] {
        match bounded(&url, fenced::connect(&url)).await {
            Err(e) => {
                one_line(&url, &e);
            }
            Ok(store) => panic!("{}: connect succeeded: {store:?}", fenced::redact(&url)),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_etcd_password_is_a_clear_error_and_writes_nothing() {
    let right = format!("Right-{}", hex(8));
    let wrong = format!("Wrong-{}", hex(8));
    let etcd = PrivateEtcd::start(EtcdOptions::default())
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    etcd.enable_auth(&right)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let hp = etcd.hostports();
    let cases = [
        (format!("etcd://root:{wrong}@{hp}/fz"), "wrong password"),
        (format!("etcd://nobody:{right}@{hp}/fz"), "unknown user"),
        (format!("etcd://{hp}/fz"), "no credentials"),
    ];
    refuse_credentials(
        "etcd",
        &cases,
        &["auth", "password", "permission", "user"],
        [&right, &wrong],
    )
    .await;
    let mut admin = etcd.admin_client(0).await.expect("admin");
    let n = admin
        .get(
            "",
            Some(GetOptions::new().with_all_keys().with_count_only()),
        )
        .await
        .expect("count")
        .count();
    assert_eq!(n, 0, "keys written without valid credentials");
    round_trip(&format!("etcd://root:{right}@{hp}/fz"))
        .await
        .unwrap_or_else(|e| panic!("the right password fails too: {e}"));
}

// ------------------------------------------------------------ invalid UTF-8

/// `LockKey` has no bytes constructor (only `&str`/`String`), so invalid
/// UTF-8 cannot reach a store through the API. The one place fenced reads
/// raw bytes is the environment: `FENCED_URL` (what the CLI and
/// `fenced::default_url()` use). A non-UTF-8 value must be an error, not be
/// skipped in favour of the local SQLite default — that would silently lock
/// a file on one host instead of the shared store.
#[tokio::test]
async fn non_utf8_fenced_url_is_a_config_error() {
    use std::os::unix::ffi::OsStringExt;
    let out = std::process::Command::new(std::env::current_exe().expect("test binary"))
        .args([
            "child_default_url",
            "--exact",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(
            "FENCED_URL",
            std::ffi::OsString::from_vec(b"mysql://root@db\xff\xfe/app".to_vec()),
        )
        .env("FENCED_FAULTS_CHILD", "1")
        .output()
        .expect("running the child");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("CHILD-CONFIG-ERROR"),
        "child: {stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Helper of `non_utf8_fenced_url_is_a_config_error`: runs in a child
/// process whose environment holds a non-UTF-8 `FENCED_URL`.
#[test]
#[ignore = "helper: run in a child process by non_utf8_fenced_url_is_a_config_error"]
fn child_default_url() {
    assert_eq!(
        std::env::var("FENCED_FAULTS_CHILD").as_deref(),
        Ok("1"),
        "only meaningful inside non_utf8_fenced_url_is_a_config_error"
    );
    match fenced::default_url() {
        Err(e @ Error::Config { .. }) => {
            one_line("FENCED_URL", &e);
            println!("CHILD-CONFIG-ERROR {e}");
        }
        other => panic!("a non-UTF-8 FENCED_URL gave {other:?}"),
    }
}
