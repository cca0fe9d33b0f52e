//! Security.
//!
//! * TLS to MySQL/MariaDB (`ssl-mode`), Redis (`rediss://`) and etcd
//!   (`etcds://`), each against a private server whose certificate is signed
//!   by a CA generated here: a locked round trip with the right CA, a
//!   failure with a wrong one, no plaintext fallback.
//! * Passwords never appear in `Debug`, `Display`, errors or logs (every
//!   `tracing` event and `log` record is captured at TRACE).
//! * Owner tokens are random and unguessable; only the owner token (or an
//!   administrator's `force_release`) frees a lock.
//!
//! The threat model these tests back is `SECURITY.md` at the repository root.
//!
//! Some TLS clients only trust the platform's roots (`SSL_CERT_FILE`); those
//! checks run in a child process of this test binary with `SSL_CERT_FILE`
//! pointing at the test CA (`tls_child`), so the environment of the other
//! tests is never touched.

// Test helpers outside #[test] functions panic on purpose, like the tests.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::{
    collections::HashSet,
    path::Path,
    sync::{Arc, Mutex, OnceLock},
    time::Duration,
};

use fenced::{
    etcd::etcd_client::{Certificate, Client, ConnectOptions, TlsOptions},
    DistributedLock, Error, Lease, LockClient, LockKey, LockOptions, Owner, ReleaseOutcome,
};
use fenced_conformance::services;
use fenced_faults::private::{
    EtcdOptions, MariaDbOptions, PrivateEtcd, PrivateMariaDb, PrivateRedis, PrivateRedisCluster,
    RedisOptions, TestCa,
};
use support::{
    bounded, drop_mysql_namespace, etcd_server, hex, mysql_server, redis_server, with_params,
    TempMysqlUser,
};

fn one_line(what: &str, e: &Error) -> String {
    let s = e.to_string();
    assert!(
        !s.contains('\n') && !s.trim().is_empty(),
        "{what}: not a one-line message: {s:?}"
    );
    s
}

/// migrate + connect + `LockClient` acquire + inspect + release.
async fn round_trip(url: &str) -> fenced::Result<u64> {
    bounded(url, fenced::migrate(url)).await?;
    let store = bounded(url, fenced::connect(url)).await?;
    let client = LockClient::new(store.clone());
    let key = format!("rt-{}", hex(8));
    let guard = bounded(url, client.acquire(key.as_str())).await?;
    let token = guard.token();
    let info = bounded(url, store.inspect(&LockKey::new(&key)?)).await?;
    if info.map(|i| i.token) != Some(token) {
        return Err(Error::config("inspect does not show the lease"));
    }
    bounded(url, guard.release()).await?;
    Ok(token.get())
}

// ------------------------------------------------------------ log capture

/// Every log line written while the returned guard lives on this thread
/// (TRACE, all targets, `log` records included). Tests using it run on a
/// current-thread runtime, so the tasks they spawn log here too.
#[derive(Clone, Default)]
struct Logs(Arc<Mutex<Vec<u8>>>);

struct LogWriter(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for LogWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for Logs {
    type Writer = LogWriter;
    fn make_writer(&'a self) -> LogWriter {
        LogWriter(self.0.clone())
    }
}

impl Logs {
    fn capture() -> (Logs, tracing::subscriber::DefaultGuard) {
        static LOG_BRIDGE: OnceLock<()> = OnceLock::new();
        LOG_BRIDGE.get_or_init(|| {
            // `log` records (sqlx, redis) become tracing events; if another
            // logger was installed first they are simply not seen.
            let _ = tracing_log::LogTracer::init();
        });
        let logs = Logs::default();
        let subscriber = tracing_subscriber::fmt()
            .with_writer(logs.clone())
            .with_max_level(tracing::Level::TRACE)
            .with_ansi(false)
            .finish();
        let guard = tracing::subscriber::set_default(subscriber);
        (logs, guard)
    }

    fn text(&self) -> String {
        String::from_utf8_lossy(
            &self
                .0
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner),
        )
        .into_owned()
    }
}

/// Fails when any of `secrets` occurs in `text`, showing where.
fn assert_no_secret(what: &str, text: &str, secrets: &[&str]) {
    for s in secrets {
        if let Some(at) = text.find(s) {
            let from = text.floor_char_boundary(at.saturating_sub(120));
            let to = text.ceil_char_boundary((at + s.len() + 60).min(text.len()));
            panic!("{what}: the password {s:?} leaks: …{}…", &text[from..to]);
        }
    }
}

