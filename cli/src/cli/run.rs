//! `fenced run`: hold a lock while a command runs, and stop the command
//! before the store can grant the key to anyone else (the timeline is in
//! the module docs of `cli/mod.rs` and in `fenced run --help`).

use std::time::Duration;

use fenced::{Error, Label, LockClient, LockGuard, SafetyMargin, WaitPolicy};
use nix::sys::signal::Signal;
use tokio::{
    process::Command,
    signal::unix::{signal, Signal as Stream, SignalKind},
    time::Instant,
};

use super::{
    connect, fail,
    job::{self, Job, Leftovers, WindDown},
    say, RunArgs, Wait, EXIT_BUSY, EXIT_CONFIG, EXIT_LOST, EXIT_SPAWN, EXIT_STORE,
};

/// `--grace` when not given (shortened to the largest that fits `--ttl`).
pub(crate) const DEFAULT_GRACE: Duration = Duration::from_secs(10);

/// How long fenced tries to release a lock it lost or gave up (the
/// command was stopped for it): the store may well be unreachable — that
/// is often why — and the lock expires at its TTL anyway.
pub(crate) const RELEASE_AFTER_LOSS: Duration = Duration::from_secs(1);

/// How long fenced tries to release the lock after the command exited by
/// itself (or after a signal passed on): longer, since the store was
/// answering, but bounded — never the store's whole chain of operation
/// timeouts and retries. When it runs out fenced exits anyway, with the
/// command's status and a warning; the lock expires at its TTL.
pub(crate) const RELEASE_AFTER_EXIT: Duration = Duration::from_secs(5);

/// How the command's run ended, before the lock is released.
enum End {
    /// The lock was lost, or was running out, or `--max-hold` was reached:
    /// the command was stopped for it.
    Lost,
    /// The command exited by itself with this code.
    Exited(u8),
    /// fenced was told to stop (or the command had to be stopped for the
    /// terminal): a signal went to the whole group at `.1`, and this is the
    /// command's code.
    Signalled(u8, Instant),
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

    /// The next signal that tells fenced to stop (SIGTERM, SIGINT, SIGHUP,
    /// SIGQUIT).
    async fn stop(&mut self) -> Signal {
        tokio::select! {
            _ = self.term.recv() => Signal::SIGTERM,
            _ = self.int.recv() => Signal::SIGINT,
            _ = self.hup.recv() => Signal::SIGHUP,
            _ = self.quit.recv() => Signal::SIGQUIT,
        }
    }
}

/// How long fenced, stopped by a signal while waiting, waits for the store
/// to take its place out of the line before it exits (past it the place
/// lapses after its TTL).
pub(crate) const LEAVE_ON_SIGNAL: Duration = Duration::from_secs(3);

/// The longest `--grace` that fits a lease of `ttl` renewed every
/// `interval` with this safety `margin`: `ttl − margin − interval −
/// interval/4`.
///
/// With renewals healthy the safe deadline is at most `ttl − margin` after
/// the last renewal was sent; the next one is sent `interval` later and
/// must be back (a quarter of the interval is allowed for its round trip
/// and scheduling) before `safe deadline − grace`, when the command gets
/// SIGTERM. A longer grace would stop the command while renewals are fine.
pub(crate) fn max_grace(ttl: Duration, margin: Duration, interval: Duration) -> Duration {
    ttl.saturating_sub(margin)
        .saturating_sub(interval)
        .saturating_sub(interval / 4)
}

