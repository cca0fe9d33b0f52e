//! MySQL row_lock: a business write commits atomically with the release.
//!
//! `cargo run -p fenced-examples --example transactional_row_lock [-- MYSQL_URL]`
#![allow(clippy::print_stdout)]

#[tokio::main]
async fn main() -> Result<(), fenced_examples::BoxError> {
    let url = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "mysql://root@127.0.0.1:3306/test".into());
    let (committed, rolled_back) = fenced_examples::transactional_row_lock(&url).await?;
    println!("committed transaction wrote {committed} row(s); rolled-back one wrote {rolled_back}");
    Ok(())
}
