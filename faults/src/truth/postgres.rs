//! PostgreSQL server truth: an audit table written by triggers on the lock
//! tables, in the same transaction as every change they record.
//!
//! Before the clients start, the runner adds to the run's namespace `<t>`
//! an audit table `<t>_audit` and two row triggers (`AFTER INSERT OR UPDATE
//! OR DELETE … FOR EACH ROW`): one on the `lease` table `<t>`, one on the
//! `advisory` holder table `<t>_advisory`. Each audit row carries the
//! changed row's key, owner, token, expiry, hold count and backend pid, the
//! transaction id, `clock_timestamp()` (the server's clock when the trigger
//! ran, after the change was made and before it commits) and the backend
//! that made the change. An audit row commits or rolls back with the change
//! it records, so the audit is exactly the committed history of the lock
//! rows — also across a crash (crash recovery replays both) and a
//! terminated session. Per key, audit rows are in the order of the changes:
//! every change of a key's row holds that row's lock until it commits, and
//! the audit's `seq` is drawn while it is held.
//!
//! Unlike MySQL (see [`crate::truth`]) a trigger disturbs nothing here: the
//! strategies read their verdict from `RETURNING`, which returns the lock
//! row, whatever a trigger writes elsewhere.
//!
//! **`lease`**: a change that puts a new token in a key's row is a grant,
//! from the trigger's clock; a change with the same token moves its end to
//! the row's new `expire_at` (an extension; a release sets `expire_at` to the
//! release statement's clock); a delete (the reaper's) ends it. A grant runs
//! to its last `expire_at`. A takeover is an update whose `WHERE` found the
//! previous lease expired on the server's clock, so a correct store shows
//! each grant starting at or after the previous one's end; a store that
//! granted early shows an overlap.
//!
//! **`advisory`**: the lock itself is a session-level advisory lock, which
//! leaves no trace in any table; its holder row (`<t>_advisory`) is written
//! by the holding backend after it got the lock. A change that puts a new
//! token in the row is a grant, from the trigger's clock; its trigger also
//! asks the lock manager (`pg_locks`, live, not a snapshot) whether the new
//! row's backend holds the key's advisory lock (`holds`: a grant recorded
//! for a backend without the lock vouches for no client), and whether the
//! backend named by the *previous* holder row still holds it (`old_holds`)
//! and still exists (`pg_stat_activity`). A grant ends at the release
//! statement's change of the row (the holder cleared, same token); a grant
//! whose session ended instead (terminated, idle timeout, a broken
//! connection, a crash) leaves no change, and its end is judged at the next
//! grant: before it when `pg_locks` showed the old backend no longer
//! holding the lock, else an overlap. The advisory lock is held without a
//! break from its grant to its unlock or session end, so "the previous
//! holder still holds it when the next grant is recorded" is exactly the
//! overlap. A new grant on the same backend as an unreleased previous one
//! counts as an overlap too: session-level advisory locks stack within a
//! session, so `pg_locks` could not tell a lock taken twice.
//!
//! Every grant a client reported is then matched to the audit on the
//! server's clock (this machine's wall clock; the run's clock is mapped
//! onto it at the start and the end of the run, [`CLOCK_MARGIN_MS`] of
//! slack): its token must be one the audit shows granted — for `advisory`,
//! to a backend holding the lock — after the client asked and before it was
//! told, and no two clients may report the same token.

use std::collections::BTreeMap;

use fenced::postgres::sqlx::{self, AssertSqlSafe, Connection as _, PgConnection, Row as _};

use super::clock::{clock_pair, ClockMap, ClockPair};
use crate::{
    history::{Event, History, Op, Phase, ServerGrant},
    model::Target,
};

/// The slack of the time comparisons between the audit and the run: the
/// run's monotonic clock is mapped onto the wall clock, which the server
/// reads (microseconds) on the same machine.
pub const CLOCK_MARGIN_MS: f64 = 10.0;

fn pg_err(what: &str, e: impl std::fmt::Display) -> String {
    format!("postgres truth: {what}: {e}")
}