/// `Err(message)` when `grace` does not fit `ttl` (see [`max_grace`]).
pub(crate) fn check_grace(
    ttl: Duration,
    grace: Duration,
    margin: Duration,
    interval: Duration,
) -> Result<(), String> {
    let largest = max_grace(ttl, margin, interval);
    if grace <= largest {
        return Ok(());
    }
    let longer = match shortest_ttl_for(grace) {
        Some(secs) => format!("or use --ttl {secs}s or longer"),
        None => format!(
            "no --ttl up to the maximum {} fits it",
            fmt_duration(fenced::LockOptions::MAX_TTL)
        ),
    };
    Err(format!(
        "--grace {} does not fit --ttl {}: once renewals fail the command gets SIGTERM at the safe \
         deadline less --grace and SIGKILL at the safe deadline, so --grace + the safety margin \
         ({}) + one renewal interval ({}) and a quarter of it must not exceed the TTL; the largest \
         --grace for --ttl {} is {} ({longer})",
        fmt_duration(grace),
        fmt_duration(ttl),
        fmt_duration(margin),
        fmt_duration(interval),
        fmt_duration(ttl),
        fmt_duration(largest),
    ))
}

/// The shortest TTL in whole seconds, at most [`fenced::LockOptions::MAX_TTL`],
/// whose largest grace (default margin, ttl/3 renewals) is at least `grace`.
fn shortest_ttl_for(grace: Duration) -> Option<u64> {
    let fits = |secs: u64| {
        let t = Duration::from_secs(secs);
        grace <= max_grace(t, SafetyMargin::DEFAULT.for_ttl(t), t / 3)
    };
    // The largest grace is 7/12 of the TTL less the margin, and the margin
    // is at most max(1 % of the TTL, 100 ms): this TTL always fits.
    let g = grace.as_secs_f64();
    let enough = ((g + 0.1) * 12.0 / 7.0).max(g / (7.0 / 12.0 - 0.01)).ceil();
    let max = fenced::LockOptions::MAX_TTL.as_secs();
    if enough > max as f64 {
        return fits(max).then_some(max);
    }
    let mut secs = (enough as u64).max(1);
    // The bound above is within a second or two of the shortest.
    while secs > 1 && fits(secs - 1) {
        secs -= 1;
    }
    Some(secs)
}

