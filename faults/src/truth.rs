//! Server truth: grants as the store itself recorded them.
//!
//! For the SQL stores, triggers on the lock table write an audit row in the
//! same transaction as every grant, extension and end (release, takeover,
//! force-release), stamped with the store's own clock. The grants rebuilt
//! from that audit are checked by
//! [`check_server_grants`](crate::history::check_server_grants): per key no
//! two intersect and tokens strictly increase. Clients cannot influence the
//! audit: it is what the database committed.
//!
//! Implemented for SQLite; the other stores report "not collected" until
//! their audit exists (see RELIABILITY.md). The same triggers on the MySQL
//! tables were tried and dropped: `unique_key` and `optimistic` read their
//! verdict from the OK packet's insert id (`LAST_INSERT_ID(expr)`), and a
//! trigger that writes a row changes what that packet carries — the audit
//! disturbed what it observed (tokens repeated, grants refused). A MySQL
//! audit must come from outside the statement (the binary log).

use std::collections::BTreeMap;

use sqlx::{AssertSqlSafe, Connection as _, Row as _, SqliteConnection};

use crate::history::ServerGrant;

/// The SQLite clock the backend uses for its own times (µs since the epoch).
const SQLITE_NOW: &str = "(CAST(ROUND(unixepoch('subsec') * 1000) AS INTEGER) * 1000)";

/// Where a run's audit lives.
#[derive(Debug, Clone)]
pub enum Audit {
    /// A SQLite file and the lock table in it.
    Sqlite {
        /// The database file.
        path: String,
        /// The lock table.
        table: String,
    },
}

fn sql_err(what: &str, e: sqlx::Error) -> String {
    format!("server-truth audit: {what}: {e}")
}

impl Audit {
    /// Creates the audit table and the triggers (after the lock table was
    /// migrated).
    ///
    /// # Errors
    ///
    /// When the store refuses them.
    pub async fn install(&self) -> Result<(), String> {
        match self {
            Audit::Sqlite { path, table } => {
                let mut c = SqliteConnection::connect(&format!("sqlite://{path}"))
                    .await
                    .map_err(|e| sql_err("connect", e))?;
                let stmts = [
                    format!(
                        "CREATE TABLE IF NOT EXISTS \"{table}_audit\" (seq INTEGER PRIMARY KEY AUTOINCREMENT, \
                         ev TEXT NOT NULL, lock_key BLOB NOT NULL, id INTEGER NOT NULL, at INTEGER NOT NULL, \
                         expire_at INTEGER NOT NULL)"
                    ),
                    format!(
                        "CREATE TRIGGER IF NOT EXISTS \"{table}_audit_grant\" AFTER INSERT ON \"{table}\" BEGIN \
                         INSERT INTO \"{table}_audit\" (ev, lock_key, id, at, expire_at) \
                         VALUES ('grant', NEW.lock_key, NEW.id, {SQLITE_NOW}, NEW.expire_at); END"
                    ),
                    format!(
                        "CREATE TRIGGER IF NOT EXISTS \"{table}_audit_extend\" AFTER UPDATE ON \"{table}\" BEGIN \
                         INSERT INTO \"{table}_audit\" (ev, lock_key, id, at, expire_at) \
                         VALUES ('extend', NEW.lock_key, NEW.id, {SQLITE_NOW}, NEW.expire_at); END"
                    ),
                    format!(
                        "CREATE TRIGGER IF NOT EXISTS \"{table}_audit_end\" AFTER DELETE ON \"{table}\" BEGIN \
                         INSERT INTO \"{table}_audit\" (ev, lock_key, id, at, expire_at) \
                         VALUES ('end', OLD.lock_key, OLD.id, {SQLITE_NOW}, OLD.expire_at); END"
                    ),
                ];
                for s in stmts {
                    sqlx::query(AssertSqlSafe(s))
                        .execute(&mut c)
                        .await
                        .map_err(|e| sql_err("install", e))?;
                }
                Ok(())
            }
        }
    }

