//! A private ZooKeeper: one standalone server or an ensemble of three (or
//! more) on loopback ports, each member with its own data directory.

use std::{path::PathBuf, process::Command};

use fenced_api::Result;

use super::{fail, free_port, proc::Proc, temp_dir, TlsFiles};
use crate::services;

/// What to start.
#[derive(Debug, Clone)]
pub struct ZooKeeperOptions {
    /// How many members (1 = standalone; 3 for an ensemble that survives the
    /// loss of one).
    pub members: usize,
    /// The tick (default 500 ms): sessions can be negotiated from 2 to 40
    /// ticks unless `max_session_ms` says otherwise.
    pub tick_ms: u32,
    /// Largest session timeout the members grant (default 60 s).
    pub max_session_ms: u32,
    /// Also serve TLS on a `secureClientPort` per member (Netty), with this
    /// server certificate and key; clients must present a certificate
    /// signed by `ca` (ZooKeeper's default `ssl.clientAuth=need`). The
    /// plaintext client port stays (probes and admin use it).
    pub tls: Option<TlsFiles>,
}

impl Default for ZooKeeperOptions {
    fn default() -> Self {
        ZooKeeperOptions {
            members: 1,
            tick_ms: 500,
            max_session_ms: 60_000,
            tls: None,
        }
    }
}

/// One member: its id, client port, quorum and election ports, data dir.
#[derive(Debug, Clone)]
pub struct ZooKeeperMember {
    /// The member's `myid` (1, 2, 3…).
    pub id: usize,
    /// The client port.
    pub client: u16,
    /// The quorum (follower-to-leader) port.
    pub quorum: u16,
    /// The leader-election port.
    pub election: u16,
    /// The TLS client port (`secureClientPort`), when serving TLS.
    pub secure: Option<u16>,
    /// The data directory (holds `myid`, `zoo.cfg` and the snapshots/logs).
    pub dir: PathBuf,
}

impl ZooKeeperMember {
    /// `127.0.0.1:<client port>`.
    pub fn hostport(&self) -> String {
        format!("127.0.0.1:{}", self.client)
    }

    /// `127.0.0.1:<TLS client port>`, when serving TLS.
    pub fn secure_hostport(&self) -> Option<String> {
        self.secure.map(|p| format!("127.0.0.1:{p}"))
    }
}

/// A private ZooKeeper. Members are killed and their data removed on drop.
#[derive(Debug)]
pub struct PrivateZooKeeper {
    // First: fields drop in order, so the members are dead before their
    // directories are removed.
    procs: Vec<Proc>,
    _root: tempfile::TempDir,
    members: Vec<ZooKeeperMember>,
    options: ZooKeeperOptions,
}

