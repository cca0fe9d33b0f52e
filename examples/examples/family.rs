//! The lock family on the embedded default store (or `$FENCED_URL`): a
//! semaphore, a reader-writer lock, a multi-lock and leader election.
//!
//! `cargo run -p fenced-examples --example family`
#![allow(clippy::print_stdout)]

#[tokio::main]
async fn main() -> Result<(), fenced_examples::BoxError> {
    let url = match std::env::var("FENCED_URL") {
        Ok(u) if !u.is_empty() => u,
        _ => fenced::default_url()?,
    };
    let r = fenced_examples::family(&url).await?;
    println!("store: {}", fenced::redact(&url));
    println!(
        "semaphore of {}: at most {} jobs at once",
        r.permits, r.most_at_once
    );
    println!(
        "reader-writer lock: writer's token above every reader's = {}",
        r.writers_fenced
    );
    println!(
        "multi-lock: both accounts held, tokens {:?}",
        r.transfer_tokens
    );
    println!("election: leaders seen in order {:?}", r.leaders_seen);
    Ok(())
}
