//! Waiting for a held key: pub/sub wake-ups, one waiter at a time.
//!
//! A waiter queues itself (the acquire script adds its id to the key's queue
//! zset with a liveness deadline) and sleeps. A release removes the lock and
//! publishes, on the key's channel, the id of **one** live waiter; only that
//! waiter tries again. So a hand-off costs the release plus one acquire, not
//! one acquire per waiter (no thundering herd), and nobody polls in a tight
//! loop. Behind the messages sits a bounded re-check: a waiter wakes at the
//! holder's expiry (no message is sent when a lease runs out) or after the
//! re-check interval (default 250 ms), whichever comes first, which also
//! refreshes its place in the queue and covers lost messages and waiters that
//! died without leaving.
//!
//! Subscriptions live on the lock's own RESP3 connection. One SUBSCRIBE per
//! key serves every waiter of this client, and lingers a few seconds after
//! the last one leaves so a busy key is not subscribed over and over.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex, MutexGuard, OnceLock, Weak},
    time::Duration,
};

use fenced_api::{wait::wait_deadline, Error, Lease, LockKey, LockOptions, Result};
use redis::{aio::ConnectionManager, PushInfo, PushKind};
use tokio::{
    sync::{Notify, OnceCell},
    time::Instant,
};

use crate::{
    error::{self, bounded},
    keys::Keys,
    scripts::{self, Attempt},
    RedisLock,
};

/// How long an unused subscription is kept before UNSUBSCRIBE.
const LINGER: Duration = Duration::from_secs(5);

/// Routes release messages from the connection to the waiters of this client.
pub(crate) struct Router {
    conn: OnceLock<ConnectionManager>,
    channels: Mutex<HashMap<String, Channel>>,
    /// Serialises SUBSCRIBE and UNSUBSCRIBE, so that a subscription made
    /// right after a lingering one was dropped is sent after its UNSUBSCRIBE.
    sub_lock: tokio::sync::Mutex<()>,
    timeout: Duration,
    server: String,
}

struct Channel {
    waiters: HashMap<Arc<str>, Arc<Notify>>,
    /// Set once the server confirmed the subscription.
    subscribed: Arc<OnceCell<()>>,
    idle_since: Option<Instant>,
    sweeper: bool,
}

impl Router {
    pub(crate) fn new(timeout: Duration, server: String) -> Self {
        Router {
            conn: OnceLock::new(),
            channels: Mutex::new(HashMap::new()),
            sub_lock: tokio::sync::Mutex::new(()),
            timeout,
            server,
        }
    }

    pub(crate) fn attach(&self, conn: ConnectionManager) {
        let _ = self.conn.set(conn);
    }

    fn channels(&self) -> MutexGuard<'_, HashMap<String, Channel>> {
        // The maps stay consistent even if a holder panicked: recover.
        self.channels.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Called by the connection for every push message; must not block.
    pub(crate) fn on_push(&self, info: PushInfo) {
        match info.kind {
            PushKind::Message => {
                let (Some(channel), Some(waiter)) = (
                    info.data.first().and_then(scripts::text),
                    info.data.get(1).and_then(scripts::text),
                ) else {
                    return;
                };
                if let Some(n) = self
                    .channels()
                    .get(&channel)
                    .and_then(|c| c.waiters.get(waiter.as_str()))
                {
                    n.notify_one();
                }
            }
            // Messages may have been lost while the connection was down:
            // every waiter looks again.
            PushKind::Disconnection => {
                for n in self.channels().values().flat_map(|c| c.waiters.values()) {
                    n.notify_one();
                }
            }
            _ => {}
        }
    }

    /// Joins `channel` locally (no I/O).
    fn register(self: &Arc<Self>, channel: &str) -> Registration {
        let id: Arc<str> = Arc::from(uuid::Uuid::new_v4().simple().to_string());
        let notify = Arc::new(Notify::new());
        let mut map = self.channels();
        let entry = map.entry(channel.to_owned()).or_insert_with(|| Channel {
            waiters: HashMap::new(),
            subscribed: Arc::new(OnceCell::new()),
            idle_since: None,
            sweeper: false,
        });
        entry.waiters.insert(Arc::clone(&id), Arc::clone(&notify));
        entry.idle_since = None;
        Registration {
            router: Arc::clone(self),
            channel: channel.to_owned(),
            id,
            notify,
            subscribed: Arc::clone(&entry.subscribed),
            leave: None,
        }
    }

    /// Joins `channel` only if this client is already subscribed to it.
    fn register_if_subscribed(self: &Arc<Self>, channel: &str) -> Option<Registration> {
        let subscribed = self
            .channels()
            .get(channel)
            .is_some_and(|c| c.subscribed.initialized());
        subscribed.then(|| self.register(channel))
    }

    fn connection(&self) -> Result<ConnectionManager> {
        self.conn
            .get()
            .cloned()
            .ok_or_else(|| error::protocol("the connection is not set up"))
    }

