//! A MySQL table that rejects stale fencing tokens: a paused ex-holder's
//! write is refused after another node took over.
//!
//! `cargo run -p fenced-examples --example fenced_resource [-- LOCK_URL MYSQL_URL]`
#![allow(clippy::print_stdout)]

#[tokio::main]
async fn main() -> Result<(), fenced_examples::BoxError> {
    let mut args = std::env::args().skip(1);
    let db = "mysql://root@127.0.0.1:3306/test".to_string();
    let lock = args
        .next()
        .unwrap_or_else(|| "redis://127.0.0.1:6379/0?prefix=fenced-example".into());
    let db = args.next().unwrap_or(db);
    let (a, b, state) = fenced_examples::fenced_resource(&lock, &db).await?;
    println!("new holder's write accepted: {b}; paused ex-holder's write accepted: {a}; row state: {state}");
    Ok(())
}