/// The server part and the table of a run's URL
/// (`postgres://…/db?strategy=…&table=<t>&…`).
fn split_url(url: &str) -> Result<(&str, &str), String> {
    let (base, query) = url
        .split_once('?')
        .ok_or_else(|| pg_err("no parameters in the run's url", url))?;
    let table = query
        .split('&')
        .find_map(|p| p.strip_prefix("table="))
        .ok_or_else(|| pg_err("no table in the run's url", base))?;
    // The runner's names (`ff_<hex>_<seed>`): nothing to quote or escape.
    if table.is_empty() || !table.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
        return Err(pg_err("unexpected table name", table));
    }
    Ok((base, table))
}

async fn admin(base: &str) -> Result<PgConnection, String> {
    let mut c = PgConnection::connect(base)
        .await
        .map_err(|e| pg_err("connecting", e))?;
    // DDL on the lock tables waits for their locks: never for long.
    sqlx::raw_sql("SET lock_timeout = '10s'")
        .execute(&mut c)
        .await
        .map_err(|e| pg_err("SET lock_timeout", e))?;
    Ok(c)
}

/// The statements that install the audit of table `t` (after the lock
/// tables were migrated).
pub fn install_sql(t: &str) -> Vec<String> {
    // The advisory lock of a holder row, as pg_locks shows a 64-bit key:
    // high half in classid, low half in objid, objsubid 1, this database.
    let held_by = |row: &str| {
        format!(
            "EXISTS (SELECT 1 FROM pg_locks l WHERE l.locktype = 'advisory' AND l.granted \
             AND l.objsubid = 1 AND l.pid = {row}.pid \
             AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database()) \
             AND l.classid = (({row}.hash >> 32) & 4294967295)::oid \
             AND l.objid = ({row}.hash & 4294967295)::oid)"
        )
    };
    let (new_holds, old_holds) = (held_by("NEW"), held_by("OLD"));
    vec![
        format!(
            "CREATE TABLE IF NOT EXISTS \"{t}_audit\" (\
             seq BIGSERIAL PRIMARY KEY, tbl TEXT NOT NULL, op TEXT NOT NULL, \
             lock_key BYTEA NOT NULL, owner BYTEA, token BIGINT, expire_at TIMESTAMPTZ, \
             hold_count INTEGER, pid INTEGER, old_token BIGINT, old_pid INTEGER, \
             txid BIGINT NOT NULL, at TIMESTAMPTZ NOT NULL, backend INTEGER NOT NULL, \
             holds BOOLEAN, old_holds BOOLEAN, old_alive BOOLEAN)"
        ),
        format!(
            "CREATE OR REPLACE FUNCTION \"{t}_audit_lease\"() RETURNS trigger LANGUAGE plpgsql AS $fn$ \
             BEGIN \
               IF TG_OP = 'DELETE' THEN \
                 INSERT INTO \"{t}_audit\" (tbl, op, lock_key, owner, token, expire_at, hold_count, \
                   old_token, txid, at, backend) \
                 VALUES ('lease', TG_OP, OLD.lock_key, OLD.owner, OLD.token, OLD.expire_at, \
                   OLD.reentrant_count, OLD.token, txid_current(), clock_timestamp(), pg_backend_pid()); \
                 RETURN OLD; \
               END IF; \
               INSERT INTO \"{t}_audit\" (tbl, op, lock_key, owner, token, expire_at, hold_count, \
                 old_token, txid, at, backend) \
               VALUES ('lease', TG_OP, NEW.lock_key, NEW.owner, NEW.token, NEW.expire_at, \
                 NEW.reentrant_count, CASE WHEN TG_OP = 'UPDATE' THEN OLD.token END, \
                 txid_current(), clock_timestamp(), pg_backend_pid()); \
               RETURN NEW; \
             END $fn$"
        ),
        format!(
            "CREATE OR REPLACE FUNCTION \"{t}_audit_advisory\"() RETURNS trigger LANGUAGE plpgsql AS $fn$ \
             DECLARE v_holds BOOLEAN; v_old_holds BOOLEAN; v_old_alive BOOLEAN; \
             BEGIN \
               IF TG_OP = 'DELETE' THEN \
                 INSERT INTO \"{t}_audit\" (tbl, op, lock_key, owner, token, expire_at, hold_count, \
                   pid, old_token, old_pid, txid, at, backend) \
                 VALUES ('advisory', TG_OP, OLD.lock_key, OLD.owner, OLD.token, OLD.expire_at, \
                   OLD.reentrant_count, OLD.pid, OLD.token, OLD.pid, txid_current(), clock_timestamp(), \
                   pg_backend_pid()); \
                 RETURN OLD; \
               END IF; \
               IF NEW.pid IS NOT NULL THEN v_holds := {new_holds}; END IF; \
               IF TG_OP = 'UPDATE' AND OLD.pid IS NOT NULL AND OLD.pid IS DISTINCT FROM NEW.pid THEN \
                 v_old_holds := {old_holds}; \
                 v_old_alive := EXISTS (SELECT 1 FROM pg_stat_activity a WHERE a.pid = OLD.pid); \
               END IF; \
               INSERT INTO \"{t}_audit\" (tbl, op, lock_key, owner, token, expire_at, hold_count, \
                 pid, old_token, old_pid, txid, at, backend, holds, old_holds, old_alive) \
               VALUES ('advisory', TG_OP, NEW.lock_key, NEW.owner, NEW.token, NEW.expire_at, \
                 NEW.reentrant_count, NEW.pid, \
                 CASE WHEN TG_OP = 'UPDATE' THEN OLD.token END, \
                 CASE WHEN TG_OP = 'UPDATE' THEN OLD.pid END, \
                 txid_current(), clock_timestamp(), pg_backend_pid(), v_holds, v_old_holds, v_old_alive); \
               RETURN NEW; \
             END $fn$"
        ),
        format!(
            "CREATE TRIGGER \"{t}_audit\" AFTER INSERT OR UPDATE OR DELETE ON \"{t}\" \
             FOR EACH ROW EXECUTE FUNCTION \"{t}_audit_lease\"()"
        ),
        format!(
            "CREATE TRIGGER \"{t}_audit\" AFTER INSERT OR UPDATE OR DELETE \
             ON \"{t}_advisory\" FOR EACH ROW EXECUTE FUNCTION \"{t}_audit_advisory\"()"
        ),
    ]
}

