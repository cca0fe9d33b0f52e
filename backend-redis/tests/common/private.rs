//! A private `redis-server` (own port, own directory) for tests that restart
//! a server or count its commands — never the shared one other tests use.

use std::{path::PathBuf, process::Stdio, time::Duration};

use fenced_api::{Error, Result};
use fenced_conformance::services::probe_redis;
use fenced_redis::redis;
use tokio::process::{Child, Command};

/// How the private server persists data.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// `--save "" --appendonly no`: a restart forgets everything.
    NoPersistence,
    /// `--appendonly yes --appendfsync everysec` (Redis's AOF default).
    AofEverySec,
    /// `--appendonly yes --appendfsync always`.
    AofAlways,
}

pub struct PrivateRedis {
    dir: PathBuf,
    port: u16,
    mode: Mode,
    /// Serves TLS only (self-signed certificate made with the openssl CLI).
    tls: bool,
    /// A read-only replica of the server on this port.
    replica_of: Option<u16>,
    /// A Redis Cluster node (`cluster-enabled yes`) with this cluster bus port.
    cluster_bus: Option<u16>,
    child: tokio::sync::Mutex<Option<Child>>,
}

fn fail(what: impl Into<String>) -> Error {
    Error::backend("redis-test", false, what.into())
}

fn free_port() -> Result<u16> {
    let l = std::net::TcpListener::bind("127.0.0.1:0").map_err(|e| fail(e.to_string()))?;
    Ok(l.local_addr().map_err(|e| fail(e.to_string()))?.port())
}

fn redis_server() -> Result<String> {
    for dir in ["/usr/bin", "/usr/local/bin", "/usr/sbin"] {
        let p = format!("{dir}/redis-server");
        if std::path::Path::new(&p).exists() {
            return Ok(p);
        }
    }
    Err(fail(
        "redis-server not found; install Redis with `scripts/services.sh`",
    ))
}

impl PrivateRedis {
    /// Starts `redis-server` on a free port with its own directory under /tmp.
    pub async fn start(mode: Mode) -> Result<Self> {
        Self::start_with(mode, false, None).await
    }

    /// A server that speaks TLS only, with a fresh self-signed certificate.
    pub async fn start_tls() -> Result<Self> {
        Self::start_with(Mode::NoPersistence, true, None).await
    }

    /// A read-only replica of `primary`.
    pub async fn start_replica_of(primary: &PrivateRedis) -> Result<Self> {
        Self::start_with(Mode::NoPersistence, false, Some(primary.port)).await
    }

    /// A Redis Cluster node owning no slots yet, alone in its cluster (see
    /// [`PrivateRedis::cluster_bus`] for `CLUSTER MEET`).
    pub async fn start_cluster_node() -> Result<Self> {
        Self::start_full(Mode::NoPersistence, false, None, Some(free_port()?)).await
    }

