//! Every fenced backend / strategy compiled in, through its driver's
//! `connect(url)` (the same path as `fenced::connect`), one store per task.

use std::{collections::HashMap, sync::Arc, time::Duration};

use async_trait::async_trait;
use fenced_api::{
    permits::Permits, DistributedLock, Driver, Error, Lease, LockClient, LockGuard, LockKey,
    LockOptions, SemaphoreStore, WaitPolicy,
};
use futures_util::StreamExt as _;
use tokio::time::Instant;

use crate::{
    peers,
    runner::{ChildSpec, Implementation, Locker, Role},
    stats::Kind,
    stats::{Server, Servers},
    BenchError, Scenario, ScenarioKind,
};

/// Lease TTL in the loop scenarios: far longer than a cell, so no renewal is needed.
const LOOP_TTL: Duration = Duration::from_secs(30);
/// Lease TTL in the many-keys scenario: `LockClient`'s default, renewed
/// every 10 s; the cell holds every lock longer than that after the last
/// is taken, so each is renewed at least once, and 100 000 held locks are
/// 10 000 renewals a second.
const MANY_TTL: Duration = LockOptions::DEFAULT_TTL;
/// Acquisitions (and releases) in flight at once through the many-keys
/// scenario's one client.
const MANY_IN_FLIGHT: usize = 32;

/// The implementations of one run: one per fenced backend/strategy in
/// `drivers` (SQLite in a temporary directory, MySQL `unique_key`,
/// `row_lock` and `optimistic`, Redis, etcd, ZooKeeper and PostgreSQL
/// `lease` and `advisory` if their drivers are compiled in), then the peers
/// and floors. `only`, when not empty, keeps the ones it selects: a whole
/// name selects that one (`fenced/redis`), any other string every name that
/// contains it (`redis`, `mysql`, `fenced/`, `peer/`; `zookeeper,zk-` for
/// every ZooKeeper row).
///
/// Every implementation gets its own namespace (table, prefix) named after a
/// fresh id; [`Implementation::cleanup`] removes it.
///
/// # Errors
///
/// When a migration (schema creation) fails or the temporary directory
/// cannot be created. Unreachable servers surface later, per cell.
pub async fn implementations(
    drivers: &[Driver],
    servers: &Servers,
    only: &[String],
) -> Result<Vec<Box<dyn Implementation>>, BenchError> {
    let id = uuid::Uuid::new_v4().simple().to_string()[..8].to_owned();
    let mut candidates = Vec::new();
    let mut tmp = None;
    for d in drivers {
        let mut variants: Vec<(String, String, Server)> = Vec::new();
        match d.name {
            "sqlite" => {
                let dir = tempfile::tempdir()?;
                let path = dir.path().join("bench.db");
                variants.push((
                    "fenced/sqlite".into(),
                    format!("sqlite://{}", path.display()),
                    Server::None,
                ));
                tmp = Some(Arc::new(dir));
            }
            "mysql" => {
                for s in ["unique_key", "row_lock", "optimistic"] {
                    variants.push((
                        format!("fenced/mysql-{s}"),
                        format!(
                            "{}?strategy={s}&table=fb_{id}_{}&max_connections=2",
                            servers.mysql,
                            &s[..3]
                        ),
                        Server::MySql,
                    ));
                }
            }
            // The cluster row: every lock on the shard of its key's slot.
            "redis" => {
                variants.push((
                    "fenced/redis".into(),
                    with_param(&servers.redis, &format!("prefix=fb{id}")),
                    Server::Redis,
                ));
                variants.push((
                    "fenced/redis-cluster".into(),
                    with_param(&servers.redis_cluster, &format!("prefix=fb{id}")),
                    Server::RedisCluster,
                ));
            }
            "etcd" => variants.push((
                "fenced/etcd".into(),
                format!("etcd://{}/fenced-bench-{id}", servers.etcd_host_port()),
                Server::Etcd,
            )),
            // A lock whose TTL exceeds the client's session timeout gets a
            // session of its own: a session as long as LOOP_TTL keeps every
            // lock of a task on its one session (one connection per task, as
            // for the peers; two would pass ZooKeeper's default limit of 60
            // connections per address in the 50-task cells).
            "zookeeper" => variants.push((
                "fenced/zookeeper".into(),
                servers.zookeeper_url(&format!(
                    "{}?session_timeout={}s",
                    zk_namespace(&id),
                    LOOP_TTL.as_secs()
                )),
                Server::ZooKeeper,
            )),
            // A statement pool of 2 as for MySQL: one connection in use,
            // one being given back (sqlx checks a returned connection with a
            // round trip before it can be used again).
            "postgres" => {
                for s in ["lease", "advisory"] {
                    variants.push((
                        format!("fenced/postgres-{s}"),
                        servers.postgres_with(&format!(
                            "strategy={s}&table=fb_{id}_{}&max_connections=2",
                            &s[..3]
                        )),
                        Server::Postgres,
                    ));
                }
            }
            _ => {}
        }
        candidates.extend(
            variants
                .into_iter()
                .map(|(name, url, server)| (name, url, server, *d, tmp.clone())),
        );
    }
    let peers = peers::peers(servers, &id);
    // Chosen by name among all of them (see `selected`).
    let (keep_fenced, keep_peers): (Vec<bool>, Vec<bool>) = {
        let names: Vec<&str> = candidates
            .iter()
            .map(|c| c.0.as_str())
            .chain(peers.iter().map(|p| p.name()))
            .collect();
        (
            candidates
                .iter()
                .map(|c| selected(only, &names, &c.0))
                .collect(),
            peers
                .iter()
                .map(|p| selected(only, &names, p.name()))
                .collect(),
        )
    };
    let mut out: Vec<Box<dyn Implementation>> = Vec::new();
    for ((name, url, server, d, tmp), keep) in candidates.into_iter().zip(keep_fenced) {
        if !keep {
            continue;
        }
        if let Some(m) = d.migrate {
            m(url.clone()).await.map_err(|e| {
                BenchError::new(format!(
                    "{name}: migrate failed (is the server up? scripts/services.sh): {e}"
                ))
            })?;
        }
        out.push(Box::new(FencedImpl {
            name,
            url,
            server,
            driver: d,
            id: id.clone(),
            _tmp: tmp,
            servers: servers.clone(),
        }));
    }
    out.extend(
        peers
            .into_iter()
            .zip(keep_peers)
            .filter_map(|(p, keep)| keep.then_some(p)),
    );
    Ok(out)
}

