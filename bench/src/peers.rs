//! Bench-only baselines: what users would pick instead of fenced, and the raw
//! round trip of each server. Written to be faithful to the article / the
//! crate's documented use, not to be good.

use std::{collections::HashMap, fmt, time::Duration};

use async_trait::async_trait;
use sqlx::{Connection, MySqlConnection, Row};
use tokio::time::Instant;

use crate::{
    runner::{Implementation, Kind, Locker},
    stats::{Server, Servers},
    BenchError, Scenario, ScenarioKind,
};

/// The article's naive lock retries a taken key after this fixed sleep.
const NAIVE_RETRY: Duration = Duration::from_millis(100);
/// rslock / naive lock TTL: longer than any cell.
const PEER_TTL: Duration = Duration::from_secs(30);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PeerKind {
    RedisPing,
    MySqlSelect1,
    GetLock,
    NaiveInsert,
    RowLock,
    Rslock,
}

struct Peer {
    name: &'static str,
    kind: PeerKind,
    servers: Servers,
    id: String,
}

impl fmt::Debug for Peer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Peer").field("name", &self.name).finish()
    }
}

/// The floors and peers, namespaced by `id`.
pub(crate) fn peers(servers: &Servers, id: &str) -> Vec<Box<dyn Implementation>> {
    [
        ("floor/redis-ping", PeerKind::RedisPing),
        ("floor/mysql-select1", PeerKind::MySqlSelect1),
        ("peer/rslock", PeerKind::Rslock),
        ("peer/mysql-get_lock", PeerKind::GetLock),
        ("peer/naive-insert", PeerKind::NaiveInsert),
        ("peer/article-row-lock", PeerKind::RowLock),
    ]
    .into_iter()
    .map(|(name, kind)| {
        Box::new(Peer {
            name,
            kind,
            servers: servers.clone(),
            id: id.to_owned(),
        }) as Box<dyn Implementation>
    })
    .collect()
}

impl Peer {
    fn naive_table(&self) -> String {
        format!("fb_{}_naive", self.id)
    }
    fn rows_table(&self) -> String {
        format!("fb_{}_artrows", self.id)
    }
}

#[async_trait]
impl Implementation for Peer {
    fn name(&self) -> &str {
        self.name
    }

    fn kind(&self) -> Kind {
        match self.kind {
            PeerKind::RedisPing | PeerKind::MySqlSelect1 => Kind::Floor,
            _ => Kind::Peer,
        }
    }

    fn server(&self) -> Server {
        match self.kind {
            PeerKind::RedisPing | PeerKind::Rslock => Server::Redis,
            _ => Server::MySql,
        }
    }

    fn runs(&self, s: &Scenario) -> bool {
        match self.kind {
            PeerKind::RedisPing | PeerKind::MySqlSelect1 => s.without_exclusion(),
            // One open transaction per connection: it cannot hold 10 000 rows
            // as separate locks.
            PeerKind::RowLock => !matches!(s.kind, ScenarioKind::ManyKeys { .. }),
            _ => true,
        }
    }

    async fn locker(&self, _: &Scenario) -> Result<Box<dyn Locker>, BenchError> {
        Ok(match self.kind {
            PeerKind::RedisPing | PeerKind::Rslock => {
                let client = redis::Client::open(self.servers.redis.as_str())?;
                if self.kind == PeerKind::Rslock {
                    Box::new(RslockLocker {
                        manager: rslock::LockManager::from_clients(vec![client]),
                        prefix: format!("{{fb{}}}:rs:", self.id),
                        held: HashMap::new(),
                    })
                } else {
                    Box::new(PingLocker {
                        conn: client.get_multiplexed_async_connection().await?,
                    })
                }
            }
            kind => {
                let mut conn = MySqlConnection::connect(&self.servers.mysql).await?;
                match kind {
                    PeerKind::NaiveInsert => {
                        exec(&mut conn, &format!(
                            "CREATE TABLE IF NOT EXISTS `{}` (lock_key VARCHAR(255) NOT NULL PRIMARY KEY, \
                             owner VARCHAR(64) NOT NULL, expire_time DATETIME(6) NOT NULL) ENGINE=InnoDB",
                            self.naive_table()
                        ))
                        .await?;
                    }
                    PeerKind::RowLock => {
                        exec(&mut conn, &format!(
                            "CREATE TABLE IF NOT EXISTS `{}` (lock_key VARCHAR(255) NOT NULL PRIMARY KEY) ENGINE=InnoDB",
                            self.rows_table()
                        ))
                        .await?;
                        exec(&mut conn, "SET SESSION innodb_lock_wait_timeout = 50").await?;
                    }
                    _ => {}
                }
                Box::new(SqlLocker {
                    conn,
                    kind,
                    naive_table: self.naive_table(),
                    rows_table: self.rows_table(),
                    owner: uuid::Uuid::new_v4().simple().to_string(),
                    lock_prefix: format!("fb{}-", self.id),
                })
            }
        })
    }

