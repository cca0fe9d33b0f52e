//! Server truth: grants as the store itself recorded them.
//!
//! Per store, the record comes from the server, never from a client:
//!
//! * **SQLite**: triggers on the lock table write an audit row in the same
//!   transaction as every grant, extension and end (release, takeover,
//!   force-release), stamped with the store's own clock;
//! * **Redis** ([`redis`]): a `MONITOR` connection for the whole run records
//!   every state write the lock scripts made, with the server's time and the
//!   arguments of the script that made it;
//! * **etcd** ([`etcd`]): a watch on the run's lock lines from the run's
//!   start revision (with `prev_kv`), lease-expiry deletions included;
//! * **MySQL/MariaDB** ([`binlog`]): the row events of the run's tables in
//!   the binary log of a private MariaDB started with `--log-bin
//!   --binlog-format=ROW` (full profile; see [`binlog`]);
//! * **ZooKeeper** ([`zookeeper`]): the transaction log of a private
//!   ZooKeeper — every create, delete and session end under the run's
//!   namespace, with its zxid and the server's time;
//! * **PostgreSQL** ([`postgres`]): an audit table written by triggers on
//!   the lock tables in the same transaction as every change, stamped with
//!   the server's `clock_timestamp()`; for `advisory` each grant's trigger
//!   also asks `pg_locks` whether the new and the previous holder's
//!   backends hold the key's advisory lock.
//!
//! The grants rebuilt from each record are checked by
//! [`check_server_grants`]: per key no two intersect and tokens strictly
//! increase. Every grant a client reported must also be one the record
//! vouches for ([`ServerTruth::unmatched_client_grants`]).
//!
//! Why not MySQL triggers (PostgreSQL's strategies read `RETURNING`, which
//! a trigger does not change): `unique_key` and `optimistic` read their verdict
//! from the OK packet's insert id (`LAST_INSERT_ID(expr)`), and a trigger
//! that writes a row changes what that packet carries — the audit disturbed
//! what it observed (tokens repeated, grants refused). The binary log is
//! written by the server outside the statement.

pub mod binlog;
mod clock;
pub mod etcd;
pub mod holders;
pub mod postgres;
pub mod redis;
pub mod zookeeper;

use std::collections::BTreeMap;

use sqlx::{AssertSqlSafe, Connection as _, Row as _, SqliteConnection};

use crate::{
    history::{check_server_grants, Event, History, Op, Phase, ServerGrant, ServerTruth},
    model::Target,
};

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

