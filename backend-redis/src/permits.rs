//! Semaphores and reader-writer locks on Redis: the line model of
//! [`fenced_api::permits`], one Lua script (`scripts/permits.lua`) over one
//! hash per key, `{prefix/key}:p` — the key's hash tag, so in a Redis
//! Cluster the line sits in the slot of the key's mutex.
//!
//! * Each step (join, look, leave, renew, release, read, force-release) is
//!   one script run: atomic, on the server's clock, deleting the key's
//!   expired entries first.
//! * Tokens come from the hash's `n` field, which stays when the line
//!   empties: they only grow while Redis keeps its data (see the crate docs
//!   on persistence: without it a restart forgets them, and the store
//!   declares itself not durable).
//! * Waiters poll with backoff ([`fenced_api::permits::acquire_in_line`]),
//!   renew their place every third of the TTL, and are woken at once by a
//!   release in the same process; between processes the hand-off waits for
//!   the waiter's next poll.

use std::{
    collections::BTreeMap,
    future::Future,
    sync::{Arc, LazyLock},
    time::Duration,
};

use async_trait::async_trait;
use fenced_api::{
    permits::{self, Arrival, LineRow, LineStore, Look, Permits},
    wait::Polling,
    Capabilities, Error, FencingToken, Label, Lease, LockInfo, LockKey, LockOptions, Owner,
    ReleaseOutcome, Result,
};
use redis::{Script, Value};
use tokio::time::Instant;

use crate::{
    conn::{Conn, Lane},
    error, list,
    scripts::millis_ceil,
};

static PERMITS: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("../scripts/permits.lua")));

/// The line steps of the store's semaphores;
/// [`RedisLock::semaphores`](fenced_api::DistributedLock::semaphores)
/// returns them as [`LineSemaphores`](fenced_api::permits::LineSemaphores).
/// Cheap to clone.
#[derive(Clone)]
pub(crate) struct RedisPermits {
    inner: Arc<Inner>,
}

struct Inner {
    conn: Conn,
    polling: Polling,
    capabilities: Capabilities,
}

impl std::fmt::Debug for RedisPermits {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisPermits")
            .field("scope", &self.inner.polling.scope())
            .finish_non_exhaustive()
    }
}

fn text(v: &Value) -> Option<String> {
    match v {
        Value::BulkString(b) => Some(String::from_utf8_lossy(b).into_owned()),
        Value::SimpleString(s) => Some(s.clone()),
        _ => None,
    }
}

fn int(v: &Value) -> Option<i64> {
    match v {
        Value::Int(i) => Some(*i),
        other => text(other).and_then(|s| s.parse().ok()),
    }
}

fn token_of(v: Option<&Value>) -> Result<FencingToken> {
    v.and_then(int)
        .and_then(|t| u64::try_from(t).ok())
        .map(FencingToken::new)
        .ok_or_else(|| error::protocol("the permits script answered without a token"))
}

impl RedisPermits {
    pub(crate) fn new(conn: Conn, capabilities: Capabilities) -> Self {
        let cfg = conn.config();
        let scope = format!("{}#{}#permits", cfg.display_url, cfg.prefix);
        RedisPermits {
            inner: Arc::new(Inner {
                polling: Polling::new(scope),
                capabilities: capabilities.fifo(true).native_wait(false),
                conn,
            }),
        }
    }

    /// One run of the script on `key`'s line: `op` and its arguments, on
    /// the shared connection.
    async fn run(&self, key: &LockKey, op: &str, args: &[String]) -> Result<Value> {
        let mut lane = self.inner.conn.shared_lane();
        self.run_on(&mut lane, key, op, args).await
    }

    /// [`run`](Self::run) on `lane`: for the writes that
    /// [`Conn::confirm`] must confirm (`min_replicas`).
    async fn run_on(
        &self,
        lane: &mut Lane,
        key: &LockKey,
        op: &str,
        args: &[String],
    ) -> Result<Value> {
        let name = self.inner.conn.keys(key).permits;
        let mut invocation = PERMITS.key(name);
        invocation.arg(op);
        for a in args {
            invocation.arg(a.as_str());
        }
        lane.run("the permits script", &invocation).await
    }

    /// A permit just granted on `lane`, once enough replicas acknowledged it
    /// (`min_replicas`); one that fell short is given back first.
    async fn replicated(&self, lane: &mut Lane, lease: Lease) -> Result<Lease> {
        self.inner
            .conn
            .confirm_grant(lane, &lease.key, || self.given_back(&lease))
            .await?;
        Ok(lease)
    }