/// Whether `--only` (`only`) selects the implementation `name` of all
/// `names`: every one when `only` is empty; an entry that is the whole name
/// of an implementation selects that one alone (`fenced/redis`, not also
/// `fenced/redis-cluster`); any other entry, every name that contains it
/// (`redis`, `fenced/mysql`, `peer/`).
fn selected(only: &[String], names: &[&str], name: &str) -> bool {
    only.is_empty()
        || only.iter().any(|o| {
            if names.contains(&o.as_str()) {
                o == name
            } else {
                name.contains(o.as_str())
            }
        })
}

/// A child process's copy of the `fenced/*` implementation `spec` (its
/// parent's store URL, so its namespace too).
pub(crate) fn for_child(
    drivers: &[Driver],
    servers: &Servers,
    spec: &ChildSpec,
    url: &str,
) -> Result<Box<dyn Implementation>, BenchError> {
    let scheme = url.split_once("://").map_or("", |(s, _)| s);
    let driver = drivers
        .iter()
        .find(|d| d.schemes.contains(&scheme))
        .ok_or_else(|| BenchError::new(format!("no driver for `{scheme}://` in this build")))?;
    Ok(Box::new(FencedImpl {
        name: spec.name.clone(),
        url: url.to_owned(),
        server: Server::None,
        driver: *driver,
        id: spec.id.clone(),
        _tmp: None,
        servers: servers.clone(),
    }))
}

