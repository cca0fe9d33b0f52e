//! A private MariaDB server: own datadir, own port, own socket.

use std::{path::PathBuf, process::Command};

use fenced_api::Result;
use sqlx::{mysql::MySqlConnectOptions, Connection};

use super::{fail, find_binary, free_port, proc::Proc, temp_dir, TlsFiles};
use crate::services::probe_mysql;

/// How to start a [`PrivateMariaDb`].
#[derive(Debug, Clone, Default)]
pub struct MariaDbOptions {
    /// Serve TLS with these files (`ssl_ca`, `ssl_cert`, `ssl_key`).
    pub tls: Option<TlsFiles>,
    /// `require_secure_transport=ON`: TCP clients must use TLS (the unix
    /// socket used by [`PrivateMariaDb::admin`] still works).
    pub require_secure_transport: bool,
    /// Start with `read_only=ON`.
    pub read_only: bool,
    /// Keep a row-based binary log (`--log-bin --binlog-format=ROW`) in the
    /// data directory, for the fault suite's server truth.
    pub binlog: bool,
    /// More server options (`--innodb-lock-wait-timeout=1`…), given after
    /// all others so that they win over the defaults.
    pub extra: Vec<String>,
}

/// A `mariadbd` on a free port with a fresh datadir (`mariadb-install-db`),
/// root without password, a `test` database. Killed and removed on drop.
#[derive(Debug)]
pub struct PrivateMariaDb {
    // First: fields drop in order, so the server is dead before its
    // directory is removed.
    proc: Proc,
    dir: tempfile::TempDir,
    port: u16,
    options: MariaDbOptions,
}

impl PrivateMariaDb {
    /// Initialises a datadir and starts the server.
    ///
    /// # Errors
    ///
    /// When the binaries are missing (naming `scripts/services.sh`), the
    /// datadir cannot be initialised or the server does not answer.
    pub async fn start(options: MariaDbOptions) -> Result<Self> {
        let dir = temp_dir("mariadb")?;
        let install = find_binary(&["mariadb-install-db", "mysql_install_db"], "MariaDB")?;
        // Its own tmpdir, for the install and the server: a MariaDB starting
        // up removes the `#sql…` temporary files it finds there, so two on
        // one /tmp break each other ("Could not remove temporary table …
        // Unknown table 'mysql.tmp_proxies_priv'").
        let tmp = dir.path().join("tmp");
        std::fs::create_dir_all(&tmp)
            .map_err(|e| fail(format!("creating {}: {e}", tmp.display())))?;
        let out = tokio::process::Command::new(install)
            .arg("--no-defaults")
            .arg(format!("--datadir={}", dir.path().join("data").display()))
            .arg(format!("--tmpdir={}", tmp.display()))
            .arg("--user=root")
            .arg("--auth-root-authentication-method=normal")
            .arg("--skip-test-db")
            .output()
            .await
            .map_err(|e| fail(format!("mariadb-install-db: {e}")))?;
        if !out.status.success() {
            return Err(fail(format!(
                "mariadb-install-db failed: {}",
                String::from_utf8_lossy(&out.stderr)
            )));
        }
        let db = PrivateMariaDb {
            dir,
            port: free_port()?,
            options,
            proc: Proc::default(),
        };
        db.launch().await?;
        db.admin("CREATE DATABASE IF NOT EXISTS test").await?;
        Ok(db)
    }

    /// Root over TCP: `mysql://root@127.0.0.1:<port>/test`.
    pub fn url(&self) -> String {
        format!("mysql://root@127.0.0.1:{}/test", self.port)
    }

    /// The TCP port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The unix socket (always plaintext-allowed, even with `require_secure_transport`).
    pub fn socket(&self) -> PathBuf {
        self.dir.path().join("sock")
    }

    /// Runs one statement as root over the unix socket.
    ///
    /// # Errors
    ///
    /// The server's error.
    pub async fn admin(&self, sql: &str) -> Result<()> {
        let opts = MySqlConnectOptions::new()
            .socket(self.socket())
            .username("root")
            .database("mysql");
        let mut conn = sqlx::MySqlConnection::connect_with(&opts)
            .await
            .map_err(|e| fail(format!("admin connection: {e}")))?;
        sqlx::raw_sql(sqlx::AssertSqlSafe(sql.to_owned()))
            .execute(&mut conn)
            .await
            .map_err(|e| fail(format!("`{sql}`: {e}")))?;
        let _ = conn.close().await;
        Ok(())
    }

    async fn launch(&self) -> Result<()> {
        let server = find_binary(&["mariadbd", "mysqld"], "MariaDB")?;
        let d = self.dir.path();
        let mut cmd = Command::new(server);
        cmd.arg("--no-defaults")
            .arg(format!("--datadir={}", d.join("data").display()))
            .arg(format!("--port={}", self.port))
            .arg("--bind-address=127.0.0.1")
            .arg(format!("--socket={}", self.socket().display()))
            .arg(format!("--pid-file={}", d.join("pid").display()))
            .arg(format!("--log-error={}", d.join("error.log").display()))
            .arg(format!("--tmpdir={}", d.join("tmp").display()))
            .arg("--user=root")
            .arg("--innodb-flush-log-at-trx-commit=1")
            .arg("--innodb-buffer-pool-size=32M");
        if self.options.binlog {
            cmd.arg(format!("--log-bin={}", d.join("binlog").display()))
                .arg("--binlog-format=ROW")
                .arg("--binlog-annotate-row-events=ON")
                .arg("--server-id=1");
        } else {
            cmd.arg("--skip-log-bin");
        }
        if let Some(tls) = &self.options.tls {
            cmd.arg(format!("--ssl-ca={}", tls.ca.display()))
                .arg(format!("--ssl-cert={}", tls.cert.display()))
                .arg(format!("--ssl-key={}", tls.key.display()));
        }
        if self.options.require_secure_transport {
            cmd.arg("--require-secure-transport=ON");
        }
        if self.options.read_only {
            cmd.arg("--read-only=ON");
        }
        cmd.args(&self.options.extra);
        self.proc.spawn(cmd, "mariadbd")?;
        let url = format!("mysql://root@127.0.0.1:{}/mysql", self.port);
        let log = d.join("error.log");
        self.proc
            .wait_until_up("mariadbd", || probe_mysql(&url))
            .await
            .map_err(|e| {
                let tail = std::fs::read_to_string(&log).unwrap_or_default();
                let tail: Vec<&str> = tail.lines().rev().take(5).collect();
                fail(format!("{e}; error log: {}", tail.join(" | ")))
            })
    }

    process_controls!();

    /// Sets `@@global.read_only`.
    ///
    /// # Errors
    ///
    /// The server's error.
    pub async fn set_read_only(&self, on: bool) -> Result<()> {
        self.admin(if on {
            "SET GLOBAL read_only = 1"
        } else {
            "SET GLOBAL read_only = 0"
        })
        .await
    }
}
