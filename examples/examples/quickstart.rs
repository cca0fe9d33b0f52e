//! Take a lock on the embedded default store (or `$FENCED_URL`), run a job
//! under it, print its fencing token.
//!
//! `cargo run -p fenced-examples --example quickstart`
#![allow(clippy::print_stdout)]

#[tokio::main]
async fn main() -> Result<(), fenced_examples::BoxError> {
    let url = fenced::default_url()?;
    let token = fenced_examples::quickstart(&url).await?;
    println!(
        "ran the job under the lock on {} with fencing token {token}",
        fenced::redact(&url)
    );
    Ok(())
}
