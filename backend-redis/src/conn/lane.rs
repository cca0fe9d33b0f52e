//! Where a write runs, and how `WAIT` confirms it (`min_replicas`): see
//! [`Lane`].

use std::{future::Future, pin::Pin, sync::Arc, time::Duration};

use futures_util::future::BoxFuture;

use fenced_api::{Error, Lease, LockKey, Result};
use redis::{
    aio::{ConnectionLike, MultiplexedConnection},
    cluster_async::ClusterConnection,
    AsyncConnectionConfig, Cmd, ErrorKind, FromRedisValue, Pipeline, RedisError, RedisFuture,
    RedisResult, ScriptInvocation, ServerErrorKind, Value,
};

use super::{until_run, Conn, Link};
use crate::{error, scripts::millis_ceil};

/// At most this many idle [`Lane`] connections are kept; more are opened
/// while more replicated writes run at once, and closed after.
const MAX_IDLE_LANES: usize = 16;

impl Conn {
    /// Where the next write runs: see [`Lane`]. Without `min_replicas` the
    /// shared connection; with it, on one server, an idle connection of
    /// this client's own or, when none is idle, a new one (within the
    /// connect timeout), and in a Cluster the same with cluster connections,
    /// on which each write goes out with its `WAIT`.
    pub(crate) async fn lane(&self) -> Result<Lane> {
        let config = &self.shared.config;
        if config.min_replicas == 0 {
            return Ok(self.shared_lane());
        }
        let ((client, link), generation) =
            self.read_primary(|p| (p.client.clone(), p.link.clone()));
        let kind = match (client, link) {
            (Some(client), _) => self.own_lane(&client, generation).await?,
            (
                None,
                Link::Cluster {
                    waits: Some(opener),
                    ..
                },
            ) => self.paired_lane(&opener).await?,
            (None, _) => {
                return Err(error::protocol(
                    "replicated writes need their own connection, and this client has none",
                ))
            }
        };
        Ok(Lane {
            conn: self.clone(),
            late: None,
            kind,
        })
    }

    /// One server: an idle connection of the primary's generation, or a new
    /// one.
    async fn own_lane(&self, client: &redis::Client, generation: u64) -> Result<LaneKind> {
        let config = &self.shared.config;
        let idle = {
            let mut lanes = self.shared.lanes.lock().unwrap_or_else(|p| p.into_inner());
            // Connections to a former primary are dropped on the way.
            std::iter::from_fn(|| lanes.pop()).find(|(g, _)| *g == generation)
        };
        let conn = match idle {
            Some((_, conn)) => conn,
            None => {
                let settings = AsyncConnectionConfig::new()
                    .set_connection_timeout(Some(config.connect_timeout))
                    .set_response_timeout(None);
                self.bounded_by(
                    config.connect_timeout + config.operation_timeout,
                    "opening a connection for a replicated write",
                    client.get_multiplexed_async_connection_with_config(&settings),
                )
                .await?
            }
        };
        Ok(LaneKind::Own {
            conn,
            generation,
            ready: true,
        })
    }

    /// A Cluster: an idle cluster connection, or a new one from `opener`.
    async fn paired_lane(&self, opener: &redis::cluster::ClusterClient) -> Result<LaneKind> {
        let config = &self.shared.config;
        let idle = self
            .shared
            .cluster_lanes
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .pop();
        let conn = match idle {
            Some(conn) => conn,
            None => {
                self.bounded_by(
                    config.connect_timeout + config.operation_timeout,
                    "opening a cluster connection for a replicated write",
                    opener.get_async_connection(),
                )
                .await?
            }
        };
        Ok(LaneKind::Paired {
            conn,
            acked: None,
            ready: true,
        })
    }

    /// The shared connection as a lane, for writes no `WAIT` follows.
    pub(crate) fn shared_lane(&self) -> Lane {
        Lane {
            conn: self.clone(),
            late: None,
            kind: LaneKind::Shared(self.manager()),
        }
    }

    /// Keeps an idle lane's connection for the next replicated write, unless
    /// it goes to a former primary or enough are idle already.
    fn put_back(&self, generation: u64, conn: MultiplexedConnection) {
        let mut lanes = self.shared.lanes.lock().unwrap_or_else(|p| p.into_inner());
        if generation == self.generation() && lanes.len() < MAX_IDLE_LANES {
            lanes.push((generation, conn));
        }
    }

    /// The same for a Cluster's connection, unless enough are idle.
    fn put_back_paired(&self, conn: ClusterConnection) {
        let mut idle = self
            .shared
            .cluster_lanes
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        if idle.len() < MAX_IDLE_LANES {
            idle.push(conn);
        }
    }