impl PrivateZooKeeper {
    /// Starts every member and waits until each serves requests (for an
    /// ensemble: until a leader is elected and every member follows or
    /// leads).
    ///
    /// # Errors
    ///
    /// When Java or ZooKeeper is missing (naming `scripts/services.sh`) or a
    /// member does not come up.
    pub async fn start(options: ZooKeeperOptions) -> Result<Self> {
        zookeeper_jar()?;
        let root = temp_dir("zookeeper")?;
        let members = (0..options.members.max(1))
            .map(|i| {
                Ok(ZooKeeperMember {
                    id: i + 1,
                    client: free_port()?,
                    quorum: free_port()?,
                    election: free_port()?,
                    secure: options.tls.as_ref().map(|_| free_port()).transpose()?,
                    dir: root.path().join(format!("m{}", i + 1)),
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let zk = PrivateZooKeeper {
            procs: members.iter().map(|_| Proc::default()).collect(),
            _root: root,
            members,
            options,
        };
        for i in 0..zk.members.len() {
            zk.write_config(i)?;
        }
        for i in 0..zk.members.len() {
            zk.procs[i].spawn(zk.command(i)?, "ZooKeeper")?;
        }
        for i in 0..zk.members.len() {
            zk.wait_serving(i).await?;
        }
        Ok(zk)
    }

    /// The members.
    pub fn members(&self) -> &[ZooKeeperMember] {
        &self.members
    }

    /// `h1:p1,h2:p2,…` of the client ports.
    pub fn hostports(&self) -> String {
        self.members
            .iter()
            .map(ZooKeeperMember::hostport)
            .collect::<Vec<_>>()
            .join(",")
    }

    /// A fenced URL for this ensemble and namespace path: `zk://…/<path>`.
    pub fn url(&self, path: &str) -> String {
        format!("zk://{}/{}", self.hostports(), path.trim_start_matches('/'))
    }

    /// `h1:p1,h2:p2,…` of the TLS client ports (`None` without TLS).
    pub fn secure_hostports(&self) -> Option<String> {
        self.members
            .iter()
            .map(ZooKeeperMember::secure_hostport)
            .collect::<Option<Vec<_>>>()
            .map(|list| list.join(","))
    }

    /// What member `i` answers to `srvr` (its mode: `standalone`, `leader`,
    /// `follower`), or the probe's error.
    ///
    /// # Errors
    ///
    /// When the member does not serve requests.
    pub async fn mode(&self, i: usize) -> std::result::Result<String, String> {
        let url = format!("zk://{}", self.members[i].hostport());
        services::probe_zookeeper_mode(&url).await
    }

    /// The index of the member that leads (an ensemble), if one does now.
    pub async fn leader(&self) -> Option<usize> {
        for i in 0..self.members.len() {
            if self.mode(i).await.is_ok_and(|m| m == "leader") {
                return Some(i);
            }
        }
        None
    }

    /// Kills member `i` hard (SIGKILL) and leaves it down.
    pub fn kill(&self, i: usize) {
        self.procs[i].kill();
    }

    /// Starts member `i` again on its data and waits until it serves.
    ///
    /// # Errors
    ///
    /// When it does not come back.
    pub async fn restart(&self, i: usize) -> Result<()> {
        self.procs[i].kill();
        self.procs[i].spawn(self.command(i)?, "ZooKeeper")?;
        self.wait_serving(i).await
    }

    /// Sends `signal` (`STOP`, `CONT`) to member `i`: a stopped member keeps
    /// its connections open and answers nothing (its clients' sessions run
    /// out).
    ///
    /// # Errors
    ///
    /// When the member is not running or kill(1) fails.
    pub fn signal(&self, i: usize, signal: &str) -> Result<()> {
        self.procs[i].signal(signal)
    }

    /// Member `i`'s process id (`None` while it is down).
    pub fn pid(&self, i: usize) -> Option<u32> {
        self.procs[i].pid()
    }

    fn write_config(&self, i: usize) -> Result<()> {
        let m = &self.members[i];
        let o = &self.options;
        std::fs::create_dir_all(&m.dir).map_err(|e| fail(format!("creating {:?}: {e}", m.dir)))?;
        let mut cfg = format!(
            "tickTime={}\ninitLimit=10\nsyncLimit=5\ndataDir={}\nclientPort={}\n\
             clientPortAddress=127.0.0.1\nmaxSessionTimeout={}\n\
             4lw.commands.whitelist=srvr,ruok,mntr,stat,wchp,wchc,cons\nadmin.enableServer=false\n",
            o.tick_ms,
            m.dir.display(),
            m.client,
            o.max_session_ms,
        );
        if self.members.len() > 1 {
            for peer in &self.members {
                cfg.push_str(&format!(
                    "server.{}=127.0.0.1:{}:{}\n",
                    peer.id, peer.quorum, peer.election
                ));
            }
        }
        let write = |name: &str, text: &str| {
            std::fs::write(m.dir.join(name), text)
                .map_err(|e| fail(format!("writing {name} of member {}: {e}", m.id)))
        };
        if let (Some(tls), Some(port)) = (&o.tls, m.secure) {
            // A PEM key store is one file: the key, then the certificate.
            let read = |path: &std::path::Path| {
                std::fs::read_to_string(path)
                    .map_err(|e| fail(format!("reading {}: {e}", path.display())))
            };
            write("keystore.pem", &(read(&tls.key)? + &read(&tls.cert)?))?;
            cfg.push_str(&format!(
                "secureClientPort={port}\nsecureClientPortAddress=127.0.0.1\n\
                 serverCnxnFactory=org.apache.zookeeper.server.NettyServerCnxnFactory\n\
                 ssl.keyStore.location={}\nssl.keyStore.type=PEM\n\
                 ssl.trustStore.location={}\nssl.trustStore.type=PEM\n",
                m.dir.join("keystore.pem").display(),
                tls.ca.display(),
            ));
        }
        write("zoo.cfg", &cfg)?;
        write("myid", &format!("{}\n", m.id))
    }

    fn command(&self, i: usize) -> Result<Command> {
        let m = &self.members[i];
        let mut cmd = Command::new(java()?);
        cmd.current_dir(&m.dir)
            .arg("-Xms32m")
            .arg("-Xmx128m")
            .arg("-cp")
            .arg(format!(
                "/etc/zookeeper/conf:{}{}",
                zookeeper_jar()?.display(),
                if self.options.tls.is_some() {
                    netty_codec()?
                } else {
                    String::new()
                }
            ))
            .arg(format!("-Dzookeeper.log.dir={}", m.dir.display()))
            .arg("org.apache.zookeeper.server.quorum.QuorumPeerMain")
            .arg(m.dir.join("zoo.cfg"))
            .env_clear()
            .env("PATH", "/usr/bin:/bin");
        Ok(cmd)
    }

    /// Waits until member `i` answers on its client port and, when it
    /// serves TLS, accepts connections on its secure port too: Netty opens
    /// that one separately, and on a loaded machine a moment later.
    async fn wait_serving(&self, i: usize) -> Result<()> {
        let url = format!("zk://{}", self.members[i].hostport());
        self.procs[i]
            .wait_until_up("ZooKeeper", || services::probe_zookeeper(&url))
            .await?;
        let Some(secure) = self.members[i].secure_hostport() else {
            return Ok(());
        };
        self.procs[i]
            .wait_until_up("ZooKeeper (TLS port)", || async {
                tokio::net::TcpStream::connect(&secure)
                    .await
                    .map(drop)
                    .map_err(|e| format!("{secure}: {e}"))
            })
            .await
    }
}

fn java() -> Result<PathBuf> {
    super::find_binary(&["java"], "a Java runtime (ZooKeeper's)")
}

/// `:<netty-codec jar>`: Netty's TLS handler needs it, and the class path
/// of Debian's zookeeper.jar does not list it.
fn netty_codec() -> Result<String> {
    let jar = "/usr/share/java/netty-codec.jar";
    if std::path::Path::new(jar).exists() {
        Ok(format!(":{jar}"))
    } else {
        Err(fail(format!(
            "a TLS ZooKeeper needs {jar} (Debian's libnetty-java, installed with zookeeper by `scripts/services.sh`)"
        )))
    }
}

fn zookeeper_jar() -> Result<PathBuf> {
    let jar = PathBuf::from("/usr/share/java/zookeeper.jar");
    if jar.exists() {
        Ok(jar)
    } else {
        Err(fail(
            "ZooKeeper is not installed (no /usr/share/java/zookeeper.jar); install it with `scripts/services.sh`",
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn an_ensemble_elects_a_leader_and_elects_again_after_losing_it() {
        let zk = PrivateZooKeeper::start(ZooKeeperOptions {
            members: 3,
            ..ZooKeeperOptions::default()
        })
        .await
        .expect("a three-member ensemble");
        let leader = zk.leader().await.expect("a leader after start");
        zk.kill(leader);
        let mut next = None;
        for _ in 0..200 {
            next = zk.leader().await;
            if next.is_some() {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
        let next = next.expect("a new leader within 20 s");
        assert_ne!(next, leader);
        zk.restart(leader).await.expect("the old leader rejoins");
        assert!(zk.mode(leader).await.is_ok_and(|m| m == "follower"));
    }
}