/// The "server truth" method section of RELIABILITY.md.
pub const METHOD: &str = "## Server truth: method\n\n\
Grants are rebuilt from a record the store itself keeps; a client can neither add to it nor hide from it.\n\n\
- **SQLite**: triggers on the lock table write an audit row in the same transaction as every grant, \
extension and end, stamped with SQLite's clock. Grants run from the insert to the earlier of the delete \
and the last expiry.\n\
- **Redis**: a `MONITOR` connection open for the whole run records every command the server executed, \
with the server's time; Redis 7 shows the commands run inside the lock scripts (`[0 lua]`) right after \
the script call and its arguments. Every `SET` of a lock state (`token|count|expiry|…|owner`, expiry in \
server ms) is a fact: a held state with a new token or owner starts a grant at the server time of the \
write; the same token and owner extends it; it ends at its expiry, or earlier only when the script that \
wrote was a release naming that owner and token, a waiter leaving that names the waiter it was handed \
to, or a force release. A script that overwrote or freed a current lease otherwise shows as an overlap.\n\
- **etcd**: a watch on the run's lock lines (`<prefix>\\0lock\\0`) from the run's start revision, with \
`prev_kv`, including lease-expiry deletions; an end marker written under the prefix shows when the \
watch has delivered everything. A grant is an entry from the revision at which it became the oldest \
live entry of its line to the revision that deleted it; its token is its create revision. Overlaps and \
regressions would need etcd to let a younger entry hold while an older one lives, or an entry to \
appear older than the holder; the sharper etcd check is the match: each client grant's token must be \
the create revision of an entry that held, and that entry must not have been deleted (as the watch saw \
it) before the client sent its acquire.\n\
- **MySQL/MariaDB**: the shared server keeps no binary log (`log_bin` off), so the MySQL cells run \
against a private MariaDB 10.11 started with `--log-bin --binlog-format=ROW \
--binlog-annotate-row-events` (one per process, fresh data directory). After each run \
`mariadb-binlog --read-from-remote-server --base64-output=decode-rows -v` decodes every row change \
committed since the run started, with the statement that made it. `unique_key`: an inserted row is a \
grant, a delete ends it in commit order (the unique key keeps a second row out until then); a delete \
by a statement that deletes *expired* rows only counts as an overlap when the row's expiry is at or \
after the end of the second in which that statement ran (row events carry whole seconds only). \
`optimistic`: an update that sets a holder and a new version is a grant from its statement's \
`UTC_TIMESTAMP(6)` (new expiry − the statement's TTL); clearing the holder ends it; a new holder \
while the previous one's expiry is after that start is an overlap. Tokens must rise in commit order. **`row_lock` overlaps are n/a**: its lock is an InnoDB \
row lock of an open transaction — taking it writes nothing, and a dead holder's rollback \
(connection cut, `wait_timeout`) frees it without a trace in the log, so the log cannot say when a \
row_lock grant ended, and a release writes nothing. Its grants are the rows its one-statement \
acquire `REPLACE`s into the `MEMORY` table `<t>_live` (logged as the old row's delete and the new \
row's insert, whose AUTO_INCREMENT id is the token): tokens are checked for regressions in commit \
order and matched against the clients.\n\
- **ZooKeeper**: the cells run against a private standalone ZooKeeper (tickTime 500 ms) whose data \
directory the runner owns; after each run its transaction log — every change the \
server committed, fsynced before the client heard back, with its zxid, session and the server's time \
— is read up to an end marker the recorder creates. fenced-zookeeper's queue of a key is the \
ephemeral sequential children of one container node; the live child with the lowest sequence holds \
and its creation zxid is the token. A grant is a child from the zxid at which it became the lowest \
live child (its create, or the delete or session end — close or expiry — that removed the one before \
it) to the zxid that removed it. Overlaps and regressions would need a child to jump the queue (a \
sequence below a live holder's). The match is sharper than etcd's, on the server's clock (the log's \
milliseconds, the run's clock mapped onto the same machine's wall clock, 10 ms of slack): each \
client grant's token must be the creation zxid of a child that held, created after the client asked \
(every attempt creates its own child) and made the holder before the client was told it holds.\n\
- **PostgreSQL**: before the clients start, the runner adds an audit table `<t>_audit` to the run's \
namespace and row triggers (`AFTER INSERT OR UPDATE OR DELETE`) on the `lease` table `<t>` and the \
`advisory` holder table `<t>_advisory`; each writes the changed row (key, owner, token, expiry, hold \
count, holder pid), the transaction id, the backend and `clock_timestamp()`, in the transaction of the \
change, so the audit is the committed history of the lock rows — across a crash and a terminated \
session too (the server-fault cells keep their record on PostgreSQL). The strategies read their \
verdict from `RETURNING`, which a trigger does not change. Per key the audit is in the order of the \
changes (each holds the row's lock until it commits). `lease`: a new token in a key's row is a grant \
from the trigger's clock; the same token moves its end to the row's new expiry (a renewal, or a \
release, which expires the row at its own clock); it runs to its last expiry, and a takeover that \
starts before it ends is an overlap. `advisory`: the lock is a session-level advisory lock, which no \
table records; the holder row is written by the holding backend after it got the lock. A new token in \
it is a grant from the trigger's clock, and the trigger asks the lock manager (`pg_locks`) whether the \
new row's backend holds the key's advisory lock (if not, the grant vouches for no client) and whether \
the previous row's backend still holds it. A grant ends at the release statement's change of the row \
(holder cleared, same token). A session that ended instead (terminated, idle timeout, broken \
connection, crash) leaves no row change: its grant's end is judged at the next grant — before it when \
`pg_locks` showed the old backend no longer holding the lock (the lock is held without a break from \
grant to unlock or session end, so this is exactly the overlap question), an overlap when it still \
held it or when the new grant is on the same backend without a release in between (session locks \
stack). Client grants are matched on the server's clock (this machine's wall clock; 10 ms of slack): \
the token's grant must be recorded after the client asked and before it was told.\n\
- **Unvouched client grants** (every store): a client's reported token must be one the record \
shows granted, and no two clients may report the same token.\n\
- The checkers can fail: each has unit tests feeding it a crafted overlapping or regressing record \
(`cargo test -p fenced-faults --lib truth`).\n";

