//! Private etcd processes: one member or a cluster, own ports and data dirs.

use std::{path::PathBuf, process::Command, time::Duration};

use etcd_client::{Client, ConnectOptions};
use fenced_api::Result;

use super::{fail, find_binary, free_port, proc::Proc, temp_dir, TlsFiles};

/// How to start a [`PrivateEtcd`].
#[derive(Debug, Clone)]
pub struct EtcdOptions {
    /// Number of members (1 or 3 in practice).
    pub members: usize,
    /// Serve the client port over TLS with these files (peers stay plaintext
    /// on loopback).
    pub tls: Option<TlsFiles>,
}

impl Default for EtcdOptions {
    fn default() -> Self {
        EtcdOptions {
            members: 1,
            tls: None,
        }
    }
}

/// One member: name, client port, peer port, data dir.
#[derive(Debug, Clone)]
pub struct EtcdMember {
    /// The member name (`m0`, `m1`…).
    pub name: String,
    /// The client port.
    pub client: u16,
    /// The peer port.
    pub peer: u16,
    /// The data directory.
    pub dir: PathBuf,
}

impl EtcdMember {
    /// `127.0.0.1:<client port>`.
    pub fn hostport(&self) -> String {
        format!("127.0.0.1:{}", self.client)
    }
}

/// A private etcd. Processes are killed and data removed on drop.
#[derive(Debug)]
pub struct PrivateEtcd {
    // First: fields drop in order, so the members are dead before their
    // directories are removed.
    procs: Vec<Proc>,
    _root: tempfile::TempDir,
    members: Vec<EtcdMember>,
    cluster: String,
    options: EtcdOptions,
    /// Root credentials once [`enable_auth`](Self::enable_auth) ran.
    root_password: std::sync::Mutex<Option<String>>,
}

