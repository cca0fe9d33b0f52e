//! A private MariaDB server (own datadir, own port) for tests that restart,
//! kill or reconfigure a server — never the shared one other tests use.

use std::{path::PathBuf, process::Stdio, time::Duration};

use fenced_api::{Error, Result};
use fenced_conformance::services::probe_mysql;
use tokio::process::{Child, Command};

pub struct PrivateMariaDb {
    dir: PathBuf,
    port: u16,
    extra: Vec<String>,
    child: tokio::sync::Mutex<Option<Child>>,
}

fn fail(what: impl Into<String>) -> Error {
    Error::backend("mysql-test", false, what.into())
}

fn free_port() -> Result<u16> {
    let l = std::net::TcpListener::bind("127.0.0.1:0").map_err(|e| fail(e.to_string()))?;
    Ok(l.local_addr().map_err(|e| fail(e.to_string()))?.port())
}

fn which(names: &[&str]) -> Result<String> {
    for n in names {
        for dir in ["/usr/sbin", "/usr/bin", "/usr/local/bin", "/usr/local/sbin"] {
            let p = format!("{dir}/{n}");
            if std::path::Path::new(&p).exists() {
                return Ok(p);
            }
        }
    }
    Err(fail(format!(
        "none of {names:?} found; install MariaDB with `scripts/services.sh`"
    )))
}

impl PrivateMariaDb {
    /// Initialises a datadir under /tmp and starts `mariadbd` on a free port.
    pub async fn start() -> Result<Self> {
        Self::start_with(&[]).await
    }

    /// As [`start`](Self::start), with extra server options.
    pub async fn start_with(extra: &[&str]) -> Result<Self> {
        let install = which(&["mariadb-install-db", "mysql_install_db"])?;
        let dir =
            std::env::temp_dir().join(format!("fenced-mariadb-{}", uuid::Uuid::new_v4().simple()));
        // Its own tmpdir, for the install and the server: a MariaDB starting
        // up removes the `#sql…` temporary files it finds there, so two on
        // one /tmp break each other (a CI run failed with "Could not remove
        // temporary table … Unknown table 'mysql.tmp_proxies_priv'").
        std::fs::create_dir_all(dir.join("tmp")).map_err(|e| fail(e.to_string()))?;
        let out = Command::new(install)
            .arg("--no-defaults")
            .arg(format!("--datadir={}", dir.join("data").display()))
            .arg(format!("--tmpdir={}", dir.join("tmp").display()))
            .arg("--user=root")
            .arg("--auth-root-authentication-method=normal")
            .arg("--skip-test-db")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .output()
            .await;
        let out = match out {
            Ok(out) => out,
            Err(e) => {
                let _ = std::fs::remove_dir_all(&dir);
                return Err(fail(format!("mariadb-install-db: {e}")));
            }
        };
        if !out.status.success() {
            let _ = std::fs::remove_dir_all(&dir);
            return Err(fail(format!(
                "mariadb-install-db failed: {}",
                String::from_utf8_lossy(&out.stderr)
            )));
        }
        let db = PrivateMariaDb {
            dir,
            port: free_port()?,
            extra: extra.iter().map(|s| (*s).to_owned()).collect(),
            child: tokio::sync::Mutex::new(None),
        };
        db.launch().await?;
        let pool = sqlx::MySqlPool::connect(&format!("mysql://root@127.0.0.1:{}/mysql", db.port))
            .await
            .map_err(|e| fail(e.to_string()))?;
        sqlx::query("CREATE DATABASE IF NOT EXISTS test")
            .execute(&pool)
            .await
            .map_err(|e| fail(e.to_string()))?;
        pool.close().await;
        Ok(db)
    }

    pub fn url(&self) -> String {
        format!("mysql://root@127.0.0.1:{}/test", self.port)
    }

    async fn launch(&self) -> Result<()> {
        let server = which(&["mariadbd", "mysqld"])?;
        let child = Command::new(server)
            .arg("--no-defaults")
            .arg(format!("--datadir={}", self.dir.join("data").display()))
            .arg(format!("--port={}", self.port))
            .arg("--bind-address=127.0.0.1")
            .arg(format!("--socket={}", self.dir.join("sock").display()))
            .arg(format!("--pid-file={}", self.dir.join("pid").display()))
            .arg(format!("--tmpdir={}", self.dir.join("tmp").display()))
            .arg("--user=root")
            .arg("--innodb-flush-log-at-trx-commit=1")
            .arg("--innodb-buffer-pool-size=32M")
            .arg("--skip-log-bin")
            .args(&self.extra)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| fail(format!("starting mariadbd: {e}")))?;
        *self.child.lock().await = Some(child);
        let url = self.url().replace("/test", "/mysql");
        let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
        loop {
            if probe_mysql(&url).await.is_ok() {
                return Ok(());
            }
            if tokio::time::Instant::now() > deadline {
                return Err(fail("the private mariadbd did not answer within 60 s"));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Kills the server hard (SIGKILL: no clean shutdown) and starts it again
    /// on the same datadir and port.
    pub async fn restart(&self) -> Result<()> {
        if let Some(mut child) = self.child.lock().await.take() {
            let _ = child.kill().await;
            let _ = child.wait().await;
        }
        self.launch().await
    }

    /// Sets `@@global.read_only`.
    pub async fn set_read_only(&self, on: bool) -> Result<()> {
        let pool = sqlx::MySqlPool::connect(&self.url())
            .await
            .map_err(|e| fail(e.to_string()))?;
        let sql = if on {
            "SET GLOBAL read_only = 1"
        } else {
            "SET GLOBAL read_only = 0"
        };
        sqlx::query(sql)
            .execute(&pool)
            .await
            .map_err(|e| fail(e.to_string()))?;
        pool.close().await;
        Ok(())
    }
}

impl Drop for PrivateMariaDb {
    fn drop(&mut self) {
        if let Ok(mut child) = self.child.try_lock() {
            if let Some(c) = child.as_mut() {
                let _ = c.start_kill();
            }
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