/// A distinctive password. Its random core alone is also looked for, so a
/// partial echo (a truncated or differently quoted password) is caught too.
struct Secret {
    plain: String,
    core: String,
}

impl Secret {
    fn new() -> Self {
        let core = hex(12);
        Secret {
            plain: format!("Sekrit{core}Pw"),
            core,
        }
    }
    fn forms(&self) -> Vec<&str> {
        vec![self.plain.as_str(), self.core.as_str()]
    }
}

// --------------------------------------------------------------- passwords

#[tokio::test]
async fn passwords_never_appear_in_config_errors() {
    let (logs, _guard) = Logs::capture();
    let s = Secret::new();
    let pw = &s.plain;
    let urls = [
        format!("mysql://app:{pw}@127.0.0.1:1/test?strategy=mutex"),
        format!("mysql://app:{pw}@127.0.0.1:1/test?table=a.b"),
        format!("mysql://app:{pw}@127.0.0.1:99999/test"),
        format!("mysql://app:{pw}@127.0.0.1:1/test?connect_timeout=forever"),
        format!("mariadb://app:{pw}@127.0.0.1:1/test?max_connections=0"),
        format!("redis://:{pw}@127.0.0.1:1?prefix=a/b"),
        format!("redis://app:{pw}@127.0.0.1:1/notanumber"),
        format!("redis://:{pw}@127.0.0.1:99999"),
        format!("rediss://:{pw}@127.0.0.1:1?protocol=resp2"),
        format!("redis://:{pw}@127.0.0.1:1?operation_timeout=2h"),
        format!("etcd://root:{pw}@127.0.0.1:1/p?nope=1"),
        format!("etcd://root:{pw}@127.0.0.1:1/p?timeout=x"),
        format!("etcds://root:{pw}@/p"),
        format!("zookeeper://root:{pw}@127.0.0.1:1/p?nope=1"),
        format!("zk://root:{pw}@127.0.0.1:99999/p"),
        format!("consul://root:{pw}@127.0.0.1:1"),
        format!("root:{pw}@127.0.0.1:1"),
        format!("sqlite:///tmp/{pw}-never.db?table=a.b"),
    ];
    for (i, url) in urls.iter().enumerate() {
        let what = format!("case {i} ({})", url.split_once(':').map_or("", |(s, _)| s));
        if url.contains("://") && !url.starts_with("sqlite") {
            assert_no_secret("redact()", &fenced::redact(url), &s.forms());
        }
        let mut results = vec![bounded(&what, fenced::connect(url)).await.map(|_| ())];
        if url.starts_with("mysql") || url.starts_with("mariadb") {
            // migrate is a no-op that does not even parse other URLs
            // (bad_inputs.rs: migrate_validates_urls_of_schemaless_stores).
            results.push(bounded(&what, fenced::migrate(url)).await.map(|_| ()));
        }
        for r in results {
            let e = r.expect_err(&what);
            assert!(matches!(e, Error::Config { .. }), "{what}: {e:?}");
            one_line(&what, &e);
            if url.starts_with("sqlite") {
                continue; // a path is not a password
            }
            assert_no_secret(&format!("{what}: Display"), &e.to_string(), &s.forms());
            assert_no_secret(&format!("{what}: Debug"), &format!("{e:?}"), &s.forms());
        }
    }
    assert_no_secret("logs", &logs.text(), &s.forms());
}

