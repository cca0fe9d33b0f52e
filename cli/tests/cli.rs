//! The `fenced` binary, end to end: several processes on one key with a
//! non-atomic read–sleep–write on a shared file, a frozen holder, exit codes.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::{
    path::Path,
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

mod common;
use common::*;

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
                let out = fenced(&[
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
                ]);
                assert_success(&out, "fenced run failed");
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

/// [`contend`] with 4 processes × 3 rounds, off the async runtime.
async fn four_by_three(url: String, dir: Scratch) {
    tokio::task::spawn_blocking(move || contend(&url, &dir, 4, 3))
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn processes_exclude_each_other_on_mysql() {
    for strategy in ["unique_key", "row_lock", "optimistic"] {
        four_by_three(mysql_url(strategy).await, tmpdir(strategy)).await;
    }
}

#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn processes_exclude_each_other_on_postgres() {
    four_by_three(postgres_url("lease").await, tmpdir("postgres_lease")).await;
}

#[cfg(feature = "etcd")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn processes_exclude_each_other_on_etcd() {
    four_by_three(etcd_url().await, tmpdir("etcd")).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn processes_exclude_each_other_on_redis() {
    four_by_three(redis_url().await, tmpdir("redis")).await;
}

/// `fenced ARGS… -- sh -c …` whose command writes its pid to `pidfile`,
/// then sleeps for a minute (stdin and stdout null, stderr to `stderr`);
/// with that pid once it is written.
fn spawn_sleeper(args: &[&str], pidfile: &Path, stderr: Stdio) -> (Child, i32) {
    let child = Command::new(BIN)
        .args(args)
        .args(["--", "sh", "-c"])
        .arg(format!("echo $$ > {}; exec sleep 60", pidfile.display()))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(stderr)
        .spawn()
        .unwrap();
    let pid = read_pid(pidfile);
    (child, pid)
}

/// All that is left to read from a child's pipe.
fn drain(pipe: &mut impl std::io::Read) -> String {
    let mut text = String::new();
    pipe.read_to_string(&mut text).unwrap();
    text
}

