//! A private `redis-server`: own port, own directory.

use std::{process::Command, time::Duration};

use fenced_api::Result;

use super::{
    fail, find_binary, free_port, proc::Proc, temp_dir, tls::install_crypto_provider, TlsFiles,
};

/// How a [`PrivateRedis`] persists data.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum RedisPersistence {
    /// `--save "" --appendonly no`: a restart forgets everything.
    #[default]
    None,
    /// `--appendonly yes --appendfsync everysec` (Redis's AOF default).
    AofEverySec,
    /// `--appendonly yes --appendfsync always`.
    AofAlways,
}

/// How to start a [`PrivateRedis`].
#[derive(Debug, Clone, Default)]
pub struct RedisOptions {
    /// Persistence mode.
    pub persistence: RedisPersistence,
    /// `--requirepass`: clients must AUTH with this password.
    pub password: Option<String>,
    /// Serve TLS only (`--port 0 --tls-port`), with these files; clients are
    /// not asked for certificates.
    pub tls: Option<TlsFiles>,
    /// A read-only replica of the server on this port.
    pub replica_of: Option<u16>,
    /// A Redis Cluster node (`cluster-enabled yes`) owning no slots yet,
    /// alone in its cluster; [`PrivateRedis::cluster_bus`] is its bus port
    /// for `CLUSTER MEET`.
    pub cluster: bool,
}

/// A `redis-server` on a free loopback port. Killed and removed on drop.
#[derive(Debug)]
pub struct PrivateRedis {
    // First: fields drop in order, so the server is dead before its
    // directory is removed.
    proc: Proc,
    dir: tempfile::TempDir,
    port: u16,
    cluster_bus: Option<u16>,
    options: RedisOptions,
}

impl PrivateRedis {
    /// Starts the server and waits until it answers `PING`.
    ///
    /// # Errors
    ///
    /// When `redis-server` is missing (naming `scripts/services.sh`) or does not answer.
    pub async fn start(options: RedisOptions) -> Result<Self> {
        let server = PrivateRedis {
            dir: temp_dir("redis")?,
            port: free_port()?,
            cluster_bus: if options.cluster {
                Some(free_port()?)
            } else {
                None
            },
            options,
            proc: Proc::default(),
        };
        server.launch().await?;
        Ok(server)
    }

    /// The port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The cluster bus port of a cluster node ([`RedisOptions::cluster`]).
    pub fn cluster_bus(&self) -> Option<u16> {
        self.cluster_bus
    }

    /// `redis://[:password@]127.0.0.1:<port>`, or `rediss://127.0.0.1:<port>`
    /// for a TLS server (certificate verified: the client must trust the CA).
    pub fn url(&self) -> String {
        let auth = self
            .options
            .password
            .as_ref()
            .map(|p| format!(":{p}@"))
            .unwrap_or_default();
        let scheme = if self.options.tls.is_some() {
            "rediss"
        } else {
            "redis"
        };
        format!("{scheme}://{auth}127.0.0.1:{}", self.port)
    }

    /// A URL for admin connections: as [`url`](Self::url), but skipping
    /// certificate verification on a TLS server.
    pub fn admin_url(&self) -> String {
        if self.options.tls.is_some() {
            format!("{}/#insecure", self.url())
        } else {
            self.url()
        }
    }

    /// A plain admin connection (RESP2) for commands the lock never sends.
    ///
    /// # Errors
    ///
    /// When the server cannot be reached.
    pub async fn admin(&self) -> Result<redis::aio::MultiplexedConnection> {
        admin_connection(&self.admin_url()).await
    }

    fn command(&self) -> Result<Command> {
        let mut cmd = Command::new(find_binary(&["redis-server"], "Redis")?);
        cmd.arg("--port")
            .arg(self.port.to_string())
            .args(["--bind", "127.0.0.1", "--daemonize", "no", "--save", ""])
            .arg("--dir")
            .arg(self.dir.path());
        if let Some(primary) = self.options.replica_of {
            cmd.args(["--replicaof", "127.0.0.1"])
                .arg(primary.to_string());
        }
        if let Some(bus) = self.cluster_bus {
            cmd.args(["--cluster-enabled", "yes"])
                .args(["--cluster-config-file", "nodes.conf"])
                .arg("--cluster-port")
                .arg(bus.to_string());
        }
        if let Some(pw) = &self.options.password {
            cmd.arg("--requirepass").arg(pw);
        }
        if let Some(tls) = &self.options.tls {
            cmd.args(["--port", "0", "--tls-port"])
                .arg(self.port.to_string())
                .arg("--tls-cert-file")
                .arg(&tls.cert)
                .arg("--tls-key-file")
                .arg(&tls.key)
                .arg("--tls-ca-cert-file")
                .arg(&tls.ca)
                .args(["--tls-auth-clients", "no"]);
        }
        match self.options.persistence {
            RedisPersistence::None => cmd.args(["--appendonly", "no"]),
            RedisPersistence::AofEverySec => {
                cmd.args(["--appendonly", "yes", "--appendfsync", "everysec"])
            }
            RedisPersistence::AofAlways => {
                cmd.args(["--appendonly", "yes", "--appendfsync", "always"])
            }
        };
        Ok(cmd)
    }