    /// With `min_replicas` ≥ 1: waits (`WAIT`, on the lane's own connection)
    /// until that many replicas acknowledged every write made on it — the
    /// `what` just made there last — or the replica timeout passed; fewer
    /// is a retryable error (and, following Sentinel, a reason to ask where
    /// the primary is: replicas that stopped acknowledging may follow a new
    /// one). On the shared lane (no `min_replicas`) there is nothing to wait
    /// for.
    pub(crate) async fn confirm(&self, lane: &mut Lane, key: &LockKey, what: &str) -> Result<()> {
        let n = self.shared.config.min_replicas;
        let wait = self.shared.config.replica_timeout;
        let acked: i64 = match &mut lane.kind {
            LaneKind::Shared(_) => return Ok(()),
            LaneKind::Own { conn, ready, .. } => {
                *ready = false;
                let acked = self
                    .bounded("WAIT", async {
                        wait_cmd(n, wait).query_async(conn).await.map_err(demoted)
                    })
                    .await?;
                *ready = true;
                acked
            }
            // Sent with the write; taken once, so a second confirm of the
            // same write cannot pass on a stale count.
            LaneKind::Paired { acked, .. } => match acked.take() {
                Some(Ok(n)) => n,
                Some(Err(e)) => return Err(error::map_with(e, self.topology())),
                None => {
                    return Err(error::protocol(format!(
                        "no WAIT reply came with the {what} of `{key}`"
                    )))
                }
            },
        };
        if acked >= i64::from(n) {
            return Ok(());
        }
        tracing::warn!(key = %key, acked, min_replicas = n, "too few replicas acknowledged a {what}");
        if self.shared.follow.is_some() {
            self.follow_primary().await;
        }
        Err(Error::backend(
            error::BACKEND,
            true,
            format!(
                "only {acked} of the {n} replicas asked for (min_replicas) acknowledged the {what} \
                 of `{key}` within {wait:?} at {}",
                self.shared.config.display_url
            ),
        ))
    }

    /// [`confirm`](Self::confirm) for a fresh grant: one that fell short is
    /// given back (`give_back`, best effort: otherwise it lapses after its
    /// TTL) before the error is returned, and so is one whose caller stopped
    /// waiting meanwhile (the future dropped: `give_back` is spawned on the
    /// current runtime), so the caller holds nothing it was not told of.
    pub(crate) async fn confirm_grant<F>(
        &self,
        lane: &mut Lane,
        key: &LockKey,
        give_back: impl FnOnce() -> F,
    ) -> Result<()>
    where
        F: Future<Output = ()> + Send + 'static,
    {
        if matches!(lane.kind, LaneKind::Shared(_)) {
            return Ok(());
        }
        let mut pending = GiveBack(Some(Box::pin(give_back())));
        match self.confirm(lane, key, "grant").await {
            Ok(()) => {
                pending.0 = None;
                Ok(())
            }
            Err(e) => {
                // Armed while it runs: a caller that leaves meanwhile has
                // the rest of it spawned (GiveBack's drop).
                if let Some(back) = pending.0.as_mut() {
                    back.await;
                    pending.0 = None;
                }
                Err(e)
            }
        }
    }

    /// The give-back of [`confirm_grant`](Self::confirm_grant) for a lock's
    /// grant: the release script, its failure logged.
    pub(crate) fn give_back(&self, lease: &Lease) -> impl Future<Output = ()> + Send + 'static {
        let (conn, lease) = (self.clone(), lease.clone());
        async move {
            if let Err(e) = conn.release(&lease).await {
                tracing::warn!(key = %lease.key, token = %lease.token, error = %e, "giving back a grant too few replicas acknowledged failed; it lapses after its TTL");
            }
        }
    }
}

/// Where one write runs. Without `min_replicas`: the shared connection.
/// With it: a connection of the client's own, used by one write at a time,
/// so that the `WAIT` sent after the write on the same connection counts
/// that write (the replication stream is ordered: with it, every write
/// before it) — a connection that broke in between fails the `WAIT`
/// instead of answering for another — and so that `WAIT`, which holds its
/// connection until the replicas answer or the replica timeout passes,
/// holds up no other call. Dropped, an idle lane's connection is kept for
/// the next write; one with a call cut short or failed is closed.
pub(crate) struct Lane {
    conn: Conn,
    kind: LaneKind,
    /// See [`Late`]; used on a [`LaneKind::Paired`] lane.
    late: Option<Late>,
}

/// What becomes of a script's answer that arrived after its caller left
/// (its future dropped, or past the operation timeout): on a
/// [`LaneKind::Paired`] lane the write and its `WAIT` go out on a task of
/// their own, which hands an answer nobody waits for any more to this (a
/// grant in it is given back, as [`Conn::confirm_grant`] would have).
pub(crate) type Late = Arc<dyn Fn(Value) -> BoxFuture<'static, ()> + Send + Sync>;

