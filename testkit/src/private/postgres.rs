//! A private PostgreSQL server (own data directory, port and socket
//! directory) and hot standbys of it.
//!
//! PostgreSQL refuses to run as root: when the tests run as root, `initdb`,
//! `postgres` and `pg_basebackup` run as the `postgres` OS user that
//! Debian's packages create, and the temporary directory is handed to it.
//!
//! Every process the postmaster forks calls `setsid()`, so its backends are
//! not in its process group: killing the server means stopping the
//! postmaster (no new forks), SIGKILLing its children found through
//! `/proc`, then the postmaster itself.

use std::{
    path::{Path, PathBuf},
    process::Command,
    time::Duration,
};

use fenced_api::Result;
use sqlx::{Connection, PgConnection};

use super::{fail, free_port, proc::Proc, temp_dir};
use crate::services::probe_postgres;

/// The binaries a private server needs, all from one installation.
const BINARIES: [&str; 3] = ["initdb", "postgres", "pg_basebackup"];

/// Where Debian installs each major version's server binaries
/// (`<root>/<major>/bin`).
const DEBIAN_ROOT: &str = "/usr/lib/postgresql";

/// Other installations' binary directories, tried after Debian's.
const OTHER_BIN_DIRS: [&str; 3] = ["/usr/local/pgsql/bin", "/usr/bin", "/usr/local/bin"];

/// How long a clean shutdown ([`PrivatePostgres::stop`]) may take before the
/// server is killed.
const STOP_TIMEOUT: Duration = Duration::from_secs(30);

/// How long killed processes may take to be gone.
const KILL_TIMEOUT: Duration = Duration::from_secs(5);

/// How to start a [`PrivatePostgres`].
#[derive(Debug, Clone)]
pub struct PostgresOptions {
    /// `max_connections` (default 100). A standby gets its primary's.
    pub max_connections: u32,
    /// More server settings as `name=value` (`synchronous_commit=off`…),
    /// each passed as `-c name=value` after the defaults so that they win.
    pub extra: Vec<String>,
}

impl Default for PostgresOptions {
    fn default() -> Self {
        PostgresOptions {
            max_connections: 100,
            extra: Vec::new(),
        }
    }
}

/// A `postgres` on a free loopback port with a fresh data directory:
/// role `postgres` with trust authentication (also for replication), fsync
/// on, WAL for replicas, the unix socket in its own directory. Killed and
/// removed on drop.
#[derive(Debug)]
pub struct PrivatePostgres {
    // First: fields drop in order, so the server is dead before its
    // directory is removed (Drop kills its children before that).
    proc: Proc,
    dir: tempfile::TempDir,
    port: u16,
    bin: PathBuf,
    /// The OS user and group the server runs as (`postgres`, when the
    /// tests run as root).
    owner: Option<(u32, u32)>,
    options: PostgresOptions,
}

