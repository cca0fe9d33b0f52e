//! The process of a private server.

use std::{
    process::{Child, Command},
    sync::Mutex,
    time::Duration,
};

use fenced_api::Result;

use super::{fail, send_signal, START_TIMEOUT};

/// A child process that is killed (SIGKILL) and reaped when dropped or replaced.
#[derive(Debug, Default)]
pub(crate) struct Proc(Mutex<Option<Child>>);

impl Proc {
    #[cfg(any(
        feature = "mysql",
        feature = "redis",
        feature = "etcd",
        feature = "zookeeper"
    ))]
    pub(crate) fn spawn(&self, mut cmd: Command, what: &str) -> Result<()> {
        cmd.stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null());
        self.spawn_with_output(cmd, what)
    }

    /// Like [`Proc::spawn`], with the process's stdout and stderr appended
    /// to `log` (a server that logs to stderr).
    #[cfg(feature = "postgres")]
    pub(crate) fn spawn_logging(
        &self,
        mut cmd: Command,
        what: &str,
        log: &std::path::Path,
    ) -> Result<()> {
        let open = || {
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(log)
                .map_err(|e| fail(format!("opening {}: {e}", log.display())))
        };
        cmd.stdout(open()?).stderr(open()?);
        self.spawn_with_output(cmd, what)
    }

    fn spawn_with_output(&self, mut cmd: Command, what: &str) -> Result<()> {
        let child = cmd
            .stdin(std::process::Stdio::null())
            .spawn()
            .map_err(|e| fail(format!("starting {what}: {e}")))?;
        let old = self.lock().replace(child);
        if let Some(old) = old {
            reap(old);
        }
        Ok(())
    }

    /// SIGKILLs the process (no clean shutdown) and waits for it.
    pub(crate) fn kill(&self) {
        let child = self.lock().take();
        if let Some(child) = child {
            reap(child);
        }
    }

    /// Waits up to `limit` for the process to exit on its own (after a
    /// signal that asked it to) and reaps it; SIGKILLs it when it has not.
    /// Whether it exited on its own.
    #[cfg(feature = "postgres")]
    pub(crate) async fn wait_exit(&self, limit: Duration) -> bool {
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            if self.exited() {
                self.kill();
                return true;
            }
            if tokio::time::Instant::now() > deadline {
                self.kill();
                return false;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    pub(crate) fn pid(&self) -> Option<u32> {
        self.lock().as_ref().map(Child::id)
    }

    /// Sends `signal` to the process (see [`send_signal`]).
    pub(crate) fn signal(&self, signal: &str) -> Result<()> {
        send_signal(self.pid(), signal)
    }

    /// Whether the process has exited (a server that refused its options).
    fn exited(&self) -> bool {
        match self.lock().as_mut() {
            Some(c) => !matches!(c.try_wait(), Ok(None)),
            None => true,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Option<Child>> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Polls `probe` every 50 ms until it succeeds, the process exits, or
    /// [`START_TIMEOUT`] passes.
    pub(crate) async fn wait_until_up<F, Fut>(&self, what: &str, mut probe: F) -> Result<()>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = std::result::Result<(), String>>,
    {
        let deadline = tokio::time::Instant::now() + START_TIMEOUT;
        loop {
            let last = match probe().await {
                Ok(()) => return Ok(()),
                Err(e) => e,
            };
            if self.exited() {
                return Err(fail(format!(
                    "the private {what} exited during start-up (last probe: {last})"
                )));
            }
            if tokio::time::Instant::now() > deadline {
                return Err(fail(format!(
                    "the private {what} did not answer within {START_TIMEOUT:?} (last probe: {last})"
                )));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill();
    }
}

fn reap(mut child: Child) {
    let _ = child.kill();
    let _ = child.wait();
}
