//! The PostgreSQL floors and peers, each on one connection per task (its
//! own `PgConnection`, no pool): `SELECT 1`, a durable commit, a raw
//! advisory lock pair, sqlx's own `PgAdvisoryLock`, and ShedLock's
//! statements. None of them
//! fences: no token, nothing survives the holder's session but ShedLock's
//! row.

use std::collections::{HashMap, HashSet};

use async_trait::async_trait;
use sqlx::{
    postgres::{PgAdvisoryLock, PgAdvisoryLockGuard},
    Connection, PgConnection, Row,
};
use tokio::time::Instant;

use super::{PeerKind, PEER_TTL};
use crate::{runner::Locker, stats::Servers, BenchError};

async fn connect(servers: &Servers) -> Result<PgConnection, BenchError> {
    PgConnection::connect(&servers.postgres).await.map_err(|e| {
        BenchError::new(format!(
            "postgres: cannot connect (is it up? scripts/services.sh): {e}"
        ))
    })
}

fn err(e: sqlx::Error) -> BenchError {
    BenchError::new(format!("postgres: {e}"))
}

/// The ShedLock table of the run `id`.
pub(super) fn shedlock_table(id: &str) -> String {
    format!("fb_{id}_shedlock")
}

/// The table of the durable-commit floor of the run `id`.
pub(super) fn commit_table(id: &str) -> String {
    format!("fb_{id}_commit")
}

pub(super) async fn locker(
    kind: PeerKind,
    servers: &Servers,
    id: &str,
) -> Result<Box<dyn Locker>, BenchError> {
    let mut conn = connect(servers).await?;
    let prefix = format!("fb{id}-");
    Ok(match kind {
        PeerKind::PgSelect1 => Box::new(Select1 { conn }),
        PeerKind::PgCommit => {
            let table = commit_table(id);
            let row = uuid::Uuid::new_v4().simple().to_string();
            create_table(
                &mut conn,
                &format!("\"{table}\" (id TEXT PRIMARY KEY, n BIGINT NOT NULL)"),
            )
            .await?;
            sqlx::raw_sql("SET synchronous_commit = on")
                .execute(&mut conn)
                .await
                .map_err(err)?;
            sqlx::query(sqlx::AssertSqlSafe(format!(
                "INSERT INTO \"{table}\" (id, n) VALUES ($1, 0)"
            )))
            .bind(&row)
            .execute(&mut conn)
            .await
            .map_err(err)?;
            Box::new(Commit {
                conn,
                update: format!("UPDATE \"{table}\" SET n = n + 1 WHERE id = $1"),
                row,
            })
        }
        PeerKind::PgAdvisory => Box::new(RawAdvisory {
            conn: Some(conn),
            servers: servers.clone(),
            prefix,
            held: HashMap::new(),
        }),
        PeerKind::PgAdvisoryFamily => Box::new(AdvisoryFamily {
            conn: Some(conn),
            servers: servers.clone(),
            prefix,
            held: HashMap::new(),
            slot: 0,
        }),
        PeerKind::SqlxAdvisory => Box::new(SqlxAdvisory {
            state: SqlxState::Idle(conn),
            servers: servers.clone(),
            prefix,
            locks: HashMap::new(),
        }),
        _ => {
            let table = shedlock_table(id);
            // ShedLock's documented table for PostgreSQL.
            create_table(
                &mut conn,
                &format!(
                    "\"{table}\" (name VARCHAR(64) NOT NULL, lock_until TIMESTAMP NOT NULL, \
                     locked_at TIMESTAMP NOT NULL, locked_by VARCHAR(255) NOT NULL, \
                     PRIMARY KEY (name))"
                ),
            )
            .await?;
            Box::new(ShedLock::new(conn, &table))
        }
    })
}