#[tokio::test]
async fn passwords_never_appear_when_the_store_is_unreachable() {
    let (logs, _guard) = Logs::capture();
    let s = Secret::new();
    let pw = &s.plain;
    let mut urls = Vec::new();
    for strategy in ["unique_key", "row_lock", "optimistic"] {
        urls.push(format!(
            "mysql://app:{pw}@127.0.0.1:1/test?strategy={strategy}&connect_timeout=1s"
        ));
    }
    urls.extend([
        format!("redis://:{pw}@127.0.0.1:1?connect_timeout=1s"),
        format!("redis://app:{pw}@127.0.0.1:1/0?connect_timeout=1s"),
        format!("rediss://:{pw}@127.0.0.1:1?connect_timeout=1s"),
        format!("etcd://root:{pw}@127.0.0.1:1/p?connect_timeout=1s"),
        format!("etcds://root:{pw}@127.0.0.1:1/p?connect_timeout=1s"),
    ]);
    for url in &urls {
        let what = fenced::redact(url);
        for r in [
            bounded(&what, fenced::connect(url)).await.map(|_| ()),
            bounded(&what, fenced::migrate(url)).await.map(|_| ()),
        ] {
            let e = match r {
                Ok(()) if !url.starts_with("mysql") => continue, // migrate: no schema
                Ok(()) => panic!("{what}: succeeded against a closed port"),
                Err(e) => e,
            };
            assert!(
                matches!(e, Error::Backend { .. }) && e.is_retryable(),
                "{what}: an unreachable store must be a retryable Backend error: {e:?}"
            );
            one_line(&what, &e);
            assert_no_secret(&format!("{what}: Display"), &e.to_string(), &s.forms());
            assert_no_secret(&format!("{what}: Debug"), &format!("{e:?}"), &s.forms());
        }
    }
    assert_no_secret("logs", &logs.text(), &s.forms());
}

/// Wrong and right passwords against real servers: errors, handles, guards
/// and every log line of a full locked round trip stay free of both.
#[tokio::test]
async fn passwords_never_appear_on_authentication_failure_or_success() {
    let right = Secret::new();
    let wrong = Secret::new();
    let secrets: Vec<&str> = right.forms().into_iter().chain(wrong.forms()).collect();

    // MySQL: a user of this test on the shared server.
    let server = mysql_server().await;
    let table = format!("fz_sec_{}", hex(12));
    let temp =
        TempMysqlUser::create(&server, "fzs", &right.plain, "ALL", Some(table.clone())).await;
    let user = temp.name.as_str();
    let hostport = services::host_port(&server, 3306).expect("host");
    let mysql = |pw: &str| format!("mysql://{user}:{pw}@{hostport}/test?table={table}");
    // Redis and etcd: private servers with authentication on.
    let redis = PrivateRedis::start(RedisOptions {
        password: Some(right.plain.clone()),
        ..RedisOptions::default()
    })
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    let etcd = PrivateEtcd::start(EtcdOptions::default())
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    etcd.enable_auth(&right.plain)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    // From here on every log line is captured (the setup above logs the
    // passwords itself: sqlx traces `CREATE USER … IDENTIFIED BY`).
    let (logs, _guard) = Logs::capture();
    let redis_url = |pw: &str| format!("redis://:{pw}@127.0.0.1:{}?prefix=fz", redis.port());
    let etcd_url = |pw: &str| format!("etcd://root:{pw}@{}/fz", etcd.hostports());

    {
        for url in [
            mysql(&wrong.plain),
            redis_url(&wrong.plain),
            etcd_url(&wrong.plain),
        ] {
            let what = fenced::redact(&url);
            // The failure may come at connect or at the first operation
            // (fenced-redis connects lazily); either way it is an error.
            let (e, shown) = match bounded(&what, fenced::connect(&url)).await {
                Err(e) => (e, String::new()),
                Ok(store) => {
                    let key = LockKey::new("pw").expect("key");
                    let e = bounded(&what, store.try_acquire(&key, &LockOptions::default()))
                        .await
                        .expect_err("a wrong password acquired a lock");
                    (e, format!("{store:?}"))
                }
            };
            assert_no_secret(&format!("{what}: Debug of the handle"), &shown, &secrets);
            one_line(&what, &e);
            assert_no_secret(&format!("{what}: Display"), &e.to_string(), &secrets);
            assert_no_secret(&format!("{what}: Debug"), &format!("{e:?}"), &secrets);
        }
        for url in [
            mysql(&right.plain),
            redis_url(&right.plain),
            etcd_url(&right.plain),
        ] {
            let what = fenced::redact(&url);
            bounded(&what, fenced::migrate(&url))
                .await
                .unwrap_or_else(|e| panic!("{what}: {e}"));
            let store = bounded(&what, fenced::connect(&url))
                .await
                .unwrap_or_else(|e| panic!("{what}: {e}"));
            let client = LockClient::builder(store.clone())
                .ttl(Duration::from_secs(3))
                .build()
                .expect("client");
            let guard = bounded(&what, client.acquire(format!("pw-{}", hex(6))))
                .await
                .unwrap_or_else(|e| panic!("{what}: {e}"));
            // Let the watchdog renew once (every ttl/3) so renewals log too.
            tokio::time::sleep(Duration::from_millis(1200)).await;
            let info = bounded(&what, store.inspect(guard.key())).await;
            let shown = format!(
                "{store:?} {client:?} {guard:?} {:?} {info:?} {:?}",
                guard.handle().lease(),
                store.capabilities()
            );
            assert_no_secret(&format!("{what}: Debug of handles"), &shown, &secrets);
            bounded(&what, guard.release())
                .await
                .unwrap_or_else(|e| panic!("{what}: {e}"));
        }
    }
    let text = logs.text();
    assert!(
        text.contains("TRACE") || text.contains("DEBUG"),
        "the log capture saw nothing; it would not catch a leak"
    );
    assert_no_secret("logs", &text, &secrets);
}