    /// Unsubscribes from a channel once it has been idle for [`LINGER`].
    async fn sweep(router: Weak<Router>, channel: String) {
        let mut until = Instant::now() + LINGER;
        loop {
            tokio::time::sleep_until(until).await;
            let Some(router) = router.upgrade() else {
                return;
            };
            let _serial = router.sub_lock.lock().await;
            let unsubscribe = {
                let mut map = router.channels();
                let Some(entry) = map.get_mut(&channel) else {
                    return;
                };
                match entry.idle_since {
                    Some(since) if entry.waiters.is_empty() => {
                        if since + LINGER > Instant::now() {
                            until = since + LINGER;
                            None
                        } else {
                            map.remove(&channel).map(|c| c.subscribed.initialized())
                        }
                    }
                    _ => {
                        entry.sweeper = false;
                        return;
                    }
                }
            };
            match unsubscribe {
                None => continue,
                Some(false) => return,
                Some(true) => {
                    if let Ok(mut conn) = router.connection() {
                        let unsub = conn.unsubscribe(&channel);
                        if let Err(e) =
                            bounded(router.timeout, "UNSUBSCRIBE", &router.server, unsub).await
                        {
                            tracing::debug!(channel, error = %e, "unsubscribe failed");
                        }
                    }
                    return;
                }
            }
        }
    }
}

/// One waiter's place: its local wake-up, and (once queued on the server)
/// what to remove when it leaves without the lock.
struct Registration {
    router: Arc<Router>,
    channel: String,
    id: Arc<str>,
    notify: Arc<Notify>,
    subscribed: Arc<OnceCell<()>>,
    leave: Option<LeaveTicket>,
}

/// What a waiter that gives up must remove from the server's queue.
struct LeaveTicket {
    conn: ConnectionManager,
    keys: Keys,
}

impl Registration {
    fn is_subscribed(&self) -> bool {
        self.subscribed.initialized()
    }

    /// Subscribes to the channel (once per client and channel).
    async fn subscribe(&self) -> Result<()> {
        let router = &self.router;
        self.subscribed
            .get_or_try_init(|| async {
                // The wait for the serialising lock counts against the same
                // bound as the SUBSCRIBE itself: a stalled server must not
                // queue every waiter behind one timeout after another.
                let started = tokio::time::Instant::now();
                let Ok(_serial) =
                    tokio::time::timeout(router.timeout, router.sub_lock.lock()).await
                else {
                    return Err(fenced_api::Error::backend(
                        crate::error::BACKEND,
                        true,
                        format!(
                            "SUBSCRIBE to {} queued for {:?}",
                            router.server, router.timeout
                        ),
                    ));
                };
                let mut conn = router.connection()?;
                let sub = conn.subscribe(&self.channel);
                let left = router.timeout.saturating_sub(started.elapsed());
                bounded(left, "SUBSCRIBE", &router.server, sub).await
            })
            .await
            .map(|_| ())
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        let runtime = tokio::runtime::Handle::try_current().ok();
        if let (Some(ticket), Some(rt)) = (self.leave.take(), runtime.as_ref()) {
            let (id, timeout) = (Arc::clone(&self.id), self.router.timeout);
            rt.spawn(async move {
                let LeaveTicket { mut conn, keys } = ticket;
                let mut leave = scripts::LEAVE.key(&keys.lock);
                leave.key(&keys.queue).arg(&keys.channel).arg(&*id);
                // Best effort: a waiter that could not leave drops out of the
                // queue when its liveness deadline passes.
                let _ = tokio::time::timeout(timeout, leave.invoke_async::<i64>(&mut conn)).await;
            });
        }
        let mut map = self.router.channels();
        let Some(entry) = map.get_mut(&self.channel) else {
            return;
        };
        entry.waiters.remove(&self.id);
        if !entry.waiters.is_empty() {
            return;
        }
        entry.idle_since = Some(Instant::now());
        match runtime {
            Some(rt) if !entry.sweeper => {
                entry.sweeper = true;
                let weak = Arc::downgrade(&self.router);
                rt.spawn(Router::sweep(weak, self.channel.clone()));
            }
            Some(_) => {}
            // No runtime to unsubscribe later: forget the channel locally; a
            // later waiter subscribes again (which the server treats as a no-op).
            None => {
                map.remove(&self.channel);
            }
        }
    }
}

