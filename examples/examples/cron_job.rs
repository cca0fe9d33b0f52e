//! A cron job on five nodes — five processes, as on five machines: at every
//! tick exactly one of them runs it.
//!
//! `cargo run -p fenced-examples --example cron_job` (store from `FENCED_URL`,
//! default the embedded SQLite file; not `memory://`, which one process
//! cannot share with another). The example starts copies of itself with
//! `--node KEY` (and `FENCED_URL`) as the nodes (see `fenced_examples::cron_node`).
#![allow(clippy::print_stdout)]

#[tokio::main]
async fn main() -> Result<(), fenced_examples::BoxError> {
    let mut args = std::env::args().skip(1);
    if args.next().as_deref() == Some("--node") {
        let Some(key) = args.next() else {
            return Err("usage: FENCED_URL=… cron_job --node KEY".into());
        };
        return fenced_examples::cron_node(&fenced::default_url()?, &key).await;
    }
    let url = fenced::default_url()?;
    let me = std::env::current_exe()?;
    let ran = fenced_examples::cron_job(&me, &url, 5, 5).await?;
    println!(
        "{}: runs per tick on five node processes: {ran:?}",
        fenced::redact(&url)
    );
    Ok(())
}
