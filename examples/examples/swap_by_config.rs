//! The same job code on whichever store `FENCED_URL` names (default: the
//! embedded SQLite file): four workers, three runs each, never two at once.
//!
//! `FENCED_URL=redis://127.0.0.1:6379 cargo run -p fenced-examples --example swap_by_config`
#![allow(clippy::print_stdout)]

#[tokio::main]
async fn main() -> Result<(), fenced_examples::BoxError> {
    let url = fenced::default_url()?;
    let tokens = fenced_examples::swap_by_config(&url, 4, 3).await?;
    println!(
        "{}: 12 job runs, one at a time, tokens {tokens:?}",
        fenced::redact(&url)
    );
    Ok(())
}