    /// A permit its caller must not keep (too few replicas acknowledged it,
    /// or its caller left before the answer) given back, its failure
    /// logged: the permit then lapses after its TTL.
    fn given_back(&self, lease: &Lease) -> impl Future<Output = ()> + Send + 'static {
        let (this, lease) = (self.clone(), lease.clone());
        async move {
            if let Err(e) = this.give_back(&lease).await {
                tracing::warn!(key = %lease.key, token = %lease.token, error = %e, "giving back a permit failed; it lapses after its TTL");
            }
        }
    }

    fn lease(
        key: &LockKey,
        owner: &Owner,
        token: FencingToken,
        ttl: Duration,
        sent: Instant,
    ) -> Lease {
        Lease::new(key.clone(), owner.clone(), token, ttl, sent)
    }
}

/// The TTL as the script counts it (whole ms, rounded up) and as the lease
/// reports it.
fn ttl_ms(opts: &LockOptions) -> (u64, Duration) {
    let ms = millis_ceil(opts.ttl());
    (ms, Duration::from_millis(ms))
}

#[async_trait]
impl LineStore for RedisPermits {
    async fn arrive(
        &self,
        key: &LockKey,
        permits: Permits,
        opts: &LockOptions,
        owner: &Owner,
        queue: bool,
    ) -> Result<Arrival> {
        let (ms, ttl) = ttl_ms(opts);
        let mut lane = self.inner.conn.lane().await?;
        if lane.answers_late() {
            // A permit granted to a caller that left before the answer:
            // given back.
            let (this, key, owner) = (self.clone(), key.clone(), owner.clone());
            lane.when_late(Arc::new(move |reply| {
                let (this, key, owner) = (this.clone(), key.clone(), owner.clone());
                Box::pin(async move {
                    let Value::Array(parts) = reply else { return };
                    if parts.first().and_then(text).as_deref() != Some("granted") {
                        return;
                    }
                    let Ok(token) = token_of(parts.get(1)) else { return };
                    tracing::warn!(key = %key, token = %token, "a permit granted after its caller left (dropped or timed out); giving it back");
                    let lease = Self::lease(&key, &owner, token, ttl, Instant::now());
                    this.given_back(&lease).await;
                })
            }));
        }
        let sent = Instant::now();
        let reply = self
            .run_on(
                &mut lane,
                key,
                "arrive",
                &[
                    owner.as_str().to_owned(),
                    permits.capacity().to_string(),
                    permits.weight().to_string(),
                    ms.to_string(),
                    opts.label().map_or("", Label::as_str).to_owned(),
                    u8::from(opts.is_reentrant()).to_string(),
                    u8::from(queue).to_string(),
                ],
            )
            .await?;
        let Value::Array(parts) = reply else {
            return Err(error::protocol(
                "the permits script's arrive answered no array",
            ));
        };
        match parts.first().and_then(text).as_deref() {
            Some("granted") => {
                let token = token_of(parts.get(1))?;
                let lease = Self::lease(key, owner, token, ttl, sent);
                Ok(Arrival::Granted(self.replicated(&mut lane, lease).await?))
            }
            Some("queued") => Ok(Arrival::Queued(token_of(parts.get(1))?)),
            Some("busy") => Ok(Arrival::Busy),
            Some("held") => Err(Error::AlreadyHeld { key: key.clone() }),
            Some("mismatch") => {
                let held = parts.get(1).and_then(int).unwrap_or(0);
                Err(permits.mismatch(key, u32::try_from(held).unwrap_or(0)))
            }
            other => Err(error::protocol(format!(
                "the permits script's arrive answered {other:?}"
            ))),
        }
    }

    async fn look(
        &self,
        key: &LockKey,
        opts: &LockOptions,
        owner: &Owner,
        token: FencingToken,
        renew: bool,
    ) -> Result<Look> {
        let (ms, ttl) = ttl_ms(opts);
        let mut lane = self.inner.conn.lane().await?;
        let sent = Instant::now();
        let reply = self
            .run_on(
                &mut lane,
                key,
                "look",
                &[
                    owner.as_str().to_owned(),
                    token.get().to_string(),
                    ms.to_string(),
                    u8::from(renew).to_string(),
                ],
            )
            .await?;
        let Value::Array(parts) = reply else {
            return Err(error::protocol(
                "the permits script's look answered no array",
            ));
        };
        match parts.first().and_then(text).as_deref() {
            Some("granted") => {
                let lease = Self::lease(key, owner, token, ttl, sent);
                Ok(Look::Granted(self.replicated(&mut lane, lease).await?))
            }
            Some("waiting") => Ok(Look::Waiting),
            Some("gone") => Ok(Look::Gone),
            other => Err(error::protocol(format!(
                "the permits script's look answered {other:?}"
            ))),
        }
    }

