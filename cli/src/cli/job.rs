//! The command of `fenced run` as a job: its process group, the terminal,
//! job-control stops and the signals passed on to it.
//!
//! CMD runs in a process group of its own, so that stopping it reaches
//! everything it started. A process group that is not the terminal's
//! foreground group is stopped (SIGTTIN) when it reads the terminal, so when
//! fenced itself is the foreground job it hands the terminal to CMD's group
//! and takes it back when CMD is done — what a shell does for its jobs.

use std::{io::IsTerminal, os::unix::process::ExitStatusExt, process::ExitStatus, time::Duration};

use nix::{
    sys::signal::{kill, killpg, pthread_sigmask, SigSet, SigmaskHow, Signal},
    unistd::{getpgid, getpgrp, getppid, getsid, tcgetpgrp, tcsetpgrp, Pid},
};
use tokio::process::{Child, Command};

use super::EXIT_STORE;

/// A started command and what fenced did with the terminal for it.
#[derive(Debug)]
pub(crate) struct Job {
    child: Child,
    /// CMD's process group (its pid).
    group: Option<Pid>,
    /// Whether fenced made CMD's group the terminal's foreground group and
    /// has not taken it back yet.
    has_terminal: bool,
}

impl Job {
    /// Starts `cmd` in a new process group and, when fenced is the
    /// foreground job of the terminal on its stdin, hands the terminal to it.
    pub(crate) fn spawn(cmd: &mut Command) -> std::io::Result<Job> {
        cmd.process_group(0).kill_on_drop(true);
        let foreground = fenced_is_foreground();
        let child = cmd.spawn()?;
        let group = child
            .id()
            .and_then(|id| i32::try_from(id).ok())
            .map(Pid::from_raw);
        let mut job = Job {
            child,
            group,
            has_terminal: false,
        };
        if foreground {
            job.give_terminal();
        }
        Ok(job)
    }

    /// Waits for CMD to exit.
    pub(crate) async fn wait(&mut self) -> std::io::Result<ExitStatus> {
        self.child.wait().await
    }

    /// Makes CMD's group the terminal's foreground group, then continues it:
    /// it may have read the terminal and stopped before it was given it.
    fn give_terminal(&mut self) {
        let Some(group) = self.group else { return };
        match set_foreground(group) {
            Ok(()) => {
                self.has_terminal = true;
                let _ = killpg(group, Signal::SIGCONT);
            }
            Err(e) => tracing::debug!(error = %e, "could not give the terminal to the command"),
        }
    }

    /// Gives the terminal back to fenced's group, if CMD's group still has
    /// it (another process may have taken it meanwhile: then it is left alone).
    pub(crate) fn take_terminal(&mut self) {
        if !std::mem::take(&mut self.has_terminal) {
            return;
        }
        let Some(group) = self.group else { return };
        if tcgetpgrp(std::io::stdin()) == Ok(group) {
            if let Err(e) = set_foreground(getpgrp()) {
                tracing::debug!(error = %e, "could not take the terminal back");
            }
        }
    }

    /// If CMD has just been stopped by a terminal signal — Ctrl-Z (SIGTSTP),
    /// or reading (SIGTTIN) or writing (SIGTTOU) the terminal from the
    /// background — returns that signal. A SIGSTOP is someone freezing the
    /// job on purpose and is left alone. Call it when SIGCHLD arrives.
    pub(crate) fn stopped_by_terminal(&self) -> Option<Signal> {
        #[cfg(any(target_os = "linux", target_os = "android", target_os = "freebsd"))]
        {
            use nix::sys::wait::{waitid, Id, WaitPidFlag, WaitStatus};
            let pid = self.group?;
            // Stops only (no WEXITED): an exit stays for tokio to reap.
            match waitid(Id::Pid(pid), WaitPidFlag::WSTOPPED | WaitPidFlag::WNOHANG) {
                Ok(WaitStatus::Stopped(_, sig))
                    if matches!(sig, Signal::SIGTSTP | Signal::SIGTTIN | Signal::SIGTTOU) =>
                {
                    Some(sig)
                }
                _ => None,
            }
        }
        #[cfg(not(any(target_os = "linux", target_os = "android", target_os = "freebsd")))]
        {
            None
        }
    }

