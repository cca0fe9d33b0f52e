//! Private etcd processes on free loopback ports with their own data dirs.

use std::{path::PathBuf, process::Stdio, time::Duration};

use fenced_api::{Error, Result};
use fenced_conformance::services::probe_etcd;
use tokio::process::{Child, Command};

fn fail(what: impl Into<String>) -> Error {
    Error::backend("etcd-test", false, what.into())
}

pub fn free_port() -> Result<u16> {
    let l = std::net::TcpListener::bind("127.0.0.1:0").map_err(|e| fail(e.to_string()))?;
    Ok(l.local_addr().map_err(|e| fail(e.to_string()))?.port())
}

fn etcd_bin() -> Result<&'static str> {
    for p in ["/usr/bin/etcd", "/usr/local/bin/etcd"] {
        if std::path::Path::new(p).exists() {
            return Ok(p);
        }
    }
    Err(fail(
        "etcd not found; install it with `scripts/services.sh`",
    ))
}

/// One member: name, client port, peer port, data dir.
#[derive(Debug, Clone)]
pub struct Member {
    pub name: String,
    pub client: u16,
    pub peer: u16,
    pub dir: PathBuf,
}

impl Member {
    fn new(name: &str, root: &std::path::Path) -> Result<Self> {
        Ok(Member {
            name: name.into(),
            client: free_port()?,
            peer: free_port()?,
            dir: root.join(name),
        })
    }

    pub fn hostport(&self) -> String {
        format!("127.0.0.1:{}", self.client)
    }

    fn command(&self, cluster: &str) -> Result<Command> {
        let mut cmd = Command::new(etcd_bin()?);
        cmd.arg("--name")
            .arg(&self.name)
            .arg("--data-dir")
            .arg(&self.dir)
            .arg("--listen-client-urls")
            .arg(format!("http://127.0.0.1:{}", self.client))
            .arg("--advertise-client-urls")
            .arg(format!("http://127.0.0.1:{}", self.client))
            .arg("--listen-peer-urls")
            .arg(format!("http://127.0.0.1:{}", self.peer))
            .arg("--initial-advertise-peer-urls")
            .arg(format!("http://127.0.0.1:{}", self.peer))
            .arg("--initial-cluster")
            .arg(cluster)
            .arg("--initial-cluster-state")
            .arg("new")
            .arg("--initial-cluster-token")
            .arg("fenced-test")
            .env_clear()
            .env("PATH", "/usr/bin:/bin")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .kill_on_drop(true);
        Ok(cmd)
    }
}

/// A private etcd (1 or 3 members). Processes die with it.
pub struct PrivateEtcd {
    root: PathBuf,
    pub members: Vec<Member>,
    cluster: String,
    children: tokio::sync::Mutex<Vec<Option<Child>>>,
}

impl PrivateEtcd {
    pub async fn start() -> Result<Self> {
        Self::start_cluster(1).await
    }

    pub async fn start_cluster(n: usize) -> Result<Self> {
        let root =
            std::env::temp_dir().join(format!("fenced-etcd-{}", uuid::Uuid::new_v4().simple()));
        let members = (0..n)
            .map(|i| Member::new(&format!("m{i}"), &root))
            .collect::<Result<Vec<_>>>()?;
        let cluster = members
            .iter()
            .map(|m| format!("{}=http://127.0.0.1:{}", m.name, m.peer))
            .collect::<Vec<_>>()
            .join(",");
        let mut children = Vec::new();
        for m in &members {
            children.push(Some(
                m.command(&cluster)?
                    .spawn()
                    .map_err(|e| fail(e.to_string()))?,
            ));
        }
        let etcd = PrivateEtcd {
            root,
            members,
            cluster,
            children: tokio::sync::Mutex::new(children),
        };
        for i in 0..n {
            etcd.wait_healthy(i).await?;
        }
        Ok(etcd)
    }

    pub fn hostport(&self) -> String {
        self.members
            .iter()
            .map(Member::hostport)
            .collect::<Vec<_>>()
            .join(",")
    }

    async fn wait_healthy(&self, i: usize) -> Result<()> {
        let url = format!("http://{}", self.members[i].hostport());
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        loop {
            if probe_etcd(&url).await.is_ok() {
                return Ok(());
            }
            if tokio::time::Instant::now() > deadline {
                return Err(fail(format!(
                    "private etcd member {i} not healthy within 30 s"
                )));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// SIGKILLs member `i`.
    pub async fn kill(&self, i: usize) {
        if let Some(mut c) = self.children.lock().await[i].take() {
            let _ = c.kill().await;
            let _ = c.wait().await;
        }
    }

    /// Starts member `i` again on its data dir.
    pub async fn start_member(&self, i: usize) -> Result<()> {
        let mut cmd = self.members[i].command(&self.cluster)?;
        cmd.arg("--initial-cluster-state").arg("existing");
        let child = cmd.spawn().map_err(|e| fail(e.to_string()))?;
        self.children.lock().await[i] = Some(child);
        self.wait_healthy(i).await
    }

    /// Kills every member hard and starts them again.
    pub async fn restart(&self) -> Result<()> {
        for i in 0..self.members.len() {
            self.kill(i).await;
        }
        for i in 0..self.members.len() {
            let child = self.members[i]
                .command(&self.cluster)?
                .spawn()
                .map_err(|e| fail(e.to_string()))?;
            self.children.lock().await[i] = Some(child);
        }
        for i in 0..self.members.len() {
            self.wait_healthy(i).await?;
        }
        Ok(())
    }
}

impl Drop for PrivateEtcd {
    fn drop(&mut self) {
        if let Ok(mut children) = self.children.try_lock() {
            for c in children.iter_mut().flatten() {
                let _ = c.start_kill();
            }
        }
        let _ = std::fs::remove_dir_all(&self.root);
    }
}