/// A password with a character that should have been percent-encoded
/// (`/`, `#`, `?`, `@`) must not be echoed either: the URL then fails to
/// parse, and the error message is where it would leak.
#[tokio::test]
async fn passwords_with_unencoded_reserved_characters_are_not_echoed() {
    let (logs, _guard) = Logs::capture();
    let (a, b) = (format!("Alpha{}", hex(10)), format!("Bravo{}", hex(10)));
    let mut failures = Vec::new();
    for sep in ['/', '#', '?'] {
        let pw = format!("{a}{sep}{b}");
        for url in [
            format!("mysql://app:{pw}@127.0.0.1:1/test"),
            format!("redis://:{pw}@127.0.0.1:1"),
            format!("etcd://root:{pw}@127.0.0.1:1/p"),
        ] {
            let r = bounded(&url, fenced::connect(&url)).await.map(|_| ());
            let shown = match &r {
                Ok(()) => String::new(),
                Err(e) => format!("{e} {e:?}"),
            };
            if shown.contains(&a) || shown.contains(&b) {
                failures.push(format!("{sep:?} in a {} password: {shown}", &url[..5]));
            }
        }
    }
    let text = logs.text();
    if text.contains(&a) || text.contains(&b) {
        failures.push("the logs show it".into());
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

// ------------------------------------------------------------ owner tokens

/// The random part of an owner token as bits (hex digits of the string).
fn owner_bits(o: &Owner) -> Vec<bool> {
    o.as_str()
        .chars()
        .filter_map(|c| c.to_digit(16))
        .flat_map(|d| (0..4).rev().map(move |i| d >> i & 1 == 1))
        .collect()
}

/// For each bit position, how many of `draws` owners have it set.
fn bit_counts(draws: &[Owner]) -> Vec<usize> {
    let width = draws.iter().map(|o| owner_bits(o).len()).max().unwrap_or(0);
    let mut ones = vec![0usize; width];
    for o in draws {
        for (i, bit) in owner_bits(o).into_iter().enumerate() {
            ones[i] += usize::from(bit);
        }
    }
    ones
}

#[test]
fn owner_tokens_are_unique_and_unguessable() {
    const N: usize = 20_000;
    let draws: Vec<Owner> = (0..N).map(|_| Owner::random()).collect();
    let distinct: HashSet<&str> = draws.iter().map(Owner::as_str).collect();
    assert_eq!(distinct.len(), N, "two random owners were equal");
    let ones = bit_counts(&draws);
    // Bits that vary are fair coins (±5 % is > 14 standard deviations at N = 20 000).
    let varying: Vec<usize> = ones.iter().copied().filter(|&n| n > 0 && n < N).collect();
    for n in &varying {
        let share = *n as f64 / N as f64;
        assert!((0.45..=0.55).contains(&share), "a biased bit: {share}");
    }
    assert!(
        varying.len() >= 122,
        "only {} random bits in an owner token",
        varying.len()
    );
    // Owners given to leases by LockOptions are fresh random ones too.
    let opts = LockOptions::default();
    assert_ne!(opts.owner_or_random(), opts.owner_or_random());
}

#[test]
fn owner_tokens_carry_128_random_bits() {
    const N: usize = 4_000;
    let draws: Vec<Owner> = (0..N).map(|_| Owner::random()).collect();
    let ones = bit_counts(&draws);
    let fixed = ones.iter().filter(|&&n| n == 0 || n == N).count();
    let varying = ones.len() - fixed;
    assert!(
        varying >= 128,
        "{varying} random bits, {fixed} fixed bits in {:?}",
        draws[0]
    );
}

// -------------------------------------------------- who can release what

/// Every backend, each in a namespace of this run, and a guard that drops
/// the namespaces (tables, keys) afterwards — also when the test panics.
async fn all_backends(dir: &Path) -> (Vec<(String, Arc<dyn DistributedLock>)>, Namespaces) {
    let (mysql, redis, etcd) = tokio::join!(mysql_server(), redis_server(), etcd_server());
    let ns = Namespaces {
        mysql: mysql.clone(),
        redis: redis.clone(),
        etcd: etcd.clone(),
        table: format!("fz_sec_{}", hex(12)),
        prefix: format!("fz-sec-{}", hex(12)),
    };
    let mut urls = vec![
        ("memory".to_owned(), "memory://".to_owned()),
        (
            "sqlite".to_owned(),
            format!("sqlite://{}", dir.join("locks.db").display()),
        ),
    ];
    for strategy in ["unique_key", "row_lock", "optimistic"] {
        urls.push((
            format!("mysql/{strategy}"),
            with_params(&mysql, &format!("strategy={strategy}&table={}", ns.table)),
        ));
    }
    urls.push((
        "redis".into(),
        with_params(&redis, &format!("prefix={}", ns.prefix)),
    ));
    urls.push(("etcd".into(), format!("etcd://{etcd}/{}", ns.prefix)));
    let mut out = Vec::new();
    for (name, url) in urls {
        bounded(&url, fenced::migrate(&url))
            .await
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        let store = bounded(&url, fenced::connect(&url))
            .await
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        out.push((name, store));
    }
    (out, ns)
}

/// This run's namespaces on the shared servers; dropped with the guard.
struct Namespaces {
    mysql: String,
    redis: String,
    etcd: String,
    table: String,
    prefix: String,
}

impl Drop for Namespaces {
    fn drop(&mut self) {
        let (mysql, redis, etcd, table, prefix) = (
            self.mysql.clone(),
            self.redis.clone(),
            self.etcd.clone(),
            self.table.clone(),
            self.prefix.clone(),
        );
        // Own thread and runtime: works from any context, panics included.
        let _ = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            rt.block_on(async {
                drop_mysql_namespace(&mysql, &table).await;
                if let Ok(client) = fenced::redis::redis::Client::open(redis.as_str()) {
                    if let Ok(mut c) = client.get_multiplexed_async_connection().await {
                        let names: Vec<Vec<u8>> = fenced::redis::redis::cmd("KEYS")
                            .arg(format!("*{prefix}*"))
                            .query_async(&mut c)
                            .await
                            .unwrap_or_default();
                        if !names.is_empty() {
                            let _: fenced::redis::redis::RedisResult<i64> =
                                fenced::redis::redis::cmd("DEL")
                                    .arg(names)
                                    .query_async(&mut c)
                                    .await;
                        }
                    }
                }
                if let Ok(mut c) = Client::connect([format!("http://{etcd}")], None).await {
                    let _ = c
                        .delete(
                            prefix.as_str(),
                            Some(fenced::etcd::etcd_client::DeleteOptions::new().with_prefix()),
                        )
                        .await;
                }
            });
            Ok::<(), std::io::Error>(())
        })
        .join();
    }
}