/// The audit of one run, from its start.
#[derive(Debug)]
pub struct AuditLog {
    target: Target,
    base: String,
    table: String,
    history: History,
    start: ClockPair,
}

/// What a finished audit holds: its rows and the clock mapping.
#[derive(Debug, Clone)]
pub struct Record {
    /// The audit rows, in `seq` order.
    pub rows: Vec<AuditRow>,
    /// The run's clock on the wall clock.
    pub clock: ClockMap,
}

/// Which lock table an audit row records.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Table {
    /// `<t>`, the `lease` rows.
    Lease,
    /// `<t>_advisory`, the `advisory` holder rows.
    Advisory,
}

/// One audit row (times in µs since the epoch on the server's clock).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AuditRow {
    /// Order of the changes (per key: the order they were made in).
    pub seq: i64,
    /// The table changed.
    pub table: Table,
    /// `INSERT`, `UPDATE` or `DELETE`.
    pub op: String,
    /// The key (lossy UTF-8).
    pub key: String,
    /// The row's owner after the change (`DELETE`: before).
    pub owner: Option<Vec<u8>>,
    /// The row's token after the change (`DELETE`: before).
    pub token: Option<i64>,
    /// The row's expiry after the change, µs.
    pub expire_us: Option<i64>,
    /// The row's hold count after the change.
    pub hold_count: Option<i32>,
    /// `advisory`: the backend the row names as holder.
    pub pid: Option<i32>,
    /// The token before the change (`UPDATE`, `DELETE`).
    pub old_token: Option<i64>,
    /// `advisory`: the backend named before the change.
    pub old_pid: Option<i32>,
    /// The transaction that made the change.
    pub txid: i64,
    /// The server's clock when the change was recorded, µs.
    pub at_us: i64,
    /// The backend that made the change.
    pub backend: i32,
    /// `advisory`: whether `pid` held the key's advisory lock then.
    pub holds: Option<bool>,
    /// `advisory`: whether `old_pid` (when another backend) still held it.
    pub old_holds: Option<bool>,
    /// `advisory`: whether `old_pid` (when another backend) still existed.
    pub old_alive: Option<bool>,
}