enum LaneKind {
    Shared(Link),
    Own {
        conn: MultiplexedConnection,
        /// The connection generation it was opened in.
        generation: u64,
        /// No call in flight and none failed: fit for the next write.
        ready: bool,
    },
    /// A Redis Cluster with `min_replicas`: a cluster connection of the
    /// client's own, used by one write at a time, on which the write and
    /// its `WAIT` go out together, as one pipeline, to the node serving the
    /// write's slot (see [`Paired`]). The cluster connection reconnects by
    /// itself, so a `WAIT` sent on its own could reach a fresh connection
    /// that made no write and answer for nothing; in one pipeline both go
    /// on one connection or neither is answered. Every script on it pays
    /// the `WAIT`, also one that wrote nothing (a busy attempt): the pair
    /// goes out before the script's answer is known.
    Paired {
        conn: ClusterConnection,
        /// `WAIT`'s reply to the last write (or its error), until
        /// [`Conn::confirm`] takes it.
        acked: Option<RedisResult<i64>>,
        /// No call in flight and none failed: fit for the next write.
        ready: bool,
    },
}

/// `WAIT n timeout`.
fn wait_cmd(n: u32, timeout: Duration) -> Cmd {
    let mut cmd = redis::cmd("WAIT");
    cmd.arg(n).arg(millis_ceil(timeout));
    cmd
}

/// The connection a [`LaneKind::Paired`] lane runs a script on: `EVALSHA`
/// goes out in one pipeline with `WAIT`, whose reply it keeps; anything else
/// (the `SCRIPT LOAD` after a NOSCRIPT reply, which every primary must get)
/// goes out alone.
struct Paired {
    conn: ClusterConnection,
    wait: Cmd,
    acked: Option<RedisResult<i64>>,
    late: Option<Late>,
    /// The bound on the task's exchange, which outlives a caller that left.
    limit: Duration,
}

impl ConnectionLike for Paired {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        let is_script = matches!(
            cmd.args_iter().next(),
            Some(redis::Arg::Simple(name)) if name.eq_ignore_ascii_case(b"EVALSHA")
        );
        if !is_script {
            let conn = self.conn.clone();
            return Box::pin(until_run(move || {
                let mut c = conn.clone();
                async move { c.req_packed_command(cmd).await }
            }));
        }
        let mut pipe = redis::pipe();
        pipe.add_command(cmd.clone()).add_command(self.wait.clone());
        // Sent from a task of its own, so that an answer that arrives after
        // the caller left still reaches someone: `late`.
        let (tx, rx) = tokio::sync::oneshot::channel();
        let (conn, late, limit) = (self.conn.clone(), self.late.clone(), self.limit);
        let spawned = fenced_api::cleanup::spawn(async move {
            // A redirection of the script comes back as an error (the
            // cluster connection looks for them in a pipeline's replies,
            // and rebuilds its slot map), so `until_run` sends both again —
            // within the operation timeout, also once the caller left.
            let exchange = until_run(|| {
                let (mut c, pipe) = (conn.clone(), &pipe);
                async move { c.req_packed_commands(pipe, 0, 2).await }
            });
            let replies = tokio::time::timeout(limit, exchange)
                .await
                .unwrap_or_else(|_| {
                    Err(RedisError::from((
                        ErrorKind::Io,
                        "no answer to a script sent with its WAIT within the operation timeout",
                    )))
                });
            if let Err(Ok(replies)) = tx.send(replies) {
                if let (Some(late), Some(reply)) = (late, replies.into_iter().next()) {
                    late(reply).await;
                }
            }
        });
        Box::pin(async move {
            if !spawned {
                return Err(RedisError::from((
                    ErrorKind::Io,
                    "no runtime to send a script with its WAIT on",
                )));
            }
            let replies = rx.await.map_err(|_| {
                RedisError::from((
                    ErrorKind::Io,
                    "the task sending a script with its WAIT ended without an answer",
                ))
            })??;
            let mut replies = replies.into_iter();
            let (Some(reply), Some(acked)) = (replies.next(), replies.next()) else {
                return Err(RedisError::from((
                    ErrorKind::UnexpectedReturnType,
                    "a script sent with WAIT: fewer than two replies",
                )));
            };
            // WAIT's failure is the confirmation's, not the script's: a
            // grant it leaves unconfirmed is given back (`confirm_grant`).
            self.acked = Some(match acked {
                Value::Int(n) => Ok(n),
                Value::ServerError(e) => Err(demoted(e.into())),
                other => Err(RedisError::from((
                    ErrorKind::UnexpectedReturnType,
                    "an unexpected reply to WAIT",
                    format!("{other:?}"),
                ))),
            });
            match reply {
                Value::ServerError(e) => Err(e.into()),
                reply => Ok(reply),
            }
        })
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        self.conn.req_packed_commands(pipeline, offset, count)
    }

    fn get_db(&self) -> i64 {
        0
    }
}