/// The owner token is the capability: a lease with the right key and token
/// but another owner changes nothing; the holder's own lease, or an
/// administrator's `force_release`, does. (`inspect` shows the owner, so
/// anyone who can read the store can also act as the holder — see
/// SECURITY.md.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_the_owner_token_or_an_admin_frees_a_lock() {
    let dir = tempfile::tempdir().expect("temp dir");
    let (backends, _namespaces) = all_backends(dir.path()).await;
    for (name, store) in backends {
        let key = LockKey::new(format!("cap-{}", hex(10))).expect("key");
        let opts = LockOptions::builder()
            .ttl(Duration::from_secs(30))
            .build()
            .expect("options");
        let lease = bounded(&name, store.try_acquire(&key, &opts))
            .await
            .unwrap_or_else(|e| panic!("{name}: {e}"))
            .unwrap_or_else(|| panic!("{name}: free key refused"));
        // A forger who knows key and token but not the owner.
        let forged = Lease::new(
            key.clone(),
            Owner::random(),
            lease.token,
            lease.ttl,
            tokio::time::Instant::now(),
        );
        assert_eq!(
            bounded(&name, store.release(&forged))
                .await
                .unwrap_or_else(|e| panic!("{name}: {e}")),
            ReleaseOutcome::NotHeld,
            "{name}: a forged lease released the lock"
        );
        let e = bounded(&name, store.extend(&forged, Duration::from_secs(60)))
            .await
            .expect_err("a forged lease extended the lock");
        assert!(matches!(e, Error::LeaseLost { .. }), "{name}: {e:?}");
        // Nor does the right owner with another token (a stale lease).
        let stale = Lease::new(
            key.clone(),
            lease.owner.clone(),
            fenced::FencingToken::new(lease.token.get() + 1),
            lease.ttl,
            tokio::time::Instant::now(),
        );
        assert_eq!(
            bounded(&name, store.release(&stale))
                .await
                .expect("release"),
            ReleaseOutcome::NotHeld,
            "{name}: a lease with another token released the lock"
        );
        let info = bounded(&name, store.inspect(&key))
            .await
            .expect("inspect")
            .unwrap_or_else(|| panic!("{name}: the lock is gone"));
        assert_eq!(
            (info.owner.clone(), info.token),
            (lease.owner.clone(), lease.token)
        );
        // The administrator frees it; the holder learns at its next extend.
        assert!(
            bounded(&name, store.force_release(&key))
                .await
                .expect("force_release"),
            "{name}: force_release found nothing"
        );
        let e = bounded(&name, store.extend(&lease, Duration::from_secs(30)))
            .await
            .expect_err("extend after force_release");
        assert!(matches!(e, Error::LeaseLost { .. }), "{name}: {e:?}");
        assert_eq!(
            bounded(&name, store.release(&lease))
                .await
                .expect("release"),
            ReleaseOutcome::NotHeld,
            "{name}"
        );
    }
}