/// The znode fenced/zookeeper's locks live under in the run `id`.
/// `url` with `param` (`name=value`) added to its query (before a
/// `#fragment`).
fn with_param(url: &str, param: &str) -> String {
    let (base, fragment) = match url.split_once('#') {
        Some((b, f)) => (b, format!("#{f}")),
        None => (url, String::new()),
    };
    let sep = if base.contains('?') { '&' } else { '?' };
    format!("{base}{sep}{param}{fragment}")
}

fn zk_namespace(id: &str) -> String {
    format!("/fenced-bench-{id}")
}

struct FencedImpl {
    name: String,
    url: String,
    server: Server,
    driver: Driver,
    id: String,
    _tmp: Option<Arc<tempfile::TempDir>>,
    servers: Servers,
}

impl std::fmt::Debug for FencedImpl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FencedImpl")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

#[async_trait]
impl Implementation for FencedImpl {
    fn name(&self) -> &str {
        &self.name
    }

    fn kind(&self) -> Kind {
        Kind::Fenced
    }

    fn server(&self) -> Server {
        self.server
    }

    fn note(&self) -> &str {
        match self.name.as_str() {
            "fenced/postgres-lease" => {
                "acquire: 1 statement (INSERT … ON CONFLICT (lock_key) DO UPDATE … WHERE expired \
                 RETURNING token, the token a nextval), a durable commit (the WAL flushed) when \
                 granted, not waited for when refused; release: 1 (UPDATE in a CTE with \
                 pg_notify), committed without waiting for the flush; 2 round trips, 1 WAL flush \
                 per cycle, each statement on a hot connection cached in front of the pool \
                 (no ping per checkout or return). A waiter \
                 tries again when a NOTIFY of the key reaches its process (another process \
                 released) or at once (its own process released), else every 500 ms: every \
                 process's first waiter tries, the first to commit wins"
            }
            "fenced/postgres-advisory" => {
                "acquire: 1 statement on a connection held for the lock (kept in a small idle \
                 cache between locks): pg_try_advisory_lock(hash) and, granted, the token \
                 (nextval) and the holder row (an unlogged table: the commit waits for a WAL \
                 flush only when nextval logs the sequence ahead, 1 grant in 32); taken: then \
                 pg_advisory_lock(hash) in the server's FIFO queue (lock_timeout = the wait \
                 bound) and the token statement; release: 1 (the holder row cleared, \
                 pg_advisory_unlock), committed without waiting for the flush; 2 round trips \
                 per cycle uncontended; a key's first use registers it (1 more)"
            }
            _ => "",
        }
    }

    fn runs(&self, scenario: &Scenario) -> bool {
        // row_lock keeps one open transaction, so one pooled connection, per
        // held lock: many held keys exhaust the pool (and the server's
        // max_connections long before thousands); advisory holds a session per
        // held lock.
        let one_connection_per_lock =
            self.name.ends_with("row_lock") || self.name.ends_with("postgres-advisory");
        // A cluster renews lease by lease (a script's keys share one slot):
        // 100 000 held locks are 10 000 scripts a second, not a cell's
        // worth of batches.
        let renews_one_by_one = self.server == Server::RedisCluster;
        !((one_connection_per_lock || renews_one_by_one)
            && matches!(scenario.kind, ScenarioKind::ManyKeys { .. }))
    }

    fn child_spec(&self) -> Option<ChildSpec> {
        Some(ChildSpec {
            name: self.name.clone(),
            id: self.id.clone(),
            url: Some(self.url.clone()),
        })
    }

    async fn locker(&self, scenario: &Scenario) -> Result<Box<dyn Locker>, BenchError> {
        let store = (self.driver.connect)(self.url.clone()).await?;
        if let ScenarioKind::ManyKeys { .. } = scenario.kind {
            let client = LockClient::builder(store)
                .ttl(MANY_TTL)
                .wait(WaitPolicy::NoWait)
                .build()?;
            return Ok(Box::new(ClientLocker {
                client,
                held: HashMap::new(),
            }));
        }
        Ok(Box::new(FencedLocker {
            semaphores: store.semaphores(),
            permit_cell: scenario.is_family(),
            store,
            held: HashMap::new(),
        }))
    }

