//! Bench-only baselines: what users would pick instead of fenced, and the raw
//! round trip of each server. Each is written the way its
//! users write it (the textbook loop, the crate's documented use), not tuned.

use std::{
    collections::HashMap,
    fmt,
    sync::{Arc, Mutex},
    time::Duration,
};

use async_trait::async_trait;
use sqlx::{Connection, MySqlConnection, Row};
use tokio::time::Instant;

use crate::{
    runner::{ChildSpec, Implementation, Locker},
    stats::Kind,
    stats::{Server, Servers},
    BenchError, Scenario, ScenarioKind,
};

mod family;
mod fencing;
mod pg;
mod zk;

pub(crate) use pg::drop_namespace as pg_drop;
pub(crate) use zk::delete_tree as zk_delete_tree;

/// The naive lock retries a taken key after this fixed sleep, as the
/// textbook INSERT/DELETE lock does.
const NAIVE_RETRY: Duration = Duration::from_millis(100);
/// Before a taken key's next try, the textbook loop's fixed pause: false,
/// without sleeping, when the pause would end after `give_up`.
async fn pause_before_retry(give_up: Instant) -> bool {
    if Instant::now() + NAIVE_RETRY > give_up {
        return false;
    }
    tokio::time::sleep(NAIVE_RETRY).await;
    true
}

/// The most locks etcd's Lock RPC, ZooKeeper's recipe and MariaDB's
/// `GET_LOCK` are asked to hold in a many-keys cell.
const SLOW_PEER_MANY_KEYS: usize = 10_000;
/// rslock / naive lock TTL: longer than any cell (the many-keys cell takes
/// up to a minute to acquire and hold its keys).
const PEER_TTL: Duration = Duration::from_secs(120);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PeerKind {
    RedisPing,
    MySqlSelect1,
    GetLock,
    NaiveInsert,
    RowLock,
    Rslock,
    /// One etcd Range get per acquire and per release: the two-round-trip floor.
    EtcdGet,
    /// etcd's built-in Lock RPC (v3lock) on one lease per task.
    EtcdLock,
    /// One ZooKeeper `exists` per acquire and per release: the two-round-trip floor.
    ZkExists,
    /// The `zookeeper-client` crate's lock recipe (`Client::lock`).
    ZkLock,
    /// One PostgreSQL `SELECT 1` per acquire and per release: the
    /// two-round-trip floor.
    PgSelect1,
    /// One durable one-row commit per acquire, `SELECT 1` per release: the
    /// floor of a lock whose grant must be on disk before it is told.
    PgCommit,
    /// `pg_try_advisory_lock` / `pg_advisory_unlock` on one connection.
    PgAdvisory,
    /// sqlx's `PgAdvisoryLock`.
    SqlxAdvisory,
    /// ShedLock's JDBC statements (database time) on PostgreSQL.
    ShedLock,
    /// A semaphore as one Redis counter changed by a script.
    RedisCounterSemaphore,
    /// The least a Redis lock with a fencing token does (`fencing.rs`).
    RedisFencing,
    /// The least a MySQL insert lock with a fencing token does (`fencing.rs`).
    MySqlFencing,
    /// A semaphore as N MySQL named locks (`GET_LOCK` slots).
    GetLockSlots,
    /// Semaphores and reader-writer locks from PostgreSQL advisory locks:
    /// N advisory slots; `pg_advisory_lock_shared` / `pg_advisory_lock`.
    PgAdvisoryFamily,
}