/// A holder frozen past its TTL loses the lock; on resume it terminates its
/// command and exits with the "lost" code.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_holder_is_stopped_when_it_resumes() {
    use nix::{
        sys::signal::{kill, killpg, Signal},
        unistd::Pid,
    };
    let url = mysql_url("unique_key").await;
    let dir = tmpdir("frozen");
    let pidfile = dir.join("child.pid");
    let (mut holder, child_pid) = spawn_sleeper(
        &[
            "--url", &url, "run", "--key", "frozen", "--ttl", "2s", "--grace", "1s",
        ],
        &pidfile,
        Stdio::piped(),
    );
    std::thread::sleep(Duration::from_millis(100));
    let fenced_pid = Pid::from_raw(holder.id() as i32);
    // The whole job freezes: fenced and the command's process group (the
    // command leads it), as a stopped or suspended machine would.
    let group = Pid::from_raw(child_pid);
    kill(fenced_pid, Signal::SIGSTOP).unwrap();
    killpg(group, Signal::SIGSTOP).unwrap();
    std::thread::sleep(Duration::from_millis(3500)); // past the 2 s TTL

    let other = fenced(&[
        "--url", &url, "run", "--key", "frozen", "--wait", "10s", "--", "true",
    ]);
    assert_success(&other, "the lock was not taken over");

    kill(fenced_pid, Signal::SIGCONT).unwrap();
    let _ = killpg(group, Signal::SIGCONT);
    let status = wait_bounded(
        &mut holder,
        Duration::from_secs(15),
        "the resumed holder did not exit",
    );
    let err = drain(holder.stderr.as_mut().unwrap());
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
    let run = fenced;

    // Held elsewhere, no wait: 75, and the command does not run.
    let dir = tmpdir("codes");
    let marker = dir.join("ran");
    let started = dir.join("started");
    let mut holder = std::process::Command::new(BIN)
        .args(["--url", &url, "run", "--key", "busy", "--", "sh", "-c"])
        .args([r#"touch "$1"; exec sleep 5"#, "sh"])
        .arg(&started)
        .stdin(Stdio::null())
        .spawn()
        .unwrap();
    // The holder's command runs only once it has the lock.
    let start = Instant::now();
    while !started.exists() {
        assert!(
            holder.try_wait().unwrap().is_none(),
            "the holder exited before its command started"
        );
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "the holder's command never started"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
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
    assert_exit(&out, 75);
    assert!(!marker.exists(), "the command ran without the lock");
    let _ = holder.kill();
    let _ = holder.wait();

    for (command, code) in [
        // The command's own code passes through; FENCED_KEY is set.
        (
            &["sh", "-c", "test \"$FENCED_KEY\" = codes && exit 7"][..],
            7,
        ),
        // Killed by a signal: 128 + N.
        (&["sh", "-c", "kill -9 $$"], 137),
        // Missing command: 127.
        (&["/nonexistent/cmd"], 127),
    ] {
        let out = run(&[&["--url", &url, "run", "--key", "codes", "--"][..], command].concat());
        assert_eq!(out.status.code(), Some(code), "{command:?}");
    }
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
    assert_exit(&out, 69);
    // Bad duration: clap's usage error (2).
    let out = run(&[
        "--url", &url, "run", "--key", "k", "--ttl", "soon", "--", "true",
    ]);
    assert_eq!(out.status.code(), Some(2));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_and_force_release() {
    let (_dir, url) = sqlite_store("status");
    let mut holder = std::process::Command::new(BIN)
        .args(["--url", &url, "run", "--key", "admin", "--", "sleep", "30"])
        .stdin(Stdio::null())
        .spawn()
        .unwrap();
    let held = status_once_held(&url, &["admin", "other"], Duration::from_secs(10));
    assert!(held[0]["token"].as_u64().unwrap() >= 1);
    assert_eq!(held[1]["held"], false);
    let table = status(&url, &["admin"]);
    assert!(String::from_utf8_lossy(&table.stdout).contains("admin"));

    let out = fenced(&["--url", &url, "release", "--force", "admin"]);
    assert!(String::from_utf8_lossy(&out.stdout).contains("released"));
    // The evicted holder notices at its next renewal and stops its command.
    let status = wait_bounded(
        &mut holder,
        Duration::from_secs(30),
        "the evicted holder kept running",
    );
    assert_eq!(status.code(), Some(76));
    // `release` without --force is refused by the argument parser.
    let out = fenced(&["--url", &url, "release", "admin"]);
    assert_eq!(out.status.code(), Some(2));
}

/// `release --force` frees a key's reader-writer holders too (a key's mutex
/// and its family are separate locks; the admin means the key).
#[tokio::test]
async fn force_release_frees_a_writer() {
    let (_dir, url) = sqlite_store("force-family");
    let mut writer = std::process::Command::new(BIN)
        .args([
            "--url",
            &url,
            "run",
            "--key",
            "ledger",
            "--exclusive",
            "--",
            "sleep",
            "30",
        ])
        .stdin(Stdio::null())
        .spawn()
        .unwrap();
    let held = status_once_held(&url, &["ledger"], Duration::from_secs(10));
    assert_eq!(held[0]["lock"], "writer", "{held:?}");
    assert_eq!(held[0]["waiting"], 0, "{held:?}");
    // A reader in line shows in the writer's row (JSON `waiting`).
    let mut reader = std::process::Command::new(BIN)
        .args([
            "--url", &url, "run", "--key", "ledger", "--shared", "--wait", "60s", "--", "true",
        ])
        .stdin(Stdio::null())
        .spawn()
        .unwrap();
    let start = std::time::Instant::now();
    while status_json(&url, &["ledger"])[0]["waiting"] != 1 {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "the waiting reader never showed"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    terminate(&mut reader, "the waiting reader");
    let out = fenced(&["--url", &url, "release", "--force", "ledger"]);
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(said.contains("released `ledger`"), "{said}");
    let v = status_json(&url, &["ledger"]);
    assert_eq!(v[0]["held"], false, "{v}");
    let status = wait_bounded(
        &mut writer,
        Duration::from_secs(30),
        "the evicted writer kept running",
    );
    assert_eq!(status.code(), Some(76));
    let out = fenced(&["--url", &url, "release", "--force", "ledger"]);
    assert!(String::from_utf8_lossy(&out.stdout).contains("was not held"));
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
        assert_success(&run(&dir), "run");
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
    let (dir, url) = sqlite_store("sqlite");
    four_by_three(url, dir).await;
}

/// SIGHUP (a closed terminal or ssh session) and SIGQUIT are passed to the
/// command like SIGTERM: the command ends, the lock is released at once
/// (not at its TTL), and fenced exits with the command's status, 128+N.
#[test]
fn hangup_and_quit_stop_the_command_and_release_the_lock() {
    use nix::sys::signal::{kill, Signal};
    let (dir, url) = sqlite_store("hup");
    for sig in [Signal::SIGHUP, Signal::SIGQUIT] {
        let pidfile = dir.join(format!("{sig}.pid"));
        let (mut holder, cmd) = spawn_sleeper(
            &["--url", &url, "run", "--key", "hup", "--ttl", "60s"],
            &pidfile,
            Stdio::null(),
        );
        assert!(held(&url, "hup"));
        kill(nix::unistd::Pid::from_raw(holder.id() as i32), sig).unwrap();
        let status = wait_bounded(
            &mut holder,
            Duration::from_secs(30),
            &format!("fenced did not exit after {sig}"),
        );
        assert_eq!(
            status.code(),
            Some(128 + sig as i32),
            "{sig}: fenced must pass the signal on and exit with the command's status, got {status:?}"
        );
        assert!(!alive(cmd), "{sig}: the command survived fenced");
        assert!(!held(&url, "hup"), "{sig}: the lock was not released");
    }
}

fn script_cmd() -> Command {
    let ok = Command::new("script")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    assert!(
        ok,
        "these tests need `script` from util-linux (apt-get install util-linux)"
    );
    Command::new("script")
}

/// Under a terminal, the command can read it: fenced makes the command's
/// process group the terminal's foreground group (otherwise the command
/// would be stopped by SIGTTIN for ever while fenced kept renewing the
/// lock).
#[test]
fn the_command_can_read_the_terminal() {
    let (_dir, url) = sqlite_store("tty");
    let mut script = script_cmd()
        .args(["-qec"])
        .arg(format!(
            "{BIN} --url {url} run --key tty -- sh -c 'read x; echo got:$x; exit 3'"
        ))
        .arg("/dev/null")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    std::io::Write::write_all(script.stdin.as_mut().unwrap(), b"hello\n").unwrap();
    drop(script.stdin.take());
    let status = wait_bounded(
        &mut script,
        Duration::from_secs(30),
        "the command never read the terminal (stopped by SIGTTIN in a background process group?)",
    );
    let out = drain(script.stdout.as_mut().unwrap());
    assert!(out.contains("got:hello"), "{out}");
    assert_eq!(status.code(), Some(3), "{out}");
    assert!(!held(&url, "tty"));
}

/// An interactive shell with job control on a pseudo-terminal (bash in
/// `script`), typed at like a person.
struct Terminal {
    script: std::process::Child,
    output: std::sync::Arc<std::sync::Mutex<Vec<u8>>>,
}

impl Terminal {
    fn bash(envs: &[(&str, &str)]) -> Terminal {
        Terminal::start("bash --norc --noprofile -i", envs)
    }

    /// `command` (a shell command line) as the session's only program.
    fn start(command: &str, envs: &[(&str, &str)]) -> Terminal {
        let mut cmd = script_cmd();
        cmd.args(["-qfec", command, "/dev/null"])
            .env("PS1", "$ ")
            .env("HISTFILE", "/dev/null")
            .env("TERM", "dumb")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null());
        for (k, v) in envs {
            cmd.env(k, v);
        }
        let mut script = cmd.spawn().unwrap();
        let output = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let (mut stdout, sink) = (script.stdout.take().unwrap(), output.clone());
        std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            while let Ok(n @ 1..) = std::io::Read::read(&mut stdout, &mut buf) {
                sink.lock().unwrap().extend_from_slice(&buf[..n]);
            }
        });
        Terminal { script, output }
    }

    fn output(&self) -> String {
        String::from_utf8_lossy(&self.output.lock().unwrap()).into_owned()
    }

    fn send(&mut self, keys: &str) {
        let stdin = self.script.stdin.as_mut().unwrap();
        std::io::Write::write_all(stdin, keys.as_bytes()).unwrap();
        std::io::Write::flush(stdin).unwrap();
    }

    /// Waits (with a hang bound) until the screen shows `text`.
    fn wait_for(&self, text: &str, what: &str) {
        let start = Instant::now();
        while !self.output().contains(text) {
            assert!(
                start.elapsed() < Duration::from_secs(30),
                "{what}; the terminal shows:\n{}",
                self.output()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Terminal {
    fn drop(&mut self) {
        let _ = self.script.kill();
        let _ = self.script.wait();
    }
}

/// `/proc/PID/stat`: (state, parent, process group, terminal's foreground group).
fn proc_stat(pid: i32) -> (char, i32, i32, i32) {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let rest: Vec<&str> = stat[stat.rfind(')').unwrap() + 2..]
        .split_whitespace()
        .collect();
    let num = |i: usize| rest[i].parse::<i32>().unwrap();
    (rest[0].chars().next().unwrap(), num(1), num(2), num(5))
}

fn until(what: &str, mut ok: impl FnMut() -> bool) {
    let start = Instant::now();
    while !ok() {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "never happened: {what}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A shell command that waits until it is the terminal's foreground group,
/// says `R-2` (the typed line echoes `R-$((1+1))`, not `R-2`), reads a line
/// and prints it as `got:LINE`. Its pid goes to `pidfile`.
fn reader_command(pidfile: &Path) -> String {
    format!(
        "sh -c 'echo $$ > {}; \
         while :; do read -r _ _ _ _ pg _ _ tp _ < /proc/$$/stat; [ \"$pg\" = \"$tp\" ] && break; sleep 0.05; done; \
         echo R-$((1+1)); read x; echo got:$x'",
        pidfile.display()
    )
}

/// Without a job-control shell (nothing could resume a stopped fenced),
/// Ctrl-Z does not stop the job: fenced continues the command and says so.
#[test]
fn ctrl_z_without_job_control_continues_the_command() {
    let (dir, url) = sqlite_store("nojobs");
    let pidfile = dir.join("cmd.pid");
    let mut tty = Terminal::start(
        &format!("{BIN} run --key job -- {}", reader_command(&pidfile)),
        &[("FENCED_URL", &url)],
    );
    tty.wait_for(
        "R-2",
        "the command never became the terminal's foreground job",
    );
    tty.send("\x1a"); // Ctrl-Z
    tty.wait_for(
        "continuing it",
        "fenced did not continue the stopped command",
    );
    tty.send("hello\n");
    tty.wait_for(
        "got:hello",
        "the continued command did not read the terminal",
    );
    let status = wait_bounded(
        &mut tty.script,
        Duration::from_secs(30),
        "the job did not end",
    );
    assert!(status.success(), "{}", tty.output());
}

/// Ctrl-Z stops the command (it has the terminal) and fenced with it, so the
/// shell sees the job stopped; `fg` resumes both and gives the command the
/// terminal again; its exit status is the job's.
#[test]
fn ctrl_z_stops_the_whole_job_and_fg_resumes_it() {
    let (dir, url) = sqlite_store("jobs");
    let pidfile = dir.join("cmd.pid");
    let mut tty = Terminal::bash(&[("FENCED_URL", &url)]);
    tty.send(&format!(
        "{BIN} run --key job --ttl 60s -- {}\n",
        reader_command(&pidfile)
    ));
    tty.wait_for(
        "R-2",
        "the command never became the terminal's foreground job",
    );
    let cmd = read_pid(&pidfile);
    let fenced = proc_stat(cmd).1;

    tty.send("\x1a"); // Ctrl-Z
    tty.wait_for("Stopped", "the shell never saw the job stop");
    assert_eq!(proc_stat(fenced).0, 'T', "fenced is not stopped");
    assert_eq!(proc_stat(cmd).0, 'T', "the command is not stopped");
    assert!(
        held(&url, "job"),
        "a stopped job keeps its lock within the TTL"
    );

    tty.send("fg\n");
    until("the command resumed with the terminal", || {
        let (state, _, group, foreground) = proc_stat(cmd);
        state != 'T' && group == foreground
    });
    tty.send("hello\n");
    tty.wait_for("got:hello", "the resumed command did not read the terminal");
    tty.send("echo rc=$((40+2))-$?\n");
    tty.wait_for("rc=42-0", "the job did not end with the command's status");
    assert!(!held(&url, "job"));
    tty.send("exit\n");
}

/// `fenced status` with no key lists the held locks, in key order, as a
/// table or JSON, up to --limit.
#[test]
fn status_without_keys_lists_the_held_locks() {
    let (_dir, url) = sqlite_store("list");
    let out = status(&url, &["--json"]);
    assert!(out.status.success());
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "[]");
    let mut holders = Vec::new();
    for key in ["list-b", "list-a"] {
        holders.push(
            Command::new(BIN)
                .args(["--url", &url, "run", "--key", key, "--", "sleep", "60"])
                .stdin(Stdio::null())
                .spawn()
                .unwrap(),
        );
    }
    until("both locks are held", || {
        let out = status(&url, &["--json"]);
        serde_json::from_slice::<serde_json::Value>(&out.stdout)
            .unwrap()
            .as_array()
            .unwrap()
            .len()
            == 2
    });
    let v: serde_json::Value = serde_json::from_slice(&status(&url, &["--json"]).stdout).unwrap();
    assert_eq!(v[0]["key"], "list-a");
    assert_eq!(v[1]["key"], "list-b");
    assert!(v.as_array().unwrap().iter().all(|l| l["held"] == true
        && l["token"].as_u64().unwrap() >= 1
        && l["remaining_ms"].as_u64().unwrap() > 0));
    let table = String::from_utf8_lossy(&status(&url, &[]).stdout).into_owned();
    assert!(table.starts_with("KEY"), "{table}");
    assert!(
        table.contains("list-a") && table.contains("list-b"),
        "{table}"
    );
    let out = status(&url, &["--json", "--limit", "1"]);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v.as_array().unwrap().len(), 1);
    assert!(String::from_utf8_lossy(&out.stderr).contains("raise --limit"));
    for mut h in holders {
        terminate(&mut h, "a holder ignored SIGTERM");
    }
    assert_eq!(
        String::from_utf8_lossy(&status(&url, &["--json"]).stdout).trim(),
        "[]"
    );
}

/// FENCED_URL wins over the per-user default file.
#[test]
fn fenced_url_wins_over_the_default_file() {
    let home = tmpdir("url-home");
    let dir = tmpdir("url-store");
    let out = Command::new(BIN)
        .env("FENCED_URL", format!("sqlite://{}/x.db", dir.display()))
        .env("FENCED_HOME", &home)
        .args(["run", "--key", "k", "--", "true"])
        .output()
        .unwrap();
    assert_success(&out, "run");
    assert!(dir.join("x.db").is_file(), "FENCED_URL's file was not used");
    assert_eq!(
        std::fs::read_dir(&home).unwrap().count(),
        0,
        "the default file under FENCED_HOME was created although FENCED_URL was set"
    );
}

/// Each subcommand's --help has examples; the environment's values (a URL
/// with a password, the log filter) are never shown.
#[test]
fn help_has_examples_and_hides_env_values() {
    let help = |args: &[&str]| {
        let out = Command::new(BIN)
            .args(args)
            .env("FENCED_URL", "mysql://u:hunter2@h/db")
            .env("FENCED_LOG", "sekrit-filter")
            .output()
            .unwrap();
        assert!(out.status.success(), "{args:?}");
        String::from_utf8(out.stdout).unwrap()
    };
    for (args, example) in [
        (
            &["run", "--help"][..],
            "fenced run --key nightly-report -- ",
        ),
        (&["status", "--help"], "fenced status nightly-report"),
        (&["release", "--help"], "fenced release --force "),
        (&["migrate", "--help"], "fenced migrate --url mysql://"),
        (&["--help"], "fenced run --key"),
    ] {
        let text = help(args);
        assert!(text.contains("Examples:"), "{args:?}: {text}");
        assert!(text.contains(example), "{args:?}: {text}");
        assert!(!text.contains("hunter2"), "{args:?}: {text}");
        assert!(!text.contains("sekrit"), "{args:?}: {text}");
    }
    let run = help(&["run", "--help"]);
    for documented in [
        "76",
        "SIGHUP",
        "SIGKILL",
        "Ctrl-Z",
        "safe deadline",
        "t+T-m-g  SIGTERM",
        "FENCED_LABEL",
        "--label",
    ] {
        assert!(
            run.contains(documented),
            "run --help lacks {documented}: {run}"
        );
    }
}

/// ZooKeeper grants a lease no longer than the server's longest session
/// (60 s on the test server): `fenced run` fits its grace to the lease it
/// got, shortening the default grace and refusing an explicit one that no
/// longer fits (78, the lock released) rather than stopping the command
/// while the lock is being renewed.
#[cfg(feature = "zookeeper")]
#[tokio::test]
async fn run_fits_the_grace_to_a_lease_granted_shorter_than_asked() {
    let base = fenced_conformance::services::zookeeper_url();
    fenced_conformance::services::probe_zookeeper(&base)
        .await
        .unwrap_or_else(|m| panic!("{m}"));
    let hp = fenced_conformance::services::host_port(&base, 2181).unwrap();
    let url = format!(
        "zk://{hp}/fenced-cli-granted-{}",
        uuid::Uuid::new_v4().simple()
    );
    let out = fenced(&[
        "--url", &url, "run", "--key", "long", "--ttl", "120s", "--grace", "50s", "--", "true",
    ]);
    assert_exit(&out, 78);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("granted `long` for 1m only"), "{stderr}");
    // Refused after the grant: the lock was released, the key is free.
    let out = fenced(&[
        "--url", &url, "run", "--key", "long", "--ttl", "120s", "--wait", "0s", "--", "true",
    ]);
    assert_success(&out, "the default grace fits the granted lease");
}

/// Runs `procs` processes × `rounds` of `fenced run --key KEY MODE… -- script`,
/// the script logging `start end token role`; returns the intervals.
fn contend_family(
    url: &str,
    dir: &Path,
    key: &str,
    modes: &[&[&str]],
    rounds: usize,
) -> Vec<(u128, u128, u64, String)> {
    let log = dir.join(format!("{key}.log"));
    let mut children = Vec::new();
    for (i, mode) in modes.iter().enumerate() {
        let role = format!("{}{i}", mode.join(""));
        let script = format!(
            "s=$(date +%s%N); sleep 0.1; e=$(date +%s%N); echo \"$s $e $FENCED_TOKEN {role}\" >> {l}",
            l = log.display()
        );
        let (url, key) = (url.to_owned(), key.to_owned());
        let mode: Vec<String> = mode.iter().map(|s| (*s).to_owned()).collect();
        children.push(std::thread::spawn(move || {
            for _ in 0..rounds {
                let mut args = vec![
                    "--url", &url, "run", "--key", &key, "--ttl", "10s", "--wait", "60s",
                ];
                args.extend(mode.iter().map(String::as_str));
                args.extend(["--", "sh", "-c", &script]);
                assert_success(&fenced(&args), "fenced run failed");
            }
        }));
    }
    for c in children {
        c.join().unwrap();
    }
    std::fs::read_to_string(&log)
        .unwrap()
        .lines()
        .map(|l| {
            let v: Vec<&str> = l.split_whitespace().collect();
            (
                v[0].parse().unwrap(),
                v[1].parse().unwrap(),
                v[2].parse().unwrap(),
                v[3].to_owned(),
            )
        })
        .collect()
}

/// The most intervals that overlap at one instant.
fn most_at_once(intervals: &[(u128, u128, u64, String)]) -> usize {
    let mut edges: Vec<(u128, i32)> = intervals
        .iter()
        .flat_map(|(s, e, _, _)| [(*s, 1), (*e, -1)])
        .collect();
    // Ends before starts at the same instant: touching is not overlapping.
    edges.sort();
    let (mut now, mut most) = (0i32, 0i32);
    for (_, d) in edges {
        now += d;
        most = most.max(now);
    }
    usize::try_from(most).unwrap()
}

/// `--permits 2`: four processes × 3 rounds never run more than 2 at once,
/// and they do share (2 at once happens); every permit has its own token.
/// Another number of permits on the key, or a reader, is refused (78).
#[test]
fn permits_bound_concurrent_commands() {
    let (dir, url) = sqlite_store("permits");
    let sem: &[&str] = &["--permits", "2"];
    let runs = contend_family(&url, dir.as_ref(), "pool", &[sem, sem, sem, sem], 3);
    assert_eq!(runs.len(), 12);
    let most = most_at_once(&runs);
    assert!(most <= 2, "{most} commands ran at once under --permits 2");
    assert_eq!(most, 2, "the semaphore never let two commands share it");
    let mut tokens: Vec<u64> = runs.iter().map(|r| r.2).collect();
    tokens.sort_unstable();
    tokens.dedup();
    assert_eq!(tokens.len(), 12, "permits shared a token");

    let mut holder = Command::new(env!("CARGO_BIN_EXE_fenced"))
        .args([
            "--url",
            &url,
            "run",
            "--key",
            "pool",
            "--permits",
            "2",
            "--",
            "sleep",
            "5",
        ])
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    status_once_held(&url, &["pool"], Duration::from_secs(10));
    for other in [
        &["--permits", "3"][..],
        &["--shared"][..],
        &["--exclusive"][..],
    ] {
        let mut args = vec!["--url", &url, "run", "--key", "pool"];
        args.extend(other);
        args.extend(["--", "true"]);
        let out = fenced(&args);
        assert_exit(&out, 78);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains("in use as a semaphore of 2 permits"),
            "{other:?}: {err}"
        );
    }
    let v = status_json(&url, &["pool"]);
    assert_eq!(v[0]["lock"], "permit", "{v}");
    assert_eq!(v[0]["permits"], 2, "{v}");
    terminate(&mut holder, "the permit holder");
}

/// `--shared` and `--exclusive`: readers run together, a writer never
/// beside anyone, and each writer's token is above every run before it.
#[test]
fn readers_share_and_writers_run_alone() {
    let (dir, url) = sqlite_store("rw");
    let r: &[&str] = &["--shared"];
    let w: &[&str] = &["--exclusive"];
    let runs = contend_family(&url, dir.as_ref(), "config", &[r, r, r, w], 3);
    assert_eq!(runs.len(), 12);
    assert!(most_at_once(&runs) >= 2, "readers never ran together");
    for (ws, we, wt, role) in runs.iter().filter(|r| r.3.starts_with("--exclusive")) {
        for (s, e, t, other) in &runs {
            if t == wt {
                continue;
            }
            assert!(
                e <= ws || s >= we,
                "{other} ({s}..{e}) ran beside the writer {role} ({ws}..{we})"
            );
            if e <= ws {
                assert!(
                    t < wt,
                    "a run before the writer has token {t} ≥ the writer's {wt}"
                );
            }
        }
    }
}

/// A `fenced run` stopped by SIGINT or SIGTERM while it waits gives its
/// place in line back before it exits (128 + the signal): nobody behind it
/// waits for a dead process's turn. Before, the signal killed fenced in
/// line and the place was granted to nobody for a whole TTL (30 s).
async fn a_signal_while_waiting_gives_the_place_back(url: &str, sig: nix::sys::signal::Signal) {
    let key = format!("sigwait-{}", uuid::Uuid::new_v4().simple());
    let run = |wait: &str, cmd: &[&str]| {
        Command::new(BIN)
            .args(["--url", url, "run", "--key", &key, "--permits", "1"])
            .args(["--wait", wait, "--"])
            .args(cmd)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    };
    let mut holder = run("0s", &["sleep", "60"]);
    status_once_held(url, &[&key], Duration::from_secs(20));
    let mut waiter = run("60s", &["true"]);
    let start = Instant::now();
    while status_json(url, &[&key])[0]["waiting"] != 1 {
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "{url}: the waiter never showed in line"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(i32::try_from(waiter.id()).unwrap()),
        sig,
    )
    .unwrap();
    let status = wait_bounded(
        &mut waiter,
        Duration::from_secs(10),
        "the signalled waiter kept waiting",
    );
    let said = drain(waiter.stderr.as_mut().unwrap());
    assert_eq!(status.code(), Some(128 + sig as i32), "{url}: {said}");
    assert!(said.contains("left the line"), "{url}: {said}");
    let v = status_json(url, &[&key]);
    assert_eq!(v[0]["waiting"], 0, "{url}: the place is still in line: {v}");
    // The holder ends; the key is free at once, not granted to the dead
    // waiter for its TTL.
    assert_eq!(terminate(&mut holder, "the holder").code(), Some(143));
    let mut next = run("0s", &["true"]);
    let status = wait_bounded(&mut next, Duration::from_secs(20), "the next run hung");
    let said = drain(next.stderr.as_mut().unwrap());
    assert_eq!(status.code(), Some(0), "{url}: {said}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_signalled_waiter_leaves_the_line_on_sqlite() {
    let (_dir, url) = sqlite_store("sigwait");
    a_signal_while_waiting_gives_the_place_back(&url, nix::sys::signal::Signal::SIGINT).await;
    a_signal_while_waiting_gives_the_place_back(&url, nix::sys::signal::Signal::SIGTERM).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_signalled_waiter_leaves_the_line_on_redis() {
    let url = redis_url().await;
    a_signal_while_waiting_gives_the_place_back(&url, nix::sys::signal::Signal::SIGINT).await;
    a_signal_while_waiting_gives_the_place_back(&url, nix::sys::signal::Signal::SIGTERM).await;
}