/// `CREATE TABLE IF NOT EXISTS <definition>`, one session at a time: the
/// lockers of a cross-process cell start together, and two concurrent
/// `CREATE TABLE IF NOT EXISTS` of one name make one of them fail (a unique
/// violation in `pg_type`). The statements run as one implicit
/// transaction, which holds the advisory lock until it commits.
async fn create_table(conn: &mut PgConnection, definition: &str) -> Result<(), BenchError> {
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "SELECT pg_advisory_xact_lock(hashtext('fenced-bench: create table')); \
         CREATE TABLE IF NOT EXISTS {definition}"
    )))
    .execute(conn)
    .await
    .map_err(err)?;
    Ok(())
}

/// The PostgreSQL floor: acquire = one `SELECT 1`, release = one `SELECT 1`
/// (prepared once, then Bind/Execute/Sync: one round trip each).
struct Select1 {
    conn: PgConnection,
}

#[async_trait]
impl Locker for Select1 {
    async fn acquire(&mut self, _: &str, _: Instant) -> Result<bool, BenchError> {
        sqlx::query("SELECT 1")
            .execute(&mut self.conn)
            .await
            .map_err(err)?;
        Ok(true)
    }
    async fn release(&mut self, _: &str) -> Result<(), BenchError> {
        sqlx::query("SELECT 1")
            .execute(&mut self.conn)
            .await
            .map_err(err)?;
        Ok(())
    }
}

/// The durable-commit floor: acquire = one autocommit `UPDATE` of the
/// task's own row (an xid, so the commit waits for the WAL flush; no row
/// lock shared with anyone), release = one `SELECT 1`.
struct Commit {
    conn: PgConnection,
    update: String,
    row: String,
}

#[async_trait]
impl Locker for Commit {
    async fn acquire(&mut self, _: &str, _: Instant) -> Result<bool, BenchError> {
        sqlx::query(sqlx::AssertSqlSafe(self.update.clone()))
            .bind(&self.row)
            .execute(&mut self.conn)
            .await
            .map_err(err)?;
        Ok(true)
    }
    async fn release(&mut self, _: &str) -> Result<(), BenchError> {
        sqlx::query("SELECT 1")
            .execute(&mut self.conn)
            .await
            .map_err(err)?;
        Ok(())
    }
}

/// The 64-bit advisory key of `key`: FNV-1a over the run's prefix and the
/// key, as a signed `bigint`.
fn advisory_key(prefix: &str, key: &str) -> i64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in prefix.bytes().chain(key.bytes()) {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    i64::from_ne_bytes(h.to_ne_bytes())
}

/// The raw advisory lock pair: `pg_try_advisory_lock(k)`, and when it is
/// refused `pg_advisory_lock(k)` (the server's queue) until the wait bound;
/// `pg_advisory_unlock(k)`. A wait given up closes the connection (its
/// backend leaves the queue; the next acquire reconnects).
struct RawAdvisory {
    conn: Option<PgConnection>,
    servers: Servers,
    prefix: String,
    held: HashMap<String, i64>,
}

impl RawAdvisory {
    async fn conn(&mut self) -> Result<&mut PgConnection, BenchError> {
        if self.conn.is_none() {
            self.conn = Some(connect(&self.servers).await?);
        }
        self.conn
            .as_mut()
            .ok_or_else(|| BenchError::new("postgres: no connection"))
    }
}

#[async_trait]
impl Locker for RawAdvisory {
    async fn acquire(&mut self, key: &str, give_up: Instant) -> Result<bool, BenchError> {
        let k = advisory_key(&self.prefix, key);
        let conn = self.conn().await?;
        let row = sqlx::query("SELECT pg_try_advisory_lock($1)")
            .bind(k)
            .fetch_one(&mut *conn)
            .await
            .map_err(err)?;
        if !row.try_get::<bool, _>(0).map_err(err)? {
            let wait = sqlx::query("SELECT pg_advisory_lock($1)")
                .bind(k)
                .execute(&mut *conn);
            match tokio::time::timeout_at(give_up, wait).await {
                Ok(done) => {
                    done.map_err(err)?;
                }
                Err(_) => {
                    self.conn = None;
                    return Ok(false);
                }
            }
        }
        self.held.insert(key.to_owned(), k);
        Ok(true)
    }

