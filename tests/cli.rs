//! The `fenced` binary, end to end: several processes on one key with a
//! non-atomic read–sleep–write on a shared file, a frozen holder, exit codes.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::{
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use fenced_conformance::services;

const BIN: &str = env!("CARGO_BIN_EXE_fenced");

fn tmpdir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!(
        "fenced-cli-{tag}-{}",
        uuid::Uuid::new_v4().simple()
    ));
    std::fs::create_dir_all(&d).unwrap();
    d
}

async fn mysql_url(strategy: &str) -> String {
    let base = services::mysql_url();
    services::probe_mysql(&base)
        .await
        .unwrap_or_else(|m| panic!("{m}"));
    let table = format!(
        "fenced_cli_{}",
        &uuid::Uuid::new_v4().simple().to_string()[..10]
    );
    let url = format!("{base}?strategy={strategy}&table={table}");
    let out = Command::new(BIN)
        .args(["migrate", "--url", &url])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "migrate: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    url
}

#[cfg(feature = "etcd")]
async fn etcd_url() -> String {
    let base = services::etcd_url();
    services::probe_etcd(&base)
        .await
        .unwrap_or_else(|m| panic!("{m}"));
    let hp = services::host_port(&base, 2379).unwrap();
    format!("etcd://{hp}/fenced-cli-{}", uuid::Uuid::new_v4().simple())
}

