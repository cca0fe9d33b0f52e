//! Quick numbers for the strategy table in the crate docs: uncontended
//! acquire+release latency and the hand-off gap to a waiting client, per
//! strategy, against one server. Not a test; the full matrix is `fenced bench`.
//!
//! `cargo run --release -p fenced-mysql --example measure [-- mysql://root@127.0.0.1:3306/test]`
#![allow(clippy::print_stdout, clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

use fenced_api::{DistributedLock, LockKey, LockOptions};
use fenced_mysql::{MySqlLock, Strategy};

fn pct(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let server = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "mysql://root@127.0.0.1:3306/test".into());
    let table = format!("fenced_measure_{}", std::process::id());
    println!("server {server}, table {table}");
    println!(
        "| strategy | uncontended acquire+release/s | p50 | p99 | hand-off p50 | hand-off p99 |"
    );
    println!("|---|---|---|---|---|---|");
    for strategy in [Strategy::UniqueKey, Strategy::RowLock, Strategy::Optimistic] {
        let url = format!("{server}?strategy={strategy}&table={table}&max_connections=16");
        MySqlLock::migrate(&url).await?;
        let a = MySqlLock::connect(&url).await?;
        let b = MySqlLock::connect(&url).await?;
        let opts = LockOptions::builder()
            .ttl(Duration::from_secs(30))
            .build()?;
        let key = LockKey::new(format!("measure/{strategy}"))?;
        // Warm up (row creation, statement caches).
        for _ in 0..20 {
            let l = a.try_acquire(&key, &opts).await?.expect("free");
            a.release(&l).await?;
        }
        let n = 500;
        let mut lat = Vec::with_capacity(n);
        let start = Instant::now();
        for _ in 0..n {
            let t = Instant::now();
            let l = a.try_acquire(&key, &opts).await?.expect("free");
            a.release(&l).await?;
            lat.push(t.elapsed());
        }
        let rate = n as f64 / start.elapsed().as_secs_f64();
        lat.sort();

        let mut gaps = Vec::new();
        let wait = opts
            .to_builder()
            .wait_timeout(Duration::from_secs(10))
            .build()?;
        for _ in 0..40 {
            let held = a.try_acquire(&key, &opts).await?.expect("free");
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
            gaps.push(got - released);
        }
        gaps.sort();
        println!(
            "| {strategy} | {rate:.0} | {:.2} ms | {:.2} ms | {:.2} ms | {:.2} ms |",
            pct(&lat, 0.5).as_secs_f64() * 1e3,
            pct(&lat, 0.99).as_secs_f64() * 1e3,
            pct(&gaps, 0.5).as_secs_f64() * 1e3,
            pct(&gaps, 0.99).as_secs_f64() * 1e3,
        );
    }
    let pool = sqlx::MySqlPool::connect(&server).await?;
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "DROP TABLE IF EXISTS `{table}`, `{table}_optimistic`, `{table}_rows`, `{table}_fence`, `{table}_migrations`"
    )))
    .execute(&pool)
    .await?;
    Ok(())
}
