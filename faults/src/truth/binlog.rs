//! MySQL/MariaDB server truth: the binary log of a private MariaDB.
//!
//! The shared MariaDB runs without a binary log, so the MySQL cells run
//! against a private `mariadbd` ([`private_server`]) started with
//! `--log-bin --binlog-format=ROW --binlog-annotate-row-events`, shared by
//! the runs of one process and killed when the last user lets go. A run
//! notes the log position before its clients start; afterwards
//! `mariadb-binlog --read-from-remote-server --base64-output=decode-rows -v`
//! decodes every row change committed since, and the run's tables are
//! picked out. The log is what the server committed, in commit order, with
//! the statement that made each change (the annotation).
//!
//! Per key, in commit order, the changes become [`Change`]s:
//!
//! * `unique_key` (`<t>`): an inserted row is a grant (token = `id`); an
//!   update of it an extension; a delete ends it in commit order (the
//!   unique key keeps a second row out until then). A delete by a statement
//!   that only deletes *expired* rows (`expire_time <` / `<=` in its
//!   annotation) is judged too: if the row's expiry is at or after the end
//!   of the second in which the statement ran (the event header's time;
//!   the log keeps no finer time for row events), the server swept away a
//!   current grant — counted as an overlap. The start of an insert
//!   (`create_time`) is not compared: a statement that waited for a row
//!   lock keeps the time it started;
//! * `optimistic` (`<t>_optimistic`): an update that sets a holder and a new
//!   `version` is a grant (start = new expiry − the statement's TTL, the
//!   `INTERVAL … MICROSECOND` of its annotation); same version, an
//!   extension; holder cleared, an end;
//! * `row_lock` (`<t>_live`, a `MEMORY` table): its acquire `REPLACE`s the
//!   key's row, logged as a delete of the old row and an insert of the new
//!   one, whose AUTO_INCREMENT `id` is the token: an insert is a grant, an
//!   update with the same id an extension. A release writes nothing.
//!
//! Checked: a grant must not start (on the server's clock) before the
//! previous grant of the key ended — by an explicit end earlier in commit
//! order, or by its expiry at or before the new grant's start — and tokens
//! strictly increase in commit order.
//!
//! `row_lock` overlaps are **not judged**: its lock is an InnoDB row lock of
//! an open transaction; taking it writes nothing, and a dead holder's
//! rollback (connection cut, `wait_timeout`) frees it without a trace in the
//! log; nor does a release, which only rolls the transaction back. Its
//! tokens are checked, and every client grant must be in the log.

mod rows;

use std::sync::{Arc, Mutex, Weak};

use fenced::mysql::sqlx::{self, Connection as _, Row as _};

/// Why `row_lock` overlaps are not judged (see the module docs).
pub use crate::history::ROW_LOCK_UNJUDGED;
pub use rows::{changes, check, micros, parse, Change, RowEvent};

use crate::{
    history::ServerTruth,
    model::Target,
    private::{find_binary, MariaDbOptions, PrivateMariaDb},
};

static SHARED: Mutex<Weak<PrivateMariaDb>> = Mutex::new(Weak::new());
static START: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// The process's private MariaDB with a binary log, started on first use.
/// While a handle lives, the MySQL targets of the fault suite use it
/// instead of the shared server.
///
/// # Errors
///
/// When it cannot be started (names `scripts/services.sh` when MariaDB is
/// missing).
pub async fn private_server() -> Result<Arc<PrivateMariaDb>, String> {
    let _gate = START.lock().await;
    if let Some(db) = current() {
        return Ok(db);
    }
    let db = PrivateMariaDb::start(MariaDbOptions {
        binlog: true,
        ..MariaDbOptions::default()
    })
    .await
    .map_err(|e| format!("private MariaDB with a binary log: {e}"))?;
    let db = Arc::new(db);
    *SHARED.lock().unwrap_or_else(|p| p.into_inner()) = Arc::downgrade(&db);
    Ok(db)
}

fn current() -> Option<Arc<PrivateMariaDb>> {
    SHARED.lock().unwrap_or_else(|p| p.into_inner()).upgrade()
}

/// The URL of the private binlog server while one is in use.
pub fn server_url() -> Option<String> {
    current().map(|db| db.url())
}

/// The binary-log record of one MySQL run.
#[derive(Debug)]
pub struct BinlogLog {
    target: Target,
    db: Arc<PrivateMariaDb>,
    table: String,
    file: String,
    position: u64,
}

impl BinlogLog {
    /// Notes the log position, or `None` when the run uses the shared
    /// server (no binary log).
    ///
    /// # Errors
    ///
    /// When the private server does not answer.
    pub async fn start(target: Target, url: &str) -> Result<Option<BinlogLog>, String> {
        let Some(db) = current() else {
            return Ok(None);
        };
        if !url.starts_with(&db.url()) {
            return Ok(None);
        }
        let table = url
            .split("table=")
            .nth(1)
            .and_then(|t| t.split('&').next())
            .ok_or("binlog truth: no table in the run's url")?
            .to_owned();
        let mut c = sqlx::MySqlConnection::connect(&db.url())
            .await
            .map_err(|e| format!("binlog truth: connecting: {e}"))?;
        let row = sqlx::query("SHOW MASTER STATUS")
            .fetch_optional(&mut c)
            .await
            .map_err(|e| format!("binlog truth: SHOW MASTER STATUS: {e}"))?
            .ok_or("binlog truth: the private server keeps no binary log")?;
        let file: String = row
            .try_get::<String, _>(0)
            .or_else(|_| {
                row.try_get::<Vec<u8>, _>(0)
                    .map(|b| String::from_utf8_lossy(&b).into())
            })
            .map_err(|e| format!("binlog truth: log file: {e}"))?;
        let position: u64 = row
            .try_get(1)
            .map_err(|e| format!("binlog truth: log position: {e}"))?;
        let _ = c.close().await;
        Ok(Some(BinlogLog {
            target,
            db,
            table,
            file,
            position,
        }))
    }

    /// Decodes the log since the start and checks the run's grants.
    ///
    /// # Errors
    ///
    /// When `mariadb-binlog` fails or prints something unreadable.
    pub async fn finish(self) -> Result<(ServerTruth, Vec<u64>), String> {
        let bin = find_binary(&["mariadb-binlog", "mysqlbinlog"], "MariaDB")
            .map_err(|e| e.to_string())?;
        let mut cmd = tokio::process::Command::new(bin);
        cmd.arg("--read-from-remote-server")
            .arg("--host=127.0.0.1")
            .arg(format!("--port={}", self.db.port()))
            .arg("--user=root")
            .arg("--base64-output=decode-rows")
            .arg("--verbose")
            .arg("--to-last-log")
            .arg(format!("--start-position={}", self.position))
            .arg(&self.file)
            .env("TZ", "UTC")
            .kill_on_drop(true);
        let out = tokio::time::timeout(std::time::Duration::from_secs(120), cmd.output())
            .await
            .map_err(|_| "binlog truth: mariadb-binlog did not finish within 120s".to_owned())?
            .map_err(|e| format!("binlog truth: running mariadb-binlog: {e}"))?;
        if !out.status.success() {
            return Err(format!(
                "binlog truth: mariadb-binlog failed: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
        let text = String::from_utf8_lossy(&out.stdout);
        let rows = parse(&text)?;
        let changes = changes(self.target, &self.table, &rows)?;
        Ok(check(&changes, self.target == Target::MySqlRowLock))
    }
}
