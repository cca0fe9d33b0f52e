//! The server-side faults: a run whose fault needs to break the *server*
//! gets a private one ([`crate::private`]), so destructive acts never touch
//! the shared services or other tests.
//!
//! * restart while held — MariaDB (InnoDB, durable), Redis without
//!   persistence and with AOF `appendfsync always`, etcd, a standalone
//!   ZooKeeper (same data directory: its sessions, nodes and zxids survive),
//!   PostgreSQL (crash recovery from the WAL: lease rows and the token
//!   sequence survive, advisory locks die with the sessions);
//! * the leader killed in a 3-member etcd cluster or ZooKeeper ensemble;
//!   the primary serving the lock's slot killed in a Redis Cluster of three
//!   primaries with a replica each, and the primary Sentinel watches killed;
//! * `KILL <id>` of the connection holding a `row_lock` transaction, and
//!   `pg_terminate_backend` of the backend holding a PostgreSQL advisory
//!   lock;
//! * a lock-conflict storm on a MariaDB with `innodb_lock_wait_timeout = 1`,
//!   with a conflict injector that makes fenced's statements deadlock
//!   victims and lets them time out, counting the deadlocks and lock-wait
//!   timeouts the server itself saw.
//!
//! Every act returns evidence that it really happened (a new pid, a new
//! leader, the killed connection id, the server's counters), which the run
//! records and the short profile asserts.

use std::time::Duration;

use tokio::time::Instant;

use fenced::mysql::sqlx::{self, mysql::MySqlConnectOptions, Connection as _, Row as _};

use crate::{
    model::{Fault, Target},
    private::{
        EtcdOptions, MariaDbOptions, PostgresOptions, PrivateEtcd, PrivateMariaDb, PrivatePostgres,
        PrivateRedis, PrivateRedisCluster, PrivateSentinelGroup, PrivateZooKeeper, RedisOptions,
        RedisPersistence, ZooKeeperOptions,
    },
};

/// A private server for one run.
#[derive(Debug)]
pub enum PrivateStore {
    /// A private MariaDB.
    MariaDb(PrivateMariaDb),
    /// A private redis-server (persistence as the fault asks).
    Redis(PrivateRedis),
    /// A private etcd: one member, or three for the leader kill.
    Etcd(PrivateEtcd),
    /// A private ZooKeeper: standalone, or an ensemble of three for the
    /// leader kill.
    ZooKeeper(PrivateZooKeeper),
    /// A private PostgreSQL.
    Postgres(PrivatePostgres),
    /// A private Redis Cluster: three primaries with a replica each.
    RedisCluster(PrivateRedisCluster),
    /// A private primary, replica and sentinel.
    RedisSentinel(Box<PrivateSentinelGroup>),
}

fn err(what: &str, e: impl std::fmt::Display) -> String {
    format!("{what}: {e}; install the servers with scripts/services.sh")
}