    async fn cleanup(&self) -> Result<(), BenchError> {
        match self.kind {
            PeerKind::NaiveInsert => drop_tables(&self.servers, &[&self.naive_table()]).await,
            PeerKind::RowLock => drop_tables(&self.servers, &[&self.rows_table()]).await,
            PeerKind::Rslock => redis_delete(&self.servers, &format!("{{fb{}}}:*", self.id)).await,
            _ => Ok(()),
        }
    }
}

async fn exec(conn: &mut MySqlConnection, sql: &str) -> Result<(), BenchError> {
    sqlx::raw_sql(sqlx::AssertSqlSafe(sql.to_owned()))
        .execute(conn)
        .await?;
    Ok(())
}

/// Drops the tables fenced's MySQL migration and the peers create for `bases`.
pub(crate) async fn drop_tables(servers: &Servers, bases: &[&str]) -> Result<(), BenchError> {
    let mut conn = MySqlConnection::connect(&servers.mysql).await?;
    for base in bases.iter().filter(|b| !b.is_empty()) {
        exec(
            &mut conn,
            &format!(
                "DROP TABLE IF EXISTS `{base}`, `{base}_optimistic`, `{base}_rows`, `{base}_fence`, `{base}_migrations`"
            ),
        )
        .await?;
    }
    let _ = conn.close().await;
    Ok(())
}

