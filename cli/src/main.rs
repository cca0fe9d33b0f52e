//! `fenced`: run commands under a distributed lock with a fencing token.
//!
//! See `fenced --help` and the README for the exit codes.
#![forbid(unsafe_code)]

mod cli;

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    let args = cli::Cli::parse();
    let filter = tracing_subscriber::EnvFilter::try_new(&args.log)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_target(false)
        .init();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            cli::say(&format!("cannot start the async runtime: {e}"));
            return ExitCode::from(cli::EXIT_STORE);
        }
    };
    let code = runtime.block_on(cli::dispatch(args));
    // Whatever is still in flight on the runtime (a release that ran out of
    // time through a dead path, a connection's background task) must not
    // hold up the exit.
    runtime.shutdown_timeout(std::time::Duration::from_millis(100));
    ExitCode::from(code)
}