    async fn leave(&self, key: &LockKey, owner: &Owner, token: FencingToken) -> Result<()> {
        let reply = self
            .run(
                key,
                "leave",
                &[owner.as_str().to_owned(), token.get().to_string()],
            )
            .await?;
        if int(&reply) == Some(1) {
            // Those behind it may be granted now.
            self.inner.polling.freed(key);
        }
        Ok(())
    }

    async fn renew(&self, lease: &Lease, ttl: Duration) -> Result<bool> {
        let mut lane = self.inner.conn.lane().await?;
        let reply = self
            .run_on(
                &mut lane,
                &lease.key,
                "extend",
                &[
                    lease.owner.as_str().to_owned(),
                    lease.token.get().to_string(),
                    millis_ceil(ttl).to_string(),
                ],
            )
            .await?;
        let renewed = int(&reply) == Some(1);
        if renewed {
            self.inner
                .conn
                .confirm(&mut lane, &lease.key, "renewal")
                .await?;
        }
        Ok(renewed)
    }

    async fn give_back(&self, lease: &Lease) -> Result<ReleaseOutcome> {
        let reply = self
            .run(
                &lease.key,
                "release",
                &[
                    lease.owner.as_str().to_owned(),
                    lease.token.get().to_string(),
                ],
            )
            .await?;
        let Value::Array(parts) = reply else {
            return Err(error::protocol(
                "the permits script's release answered no array",
            ));
        };
        Ok(match parts.first().and_then(int) {
            Some(1) => ReleaseOutcome::Released,
            Some(2) => ReleaseOutcome::StillHeld {
                remaining: parts
                    .get(1)
                    .and_then(int)
                    .and_then(|r| u32::try_from(r).ok())
                    .unwrap_or(1),
            },
            _ => ReleaseOutcome::NotHeld,
        })
    }

    async fn read_line(&self, key: &LockKey) -> Result<Vec<LineRow>> {
        let reply = self.run(key, "line", &[]).await?;
        let Value::Array(parts) = reply else {
            return Err(error::protocol(
                "the permits script's line answered no array",
            ));
        };
        let bad = || error::protocol("the permits script answered a malformed line");
        let Some(capacity) = parts.first() else {
            return Ok(Vec::new());
        };
        let capacity = int(capacity)
            .and_then(|c| u32::try_from(c).ok())
            .ok_or_else(bad)?;
        let mut rows = Vec::new();
        for e in parts[1..].chunks(6) {
            let [owner, token, remaining, count, label, weight] = e else {
                return Err(bad());
            };
            let owner = text(owner)
                .and_then(|o| Owner::new(o).ok())
                .ok_or_else(bad)?;
            let remaining = Duration::from_millis(
                int(remaining)
                    .and_then(|r| u64::try_from(r).ok())
                    .unwrap_or(0),
            );
            let count = int(count).and_then(|c| u32::try_from(c).ok()).unwrap_or(1);
            let label = text(label)
                .filter(|l| !l.is_empty())
                .and_then(|l| Label::new(l).ok());
            let weight = int(weight)
                .and_then(|w| u32::try_from(w).ok())
                .ok_or_else(bad)?;
            let info = LockInfo::new(key.clone(), owner, token_of(Some(token))?, remaining, count)
                .with_label(label);
            rows.push(LineRow::new(info, capacity, weight));
        }
        Ok(rows)
    }

    async fn clear(&self, key: &LockKey) -> Result<bool> {
        Ok(int(&self.run(key, "force", &[]).await?) == Some(1))
    }

    /// Walks the keyspace with SCAN (as the mutex listing does) and reads
    /// each line found.
    async fn list_granted(&self, limit: usize) -> Result<Vec<LockInfo>> {
        let conn = &self.inner.conn;
        let prefix = &conn.config().prefix;
        let mut scan = list::Scan::new(conn, list::role_pattern(prefix, "p")).await?;
        let mut found: BTreeMap<LockKey, Vec<LockInfo>> = BTreeMap::new();
        while let Some((_, names)) = scan.next().await? {
            for key in names
                .iter()
                .filter_map(|n| list::key_of_role(prefix, n, "p"))
            {
                let rows = self.read_line(&key).await?;
                let Some(capacity) = rows.first().map(|r| r.capacity) else {
                    continue;
                };
                let granted = permits::granted_count(rows.iter().map(|r| r.weight), capacity);
                found.insert(
                    key,
                    rows.into_iter().take(granted).map(|r| r.info).collect(),
                );
            }
            if found.values().map(Vec::len).sum::<usize>() >= limit {
                break;
            }
        }
        Ok(found.into_values().flatten().take(limit).collect())
    }

    fn polling(&self) -> &Polling {
        &self.inner.polling
    }

    fn line_capabilities(&self) -> Capabilities {
        self.inner.capabilities
    }
}
