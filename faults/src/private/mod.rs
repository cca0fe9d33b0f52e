//! Private server instances for tests that must not touch the shared
//! services: their own data directory, their own loopback port, killed and
//! removed when the handle is dropped.
//!
//! * [`PrivateMariaDb`] — `mariadbd` (read-only, TLS-only, hard restart);
//! * [`PrivateRedis`] — `redis-server` (persistence modes, `requirepass`,
//!   TLS-only, hard restart, SIGSTOP/SIGCONT);
//! * [`PrivateEtcd`] — `etcd`, one or three members (TLS client port,
//!   authentication, member kill and restart);
//! * [`TestCa`] — a throw-away certificate authority (rcgen) that issues the
//!   servers' certificates, so TLS tests verify a real chain.
//!
//! The binaries are the ones `scripts/services.sh` installs; a missing one is
//! an error that names that script. Every process listens on 127.0.0.1 only.

mod etcd;
mod mariadb;
mod redis;
mod tls;

use std::{
    path::PathBuf,
    process::{Child, Command},
    sync::Mutex,
    time::Duration,
};

use fenced_api::{Error, Result};

pub use etcd::{EtcdMember, EtcdOptions, PrivateEtcd};
pub use mariadb::{MariaDbOptions, PrivateMariaDb};
pub use redis::{PrivateRedis, RedisOptions, RedisPersistence};
pub use tls::{TestCa, TlsFiles};

/// How long a private server may take to answer after it was started.
pub const START_TIMEOUT: Duration = Duration::from_secs(60);

pub(crate) fn fail(what: impl Into<String>) -> Error {
    Error::backend("private-server", false, what.into())
}

/// A free loopback port (bound, read, released: another process could take
/// it in between, which the start-up probe then reports).
///
/// # Errors
///
/// When no socket can be bound.
pub fn free_port() -> Result<u16> {
    let l = std::net::TcpListener::bind("127.0.0.1:0").map_err(|e| fail(e.to_string()))?;
    Ok(l.local_addr().map_err(|e| fail(e.to_string()))?.port())
}

/// The first of `names` found in the usual binary directories.
pub(crate) fn find_binary(names: &[&str], what: &str) -> Result<PathBuf> {
    for n in names {
        for dir in ["/usr/sbin", "/usr/bin", "/usr/local/bin", "/usr/local/sbin"] {
            let p = PathBuf::from(dir).join(n);
            if p.exists() {
                return Ok(p);
            }
        }
    }
    Err(fail(format!(
        "none of {names:?} found; install {what} with `scripts/services.sh`"
    )))
}

pub(crate) fn temp_dir(kind: &str) -> Result<tempfile::TempDir> {
    tempfile::Builder::new()
        .prefix(&format!("fenced-{kind}-"))
        .tempdir()
        .map_err(|e| fail(format!("creating a data directory: {e}")))
}

/// A child process that is killed (SIGKILL) and reaped when dropped or replaced.
#[derive(Debug, Default)]
pub(crate) struct Proc(Mutex<Option<Child>>);

impl Proc {
    pub(crate) fn spawn(&self, mut cmd: Command, what: &str) -> Result<()> {
        let child = cmd
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
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

    pub(crate) fn pid(&self) -> Option<u32> {
        self.lock().as_ref().map(Child::id)
    }

    /// Whether the process has exited (a server that refused its options).
    pub(crate) fn exited(&self) -> bool {
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

/// Sends `signal` (`STOP`, `CONT`, `TERM`…) to `pid` with kill(1).
pub(crate) fn send_signal(pid: Option<u32>, signal: &str) -> Result<()> {
    let pid = pid.ok_or_else(|| fail("the server is not running"))?;
    let status = Command::new("kill")
        .arg(format!("-{signal}"))
        .arg(pid.to_string())
        .status()
        .map_err(|e| fail(format!("kill -{signal} {pid}: {e}")))?;
    if status.success() {
        Ok(())
    } else {
        Err(fail(format!("kill -{signal} {pid} failed")))
    }
}

/// Polls `probe` every 50 ms until it succeeds, `proc` exits, or
/// [`START_TIMEOUT`] passes.
pub(crate) async fn wait_until_up<F, Fut>(what: &str, proc: &Proc, mut probe: F) -> Result<()>
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
        if proc.exited() {
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