    async fn cleanup(&self) -> Result<(), BenchError> {
        match self.server {
            Server::MySql => {
                let table = self
                    .url
                    .split("table=")
                    .nth(1)
                    .and_then(|t| t.split('&').next())
                    .unwrap_or_default();
                peers::drop_tables(&self.servers, &[table]).await
            }
            Server::Redis => {
                peers::redis_delete(&self.servers.redis, &format!("{{fb{}*", self.id)).await
            }
            Server::RedisCluster => {
                let primaries = crate::stats::cluster_primaries(&self.servers)
                    .await
                    .map_err(BenchError::new)?;
                for node in primaries {
                    peers::redis_delete(&node, &format!("{{fb{}*", self.id)).await?;
                }
                Ok(())
            }
            // The namespace is persistent (the queues under it are
            // containers, the entries ephemeral).
            Server::ZooKeeper => {
                peers::zk_delete_tree(&self.servers, &zk_namespace(&self.id)).await
            }
            Server::Postgres => {
                let table = self
                    .url
                    .split("table=")
                    .nth(1)
                    .and_then(|t| t.split('&').next())
                    .unwrap_or_default();
                peers::pg_drop(&self.servers, table).await
            }
            // etcd keys live on leases and vanish by themselves; SQLite's
            // directory is removed with the last `Arc<TempDir>`.
            Server::Etcd | Server::None => Ok(()),
        }
    }
}

/// One task on the raw trait: acquire with a wait bound, release. Permits
/// and reader-writer grants are taken from the store's semaphores and given
/// back there.
struct FencedLocker {
    store: Arc<dyn DistributedLock>,
    held: HashMap<String, Lease>,
    semaphores: Option<Arc<dyn SemaphoreStore>>,
    /// A family cell: every lease is a permit.
    permit_cell: bool,
}

/// Loop-cell options: the loop TTL, waiting until `give_up`.
fn wait_until(give_up: Instant) -> Result<LockOptions, BenchError> {
    let wait = give_up
        .saturating_duration_since(Instant::now())
        .max(Duration::from_millis(1));
    Ok(LockOptions::builder()
        .ttl(LOOP_TTL)
        .wait_timeout(wait)
        .build()?)
}

#[async_trait]
impl Locker for FencedLocker {
    async fn acquire(&mut self, key: &str, give_up: Instant) -> Result<bool, BenchError> {
        let opts = wait_until(give_up)?;
        let k = LockKey::new(key)?;
        match self.store.acquire(&k, &opts).await {
            Ok(lease) => {
                self.held.insert(key.to_owned(), lease);
                Ok(true)
            }
            Err(Error::Timeout { .. }) => Ok(false),
            Err(e) => Err(e.into()),
        }
    }

    async fn acquire_as(
        &mut self,
        key: &str,
        role: Role,
        give_up: Instant,
    ) -> Result<bool, BenchError> {
        let permits = match role {
            Role::Permit(n) => Permits::semaphore(n)?,
            Role::Read => Permits::read(),
            Role::Write => Permits::write(),
        };
        let Some(sems) = self.semaphores.clone() else {
            return Err(BenchError::new("this store has no semaphores"));
        };
        let opts = wait_until(give_up)?;
        let k = LockKey::new(key)?;
        match sems.acquire_permits(&k, permits, &opts).await {
            Ok(lease) => {
                self.held.insert(key.to_owned(), lease);
                Ok(true)
            }
            Err(Error::Timeout { .. }) => Ok(false),
            Err(e) => Err(e.into()),
        }
    }

    async fn release(&mut self, key: &str) -> Result<(), BenchError> {
        let lease = crate::runner::take_held(&mut self.held, key)?;
        let released = match (&self.semaphores, self.permit_cell) {
            (Some(sems), true) => sems.release(&lease).await?,
            _ => self.store.release(&lease).await?,
        };
        match released {
            fenced_api::ReleaseOutcome::Released => Ok(()),
            other => Err(BenchError::new(format!("release of `{key}`: {other:?}"))),
        }
    }
}

