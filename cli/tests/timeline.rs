//! `fenced run`'s timeline on a dead path, on every store: the command is
//! stopped — its grace over, SIGKILL sent — before the store can grant the
//! key to anyone else, and fenced exits promptly after its command even
//! though the release cannot reach the store. Plus the options that shape
//! it: `--grace` that does not fit `--ttl`, `--max-hold`, `--label`, and a
//! refused renewal (a genuine loss: SIGKILL, no grace).
//!
//! A dead path is the fault proxy's blackhole: every byte swallowed, no RST,
//! no FIN — what a partition or a frozen peer looks like. The holder talks
//! to the store through the proxy, the second client directly.
//!
//! SQLite has no network path to cut (the store is a local file), so the
//! dead-path tests do not run on it; the SQLite tests here cover the
//! timeline's other paths (`--max-hold`, a refused renewal).

// The measurements are printed (seen with --nocapture).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stderr)]

mod common;

use std::{
    path::{Path, PathBuf},
    process::{Child, Command, Output, Stdio},
    sync::Arc,
    time::{Duration, Instant},
};

use common::*;
use fenced_conformance::services;
use fenced_faults::proxy::FaultProxy;

/// The holder's lease: short, so that the tests are quick; the grace fits
/// it (the largest for 6 s is 3.4 s).
const TTL: &str = "6s";
const TTL_SECS: u64 = 6;
const GRACE: &str = "2s";

/// A store reached two ways: directly, and through a fault proxy.
struct Paths {
    direct: String,
    proxied: String,
    proxy: Arc<FaultProxy>,
}

/// Starts a proxy in front of the server of `direct` (its `host:port`,
/// `default_port` if it names none) and rewrites the URL to go through it.
async fn through_proxy(direct: String, default_port: u16) -> Paths {
    let hp = services::host_port(&direct, default_port).unwrap();
    let upstream = tokio::net::lookup_host(hp.as_str())
        .await
        .unwrap()
        .next()
        .unwrap();
    let proxy = FaultProxy::start(upstream).await.unwrap();
    assert!(direct.contains(&hp), "{direct} does not name {hp}");
    let proxied = direct.replacen(&hp, &proxy.addr().to_string(), 1);
    Paths {
        direct,
        proxied,
        proxy: Arc::new(proxy),
    }
}

/// `fenced --url URL run --key KEY ARGS… -- sh -c SCRIPT`, stderr into
/// `stderr` (read on failure).
fn spawn_run(url: &str, key: &str, args: &[&str], script: &str, stderr: &Path) -> Child {
    Command::new(BIN)
        .args(["--url", url, "run", "--key", key])
        .args(args)
        .args(["--", "sh", "-c", script])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(stderr).unwrap())
        .spawn()
        .unwrap()
}

/// B: `fenced run` of `key` waiting up to `wait`, whose command logs
/// `B start` to `log`; run to its end.
fn run_b(url: &str, key: &str, wait: &str, log: &Path) -> Output {
    Command::new(BIN)
        .args(["--url", url, "run", "--key", key, "--wait", wait])
        .args(["--", "sh", "-c"])
        .arg(format!(
            r#"echo "B start $(date +%s%N)" >> {}"#,
            log.display()
        ))
        .stdin(Stdio::null())
        .output()
        .unwrap()
}