/// A duration in milliseconds precision, humantime style (`3s 400ms`).
fn fmt_duration(d: Duration) -> String {
    let ms = Duration::from_millis(u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
    humantime::format_duration(ms).to_string()
}

pub(crate) async fn run(url: Option<String>, args: RunArgs) -> u8 {
    // Everything that can be checked without the store, before any I/O.
    if let Some(label) = &args.label {
        if let Err(e) = Label::new(label) {
            return fail(&e);
        }
    }
    if args.max_hold.is_some_and(|m| m.is_zero()) {
        say("--max-hold must be longer than zero");
        return EXIT_CONFIG;
    }
    // fenced's policy (ttl/3 renewals, the default margin), checked again
    // below with the client's own figures.
    let (margin, interval) = (SafetyMargin::DEFAULT.for_ttl(args.ttl), args.ttl / 3);
    let mut grace = args
        .grace
        .unwrap_or(DEFAULT_GRACE.min(max_grace(args.ttl, margin, interval)));
    if let Err(msg) = check_grace(args.ttl, grace, margin, interval) {
        say(&msg);
        return EXIT_CONFIG;
    }
    let store = match connect(url).await {
        Ok(s) => s,
        Err(e) => return fail(&e),
    };
    let wait = match args.wait {
        Wait::For(d) if d.is_zero() => WaitPolicy::NoWait,
        Wait::For(d) => WaitPolicy::Timeout(d),
        Wait::Forever => WaitPolicy::Forever,
    };
    // No `max_hold` on the client: at --max-hold fenced stops the command
    // itself, with its grace, while the watchdog keeps the lock.
    let mut builder = LockClient::builder(store).ttl(args.ttl).wait(wait);
    if let Some(label) = &args.label {
        builder = builder.label(label.as_str());
    }
    let client = match builder.build() {
        Ok(c) => c,
        Err(e) => return fail(&e),
    };
    let interval = client.renew_interval().unwrap_or(args.ttl / 3);
    if let Err(msg) = check_grace(client.ttl(), grace, client.margin(), interval) {
        say(&msg);
        return EXIT_CONFIG;
    }
    // Before the wait: a signal while waiting must give the place in line
    // back (and wait for the store to take it out), not kill fenced and
    // leave the place to hold up everyone behind it for its TTL. From the
    // grant on, the same handlers keep a SIGHUP or SIGQUIT from killing
    // fenced and leaving the command running without the lock.
    let mut signals = match Signals::install() {
        Ok(s) => s,
        Err(e) => {
            say(&format!("cannot install signal handlers: {e}"));
            return EXIT_STORE;
        }
    };
    let acquire = async {
        match (args.permits, args.shared, args.exclusive) {
            (Some(n), _, _) => match client.semaphore(args.key.as_str(), n) {
                Ok(pool) => pool.acquire().await,
                Err(e) => Err(e),
            },
            (None, true, _) => match client.rw_lock(args.key.as_str()) {
                Ok(rw) => rw.read().await,
                Err(e) => Err(e),
            },
            (None, false, true) => match client.rw_lock(args.key.as_str()) {
                Ok(rw) => rw.write().await,
                Err(e) => Err(e),
            },
            (None, false, false) => client.acquire(args.key.as_str()).await,
        }
    };
    let waited = tokio::select! {
        // A grant that is ready wins: a signal that came with it then goes
        // to the command, which is stopped and the lock released.
        biased;
        taken = acquire => Ok(taken),
        sig = signals.stop() => Err(sig),
    };
    // The wait is dropped by now: its place is being taken out.
    let taken = match waited {
        Ok(taken) => taken,
        Err(sig) => return gave_up_waiting(&args.key, sig).await,
    };
    let guard = match taken {
        Ok(g) => g,
        Err(Error::Timeout { key, waited }) => {
            let taken = match (args.permits, args.shared, args.exclusive) {
                (Some(1), _, _) => format!("the one permit of `{key}` is taken"),
                (Some(n), _, _) => format!("all {n} permits of `{key}` are taken"),
                (None, true, _) => format!("`{key}` is held by a writer, or a writer waits first"),
                (None, false, true) => format!("`{key}` is held by readers or a writer"),
                (None, false, false) => format!("lock `{key}` is held elsewhere"),
            };
            say(&format!(
                "{taken} (waited {waited:.1?}); not running the command"
            ));
            return EXIT_BUSY;
        }
        Err(e) => return fail(&e),
    };
    // A store may grant a shorter lease than asked (ZooKeeper: no longer
    // than the lock's session); the grace must fit what was granted, with
    // renewals at the same fraction of it.
    let granted = guard.handle().lease().ttl;
    if granted < args.ttl {
        let margin = SafetyMargin::DEFAULT.for_ttl(granted);
        let every = interval.mul_f64(granted.as_secs_f64() / args.ttl.as_secs_f64());
        if args.grace.is_none() {
            grace = grace.min(max_grace(granted, margin, every));
        } else if let Err(msg) = check_grace(granted, grace, margin, every) {
            say(&format!(
                "the store granted `{}` for {} only (asked {}): {msg}",
                args.key,
                fmt_duration(granted),
                fmt_duration(args.ttl)
            ));
            release(guard, RELEASE_AFTER_EXIT).await;
            return EXIT_CONFIG;
        }
    }
    let max_hold_at = args.max_hold.and_then(|m| Instant::now().checked_add(m));

    let mut cmd = Command::new(&args.command[0]);
    cmd.args(&args.command[1..])
        .env("FENCED_TOKEN", guard.token().get().to_string())
        .env("FENCED_KEY", guard.key().as_str());
    match client.label() {
        Some(label) => cmd.env("FENCED_LABEL", label.as_str()),
        None => cmd.env_remove("FENCED_LABEL"),
    };
    let mut job = match Job::spawn(&mut cmd) {
        Ok(j) => j,
        Err(e) => {
            say(&format!("cannot start `{}`: {e}", args.command[0]));
            release(guard, RELEASE_AFTER_EXIT).await;
            return EXIT_SPAWN;
        }
    };

    // Whether fenced stopped itself because the command was stopped from
    // the terminal, and so continues it when fenced is continued.
    let mut suspended = false;
    let key = &args.key;
    let end = loop {
        tokio::select! {
            // Loss first: a frozen process resumed past its deadline must stop
            // the command even if it also happens to have finished; then the
            // command's own end, before the lock running out.
            biased;
            reason = guard.lost() => {
                say(&format!(
                    "lost lock `{key}` ({reason}); it may already belong to another holder: \
                     killing the command (SIGKILL)"
                ));
                job.kill().await;
                break End::Lost;
            }
            // A command that has finished while the lock was certainly held
            // ran under it, even if the lock is running out now.
            status = job.wait() => {
                job.take_terminal();
                let code = match status {
                    Ok(s) => job::exit_code(s),
                    Err(e) => {
                        say(&format!("waiting for the command failed: {e}"));
                        EXIT_STORE
                    }
                };
                // Noticed only now, after the safe deadline (fenced was
                // frozen): when it finished is unknown, so it is not vouched for.
                if guard.deadline().is_none() {
                    say(&format!(
                        "the command finished, but lock `{key}` ran out before fenced saw it finish"
                    ));
                    job.kill().await;
                    break End::Lost;
                }
                break End::Exited(code);
            }
            () = guard.expiring(grace) => {
                match guard.deadline() {
                    Some(deadline) if deadline > Instant::now() => {
                        let left = deadline - Instant::now();
                        say(&format!(
                            "cannot renew lock `{key}`; it is certainly held for {} more: \
                             SIGTERM to the command now, SIGKILL in {} at the latest",
                            fmt_duration(left),
                            fmt_duration(left),
                        ));
                        stop_for_the_lock(&mut job, &guard, grace).await;
                    }
                    // Lost meanwhile, or the safe deadline is already past
                    // (fenced was frozen): a loss, no grace.
                    _ => {
                        say(&format!(
                            "lost lock `{key}` (its safe deadline passed without a renewal); \
                             killing the command (SIGKILL)"
                        ));
                        job.kill().await;
                    }
                }
                break End::Lost;
            }
            () = sleep_until_opt(max_hold_at) => {
                say(&format!(
                    "--max-hold reached for lock `{key}`: SIGTERM to the command, SIGKILL after \
                     --grace; then the lock is released"
                ));
                stop_for_the_lock(&mut job, &guard, grace).await;
                break End::Lost;
            }
            _ = signals.term.recv() => break pass_on(&mut job, &guard, Signal::SIGTERM, grace, key).await,
            _ = signals.int.recv() => break pass_on(&mut job, &guard, Signal::SIGINT, grace, key).await,
            _ = signals.hup.recv() => break pass_on(&mut job, &guard, Signal::SIGHUP, grace, key).await,
            _ = signals.quit.recv() => break pass_on(&mut job, &guard, Signal::SIGQUIT, grace, key).await,
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
                        let sent = Instant::now();
                        match job.wind_down(Signal::SIGTERM, grace, guard.expiring(Duration::ZERO)).await {
                            WindDown::Deadline => break End::Lost,
                            WindDown::Exited(code) => break End::Signalled(code, sent),
                            WindDown::GraceOver => break End::Signalled(128 + Signal::SIGKILL as u8, sent),
                        }
                    }
                }
            }
            _ = signals.cont.recv(), if suspended => {
                suspended = false;
                job.resume();
            }
        }
    };
    // The lock covers the command's whole process group: what it left
    // running in the background ends before the lock is released. (After a
    // stop for the lock the group was SIGKILLed already.)
    let end = match end {
        End::Lost => End::Lost,
        done => {
            // After a signal to the group the leftovers had it too: what is
            // left of the one grace, not a second one.
            let grace = match done {
                End::Signalled(_, sent) => grace.saturating_sub(sent.elapsed()),
                _ => grace,
            };
            leftovers(&mut job, &guard, grace, key, done).await
        }
    };
    drop(job);

    match end {
        End::Lost => {
            release(guard, RELEASE_AFTER_LOSS).await;
            EXIT_LOST
        }
        // The command ran to its end (or to a signal passed on); if the
        // store says the lease was gone by then, the lock did not cover it
        // to the end: that is a loss, whatever the command's own status.
        End::Signalled(code, _) | End::Exited(code) => {
            match release(guard, RELEASE_AFTER_EXIT).await {
                Some(Err(e @ Error::LeaseLost { .. })) => {
                    say(&format!("the command finished, but {e}"));
                    EXIT_LOST
                }
                _ => code,
            }
        }
    }
}