// -------------------------------------------------------------------- TLS

/// Runs `tls_child` in a child process that trusts only `ca` (through
/// `SSL_CERT_FILE`) and connects to `url`; returns its output. `expect_ok`
/// says whether the child must complete a round trip or must fail.
fn run_tls_child(url: &str, ca: &Path, expect_ok: bool) -> String {
    let out = std::process::Command::new(std::env::current_exe().expect("test binary"))
        .args([
            "tls_child",
            "--exact",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("SSL_CERT_FILE", ca)
        .env_remove("SSL_CERT_DIR")
        .env("FENCED_FAULTS_TLS_URL", url)
        .env(
            "FENCED_FAULTS_TLS_EXPECT",
            if expect_ok { "ok" } else { "err" },
        )
        .output()
        .expect("running the child");
    let text = format!(
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success() && text.contains("CHILD-DONE"),
        "child for {url} (expect {}): {text}",
        if expect_ok {
            "a round trip"
        } else {
            "a failure"
        }
    );
    text
}

/// Helper of the TLS tests: runs in a child process whose `SSL_CERT_FILE`
/// names the only CA to trust.
#[tokio::test]
#[ignore = "helper: run in a child process by the *_tls_* tests (needs SSL_CERT_FILE and FENCED_FAULTS_TLS_URL)"]
async fn tls_child() {
    let url = std::env::var("FENCED_FAULTS_TLS_URL")
        .expect("only meaningful inside the TLS tests: FENCED_FAULTS_TLS_URL is not set");
    let expect_ok = std::env::var("FENCED_FAULTS_TLS_EXPECT").as_deref() == Ok("ok");
    match round_trip(&url).await {
        Ok(token) if expect_ok => println!("CHILD-OK token {token}"),
        Err(e) if !expect_ok => {
            one_line(&url, &e);
            println!("CHILD-ERR {e}");
        }
        Ok(token) => panic!("{url}: a round trip succeeded (token {token}) but must fail"),
        Err(e) => panic!("{url}: {e}"),
    }
    println!("CHILD-DONE");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_tls_with_a_test_ca() {
    let dir = tempfile::tempdir().expect("temp dir");
    let ca = TestCa::new("fenced redis test CA").expect("CA");
    let other = TestCa::new("some other CA").expect("CA");
    let files = ca.issue_server(dir.path()).expect("server certificate");
    let other_ca = other.write_ca(dir.path(), "other.pem").expect("other CA");
    let server = PrivateRedis::start(RedisOptions {
        tls: Some(files.clone()),
        ..RedisOptions::default()
    })
    .await
    .unwrap_or_else(|e| panic!("redis-server with --tls-port: {e}"));
    let url = format!("{}?prefix=fz-tls", server.url());
    assert!(url.starts_with("rediss://"), "{url}");
    let ok = run_tls_child(&url, &files.ca, true);
    assert!(ok.contains("CHILD-OK"), "{ok}");
    let err = run_tls_child(&url, &other_ca, false);
    assert!(
        err.to_lowercase().contains("certificate") || err.to_lowercase().contains("tls"),
        "the wrong-CA failure should say why: {err}"
    );
    // A plaintext client on the TLS port fails (bounded), never succeeds.
    let plain = format!(
        "redis://127.0.0.1:{}?prefix=fz-tls&connect_timeout=2s",
        server.port()
    );
    let e = bounded(&plain, fenced::connect(&plain))
        .await
        .expect_err("plaintext against a TLS-only port");
    one_line(&plain, &e);
}

/// `rediss+cluster://` with the certificates verified: a TLS-only cluster
/// (clients, replication, cluster bus) whose nodes' certificate comes from a
/// test CA. A client trusting that CA (and nothing else) takes and gives back
/// a lock — on the seed it connects to and on the nodes the seed names — and
/// one trusting another CA is refused, saying why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_cluster_tls_with_a_test_ca() {
    let dir = tempfile::tempdir().expect("temp dir");
    let ca = TestCa::new("fenced redis cluster test CA").expect("CA");
    let other = TestCa::new("some other CA").expect("CA");
    let files = ca.issue_server(dir.path()).expect("server certificate");
    let other_ca = other.write_ca(dir.path(), "other.pem").expect("other CA");
    let cluster = PrivateRedisCluster::start_tls(3, 0, files.clone())
        .await
        .unwrap_or_else(|e| panic!("a TLS-only redis cluster: {e}"));
    let url = format!("{}?prefix=fz-cluster-tls", cluster.url());
    assert!(url.starts_with("rediss+cluster://"), "{url}");
    let ok = run_tls_child(&url, &files.ca, true);
    assert!(ok.contains("CHILD-OK"), "{ok}");
    let err = run_tls_child(&url, &other_ca, false);
    assert!(
        err.contains("certificate"),
        "the wrong-CA failure should say why: {err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_tls_fixture_verifies_and_wrong_cas_fail() {
    let dir = tempfile::tempdir().expect("temp dir");
    let ca = TestCa::new("fenced etcd test CA").expect("CA");
    let other = TestCa::new("some other CA").expect("CA");
    let files = ca.issue_server(dir.path()).expect("server certificate");
    let other_ca = other.write_ca(dir.path(), "other.pem").expect("other CA");
    let etcd = PrivateEtcd::start(EtcdOptions {
        tls: Some(files.clone()),
        ..EtcdOptions::default()
    })
    .await
    .unwrap_or_else(|e| panic!("etcd with a TLS client port: {e}"));
    // The fixture: etcd-client itself, given the CA, verifies the server…
    let mut admin = etcd.admin_client(0).await.expect("TLS admin client");
    admin.status().await.expect("status over TLS");
    // …and refuses it under another CA.
    let endpoint = etcd.endpoints().remove(0);
    let pem = std::fs::read(&other_ca).expect("other CA");
    let opts = ConnectOptions::new()
        .with_connect_timeout(Duration::from_secs(2))
        .with_timeout(Duration::from_secs(2))
        .with_tls(TlsOptions::new().ca_certificate(Certificate::from_pem(pem)));
    let wrong = async {
        let mut c = Client::connect([endpoint.clone()], Some(opts)).await?;
        c.status().await
    };
    assert!(
        bounded("etcd-client with a wrong CA", wrong).await.is_err(),
        "etcd-client accepted a certificate from another CA"
    );
    // fenced: a wrong CA fails, plaintext against the TLS port fails.
    let url = format!("{}?connect_timeout=2s", etcd.url("fz"));
    assert!(url.starts_with("etcds://"), "{url}");
    run_tls_child(&url, &other_ca, false);
    let plain = url.replacen("etcds://", "etcd://", 1);
    bounded(&plain, fenced::connect(&plain))
        .await
        .expect_err("plaintext against a TLS client port");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_tls_round_trip_with_the_test_ca() {
    let dir = tempfile::tempdir().expect("temp dir");
    let ca = TestCa::new("fenced etcd test CA").expect("CA");
    let files = ca.issue_server(dir.path()).expect("server certificate");
    let etcd = PrivateEtcd::start(EtcdOptions {
        tls: Some(files.clone()),
        ..EtcdOptions::default()
    })
    .await
    .unwrap_or_else(|e| panic!("etcd with a TLS client port: {e}"));
    let url = format!("{}?connect_timeout=2s", etcd.url("fz"));
    // The platform's roots (SSL_CERT_FILE names the test CA in the child).
    run_tls_child(&url, &files.ca, true);
    // Another CA in the platform's roots: refused.
    let other = TestCa::new("some other CA").expect("CA");
    let other_ca = other.write_ca(dir.path(), "other.pem").expect("other CA");
    run_tls_child(&url, &other_ca, false);
    // `ca=`: only that file is trusted, whatever the platform's roots say.
    let with_ca = format!("{url}&ca={}", files.ca.display());
    run_tls_child(&with_ca, &other_ca, true);
    let wrong_ca = format!("{url}&ca={}", other_ca.display());
    run_tls_child(&wrong_ca, &files.ca, false);
    let missing = format!("{url}&ca={}", dir.path().join("missing.pem").display());
    match bounded(&missing, fenced::connect(&missing)).await {
        Err(e @ Error::Config { .. }) => assert!(one_line(&missing, &e).contains("missing.pem")),
        Err(e) => panic!("{missing}: expected a Config error, got {e}"),
        Ok(_) => panic!("{missing}: connected with a CA file that does not exist"),
    }
}

/// A private MariaDB that serves TLS with the test CA's certificate and
/// refuses plaintext TCP clients (`require_secure_transport`).
async fn tls_mariadb(dir: &Path, ca: &TestCa) -> PrivateMariaDb {
    let files = ca.issue_server(dir).expect("server certificate");
    PrivateMariaDb::start(MariaDbOptions {
        tls: Some(files),
        require_secure_transport: true,
        ..MariaDbOptions::default()
    })
    .await
    .unwrap_or_else(|e| panic!("mariadbd with TLS: {e}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_tls_fixture_serves_verified_tls_only_and_wrong_cas_fail() {
    let dir = tempfile::tempdir().expect("temp dir");
    let ca = TestCa::new("fenced mariadb test CA").expect("CA");
    let other = TestCa::new("some other CA").expect("CA");
    let other_ca = other.write_ca(dir.path(), "other.pem").expect("other CA");
    let db = tls_mariadb(dir.path(), &ca).await;
    // The fixture: the mariadb client verifies the chain and gets TLS.
    let out = std::process::Command::new("mariadb")
        .arg(format!("--ssl-ca={}", dir.path().join("ca.pem").display()))
        .args([
            "--ssl-verify-server-cert",
            "-h",
            "127.0.0.1",
            "-u",
            "root",
            "-N",
            "-e",
        ])
        .arg("SHOW SESSION STATUS LIKE 'Ssl_version'")
        .arg(format!("-P{}", db.port()))
        .output()
        .expect("running the mariadb client (installed by scripts/services.sh)");
    let shown = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && shown.contains("TLS"),
        "mariadb client over TLS: {shown} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    // fenced: plaintext is refused by the server, a wrong CA by the client.
    for (url, why) in [
        (format!("{}?ssl-mode=DISABLED", db.url()), "plaintext"),
        (
            format!(
                "{}?ssl-mode=VERIFY_CA&ssl-ca={}",
                db.url(),
                other_ca.display()
            ),
            "wrong CA",
        ),
    ] {
        let e = bounded(&url, fenced::migrate(&url)).await.expect_err(why);
        let msg = one_line(why, &e);
        println!("{why}: {msg}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_tls_round_trip_with_the_test_ca() {
    let dir = tempfile::tempdir().expect("temp dir");
    let ca = TestCa::new("fenced mariadb test CA").expect("CA");
    let db = tls_mariadb(dir.path(), &ca).await;
    let ca_path = dir.path().join("ca.pem");
    for mode in ["REQUIRED", "VERIFY_CA", "VERIFY_IDENTITY"] {
        let url = format!(
            "{}?ssl-mode={mode}&ssl-ca={}&table=fz_tls",
            db.url(),
            ca_path.display()
        );
        round_trip(&url)
            .await
            .unwrap_or_else(|e| panic!("ssl-mode={mode}: {e}"));
    }
}
