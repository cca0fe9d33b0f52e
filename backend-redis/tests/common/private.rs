//! A private `redis-server` (own port, own directory) for tests that restart
//! a server or count its commands — never the shared one other tests use:
//! the test-server kit's [`PrivateRedis`](fenced_testkit::private::PrivateRedis),
//! started by persistence mode, with admin connections that panic instead
//! of returning errors.

use fenced_api::Result;
use fenced_redis::redis;
use fenced_testkit::private::{self as kit, RedisOptions, RedisPersistence};

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

impl From<Mode> for RedisPersistence {
    fn from(mode: Mode) -> Self {
        match mode {
            Mode::NoPersistence => RedisPersistence::None,
            Mode::AofEverySec => RedisPersistence::AofEverySec,
            Mode::AofAlways => RedisPersistence::AofAlways,
        }
    }
}

/// The kit's server (`port`, `restart`, `cluster_bus`… through `Deref`).
pub struct PrivateRedis {
    server: kit::PrivateRedis,
    mode: Mode,
    /// The TLS server's certificate files, removed with the server.
    _certificates: Option<kit::TempDir>,
}

impl PrivateRedis {
    /// Starts `redis-server` on a free port with its own directory.
    pub async fn start(mode: Mode) -> Result<Self> {
        Self::start_with(mode, RedisOptions::default(), None).await
    }

    /// A server that speaks TLS only, with a certificate from a fresh test
    /// CA that no client trusts (`#insecure` in [`url`](Self::url)).
    #[cfg(feature = "tls")]
    pub async fn start_tls() -> Result<Self> {
        Self::start_tls_asking(false).await
    }

    /// [`start_tls`](Self::start_tls) for a server that demands a client
    /// certificate (`--tls-auth-clients yes`).
    #[cfg(feature = "tls")]
    pub async fn start_tls_with_client_certificates() -> Result<Self> {
        Self::start_tls_asking(true).await
    }

    #[cfg(feature = "tls")]
    async fn start_tls_asking(client_certificates: bool) -> Result<Self> {
        let dir = kit::temp_dir("redis-tls")?;
        let files = kit::TestCa::new("fenced redis test CA")?.issue_server(dir.path())?;
        let options = RedisOptions {
            tls: Some(files),
            tls_client_certificates: client_certificates,
            ..RedisOptions::default()
        };
        Self::start_with(Mode::NoPersistence, options, Some(dir)).await
    }

    /// A read-only replica of `primary`.
    pub async fn start_replica_of(primary: &PrivateRedis) -> Result<Self> {
        let options = RedisOptions {
            replica_of: Some(primary.port()),
            ..RedisOptions::default()
        };
        Self::start_with(Mode::NoPersistence, options, None).await
    }

    /// A Redis Cluster node owning no slots yet, alone in its cluster (see
    /// [`cluster_bus`](kit::PrivateRedis::cluster_bus) for `CLUSTER MEET`).
    pub async fn start_cluster_node() -> Result<Self> {
        let options = RedisOptions {
            cluster: true,
            ..RedisOptions::default()
        };
        Self::start_with(Mode::NoPersistence, options, None).await
    }

    async fn start_with(
        mode: Mode,
        options: RedisOptions,
        certificates: Option<kit::TempDir>,
    ) -> Result<Self> {
        let options = RedisOptions {
            persistence: mode.into(),
            ..options
        };
        Ok(PrivateRedis {
            server: kit::PrivateRedis::start(options).await?,
            mode,
            _certificates: certificates,
        })
    }

    /// `redis://…`, or `rediss://…/#insecure` for a TLS server (its CA is
    /// trusted by no one, so verification is skipped).
    pub fn url(&self) -> String {
        self.server.admin_url()
    }

    pub fn mode(&self) -> Mode {
        self.mode
    }

    /// Sends a signal (`STOP`, `CONT`) to the server process: SIGSTOP makes
    /// it a silent peer — connections stay open, nothing is answered.
    pub async fn signal(&self, signal: &str) {
        self.server
            .signal(signal)
            .unwrap_or_else(|e| panic!("kill -{signal}: {e}"));
    }

    /// A plain admin connection (RESP2) for commands the lock never sends.
    pub async fn admin(&self) -> redis::aio::MultiplexedConnection {
        admin(&self.url()).await
    }
}

impl std::ops::Deref for PrivateRedis {
    type Target = kit::PrivateRedis;

    fn deref(&self) -> &Self::Target {
        &self.server
    }
}

/// A plain admin connection (RESP2) to any server.
pub async fn admin(url: &str) -> redis::aio::MultiplexedConnection {
    kit::admin_connection(url)
        .await
        .unwrap_or_else(|e| panic!("admin connection to {url}: {e}"))
}