impl AuditLog {
    /// Installs the audit of the run whose URL (straight to the server) is
    /// `url`, after its tables were migrated.
    ///
    /// # Errors
    ///
    /// When the server refuses the table or the triggers.
    pub async fn start(target: Target, url: &str, history: &History) -> Result<AuditLog, String> {
        let (base, table) = split_url(url)?;
        let mut c = admin(base)
            .await
            .map_err(|e| format!("{e}; are the services up? run scripts/services.sh"))?;
        for sql in install_sql(table) {
            sqlx::raw_sql(AssertSqlSafe(sql))
                .execute(&mut c)
                .await
                .map_err(|e| pg_err("installing the audit", e))?;
        }
        let _ = c.close().await;
        Ok(AuditLog {
            target,
            base: base.to_owned(),
            table: table.to_owned(),
            history: history.clone(),
            start: clock_pair(history),
        })
    }

    /// The target whose run this audits.
    pub fn target(&self) -> Target {
        self.target
    }

    /// Reads the audit.
    ///
    /// # Errors
    ///
    /// When it cannot be read.
    pub async fn finish(self) -> Result<Record, String> {
        let end = clock_pair(&self.history);
        let mut c = admin(&self.base).await?;
        let rows = read(&mut c, &self.table).await?;
        let _ = c.close().await;
        Ok(Record {
            rows,
            clock: ClockMap::between(self.start, end),
        })
    }
}

/// Every audit row of table `t`, in `seq` order.
///
/// # Errors
///
/// When the audit cannot be read.
pub async fn read(c: &mut PgConnection, t: &str) -> Result<Vec<AuditRow>, String> {
    let us = |col: &str| format!("(EXTRACT(EPOCH FROM {col}) * 1000000)::BIGINT");
    let rows = sqlx::query(AssertSqlSafe(format!(
        "SELECT seq, tbl, op, lock_key, owner, token, {}, hold_count, pid, old_token, old_pid, \
         txid, {}, backend, holds, old_holds, old_alive FROM \"{t}_audit\" ORDER BY seq",
        us("expire_at"),
        us("at")
    )))
    .fetch_all(&mut *c)
    .await
    .map_err(|e| pg_err("reading the audit", e))?;
    let mut out = Vec::with_capacity(rows.len());
    for r in rows {
        let get_err = |e: sqlx::Error| pg_err("an audit row", e);
        let table: String = r.try_get(1).map_err(get_err)?;
        let key: Vec<u8> = r.try_get(3).map_err(get_err)?;
        out.push(AuditRow {
            seq: r.try_get(0).map_err(get_err)?,
            table: if table == "advisory" {
                Table::Advisory
            } else {
                Table::Lease
            },
            op: r.try_get(2).map_err(get_err)?,
            key: String::from_utf8_lossy(&key).into_owned(),
            owner: r.try_get(4).map_err(get_err)?,
            token: r.try_get(5).map_err(get_err)?,
            expire_us: r.try_get(6).map_err(get_err)?,
            hold_count: r.try_get(7).map_err(get_err)?,
            pid: r.try_get(8).map_err(get_err)?,
            old_token: r.try_get(9).map_err(get_err)?,
            old_pid: r.try_get(10).map_err(get_err)?,
            txid: r.try_get(11).map_err(get_err)?,
            at_us: r.try_get(12).map_err(get_err)?,
            backend: r.try_get(13).map_err(get_err)?,
            holds: r.try_get(14).map_err(get_err)?,
            old_holds: r.try_get(15).map_err(get_err)?,
            old_alive: r.try_get(16).map_err(get_err)?,
        });
    }
    Ok(out)
}

/// A grant rebuilt from the audit (times in µs on the server's clock).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Held {
    /// The key.
    pub key: String,
    /// Its token.
    pub token: u64,
    /// When it was recorded (the grant's start).
    pub from_us: i64,
    /// Its end: the last expiry (`lease`), the release, or — a session
    /// that ended — judged at the next grant (`advisory`).
    pub to_us: i64,
    /// Whether the store really held it for the row's holder: `lease`
    /// always; `advisory` when `pg_locks` showed the row's backend holding
    /// the key's advisory lock.
    pub real: bool,
}