    async fn release(&mut self, key: &str) -> Result<(), BenchError> {
        let k = crate::runner::take_held(&mut self.held, key)?;
        let conn = self.conn().await?;
        let row = sqlx::query("SELECT pg_advisory_unlock($1)")
            .bind(k)
            .fetch_one(conn)
            .await
            .map_err(err)?;
        if row.try_get::<bool, _>(0).map_err(err)? {
            Ok(())
        } else {
            Err(BenchError::new("pg_advisory_unlock: the lock was not held"))
        }
    }
}

/// Semaphores and reader-writer locks from advisory locks (see the peer's
/// note). A wait given up closes the connection, as [`RawAdvisory`]'s.
struct AdvisoryFamily {
    conn: Option<PgConnection>,
    servers: Servers,
    prefix: String,
    /// Key → (advisory key, shared).
    held: HashMap<String, (i64, bool)>,
    /// The slot this task waits on when every slot is taken.
    slot: u32,
}

impl AdvisoryFamily {
    async fn conn(&mut self) -> Result<&mut PgConnection, BenchError> {
        if self.conn.is_none() {
            self.conn = Some(connect(&self.servers).await?);
        }
        self.conn
            .as_mut()
            .ok_or_else(|| BenchError::new("postgres: no connection"))
    }

    async fn try_lock(&mut self, k: i64) -> Result<bool, BenchError> {
        let conn = self.conn().await?;
        let row = sqlx::query("SELECT pg_try_advisory_lock($1)")
            .bind(k)
            .fetch_one(conn)
            .await
            .map_err(err)?;
        row.try_get::<bool, _>(0).map_err(err)
    }

    /// Runs a blocking lock statement until `give_up`; `false` when it gave up.
    async fn wait(
        &mut self,
        sql: &'static str,
        k: i64,
        give_up: Instant,
    ) -> Result<bool, BenchError> {
        let conn = self.conn().await?;
        let wait = sqlx::query(sql).bind(k).execute(conn);
        match tokio::time::timeout_at(give_up, wait).await {
            Ok(done) => {
                done.map_err(err)?;
                Ok(true)
            }
            Err(_) => {
                self.conn = None;
                Ok(false)
            }
        }
    }
}

#[async_trait]
impl Locker for AdvisoryFamily {
    async fn acquire(&mut self, key: &str, give_up: Instant) -> Result<bool, BenchError> {
        self.acquire_as(key, crate::runner::Role::Write, give_up)
            .await
    }

    async fn acquire_as(
        &mut self,
        key: &str,
        role: crate::runner::Role,
        give_up: Instant,
    ) -> Result<bool, BenchError> {
        use crate::runner::Role;
        let base = advisory_key(&self.prefix, key);
        let (k, shared) = match role {
            Role::Permit(n) => {
                let n = n.max(1);
                for i in 0..n {
                    let k = base.wrapping_add(i64::from(i));
                    if self.try_lock(k).await? {
                        self.held.insert(key.to_owned(), (k, false));
                        return Ok(true);
                    }
                }
                self.slot = (self.slot + 1) % n;
                (base.wrapping_add(i64::from(self.slot)), false)
            }
            Role::Read => (base, true),
            Role::Write => (base, false),
        };
        let sql = if shared {
            "SELECT pg_advisory_lock_shared($1)"
        } else {
            "SELECT pg_advisory_lock($1)"
        };
        if !self.wait(sql, k, give_up).await? {
            return Ok(false);
        }
        self.held.insert(key.to_owned(), (k, shared));
        Ok(true)
    }

    async fn release(&mut self, key: &str) -> Result<(), BenchError> {
        let (k, shared) = crate::runner::take_held(&mut self.held, key)?;
        let sql = if shared {
            "SELECT pg_advisory_unlock_shared($1)"
        } else {
            "SELECT pg_advisory_unlock($1)"
        };
        let conn = self.conn().await?;
        let row = sqlx::query(sql)
            .bind(k)
            .fetch_one(conn)
            .await
            .map_err(err)?;
        if row.try_get::<bool, _>(0).map_err(err)? {
            Ok(())
        } else {
            Err(BenchError::new("advisory unlock: the lock was not held"))
        }
    }
}

