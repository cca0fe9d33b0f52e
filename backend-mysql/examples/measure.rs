//! Quick numbers for the strategy table in the crate docs, per strategy,
//! against one server: uncontended acquire+release latency, the hand-off
//! gap to a client waiting in the same process, and the hand-off gap to a
//! client waiting in **another process** (this program re-executed as a
//! child), where no in-process wake-up helps. Not a test; the full matrix
//! is `fenced bench`.
//!
//! `cargo run --release -p fenced-mysql --example measure [-- mysql://root@127.0.0.1:3306/test [HANDOFFS]]`
//!
//! Cross-process hand-off: the parent holds the key for a random 10–60 ms
//! while the child waits in `acquire` (polling with backoff for
//! `unique_key` / `optimistic`, InnoDB's queue for `row_lock`); the gap is
//! from the instant the parent starts its release to the instant the
//! child's `acquire` returns, both read from the system clock
//! (`CLOCK_REALTIME`, one machine, so one clock).
#![allow(
    clippy::print_stdout,
    clippy::print_stderr,
    clippy::unwrap_used,
    clippy::expect_used
)]

use std::{
    process::Stdio,
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use fenced_api::{DistributedLock, LockKey, LockOptions};
use fenced_mysql::{MySqlLock, Strategy};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};

type Res<T> = Result<T, Box<dyn std::error::Error>>;

fn pct(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

fn ms(d: Duration) -> String {
    format!("{:.2} ms", d.as_secs_f64() * 1e3)
}

/// Nanoseconds on the system clock: comparable between two processes on one machine.
fn wall_ns() -> i128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as i128)
}

fn opts(wait: Option<Duration>) -> Res<LockOptions> {
    let b = LockOptions::builder().ttl(Duration::from_secs(30));
    Ok(match wait {
        Some(w) => b.wait_timeout(w).build()?,
        None => b.build()?,
    })
}

#[tokio::main]
async fn main() -> Res<()> {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("--child") {
        return child(&args[2], &args[3]).await;
    }
    let server = args
        .get(1)
        .cloned()
        .unwrap_or_else(|| "mysql://root@127.0.0.1:3306/test".into());
    let handoffs: usize = args.get(2).map_or(Ok(200), |n| n.parse())?;
    let table = format!("fenced_measure_{}", std::process::id());
    println!("server {server}, table {table}, {handoffs} cross-process hand-offs per strategy");
    println!(
        "| strategy | uncontended acquire+release/s | p50 | p99 | in-process hand-off p50 | p99 | cross-process hand-off p50 | p90 | p99 | max |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|");
    let result = measure_all(&server, &table, handoffs).await;
    // Dropped whatever happened: every table the three strategies create.
    let pool = sqlx::MySqlPool::connect(&server).await?;
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "DROP TABLE IF EXISTS `{table}`, `{table}_optimistic`, `{table}_rows`, `{table}_fence`, \
         `{table}_live`, `{table}_migrations`"
    )))
    .execute(&pool)
    .await?;
    result
}

