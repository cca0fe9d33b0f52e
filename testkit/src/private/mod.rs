//! Private server instances for tests that must not touch the shared
//! services: their own data directory, their own loopback port, killed and
//! removed when the handle is dropped.
//!
//! * [`PrivateMariaDb`] (feature `mysql`): `mariadbd` (extra options,
//!   binary log, read-only, TLS-only, hard restart);
//! * [`PrivateRedis`] (feature `redis`): `redis-server` (persistence modes,
//!   `requirepass`, TLS-only, replica, cluster node, hard restart,
//!   SIGSTOP/SIGCONT);
//! * [`PrivateEtcd`] (feature `etcd`): `etcd`, one or three members (TLS
//!   client port, authentication, member kill and restart);
//! * `PrivateZooKeeper` (feature `zookeeper`): ZooKeeper standalone or an
//!   ensemble of three (member kill, restart, SIGSTOP/SIGCONT, leader);
//! * `PrivatePostgres` (feature `postgres`): `postgres` from a fresh
//!   `initdb` (crash, restart, clean stop, SIGSTOP/SIGCONT) and hot
//!   standbys of it (`pg_basebackup`, promotion);
//! * [`TestCa`] (feature `tls`): a throw-away certificate authority that
//!   issues the servers' certificates, so TLS tests verify a real chain.
//!
//! The binaries are the ones `scripts/services.sh` installs; a missing one is
//! an error that names that script. Every process listens on 127.0.0.1 only.

/// The controls of a server that runs as one process: `restart`, `pid`,
/// `kill` and `signal`, for a type with a `proc: Proc` field and an
/// `async fn launch(&self) -> Result<()>` that starts it on its data.
#[cfg(any(feature = "mysql", feature = "redis"))]
macro_rules! process_controls {
    () => {
        /// Kills the server hard (SIGKILL: no clean shutdown, no last save)
        /// and starts it again on the same data and port.
        ///
        /// # Errors
        ///
        /// When it does not come back.
        pub async fn restart(&self) -> Result<()> {
            self.proc.kill();
            self.launch().await
        }

        /// The server's process id (`None` while it is down).
        pub fn pid(&self) -> Option<u32> {
            self.proc.pid()
        }

        /// Kills the server hard (SIGKILL) and leaves it down.
        pub fn kill(&self) {
            self.proc.kill();
        }

        /// Sends `signal` (`STOP`, `CONT`) to the server process: SIGSTOP
        /// makes it a silent peer (connections stay open, nothing is
        /// answered).
        ///
        /// # Errors
        ///
        /// When the server is not running or kill(1) fails.
        pub fn signal(&self, signal: &str) -> Result<()> {
            self.proc.signal(signal)
        }
    };
}

#[cfg(feature = "tls")]
mod ca;
#[cfg(feature = "etcd")]
mod etcd;
#[cfg(feature = "mysql")]
mod mariadb;
#[cfg(feature = "postgres")]
mod postgres;
#[cfg(any(
    feature = "mysql",
    feature = "redis",
    feature = "etcd",
    feature = "zookeeper",
    feature = "postgres"
))]
mod proc;
#[cfg(feature = "redis")]
mod redis;
mod tls;
#[cfg(feature = "zookeeper")]
mod zookeeper;

use std::{path::PathBuf, process::Command, time::Duration};

use fenced_api::{Error, Result};

#[cfg(feature = "tls")]
pub use ca::TestCa;
#[cfg(feature = "etcd")]
pub use etcd::{EtcdMember, EtcdOptions, PrivateEtcd};
#[cfg(feature = "mysql")]
pub use mariadb::{MariaDbOptions, PrivateMariaDb};
#[cfg(feature = "postgres")]
pub use postgres::{bin_dir as postgres_bin_dir, PostgresOptions, PrivatePostgres};
#[cfg(feature = "redis")]
pub use redis::{
    admin_connection, cluster_slot_owner, PrivateRedis, PrivateRedisCluster, PrivateSentinel,
    PrivateSentinelGroup, RedisOptions, RedisPersistence,
};
pub use tempfile::TempDir;
pub use tls::TlsFiles;
#[cfg(feature = "zookeeper")]
pub use zookeeper::{PrivateZooKeeper, ZooKeeperMember, ZooKeeperOptions};

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
///
/// # Errors
///
/// When none is found: the message says to install `what` with
/// `scripts/services.sh`.
pub fn find_binary(names: &[&str], what: &str) -> Result<PathBuf> {
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

/// A fresh directory `fenced-<kind>-…` under the system's temporary
/// directory, removed when dropped.
///
/// # Errors
///
/// When it cannot be created.
pub fn temp_dir(kind: &str) -> Result<TempDir> {
    tempfile::Builder::new()
        .prefix(&format!("fenced-{kind}-"))
        .tempdir()
        .map_err(|e| fail(format!("creating a data directory: {e}")))
}

/// Sends `signal` (`STOP`, `CONT`, `KILL`…) to `pid` with kill(1).
///
/// # Errors
///
/// When `pid` is `None` (the server is not running) or kill(1) fails.
pub fn send_signal(pid: Option<u32>, signal: &str) -> Result<()> {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_binary_names_the_services_script() {
        let e = find_binary(&["fenced-no-such-server"], "Nothing").unwrap_err();
        assert!(e.to_string().contains("scripts/services.sh"), "{e}");
    }

    #[test]
    fn signalling_a_stopped_server_is_an_error() {
        assert!(send_signal(None, "STOP").is_err());
    }
}
