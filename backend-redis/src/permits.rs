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

use std::{collections::BTreeMap, sync::Arc, sync::LazyLock, time::Duration};

use async_trait::async_trait;
use fenced_api::{
    permits::{self, Arrival, KeyHolders, LineStore, Look, PermitHolder, Permits, SemaphoreStore},
    wait::{Backoff, Polling},
    Capabilities, DistributedLock, Error, FencingToken, Label, Lease, LockInfo, LockKey,
    LockOptions, Owner, ReleaseOutcome, Result,
};
use redis::{Script, Value};
use tokio::time::Instant;

use crate::{conn::Conn, error, list, scripts::millis_ceil};

static PERMITS: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("../scripts/permits.lua")));

/// The store's semaphores: what
/// [`RedisLock::semaphores`](fenced_api::DistributedLock::semaphores)
/// returns. Cheap to clone.
#[derive(Clone)]
pub struct RedisPermits {
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

    /// One run of the script on `key`'s line: `op` and its arguments.
    async fn run(&self, key: &LockKey, op: &str, args: &[String]) -> Result<Value> {
        let name = self.inner.conn.keys(key).permits;
        let mut invocation = PERMITS.key(name);
        invocation.arg(op);
        for a in args {
            invocation.arg(a.as_str());
        }
        let mut conn = self.inner.conn.manager();
        self.inner
            .conn
            .bounded("the permits script", invocation.invoke_async(&mut conn))
            .await
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
        let sent = Instant::now();
        let reply = self
            .run(
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
                Ok(Arrival::Granted(Self::lease(key, owner, token, ttl, sent)))
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
        let sent = Instant::now();
        let reply = self
            .run(
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
            Some("granted") => Ok(Look::Granted(Self::lease(key, owner, token, ttl, sent))),
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
}

#[async_trait]
impl SemaphoreStore for RedisPermits {
    async fn try_acquire_permits(
        &self,
        key: &LockKey,
        permits: Permits,
        opts: &LockOptions,
    ) -> Result<Option<Lease>> {
        permits::try_acquire_in_line(self, key, permits, opts).await
    }

    async fn acquire_permits(
        &self,
        key: &LockKey,
        permits: Permits,
        opts: &LockOptions,
    ) -> Result<Lease> {
        let scope = self.inner.polling.scope();
        permits::acquire_in_line(self, scope, key, permits, opts, Backoff::default()).await
    }

    async fn holders(&self, key: &LockKey) -> Result<Option<KeyHolders>> {
        let reply = self.run(key, "holders", &[]).await?;
        let Value::Array(parts) = reply else {
            return Err(error::protocol(
                "the permits script's holders answered no array",
            ));
        };
        if parts.is_empty() {
            return Ok(None);
        }
        let bad = || error::protocol("the permits script's holders answered a malformed line");
        let capacity = parts
            .first()
            .and_then(int)
            .and_then(|c| u32::try_from(c).ok());
        let waiting = parts
            .get(1)
            .and_then(int)
            .and_then(|w| usize::try_from(w).ok());
        let (Some(capacity), Some(waiting)) = (capacity, waiting) else {
            return Err(bad());
        };
        let mut holders = Vec::new();
        for h in parts[2..].chunks(6) {
            let [owner, token, remaining, count, label, weight] = h else {
                return Err(bad());
            };
            let owner = text(owner)
                .and_then(|o| Owner::new(o).ok())
                .ok_or_else(bad)?;
            let token = token_of(Some(token))?;
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
            let permits = Permits::from_parts(capacity, weight).map_err(|_| bad())?;
            let info = LockInfo::new(key.clone(), owner, token, remaining, count).with_label(label);
            holders.push(PermitHolder::new(info, permits));
        }
        Ok(Some(KeyHolders::new(
            key.clone(),
            capacity,
            holders,
            waiting,
        )))
    }
}

#[async_trait]
impl DistributedLock for RedisPermits {
    async fn try_acquire(&self, key: &LockKey, opts: &LockOptions) -> Result<Option<Lease>> {
        self.try_acquire_permits(key, Permits::semaphore(1)?, opts)
            .await
    }

    async fn acquire(&self, key: &LockKey, opts: &LockOptions) -> Result<Lease> {
        self.acquire_permits(key, Permits::semaphore(1)?, opts)
            .await
    }

    async fn extend(&self, lease: &Lease, ttl: Duration) -> Result<Lease> {
        let ttl = Duration::from_millis(millis_ceil(LockOptions::validate_ttl(ttl)?));
        let sent = Instant::now();
        let reply = self
            .run(
                &lease.key,
                "extend",
                &[
                    lease.owner.as_str().to_owned(),
                    lease.token.get().to_string(),
                    millis_ceil(ttl).to_string(),
                ],
            )
            .await?;
        if int(&reply) == Some(1) {
            return Ok(lease.renewed(ttl, sent));
        }
        Err(Error::lease_lost(
            &lease.key,
            lease.token,
            "redis no longer has this permit (expired, released, force-released, or lost in a restart)",
        ))
    }

    async fn release(&self, lease: &Lease) -> Result<ReleaseOutcome> {
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
        let outcome = match parts.first().and_then(int) {
            Some(1) => ReleaseOutcome::Released,
            Some(2) => ReleaseOutcome::StillHeld {
                remaining: parts
                    .get(1)
                    .and_then(int)
                    .and_then(|r| u32::try_from(r).ok())
                    .unwrap_or(1),
            },
            _ => ReleaseOutcome::NotHeld,
        };
        Ok(self.inner.polling.released(&lease.key, outcome))
    }

    async fn inspect(&self, key: &LockKey) -> Result<Option<LockInfo>> {
        Ok(self
            .holders(key)
            .await?
            .and_then(|k| k.holders.into_iter().next())
            .map(|h| h.info))
    }

    async fn force_release(&self, key: &LockKey) -> Result<bool> {
        let live = int(&self.run(key, "force", &[]).await?) == Some(1);
        if live {
            tracing::warn!(key = %key, "semaphore force-released");
        }
        Ok(self.inner.polling.force_released(key, live))
    }

    /// Walks the keyspace with SCAN (as the mutex listing does) and reads
    /// each line found.
    async fn list(&self, limit: usize) -> Result<Vec<LockInfo>> {
        let conn = &self.inner.conn;
        let prefix = &conn.config().prefix;
        let pattern = list::role_pattern(prefix, "p");
        let mut manager = conn.manager();
        let mut found: BTreeMap<LockKey, Vec<LockInfo>> = BTreeMap::new();
        let mut cursor: u64 = 0;
        loop {
            let (next, names): (u64, Vec<Vec<u8>>) = conn
                .bounded(
                    "SCAN",
                    redis::cmd("SCAN")
                        .arg(cursor)
                        .arg("MATCH")
                        .arg(&pattern)
                        .arg("COUNT")
                        .arg(list::SCAN_COUNT)
                        .query_async(&mut manager),
                )
                .await?;
            for key in names
                .iter()
                .filter_map(|n| list::key_of_role(prefix, n, "p"))
            {
                if let Some(line) = self.holders(&key).await? {
                    found.insert(key, line.holders.into_iter().map(|h| h.info).collect());
                }
            }
            if found.values().map(Vec::len).sum::<usize>() >= limit || next == 0 {
                break;
            }
            cursor = next;
        }
        Ok(found.into_values().flatten().take(limit).collect())
    }

    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities
    }

    /// Itself: a semaphore store's mutex is its semaphore of one permit.
    fn semaphores(&self) -> Option<Arc<dyn SemaphoreStore>> {
        Some(Arc::new(self.clone()))
    }
}