impl PrivateStore {
    /// The private server `fault` needs on `target`, if it needs one.
    ///
    /// # Errors
    ///
    /// When the server binary is missing (naming `scripts/services.sh`) or
    /// the server does not come up.
    pub async fn for_run(target: Target, fault: Fault) -> Result<Option<Self>, String> {
        // A Sentinel group is private whatever the fault: no shared one.
        if !fault.needs_private_server() && target != Target::RedisSentinel {
            return Ok(None);
        }
        let store = match target {
            Target::MySqlUniqueKey | Target::MySqlRowLock | Target::MySqlOptimistic => {
                let db = PrivateMariaDb::start(MariaDbOptions::default())
                    .await
                    .map_err(|e| err("private MariaDB", e))?;
                if fault == Fault::LockStorm {
                    // Lock waits end in 1205 after a second instead of 50.
                    db.admin("SET GLOBAL innodb_lock_wait_timeout = 1")
                        .await
                        .map_err(|e| err("private MariaDB", e))?;
                }
                PrivateStore::MariaDb(db)
            }
            Target::Redis => {
                let persistence = if fault == Fault::ServerRestartAof {
                    RedisPersistence::AofAlways
                } else {
                    RedisPersistence::None
                };
                PrivateStore::Redis(
                    PrivateRedis::start(RedisOptions {
                        persistence,
                        ..RedisOptions::default()
                    })
                    .await
                    .map_err(|e| err("private redis-server", e))?,
                )
            }
            Target::Etcd => {
                let members = if fault == Fault::LeaderKill { 3 } else { 1 };
                PrivateStore::Etcd(
                    PrivateEtcd::start(EtcdOptions {
                        members,
                        ..EtcdOptions::default()
                    })
                    .await
                    .map_err(|e| err("private etcd", e))?,
                )
            }
            Target::ZooKeeper => {
                let members = if fault == Fault::LeaderKill { 3 } else { 1 };
                PrivateStore::ZooKeeper(
                    PrivateZooKeeper::start(ZooKeeperOptions {
                        members,
                        tick_ms: crate::model::ZOOKEEPER_TICK_MS,
                        ..ZooKeeperOptions::default()
                    })
                    .await
                    .map_err(|e| err("private ZooKeeper", e))?,
                )
            }
            Target::PostgresLease | Target::PostgresAdvisory => PrivateStore::Postgres(
                PrivatePostgres::start(PostgresOptions::default())
                    .await
                    .map_err(|e| err("private PostgreSQL", e))?,
            ),
            Target::RedisCluster => PrivateStore::RedisCluster(
                PrivateRedisCluster::start(3, 1)
                    .await
                    .map_err(|e| err("private Redis Cluster", e))?,
            ),
            Target::RedisSentinel => PrivateStore::RedisSentinel(Box::new(
                PrivateSentinelGroup::start()
                    .await
                    .map_err(|e| err("private Redis Sentinel group", e))?,
            )),
            Target::Sqlite => return Ok(None),
        };
        Ok(Some(store))
    }

    /// The server part of the store URL (`Target::url` adds the options).
    pub fn base_url(&self) -> String {
        match self {
            PrivateStore::MariaDb(db) => db.url(),
            PrivateStore::Redis(r) => r.url(),
            PrivateStore::Etcd(e) => format!("http://{}", e.hostports()),
            PrivateStore::ZooKeeper(z) => format!("zk://{}", z.hostports()),
            PrivateStore::Postgres(p) => p.url(),
            PrivateStore::RedisCluster(c) => c.url(),
            PrivateStore::RedisSentinel(g) => g.url(),
        }
    }

    /// What a client's proxy forwards to when the proxy is the fault: the
    /// primary of a Sentinel group (its clients' URLs map the address the
    /// sentinel names to their proxies). The other private servers are
    /// used by server faults only, which need no proxy.
    ///
    /// # Errors
    ///
    /// For a private server whose cells have no proxy.
    pub async fn proxied_upstreams(&self) -> Result<Vec<std::net::SocketAddr>, String> {
        match self {
            PrivateStore::RedisSentinel(g) => {
                let port = g
                    .named_primary()
                    .await
                    .map_err(|e| err("private Redis Sentinel group", e))?;
                Ok(vec![std::net::SocketAddr::from(([127, 0, 0, 1], port))])
            }
            _ => Err("this private server's cells are not proxied".into()),
        }
    }