/// Deletes the Redis keys matching `pattern` (SCAN, never KEYS or FLUSH).
pub(crate) async fn redis_delete(servers: &Servers, pattern: &str) -> Result<(), BenchError> {
    let client = redis::Client::open(servers.redis.as_str())?;
    let mut conn = client.get_multiplexed_async_connection().await?;
    let mut cursor: u64 = 0;
    loop {
        let (next, keys): (u64, Vec<String>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(pattern)
            .arg("COUNT")
            .arg(1000)
            .query_async(&mut conn)
            .await?;
        if !keys.is_empty() {
            redis::cmd("DEL")
                .arg(&keys)
                .query_async::<()>(&mut conn)
                .await?;
        }
        if next == 0 {
            return Ok(());
        }
        cursor = next;
    }
}

/// The Redis floor: acquire = one PING, release = one PING.
struct PingLocker {
    conn: redis::aio::MultiplexedConnection,
}

#[async_trait]
impl Locker for PingLocker {
    async fn acquire(&mut self, _: &str, _: Instant) -> Result<bool, BenchError> {
        redis::cmd("PING")
            .query_async::<String>(&mut self.conn)
            .await?;
        Ok(true)
    }
    async fn release(&mut self, _: &str) -> Result<(), BenchError> {
        redis::cmd("PING")
            .query_async::<String>(&mut self.conn)
            .await?;
        Ok(())
    }
}

/// `rslock` as its docs suggest: `lock()` (3 tries, 200 ms apart) until it succeeds.
struct RslockLocker {
    manager: rslock::LockManager,
    prefix: String,
    held: HashMap<String, rslock::Lock>,
}

#[async_trait]
impl Locker for RslockLocker {
    async fn acquire(&mut self, key: &str, give_up: Instant) -> Result<bool, BenchError> {
        let resource = format!("{}{key}", self.prefix);
        while Instant::now() < give_up {
            match self.manager.lock(resource.as_bytes(), PEER_TTL).await {
                Ok(lock) => {
                    self.held.insert(key.to_owned(), lock);
                    return Ok(true);
                }
                Err(rslock::LockError::Unavailable) => {}
                Err(e) => return Err(BenchError::new(format!("rslock: {e}"))),
            }
        }
        Ok(false)
    }
    async fn release(&mut self, key: &str) -> Result<(), BenchError> {
        let lock = self
            .held
            .remove(key)
            .ok_or_else(|| BenchError::new(format!("release of `{key}`, which is not held")))?;
        self.manager.unlock(&lock).await;
        Ok(())
    }
}

/// The MySQL peers and floor, each on one dedicated connection.
struct SqlLocker {
    conn: MySqlConnection,
    kind: PeerKind,
    naive_table: String,
    rows_table: String,
    owner: String,
    lock_prefix: String,
}

#[async_trait]
impl Locker for SqlLocker {
    async fn acquire(&mut self, key: &str, give_up: Instant) -> Result<bool, BenchError> {
        match self.kind {
            PeerKind::MySqlSelect1 => {
                sqlx::query("SELECT 1").execute(&mut self.conn).await?;
                Ok(true)
            }
            PeerKind::GetLock => {
                let secs = give_up
                    .saturating_duration_since(Instant::now())
                    .as_secs()
                    .max(1);
                let row = sqlx::query("SELECT GET_LOCK(?, ?)")
                    .bind(format!("{}{key}", self.lock_prefix))
                    .bind(secs)
                    .fetch_one(&mut self.conn)
                    .await?;
                let got: Option<i64> = row.try_get(0)?;
                Ok(got == Some(1))
            }
            PeerKind::NaiveInsert => {
                let sql = format!(
                    "INSERT INTO `{}` (lock_key, owner, expire_time) VALUES (?, ?, NOW(6) + INTERVAL 30 SECOND)",
                    self.naive_table
                );
                loop {
                    let r = sqlx::query(sqlx::AssertSqlSafe(sql.clone()))
                        .bind(key)
                        .bind(&self.owner)
                        .execute(&mut self.conn)
                        .await;
                    match r {
                        Ok(_) => return Ok(true),
                        Err(sqlx::Error::Database(e)) if e.is_unique_violation() => {}
                        // Concurrent inserts of one key deadlock in InnoDB (each waits
                        // for a shared lock on the duplicate); the article's loop
                        // treats any failed insert as "taken, try again later".
                        Err(e) if is_deadlock(&e) => {}
                        Err(e) => return Err(e.into()),
                    }
                    if Instant::now() + NAIVE_RETRY > give_up {
                        return Ok(false);
                    }
                    tokio::time::sleep(NAIVE_RETRY).await;
                }
            }
            PeerKind::RowLock => loop {
                exec(&mut self.conn, "BEGIN").await?;
                let found = sqlx::query(sqlx::AssertSqlSafe(format!(
                    "SELECT lock_key FROM `{}` WHERE lock_key = ? FOR UPDATE",
                    self.rows_table
                )))
                .bind(key)
                .fetch_optional(&mut self.conn)
                .await;
                match found {
                    Ok(Some(_)) => return Ok(true),
                    Ok(None) => {
                        // Never lock a missing row (gap locks): create it, retry.
                        exec(&mut self.conn, "ROLLBACK").await?;
                        sqlx::query(sqlx::AssertSqlSafe(format!(
                            "INSERT IGNORE INTO `{}` (lock_key) VALUES (?)",
                            self.rows_table
                        )))
                        .bind(key)
                        .execute(&mut self.conn)
                        .await?;
                    }
                    Err(e) => {
                        let _ = exec(&mut self.conn, "ROLLBACK").await;
                        return Err(e.into());
                    }
                }
            },
            PeerKind::RedisPing | PeerKind::Rslock => Err(BenchError::new("not a MySQL peer")),
        }
    }

    async fn release(&mut self, key: &str) -> Result<(), BenchError> {
        match self.kind {
            PeerKind::MySqlSelect1 => {
                sqlx::query("SELECT 1").execute(&mut self.conn).await?;
                Ok(())
            }
            PeerKind::GetLock => {
                let row = sqlx::query("SELECT RELEASE_LOCK(?)")
                    .bind(format!("{}{key}", self.lock_prefix))
                    .fetch_one(&mut self.conn)
                    .await?;
                let r: Option<i64> = row.try_get(0)?;
                if r == Some(1) {
                    Ok(())
                } else {
                    Err(BenchError::new(format!("RELEASE_LOCK returned {r:?}")))
                }
            }
            PeerKind::NaiveInsert => {
                let sql = format!(
                    "DELETE FROM `{}` WHERE lock_key = ? AND owner = ?",
                    self.naive_table
                );
                // The DELETE can be the deadlock victim too; a naive user retries
                // it (otherwise the key stays taken until someone reaps it).
                let mut attempts = 0;
                let done = loop {
                    let r = sqlx::query(sqlx::AssertSqlSafe(sql.clone()))
                        .bind(key)
                        .bind(&self.owner)
                        .execute(&mut self.conn)
                        .await;
                    match r {
                        Err(e) if is_deadlock(&e) && attempts < 10 => attempts += 1,
                        r => break r?,
                    }
                };
                if done.rows_affected() == 1 {
                    Ok(())
                } else {
                    Err(BenchError::new("naive lock row was gone at release"))
                }
            }
            PeerKind::RowLock => exec(&mut self.conn, "COMMIT").await,
            PeerKind::RedisPing | PeerKind::Rslock => Err(BenchError::new("not a MySQL peer")),
        }
    }
}

/// MySQL error 1213 (SQLSTATE 40001): the statement was chosen as a deadlock victim.
fn is_deadlock(e: &sqlx::Error) -> bool {
    matches!(e, sqlx::Error::Database(d) if d.code().as_deref() == Some("40001"))
}
