//! Every example, run against the real stores (`scripts/services.sh`).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::{
    path::{Path, PathBuf},
    process::{Command, Stdio},
};

use fenced_conformance::services;

fn increasing(tokens: &[u64]) -> bool {
    tokens.windows(2).all(|w| w[1] > w[0])
}

/// A scratch directory for one test, removed when it is dropped (runs used
/// to leave theirs in `/tmp`).
fn scratch() -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix("fenced-examples-")
        .tempdir()
        .unwrap()
}

/// A SQLite store in `dir` (keep the directory alive while it is used).
fn sqlite_url(dir: &tempfile::TempDir) -> String {
    format!("sqlite://{}/locks.db", dir.path().display())
}

async fn mysql(strategy: &str) -> String {
    let base = services::mysql_url();
    services::probe_mysql(&base)
        .await
        .unwrap_or_else(|m| panic!("{m}"));
    let url = format!(
        "{base}?strategy={strategy}&table=fenced_ex_{}",
        &uuid::Uuid::new_v4().simple().to_string()[..8]
    );
    fenced::migrate(&url).await.unwrap();
    url
}

async fn redis() -> String {
    let base = services::redis_url();
    services::probe_redis(&base)
        .await
        .unwrap_or_else(|m| panic!("{m}"));
    format!(
        "{base}/0?prefix=fenced-ex-{}",
        uuid::Uuid::new_v4().simple()
    )
}

/// Every shareable store compiled in (not `memory://`: each connect to it
/// makes a new, private store). The swap-by-config example runs on each.
async fn every_store(dir: &tempfile::TempDir) -> Vec<String> {
    let mut urls = vec![sqlite_url(dir)];
    for s in ["unique_key", "row_lock", "optimistic"] {
        urls.push(mysql(s).await);
    }
    urls.push(redis().await);
    if fenced::drivers().iter().any(|d| d.name == "etcd") {
        let base = services::etcd_url();
        services::probe_etcd(&base)
            .await
            .unwrap_or_else(|m| panic!("{m}"));
        let hp = services::host_port(&base, 2379).unwrap();
        urls.push(format!(
            "etcd://{hp}/fenced-ex-{}",
            uuid::Uuid::new_v4().simple()
        ));
    }
    urls
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quickstart_on_the_embedded_default() {
    let dir = scratch();
    let url = sqlite_url(&dir);
    let first = fenced_examples::quickstart(&url).await.unwrap();
    let second = fenced_examples::quickstart(&url).await.unwrap();
    assert!(second > first);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn swap_by_config_runs_unchanged_on_every_store() {
    let dir = scratch();
    for url in every_store(&dir).await {
        let tokens = fenced_examples::swap_by_config(&url, 4, 3)
            .await
            .unwrap_or_else(|e| panic!("{url}: {e}"));
        assert_eq!(tokens.len(), 12, "{url}");
        assert!(increasing(&tokens), "{url}: {tokens:?}");
    }
}

/// The built example program `name` (`cargo test` builds the examples
/// next to the test binaries: `target/<profile>/examples/`).
fn example(name: &str) -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let profile = exe.parent().and_then(Path::parent).unwrap();
    let path = profile.join("examples").join(name);
    assert!(
        path.is_file(),
        "{} is missing: run the tests with `cargo test -p fenced-examples` (which builds the \
         examples) or build them first with `cargo build -p fenced-examples --examples`",
        path.display()
    );
    // `cargo test --test examples` alone does not rebuild the examples.
    let built = std::fs::metadata(&path).unwrap().modified().unwrap();
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let sources = [dir.join("examples").join(format!("{name}.rs"))]
        .into_iter()
        .chain(
            std::fs::read_dir(dir.join("src"))
                .unwrap()
                .map(|e| e.unwrap().path()),
        );
    for source in sources {
        let changed = std::fs::metadata(&source).unwrap().modified().unwrap();
        assert!(
            changed <= built,
            "{} is older than {}: run `cargo test -p fenced-examples` (which rebuilds the examples)",
            path.display(),
            source.display()
        );
    }
    path
}

/// Runs an example program's `main` with `envs`; returns its stdout.
fn run_example(name: &str, args: &[&str], envs: &[(&str, &str)]) -> String {
    let mut cmd = Command::new(example(name));
    cmd.args(args).env_remove("FENCED_URL").stdin(Stdio::null());
    for (k, v) in envs {
        cmd.env(k, v);
    }
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "example {name} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// Five node processes (copies of the example program), one run per tick.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cron_job_runs_exactly_once_per_tick_across_processes() {
    let node = example("cron_job");
    let dir = scratch();
    for url in [sqlite_url(&dir), redis().await, mysql("unique_key").await] {
        let ran = fenced_examples::cron_job(&node, &url, 5, 4)
            .await
            .unwrap_or_else(|e| panic!("{url}: {e}"));
        assert_eq!(ran, vec![1, 1, 1, 1], "{url}");
    }
}

/// The family example on every store that has semaphores: two permits at
/// most, fenced writers, both members of the multi-lock, both leaders seen.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn family_on_every_store_with_semaphores() {
    let dir = scratch();
    for url in [sqlite_url(&dir), "memory://".to_owned()] {
        let r = fenced_examples::family(&url)
            .await
            .unwrap_or_else(|e| panic!("{url}: {e}"));
        assert_eq!(r.most_at_once, 2, "{url}: {r:?}");
        assert!(r.writers_fenced, "{url}: {r:?}");
        assert_eq!(r.transfer_tokens.len(), 2, "{url}: {r:?}");
        assert_eq!(r.leaders_seen, ["node-a", "node-b"], "{url}: {r:?}");
    }
}

