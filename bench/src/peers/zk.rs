//! The ZooKeeper floor and the `zookeeper-client` crate's own lock recipe
//! (`Client::lock`), each on one session per task, and the cleanup of a
//! run's znodes.

use std::{collections::HashMap, time::Duration};

use async_trait::async_trait;
use tokio::time::Instant;
use zookeeper_client as zk;

use super::PeerKind;
use crate::{runner::Locker, stats::Servers, BenchError};

/// Session timeout asked for by every peer session: fenced's ZooKeeper
/// default, so that both sides ping alike.
const SESSION_TIMEOUT: Duration = Duration::from_secs(10);
/// Bound on establishing a session (the crate would keep trying).
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Bound on seeing a released lock node deleted: a release that never
/// lands is an error, not a stuck cell.
const RELEASE_BOUND: Duration = Duration::from_secs(10);

fn err(what: &str, e: zk::Error) -> BenchError {
    BenchError::new(format!("zookeeper {what}: {e}"))
}

/// Where the peers of the run `id` keep their znodes.
pub(super) fn root(id: &str) -> String {
    format!("/fenced-bench-{id}-peer")
}

/// A new session on the servers of [`Servers::zookeeper`].
async fn connect(servers: &Servers) -> Result<zk::Client, BenchError> {
    let (hosts, user) = servers.zookeeper_hosts();
    let mut connector = zk::Client::connector()
        .with_session_timeout(SESSION_TIMEOUT)
        .with_fail_eagerly();
    if let Some(user_password) = user {
        connector = connector.with_auth("digest", user_password.as_bytes());
    }
    match tokio::time::timeout(CONNECT_TIMEOUT, connector.connect(&hosts)).await {
        Ok(client) => client.map_err(|e| err(&format!("connect to {hosts}"), e)),
        Err(_) => Err(BenchError::new(format!(
            "zookeeper: no session from {hosts} within {CONNECT_TIMEOUT:?} (is it up? scripts/services.sh)"
        ))),
    }
}

pub(super) async fn locker(
    kind: PeerKind,
    servers: &Servers,
    id: &str,
) -> Result<Box<dyn Locker>, BenchError> {
    let client = connect(servers).await?;
    Ok(if kind == PeerKind::ZkExists {
        Box::new(ExistsLocker {
            client,
            path: format!("{}/floor", root(id)),
        })
    } else {
        Box::new(RecipeLocker {
            client,
            root: root(id),
            held: HashMap::new(),
        })
    })
}

/// The ZooKeeper floor: acquire = one `exists`, release = one `exists`
/// (of a node that is not there: a read served from memory, nothing
/// written).
struct ExistsLocker {
    client: zk::Client,
    path: String,
}

#[async_trait]
impl Locker for ExistsLocker {
    async fn acquire(&mut self, _: &str, _: Instant) -> Result<bool, BenchError> {
        self.client
            .check_stat(&self.path)
            .await
            .map_err(|e| err("exists", e))?;
        Ok(true)
    }
    async fn release(&mut self, _: &str) -> Result<(), BenchError> {
        self.client
            .check_stat(&self.path)
            .await
            .map_err(|e| err("exists", e))?;
        Ok(())
    }
}

/// `Client::lock` as its docs describe it: a Curator-compatible prefix
/// (`<dir>/_c_<uuid>-lock-<sequence>`, as `InterProcessMutex` names its
/// nodes), ancestors created on demand (as containers, so the server
/// removes them once empty, like fenced's queue nodes), the wait bounded by
/// dropping the future (the method is cancellation safe).
///
/// The recipe's only release is dropping the lock, which deletes the node
/// from a spawned task. So that the cycle is timed to the server's
/// acknowledgement like every other row's release, `release` then waits
/// until the node is gone: one `exists` with a watch, and the deletion
/// event when the `exists` overtook the delete.
struct RecipeLocker {
    client: zk::Client,
    root: String,
    held: HashMap<String, zk::OwnedLockClient>,
}

#[async_trait]
impl Locker for RecipeLocker {
    async fn acquire(&mut self, key: &str, give_up: Instant) -> Result<bool, BenchError> {
        let dir = format!("{}/{key}", self.root);
        let prefix = zk::LockPrefix::new_curator(&dir, "lock-").map_err(|e| err("lock", e))?;
        let options = zk::LockOptions::new(zk::Acls::anyone_all())
            .with_ancestor_options(zk::CreateMode::Container.with_acls(zk::Acls::anyone_all()))
            .map_err(|e| err("lock", e))?;
        match tokio::time::timeout_at(give_up, self.client.lock(prefix, b"", options)).await {
            Ok(Ok(lock)) => {
                self.held.insert(key.to_owned(), lock.into_owned());
                Ok(true)
            }
            Ok(Err(e)) => Err(err("lock", e)),
            // Dropped while waiting: the recipe deletes its node itself.
            Err(_) => Ok(false),
        }
    }

    async fn release(&mut self, key: &str) -> Result<(), BenchError> {
        let lock = crate::runner::take_held(&mut self.held, key)?;
        let path = lock.lock_path().to_owned();
        drop(lock);
        let (stat, watcher) = self
            .client
            .check_and_watch_stat(&path)
            .await
            .map_err(|e| err("exists", e))?;
        if stat.is_none() {
            return Ok(());
        }
        match tokio::time::timeout(RELEASE_BOUND, watcher.changed()).await {
            Ok(event) if event.event_type == zk::EventType::NodeDeleted => Ok(()),
            Ok(event) => Err(BenchError::new(format!(
                "zookeeper: waiting for the released node {path} to go, got {event:?}"
            ))),
            Err(_) => Err(BenchError::new(format!(
                "zookeeper: the released node {path} was still there after {RELEASE_BOUND:?}"
            ))),
        }
    }
}

/// Deletes `root` and everything under it, best effort: what is gone or
/// still in use (a node of a session that has not ended yet) is left to
/// the server (ephemeral nodes die with their sessions, empty containers
/// are reaped).
pub(crate) async fn delete_tree(servers: &Servers, root: &str) -> Result<(), BenchError> {
    let client = connect(servers).await?;
    // Parents before children in `nodes`; deleted in reverse.
    let mut nodes = vec![root.to_owned()];
    let mut next = 0;
    while next < nodes.len() {
        let parent = nodes[next].clone();
        next += 1;
        match client.list_children(&parent).await {
            Ok(children) => nodes.extend(children.into_iter().map(|c| format!("{parent}/{c}"))),
            Err(zk::Error::NoNode) => {}
            Err(e) => return Err(err(&format!("listing {parent}"), e)),
        }
    }
    // Siblings in one batch: the requests are sent when the calls are made
    // and answered in order, so a batch costs about one round trip.
    let mut level_end = nodes.len();
    while level_end > 0 {
        let parent_of_last = nodes[level_end - 1]
            .rsplit_once('/')
            .map(|(p, _)| p.to_owned());
        let start = nodes[..level_end]
            .iter()
            .rposition(|n| n.rsplit_once('/').map(|(p, _)| p.to_owned()) != parent_of_last)
            .map_or(0, |i| i + 1);
        let pending: Vec<_> = nodes[start..level_end]
            .iter()
            .map(|n| client.delete(n, None))
            .collect();
        for (n, done) in nodes[start..level_end].iter().zip(pending) {
            match done.await {
                Ok(()) | Err(zk::Error::NoNode | zk::Error::NotEmpty) => {}
                Err(e) => return Err(err(&format!("deleting {n}"), e)),
            }
        }
        level_end = start;
    }
    Ok(())
}