    /// The cluster bus port of a cluster node.
    pub fn cluster_bus(&self) -> Option<u16> {
        self.cluster_bus
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    async fn start_with(mode: Mode, tls: bool, replica_of: Option<u16>) -> Result<Self> {
        Self::start_full(mode, tls, replica_of, None).await
    }

    async fn start_full(
        mode: Mode,
        tls: bool,
        replica_of: Option<u16>,
        cluster_bus: Option<u16>,
    ) -> Result<Self> {
        let dir =
            std::env::temp_dir().join(format!("fenced-redis-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&dir).map_err(|e| fail(e.to_string()))?;
        let server = PrivateRedis {
            dir,
            port: free_port()?,
            mode,
            tls,
            replica_of,
            cluster_bus,
            child: tokio::sync::Mutex::new(None),
        };
        if tls {
            server.make_certificate().await?;
        }
        server.launch().await?;
        Ok(server)
    }

    async fn make_certificate(&self) -> Result<()> {
        let out = Command::new("openssl")
            .args([
                "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
            ])
            .args(["-subj", "/CN=127.0.0.1"])
            .arg("-keyout")
            .arg(self.dir.join("key.pem"))
            .arg("-out")
            .arg(self.dir.join("cert.pem"))
            .output()
            .await
            .map_err(|e| fail(format!("running openssl (needed for the TLS test): {e}")))?;
        if !out.status.success() {
            return Err(fail(format!(
                "openssl req failed: {}",
                String::from_utf8_lossy(&out.stderr)
            )));
        }
        Ok(())
    }

    /// `redis://…`, or `rediss://…/#insecure` for a TLS server (its
    /// certificate is self-signed, so verification is skipped).
    pub fn url(&self) -> String {
        if self.tls {
            format!("rediss://127.0.0.1:{}/#insecure", self.port)
        } else {
            format!("redis://127.0.0.1:{}", self.port)
        }
    }

    pub fn mode(&self) -> Mode {
        self.mode
    }

    async fn launch(&self) -> Result<()> {
        let mut cmd = Command::new(redis_server()?);
        cmd.arg("--port")
            .arg(self.port.to_string())
            .arg("--bind")
            .arg("127.0.0.1")
            .arg("--dir")
            .arg(&self.dir)
            .arg("--daemonize")
            .arg("no")
            .arg("--save")
            .arg("");
        if let Some(primary) = self.replica_of {
            cmd.args(["--replicaof", "127.0.0.1"])
                .arg(primary.to_string());
        }
        if let Some(bus) = self.cluster_bus {
            cmd.args([
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                "nodes.conf",
            ])
            .arg("--cluster-port")
            .arg(bus.to_string());
        }
        if self.tls {
            cmd.args(["--port", "0", "--tls-port"])
                .arg(self.port.to_string())
                .arg("--tls-cert-file")
                .arg(self.dir.join("cert.pem"))
                .arg("--tls-key-file")
                .arg(self.dir.join("key.pem"))
                .args(["--tls-auth-clients", "no"]);
        }
        match self.mode {
            Mode::NoPersistence => cmd.args(["--appendonly", "no"]),
            Mode::AofEverySec => cmd.args(["--appendonly", "yes", "--appendfsync", "everysec"]),
            Mode::AofAlways => cmd.args(["--appendonly", "yes", "--appendfsync", "always"]),
        };
        let child = cmd
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| fail(format!("starting redis-server: {e}")))?;
        *self.child.lock().await = Some(child);
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        loop {
            let up = if self.tls {
                tokio::net::TcpStream::connect(("127.0.0.1", self.port))
                    .await
                    .is_ok()
            } else {
                probe_redis(&self.url()).await.is_ok()
            };
            if up {
                return Ok(());
            }
            if tokio::time::Instant::now() > deadline {
                return Err(fail("the private redis-server did not answer within 30 s"));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Kills the server hard (SIGKILL: no shutdown save) and starts it again
    /// on the same port and directory.
    pub async fn restart(&self) -> Result<()> {
        if let Some(mut child) = self.child.lock().await.take() {
            let _ = child.kill().await;
            let _ = child.wait().await;
        }
        self.launch().await
    }

    /// Sends a signal (`STOP`, `CONT`) to the server process: SIGSTOP makes
    /// it a silent peer — connections stay open, nothing is answered.
    pub async fn signal(&self, signal: &str) {
        let pid = self
            .child
            .lock()
            .await
            .as_ref()
            .and_then(|c| c.id())
            .expect("the server is running");
        let status = Command::new("kill")
            .arg(format!("-{signal}"))
            .arg(pid.to_string())
            .status()
            .await
            .expect("kill runs");
        assert!(status.success(), "kill -{signal} {pid}");
    }

    /// A plain admin connection (RESP2) for commands the lock never sends.
    pub async fn admin(&self) -> redis::aio::MultiplexedConnection {
        admin(&self.url()).await
    }
}

/// A plain admin connection (RESP2) to any server.
pub async fn admin(url: &str) -> redis::aio::MultiplexedConnection {
    redis::Client::open(url)
        .unwrap_or_else(|e| panic!("admin client for {url}: {e}"))
        .get_multiplexed_async_connection()
        .await
        .unwrap_or_else(|e| panic!("admin connection to {url}: {e}"))
}

impl Drop for PrivateRedis {
    fn drop(&mut self) {
        if let Ok(mut child) = self.child.try_lock() {
            if let Some(c) = child.as_mut() {
                let _ = c.start_kill();
            }
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