/// N processes × `rounds` each run a shell command that reads a counter,
/// sleeps, and writes it back +1 — a lost update unless the lock excludes.
/// Each also logs `start end token`. Asserts no lost update, no overlapping
/// intervals and strictly increasing tokens in start order.
fn contend(url: &str, dir: &Path, procs: usize, rounds: usize) {
    let counter = dir.join("counter");
    let log = dir.join("log");
    std::fs::write(&counter, "0").unwrap();
    let script = format!(
        "s=$(date +%s%N); n=$(cat {c}); sleep 0.05; echo $((n+1)) > {c}; e=$(date +%s%N); echo \"$s $e $FENCED_TOKEN\" >> {l}",
        c = counter.display(),
        l = log.display()
    );
    let mut children = Vec::new();
    for _ in 0..procs {
        let (url, script) = (url.to_owned(), script.clone());
        children.push(std::thread::spawn(move || {
            for _ in 0..rounds {
                let out = Command::new(BIN)
                    .args([
                        "--url",
                        &url,
                        "run",
                        "--key",
                        "shared-counter",
                        "--ttl",
                        "10s",
                        "--wait",
                        "60s",
                        "--",
                        "sh",
                        "-c",
                        &script,
                    ])
                    .output()
                    .unwrap();
                assert!(
                    out.status.success(),
                    "fenced run failed: {:?} {}",
                    out.status,
                    String::from_utf8_lossy(&out.stderr)
                );
            }
        }));
    }
    for c in children {
        c.join().unwrap();
    }
    let total: usize = std::fs::read_to_string(&counter)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    assert_eq!(total, procs * rounds, "lost updates under {url}");
    let mut intervals: Vec<(u128, u128, u64)> = std::fs::read_to_string(&log)
        .unwrap()
        .lines()
        .map(|l| {
            let v: Vec<&str> = l.split_whitespace().collect();
            (
                v[0].parse().unwrap(),
                v[1].parse().unwrap(),
                v[2].parse().unwrap(),
            )
        })
        .collect();
    intervals.sort();
    assert_eq!(intervals.len(), procs * rounds);
    for w in intervals.windows(2) {
        assert!(
            w[1].0 >= w[0].1,
            "overlapping holders under {url}: {:?} and {:?}",
            w[0],
            w[1]
        );
        assert!(
            w[1].2 > w[0].2,
            "FENCED_TOKEN did not increase under {url}: {} then {}",
            w[0].2,
            w[1].2
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn processes_exclude_each_other_on_mysql() {
    for strategy in ["unique_key", "row_lock", "optimistic"] {
        let url = mysql_url(strategy).await;
        let dir = tmpdir(strategy);
        tokio::task::spawn_blocking(move || contend(&url, &dir, 4, 3))
            .await
            .unwrap();
    }
}

#[cfg(feature = "etcd")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn processes_exclude_each_other_on_etcd() {
    let url = etcd_url().await;
    let dir = tmpdir("etcd");
    tokio::task::spawn_blocking(move || contend(&url, &dir, 4, 3))
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn processes_exclude_each_other_on_redis() {
    let base = services::redis_url();
    services::probe_redis(&base)
        .await
        .unwrap_or_else(|m| panic!("{m}"));
    let url = format!(
        "{base}/0?prefix=fenced-cli-{}",
        uuid::Uuid::new_v4().simple()
    );
    let dir = tmpdir("redis");
    tokio::task::spawn_blocking(move || contend(&url, &dir, 4, 3))
        .await
        .unwrap();
}

/// A holder frozen past its TTL loses the lock; on resume it terminates its
/// command and exits with the "lost" code.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_holder_is_stopped_when_it_resumes() {
    use nix::{
        sys::signal::{kill, Signal},
        unistd::Pid,
    };
    let url = mysql_url("unique_key").await;
    let dir = tmpdir("frozen");
    let pidfile = dir.join("child.pid");
    let mut holder = std::process::Command::new(BIN)
        .args([
            "--url", &url, "run", "--key", "frozen", "--ttl", "2s", "--grace", "1s", "--", "sh",
            "-c",
        ])
        .arg(format!("echo $$ > {}; exec sleep 60", pidfile.display()))
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let start = Instant::now();
    while !pidfile.exists() {
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "the command never started"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    std::thread::sleep(Duration::from_millis(100));
    let child_pid: i32 = std::fs::read_to_string(&pidfile)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    let fenced_pid = Pid::from_raw(holder.id() as i32);
    kill(fenced_pid, Signal::SIGSTOP).unwrap();
    std::thread::sleep(Duration::from_millis(3500)); // past the 2 s TTL

    let other = Command::new(BIN)
        .args([
            "--url", &url, "run", "--key", "frozen", "--wait", "10s", "--", "true",
        ])
        .output()
        .unwrap();
    assert!(
        other.status.success(),
        "the lock was not taken over: {}",
        String::from_utf8_lossy(&other.stderr)
    );

    kill(fenced_pid, Signal::SIGCONT).unwrap();
    let deadline = Instant::now() + Duration::from_secs(15);
    let status = loop {
        if let Some(s) = holder.try_wait().unwrap() {
            break s;
        }
        assert!(Instant::now() < deadline, "the resumed holder did not exit");
        std::thread::sleep(Duration::from_millis(50));
    };
    let mut err = String::new();
    std::io::Read::read_to_string(holder.stderr.as_mut().unwrap(), &mut err).unwrap();
    assert_eq!(
        status.code(),
        Some(76),
        "expected the lost code; stderr: {err}"
    );
    assert!(err.contains("lost lock"), "{err}");
    // The command is gone (killed and reaped by fenced).
    assert!(
        kill(Pid::from_raw(child_pid), None).is_err(),
        "the command survived the loss"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exit_codes_are_distinct_and_documented() {
    let url = mysql_url("unique_key").await;
    let run = |args: &[&str]| Command::new(BIN).args(args).output().unwrap();

    // Held elsewhere, no wait: 75, and the command does not run.
    let dir = tmpdir("codes");
    let marker = dir.join("ran");
    let mut holder = std::process::Command::new(BIN)
        .args(["--url", &url, "run", "--key", "busy", "--", "sleep", "5"])
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(800));
    let out = run(&[
        "--url",
        &url,
        "run",
        "--key",
        "busy",
        "--",
        "touch",
        marker.to_str().unwrap(),
    ]);
    assert_eq!(
        out.status.code(),
        Some(75),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!marker.exists(), "the command ran without the lock");
    let _ = holder.kill();
    let _ = holder.wait();

    // The command's own code passes through; FENCED_KEY is set.
    let out = run(&[
        "--url",
        &url,
        "run",
        "--key",
        "codes",
        "--",
        "sh",
        "-c",
        "test \"$FENCED_KEY\" = codes && exit 7",
    ]);
    assert_eq!(out.status.code(), Some(7));
    // Killed by a signal: 128 + N.
    let out = run(&[
        "--url",
        &url,
        "run",
        "--key",
        "codes",
        "--",
        "sh",
        "-c",
        "kill -9 $$",
    ]);
    assert_eq!(out.status.code(), Some(137));
    // Missing command: 127.
    let out = run(&[
        "--url",
        &url,
        "run",
        "--key",
        "codes",
        "--",
        "/nonexistent/cmd",
    ]);
    assert_eq!(out.status.code(), Some(127));
    // Bad key, bad URL: 78, one line that says what is wrong.
    let out = run(&["--url", &url, "run", "--key", "", "--", "true"]);
    assert_eq!(out.status.code(), Some(78));
    let out = run(&["--url", "nope://x", "run", "--key", "k", "--", "true"]);
    assert_eq!(out.status.code(), Some(78));
    assert_eq!(String::from_utf8_lossy(&out.stderr).lines().count(), 1);
    // Unreachable store: 69.
    let out = run(&[
        "--url",
        "mysql://root@127.0.0.1:1/test?connect_timeout=1s",
        "run",
        "--key",
        "k",
        "--",
        "true",
    ]);
    assert_eq!(
        out.status.code(),
        Some(69),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Bad duration: clap's usage error (2).
    let out = run(&[
        "--url", &url, "run", "--key", "k", "--ttl", "soon", "--", "true",
    ]);
    assert_eq!(out.status.code(), Some(2));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_and_force_release() {
    let dir = tmpdir("status");
    let url = format!("sqlite://{}/locks.db", dir.display());
    let mut holder = std::process::Command::new(BIN)
        .args(["--url", &url, "run", "--key", "admin", "--", "sleep", "30"])
        .spawn()
        .unwrap();
    let start = Instant::now();
    let held = loop {
        let out = Command::new(BIN)
            .args(["--url", &url, "status", "--json", "admin", "other"])
            .output()
            .unwrap();
        assert!(out.status.success());
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        if v[0]["held"] == true {
            break v;
        }
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "never saw the lock held"
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(held[0]["token"].as_u64().unwrap() >= 1);
    assert_eq!(held[1]["held"], false);
    let table = Command::new(BIN)
        .args(["--url", &url, "status", "admin"])
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&table.stdout).contains("admin"));

    let out = Command::new(BIN)
        .args(["--url", &url, "release", "--force", "admin"])
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&out.stdout).contains("released"));
    // The evicted holder notices at its next renewal and stops its command.
    let deadline = Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(s) = holder.try_wait().unwrap() {
            break s;
        }
        assert!(Instant::now() < deadline, "the evicted holder kept running");
        std::thread::sleep(Duration::from_millis(100));
    };
    assert_eq!(status.code(), Some(76));
    // `release` without --force is refused by the argument parser.
    let out = Command::new(BIN)
        .args(["--url", &url, "release", "admin"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
}

/// With no --url and no FENCED_URL, `fenced run` uses the embedded SQLite
/// file under FENCED_HOME (or the XDG state directory): no server needed.
#[test]
fn the_embedded_default_needs_no_configuration() {
    let home = tmpdir("home");
    let dir = tmpdir("default");
    let run = |dir: &Path| {
        Command::new(BIN)
            .env_remove("FENCED_URL")
            .env("FENCED_HOME", &home)
            .args(["run", "--key", "demo", "--wait", "30s", "--", "sh", "-c"])
            .arg(format!("echo $FENCED_TOKEN >> {}/tokens", dir.display()))
            .output()
            .unwrap()
    };
    for _ in 0..3 {
        let out = run(&dir);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    assert!(
        home.join("locks.db").exists(),
        "the default file was not created under FENCED_HOME"
    );
    let tokens: Vec<u64> = std::fs::read_to_string(dir.join("tokens"))
        .unwrap()
        .lines()
        .map(|l| l.trim().parse().unwrap())
        .collect();
    assert_eq!(tokens.len(), 3);
    assert!(tokens.windows(2).all(|w| w[1] > w[0]), "{tokens:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn processes_exclude_each_other_on_sqlite() {
    let dir = tmpdir("sqlite");
    let url = format!("sqlite://{}/locks.db", dir.display());
    tokio::task::spawn_blocking(move || contend(&url, &dir, 4, 3))
        .await
        .unwrap();
}