struct Peer {
    name: &'static str,
    kind: PeerKind,
    servers: Servers,
    id: String,
    /// Lock RPCs still waiting after their caller gave up (etcd's Lock RPC
    /// only): awaited in `cleanup`, never cancelled (etcd issue 13336).
    abandoned: Arc<Mutex<Vec<tokio::task::JoinHandle<()>>>>,
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
        ("floor/redis-fencing", PeerKind::RedisFencing),
        ("peer/rslock", PeerKind::Rslock),
        ("peer/mysql-get_lock", PeerKind::GetLock),
        ("floor/mysql-fencing", PeerKind::MySqlFencing),
        ("peer/naive-insert", PeerKind::NaiveInsert),
        ("peer/naive-row-lock", PeerKind::RowLock),
        #[cfg(feature = "etcd")]
        ("floor/etcd-get", PeerKind::EtcdGet),
        #[cfg(feature = "etcd")]
        ("peer/etcd-lock", PeerKind::EtcdLock),
        ("floor/zk-exists", PeerKind::ZkExists),
        ("peer/zk-lock", PeerKind::ZkLock),
        ("floor/pg-select1", PeerKind::PgSelect1),
        ("floor/pg-commit", PeerKind::PgCommit),
        ("peer/pg-advisory", PeerKind::PgAdvisory),
        ("peer/sqlx-advisory", PeerKind::SqlxAdvisory),
        ("peer/shedlock-pg", PeerKind::ShedLock),
        ("peer/pg-advisory-family", PeerKind::PgAdvisoryFamily),
        (
            "peer/redis-counter-semaphore",
            PeerKind::RedisCounterSemaphore,
        ),
        ("peer/mysql-get_lock-slots", PeerKind::GetLockSlots),
    ]
    .into_iter()
    .map(|(name, kind)| {
        Box::new(Peer {
            name,
            kind,
            servers: servers.clone(),
            id: id.to_owned(),
            abandoned: Arc::default(),
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
            PeerKind::RedisPing
            | PeerKind::MySqlSelect1
            | PeerKind::EtcdGet
            | PeerKind::ZkExists
            | PeerKind::PgSelect1
            | PeerKind::PgCommit
            | PeerKind::RedisFencing
            | PeerKind::MySqlFencing => Kind::Floor,
            _ => Kind::Peer,
        }
    }

    fn note(&self) -> &str {
        match self.kind {
            PeerKind::RedisFencing => {
                "the least a Redis lock with a fencing token does: acquire = one script (GET \
                 the state, TIME, and when free SET token|expiry|owner PX, the token max(last \
                 + 1, server µs)); release = one script (GET, TIME, owner, token and expiry \
                 checked, SET back free keeping the token); one connection; 2 round trips per \
                 cycle; no queue, no re-entry, no label"
            }
            PeerKind::MySqlFencing => {
                "the least a MySQL insert lock with a fencing token does: acquire = INSERT … \
                 SELECT … FROM DUAL (the AUTO_INCREMENT id is the token; the bulk form keeps \
                 ids in order), expiry on the server's clock; release = DELETE by key, token \
                 and owner while current; one connection; 2 statements, 2 durable commits per \
                 cycle; no takeover of an expired row, no label, no reaper index"
            }
            PeerKind::PgSelect1 => {
                "acquire: SELECT 1; release: SELECT 1 (prepared once, then one round trip \
                 each, one connection): the two-round-trip floor, nothing written"
            }
            PeerKind::PgCommit => {
                "acquire: UPDATE of one row of the task's own (synchronous_commit = on: the \
                 commit waits for the WAL flush); release: SELECT 1; one connection: the floor \
                 of a grant that is on disk before the holder hears of it"
            }
            PeerKind::PgAdvisory => {
                "acquire: SELECT pg_try_advisory_lock(k), when refused SELECT \
                 pg_advisory_lock(k) (the server's queue); release: SELECT \
                 pg_advisory_unlock(k); k = FNV-1a of the key; one connection; 2 round trips \
                 per cycle uncontended, nothing written, no token"
            }
            PeerKind::SqlxAdvisory => {
                "sqlx 0.9's PgAdvisoryLock: acquire(conn) = SELECT pg_advisory_lock(k) (the \
                 server's queue), release_now() = SELECT pg_advisory_unlock(k); k from \
                 HKDF-SHA256 of the key; one connection; 2 round trips per cycle, nothing \
                 written, no token"
            }
            PeerKind::RedisCounterSemaphore => {
                "a semaphore as users write it on Redis (Redisson's RSemaphore in spirit): one \
                 counter per key, a script INCRs it when fewer than N are taken, DECR gives a \
                 permit back; a waiter polls every 5 ms; 2 round trips per cycle uncontended, \
                 no token, no TTL per permit (a dead holder's permit never comes back), no \
                 agreement on N, no reader-writer lock"
            }
            PeerKind::GetLockSlots => {
                "a semaphore as N MySQL named locks: GET_LOCK(slot, 0) on each slot in turn, \
                 all taken: GET_LOCK(slot, wait) on one (by turns) in the server's queue; \
                 RELEASE_LOCK(slot); one connection; 2 round trips per cycle uncontended, \
                 nothing written, no token, no agreement on N, no shared mode"
            }
            PeerKind::PgAdvisoryFamily => {
                "what PostgreSQL offers without a library: a semaphore of N = N advisory \
                 slots (pg_try_advisory_lock on each in turn; all taken: pg_advisory_lock on \
                 one slot, chosen by task, in the server's queue); a reader-writer lock = \
                 pg_advisory_lock_shared / pg_advisory_lock (the server's queue: a waiting \
                 writer holds back later readers); release the matching unlock; one \
                 connection; nothing written, no token, no agreement on N"
            }
            PeerKind::ShedLock => {
                "ShedLock's statements with database time: a name's first use INSERT … ON \
                 CONFLICT DO NOTHING, then UPDATE … SET lock_until = now + 30 s … WHERE name = \
                 $1 AND lock_until <= now; release UPDATE … SET lock_until = now; one \
                 connection; 2 durable commits and 2 round trips per cycle; a taken name \
                 retried every 100 ms; no token"
            }
            _ => "",
        }
    }

    fn server(&self) -> Server {
        match self.kind {
            PeerKind::RedisPing
            | PeerKind::Rslock
            | PeerKind::RedisCounterSemaphore
            | PeerKind::RedisFencing => Server::Redis,
            PeerKind::EtcdGet | PeerKind::EtcdLock => Server::Etcd,
            PeerKind::ZkExists | PeerKind::ZkLock => Server::ZooKeeper,
            PeerKind::PgSelect1
            | PeerKind::PgCommit
            | PeerKind::PgAdvisory
            | PeerKind::SqlxAdvisory
            | PeerKind::ShedLock
            | PeerKind::PgAdvisoryFamily => Server::Postgres,
            _ => Server::MySql,
        }
    }

    fn runs(&self, s: &Scenario) -> bool {
        match self.kind {
            PeerKind::RedisPing
            | PeerKind::MySqlSelect1
            | PeerKind::EtcdGet
            | PeerKind::ZkExists
            | PeerKind::PgSelect1
            | PeerKind::PgCommit
            | PeerKind::RedisFencing
            | PeerKind::MySqlFencing => s.without_exclusion(),
            // One open transaction per connection: it cannot hold thousands
            // of rows as separate locks. sqlx's guard owns its connection (one
            // lock per connection); the raw pair would hold every lock as an
            // entry of the server's shared lock table.
            PeerKind::RowLock | PeerKind::SqlxAdvisory | PeerKind::PgAdvisory => {
                !matches!(s.kind, ScenarioKind::ManyKeys { .. }) && !s.is_family()
            }
            PeerKind::PgAdvisoryFamily => s.is_family(),
            // One lock after another on one connection, under 1 000/s: more
            // than `SLOW_PEER_MANY_KEYS` would take minutes per row (and
            // outlive etcd's Lock RPC lease). MariaDB's GET_LOCK slows down as
            // one connection holds more: 10 000 at 6 910/s, 100 000 not
            // within the cell's 284 s.
            PeerKind::EtcdLock | PeerKind::ZkLock | PeerKind::GetLock => match s.kind {
                ScenarioKind::ManyKeys { keys } => keys <= SLOW_PEER_MANY_KEYS,
                _ => !s.is_family(),
            },
            PeerKind::RedisCounterSemaphore | PeerKind::GetLockSlots => {
                matches!(s.kind, ScenarioKind::Semaphore { .. })
            }
            // Mutexes: no semaphores or reader-writer locks.
            _ => !s.is_family(),
        }
    }

    fn child_spec(&self) -> Option<ChildSpec> {
        Some(ChildSpec {
            name: self.name.to_owned(),
            id: self.id.clone(),
            url: None,
        })
    }

    async fn child_done(&self) {
        #[cfg(feature = "etcd")]
        if self.kind == PeerKind::EtcdLock {
            let _ = etcd::drain(&self.abandoned).await;
        }
    }

    async fn locker(&self, _: &Scenario) -> Result<Box<dyn Locker>, BenchError> {
        Ok(match self.kind {
            #[cfg(feature = "etcd")]
            PeerKind::EtcdGet | PeerKind::EtcdLock => {
                etcd::locker(self.kind, &self.servers, &self.id, &self.abandoned).await?
            }
            PeerKind::ZkExists | PeerKind::ZkLock => {
                zk::locker(self.kind, &self.servers, &self.id).await?
            }
            PeerKind::PgSelect1
            | PeerKind::PgCommit
            | PeerKind::PgAdvisory
            | PeerKind::SqlxAdvisory
            | PeerKind::ShedLock
            | PeerKind::PgAdvisoryFamily => pg::locker(self.kind, &self.servers, &self.id).await?,
            PeerKind::RedisFencing | PeerKind::MySqlFencing => {
                fencing::locker(self.kind, &self.servers, &self.id).await?
            }
            PeerKind::RedisCounterSemaphore => {
                let client = redis::Client::open(self.servers.redis.as_str())?;
                Box::new(family::RedisCounter {
                    conn: client.get_multiplexed_async_connection().await?,
                    prefix: format!("{{fb{}}}:sem:", self.id),
                })
            }
            PeerKind::GetLockSlots => Box::new(family::GetLockSlots {
                conn: MySqlConnection::connect(&self.servers.mysql).await?,
                prefix: format!("fb{}-", self.id),
                held: HashMap::new(),
                turn: 0,
            }),
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
            PeerKind::MySqlFencing => {
                drop_tables(&self.servers, &[&fencing::mysql_table(&self.id)]).await
            }
            PeerKind::Rslock | PeerKind::RedisCounterSemaphore | PeerKind::RedisFencing => {
                redis_delete(&self.servers.redis, &format!("{{fb{}}}:*", self.id)).await
            }
            #[cfg(feature = "etcd")]
            PeerKind::EtcdLock => etcd::drain(&self.abandoned).await,
            PeerKind::ZkLock => zk::delete_tree(&self.servers, &zk::root(&self.id)).await,
            PeerKind::ShedLock => {
                pg::drop_namespace(&self.servers, &pg::shedlock_table(&self.id)).await
            }
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
                "DROP TABLE IF EXISTS `{base}`, `{base}_optimistic`, `{base}_rows`, `{base}_fence`, \
                 `{base}_live`, `{base}_migrations`, `{base}_permits`, `{base}_permit_keys`"
            ),
        )
        .await?;
    }
    let _ = conn.close().await;
    Ok(())
}

/// Deletes the Redis keys matching `pattern` (SCAN, never KEYS or FLUSH).
pub(crate) async fn redis_delete(url: &str, pattern: &str) -> Result<(), BenchError> {
    let client = redis::Client::open(url)?;
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
        let lock = crate::runner::take_held(&mut self.held, key)?;
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

impl SqlLocker {
    /// Runs `sql` with the key and this locker's owner bound, in that order.
    async fn key_and_owner(
        &mut self,
        sql: &str,
        key: &str,
    ) -> Result<sqlx::mysql::MySqlQueryResult, sqlx::Error> {
        sqlx::query(sqlx::AssertSqlSafe(sql.to_owned()))
            .bind(key)
            .bind(&self.owner)
            .execute(&mut self.conn)
            .await
    }
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
                    let r = self.key_and_owner(&sql, key).await;
                    match r {
                        Ok(_) => return Ok(true),
                        Err(sqlx::Error::Database(e)) if e.is_unique_violation() => {}
                        // Concurrent inserts of one key deadlock in InnoDB (each waits
                        // for a shared lock on the duplicate); the textbook loop
                        // treats any failed insert as "taken, try again later".
                        Err(e) if is_deadlock(&e) => {}
                        Err(e) => return Err(e.into()),
                    }
                    if !pause_before_retry(give_up).await {
                        return Ok(false);
                    }
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
            _ => Err(BenchError::new("not a MySQL peer")),
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
                    let r = self.key_and_owner(&sql, key).await;
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
            _ => Err(BenchError::new("not a MySQL peer")),
        }
    }
}