/// Ends what the command left running in its group (see
/// [`Job::end_leftovers`]) before the lock is released; `done` is how the
/// command itself ended, kept unless the lock ran out meanwhile.
async fn leftovers(job: &mut Job, guard: &LockGuard, grace: Duration, key: &str, done: End) -> End {
    match job
        .end_leftovers(grace, guard.expiring(Duration::ZERO))
        .await
    {
        Leftovers::None => done,
        Leftovers::Ended => {
            say("the command left processes running in its group; they got SIGTERM and ended before the lock was released");
            done
        }
        Leftovers::Killed => {
            say("the command left processes running in its group that outlived --grace after SIGTERM: killed them (SIGKILL) before releasing the lock");
            done
        }
        Leftovers::KilledAtDeadline => {
            say(&format!(
                "the command left processes running in its group, still there when lock `{key}` ran out: killed them (SIGKILL)"
            ));
            End::Lost
        }
    }
}

/// Stops the command because the lock is running out or `--max-hold` was
/// reached: SIGTERM now; SIGKILL when `grace` is over, or at the lock's
/// safe deadline (or its loss) if that comes first. The watchdog keeps
/// renewing meanwhile: the lock stays held while the command winds down.
/// Whatever is left of the command's group is SIGKILLed after it exits.
async fn stop_for_the_lock(job: &mut Job, guard: &LockGuard, grace: Duration) {
    let end = job
        .wind_down(Signal::SIGTERM, grace, guard.expiring(Duration::ZERO))
        .await;
    match end {
        WindDown::Exited(code) => {
            tracing::info!(code, "the command stopped within its grace");
            // Leftovers of the group (background children) must not run on
            // once the lock is given up.
            job.kill().await;
        }
        WindDown::GraceOver => say("the command outlived --grace: killed it (SIGKILL)"),
        WindDown::Deadline => {
            say("the command was still running at the lock's safe deadline: killed it (SIGKILL)")
        }
    }
}