async fn measure_all(server: &str, table: &str, handoffs: usize) -> Res<()> {
    for strategy in [Strategy::UniqueKey, Strategy::RowLock, Strategy::Optimistic] {
        let url = format!("{server}?strategy={strategy}&table={table}&max_connections=16");
        MySqlLock::migrate(&url).await?;
        let a = MySqlLock::connect(&url).await?;
        let b = MySqlLock::connect(&url).await?;
        let plain = opts(None)?;
        let wait = opts(Some(Duration::from_secs(10)))?;
        let key = LockKey::new(format!("measure/{strategy}"))?;
        // Warm up (row creation, statement caches).
        for _ in 0..20 {
            let l = a.try_acquire(&key, &plain).await?.expect("free");
            a.release(&l).await?;
        }
        let n = 500;
        let mut lat = Vec::with_capacity(n);
        let start = Instant::now();
        for _ in 0..n {
            let t = Instant::now();
            let l = a.try_acquire(&key, &plain).await?.expect("free");
            a.release(&l).await?;
            lat.push(t.elapsed());
        }
        let rate = n as f64 / start.elapsed().as_secs_f64();
        lat.sort();

        let mut local = Vec::new();
        for _ in 0..40 {
            let held = a.try_acquire(&key, &plain).await?.expect("free");
            let (b2, k2, w2) = (b.clone(), key.clone(), wait.clone());
            let waiter = tokio::spawn(async move {
                let l = b2.acquire(&k2, &w2).await;
                (l, Instant::now())
            });
            tokio::time::sleep(Duration::from_millis(30)).await;
            let released = Instant::now();
            a.release(&held).await?;
            let (l, got) = waiter.await?;
            b.release(&l?).await?;
            local.push(got - released);
        }
        local.sort();

        let mut remote = cross_process(&a, &url, &key, handoffs).await?;
        remote.sort();
        println!(
            "| {strategy} | {rate:.0} | {} | {} | {} | {} | {} | {} | {} | {} |",
            ms(pct(&lat, 0.5)),
            ms(pct(&lat, 0.99)),
            ms(pct(&local, 0.5)),
            ms(pct(&local, 0.99)),
            ms(pct(&remote, 0.5)),
            ms(pct(&remote, 0.9)),
            ms(pct(&remote, 0.99)),
            ms(remote[remote.len() - 1]),
        );
    }
    Ok(())
}

/// Hand-offs from this process to a waiter in a child process.
async fn cross_process(
    a: &MySqlLock,
    url: &str,
    key: &LockKey,
    handoffs: usize,
) -> Res<Vec<Duration>> {
    let mut child = tokio::process::Command::new(std::env::current_exe()?)
        .args(["--child", url, key.as_str()])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()?;
    let mut to_child = child.stdin.take().ok_or("no child stdin")?;
    let mut from_child = BufReader::new(child.stdout.take().ok_or("no child stdout")?).lines();
    let ready = from_child.next_line().await?;
    if ready.as_deref() != Some("ready") {
        return Err(format!("child did not start: {ready:?}").into());
    }
    let plain = opts(None)?;
    // A small xorshift for the hold times: no extra dependency for an example.
    let mut rng = (wall_ns() as u64) | 1;
    let mut gaps = Vec::with_capacity(handoffs);
    for _ in 0..handoffs {
        let held = a.try_acquire(key, &plain).await?.ok_or("key not free")?;
        to_child.write_all(b"go\n").await?;
        to_child.flush().await?;
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        tokio::time::sleep(Duration::from_millis(10 + rng % 51)).await;
        let released = wall_ns();
        a.release(&held).await?;
        let line = from_child.next_line().await?.ok_or("child ended")?;
        let granted: i128 = line.parse()?;
        gaps.push(Duration::from_nanos((granted - released).max(0) as u64));
    }
    drop(to_child);
    child.wait().await?;
    Ok(gaps)
}

/// The waiting side: for each `go`, acquire (waiting), note the system
/// clock, release, report the instant.
async fn child(url: &str, key: &str) -> Res<()> {
    let lock = MySqlLock::connect(url).await?;
    let key = LockKey::new(key)?;
    let wait = opts(Some(Duration::from_secs(10)))?;
    let mut stdin = BufReader::new(tokio::io::stdin()).lines();
    let mut stdout = tokio::io::stdout();
    stdout.write_all(b"ready\n").await?;
    stdout.flush().await?;
    while let Some(line) = stdin.next_line().await? {
        if line != "go" {
            continue;
        }
        let lease = lock.acquire(&key, &wait).await?;
        let granted = wall_ns();
        lock.release(&lease).await?;
        stdout.write_all(format!("{granted}\n").as_bytes()).await?;
        stdout.flush().await?;
    }
    Ok(())
}