    /// Continues CMD after fenced was resumed (`fg` or `bg`): on `fg` —
    /// fenced is the foreground job again — CMD's group gets the terminal back.
    pub(crate) fn resume(&mut self) {
        if fenced_is_foreground() {
            self.give_terminal();
        } else if let Some(group) = self.group {
            let _ = killpg(group, Signal::SIGCONT);
        }
    }

    /// Sends `sig` to CMD's group, then SIGCONT so that a stopped CMD acts on
    /// it (as shells do for `kill` of a stopped job).
    pub(crate) fn signal(&self, sig: Signal) {
        if let Some(g) = self.group {
            let _ = killpg(g, sig);
            if sig != Signal::SIGKILL && sig != Signal::SIGCONT {
                let _ = killpg(g, Signal::SIGCONT);
            }
        }
    }

    /// Sends `sig` to CMD's group (and SIGCONT), then waits for CMD to
    /// exit — for `grace` at most, and no longer than until `deadline`
    /// resolves; then SIGKILLs the group. The terminal is taken back.
    pub(crate) async fn wind_down(
        &mut self,
        sig: Signal,
        grace: Duration,
        deadline: impl std::future::Future<Output = ()>,
    ) -> WindDown {
        self.signal(sig);
        let end = tokio::select! {
            // An exit that is already there counts, whatever else is due.
            biased;
            status = self.child.wait() => match status {
                Ok(s) => WindDown::Exited(exit_code(s)),
                Err(e) => {
                    tracing::warn!(error = %e, "waiting for the command failed; killing it");
                    self.kill().await;
                    WindDown::GraceOver
                }
            },
            () = deadline => {
                self.kill().await;
                WindDown::Deadline
            }
            () = tokio::time::sleep(grace) => {
                self.kill().await;
                WindDown::GraceOver
            }
        };
        self.take_terminal();
        end
    }

    /// Whether anything of CMD's process group is still there (CMD itself
    /// may be gone: what it started in the background stays in its group).
    pub(crate) fn group_alive(&self) -> bool {
        let Some(group) = self.group else {
            return false;
        };
        // Only "no such process" means gone: EPERM is a member fenced may
        // not signal (it changed its credentials), still running.
        if killpg(group, None) == Err(nix::errno::Errno::ESRCH) {
            return false;
        }
        // A dead member whose new parent has not reaped it yet (a zombie)
        // still answers kill(0) but runs nothing: only live members count.
        // Without /proc, every member counts.
        live_members_in_proc(group).unwrap_or(true)
    }

    /// After CMD exited: what it left in its group (background children)
    /// gets SIGTERM (and SIGCONT) and up to `grace` to exit — less if
    /// `deadline` resolves first — then SIGKILL. The lock covers the whole
    /// group, so nothing of it may outlive the release. A process that left
    /// the group (`setsid`, `setpgid`) is beyond reach: it is on its own.
    pub(crate) async fn end_leftovers(
        &mut self,
        grace: Duration,
        deadline: impl std::future::Future<Output = ()>,
    ) -> Leftovers {
        if !self.group_alive() {
            return Leftovers::None;
        }
        self.signal(Signal::SIGTERM);
        let end = tokio::select! {
            biased;
            () = self.group_gone() => Leftovers::Ended,
            () = deadline => Leftovers::KilledAtDeadline,
            () = tokio::time::sleep(grace) => Leftovers::Killed,
        };
        if end != Leftovers::Ended {
            self.signal(Signal::SIGKILL);
            // SIGKILL cannot be refused; the bound only covers the moment
            // it takes the orphans' new parent to reap them.
            let _ = tokio::time::timeout(Duration::from_secs(1), self.group_gone()).await;
        }
        end
    }

    async fn group_gone(&self) {
        while self.group_alive() {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// SIGKILL to the group at once (no SIGTERM first); reaps CMD, waits
    /// (a second at most) until the rest of the group is gone too, and
    /// takes the terminal back.
    pub(crate) async fn kill(&mut self) {
        self.signal(Signal::SIGKILL);
        let _ = self.child.kill().await;
        let _ = self.child.wait().await;
        let _ = tokio::time::timeout(Duration::from_secs(1), self.group_gone()).await;
        self.take_terminal();
    }
}

/// What [`Job::end_leftovers`] found and did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Leftovers {
    /// Nothing of the group was left.
    None,
    /// Processes were left; they ended after SIGTERM within the grace.
    Ended,
    /// Processes were left and outlived the grace: SIGKILLed.
    Killed,
    /// Processes were left and still there when the lock ran out: SIGKILLed.
    KilledAtDeadline,
}

/// How [`Job::wind_down`] ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum WindDown {
    /// CMD exited within the time it had, with this code.
    Exited(u8),
    /// CMD was still running when `grace` ran out: SIGKILLed.
    GraceOver,
    /// CMD was still running when the deadline came: SIGKILLed.
    Deadline,
}