impl PrivatePostgres {
    /// Initialises a data directory (`initdb`) and starts the server.
    ///
    /// # Errors
    ///
    /// When the binaries are missing (naming `scripts/services.sh`), the
    /// data directory cannot be initialised or the server does not answer.
    pub async fn start(options: PostgresOptions) -> Result<Self> {
        let bin = bin_dir()?;
        let owner = owner()?;
        let dir = prepare_dir("postgres", owner)?;
        let data = dir.path().join("data");
        let mut initdb = tokio::process::Command::new(bin.join("initdb"));
        initdb
            .arg("-D")
            .arg(&data)
            .args(["-U", "postgres", "--auth=trust", "--encoding=UTF8"])
            // C: no dependence on the machine's locales. No sync: a crash
            // test kills processes, not the machine, so the page cache
            // keeps what initdb wrote.
            .args(["--locale=C", "--no-sync", "--no-instructions"]);
        run_as(&mut initdb, dir.path(), owner);
        let out = initdb
            .output()
            .await
            .map_err(|e| fail(format!("initdb: {e}")))?;
        if !out.status.success() {
            return Err(fail(format!(
                "initdb failed: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            )));
        }
        // Trust for local and loopback connections, replication included
        // (what initdb writes already, stated here so standbys never depend
        // on initdb's template).
        std::fs::write(
            data.join("pg_hba.conf"),
            "local all all trust\nhost all all 127.0.0.1/32 trust\n\
             local replication all trust\nhost replication all 127.0.0.1/32 trust\n",
        )
        .map_err(|e| fail(format!("writing pg_hba.conf: {e}")))?;
        let server = PrivatePostgres {
            proc: Proc::default(),
            dir,
            port: free_port()?,
            bin,
            owner,
            options,
        };
        server.launch().await?;
        Ok(server)
    }

    /// A hot standby of `primary`: a base backup (`pg_basebackup -R`, which
    /// writes `standby.signal` and the `primary_conninfo`) started on its
    /// own port. It streams the primary's WAL and answers read-only queries
    /// (`pg_is_in_recovery()` is true) until [`promote`](Self::promote)d.
    ///
    /// # Errors
    ///
    /// When the primary does not answer, the backup fails or the standby
    /// does not come up.
    pub async fn standby_of(primary: &PrivatePostgres) -> Result<Self> {
        let dir = prepare_dir("postgres-standby", primary.owner)?;
        let mut backup = tokio::process::Command::new(primary.bin.join("pg_basebackup"));
        backup
            .arg("-D")
            .arg(dir.path().join("data"))
            .args(["-R", "-X", "stream", "-c", "fast", "--no-sync"])
            .args(["-h", "127.0.0.1", "-U", "postgres", "-p"])
            .arg(primary.port.to_string());
        run_as(&mut backup, dir.path(), primary.owner);
        let out = backup
            .output()
            .await
            .map_err(|e| fail(format!("pg_basebackup: {e}")))?;
        if !out.status.success() {
            return Err(fail(format!(
                "pg_basebackup from port {} failed: {}",
                primary.port,
                String::from_utf8_lossy(&out.stderr).trim()
            )));
        }
        let standby = PrivatePostgres {
            proc: Proc::default(),
            dir,
            port: free_port()?,
            bin: primary.bin.clone(),
            owner: primary.owner,
            // A hot standby needs at least its primary's max_connections.
            options: primary.options.clone(),
        };
        standby.launch().await?;
        Ok(standby)
    }

    /// Role `postgres` over TCP to database `postgres`:
    /// `postgres://postgres@127.0.0.1:<port>/postgres`.
    pub fn url(&self) -> String {
        self.url_for("postgres")
    }

    /// The URL of database `database` on this server (see
    /// [`create_database`](Self::create_database)).
    pub fn url_for(&self, database: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{database}", self.port)
    }

    /// The TCP port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The data directory.
    pub fn data_dir(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    /// The directory holding the unix socket (`.s.PGSQL.<port>`).
    pub fn socket_dir(&self) -> PathBuf {
        self.dir.path().join("sock")
    }

    /// The server's log (its stderr).
    pub fn log_file(&self) -> PathBuf {
        self.dir.path().join("server.log")
    }

    /// Runs `sql` (one or more statements, no results) as role `postgres`
    /// on database `postgres`.
    ///
    /// # Errors
    ///
    /// The server's error.
    pub async fn admin(&self, sql: &str) -> Result<()> {
        let mut conn = self.connect().await?;
        sqlx::raw_sql(sqlx::AssertSqlSafe(sql.to_owned()))
            .execute(&mut conn)
            .await
            .map_err(|e| fail(format!("`{sql}`: {e}")))?;
        let _ = conn.close().await;
        Ok(())
    }

    /// Creates database `name` (ASCII letters, digits and `_`) and returns
    /// its URL.
    ///
    /// # Errors
    ///
    /// For another name, or the server's error.
    pub async fn create_database(&self, name: &str) -> Result<String> {
        if name.is_empty() || !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
            return Err(fail(format!(
                "database name {name:?}: only ASCII letters, digits and `_`"
            )));
        }
        self.admin(&format!("CREATE DATABASE \"{name}\"")).await?;
        Ok(self.url_for(name))
    }

    /// `pg_is_in_recovery()`: true on a standby, false on a primary.
    ///
    /// # Errors
    ///
    /// The server's error.
    pub async fn in_recovery(&self) -> Result<bool> {
        let mut conn = self.connect().await?;
        let recovering = sqlx::query_scalar("SELECT pg_is_in_recovery()")
            .fetch_one(&mut conn)
            .await
            .map_err(|e| fail(format!("pg_is_in_recovery(): {e}")))?;
        let _ = conn.close().await;
        Ok(recovering)
    }

    /// Promotes a standby to a primary (`pg_promote`, waiting until it
    /// accepts writes).
    ///
    /// # Errors
    ///
    /// When the server is not a standby or the promotion does not finish
    /// within a minute.
    pub async fn promote(&self) -> Result<()> {
        let mut conn = self.connect().await?;
        let done: bool = sqlx::query_scalar("SELECT pg_promote(true, 60)")
            .fetch_one(&mut conn)
            .await
            .map_err(|e| fail(format!("pg_promote(): {e}")))?;
        let _ = conn.close().await;
        if done {
            Ok(())
        } else {
            Err(fail("pg_promote() did not finish within 60 s"))
        }
    }

    /// The postmaster's process id (`None` while the server is down).
    pub fn pid(&self) -> Option<u32> {
        self.proc.pid()
    }

    /// Crashes the server: SIGKILL to the postmaster and every process it
    /// forked (no shutdown checkpoint; the next start replays the WAL).
    /// Leaves it down.
    pub fn kill(&self) {
        let Some(pid) = self.proc.pid() else {
            return;
        };
        // Stopped first, so that it forks nothing while its children are
        // listed.
        let _ = self.proc.signal("STOP");
        let children = children(pid);
        signal_all("KILL", &children);
        self.proc.kill();
        wait_gone(&children);
    }

    /// Starts the server again on the same data directory and port and
    /// waits until it answers; a running server is [`kill`](Self::kill)ed
    /// first (a crash and a restart).
    ///
    /// # Errors
    ///
    /// When it does not come back.
    pub async fn restart(&self) -> Result<()> {
        self.kill();
        self.launch().await
    }

    /// Shuts the server down cleanly (SIGINT: PostgreSQL's fast shutdown,
    /// which disconnects clients and writes a checkpoint) and leaves it
    /// down.
    ///
    /// # Errors
    ///
    /// When it does not exit within 30 s (it is then killed).
    pub async fn stop(&self) -> Result<()> {
        if self.proc.pid().is_none() {
            return Ok(());
        }
        self.proc.signal("INT")?;
        if self.proc.wait_exit(STOP_TIMEOUT).await {
            Ok(())
        } else {
            self.kill();
            Err(fail(format!(
                "the private PostgreSQL did not shut down within {STOP_TIMEOUT:?}; killed it"
            )))
        }
    }

    /// Sends `signal` (`STOP`, `CONT`) to the postmaster and every process
    /// it forked: SIGSTOP makes the whole server a silent peer (connections
    /// stay open, nothing is answered).
    ///
    /// # Errors
    ///
    /// When the server is not running.
    pub fn signal(&self, signal: &str) -> Result<()> {
        let pid = self
            .proc
            .pid()
            .ok_or_else(|| fail("the server is not running"))?;
        let mut all = vec![pid];
        all.extend(children(pid));
        signal_all(signal, &all);
        Ok(())
    }

    async fn connect(&self) -> Result<PgConnection> {
        PgConnection::connect(&self.url())
            .await
            .map_err(|e| fail(format!("connecting to the private PostgreSQL: {e}")))
    }

    async fn launch(&self) -> Result<()> {
        let mut cmd = Command::new(self.bin.join("postgres"));
        cmd.arg("-D")
            .arg(self.data_dir())
            .arg("-p")
            .arg(self.port.to_string());
        let settings = [
            "listen_addresses=127.0.0.1".to_owned(),
            format!("unix_socket_directories={}", self.socket_dir().display()),
            "fsync=on".to_owned(),
            format!("max_connections={}", self.options.max_connections),
            // Many private servers may run at once; the stock 128 MB each
            // is more than a test needs.
            "shared_buffers=32MB".to_owned(),
            "wal_level=replica".to_owned(),
            "max_wal_senders=10".to_owned(),
            "hot_standby=on".to_owned(),
            "ssl=off".to_owned(),
            "logging_collector=off".to_owned(),
        ];
        for setting in settings.iter().chain(&self.options.extra) {
            cmd.arg("-c").arg(setting);
        }
        run_as_std(&mut cmd, self.dir.path(), self.owner);
        self.proc.spawn_logging(cmd, "postgres", &self.log_file())?;
        let url = self.url();
        self.proc
            .wait_until_up("PostgreSQL", || probe_postgres(&url))
            .await
            .map_err(|e| fail(format!("{e}; server log: {}", log_tail(&self.log_file()))))
    }
}

impl Drop for PrivatePostgres {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The directory with the server's binaries: the newest
/// `/usr/lib/postgresql/<major>/bin` (Debian's layout) that has them all,
/// else the first of the other usual places that does.
///
/// # Errors
///
/// When there is none; the message names `scripts/services.sh`.
pub fn bin_dir() -> Result<PathBuf> {
    bin_dir_in(Path::new(DEBIAN_ROOT), &OTHER_BIN_DIRS.map(Path::new))
}

fn bin_dir_in(debian_root: &Path, others: &[&Path]) -> Result<PathBuf> {
    let complete = |dir: &Path| BINARIES.iter().all(|b| dir.join(b).is_file());
    let mut majors: Vec<(u32, PathBuf)> = std::fs::read_dir(debian_root)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let major = e.file_name().to_str()?.parse().ok()?;
            Some((major, e.path().join("bin")))
        })
        .collect();
    majors.sort();
    if let Some((_, dir)) = majors.into_iter().rev().find(|(_, d)| complete(d)) {
        return Ok(dir);
    }
    others
        .iter()
        .find(|d| complete(d))
        .map(|d| d.to_path_buf())
        .ok_or_else(|| {
            fail(format!(
                "no PostgreSQL server binaries ({}) in {}/<major>/bin or {}; \
                 install PostgreSQL with `scripts/services.sh`",
                BINARIES.join(", "),
                debian_root.display(),
                others
                    .iter()
                    .map(|d| d.display().to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            ))
        })
}

/// The user and group to run the server as: `postgres`'s when this
/// process is root, none (this process's own) otherwise.
fn owner() -> Result<Option<(u32, u32)>> {
    use std::os::unix::fs::MetadataExt;

    let me = std::fs::metadata("/proc/self")
        .map_err(|e| fail(format!("reading /proc/self: {e}")))?
        .uid();
    if me != 0 {
        return Ok(None);
    }
    let passwd = std::fs::read_to_string("/etc/passwd")
        .map_err(|e| fail(format!("reading /etc/passwd: {e}")))?;
    passwd_ids(&passwd, "postgres").map(Some).ok_or_else(|| {
        fail(
            "the tests run as root, which PostgreSQL refuses, and there is no `postgres` \
             OS user to run it as; install PostgreSQL with `scripts/services.sh`",
        )
    })
}

/// The uid and gid of `user` in the text of an `/etc/passwd`.
fn passwd_ids(passwd: &str, user: &str) -> Option<(u32, u32)> {
    passwd.lines().find_map(|line| {
        let mut fields = line.split(':');
        if fields.next()? != user {
            return None;
        }
        let _password = fields.next()?;
        Some((fields.next()?.parse().ok()?, fields.next()?.parse().ok()?))
    })
}

/// A temporary directory with a `sock/` inside, both handed to `owner`.
fn prepare_dir(kind: &str, owner: Option<(u32, u32)>) -> Result<tempfile::TempDir> {
    let dir = temp_dir(kind)?;
    let sock = dir.path().join("sock");
    std::fs::create_dir(&sock).map_err(|e| fail(format!("creating {}: {e}", sock.display())))?;
    if let Some((uid, gid)) = owner {
        for path in [dir.path(), sock.as_path()] {
            std::os::unix::fs::chown(path, Some(uid), Some(gid)).map_err(|e| {
                fail(format!(
                    "handing {} to the postgres user: {e}",
                    path.display()
                ))
            })?;
        }
    }
    Ok(dir)
}

/// A PostgreSQL tool's environment: none of this process's (`PG*`
/// variables would redirect it), started in `dir`, as `owner`.
fn run_as(cmd: &mut tokio::process::Command, dir: &Path, owner: Option<(u32, u32)>) {
    cmd.env_clear()
        .env("PATH", "/usr/bin:/bin")
        .current_dir(dir);
    if let Some((uid, gid)) = owner {
        cmd.uid(uid).gid(gid);
    }
}

/// [`run_as`] for the server's own (std) command.
fn run_as_std(cmd: &mut Command, dir: &Path, owner: Option<(u32, u32)>) {
    use std::os::unix::process::CommandExt;

    cmd.env_clear()
        .env("PATH", "/usr/bin:/bin")
        .current_dir(dir);
    if let Some((uid, gid)) = owner {
        cmd.uid(uid).gid(gid);
    }
}

/// The processes whose parent is `pid`, from `/proc`.
fn children(pid: u32) -> Vec<u32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|e| {
            let child: u32 = e.file_name().to_str()?.parse().ok()?;
            let (_, ppid) = stat_state(child)?;
            (ppid == pid).then_some(child)
        })
        .collect()
}

/// The state letter and parent of process `pid`, from `/proc/<pid>/stat`
/// (the command name in parentheses may hold spaces, so fields are counted
/// after the last `)`).
fn stat_state(pid: u32) -> Option<(String, u32)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let (_, rest) = stat.rsplit_once(')')?;
    let mut fields = rest.split_whitespace();
    let state = fields.next()?.to_owned();
    Some((state, fields.next()?.parse().ok()?))
}