/// `lease` grants: a new token in a key's row starts one; the same token
/// moves its end to the new expiry; a delete ends it.
pub fn lease_grants(rows: &[AuditRow]) -> Vec<Held> {
    let mut open: BTreeMap<&str, Held> = BTreeMap::new();
    let mut out = Vec::new();
    for r in rows.iter().filter(|r| r.table == Table::Lease) {
        let (Some(token), Some(expire)) = (r.token, r.expire_us) else {
            continue;
        };
        let token = token.max(0) as u64;
        if r.op == "DELETE" {
            if let Some(mut g) = open.remove(r.key.as_str()) {
                g.to_us = g.to_us.min(r.at_us).max(g.from_us);
                out.push(g);
            }
            continue;
        }
        match open.get_mut(r.key.as_str()) {
            Some(g) if g.token == token => g.to_us = expire.max(g.from_us),
            _ => {
                let next = Held {
                    key: r.key.clone(),
                    token,
                    from_us: r.at_us,
                    to_us: expire.max(r.at_us),
                    real: true,
                };
                if let Some(prev) = open.insert(r.key.as_str(), next) {
                    out.push(prev);
                }
            }
        }
    }
    out.extend(open.into_values());
    out
}

/// Whether an `advisory` holder row says "nobody holds" after a change
/// that kept its token: the release statement cleared it.
fn cleared(r: &AuditRow) -> bool {
    r.pid.is_none() || r.owner.is_none() || r.hold_count.is_some_and(|n| n <= 0)
}

/// `advisory` grants: a new token in a key's holder row starts one; a
/// change that clears the row with the same token ends it (a release);
/// otherwise the next grant judges its end from what `pg_locks` showed
/// (see the module docs).
pub fn advisory_grants(rows: &[AuditRow]) -> Vec<Held> {
    // The open grant per key, its backend, and whether it has ended.
    let mut open: BTreeMap<&str, (Held, Option<i32>, bool)> = BTreeMap::new();
    let mut out = Vec::new();
    for r in rows.iter().filter(|r| r.table == Table::Advisory) {
        let current = open.get_mut(r.key.as_str());
        if r.op == "DELETE" {
            if let Some((mut g, _, ended)) = open.remove(r.key.as_str()) {
                if !ended {
                    g.to_us = r.at_us.max(g.from_us);
                }
                out.push(g);
            }
            continue;
        }
        let Some(token) = r.token.map(|t| t.max(0) as u64) else {
            // The registry's insert (no holder yet), or a release that
            // cleared the token as well.
            if let Some((g, _, ended)) = current {
                if !*ended && r.old_token.map(|t| t.max(0) as u64) == Some(g.token) {
                    g.to_us = r.at_us.max(g.from_us);
                    *ended = true;
                }
            }
            continue;
        };
        match current {
            Some((g, _, ended)) if g.token == token => {
                if !*ended && cleared(r) {
                    g.to_us = r.at_us.max(g.from_us);
                    *ended = true;
                }
            }
            _ => {
                let next = Held {
                    key: r.key.clone(),
                    token,
                    from_us: r.at_us,
                    to_us: r.at_us,
                    real: r.holds == Some(true),
                };
                if let Some((mut prev, prev_pid, ended)) =
                    open.insert(r.key.as_str(), (next, r.pid, cleared(r)))
                {
                    if !ended {
                        // Ended by its session: before this grant, unless
                        // the lock manager still showed it held (or it is
                        // this very session, where a second lock stacks).
                        let still_held = if prev_pid.is_some() && prev_pid == r.pid {
                            true
                        } else {
                            r.old_holds == Some(true)
                        };
                        prev.to_us = if still_held {
                            r.at_us + 1
                        } else {
                            r.at_us.max(prev.from_us)
                        };
                    }
                    out.push(prev);
                }
            }
        }
    }
    out.extend(open.into_values().map(|(g, _, _)| g));
    out
}

/// The grants of a run's audit, for `target`.
pub fn holds(target: Target, record: &Record) -> Vec<Held> {
    if target == Target::PostgresAdvisory {
        advisory_grants(&record.rows)
    } else {
        lease_grants(&record.rows)
    }
}