impl Drop for Job {
    fn drop(&mut self) {
        self.take_terminal();
    }
}

/// Whether `/proc` shows a live process of `group`; `None` when `/proc`
/// cannot be read.
///
/// The group's number cannot be taken by a new group while a member is
/// left (zombies included), so this never counts another command's
/// processes; once the last member is reaped it is never looked at again.
fn live_members_in_proc(group: Pid) -> Option<bool> {
    let entries = std::fs::read_dir("/proc").ok()?;
    let group = group.as_raw().to_string();
    let mut seen_any = false;
    for entry in entries.flatten() {
        let name = entry.file_name();
        if !name.as_encoded_bytes().iter().all(u8::is_ascii_digit) {
            continue;
        }
        // `pid (comm) state ppid pgrp …`; comm may hold spaces, ')' and
        // bytes that are not UTF-8 (the kernel cuts it at 15 bytes).
        let Ok(stat) = std::fs::read(entry.path().join("stat")) else {
            continue;
        };
        seen_any = true;
        let Some(close) = stat.iter().rposition(|&b| b == b')') else {
            continue;
        };
        let rest = String::from_utf8_lossy(&stat[close + 1..]);
        let mut fields = rest.split_whitespace();
        let (Some(state), Some(_ppid), Some(pgrp)) = (fields.next(), fields.next(), fields.next())
        else {
            continue;
        };
        if pgrp != group {
            continue;
        }
        // A process whose main thread ended shows as a zombie while its
        // other threads still run.
        let dead = matches!(state, "Z" | "X")
            && std::fs::read_dir(entry.path().join("task")).map_or(true, |t| t.count() <= 1);
        if !dead {
            return Some(true);
        }
    }
    seen_any.then_some(false)
}

/// Whether stdin is a terminal whose foreground group is fenced's own.
pub(crate) fn fenced_is_foreground() -> bool {
    let stdin = std::io::stdin();
    stdin.is_terminal() && tcgetpgrp(&stdin) == Ok(getpgrp())
}

/// Makes `group` the foreground group of the terminal on stdin. SIGTTOU is
/// blocked on this thread for the call: from a background group (after the
/// terminal was handed over) `tcsetpgrp` would otherwise stop fenced.
fn set_foreground(group: Pid) -> nix::Result<()> {
    let mut ttou = SigSet::empty();
    ttou.add(Signal::SIGTTOU);
    let mut before = SigSet::empty();
    pthread_sigmask(SigmaskHow::SIG_BLOCK, Some(&ttou), Some(&mut before))?;
    let done = tcsetpgrp(std::io::stdin(), group);
    let _ = pthread_sigmask(SigmaskHow::SIG_SETMASK, Some(&before), None);
    done
}

/// Whether a job-control shell can resume fenced after it stops: its parent
/// is in the same session but another process group (so fenced's group is
/// not orphaned, and the kernel would deliver a stop signal to it).
pub(crate) fn can_be_resumed() -> bool {
    let parent = getppid();
    matches!(
        (getsid(None), getsid(Some(parent)), getpgid(Some(parent))),
        (Ok(mine), Ok(theirs), Ok(group)) if mine == theirs && group != getpgrp()
    )
}

/// Stops fenced itself with `sig`, as CMD was stopped: the shell then sees
/// the whole job stopped.
pub(crate) fn stop_self(sig: Signal) {
    let _ = kill(Pid::this(), sig);
}

/// The shell convention: the exit code, or 128 + the signal that killed it.
pub(crate) fn exit_code(status: ExitStatus) -> u8 {
    match (status.code(), status.signal()) {
        (Some(c), _) => c.clamp(0, 255) as u8,
        (None, Some(sig)) => (128 + sig).clamp(0, 255) as u8,
        _ => EXIT_STORE,
    }
}