/// MySQL error 1213 (SQLSTATE 40001): the statement was chosen as a deadlock victim.
fn is_deadlock(e: &sqlx::Error) -> bool {
    matches!(e, sqlx::Error::Database(d) if d.code().as_deref() == Some("40001"))
}

/// The etcd floor and etcd's own Lock RPC (`etcd-client`, so `protoc` at build time).
#[cfg(feature = "etcd")]
mod etcd {
    use std::{
        collections::HashMap,
        sync::{Arc, Mutex},
        time::Duration,
    };

    use async_trait::async_trait;
    use etcd_client::{Client, LockOptions};
    use tokio::{sync::oneshot, task::JoinHandle, time::Instant};

    use super::PeerKind;
    use crate::{runner::Locker, stats::Servers, BenchError};

    /// The lease (= lock TTL) of each Lock RPC: longer than any cell,
    /// many-keys included (acquiring 10 000 locks, then holding them 8 s).
    const LOCK_TTL: i64 = 60;

    /// How long `cleanup` waits for Lock RPCs whose callers gave up. They end
    /// as the queue drains (every task stops after its current acquisition),
    /// or when their lease (`LOCK_TTL`) expires.
    const DRAIN_BOUND: Duration = Duration::from_secs(75);

    pub(super) type Abandoned = Arc<Mutex<Vec<JoinHandle<()>>>>;