/// What sqlx's guard owns: the connection, while the lock is held.
enum SqlxState {
    Idle(PgConnection),
    Held(String, PgAdvisoryLockGuard<PgConnection>),
    /// Closed by a wait given up, or lost to an error: reconnect.
    Gone,
}

/// sqlx's `PgAdvisoryLock` as documented: `PgAdvisoryLock::new(name)` (the
/// key from HKDF-SHA256 of the name), `acquire(conn)` — `SELECT
/// pg_advisory_lock($1)`, waiting in the server's queue, prepared on first
/// use — giving a guard that owns the connection, and
/// `guard.release_now()` — `SELECT pg_advisory_unlock($1)` — giving it
/// back. The wait is bounded by dropping the future (the crate documents
/// `acquire` as cancel safe), which drops the connection with it.
struct SqlxAdvisory {
    state: SqlxState,
    servers: Servers,
    prefix: String,
    locks: HashMap<String, PgAdvisoryLock>,
}

#[async_trait]
impl Locker for SqlxAdvisory {
    async fn acquire(&mut self, key: &str, give_up: Instant) -> Result<bool, BenchError> {
        let conn = match std::mem::replace(&mut self.state, SqlxState::Gone) {
            SqlxState::Idle(c) => c,
            SqlxState::Gone => connect(&self.servers).await?,
            held @ SqlxState::Held(..) => {
                self.state = held;
                return Err(BenchError::new(
                    "sqlx advisory: this task already holds a lock",
                ));
            }
        };
        let lock = self
            .locks
            .entry(key.to_owned())
            .or_insert_with(|| PgAdvisoryLock::new(format!("{}{key}", self.prefix)));
        match tokio::time::timeout_at(give_up, lock.acquire(conn)).await {
            Ok(Ok(guard)) => {
                self.state = SqlxState::Held(key.to_owned(), guard);
                Ok(true)
            }
            Ok(Err(e)) => Err(err(e)),
            Err(_) => Ok(false),
        }
    }

    async fn release(&mut self, key: &str) -> Result<(), BenchError> {
        match std::mem::replace(&mut self.state, SqlxState::Gone) {
            SqlxState::Held(k, guard) if k == key => {
                let conn = guard.release_now().await.map_err(err)?;
                self.state = SqlxState::Idle(conn);
                Ok(())
            }
            other => {
                self.state = other;
                Err(BenchError::new(format!(
                    "release of `{key}`, which is not held"
                )))
            }
        }
    }
}

/// ShedLock's JDBC lock provider with database time
/// (`usingDbTime()`), its statements as it sends them to PostgreSQL: the
/// first use of a name inserts its row (`ON CONFLICT DO NOTHING`), every
/// later acquire is `UPDATE … SET lock_until = now + lockAtMostFor … WHERE
/// name = ? AND lock_until <= now`, and unlock sets `lock_until = now`.
/// ShedLock never waits (a taken lock skips the task); here a taken name is
/// tried again every 100 ms, as the naive insert lock does.
struct ShedLock {
    conn: PgConnection,
    owner: String,
    sql: ShedSql,
    known: HashSet<String>,
}

/// ShedLock's "now" on PostgreSQL with database time.
const NOW: &str = "timezone('utc', CURRENT_TIMESTAMP)";

/// ShedLock's three statements on one table.
struct ShedSql {
    insert: String,
    update: String,
    unlock: String,
}

impl ShedSql {
    fn new(table: &str) -> Self {
        let until = format!("{NOW} + interval '{} seconds'", PEER_TTL.as_secs());
        ShedSql {
            insert: format!(
                "INSERT INTO \"{table}\" (name, lock_until, locked_at, locked_by) \
                 VALUES ($1, {until}, {NOW}, $2) ON CONFLICT (name) DO NOTHING"
            ),
            update: format!(
                "UPDATE \"{table}\" SET lock_until = {until}, locked_at = {NOW}, locked_by = $2 \
                 WHERE name = $1 AND lock_until <= {NOW}"
            ),
            unlock: format!("UPDATE \"{table}\" SET lock_until = {NOW} WHERE name = $1"),
        }
    }
}