    async fn launch(&self) -> Result<()> {
        self.proc.spawn(self.command()?, "redis-server")?;
        let url = self.admin_url();
        self.proc.wait_until_up("redis-server", || ping(&url)).await
    }

    process_controls!();
}

/// A Redis Sentinel (`redis-server <conf> --sentinel`) on a free loopback
/// port, watching one primary as `mymaster` with a quorum of 1, quick to act:
/// the primary is down after 500 ms of silence, a failover may take 2 s.
/// Killed and removed on drop.
#[derive(Debug)]
pub struct PrivateSentinel {
    proc: Proc,
    dir: tempfile::TempDir,
    port: u16,
    primary: u16,
}

impl PrivateSentinel {
    /// The name the sentinel knows the primary by.
    pub const MASTER: &'static str = "mymaster";

    /// Starts a sentinel watching the server on `primary_port`.
    ///
    /// # Errors
    ///
    /// When `redis-server` is missing (naming `scripts/services.sh`) or the
    /// sentinel does not answer.
    pub async fn start(primary_port: u16) -> Result<Self> {
        let sentinel = PrivateSentinel {
            dir: temp_dir("redis-sentinel")?,
            port: free_port()?,
            primary: primary_port,
            proc: Proc::default(),
        };
        sentinel.launch().await?;
        Ok(sentinel)
    }

    /// The port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `redis+sentinel://127.0.0.1:<port>/mymaster`.
    pub fn url(&self) -> String {
        format!("redis+sentinel://127.0.0.1:{}/{}", self.port, Self::MASTER)
    }

    /// A plain connection to the sentinel itself.
    ///
    /// # Errors
    ///
    /// When the sentinel cannot be reached.
    pub async fn admin(&self) -> Result<redis::aio::MultiplexedConnection> {
        admin_connection(&format!("redis://127.0.0.1:{}", self.port)).await
    }

    fn command(&self) -> Result<Command> {
        // The sentinel rewrites its configuration file: it lives in the
        // sentinel's own directory.
        let conf = self.dir.path().join("sentinel.conf");
        let text = format!(
            "port {port}\nbind 127.0.0.1\ndaemonize no\ndir {dir}\n\
             sentinel monitor {m} 127.0.0.1 {primary} 1\n\
             sentinel down-after-milliseconds {m} 500\n\
             sentinel failover-timeout {m} 2000\n\
             sentinel parallel-syncs {m} 1\n",
            port = self.port,
            dir = self.dir.path().display(),
            m = Self::MASTER,
            primary = self.primary,
        );
        std::fs::write(&conf, text).map_err(|e| fail(format!("sentinel.conf: {e}")))?;
        let mut cmd = Command::new(find_binary(&["redis-server"], "Redis")?);
        cmd.arg(conf).arg("--sentinel");
        Ok(cmd)
    }

    async fn launch(&self) -> Result<()> {
        self.proc.spawn(self.command()?, "redis-sentinel")?;
        let url = format!("redis://127.0.0.1:{}", self.port);
        self.proc
            .wait_until_up("redis-sentinel", || ping(&url))
            .await
    }

    process_controls!();
}

/// A plain admin connection (RESP2) to any Redis URL the `redis` crate accepts.
///
/// # Errors
///
/// When the server cannot be reached within 5 s.
pub async fn admin_connection(url: &str) -> Result<redis::aio::MultiplexedConnection> {
    install_crypto_provider();
    let client = redis::Client::open(url).map_err(|e| fail(format!("admin client: {e}")))?;
    match tokio::time::timeout(
        Duration::from_secs(5),
        client.get_multiplexed_async_connection(),
    )
    .await
    {
        Ok(Ok(c)) => Ok(c),
        Ok(Err(e)) => Err(fail(format!("admin connection: {e}"))),
        Err(_) => Err(fail("admin connection: no answer within 5s")),
    }
}

async fn ping(url: &str) -> std::result::Result<(), String> {
    let mut conn = admin_connection(url).await.map_err(|e| e.to_string())?;
    let pong: redis::RedisResult<String> = tokio::time::timeout(
        Duration::from_secs(2),
        redis::cmd("PING").query_async(&mut conn),
    )
    .await
    .map_err(|_| "no PONG within 2s".to_owned())?;
    match pong {
        Ok(p) if p == "PONG" => Ok(()),
        Ok(other) => Err(format!("PING answered {other:?}")),
        Err(e) => Err(e.to_string()),
    }
}