    fn err(e: etcd_client::Error) -> BenchError {
        BenchError::new(format!("etcd: {e}"))
    }

    pub(super) async fn locker(
        kind: PeerKind,
        servers: &Servers,
        id: &str,
        abandoned: &Abandoned,
    ) -> Result<Box<dyn Locker>, BenchError> {
        // No request timeout: a timed-out Lock RPC is a cancelled one, and
        // cancelling waiting Lock RPCs wedges etcd 3.4's lock service.
        let client = Client::connect([servers.etcd.as_str()], None)
            .await
            .map_err(err)?;
        Ok(if kind == PeerKind::EtcdGet {
            Box::new(GetLocker {
                client,
                key: format!("fb{id}/floor").into_bytes(),
            })
        } else {
            Box::new(RpcLocker {
                client,
                prefix: format!("fb{id}/lk/"),
                held: HashMap::new(),
                abandoned: Arc::clone(abandoned),
            })
        })
    }

    /// Waits (bounded) for the Lock RPCs that outlived their callers.
    pub(super) async fn drain(abandoned: &Abandoned) -> Result<(), BenchError> {
        let pending: Vec<JoinHandle<()>> = {
            let mut list = abandoned.lock().unwrap_or_else(|p| p.into_inner());
            list.drain(..).collect()
        };
        let n = pending.len();
        let all = async {
            for h in pending {
                let _ = h.await;
            }
        };
        tokio::time::timeout(DRAIN_BOUND, all).await.map_err(|_| {
            BenchError::new(format!(
                "{n} abandoned etcd Lock RPCs still waiting after {DRAIN_BOUND:?}"
            ))
        })
    }