/// The server-side record of one run, started before the clients and
/// read after the liveness check.
#[derive(Debug)]
pub enum Recorder {
    /// SQLite audit triggers.
    Sqlite(Audit),
    /// Redis `MONITOR`.
    Redis(Box<redis::Monitor>),
    /// etcd watch history.
    Etcd(Box<etcd::WatchLog>),
    /// MariaDB binary log (full profile).
    Binlog(binlog::BinlogLog),
    /// ZooKeeper transaction log (private server).
    ZooKeeper(Box<zookeeper::TxnLog>),
    /// PostgreSQL audit triggers.
    Postgres(Box<postgres::AuditLog>),
    /// The family cells: the store's list of a key's holders, sampled.
    Holders(Box<holders::Sampler>),
    /// No record for this run, and why.
    None(&'static str),
}

/// Why a MySQL run on the shared server has no server truth.
pub const MYSQL_SHARED_REASON: &str =
    "the run used the shared MariaDB, which keeps no binary log (hold truth::binlog::private_server() while running)";

/// The key prefix and the server part of a Redis URL.
fn redis_prefix(url: &str) -> Result<(&str, &str), String> {
    let prefix = url
        .split("prefix=")
        .nth(1)
        .and_then(|p| p.split('&').next())
        .ok_or("redis truth: no prefix in the run's url")?;
    Ok((prefix, url.split('?').next().unwrap_or(url)))
}

impl Recorder {
    /// Starts recording the run of `target` whose admin URL (straight to the
    /// store, no proxy) is `url`, on the lock `key`.
    ///
    /// # Errors
    ///
    /// When the store cannot be reached (naming `scripts/services.sh`).
    pub async fn start(
        target: Target,
        url: &str,
        key: &str,
        dir: &std::path::Path,
        history: &History,
    ) -> Result<Recorder, String> {
        match target {
            Target::Sqlite => {
                let a = Audit::Sqlite {
                    path: dir.join("faults.db").display().to_string(),
                    table: "fenced_locks".into(),
                };
                a.install().await?;
                Ok(Recorder::Sqlite(a))
            }
            Target::Redis => {
                let (prefix, base) = redis_prefix(url)?;
                Ok(Recorder::Redis(Box::new(
                    redis::Monitor::start(base, &format!("{{{prefix}/")).await?,
                )))
            }
            Target::Etcd => {
                let rest = url.split_once("://").map_or(url, |(_, r)| r);
                let (hosts, prefix) = rest
                    .split_once('/')
                    .ok_or_else(|| "etcd truth: no prefix in the run's url".to_owned())?;
                let prefix = prefix.split('?').next().unwrap_or(prefix);
                let endpoint = format!("http://{}", hosts.split(',').next().unwrap_or(hosts));
                Ok(Recorder::Etcd(Box::new(
                    etcd::WatchLog::start(&endpoint, prefix, history).await?,
                )))
            }
            Target::MySqlUniqueKey | Target::MySqlOptimistic | Target::MySqlRowLock => {
                match binlog::BinlogLog::start(target, url).await? {
                    Some(b) => Ok(Recorder::Binlog(b)),
                    None => Ok(Recorder::None(MYSQL_SHARED_REASON)),
                }
            }
            Target::ZooKeeper => match zookeeper::TxnLog::start(url, history)? {
                Some(log) => Ok(Recorder::ZooKeeper(Box::new(log))),
                None => Ok(Recorder::None(zookeeper::SHARED_REASON)),
            },
            Target::PostgresLease | Target::PostgresAdvisory => Ok(Recorder::Postgres(Box::new(
                postgres::AuditLog::start(target, url, history).await?,
            ))),
            // MONITOR on the primary that serves the lock's slot: every
            // script on the lock runs there (the cells that move the slot,
            // the failover, record nothing, as other server faults).
            Target::RedisCluster => {
                let (prefix, base) = redis_prefix(url)?;
                let node = redis::slot_node(base, &format!("{{{prefix}/{key}}}:l")).await?;
                Ok(Recorder::Redis(Box::new(
                    redis::Monitor::start(&format!("redis://{node}"), &format!("{{{prefix}/"))
                        .await?,
                )))
            }
            // MONITOR on the primary the sentinel names (the failover, a
            // server fault, records nothing, as other server faults).
            Target::RedisSentinel => {
                let (prefix, base) = redis_prefix(url)?;
                let primary = redis::sentinel_primary(base).await?;
                Ok(Recorder::Redis(Box::new(
                    redis::Monitor::start(&format!("redis://{primary}"), &format!("{{{prefix}/"))
                        .await?,
                )))
            }
        }
    }