/// fenced was told to stop while waiting: the dropped wait's clean-up
/// (leaving the line) gets [`LEAVE_ON_SIGNAL`] to finish, then fenced exits
/// as the signal would have ended it (128 + its number), the command never
/// started. One narrow window stays: a grant the store made just as the
/// wait was dropped, whose answer had not arrived, has no guard to release
/// it and lapses after its TTL, as any acquisition cancelled in flight.
async fn gave_up_waiting(key: &str, sig: Signal) -> u8 {
    let left = fenced::cleanup::settle(LEAVE_ON_SIGNAL).await;
    if left {
        say(&format!(
            "{sig} while waiting for `{key}`: left the line; not running the command"
        ));
    } else {
        say(&format!(
            "{sig} while waiting for `{key}`: the store did not confirm leaving the line within \
             {LEAVE_ON_SIGNAL:?}; the place lapses after its TTL; not running the command"
        ));
    }
    128 + sig as u8
}

/// A signal sent to fenced, passed on to the command's group: the command
/// gets `grace` to exit — less if the lock runs out meanwhile, at its safe
/// deadline it is SIGKILLed and the run ends as lost.
async fn pass_on(job: &mut Job, guard: &LockGuard, sig: Signal, grace: Duration, key: &str) -> End {
    let sent = Instant::now();
    match job
        .wind_down(sig, grace, guard.expiring(Duration::ZERO))
        .await
    {
        WindDown::Exited(code) => End::Signalled(code, sent),
        WindDown::GraceOver => End::Signalled(128 + Signal::SIGKILL as u8, sent),
        WindDown::Deadline => {
            say(&format!(
                "lost lock `{key}` while the command was stopping after {sig}: killed it (SIGKILL)"
            ));
            End::Lost
        }
    }
}