    /// Kills the server hard (SIGKILL, no shutdown) and starts it again on
    /// the same data. Evidence: the old and the new pid.
    ///
    /// # Errors
    ///
    /// When it does not come back, or came back as the same process.
    pub async fn restart(&self) -> Result<String, String> {
        let (before, after) = match self {
            PrivateStore::MariaDb(db) => {
                let before = db.pid();
                db.restart().await.map_err(|e| e.to_string())?;
                (before, db.pid())
            }
            PrivateStore::Redis(r) => {
                let before = r.pid();
                r.restart().await.map_err(|e| e.to_string())?;
                (before, r.pid())
            }
            PrivateStore::Etcd(e) => {
                let before = e.member_pid(0);
                e.restart().await.map_err(|e| e.to_string())?;
                (before, e.member_pid(0))
            }
            PrivateStore::ZooKeeper(z) => {
                let before = z.pid(0);
                z.restart(0).await.map_err(|e| e.to_string())?;
                (before, z.pid(0))
            }
            PrivateStore::Postgres(p) => {
                let before = p.pid();
                p.restart().await.map_err(|e| e.to_string())?;
                (before, p.pid())
            }
            PrivateStore::RedisCluster(_) | PrivateStore::RedisSentinel(_) => {
                return Err("a restart of a Redis Cluster or Sentinel group is not a cell".into())
            }
        };
        match (before, after) {
            (Some(b), Some(a)) if a != b => Ok(format!("server restarted: pid {b} -> {a}")),
            _ => Err(format!(
                "the server did not restart (pid {before:?} -> {after:?})"
            )),
        }
    }

    /// Kills the leader of the etcd cluster or ZooKeeper ensemble (SIGKILL)
    /// and waits until the survivors have elected another; in a Redis
    /// Cluster, the primary that serves the slot of `name` (the lock's
    /// state key), until its replica serves it; under Sentinel, the
    /// primary, until the sentinel names the replica. Evidence: the old and
    /// the new leader or primary.
    ///
    /// # Errors
    ///
    /// When this is not a cluster, or no new leader shows up within 30 s.
    pub async fn kill_leader(&self, name: &str) -> Result<String, String> {
        let e = match self {
            PrivateStore::Etcd(e) => e,
            PrivateStore::ZooKeeper(z) => return kill_zookeeper_leader(z).await,
            PrivateStore::RedisCluster(c) => return kill_cluster_primary(c, name).await,
            PrivateStore::RedisSentinel(g) => return kill_sentinel_primary(g).await,
            _ => {
                return Err("the leader kill needs an etcd cluster or a ZooKeeper ensemble".into())
            }
        };
        let (leader, index) = etcd_leader(e, None).await?;
        e.kill(index);
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        loop {
            match etcd_leader(e, Some(index)).await {
                Ok((new, _)) if new != leader && new != 0 => {
                    return Ok(format!(
                        "leader m{index} ({leader:x}) killed; new leader {new:x}"
                    ))
                }
                _ if tokio::time::Instant::now() > deadline => {
                    return Err(format!("no new leader 30 s after killing m{index}"))
                }
                _ => tokio::time::sleep(Duration::from_millis(50)).await,
            }
        }
    }

    /// Ends the server session that holds the lock. MariaDB: `KILL`s every
    /// connection with an open transaction that holds row locks — on this
    /// private server, the `row_lock` holder's. PostgreSQL:
    /// `pg_terminate_backend` of every backend holding a single-key
    /// (64-bit) advisory lock — on this private server, the `advisory`
    /// holder's (fenced's own housekeeping guards are two-key locks).
    /// Evidence: the connection ids or backend pids.
    ///
    /// # Errors
    ///
    /// When no such connection exists or the KILL fails.
    pub async fn kill_lock_connection(&self) -> Result<String, String> {
        let db = match self {
            PrivateStore::MariaDb(db) => db,
            PrivateStore::Postgres(p) => return terminate_advisory_holders(p).await,
            _ => return Err("the connection kill needs MariaDB or PostgreSQL".into()),
        };
        let mut c = admin(db).await?;
        let ids: Vec<u64> = sqlx::query(
            "SELECT trx_mysql_thread_id FROM information_schema.innodb_trx \
             WHERE trx_state = 'RUNNING' AND trx_rows_locked > 0 AND trx_mysql_thread_id <> CONNECTION_ID()",
        )
        .fetch_all(&mut c)
        .await
        .map_err(|e| format!("reading innodb_trx: {e}"))?
        .iter()
        .filter_map(|r| r.try_get::<u64, _>(0).ok())
        .collect();
        if ids.is_empty() {
            return Err("no connection holds a row lock".into());
        }
        for id in &ids {
            sqlx::query(sqlx::AssertSqlSafe(format!("KILL {id}")))
                .execute(&mut c)
                .await
                .map_err(|e| format!("KILL {id}: {e}"))?;
        }
        Ok(format!("KILL of the holding connection(s) {ids:?}"))
    }