/// The many-keys locker: `LockClient` guards, renewed by the watchdog.
struct ClientLocker {
    client: LockClient,
    held: HashMap<String, LockGuard>,
}

#[async_trait]
impl Locker for ClientLocker {
    async fn acquire(&mut self, key: &str, _give_up: Instant) -> Result<bool, BenchError> {
        match self.client.try_acquire(key).await? {
            Some(g) => {
                self.held.insert(key.to_owned(), g);
                Ok(true)
            }
            None => Ok(false),
        }
    }

    async fn release(&mut self, key: &str) -> Result<(), BenchError> {
        let g = crate::runner::take_held(&mut self.held, key)?;
        g.release().await.map_err(Into::into)
    }

    fn lost(&self) -> usize {
        self.held.values().filter(|g| g.is_lost()).count()
    }

    /// [`MANY_IN_FLIGHT`] tries at a time through the one client, as an
    /// application's tasks would share it.
    async fn acquire_each(
        &mut self,
        keys: &[String],
        _give_up: Duration,
    ) -> Vec<Result<bool, BenchError>> {
        let client = &self.client;
        let tries: Vec<_> = keys
            .iter()
            .map(|k| client.try_acquire(k.as_str()))
            .collect();
        let got: Vec<_> = futures_util::stream::iter(tries)
            .buffered(MANY_IN_FLIGHT)
            .collect()
            .await;
        keys.iter()
            .zip(got)
            .map(|(key, got)| match got {
                Ok(Some(g)) => {
                    self.held.insert(key.clone(), g);
                    Ok(true)
                }
                Ok(None) => Ok(false),
                Err(e) => Err(e.into()),
            })
            .collect()
    }

    async fn release_each(&mut self, keys: &[String]) -> Vec<Result<(), BenchError>> {
        let releases: Vec<_> = keys
            .iter()
            .map(|key| {
                let guard = self.held.remove(key);
                let key = key.clone();
                async move {
                    match guard {
                        Some(g) => g.release().await.map_err(Into::into),
                        None => Err(BenchError::new(format!(
                            "release of `{key}`, which is not held"
                        ))),
                    }
                }
            })
            .collect();
        futures_util::stream::iter(releases)
            .buffered(MANY_IN_FLIGHT)
            .collect()
            .await
    }

    fn in_flight(&self) -> usize {
        MANY_IN_FLIGHT
    }
}

#[cfg(test)]
mod tests {
    use super::{selected, with_param};

    #[test]
    fn a_whole_name_selects_that_implementation_alone() {
        let names = [
            "fenced/redis",
            "fenced/redis-cluster",
            "fenced/mysql-row_lock",
            "peer/rslock",
        ];
        let only = |o: &[&str]| -> Vec<&str> {
            let o: Vec<String> = o.iter().map(|s| (*s).to_owned()).collect();
            names
                .iter()
                .copied()
                .filter(|n| selected(&o, &names, n))
                .collect()
        };
        assert_eq!(only(&[]), names);
        assert_eq!(only(&["fenced/redis"]), ["fenced/redis"]);
        assert_eq!(only(&["redis"]), ["fenced/redis", "fenced/redis-cluster"]);
        assert_eq!(
            only(&["fenced/redis", "peer/"]),
            ["fenced/redis", "peer/rslock"]
        );
        assert_eq!(only(&["fenced/mysql"]), ["fenced/mysql-row_lock"]);
        assert!(only(&["consul"]).is_empty());
    }

    #[test]
    fn a_parameter_joins_the_query_the_url_has() {
        assert_eq!(
            with_param("redis://h:1", "prefix=p"),
            "redis://h:1?prefix=p"
        );
        assert_eq!(
            with_param("redis+cluster://h:1?address_map=a:1>b:2", "prefix=p"),
            "redis+cluster://h:1?address_map=a:1>b:2&prefix=p"
        );
        assert_eq!(
            with_param("rediss://h:1#insecure", "prefix=p"),
            "rediss://h:1?prefix=p#insecure"
        );
    }
}