impl Lane {
    /// Whether a script's answer can arrive after its caller left, to be
    /// handed to [`when_late`](Self::when_late).
    pub(crate) fn answers_late(&self) -> bool {
        matches!(self.kind, LaneKind::Paired { .. })
    }

    /// What the next [`run`](Self::run)'s answer becomes if it arrives
    /// after the caller left (see [`Late`]).
    pub(crate) fn when_late(&mut self, late: Late) {
        self.late = Some(late);
    }

    /// Runs `script` on this lane within the operation timeout.
    pub(crate) async fn run<T: FromRedisValue>(
        &mut self,
        what: &str,
        script: &ScriptInvocation<'_>,
    ) -> Result<T> {
        match &mut self.kind {
            LaneKind::Shared(manager) => {
                self.conn.bounded(what, script.invoke_async(manager)).await
            }
            LaneKind::Own { conn, ready, .. } => {
                *ready = false;
                let res = self.conn.bounded(what, script.invoke_async(conn)).await;
                *ready = res.is_ok();
                res
            }
            LaneKind::Paired { conn, acked, ready } => {
                let config = self.conn.config();
                let mut paired = Paired {
                    conn: conn.clone(),
                    wait: wait_cmd(config.min_replicas, config.replica_timeout),
                    acked: None,
                    late: self.late.take(),
                    limit: config.operation_timeout,
                };
                *ready = false;
                let res = self
                    .conn
                    .bounded(what, script.invoke_async(&mut paired))
                    .await;
                *ready = res.is_ok();
                // Only a script that ran has a WAIT reply to confirm.
                *acked = if res.is_ok() { paired.acked } else { None };
                res
            }
        }
    }
}

impl Drop for Lane {
    fn drop(&mut self) {
        match &self.kind {
            LaneKind::Own {
                conn,
                generation,
                ready: true,
            } => self.conn.put_back(*generation, conn.clone()),
            LaneKind::Paired {
                conn, ready: true, ..
            } => self.conn.put_back_paired(conn.clone()),
            _ => {}
        }
    }
}

/// A give-back that runs unless disarmed: spawned on the current runtime
/// when dropped armed (the future waiting for replicas was dropped).
struct GiveBack(Option<Pin<Box<dyn Future<Output = ()> + Send>>>);

impl Drop for GiveBack {
    fn drop(&mut self) {
        if let Some(back) = self.0.take() {
            fenced_api::cleanup::spawn(back);
        }
    }
}

/// `WAIT` sent to a replica fails with a plain `ERR … replica …`: the server
/// was demoted by a failover. Told apart as a read-only reply, which
/// [`error::map_with`] makes retryable for a client that follows Sentinel.
fn demoted(e: RedisError) -> RedisError {
    let replica = e.kind() == ErrorKind::Server(ServerErrorKind::ResponseError)
        && e.detail().is_some_and(|d| d.contains("replica"));
    if replica {
        RedisError::from((
            ErrorKind::Server(ServerErrorKind::ReadOnly),
            "WAIT refused: the server is a replica",
            e.to_string(),
        ))
    } else {
        e
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reply_error(reply: &[u8]) -> RedisError {
        redis::parse_redis_value(reply)
            .and_then(|v| v.extract_error())
            .unwrap_err()
    }

    /// `WAIT` on a demoted primary: retryable while following Sentinel (a
    /// failover explains it), configuration otherwise, like `READONLY`.
    #[test]
    fn wait_refused_by_a_replica_reads_as_a_demoted_primary() {
        let refused = || {
            demoted(reply_error(
                b"-ERR WAIT cannot be used with replica instances. Please also note that since \
                  Redis 4.0 if a replica is configured to be writable (which is not the default) \
                  writes to replicas are just local and are not propagated.\r\n",
            ))
        };
        let following = error::map_with(refused(), error::Topology::Sentinel);
        assert!(following.is_retryable(), "{following}");
        assert!(
            following.to_string().contains("no longer the primary"),
            "{following}"
        );
        assert!(matches!(error::map(refused()), Error::Config { .. }));
        // Any other error is left as it is.
        let other = demoted(reply_error(b"-ERR unknown command 'WAIT'\r\n"));
        assert_eq!(
            other.kind(),
            ErrorKind::Server(ServerErrorKind::ResponseError)
        );
    }
}