/// The grants as [`ServerGrant`]s (µs on the server's clock).
pub fn server_grants(holds: &[Held]) -> Vec<ServerGrant> {
    holds
        .iter()
        .map(|h| ServerGrant {
            key: h.key.clone(),
            token: h.token,
            from: h.from_us.max(0) as u64,
            to: h.to_us.max(h.from_us).max(0) as u64,
        })
        .collect()
}

/// Client grants the audit does not vouch for: no real grant with that
/// token; two clients report it; or it was recorded before the client
/// asked or after the client was told (times on the server's clock,
/// [`CLOCK_MARGIN_MS`] of slack).
pub fn unmatched(events: &[Event], holds: &[Held], clock: &ClockMap) -> usize {
    let by_token: BTreeMap<u64, &Held> = holds.iter().map(|h| (h.token, h)).collect();
    let mut asked: BTreeMap<usize, u64> = BTreeMap::new();
    let mut claimed: BTreeMap<u64, usize> = BTreeMap::new();
    let mut n = 0;
    for e in events {
        match (e.op, e.phase) {
            (Op::Acquire, Phase::Invoke) => {
                asked.insert(e.process, e.t_ns);
            }
            (Op::Acquire, Phase::Ok) => {
                let Some(t) = e.token else { continue };
                let foreign = *claimed.entry(t).or_insert(e.process) != e.process;
                let asked_ms = clock.wall_ms(asked.get(&e.process).copied().unwrap_or(0));
                let told_ms = clock.wall_ms(e.t_ns);
                let vouched = by_token.get(&t).is_some_and(|h| {
                    let from_ms = h.from_us as f64 / 1e3;
                    h.real
                        && from_ms + CLOCK_MARGIN_MS >= asked_ms
                        && from_ms <= told_ms + CLOCK_MARGIN_MS
                });
                if foreign || !vouched {
                    n += 1;
                }
            }
            _ => {}
        }
    }
    n
}