    /// The server's own counts of deadlocks (1213) and lock-wait timeouts
    /// (1205) so far (`information_schema.INNODB_METRICS`).
    ///
    /// # Errors
    ///
    /// When this is not MariaDB or the counters cannot be read.
    pub async fn lock_conflicts(&self) -> Result<(u64, u64), String> {
        let PrivateStore::MariaDb(db) = self else {
            return Err("lock-conflict counters need MariaDB".into());
        };
        let mut c = admin(db).await?;
        let rows = sqlx::query(
            "SELECT name, `count` FROM information_schema.INNODB_METRICS \
             WHERE name IN ('lock_deadlocks', 'lock_timeouts')",
        )
        .fetch_all(&mut c)
        .await
        .map_err(|e| format!("reading INNODB_METRICS: {e}"))?;
        let mut out = (0, 0);
        for r in rows {
            let name: String = r.try_get(0).map_err(|e| e.to_string())?;
            let n: i64 = r.try_get(1).map_err(|e| e.to_string())?;
            match name.as_str() {
                "lock_deadlocks" => out.0 = n.max(0) as u64,
                _ => out.1 = n.max(0) as u64,
            }
        }
        Ok(out)
    }
}

/// The slot of `name` and the port of the primary serving it, as the node
/// at `ask` sees the cluster.
async fn slot_primary(ask: &PrivateRedis, name: &str) -> Result<(u16, u16), String> {
    let mut c = ask.admin().await.map_err(|e| e.to_string())?;
    let (slot, (_, port)) = crate::private::cluster_slot_owner(&mut c, name)
        .await
        .map_err(|e| e.to_string())?;
    Ok((slot, port))
}