    /// Reads the record and checks it against itself and the clients'
    /// reported grants (`None`: no record, see [`Recorder::None`]).
    ///
    /// # Errors
    ///
    /// When the record cannot be read completely.
    pub async fn finish(self, events: &[Event]) -> Result<Option<ServerTruth>, String> {
        if let Recorder::Binlog(b) = self {
            let (mut t, tokens) = b.finish().await?;
            let granted: Vec<ServerGrant> = tokens
                .into_iter()
                .map(|token| ServerGrant {
                    key: String::new(),
                    token,
                    from: 0,
                    to: 0,
                })
                .collect();
            t.unmatched_client_grants = unmatched_tokens(events, &granted);
            return Ok(Some(t));
        }
        let (grants, unmatched) = match self {
            Recorder::None(_) => return Ok(None),
            Recorder::Holders(s) => return s.finish(events).await.map(Some),
            Recorder::Sqlite(a) => {
                let g = a.grants().await?;
                let u = unmatched_tokens(events, &g);
                (g, u)
            }
            Recorder::Redis(m) => {
                let g = redis::grants(&m.finish().await?)?;
                let u = unmatched_tokens(events, &g);
                (g, u)
            }
            Recorder::Etcd(w) => {
                let h = etcd::holds(&w.finish().await?);
                let u = etcd::unmatched(events, &h);
                (etcd::server_grants(&h), u)
            }
            Recorder::ZooKeeper(log) => {
                let record = log.finish().await?;
                let h = zookeeper::holds(&record);
                let u = zookeeper::unmatched(events, &h, &record.clock);
                (zookeeper::server_grants(&h), u)
            }
            Recorder::Postgres(log) => {
                let target = log.target();
                let record = log.finish().await?;
                let h = postgres::holds(target, &record);
                let u = postgres::unmatched(events, &h, &record.clock);
                (postgres::server_grants(&h), u)
            }
            Recorder::Binlog(_) => return Ok(None),
        };
        let mut t = check_server_grants(&grants);
        t.unmatched_client_grants = unmatched;
        Ok(Some(t))
    }
}

/// Client grants whose token the store never granted, plus tokens two
/// different clients both reported (each client has its own owner, so one
/// grant can only ever be one client's).
pub fn unmatched_tokens(events: &[Event], grants: &[ServerGrant]) -> usize {
    let granted: std::collections::BTreeSet<u64> = grants.iter().map(|g| g.token).collect();
    let mut claimed: BTreeMap<u64, usize> = BTreeMap::new();
    let mut n = 0;
    for e in events {
        if let (Op::Acquire, Phase::Ok, Some(t)) = (e.op, e.phase, e.token) {
            let foreign = *claimed.entry(t).or_insert(e.process) != e.process;
            if !granted.contains(&t) || foreign {
                n += 1;
            }
        }
    }
    n
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
    fn client_grants_the_store_never_made_or_made_to_another_are_unmatched() {
        let g = rebuild(&[ev("grant", 1, 0, 100), ev("grant", 2, 100, 200)]);
        let acq = |process, token| Event {
            process,
            op: Op::Acquire,
            phase: Phase::Ok,
            key: "k".into(),
            token: Some(token),
            t_ns: 0,
            detail: String::new(),
        };
        assert_eq!(unmatched_tokens(&[acq(0, 1), acq(1, 2)], &g), 0);
        assert_eq!(unmatched_tokens(&[acq(0, 1), acq(1, 1), acq(2, 3)], &g), 2);
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
