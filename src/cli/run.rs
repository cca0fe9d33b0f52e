//! `fenced run`: hold a lock while a command runs.

use std::{os::unix::process::ExitStatusExt, process::ExitStatus, time::Duration};

use fenced::{Error, LockClient, WaitPolicy};
use nix::{
    sys::signal::{killpg, Signal},
    unistd::Pid,
};
use tokio::{
    process::{Child, Command},
    signal::unix::{signal, SignalKind},
};

use super::{connect, fail, say, RunArgs, Wait, EXIT_BUSY, EXIT_LOST, EXIT_SPAWN, EXIT_STORE};

pub(crate) async fn run(url: Option<String>, args: RunArgs) -> u8 {
    let store = match connect(url).await {
        Ok(s) => s,
        Err(e) => return fail(&e),
    };
    let wait = match args.wait {
        Wait::For(d) if d.is_zero() => WaitPolicy::NoWait,
        Wait::For(d) => WaitPolicy::Timeout(d),
        Wait::Forever => WaitPolicy::Forever,
    };
    let mut builder = LockClient::builder(store).ttl(args.ttl).wait(wait);
    if let Some(m) = args.max_hold {
        builder = builder.max_hold(m);
    }
    let client = match builder.build() {
        Ok(c) => c,
        Err(e) => return fail(&e),
    };
    let guard = match client.acquire(args.key.as_str()).await {
        Ok(g) => g,
        Err(Error::Timeout { key, waited }) => {
            say(&format!(
                "lock `{key}` is held elsewhere (waited {waited:.1?}); not running the command"
            ));
            return EXIT_BUSY;
        }
        Err(e) => return fail(&e),
    };

    // The command runs in a process group of its own, so that terminating it
    // reaches everything it started.
    let mut cmd = Command::new(&args.command[0]);
    cmd.args(&args.command[1..])
        .env("FENCED_TOKEN", guard.token().get().to_string())
        .env("FENCED_KEY", guard.key().as_str())
        .process_group(0)
        .kill_on_drop(true);
    let mut child = match cmd.spawn() {
        Ok(c) => c,
        Err(e) => {
            say(&format!("cannot start `{}`: {e}", args.command[0]));
            let _ = guard.release().await;
            return EXIT_SPAWN;
        }
    };
    let group = child.id().map(|id| Pid::from_raw(id as i32));

    let (mut sigterm, mut sigint) = match (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) {
        (Ok(t), Ok(i)) => (t, i),
        _ => {
            say("cannot install signal handlers");
            stop(&mut child, group, args.grace).await;
            let _ = guard.release().await;
            return EXIT_STORE;
        }
    };

    tokio::select! {
        // Loss first: a frozen process resumed past its deadline must stop
        // the command even if it also happens to have finished.
        biased;
        reason = guard.lost() => {
            say(&format!("lost lock `{}` ({reason}); terminating the command", args.key));
            stop(&mut child, group, args.grace).await;
            let _ = guard.release().await;
            EXIT_LOST
        }
        status = child.wait() => {
            let code = match status {
                Ok(s) => exit_code(s),
                Err(e) => {
                    say(&format!("waiting for the command failed: {e}"));
                    EXIT_STORE
                }
            };
            match guard.release().await {
                Ok(()) => code,
                Err(e @ Error::LeaseLost { .. }) => {
                    say(&format!("the command finished, but {e}"));
                    EXIT_LOST
                }
                Err(e) => {
                    // The command ran under the lock; it now expires at its TTL.
                    tracing::warn!(error = %e, "release failed");
                    code
                }
            }
        }
        _ = sigterm.recv() => forward(&mut child, group, args.grace, guard, Signal::SIGTERM).await,
        _ = sigint.recv() => forward(&mut child, group, args.grace, guard, Signal::SIGINT).await,
    }
}

/// Passes a signal to the command's group, waits for it, releases the lock.
async fn forward(
    child: &mut Child,
    group: Option<Pid>,
    grace: Duration,
    guard: fenced::LockGuard,
    sig: Signal,
) -> u8 {
    if let Some(g) = group {
        let _ = killpg(g, sig);
    }
    let code = match tokio::time::timeout(grace, child.wait()).await {
        Ok(Ok(s)) => exit_code(s),
        _ => {
            stop(child, group, Duration::ZERO).await;
            128 + sig as u8
        }
    };
    let _ = guard.release().await;
    code
}

/// SIGTERM to the group, then SIGKILL after `grace`; reaps the child.
async fn stop(child: &mut Child, group: Option<Pid>, grace: Duration) {
    if let Some(g) = group {
        let _ = killpg(g, Signal::SIGTERM);
        if !grace.is_zero() && tokio::time::timeout(grace, child.wait()).await.is_ok() {
            // Leftovers of the group still get the hard stop below.
            let _ = killpg(g, Signal::SIGKILL);
            return;
        }
        let _ = killpg(g, Signal::SIGKILL);
    }
    let _ = child.kill().await;
    let _ = child.wait().await;
}

/// The shell convention: the exit code, or 128 + the signal that killed it.
fn exit_code(status: ExitStatus) -> u8 {
    match (status.code(), status.signal()) {
        (Some(c), _) => c.clamp(0, 255) as u8,
        (None, Some(sig)) => (128 + sig).clamp(0, 255) as u8,
        _ => EXIT_STORE,
    }
}
