//! A cron job on five nodes: at every tick exactly one of them runs it.
//!
//! `cargo run -p fenced-examples --example cron_job` (store from `FENCED_URL`,
//! default the embedded SQLite file)
#![allow(clippy::print_stdout)]

#[tokio::main]
async fn main() -> Result<(), fenced_examples::BoxError> {
    let url = fenced::default_url()?;
    let ran = fenced_examples::cron_job(&url, 5, 5).await?;
    println!("runs per tick on five nodes: {ran:?}");
    Ok(())
}