/// Drops a run's tables, sequence, audit and trigger functions.
pub async fn drop_namespace(url: &str) {
    let Ok((base, t)) = split_url(url) else {
        return;
    };
    let Ok(mut c) = admin(base).await else {
        return;
    };
    let _ = sqlx::raw_sql(AssertSqlSafe(format!(
        "DROP TABLE IF EXISTS \"{t}\", \"{t}_advisory\", \"{t}_audit\", \"{t}_migrations\", \
         \"{t}_permits\", \"{t}_permit_keys\" CASCADE; \
         DROP SEQUENCE IF EXISTS \"{t}_token\"; \
         DROP FUNCTION IF EXISTS \"{t}_audit_lease\"(), \"{t}_audit_advisory\"()"
    )))
    .execute(&mut c)
    .await;
    let _ = c.close().await;
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use crate::history::check_server_grants;

    fn row(table: Table, op: &str, token: Option<i64>, at: i64) -> AuditRow {
        AuditRow {
            seq: at,
            table,
            op: op.into(),
            key: "k".into(),
            owner: Some(b"o".to_vec()),
            token,
            expire_us: None,
            hold_count: Some(1),
            pid: None,
            old_token: None,
            old_pid: None,
            txid: at,
            at_us: at,
            backend: 1,
            holds: None,
            old_holds: None,
            old_alive: None,
        }
    }

    fn lease(op: &str, token: i64, at: i64, expire: i64) -> AuditRow {
        AuditRow {
            expire_us: Some(expire),
            ..row(Table::Lease, op, Some(token), at)
        }
    }

    #[test]
    fn lease_grants_run_to_their_last_expiry_and_a_takeover_inside_one_overlaps() {
        let clean = [
            lease("INSERT", 1, 0, 100),
            lease("UPDATE", 1, 50, 150),  // extended
            lease("UPDATE", 1, 80, 80),   // released
            lease("UPDATE", 2, 90, 190),  // next holder
            lease("UPDATE", 3, 190, 290), // takeover after the expiry
        ];
        let g = lease_grants(&clean);
        assert_eq!(g.len(), 3, "{g:?}");
        assert_eq!((g[0].from_us, g[0].to_us), (0, 80));
        let t = check_server_grants(&server_grants(&g));
        assert_eq!((t.overlaps, t.token_regressions), (0, 0), "{g:?}");
        // Taken over while the lease ran, with a smaller token.
        let bad = [lease("INSERT", 5, 0, 100), lease("UPDATE", 4, 50, 150)];
        let t = check_server_grants(&server_grants(&lease_grants(&bad)));
        assert_eq!((t.overlaps, t.token_regressions), (1, 1));
    }

    fn advisory(token: Option<i64>, at: i64, pid: Option<i32>, holds: bool) -> AuditRow {
        AuditRow {
            pid,
            holds: pid.map(|_| holds),
            ..row(Table::Advisory, "UPDATE", token, at)
        }
    }

    #[test]
    fn advisory_grants_end_at_their_release_or_judged_by_the_lock_manager() {
        let mut released = advisory(Some(1), 20, None, false);
        released.old_token = Some(1);
        let mut after_session_end = advisory(Some(2), 30, Some(11), true);
        after_session_end.old_pid = Some(10);
        after_session_end.old_holds = Some(false);
        let mut third = advisory(Some(3), 40, Some(12), true);
        third.old_pid = Some(11);
        third.old_holds = Some(false);
        let rows = [
            advisory(None, 0, None, false), // the registry's insert
            advisory(Some(1), 10, Some(10), true),
            released,
            // pid 10 is named again by the next grant's OLD only if the
            // release kept it; here the release cleared it.
            after_session_end,
            third,
        ];
        let g = advisory_grants(&rows);
        assert_eq!(g.len(), 3, "{g:?}");
        assert_eq!((g[0].from_us, g[0].to_us), (10, 20));
        assert!(g.iter().all(|h| h.real));
        let t = check_server_grants(&server_grants(&g));
        assert_eq!((t.overlaps, t.token_regressions), (0, 0), "{g:?}");

        // The previous holder's backend still held the lock: an overlap.
        let mut next = advisory(Some(2), 30, Some(11), true);
        next.old_pid = Some(10);
        next.old_holds = Some(true);
        let g = advisory_grants(&[advisory(Some(1), 10, Some(10), true), next]);
        assert_eq!(check_server_grants(&server_grants(&g)).overlaps, 1);
        // The same session granted again without a release: stacked.
        let g = advisory_grants(&[
            advisory(Some(1), 10, Some(10), true),
            advisory(Some(2), 30, Some(10), true),
        ]);
        assert_eq!(check_server_grants(&server_grants(&g)).overlaps, 1);
        // A grant recorded for a backend without the lock is not real.
        let g = advisory_grants(&[advisory(Some(1), 10, Some(10), false)]);
        assert!(!g[0].real);
    }

    #[test]
    fn client_grants_must_be_recorded_between_the_ask_and_the_answer() {
        let h = [Held {
            key: "k".into(),
            token: 7,
            from_us: 100_000,
            to_us: 200_000,
            real: true,
        }];
        let clock = ClockMap::fixed(0, 0.0);
        let ev = |process, op, phase, token, ms: u64| Event {
            process,
            op,
            phase,
            key: "k".into(),
            token,
            t_ns: ms * 1_000_000,
            detail: String::new(),
        };
        let fine = [
            ev(0, Op::Acquire, Phase::Invoke, None, 90),
            ev(0, Op::Acquire, Phase::Ok, Some(7), 101),
        ];
        assert_eq!(unmatched(&fine, &h, &clock), 0);
        let late_ask = [
            ev(0, Op::Acquire, Phase::Invoke, None, 150),
            ev(0, Op::Acquire, Phase::Ok, Some(7), 160),
        ];
        assert_eq!(unmatched(&late_ask, &h, &clock), 1);
        let early_answer = [
            ev(0, Op::Acquire, Phase::Invoke, None, 10),
            ev(0, Op::Acquire, Phase::Ok, Some(7), 50),
        ];
        assert_eq!(unmatched(&early_answer, &h, &clock), 1);
        let unknown = [
            ev(0, Op::Acquire, Phase::Invoke, None, 90),
            ev(0, Op::Acquire, Phase::Ok, Some(8), 101),
        ];
        assert_eq!(unmatched(&unknown, &h, &clock), 1);
    }
}