fn until_exists(path: &Path, child: &mut Child, what: &str) {
    let start = Instant::now();
    while !path.exists() {
        assert!(
            child.try_wait().unwrap().is_none(),
            "the holder exited before {what}"
        );
        assert!(start.elapsed() < Duration::from_secs(30), "{what}: never");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// [`spawn_run`] of `key` whose command loops until SIGTERM, then runs the
/// shell commands `on_term`; returns once the command runs, with the file
/// that gets fenced's stderr.
fn spawn_looping(
    dir: &Path,
    url: &str,
    key: &str,
    args: &[&str],
    on_term: &str,
) -> (Child, PathBuf) {
    let started = dir.join("started");
    let script = format!(
        "trap '{on_term}' TERM; touch {}; while :; do sleep 0.1; done",
        started.display()
    );
    let err = dir.join("a.err");
    let mut child = spawn_run(url, key, args, &script, &err);
    until_exists(&started, &mut child, "the command started");
    (child, err)
}

/// `(event, nanoseconds)` lines of a log written by the commands with
/// `date +%s%N` (one clock for both holders).
fn events(log: &Path) -> Vec<(String, u128)> {
    std::fs::read_to_string(log)
        .unwrap_or_default()
        .lines()
        .map(|l| {
            let (what, at) = l.rsplit_once(' ').unwrap();
            (what.to_owned(), at.parse().unwrap())
        })
        .collect()
}

fn at(events: &[(String, u128)], what: &str) -> Option<u128> {
    events.iter().find(|(w, _)| w == what).map(|(_, t)| *t)
}

/// A: a graceful command on the proxied path that, on SIGTERM, finishes
/// its current 1 s step before it exits. Once it runs the path dies; B,
/// on the direct path, waits for the key. B's command must start only
/// after A's command exited.
fn a_graceful_command_exits_before_the_next_holder_starts(store: &str, paths: &Paths) {
    let dir = tmpdir("graceful");
    let (log, started) = (dir.join("log"), dir.join("started"));
    let key = "graceful";
    let script = format!(
        r#"trap 'sleep 1; echo "A exit $(date +%s%N)" >> {log}; exit 0' TERM
echo "A start $(date +%s%N)" >> {log}; touch {started}
while :; do sleep 0.1; done"#,
        log = log.display(),
        started = started.display()
    );
    let a_err = dir.join("a.err");
    let mut a = spawn_run(
        &paths.proxied,
        key,
        &["--ttl", TTL, "--grace", GRACE],
        &script,
        &a_err,
    );
    until_exists(&started, &mut a, "A's command started");
    paths.proxy.blackhole(true);
    let b = run_b(&paths.direct, key, "30s", &log);
    let a_status = wait_bounded(&mut a, Duration::from_secs(30), "A never exited");
    let a_stderr = std::fs::read_to_string(&a_err).unwrap();
    assert!(
        b.status.success(),
        "{store}: B did not get the lock: {}\nA: {a_stderr}",
        String::from_utf8_lossy(&b.stderr)
    );
    assert_eq!(a_status.code(), Some(76), "{store}: A: {a_stderr}");
    let ev = events(&log);
    let a_exit = at(&ev, "A exit").unwrap_or_else(|| {
        panic!("{store}: A's command never got to exit gracefully: {ev:?}\n{a_stderr}")
    });
    let b_start = at(&ev, "B start").unwrap();
    assert!(
        b_start > a_exit,
        "{store}: B's command started {} ms before A's command exited: two holders at once\n\
         events: {ev:?}\nA: {a_stderr}",
        (a_exit - b_start) / 1_000_000
    );
    eprintln!(
        "{store}: A's command exited {} ms before B's started",
        (b_start - a_exit) / 1_000_000
    );
}

/// A command that exits at once on SIGTERM: fenced, cut off from its
/// store, exits within TTL + 2 s of the path's death (it does not wait on
/// a release through the dead path).
fn the_holder_exits_promptly_after_the_path_dies(store: &str, paths: &Paths) {
    let dir = tmpdir("prompt");
    let (mut a, err) = spawn_looping(
        &dir,
        &paths.proxied,
        "prompt",
        &["--ttl", TTL, "--grace", GRACE],
        "exit 0",
    );
    paths.proxy.blackhole(true);
    let dead = Instant::now();
    let status = wait_bounded(&mut a, Duration::from_secs(60), "the holder never exited");
    let took = dead.elapsed();
    let stderr = std::fs::read_to_string(&err).unwrap();
    assert_eq!(status.code(), Some(76), "{store}: {stderr}");
    assert!(
        took < Duration::from_secs(TTL_SECS + 2),
        "{store}: the holder exited {took:?} after the path died (TTL {TTL}): {stderr}"
    );
    eprintln!("{store}: the holder exited {took:?} after the path died");
}

/// Both scenarios on one store, at once (separate keys and proxies).
async fn dead_path(
    store: &'static str,
    make: impl Fn() -> std::pin::Pin<Box<dyn std::future::Future<Output = Paths> + Send>>,
) {
    let graceful = make().await;
    let prompt = make().await;
    let one = tokio::task::spawn_blocking(move || {
        a_graceful_command_exits_before_the_next_holder_starts(store, &graceful)
    });
    let two = tokio::task::spawn_blocking(move || {
        the_holder_exits_promptly_after_the_path_dies(store, &prompt)
    });
    let (one, two) = tokio::join!(one, two);
    one.unwrap();
    two.unwrap();
}

/// One test per store: [`dead_path`] on the store of `$url` (a future of
/// its URL), whose server listens on `$port` when the URL names none.
macro_rules! dead_path_test {
    ($(#[$attr:meta])* $name:ident, $store:literal, $url:expr, $port:literal) => {
        $(#[$attr])*
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $name() {
            dead_path($store, || Box::pin(async { through_proxy($url.await, $port).await })).await;
        }
    };
}

dead_path_test!(dead_path_on_redis, "redis", redis_url(), 6379);
dead_path_test!(
    dead_path_on_mysql_unique_key,
    "mysql unique_key",
    mysql_url("unique_key"),
    3306
);
dead_path_test!(
    dead_path_on_mysql_row_lock,
    "mysql row_lock",
    mysql_url("row_lock"),
    3306
);
dead_path_test!(
    dead_path_on_mysql_optimistic,
    "mysql optimistic",
    mysql_url("optimistic"),
    3306
);
dead_path_test!(
    #[cfg(feature = "postgres")]
    dead_path_on_postgres_lease,
    "postgres lease",
    postgres_url("lease"),
    5432
);
dead_path_test!(
    #[cfg(feature = "etcd")]
    dead_path_on_etcd,
    "etcd",
    etcd_url(),
    2379
);
dead_path_test!(
    #[cfg(feature = "zookeeper")]
    dead_path_on_zookeeper,
    "zookeeper",
    zookeeper_url(),
    2181
);

/// A ZooKeeper URL with a namespace of its own, whose session timeout is
/// the holder's `--ttl`. The blackholed holder cannot delete its node, so
/// B gets the key only once the server expires the holder's session: one
/// session timeout (rounded up to a tick) after the last request it
/// received — never before the lease's deadline, which counts from a
/// renewal sent earlier. So the holder's command is stopped first, and B
/// waits about a TTL after the path died, well inside its `--wait`. A
/// longer session only makes B wait longer; a lock never lives on a
/// shorter one.
#[cfg(feature = "zookeeper")]
async fn zookeeper_url() -> String {
    let base = services::zookeeper_url();
    services::probe_zookeeper(&base)
        .await
        .unwrap_or_else(|m| panic!("{m}"));
    let hp = services::host_port(&base, 2181).unwrap();
    format!(
        "zk://{hp}/fenced-cli-{}?session_timeout={TTL}",
        uuid::Uuid::new_v4().simple()
    )
}

/// A `--grace` that cannot fit the TTL is refused before anything is
/// acquired, naming the largest grace that fits.
#[test]
fn a_grace_that_does_not_fit_the_ttl_is_refused() {
    let (dir, url) = sqlite_store("grace");
    let marker = dir.join("ran");
    let out = Command::new(BIN)
        .args([
            "--url", &url, "run", "--key", "g", "--ttl", "6s", "--grace", "4s",
        ])
        .args(["--", "touch"])
        .arg(&marker)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(78), "{err}");
    assert!(err.contains("--grace 4s does not fit --ttl 6s"), "{err}");
    assert!(
        err.contains("the largest --grace for --ttl 6s is 3s 400ms"),
        "{err}"
    );
    assert!(err.contains("--ttl 8s or longer"), "{err}");
    assert!(!marker.exists(), "the command ran");
    // Refused before any I/O: the store file was never even created.
    assert!(!dir.join("locks.db").exists(), "the store was opened");
    assert!(!held(&url, "g"));
    // The defaults fit, so does the largest grace named, and without
    // --grace the default (10 s) is shortened to fit a short --ttl.
    for args in [
        &[][..],
        &["--ttl", "6s", "--grace", "3400ms"],
        &["--ttl", "6s"],
    ] {
        let out = fenced(
            &[
                &["--url", &url, "run", "--key", "g"][..],
                args,
                &["--", "true"],
            ]
            .concat(),
        );
        assert_success(&out, &format!("{args:?}"));
    }
}

/// `--max-hold`: fenced itself sends SIGTERM, gives the command its grace
/// while it keeps the lock renewed, then releases and exits 76. The next
/// holder starts only after the command is gone.
#[test]
fn max_hold_stops_the_command_gracefully_and_keeps_the_lock_until_it_is_gone() {
    let (dir, url) = sqlite_store("max-hold");
    let log = dir.join("log");
    // On SIGTERM the command finishes a 2 s step, within its 3 s grace.
    let (mut a, err) = spawn_looping(
        &dir,
        &url,
        "mh",
        &["--ttl", "6s", "--grace", "3s", "--max-hold", "1s"],
        &format!(
            r#"sleep 2; echo "A exit $(date +%s%N)" >> {}; exit 0"#,
            log.display()
        ),
    );
    let b = run_b(&url, "mh", "60s", &log);
    assert!(b.status.success(), "{}", String::from_utf8_lossy(&b.stderr));
    let status = wait_bounded(&mut a, Duration::from_secs(30), "the holder never exited");
    let stderr = std::fs::read_to_string(&err).unwrap();
    assert_eq!(status.code(), Some(76), "{stderr}");
    assert!(stderr.contains("--max-hold reached"), "{stderr}");
    let ev = events(&log);
    let a_exit = at(&ev, "A exit").unwrap_or_else(|| panic!("no graceful exit: {ev:?} {stderr}"));
    assert!(at(&ev, "B start").unwrap() > a_exit, "{ev:?}");
}

/// A renewal refused (here: the lock was force-released) means the key may
/// already be someone else's: the command is SIGKILLed at once — its
/// SIGTERM handler never runs.
#[test]
fn a_refused_renewal_kills_the_command_without_grace() {
    let (dir, url) = sqlite_store("refused");
    let log = dir.join("log");
    let (mut a, err) = spawn_looping(
        &dir,
        &url,
        "refused",
        &["--ttl", "3s", "--grace", "1s"],
        &format!(r#"echo "got TERM 0" >> {}; sleep 5; exit 0"#, log.display()),
    );
    assert!(fenced(&["--url", &url, "release", "--force", "refused"])
        .status
        .success());
    let status = wait_bounded(
        &mut a,
        Duration::from_secs(30),
        "the evicted holder kept running",
    );
    let stderr = std::fs::read_to_string(&err).unwrap();
    assert_eq!(status.code(), Some(76), "{stderr}");
    assert!(stderr.contains("lost lock"), "{stderr}");
    assert!(
        events(&log).is_empty(),
        "the command got SIGTERM (and ran its handler) after a genuine loss: {stderr}"
    );
}

/// What the command leaves running in its process group ends before the
/// lock is released: a background child that stops on SIGTERM is gone when
/// fenced exits, and one that ignores SIGTERM is SIGKILLed after --grace.
/// The command's own status is still fenced's.
#[test]
fn background_children_end_before_the_lock_is_released() {
    let (dir, url) = sqlite_store("leftovers");
    let (polite, stubborn) = (dir.join("polite.pid"), dir.join("stubborn.pid"));
    // The stubborn child writes its pid only once its trap is set, and the
    // command waits for that file: exiting earlier let fenced's SIGTERM
    // reach the child before its trap (CI saw it end politely).
    let script = format!(
        r#"sleep 60 & echo $! > {polite}
sh -c 'trap "" TERM; echo $$ > {stubborn}.tmp; mv {stubborn}.tmp {stubborn}; exec sleep 60' &
while [ ! -s {stubborn} ]; do sleep 0.01; done
exit 3"#,
        polite = polite.display(),
        stubborn = stubborn.display()
    );
    let err = dir.join("err");
    let mut a = spawn_run(&url, "leftovers", &["--grace", "1s"], &script, &err);
    let status = wait_bounded(&mut a, Duration::from_secs(30), "fenced did not exit");
    let stderr = std::fs::read_to_string(&err).unwrap();
    assert_eq!(status.code(), Some(3), "{stderr}");
    for pidfile in [&polite, &stubborn] {
        let pid = read_pid(pidfile);
        assert!(
            !alive(pid),
            "{} (pid {pid}) still runs after fenced released the lock: {stderr}",
            pidfile.display()
        );
    }
    assert!(!held(&url, "leftovers"), "the lock was not released");
    assert!(stderr.contains("outlived --grace"), "{stderr}");
}

/// A signal passed on to the command, which then exits 0, while the store
/// had already taken the lock away (a force release the next renewal would
/// only have noticed seconds later): the run did not hold the lock to the
/// end, so fenced exits 76, not the command's 0.
#[test]
fn a_signal_after_the_lock_was_taken_away_exits_lost() {
    let (dir, url) = sqlite_store("signal-lost");
    // 30 s TTL: the next renewal is 10 s away, long after the SIGTERM.
    let (mut a, err) = spawn_looping(&dir, &url, "signal-lost", &["--ttl", "30s"], "exit 0");
    assert!(
        fenced(&["--url", &url, "release", "--force", "signal-lost"])
            .status
            .success()
    );
    let status = terminate(&mut a, "fenced did not exit");
    let stderr = std::fs::read_to_string(&err).unwrap();
    assert_eq!(status.code(), Some(76), "{stderr}");
}

/// `--label` is stored with the lock, shown by `fenced status` (table and
/// JSON) and given to the command as FENCED_LABEL; without it the label is
/// fenced's host:pid; a bad label is a usage error (78).
#[test]
fn labels_are_shown_by_status() {
    let (dir, url) = sqlite_store("label");
    let env_file = dir.join("env");
    let mut labelled = Command::new(BIN)
        .args([
            "--url",
            &url,
            "run",
            "--key",
            "lab-a",
            "--label",
            "nightly report #7",
        ])
        .args(["--", "sh", "-c"])
        .arg(format!(
            r#"echo "$FENCED_LABEL" > {}; exec sleep 60"#,
            env_file.display()
        ))
        .stdin(Stdio::null())
        .spawn()
        .unwrap();
    let mut plain = Command::new(BIN)
        .args(["--url", &url, "run", "--key", "lab-b", "--", "sleep", "60"])
        .stdin(Stdio::null())
        .spawn()
        .unwrap();
    let start = Instant::now();
    let v = loop {
        let v: serde_json::Value =
            serde_json::from_slice(&status(&url, &["--json"]).stdout).unwrap();
        if v.as_array().unwrap().len() == 2 && env_file.exists() {
            break v;
        }
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "never saw both locks: {v}"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(v[0]["key"], "lab-a");
    assert_eq!(v[0]["label"], "nightly report #7", "{v}");
    let host_pid = v[1]["label"]
        .as_str()
        .unwrap_or_else(|| panic!("no default label: {v}"));
    assert!(
        host_pid.ends_with(&format!(":{}", plain.id())),
        "{host_pid}"
    );
    let table = String::from_utf8_lossy(&status(&url, &[]).stdout).into_owned();
    assert!(table.lines().next().unwrap().ends_with("LABEL"), "{table}");
    assert!(
        table.contains("nightly report #7") && table.contains(host_pid),
        "{table}"
    );
    assert_eq!(
        std::fs::read_to_string(&env_file).unwrap().trim(),
        "nightly report #7"
    );
    for child in [&mut labelled, &mut plain] {
        terminate(child, "a holder ignored SIGTERM");
    }
    let free: serde_json::Value =
        serde_json::from_slice(&status(&url, &["--json", "lab-a"]).stdout).unwrap();
    assert_eq!(free[0]["held"], false);
    let bad = fenced(&[
        "--url",
        &url,
        "run",
        "--key",
        "k",
        "--label",
        "two\nlines",
        "--",
        "true",
    ]);
    assert_exit(&bad, 78);
}

/// The server stores keep the label too (etcd does not yet: its `inspect`
/// reports none, so it is not checked here).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn labels_are_shown_by_status_on_the_server_stores() {
    let urls = vec![
        redis_url().await,
        mysql_url("unique_key").await,
        mysql_url("row_lock").await,
        mysql_url("optimistic").await,
    ];
    tokio::task::spawn_blocking(move || {
        for url in urls {
            let mut holder = Command::new(BIN)
                .args([
                    "--url",
                    &url,
                    "run",
                    "--key",
                    "lab",
                    "--label",
                    "deploy eu-1",
                ])
                .args(["--", "sleep", "60"])
                .stdin(Stdio::null())
                .spawn()
                .unwrap();
            let v = status_once_held(&url, &["lab"], Duration::from_secs(20));
            assert_eq!(v[0]["label"], "deploy eu-1", "{url}: {v}");
            let table = status(&url, &["lab"]);
            assert!(
                String::from_utf8_lossy(&table.stdout).contains("deploy eu-1"),
                "{url}"
            );
            terminate(&mut holder, "the holder ignored SIGTERM");
        }
    })
    .await
    .unwrap();
}