/// `acquire` for [`RedisLock`]: see the module docs.
pub(crate) async fn acquire(lock: &RedisLock, key: &LockKey, opts: &LockOptions) -> Result<Lease> {
    let start = Instant::now();
    let deadline = wait_deadline(opts.wait(), start);
    let owner = opts.owner_or_random();
    let keys = lock.keys(key);
    let router = lock.router();
    let recheck = lock.config().recheck_interval;
    let may_wait = deadline != Some(start);
    let mut reg = if may_wait {
        router.register_if_subscribed(&keys.channel)
    } else {
        None
    };
    let mut attempts = 0u32;
    loop {
        let queued = reg
            .as_ref()
            .filter(|r| r.is_subscribed())
            .map(|r| r.id.clone());
        // Arm the leave ticket before a queued attempt is sent (review fix).
        if let (Some(r), Some(_)) = (reg.as_mut(), &queued) {
            if r.leave.is_none() {
                r.leave = Some(LeaveTicket {
                    conn: lock.connection(),
                    keys: keys.clone(),
                });
            }
        }
        let sent = Instant::now();
        attempts += 1;
        let pttl = match lock.attempt(&keys, opts, &owner, queued.as_deref()).await? {
            Attempt::Granted { token, .. } => {
                if let Some(r) = reg.as_mut() {
                    r.leave = None;
                }
                if attempts > 1 {
                    tracing::debug!(key = %key, attempts, waited_ms = start.elapsed().as_millis() as u64, "acquired after waiting");
                }
                return Ok(lock.lease(key, owner, token, opts, sent));
            }
            Attempt::AlreadyHeld => return Err(Error::AlreadyHeld { key: key.clone() }),
            Attempt::Busy { pttl } => pttl,
        };
        if let (Some(r), Some(_)) = (reg.as_mut(), &queued) {
            if r.leave.is_none() {
                r.leave = Some(LeaveTicket {
                    conn: lock.connection(),
                    keys: keys.clone(),
                });
            }
        }
        let now = Instant::now();
        if deadline.is_some_and(|d| now >= d) {
            return Err(Error::Timeout {
                key: key.clone(),
                waited: now - start,
            });
        }
        let Some(r) = reg.as_ref().filter(|_| queued.is_some()) else {
            // Not subscribed yet: subscribe, then try again at once — queued
            // this time, so the next release names us.
            let r = reg.get_or_insert_with(|| router.register(&keys.channel));
            // Never past the caller's wait bound.
            match deadline {
                Some(d) => match tokio::time::timeout_at(d, r.subscribe()).await {
                    Ok(res) => res?,
                    Err(_) => {
                        return Err(Error::Timeout {
                            key: key.clone(),
                            waited: start.elapsed(),
                        })
                    }
                },
                None => r.subscribe().await?,
            }
            continue;
        };
        let nap = next_check(pttl, recheck);
        let wake = deadline.map_or(now + nap, |d| d.min(now + nap));
        tokio::select! {
            _ = r.notify.notified() => {}
            _ = tokio::time::sleep_until(wake) => {}
        }
    }
}

/// When to look again without a message: just after the holder's lease ends
/// (no message is sent on expiry), but no later than the re-check interval
/// (jittered down by up to a quarter, so waiters do not re-check in step).
fn next_check(pttl: Option<Duration>, recheck: Duration) -> Duration {
    let jittered = recheck.mul_f64(0.75 + fastrand::f64() / 4.0);
    match pttl {
        Some(p) => (p + Duration::from_millis(1)).min(jittered),
        None => jittered,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn next_check_is_bounded() {
        let cap = Duration::from_millis(200);
        for _ in 0..100 {
            let d = next_check(None, cap);
            assert!(d >= cap.mul_f64(0.75) && d <= cap, "{d:?}");
            let d = next_check(Some(Duration::from_secs(30)), cap);
            assert!(d <= cap, "{d:?}");
        }
        assert_eq!(
            next_check(Some(Duration::from_millis(20)), cap),
            Duration::from_millis(21)
        );
        assert_eq!(
            next_check(Some(Duration::ZERO), cap),
            Duration::from_millis(1)
        );
    }

    #[tokio::test]
    async fn messages_wake_only_the_named_waiter() {
        let router = Arc::new(Router::new(Duration::from_secs(1), "test".into()));
        let a = router.register("ch");
        let b = router.register("ch");
        let other = router.register("other");
        let message = |ch: &str, id: &str| PushInfo {
            kind: PushKind::Message,
            data: vec![
                redis::Value::BulkString(ch.as_bytes().to_vec()),
                redis::Value::BulkString(id.as_bytes().to_vec()),
            ],
        };
        async fn woke(r: &Registration) -> bool {
            tokio::time::timeout(Duration::from_millis(20), r.notify.notified())
                .await
                .is_ok()
        }
        router.on_push(message("ch", &b.id));
        assert!(woke(&b).await, "the named waiter has a wake-up");
        assert!(!woke(&a).await, "the other waiter of the channel does not");
        router.on_push(message("other", &a.id));
        assert!(
            !woke(&a).await && !woke(&other).await,
            "ids are per channel"
        );
        router.on_push(PushInfo {
            kind: PushKind::Disconnection,
            data: vec![],
        });
        assert!(
            woke(&a).await && woke(&b).await && woke(&other).await,
            "a disconnect wakes all"
        );
        drop((a, b, other));
        let map = router.channels();
        assert!(map.values().all(|c| c.waiters.is_empty()));
    }
}