/// Sends `signal` to every process in `pids` with one kill(1); one that
/// exited meanwhile is skipped by kill(1), which still signals the rest.
fn signal_all(signal: &str, pids: &[u32]) {
    if pids.is_empty() {
        return;
    }
    let _ = Command::new("kill")
        .arg(format!("-{signal}"))
        .args(pids.iter().map(u32::to_string))
        .stderr(std::process::Stdio::null())
        .status();
}

/// Waits (blocking, at most [`KILL_TIMEOUT`]) until none of `pids` is a
/// live process: a zombie no longer holds the server's shared memory, so a
/// new postmaster can start on the data directory.
fn wait_gone(pids: &[u32]) {
    let deadline = std::time::Instant::now() + KILL_TIMEOUT;
    while pids
        .iter()
        .any(|&p| stat_state(p).is_some_and(|(state, _)| state != "Z"))
        && std::time::Instant::now() < deadline
    {
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// The last lines of the server log, ` | `-joined.
fn log_tail(log: &Path) -> String {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let mut tail: Vec<&str> = text.lines().rev().take(5).collect();
    tail.reverse();
    tail.join(" | ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_binaries_name_the_services_script() {
        let none = Path::new("/nonexistent/fenced-testkit");
        let e = bin_dir_in(none, &[none]).unwrap_err().to_string();
        assert!(
            e.contains("scripts/services.sh") && e.contains("initdb"),
            "{e}"
        );
    }

    #[test]
    fn passwd_lines_give_uid_and_gid() {
        let passwd = "root:x:0:0:root:/root:/bin/bash\n\
                      postgresx:x:7:7::/:/bin/false\n\
                      postgres:x:101:104:PostgreSQL administrator:/var/lib/postgresql:/bin/bash\n";
        assert_eq!(passwd_ids(passwd, "postgres"), Some((101, 104)));
        assert_eq!(passwd_ids(passwd, "nobody"), None);
    }

    #[test]
    fn children_are_found_through_proc() {
        let mut child = Command::new("sleep").arg("30").spawn().unwrap();
        let me = std::process::id();
        assert!(children(me).contains(&child.id()));
        assert_eq!(stat_state(child.id()).map(|(_, ppid)| ppid), Some(me));
        signal_all("KILL", &[child.id()]);
        child.wait().unwrap();
        assert!(!children(me).contains(&child.id()));
    }
}
