//! `fenced run`: hold a lock while a command runs.

use fenced::{Error, LockClient, WaitPolicy};
use nix::sys::signal::Signal;
use tokio::{
    process::Command,
    signal::unix::{signal, Signal as Stream, SignalKind},
};

use super::{
    connect, fail,
    job::{self, Job},
    say, RunArgs, Wait, EXIT_BUSY, EXIT_LOST, EXIT_SPAWN, EXIT_STORE,
};

/// How the command's run ended, before the lock is released.
enum End {
    /// The lock was lost; the command was terminated.
    Lost,
    /// The command exited by itself with this code.
    Exited(u8),
    /// fenced was told to stop; the signal was passed on and this is the
    /// command's code.
    Signalled(u8),
}

/// The signals `fenced run` listens to while the command runs.
struct Signals {
    term: Stream,
    int: Stream,
    hup: Stream,
    quit: Stream,
    child: Stream,
    cont: Stream,
}

impl Signals {
    fn install() -> std::io::Result<Signals> {
        Ok(Signals {
            term: signal(SignalKind::terminate())?,
            int: signal(SignalKind::interrupt())?,
            hup: signal(SignalKind::hangup())?,
            quit: signal(SignalKind::quit())?,
            child: signal(SignalKind::child())?,
            cont: signal(SignalKind::from_raw(Signal::SIGCONT as i32))?,
        })
    }
}

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
    // Before the command starts: from here on a SIGHUP or SIGQUIT must not
    // kill fenced and leave the command running without the lock.
    let mut signals = match Signals::install() {
        Ok(s) => s,
        Err(e) => {
            say(&format!("cannot install signal handlers: {e}"));
            let _ = guard.release().await;
            return EXIT_STORE;
        }
    };

    let mut cmd = Command::new(&args.command[0]);
    cmd.args(&args.command[1..])
        .env("FENCED_TOKEN", guard.token().get().to_string())
        .env("FENCED_KEY", guard.key().as_str());
    let mut job = match Job::spawn(&mut cmd) {
        Ok(j) => j,
        Err(e) => {
            say(&format!("cannot start `{}`: {e}", args.command[0]));
            let _ = guard.release().await;
            return EXIT_SPAWN;
        }
    };

    // Whether fenced stopped itself because the command was stopped from
    // the terminal, and so continues it when fenced is continued.
    let mut suspended = false;
    let end = loop {
        tokio::select! {
            // Loss first: a frozen process resumed past its deadline must stop
            // the command even if it also happens to have finished.
            biased;
            reason = guard.lost() => {
                say(&format!("lost lock `{}` ({reason}); terminating the command", args.key));
                job.stop(args.grace).await;
                break End::Lost;
            }
            status = job.wait() => {
                job.take_terminal();
                break End::Exited(match status {
                    Ok(s) => job::exit_code(s),
                    Err(e) => {
                        say(&format!("waiting for the command failed: {e}"));
                        EXIT_STORE
                    }
                });
            }
            _ = signals.term.recv() => break End::Signalled(job.forward(Signal::SIGTERM, args.grace).await),
            _ = signals.int.recv() => break End::Signalled(job.forward(Signal::SIGINT, args.grace).await),
            _ = signals.hup.recv() => break End::Signalled(job.forward(Signal::SIGHUP, args.grace).await),
            _ = signals.quit.recv() => break End::Signalled(job.forward(Signal::SIGQUIT, args.grace).await),
            _ = signals.child.recv() => {
                if let Some(sig) = job.stopped_by_terminal() {
                    job.take_terminal();
                    if job::can_be_resumed() {
                        tracing::info!(signal = %sig, "the command was stopped; stopping fenced too");
                        suspended = true;
                        job::stop_self(sig);
                    } else if sig == Signal::SIGTSTP || job::fenced_is_foreground() {
                        say(&format!(
                            "the command was stopped by {sig}, but no job-control shell could resume \
                             fenced; continuing it"
                        ));
                        job.resume();
                    } else {
                        // It needs the terminal, which a background fenced
                        // cannot give it, and nobody can bring fenced to the
                        // foreground: it would stay stopped, holding the lock.
                        say(&format!(
                            "the command was stopped by {sig} (it needs the terminal, and fenced runs \
                             in the background without job control); terminating it"
                        ));
                        job.stop(args.grace).await;
                        break End::Signalled(128 + sig as u8);
                    }
                }
            }
            _ = signals.cont.recv(), if suspended => {
                suspended = false;
                job.resume();
            }
        }
    };
    drop(job);

    match end {
        End::Lost => {
            let _ = guard.release().await;
            EXIT_LOST
        }
        End::Signalled(code) => {
            let _ = guard.release().await;
            code
        }
        End::Exited(code) => match guard.release().await {
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
        },
    }
}