async fn kill_cluster_primary(c: &PrivateRedisCluster, name: &str) -> Result<String, String> {
    let (slot, old) = slot_primary(c.primary(0), name).await?;
    let victim = c
        .nodes()
        .find(|n| n.port() == old)
        .ok_or_else(|| format!("no node of this cluster on port {old}"))?;
    victim.kill();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let asked = c.nodes().find(|n| n.pid().is_some() && n.port() != old);
        if let Some(n) = asked {
            if let Ok((_, new)) = slot_primary(n, name).await {
                if new != old {
                    return Ok(format!(
                        "primary :{old} of slot {slot} killed; :{new} serves it now"
                    ));
                }
            }
        }
        if Instant::now() > deadline {
            return Err(format!(
                "slot {slot} still served by the killed :{old} 30 s later"
            ));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn kill_sentinel_primary(g: &PrivateSentinelGroup) -> Result<String, String> {
    let old = g.primary.port();
    g.primary.kill();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match g.named_primary().await {
            Ok(new) if new != old => {
                return Ok(format!("primary :{old} killed; the sentinel names :{new}"))
            }
            _ if Instant::now() > deadline => {
                return Err(format!("the sentinel still names :{old} 30 s later"))
            }
            _ => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
}

/// What the conflict injector of a storm run did ([`PrivateStore::inject_lock_conflicts`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Interference {
    /// Cycles that found a fenced statement waiting on the injector's locks.
    pub cycles_with_waiters: u64,
    /// Cycles that asked for exclusive locks with a fenced statement queued
    /// and got them: every fenced statement still queued then was a
    /// deadlock victim (the server's counter says how many).
    pub exclusive_requests: u64,
    /// Deadlock cycles in which the injector itself was the victim.
    pub own_deadlocks: u64,
    /// Holds kept past `innodb_lock_wait_timeout` with fenced statements waiting.
    pub timeout_holds: u64,
    /// The injector's own lock-wait timeouts (1205), to subtract from the
    /// server's count.
    pub own_timeouts: u64,
}

/// Rows the injector updates before it locks anything: InnoDB resolves a
/// deadlock by rolling back the transaction that changed fewer rows, and the
/// storm is about what fenced does when *its* statement is the victim.
const BALLAST_ROWS: usize = 300;

/// The injector keeps its locks this much longer than the private server's
/// `innodb_lock_wait_timeout` (1 s) in its timeout cycles.
const TIMEOUT_HOLD: Duration = Duration::from_millis(1_300);

impl PrivateStore {
    /// Makes the server answer fenced's statements with deadlocks (1213) and
    /// lock-wait timeouts (1205) until `deadline()`, a cycle every `gap`.
    ///
    /// A natural storm of clients on one key seldom makes InnoDB raise either
    /// (each fenced statement is one short autocommit transaction on one
    /// row), so the injector does it on purpose, as a heavy application
    /// transaction would: it updates `BALLAST_ROWS` rows of a scratch table,
    /// takes shared next-key locks on every InnoDB table of the lock schema
    /// (`SELECT … LOCK IN SHARE MODE`: every fenced write to them now waits),
    /// waits until a fenced statement is queued behind it, and then either
    /// asks for exclusive locks on the same rows — a deadlock cycle, whose
    /// victim InnoDB picks as the lighter transaction: fenced's — or keeps
    /// its locks past the server's `innodb_lock_wait_timeout`, so the waiting
    /// statements end with 1205. It rolls back every cycle and writes no
    /// lock row: the grants stay fenced's own.
    ///
    /// # Errors
    ///
    /// When this is not MariaDB, or its admin connection fails.
    pub async fn inject_lock_conflicts(
        &self,
        deadline: impl Fn() -> Instant + Send,
        gap: Duration,
    ) -> Result<Interference, String> {
        let PrivateStore::MariaDb(db) = self else {
            return Err("the lock-conflict injector needs MariaDB".into());
        };
        let mut c = admin(db).await?;
        let rows: Vec<String> = (1..=BALLAST_ROWS).map(|i| format!("({i}, 0)")).collect();
        for sql in [
            "SET SESSION innodb_lock_wait_timeout = 3".to_owned(),
            "CREATE DATABASE IF NOT EXISTS faults_scratch".to_owned(),
            "CREATE TABLE IF NOT EXISTS faults_scratch.ballast \
             (id INT PRIMARY KEY, n BIGINT NOT NULL) ENGINE = InnoDB"
                .to_owned(),
            format!(
                "INSERT IGNORE INTO faults_scratch.ballast (id, n) VALUES {}",
                rows.join(", ")
            ),
        ] {
            exec(&mut c, &sql).await?;
        }
        let tables: Vec<String> = sqlx::query(
            "SELECT TABLE_NAME FROM information_schema.TABLES \
             WHERE TABLE_SCHEMA = 'test' AND ENGINE = 'InnoDB' ORDER BY TABLE_NAME",
        )
        .fetch_all(&mut c)
        .await
        .map_err(|e| format!("listing the lock tables: {e}"))?
        .iter()
        .filter_map(|r| r.try_get::<String, _>(0).ok())
        .map(|t| format!("test.`{}`", t.replace('`', "``")))
        .collect();
        if tables.is_empty() {
            return Err("the private MariaDB has no InnoDB lock table in `test`".into());
        }
        let mut done = Interference::default();
        let mut cycle = 0u64;
        // A cycle needs up to ~2 s (shared locks behind a dying holder, the
        // wait for a waiter, the timeout hold); none starts without it.
        while Instant::now() + gap + Duration::from_secs(2) < deadline() {
            tokio::time::sleep(gap).await;
            cycle += 1;
            // Each kind until it has worked once (a cycle that finds no
            // waiter, or loses its own deadlock, must not use up the few
            // cycles a run has), then alternating.
            let deadlock = if done.exclusive_requests == 0 {
                true
            } else if done.timeout_holds == 0 {
                false
            } else {
                cycle % 2 == 1
            };
            exec(&mut c, "START TRANSACTION").await?;
            let outcome = conflict_cycle(&mut c, &tables, deadlock).await;
            // Ends the cycle whatever happened (a deadlock victim's
            // transaction is rolled back already; this is then a no-op).
            exec(&mut c, "ROLLBACK").await?;
            match outcome? {
                Cycle::NoWaiter => {}
                Cycle::ExclusiveGranted => {
                    done.cycles_with_waiters += 1;
                    done.exclusive_requests += 1;
                }
                Cycle::OwnDeadlock => {
                    done.cycles_with_waiters += 1;
                    done.own_deadlocks += 1;
                }
                Cycle::HeldPastTimeout => {
                    done.cycles_with_waiters += 1;
                    done.timeout_holds += 1;
                }
                Cycle::OwnTimeout => done.own_timeouts += 1,
            }
        }
        Ok(done)
    }
}

/// One injector cycle, inside the injector's transaction.
async fn conflict_cycle(
    c: &mut sqlx::MySqlConnection,
    tables: &[String],
    deadlock: bool,
) -> Result<Cycle, String> {
    exec(c, "UPDATE faults_scratch.ballast SET n = n + 1").await?;
    for t in tables {
        match sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "SELECT * FROM {t} LOCK IN SHARE MODE"
        )))
        .execute(&mut *c)
        .await
        {
            Ok(_) => {}
            Err(e) => return own_conflict(e, "taking shared locks"),
        }
    }
    // Wait (bounded) until a fenced statement queues behind those locks.
    let waiting_until = Instant::now() + Duration::from_millis(700);
    loop {
        let waiting: i64 = sqlx::query_scalar(
            "SELECT COUNT(*) FROM information_schema.INNODB_TRX \
             WHERE trx_state = 'LOCK WAIT' AND trx_mysql_thread_id <> CONNECTION_ID()",
        )
        .fetch_one(&mut *c)
        .await
        .map_err(|e| format!("reading INNODB_TRX: {e}"))?;
        if waiting > 0 {
            break;
        }
        if Instant::now() >= waiting_until {
            return Ok(Cycle::NoWaiter);
        }
        // InnoDB refreshes its INNODB_TRX snapshot only when the last
        // read is more than 0.1 s old: polling faster sees a frozen one.
        tokio::time::sleep(Duration::from_millis(110)).await;
    }
    if !deadlock {
        tokio::time::sleep(TIMEOUT_HOLD).await;
        return Ok(Cycle::HeldPastTimeout);
    }
    for t in tables {
        if let Err(e) = sqlx::raw_sql(sqlx::AssertSqlSafe(format!("SELECT * FROM {t} FOR UPDATE")))
            .execute(&mut *c)
            .await
        {
            return own_conflict(e, "upgrading to exclusive locks");
        }
    }
    Ok(Cycle::ExclusiveGranted)
}