    /// The grants the store recorded, rebuilt from the audit: each runs from
    /// its grant to the earlier of its end and its last expiry.
    ///
    /// # Errors
    ///
    /// When the audit cannot be read.
    pub async fn grants(&self) -> Result<Vec<ServerGrant>, String> {
        match self {
            Audit::Sqlite { path, table } => {
                let mut c = SqliteConnection::connect(&format!("sqlite://{path}"))
                    .await
                    .map_err(|e| sql_err("connect", e))?;
                let rows = sqlx::query(AssertSqlSafe(format!(
                    "SELECT ev, lock_key, id, at, expire_at FROM \"{table}_audit\" ORDER BY seq"
                )))
                .fetch_all(&mut c)
                .await
                .map_err(|e| sql_err("read", e))?;
                let mut events = Vec::with_capacity(rows.len());
                for r in rows {
                    let key: Vec<u8> = r.try_get(1).map_err(|e| sql_err("row", e))?;
                    events.push(AuditEvent {
                        ev: r.try_get(0).map_err(|e| sql_err("row", e))?,
                        key: String::from_utf8_lossy(&key).into_owned(),
                        id: r.try_get(2).map_err(|e| sql_err("row", e))?,
                        at: r.try_get(3).map_err(|e| sql_err("row", e))?,
                        expire_at: r.try_get(4).map_err(|e| sql_err("row", e))?,
                    });
                }
                Ok(rebuild(&events))
            }
        }
    }
}

/// One audit row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AuditEvent {
    /// `grant`, `extend` or `end`.
    pub ev: String,
    /// The key.
    pub key: String,
    /// The row id (the fencing token).
    pub id: i64,
    /// When, on the store's clock.
    pub at: i64,
    /// The row's expiry after the event.
    pub expire_at: i64,
}

/// Grants from audit events: from the grant to min(end, last expiry); a
/// grant never ended runs to its last expiry.
pub fn rebuild(events: &[AuditEvent]) -> Vec<ServerGrant> {
    let mut open: BTreeMap<(String, i64), (i64, i64)> = BTreeMap::new();
    let mut out = Vec::new();
    let grant = |key: &str, id: i64, from: i64, to: i64| ServerGrant {
        key: key.to_owned(),
        token: id.max(0) as u64,
        from: from.max(0) as u64,
        to: to.max(from).max(0) as u64,
    };
    for e in events {
        let k = (e.key.clone(), e.id);
        match e.ev.as_str() {
            "grant" => {
                open.insert(k, (e.at, e.expire_at));
            }
            "extend" => {
                if let Some(g) = open.get_mut(&k) {
                    g.1 = e.expire_at;
                }
            }
            _ => {
                if let Some((from, exp)) = open.remove(&k) {
                    out.push(grant(&e.key, e.id, from, exp.min(e.at)));
                }
            }
        }
    }
    for ((key, id), (from, exp)) in open {
        out.push(grant(&key, id, from, exp));
    }
    out
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use crate::history::check_server_grants;

    fn ev(ev: &str, id: i64, at: i64, expire_at: i64) -> AuditEvent {
        AuditEvent {
            ev: ev.into(),
            key: "k".into(),
            id,
            at,
            expire_at,
        }
    }

    #[test]
    fn release_takeover_and_extension_rebuild_into_disjoint_grants() {
        let events = [
            ev("grant", 1, 0, 100),
            ev("extend", 1, 50, 200),
            ev("end", 1, 120, 200), // released at 120
            ev("grant", 2, 130, 230),
            ev("end", 2, 260, 230), // taken over after expiry at 230
            ev("grant", 3, 260, 360),
        ];
        let g = rebuild(&events);
        assert_eq!(g.len(), 3);
        let t = check_server_grants(&g);
        assert_eq!((t.overlaps, t.token_regressions), (0, 0), "{g:?}");
    }

    #[test]
    fn a_grant_inside_another_is_an_overlap() {
        let events = [
            ev("grant", 1, 0, 100),
            ev("grant", 2, 50, 150),
            ev("end", 1, 60, 100),
            ev("end", 2, 70, 150),
        ];
        let t = check_server_grants(&rebuild(&events));
        assert_eq!(t.overlaps, 1);
    }
}