impl ShedLock {
    fn new(conn: PgConnection, table: &str) -> Self {
        ShedLock {
            conn,
            owner: uuid::Uuid::new_v4().simple().to_string(),
            sql: ShedSql::new(table),
            known: HashSet::new(),
        }
    }

    /// Runs `sql` with the name and this locker's owner bound; rows changed.
    async fn run(&mut self, sql: &str, name: &str) -> Result<u64, BenchError> {
        let done = sqlx::query(sqlx::AssertSqlSafe(sql.to_owned()))
            .bind(name)
            .bind(&self.owner)
            .execute(&mut self.conn)
            .await
            .map_err(err)?;
        Ok(done.rows_affected())
    }
}

#[async_trait]
impl Locker for ShedLock {
    async fn acquire(&mut self, key: &str, give_up: Instant) -> Result<bool, BenchError> {
        loop {
            if !self.known.contains(key) {
                let insert = self.sql.insert.clone();
                let inserted = self.run(&insert, key).await?;
                self.known.insert(key.to_owned());
                if inserted == 1 {
                    return Ok(true);
                }
            }
            let update = self.sql.update.clone();
            if self.run(&update, key).await? == 1 {
                return Ok(true);
            }
            if !super::pause_before_retry(give_up).await {
                return Ok(false);
            }
        }
    }

    async fn release(&mut self, key: &str) -> Result<(), BenchError> {
        let done = sqlx::query(sqlx::AssertSqlSafe(self.sql.unlock.clone()))
            .bind(key)
            .execute(&mut self.conn)
            .await
            .map_err(err)?;
        if done.rows_affected() == 1 {
            Ok(())
        } else {
            Err(BenchError::new(
                "shedlock: the lock row was gone at release",
            ))
        }
    }
}

/// Drops every table and sequence named `base` or `base_…` in the current
/// schema: what fenced's PostgreSQL migrations and the ShedLock peer create.
pub(crate) async fn drop_namespace(servers: &Servers, base: &str) -> Result<(), BenchError> {
    if base.is_empty() {
        return Ok(());
    }
    let mut conn = connect(servers).await?;
    let rows = sqlx::query(
        "SELECT c.relname::text, c.relkind::text FROM pg_class c \
         WHERE c.relnamespace = current_schema()::regnamespace AND c.relkind IN ('r', 'p', 'S') \
         AND (c.relname = $1 OR starts_with(c.relname, $1 || '_')) \
         ORDER BY c.relkind DESC",
    )
    .bind(base)
    .fetch_all(&mut conn)
    .await
    .map_err(err)?;
    for row in rows {
        let name: String = row.try_get(0).map_err(err)?;
        let kind: String = row.try_get(1).map_err(err)?;
        let what = if kind == "S" { "SEQUENCE" } else { "TABLE" };
        let quoted = name.replace('"', "\"\"");
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "DROP {what} IF EXISTS \"{quoted}\" CASCADE"
        )))
        .execute(&mut conn)
        .await
        .map_err(err)?;
    }
    let _ = conn.close().await;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn advisory_keys_are_stable_and_namespaced() {
        // FNV-1a's published test vector: "a" → 0xaf63dc4c8601ec8c.
        assert_eq!(
            advisory_key("", "a"),
            i64::from_ne_bytes(0xaf63_dc4c_8601_ec8c_u64.to_ne_bytes())
        );
        assert_ne!(advisory_key("fb1-", "k"), advisory_key("fb2-", "k"));
    }

    #[test]
    fn shedlock_statements_use_the_database_clock() {
        let sql = ShedSql::new("fb_x_shedlock");
        for text in [&sql.insert, &sql.update, &sql.unlock] {
            assert!(text.contains(NOW), "{text}");
            assert!(text.contains("\"fb_x_shedlock\""), "{text}");
        }
    }
}