/// How one injector cycle ended.
enum Cycle {
    NoWaiter,
    ExclusiveGranted,
    OwnDeadlock,
    HeldPastTimeout,
    OwnTimeout,
}

fn own_conflict(e: sqlx::Error, doing: &str) -> Result<Cycle, String> {
    let number = match &e {
        sqlx::Error::Database(db) => db
            .try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>()
            .map(|m| m.number()),
        _ => None,
    };
    match number {
        Some(1213) => Ok(Cycle::OwnDeadlock),
        Some(1205) => Ok(Cycle::OwnTimeout),
        _ => Err(format!("conflict injector, {doing}: {e}")),
    }
}

async fn exec(c: &mut sqlx::MySqlConnection, sql: &str) -> Result<(), String> {
    sqlx::raw_sql(sqlx::AssertSqlSafe(sql.to_owned()))
        .execute(c)
        .await
        .map(drop)
        .map_err(|e| format!("conflict injector, `{sql}`: {e}"))
}

async fn admin(db: &PrivateMariaDb) -> Result<sqlx::MySqlConnection, String> {
    let opts = MySqlConnectOptions::new()
        .socket(db.socket())
        .username("root")
        .database("mysql");
    sqlx::MySqlConnection::connect_with(&opts)
        .await
        .map_err(|e| format!("admin connection to the private MariaDB: {e}"))
}