/// Releases the lock, waiting at most `bound` for the store. `None` when
/// the bound ran out (a warning is logged; the lock expires at its TTL).
async fn release(guard: LockGuard, bound: Duration) -> Option<Result<(), Error>> {
    let key = guard.key().clone();
    match tokio::time::timeout(bound, guard.release()).await {
        Ok(Ok(())) => Some(Ok(())),
        Ok(Err(e)) => {
            tracing::debug!(key = %key, error = %e, "release failed");
            if !matches!(e, Error::LeaseLost { .. }) {
                tracing::warn!(key = %key, error = %e, "release failed; the lock expires at its TTL");
            }
            Some(Err(e))
        }
        Err(_) => {
            tracing::warn!(
                key = %key,
                bound_ms = u64::try_from(bound.as_millis()).unwrap_or(u64::MAX),
                "the store did not answer the release in time; not waiting longer: the lock expires at its TTL"
            );
            None
        }
    }
}

async fn sleep_until_opt(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;

    #[test]
    fn the_default_grace_fits_the_default_ttl_and_the_limit_is_named() {
        let s = Duration::from_secs;
        let margin = |t| SafetyMargin::DEFAULT.for_ttl(t);
        assert!(check_grace(s(30), s(10), margin(s(30)), s(10)).is_ok());
        // 30 s − 300 ms − 10 s − 2.5 s
        assert_eq!(
            max_grace(s(30), margin(s(30)), s(10)),
            Duration::from_millis(17_200)
        );
        // 6 s − 100 ms − 2 s − 500 ms
        assert_eq!(
            max_grace(s(6), margin(s(6)), s(2)),
            Duration::from_millis(3_400)
        );
        let msg = check_grace(s(6), s(5), margin(s(6)), s(2)).unwrap_err();
        assert!(
            msg.contains("the largest --grace for --ttl 6s is 3s 400ms"),
            "{msg}"
        );
        // 5 s needs 7/12 · ttl − 100 ms ≥ 5 s: ttl ≥ 8.75 s → 9 s.
        assert!(msg.contains("--ttl 9s or longer"), "{msg}");
        assert!(check_grace(s(9), s(5), margin(s(9)), s(3)).is_ok());
        let msg = check_grace(s(30), s(3600), margin(s(30)), s(10)).unwrap_err();
        let ttl: u64 = msg
            .rsplit("--ttl ")
            .next()
            .and_then(|t| t.split('s').next())
            .and_then(|t| t.parse().ok())
            .unwrap_or(0);
        let t = s(ttl);
        assert!(check_grace(t, s(3600), margin(t), t / 3).is_ok(), "{msg}");
        assert!(
            check_grace(t - s(1), s(3600), margin(t - s(1)), (t - s(1)) / 3).is_err(),
            "{msg}"
        );
    }

    #[test]
    fn a_grace_no_ttl_can_fit_is_said_so_at_once() {
        let s = Duration::from_secs;
        for grace in [s(30 * 24 * 3600), s(u64::MAX / 2), Duration::MAX] {
            let msg = check_grace(s(30), grace, s(1), s(10)).unwrap_err();
            assert!(msg.contains("no --ttl up to the maximum"), "{msg}");
        }
        // Just below a day still has an answer, and it fits.
        let msg = check_grace(s(30), s(40_000), s(1), s(10)).unwrap_err();
        assert!(msg.contains("or use --ttl"), "{msg}");
        let secs = shortest_ttl_for(s(40_000)).unwrap();
        let t = s(secs);
        assert!(s(40_000) <= max_grace(t, SafetyMargin::DEFAULT.for_ttl(t), t / 3));
        assert!(
            s(40_000)
                > max_grace(
                    t - s(1),
                    SafetyMargin::DEFAULT.for_ttl(t - s(1)),
                    (t - s(1)) / 3
                )
        );
    }
}