    /// The etcd floor: acquire = one Range get, release = one Range get.
    struct GetLocker {
        client: Client,
        key: Vec<u8>,
    }

    #[async_trait]
    impl Locker for GetLocker {
        async fn acquire(&mut self, _: &str, _: Instant) -> Result<bool, BenchError> {
            self.client.get(self.key.clone(), None).await.map_err(err)?;
            Ok(true)
        }
        async fn release(&mut self, _: &str) -> Result<(), BenchError> {
            self.client.get(self.key.clone(), None).await.map_err(err)?;
            Ok(())
        }
    }

    /// etcd's Lock RPC as documented (etcd-client's `lock` example, the
    /// v3lock API): grant a lease — the lock's TTL — then `Lock(name,
    /// lease)`, later `Unlock(key)`; the lease then expires on its own.
    ///
    /// A waiting Lock RPC is never cancelled: it runs in its own task; when
    /// the caller gives up, the task is left to finish (it unlocks at once
    /// when it is granted; its lease bounds how long that can take) and
    /// `cleanup` waits for it.
    struct RpcLocker {
        client: Client,
        prefix: String,
        held: HashMap<String, Vec<u8>>,
        abandoned: Abandoned,
    }

    #[async_trait]
    impl Locker for RpcLocker {
        async fn acquire(&mut self, key: &str, give_up: Instant) -> Result<bool, BenchError> {
            let lease = self
                .client
                .lease_grant(LOCK_TTL, None)
                .await
                .map_err(err)?
                .id();
            let name = format!("{}{key}", self.prefix);
            let (tx, mut rx) = oneshot::channel();
            let mut client = self.client.clone();
            let task = tokio::spawn(async move {
                let opts = LockOptions::new().with_lease(lease);
                match client.lock(name, Some(opts)).await {
                    Ok(resp) => {
                        if let Err(Ok(unclaimed)) = tx.send(Ok(resp.key().to_vec())) {
                            // The caller gave up meanwhile: give it back.
                            let _ = client.unlock(unclaimed).await;
                        }
                    }
                    Err(e) => {
                        let _ = tx.send(Err(e));
                    }
                }
            });
            let result = match tokio::time::timeout_at(give_up, &mut rx).await {
                Ok(r) => r,
                Err(_) => {
                    // Close first, then look: a grant that raced the timeout
                    // is taken; otherwise the task unlocks it when it comes.
                    rx.close();
                    match rx.try_recv() {
                        Ok(r) => Ok(r),
                        Err(_) => {
                            let mut list = self.abandoned.lock().unwrap_or_else(|p| p.into_inner());
                            list.retain(|h| !h.is_finished());
                            list.push(task);
                            return Ok(false);
                        }
                    }
                }
            };
            match result {
                Ok(Ok(lock_key)) => {
                    self.held.insert(key.to_owned(), lock_key);
                    Ok(true)
                }
                Ok(Err(e)) => Err(err(e)),
                Err(_) => Err(BenchError::new("etcd Lock task ended without an answer")),
            }
        }

        async fn release(&mut self, key: &str) -> Result<(), BenchError> {
            let lock_key = crate::runner::take_held(&mut self.held, key)?;
            self.client.unlock(lock_key).await.map_err(err)?;
            Ok(())
        }
    }
}
