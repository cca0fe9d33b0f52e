//! Helpers shared by the CLI's integration tests: the binary, scratch
//! directories, a URL per store.

#![allow(dead_code, unreachable_pub, clippy::unwrap_used, clippy::expect_used)]

use std::{
    path::Path,
    process::{Child, Command, ExitStatus, Output},
    time::{Duration, Instant},
};

use fenced_conformance::services;

pub const BIN: &str = env!("CARGO_BIN_EXE_fenced");

/// A test's scratch directory, removed when dropped — whether the test
/// passed or failed, so that runs leave nothing behind in `/tmp`.
pub struct Scratch(tempfile::TempDir);

impl std::ops::Deref for Scratch {
    type Target = Path;
    fn deref(&self) -> &Path {
        self.0.path()
    }
}

impl AsRef<std::ffi::OsStr> for Scratch {
    fn as_ref(&self) -> &std::ffi::OsStr {
        self.0.path().as_os_str()
    }
}

impl AsRef<Path> for Scratch {
    fn as_ref(&self) -> &Path {
        self.0.path()
    }
}

pub fn tmpdir(tag: &str) -> Scratch {
    Scratch(
        tempfile::Builder::new()
            .prefix(&format!("fenced-cli-{tag}-"))
            .tempdir()
            .unwrap(),
    )
}

/// A scratch directory and the URL of a SQLite store in it.
pub fn sqlite_store(tag: &str) -> (Scratch, String) {
    let dir = tmpdir(tag);
    let url = format!("sqlite://{}/locks.db", dir.display());
    (dir, url)
}

/// `fenced ARGS…`, run to its end.
pub fn fenced(args: &[&str]) -> Output {
    Command::new(BIN).args(args).output().unwrap()
}

/// Fails naming `what`, the exit status and the stderr unless `out` is a
/// success.
pub fn assert_success(out: &Output, what: &str) {
    assert!(
        out.status.success(),
        "{what}: {:?}: {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Fails showing the stderr unless `out` exited with `code`.
pub fn assert_exit(out: &Output, code: i32) {
    assert_eq!(
        out.status.code(),
        Some(code),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `fenced --url URL status EXTRA…`.
pub fn status(url: &str, extra: &[&str]) -> Output {
    Command::new(BIN)
        .args(["--url", url, "status"])
        .args(extra)
        .output()
        .unwrap()
}

/// `fenced --url URL status --json KEYS…`, which must succeed, parsed.
pub fn status_json(url: &str, keys: &[&str]) -> serde_json::Value {
    let out = status(url, &[&["--json"][..], keys].concat());
    assert_success(&out, &format!("{url}: status"));
    serde_json::from_slice(&out.stdout).unwrap()
}

pub async fn mysql_url(strategy: &str) -> String {
    let base = services::mysql_url();
    services::probe_mysql(&base)
        .await
        .unwrap_or_else(|m| panic!("{m}"));
    let table = format!(
        "fenced_cli_{}",
        &uuid::Uuid::new_v4().simple().to_string()[..10]
    );
    let url = format!("{base}?strategy={strategy}&table={table}");
    assert_success(&fenced(&["migrate", "--url", &url]), "migrate");
    url
}

/// A PostgreSQL URL with `strategy` and a table of its own, migrated.
#[cfg(feature = "postgres")]
pub async fn postgres_url(strategy: &str) -> String {
    let base = services::postgres_url();
    services::probe_postgres(&base)
        .await
        .unwrap_or_else(|m| panic!("{m}"));
    let table = format!(
        "fenced_cli_{}",
        &uuid::Uuid::new_v4().simple().to_string()[..10]
    );
    let url = format!("{base}?strategy={strategy}&table={table}");
    assert_success(&fenced(&["migrate", "--url", &url]), "migrate");
    url
}

#[cfg(feature = "etcd")]
pub async fn etcd_url() -> String {
    let base = services::etcd_url();
    services::probe_etcd(&base)
        .await
        .unwrap_or_else(|m| panic!("{m}"));
    let hp = services::host_port(&base, 2379).unwrap();
    format!("etcd://{hp}/fenced-cli-{}", uuid::Uuid::new_v4().simple())
}

/// A Redis URL with a prefix of its own.
pub async fn redis_url() -> String {
    let base = services::redis_url();
    services::probe_redis(&base)
        .await
        .unwrap_or_else(|m| panic!("{m}"));
    format!(
        "{base}/0?prefix=fenced-cli-{}",
        uuid::Uuid::new_v4().simple()
    )
}

/// Waits for `child` at most `bound` (a hang bound, not a timing claim);
/// kills it and fails with `what` if it is still running then.
pub fn wait_bounded(child: &mut std::process::Child, bound: Duration, what: &str) -> ExitStatus {
    let deadline = Instant::now() + bound;
    loop {
        if let Some(s) = child.try_wait().unwrap() {
            return s;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{what}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// SIGTERM to `child`, then [`wait_bounded`] for 30 s (`what` says what
/// went wrong if it is still running).
pub fn terminate(child: &mut Child, what: &str) -> ExitStatus {
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(i32::try_from(child.id()).unwrap()),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    wait_bounded(child, Duration::from_secs(30), what)
}

/// Polls until `path` exists and holds a pid.
pub fn read_pid(path: &Path) -> i32 {
    let start = Instant::now();
    loop {
        if let Ok(s) = std::fs::read_to_string(path) {
            if let Ok(pid) = s.trim().parse() {
                return pid;
            }
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "the command never started"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Whether `pid` runs: exists and is not a zombie (a killed orphan stays
/// one until its new parent reaps it, which on some machines is never).
pub fn alive(pid: i32) -> bool {
    if nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), None).is_err() {
        return false;
    }
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().next())
            .is_some_and(|state| state != "Z" && state != "X"),
        Err(_) => false,
    }
}

/// `fenced status --json KEY` → whether KEY is held.
pub fn held(url: &str, key: &str) -> bool {
    status_json(url, &[key])[0]["held"] == true
}

/// `fenced status --json KEYS…` polled until the first key is held (at most
/// `bound`, a hang bound); the parsed answer.
pub fn status_once_held(url: &str, keys: &[&str], bound: Duration) -> serde_json::Value {
    let start = Instant::now();
    loop {
        let v = status_json(url, keys);
        if v[0]["held"] == true {
            return v;
        }
        assert!(
            start.elapsed() < bound,
            "{url}: never saw `{}` held",
            keys[0]
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}