/// `pg_terminate_backend` of every backend holding a 64-bit advisory lock
/// (`objsubid = 1`), waiting (at most 5 s each) until it has exited.
async fn terminate_advisory_holders(p: &PrivatePostgres) -> Result<String, String> {
    use fenced::postgres::sqlx::{Connection as _, PgConnection};
    let mut c = PgConnection::connect(&p.url())
        .await
        .map_err(|e| format!("admin connection to the private PostgreSQL: {e}"))?;
    let pids: Vec<i32> = fenced::postgres::sqlx::query_scalar(
        "SELECT DISTINCT pid FROM pg_locks WHERE locktype = 'advisory' AND granted \
         AND objsubid = 1 AND pid <> pg_backend_pid()",
    )
    .fetch_all(&mut c)
    .await
    .map_err(|e| format!("reading pg_locks: {e}"))?;
    if pids.is_empty() {
        return Err("no backend holds an advisory lock".into());
    }
    for pid in &pids {
        let ended: bool =
            fenced::postgres::sqlx::query_scalar("SELECT pg_terminate_backend($1, 5000)")
                .bind(pid)
                .fetch_one(&mut c)
                .await
                .map_err(|e| format!("pg_terminate_backend({pid}): {e}"))?;
        if !ended {
            return Err(format!("backend {pid} did not end within 5 s"));
        }
    }
    let _ = c.close().await;
    Ok(format!(
        "pg_terminate_backend of the holding backend(s) {pids:?}"
    ))
}

/// Kills the ensemble's leader (SIGKILL) and waits until one of the two
/// others says it leads (`srvr`).
async fn kill_zookeeper_leader(z: &PrivateZooKeeper) -> Result<String, String> {
    let index = z
        .leader()
        .await
        .ok_or("finding the ZooKeeper leader: no member says it leads")?;
    let pid = z.pid(index);
    z.kill(index);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        for j in (0..z.members().len()).filter(|j| *j != index) {
            if z.mode(j).await.is_ok_and(|m| m == "leader") {
                return Ok(format!(
                    "leader m{} (pid {}) killed; new leader m{}",
                    index + 1,
                    pid.map_or_else(|| "?".to_owned(), |p| p.to_string()),
                    j + 1
                ));
            }
        }
        if tokio::time::Instant::now() > deadline {
            return Err(format!("no new leader 30 s after killing m{}", index + 1));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The leader's member id and index, asking every member but `skip`.
async fn etcd_leader(e: &PrivateEtcd, skip: Option<usize>) -> Result<(u64, usize), String> {
    let mut last = String::from("no member answered");
    for i in 0..e.members().len() {
        if Some(i) == skip {
            continue;
        }
        let mut c = match e.admin_client(i).await {
            Ok(c) => c,
            Err(err) => {
                last = err.to_string();
                continue;
            }
        };
        let Ok(Ok(status)) = tokio::time::timeout(Duration::from_secs(2), c.status()).await else {
            continue;
        };
        let leader = status.leader();
        if leader == 0 {
            continue;
        }
        // Which member is it? Ask each for its own id.
        for j in 0..e.members().len() {
            if Some(j) == skip {
                continue;
            }
            let Ok(mut cj) = e.admin_client(j).await else {
                continue;
            };
            if let Ok(Ok(s)) = tokio::time::timeout(Duration::from_secs(2), cj.status()).await {
                if s.header().map(|h| h.member_id()) == Some(leader) {
                    return Ok((leader, j));
                }
            }
        }
        last = format!("leader {leader:x} is none of the members asked");
    }
    Err(format!("finding the etcd leader: {last}"))
}
