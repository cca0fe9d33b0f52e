//! `fenced-faults-client`: one lock client process of the fault suite,
//! started (and stopped, killed, or run under a skewed clock) by
//! `fenced-faults` and the short profile. Not meant to be run by hand.

use clap::Parser;
use fenced_faults::procs::{client_main, ClientArgs};

#[tokio::main(flavor = "current_thread")]
async fn main() -> std::process::ExitCode {
    let code = client_main(ClientArgs::parse()).await;
    std::process::ExitCode::from(u8::try_from(code).unwrap_or(1))
}