/// Every example program's `main`, as `cargo run -p fenced-examples
/// --example NAME` runs it (with fresh stores, so runs never collide).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_example_program_runs() {
    let home_dir = tempfile::Builder::new()
        .prefix("fenced-ex-home-")
        .tempdir()
        .unwrap();
    let home = home_dir.path().to_str().unwrap();
    // No URL at all: the embedded default under FENCED_HOME.
    let out = run_example("quickstart", &[], &[("FENCED_HOME", home)]);
    assert!(out.contains("fencing token"), "{out}");
    assert!(Path::new(home).join("locks.db").is_file());
    let dir = scratch();
    let url = sqlite_url(&dir);
    let out = run_example("swap_by_config", &[], &[("FENCED_URL", &url)]);
    assert!(out.contains("12 job runs"), "{out}");
    let out = run_example("cron_job", &[], &[("FENCED_URL", &url)]);
    assert!(out.contains("[1, 1, 1, 1, 1]"), "{out}");
    let out = run_example("family", &[], &[("FENCED_URL", &url)]);
    for line in [
        "semaphore of 2: at most 2 jobs at once",
        "writer's token above every reader's = true",
        "leaders seen in order [\"node-a\", \"node-b\"]",
    ] {
        assert!(
            out.contains(line),
            "the family example did not print {line:?}:\n{out}"
        );
    }
    let out = run_example("tour", &[], &[]);
    for line in [
        "inspect shows the holder labelled Some(\"tour worker\")",
        "the same task asking again -> ",
        "another task of the same client waits (done: false)",
        "lost = false: wind down now",
    ] {
        assert!(
            out.contains(line),
            "the tour did not print {line:?}:\n{out}"
        );
    }
    assert!(!out.contains("unexpected"), "{out}");
    let (mysql, redis) = (mysql("unique_key").await, redis().await);
    let out = run_example("migrate_mysql_to_redis", &[&mysql, &redis], &[]);
    assert!(
        out.contains("tokens increased through every phase"),
        "{out}"
    );
    let base = services::mysql_url();
    let out = run_example("transactional_row_lock", &[&base], &[]);
    assert!(
        out.contains("committed transaction wrote 1 row(s); rolled-back one wrote 0"),
        "{out}"
    );
    let out = run_example("fenced_resource", &[&redis, &base], &[]);
    assert!(
        out.contains("paused ex-holder's write accepted: false"),
        "{out}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_mysql_to_redis_keeps_exclusion_and_increasing_tokens() {
    let phases =
        fenced_examples::migrate_mysql_to_redis(&mysql("unique_key").await, &redis().await, 3)
            .await
            .unwrap();
    assert_eq!(phases.len(), 5);
    let all: Vec<u64> = phases.iter().flat_map(|p| p.tokens.clone()).collect();
    assert_eq!(all.len(), 5 * 6);
    assert!(increasing(&all), "{phases:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transactional_row_lock_commits_and_rolls_back_with_the_release() {
    let base = services::mysql_url();
    services::probe_mysql(&base)
        .await
        .unwrap_or_else(|m| panic!("{m}"));
    assert_eq!(
        fenced_examples::transactional_row_lock(&base)
            .await
            .unwrap(),
        (1, 0)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fenced_resource_rejects_the_paused_ex_holder() {
    let base = services::mysql_url();
    services::probe_mysql(&base)
        .await
        .unwrap_or_else(|m| panic!("{m}"));
    for lock in [redis().await, mysql("unique_key").await] {
        let (a, b, state) = fenced_examples::fenced_resource(&lock, &base)
            .await
            .unwrap();
        assert_eq!((a, b, state.as_str()), (false, true, "B"), "{lock}");
    }
}