impl PrivateEtcd {
    /// Starts every member and waits until each answers.
    ///
    /// # Errors
    ///
    /// When `etcd` is missing (naming `scripts/services.sh`) or a member
    /// does not become healthy.
    pub async fn start(options: EtcdOptions) -> Result<Self> {
        let root = temp_dir("etcd")?;
        let members = (0..options.members.max(1))
            .map(|i| {
                Ok(EtcdMember {
                    name: format!("m{i}"),
                    client: free_port()?,
                    peer: free_port()?,
                    dir: root.path().join(format!("m{i}")),
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let cluster = members
            .iter()
            .map(|m| format!("{}=http://127.0.0.1:{}", m.name, m.peer))
            .collect::<Vec<_>>()
            .join(",");
        let procs = members.iter().map(|_| Proc::default()).collect();
        let etcd = PrivateEtcd {
            _root: root,
            members,
            cluster,
            options,
            procs,
            root_password: std::sync::Mutex::new(None),
        };
        for i in 0..etcd.members.len() {
            etcd.procs[i].spawn(etcd.command(i, "new")?, "etcd")?;
        }
        for i in 0..etcd.members.len() {
            etcd.wait_healthy(i).await?;
        }
        Ok(etcd)
    }

    /// The members.
    pub fn members(&self) -> &[EtcdMember] {
        &self.members
    }

    /// `h1:p1,h2:p2,…` of the client ports.
    pub fn hostports(&self) -> String {
        self.members
            .iter()
            .map(EtcdMember::hostport)
            .collect::<Vec<_>>()
            .join(",")
    }

    /// A fenced URL for this cluster and `prefix`: `etcd://…/prefix`, or
    /// `etcds://…/prefix` when the client port is TLS.
    pub fn url(&self, prefix: &str) -> String {
        let scheme = if self.options.tls.is_some() {
            "etcds"
        } else {
            "etcd"
        };
        format!("{scheme}://{}/{prefix}", self.hostports())
    }

    /// The client endpoints as URIs (`http://` or `https://`).
    pub fn endpoints(&self) -> Vec<String> {
        let scheme = if self.options.tls.is_some() {
            "https"
        } else {
            "http"
        };
        self.members
            .iter()
            .map(|m| format!("{scheme}://{}", m.hostport()))
            .collect()
    }

    fn command(&self, i: usize, state: &str) -> Result<Command> {
        let m = &self.members[i];
        let client_scheme = if self.options.tls.is_some() {
            "https"
        } else {
            "http"
        };
        let client_url = format!("{client_scheme}://127.0.0.1:{}", m.client);
        let mut cmd = Command::new(find_binary(&["etcd"], "etcd")?);
        cmd.arg("--name")
            .arg(&m.name)
            .arg("--data-dir")
            .arg(&m.dir)
            .arg("--listen-client-urls")
            .arg(&client_url)
            .arg("--advertise-client-urls")
            .arg(&client_url)
            .arg("--listen-peer-urls")
            .arg(format!("http://127.0.0.1:{}", m.peer))
            .arg("--initial-advertise-peer-urls")
            .arg(format!("http://127.0.0.1:{}", m.peer))
            .arg("--initial-cluster")
            .arg(&self.cluster)
            .arg("--initial-cluster-state")
            .arg(state)
            .arg("--initial-cluster-token")
            .arg("fenced-private")
            .env_clear()
            .env("PATH", "/usr/bin:/bin");
        if let Some(tls) = &self.options.tls {
            // No --trusted-ca-file: with it, etcd 3.4 demands client certificates.
            cmd.arg("--cert-file")
                .arg(&tls.cert)
                .arg("--key-file")
                .arg(&tls.key);
        }
        Ok(cmd)
    }

    /// An etcd-client connection to member `i` only (trusting the test CA
    /// on a TLS server; as root once authentication is on).
    ///
    /// # Errors
    ///
    /// When the member does not answer.
    pub async fn admin_client(&self, i: usize) -> Result<Client> {
        let mut opts = ConnectOptions::new()
            .with_connect_timeout(Duration::from_secs(2))
            .with_timeout(Duration::from_secs(5));
        let scheme = if let Some(tls) = &self.options.tls {
            opts = with_test_ca(opts, tls)?;
            "https"
        } else {
            "http"
        };
        let password = self
            .root_password
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone();
        if let Some(pw) = password {
            opts = opts.with_user("root", pw);
        }
        let endpoint = format!("{scheme}://{}", self.members[i].hostport());
        let connect = Client::connect([endpoint], Some(opts));
        match tokio::time::timeout(Duration::from_secs(5), connect).await {
            Ok(Ok(c)) => Ok(c),
            Ok(Err(e)) => Err(fail(format!("etcd admin connection: {e}"))),
            Err(_) => Err(fail("etcd admin connection: no answer within 5s")),
        }
    }

    async fn wait_healthy(&self, i: usize) -> Result<()> {
        self.procs[i]
            .wait_until_up("etcd", || async move {
                let mut c = self.admin_client(i).await.map_err(|e| e.to_string())?;
                match tokio::time::timeout(Duration::from_secs(2), c.status()).await {
                    Ok(Ok(_)) => Ok(()),
                    Ok(Err(e)) => Err(e.to_string()),
                    Err(_) => Err("no status within 2s".to_owned()),
                }
            })
            .await
    }

    /// Turns authentication on: user `root` with `password` and the root role.
    /// Clients then need `etcd://root:<password>@…`.
    ///
    /// # Errors
    ///
    /// The server's error.
    pub async fn enable_auth(&self, password: &str) -> Result<()> {
        let mut c = self.admin_client(0).await?;
        let err = |e: etcd_client::Error| fail(format!("enabling etcd auth: {e}"));
        c.user_add("root", password, None).await.map_err(err)?;
        c.user_grant_role("root", "root").await.map_err(err)?;
        c.auth_enable().await.map_err(err)?;
        *self
            .root_password
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(password.to_owned());
        Ok(())
    }

    /// Member `i`'s process id (`None` while it is down).
    pub fn member_pid(&self, i: usize) -> Option<u32> {
        self.procs.get(i).and_then(Proc::pid)
    }

    /// SIGKILLs member `i`.
    pub fn kill(&self, i: usize) {
        self.procs[i].kill();
    }

    /// Starts member `i` again on its data dir and waits until it answers.
    ///
    /// # Errors
    ///
    /// When it does not come back.
    pub async fn start_member(&self, i: usize) -> Result<()> {
        self.procs[i].spawn(self.command(i, "existing")?, "etcd")?;
        self.wait_healthy(i).await
    }

    /// Kills every member hard and starts them all again.
    ///
    /// # Errors
    ///
    /// When a member does not come back.
    pub async fn restart(&self) -> Result<()> {
        for p in &self.procs {
            p.kill();
        }
        for i in 0..self.members.len() {
            self.procs[i].spawn(self.command(i, "existing")?, "etcd")?;
        }
        for i in 0..self.members.len() {
            self.wait_healthy(i).await?;
        }
        Ok(())
    }

    /// Sends `signal` (`STOP`, `CONT`) to member `i`.
    ///
    /// # Errors
    ///
    /// When the member is not running or kill(1) fails.
    pub fn signal(&self, i: usize, signal: &str) -> Result<()> {
        self.procs[i].signal(signal)
    }
}

/// `opts` trusting the CA of `tls` (ring as rustls's provider).
#[cfg(feature = "tls")]
fn with_test_ca(opts: ConnectOptions, tls: &TlsFiles) -> Result<ConnectOptions> {
    use etcd_client::{Certificate, TlsOptions};

    let ca = std::fs::read(&tls.ca).map_err(|e| fail(format!("reading the CA: {e}")))?;
    super::tls::install_crypto_provider();
    Ok(opts.with_tls(TlsOptions::new().ca_certificate(Certificate::from_pem(ca))))
}

/// A TLS admin connection needs etcd-client's TLS support.
#[cfg(not(feature = "tls"))]
fn with_test_ca(_: ConnectOptions, _: &TlsFiles) -> Result<ConnectOptions> {
    Err(fail(
        "an admin connection to a TLS etcd needs fenced-testkit's `tls` feature",
    ))
}
