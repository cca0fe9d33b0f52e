//! A live migration from MySQL to Redis with two nodes taking the same lock
//! in every phase (old → old + dual → dual → dual + new → new).
//!
//! `cargo run -p fenced-examples --example migrate_mysql_to_redis [-- MYSQL_URL REDIS_URL]`
#![allow(clippy::print_stdout)]

#[tokio::main]
async fn main() -> Result<(), fenced_examples::BoxError> {
    let mut args = std::env::args().skip(1);
    let mysql = args
        .next()
        .unwrap_or_else(|| "mysql://root@127.0.0.1:3306/test?table=fenced_example_mig".into());
    let redis = args
        .next()
        .unwrap_or_else(|| "redis://127.0.0.1:6379/0?prefix=fenced-example-mig".into());
    for phase in fenced_examples::migrate_mysql_to_redis(&mysql, &redis, 3).await? {
        println!("phase {:<28} tokens {:?}", phase.name, phase.tokens);
    }
    println!("never two holders; tokens increased through every phase");
    Ok(())
}
