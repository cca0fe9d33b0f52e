//! How waiters wait: a FIFO queue on the server, the key handed over by
//! message. The protocol (entries, liveness, hand-over, what a waiter that
//! gives up leaves behind) is described under "Waiting" in the crate docs.
//!
//! [`Router`] routes the hand-over messages that reach this client's wake-up
//! channel to its waiters; [`acquire`] runs one waiter: a plain try first,
//! then, once the channel is subscribed, queued attempts, each followed by a
//! sleep until a hand-over, the holder's expiry or the re-check interval,
//! whichever comes first. A waiter that gives up leaves the queue (its
//! `Registration` runs the leave script when dropped) and passes on a lease
//! handed to it meanwhile; so does the router for a grant whose waiter is
//! gone.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex, MutexGuard, OnceLock},
    time::Duration,
};

use fenced_api::{
    wait::wait_deadline, Error, FencingToken, Lease, LockKey, LockOptions, Owner, Result,
};
use redis::{PushInfo, PushKind};
use std::sync::atomic::{AtomicU64, Ordering};

use tokio::{sync::Notify, time::Instant};

use crate::{
    config::Prefix,
    conn::{granted, Conn},
    error,
    keys::{self, Keys},
    scripts::{self, millis_ceil, Attempt, Entry, Queued},
};

/// Routes hand-over messages from the connection to this client's waiters.
pub(crate) struct Router {
    conn: OnceLock<Conn>,
    channels: Channels,
    /// One server: 1 + the connection generation (see [`Conn::generation`])
    /// the server confirmed the subscription on; 0 for none yet. A switch to
    /// a new primary (Sentinel) needs a subscription there.
    subscribed: AtomicU64,
    /// One SUBSCRIBE at a time.
    subscribing: tokio::sync::Mutex<()>,
    waiters: Mutex<HashMap<Arc<str>, Arc<Slot>>>,
}

/// Where hand-overs to this client's waiters are published.
enum Channels {
    /// One server: `{prefix/}:w:<client>`, one channel for every key,
    /// subscribed once.
    One(Arc<str>),
    /// A Redis Cluster: per key, `{prefix/key}:w:<client>` — in the key's
    /// slot, so the scripts (which may only touch their keys' slot) can
    /// `SPUBLISH` to it and count who listens — subscribed (`SSUBSCRIBE`, on
    /// the node serving the slot) while this client has waiters on the key.
    PerKey {
        /// `:w:<client>`, after the key's hash tag.
        suffix: String,
        subs: Mutex<HashMap<Arc<str>, Arc<KeySub>>>,
    },
}

/// The subscription to one key's channel (a Cluster client).
#[derive(Default)]
struct KeySub {
    state: Mutex<SubState>,
    /// One `SSUBSCRIBE` or `SUNSUBSCRIBE` of the channel at a time.
    io: tokio::sync::Mutex<()>,
}

#[derive(Default)]
struct SubState {
    /// Registered waiters on the key; the subscription ends with the last.
    waiters: usize,
    /// The server confirmed the subscription and has not ended it since.
    confirmed: bool,
    /// Bumped whenever the server ends the subscription: a confirmation
    /// that arrives after the end (pushes and replies travel apart) must
    /// not count.
    ended: u64,
}

impl KeySub {
    fn state(&self) -> MutexGuard<'_, SubState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Where a hand-over for one waiter lands.
#[derive(Default)]
struct Slot {
    notify: Notify,
    grant: Mutex<Option<FencingToken>>,
}

impl Slot {
    fn take(&self) -> Option<FencingToken> {
        self.grant.lock().unwrap_or_else(|p| p.into_inner()).take()
    }
}

/// A hand-over message: `g|<token>|<waiter id>|<lock state key>`.
#[derive(Debug, PartialEq, Eq)]
struct Grant<'a> {
    token: FencingToken,
    waiter: &'a str,
    lock: &'a str,
}

fn parse_grant(payload: &str) -> Option<Grant<'_>> {
    let mut parts = payload.splitn(4, '|');
    if parts.next()? != "g" {
        return None;
    }
    let token = parts.next()?.parse::<u64>().ok().filter(|t| *t >= 1)?;
    let waiter = parts.next()?;
    let lock = parts.next()?;
    Some(Grant {
        token: FencingToken::new(token),
        waiter,
        lock,
    })
}

impl Router {
    /// The router of the client `client` (a unique id) under `prefix`; a
    /// Cluster client's channels are per key.
    pub(crate) fn new(prefix: &Prefix, client: String, cluster: bool) -> Self {
        let channels = if cluster {
            Channels::PerKey {
                suffix: format!(":w:{client}"),
                subs: Mutex::new(HashMap::new()),
            }
        } else {
            Channels::One(Arc::from(keys::wake_channel(prefix, &client)))
        };
        Router {
            conn: OnceLock::new(),
            channels,
            subscribed: AtomicU64::new(0),
            subscribing: tokio::sync::Mutex::new(()),
            waiters: Mutex::new(HashMap::new()),
        }
    }

    /// Set once, right after the connection (which routes its push messages
    /// here) is created.
    pub(crate) fn attach(&self, conn: Conn) {
        let _ = self.conn.set(conn);
    }

    fn waiters(&self) -> MutexGuard<'_, HashMap<Arc<str>, Arc<Slot>>> {
        // The map stays consistent even if a holder panicked: recover.
        self.waiters.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The wake-up channel of this client's waiters on `keys`.
    fn channel(&self, keys: &Keys) -> Arc<str> {
        match &self.channels {
            Channels::One(ch) => Arc::clone(ch),
            Channels::PerKey { suffix, .. } => Arc::from(keys.channel(suffix)),
        }
    }

    /// Whether `channel` is one of this client's wake-up channels.
    fn is_ours(&self, channel: &str) -> bool {
        match &self.channels {
            Channels::One(ch) => channel == &**ch,
            Channels::PerKey { suffix, .. } => channel.ends_with(suffix.as_str()),
        }
    }

    /// The subscription state of a Cluster client's key channel.
    fn key_sub(&self, channel: &str) -> Option<Arc<KeySub>> {
        match &self.channels {
            Channels::One(_) => None,
            Channels::PerKey { subs, .. } => subs
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .get(channel)
                .cloned(),
        }
    }

    /// Subscribed to `channel` on the connection as it is now.
    fn is_subscribed(&self, channel: &str) -> bool {
        match &self.channels {
            Channels::One(_) => self
                .conn
                .get()
                .is_some_and(|c| self.subscribed.load(Ordering::Acquire) == c.generation() + 1),
            Channels::PerKey { .. } => self.key_sub(channel).is_some_and(|s| s.state().confirmed),
        }
    }

    /// Every waiter looks again (messages may have been lost, or went to a
    /// server that is no longer the primary).
    pub(crate) fn wake_all(&self) {
        for slot in self.waiters().values() {
            slot.notify.notify_one();
        }
    }

    fn connection(&self) -> Result<Conn> {
        self.conn
            .get()
            .cloned()
            .ok_or_else(|| error::protocol("the connection is not set up"))
    }

    /// Called by the connection for every push message; must not block.
    pub(crate) fn on_push(&self, info: PushInfo) {
        match info.kind {
            PushKind::Message | PushKind::SMessage => {
                let (Some(channel), Some(payload)) = (
                    info.data.first().and_then(scripts::text),
                    info.data.get(1).and_then(scripts::text),
                ) else {
                    return;
                };
                if !self.is_ours(&channel) {
                    return;
                }
                let Some(grant) = parse_grant(&payload) else {
                    tracing::debug!(payload, "unexpected message on the wake-up channel");
                    return;
                };
                let slot = self.waiters().get(grant.waiter).cloned();
                match slot {
                    Some(slot) => {
                        *slot.grant.lock().unwrap_or_else(|p| p.into_inner()) = Some(grant.token);
                        slot.notify.notify_one();
                    }
                    // The waiter is gone (cancelled, timed out): pass the key on.
                    None => self.give_back(&grant),
                }
            }
            // Messages may have been lost while the connection was down:
            // every waiter looks again.
            PushKind::Disconnection => self.wake_all(),
            // The server ended a key channel's subscription (its slot moved
            // to another node, by resharding or failover — or this client's
            // own SUNSUBSCRIBE): waiters on it subscribe again, at the node
            // that serves the slot now, before they queue again.
            PushKind::SUnsubscribe => {
                let Some(sub) = info
                    .data
                    .first()
                    .and_then(scripts::text)
                    .and_then(|ch| self.key_sub(&ch))
                else {
                    return;
                };
                let waiting = {
                    let mut state = sub.state();
                    state.confirmed = false;
                    state.ended += 1;
                    state.waiters > 0
                };
                if waiting {
                    self.wake_all();
                }
            }
            _ => {}
        }
    }

    /// Passes on a lease handed to a waiter of this client that has stopped
    /// waiting (the leave script does nothing if the waiter claimed it).
    fn give_back(&self, grant: &Grant<'_>) {
        let (Some(keys), Ok(conn)) = (Keys::from_lock(grant.lock), self.connection()) else {
            return;
        };
        tracing::debug!(lock = grant.lock, token = %grant.token, "passing on a hand-over nobody waits for");
        fenced_api::cleanup::spawn(leave(conn, keys, Arc::from(grant.waiter), None));
    }

    /// A new waiter on `keys` (no I/O). A Cluster client's channel for the
    /// key stays subscribed while it is registered.
    fn register(self: &Arc<Self>, keys: &Keys) -> Registration {
        let id: Arc<str> = Arc::from(uuid::Uuid::new_v4().simple().to_string());
        let slot = Arc::new(Slot::default());
        self.waiters().insert(Arc::clone(&id), Arc::clone(&slot));
        let channel = self.channel(keys);
        let entry_channel = match &self.channels {
            Channels::One(ch) => Arc::clone(ch),
            Channels::PerKey { suffix, .. } => Arc::from(suffix.as_str()),
        };
        if let Channels::PerKey { subs, .. } = &self.channels {
            let mut subs = subs.lock().unwrap_or_else(|p| p.into_inner());
            let sub = subs.entry(Arc::clone(&channel)).or_default();
            sub.state().waiters += 1;
        }
        Registration {
            router: Arc::clone(self),
            id,
            channel,
            entry_channel,
            slot,
            entry: None,
            entry_sent: None,
            leave: None,
        }
    }

    /// Subscribes to the wake-up channel of a registered waiter. One
    /// server: once per connection (the connection subscribes again by
    /// itself after a reconnect; a connection to a new primary needs it
    /// anew). A Cluster client: per key channel, until the last waiter on it
    /// leaves or the server ends it.
    async fn subscribe(&self, channel: &str) -> Result<()> {
        let conn = self.connection()?;
        let Some(sub) = self.key_sub(channel) else {
            let _one = self.subscribing.lock().await;
            let (mut link, generation) = conn.manager_and_generation();
            if self.subscribed.load(Ordering::Acquire) == generation + 1 {
                return Ok(());
            }
            conn.bounded("SUBSCRIBE", link.subscribe(channel)).await?;
            self.subscribed.store(generation + 1, Ordering::Release);
            return Ok(());
        };
        let _one = sub.io.lock().await;
        let ended = {
            let state = sub.state();
            if state.confirmed {
                return Ok(());
            }
            state.ended
        };
        conn.bounded("SSUBSCRIBE", conn.manager().subscribe(channel))
            .await?;
        let mut state = sub.state();
        // Ended meanwhile (the slot moved): unconfirmed, the waiter
        // subscribes again before it queues.
        state.confirmed = state.ended == ended;
        Ok(())
    }

    /// A Cluster client's last waiter on `channel` left: ends the
    /// subscription, unless a waiter registered meanwhile (best effort:
    /// spawned; a failed `SUNSUBSCRIBE` leaves a subscription that
    /// receives nothing more).
    fn unsubscribe_later(self: &Arc<Self>, channel: Arc<str>) {
        let (Some(sub), Ok(rt)) = (
            self.key_sub(&channel),
            tokio::runtime::Handle::try_current(),
        ) else {
            return;
        };
        let router = Arc::clone(self);
        rt.spawn(async move {
            let _one = sub.io.lock().await;
            {
                // Only the current entry's own subscription: an entry
                // removed meanwhile may have a successor, subscribed anew.
                if !router
                    .key_sub(&channel)
                    .is_some_and(|s| Arc::ptr_eq(&s, &sub))
                {
                    return;
                }
                let mut state = sub.state();
                if state.waiters > 0 || !state.confirmed {
                    return;
                }
                // Unconfirmed from here: a waiter registering now subscribes
                // anew (after this SUNSUBSCRIBE, behind the same lock).
                state.confirmed = false;
            }
            if let Ok(conn) = router.connection() {
                let _ = conn
                    .bounded("SUNSUBSCRIBE", conn.manager().unsubscribe(&channel))
                    .await;
            }
            router.forget_idle(&channel);
        });
    }

    /// Drops a Cluster client's entry for `channel` once nobody waits on it
    /// and it is not subscribed (no I/O).
    fn forget_idle(&self, channel: &str) {
        if let Channels::PerKey { subs, .. } = &self.channels {
            let mut subs = subs.lock().unwrap_or_else(|p| p.into_inner());
            let idle = subs.get(channel).is_some_and(|s| {
                let state = s.state();
                state.waiters == 0 && !state.confirmed
            });
            if idle {
                subs.remove(channel);
            }
        }
    }
}

/// Runs the leave script: best effort, bounded. A waiter that could not
/// leave drops out of the queue when its entry's deadline passes.
async fn leave(conn: Conn, keys: Keys, id: Arc<str>, entry: Option<String>) {
    let mut leave = scripts::LEAVE.key(&keys.lock);
    leave
        .key(&keys.queue)
        .arg(&*id)
        .arg(entry.as_deref().unwrap_or(""));
    let mut manager = conn.manager();
    let left = conn.bounded("the leave script", leave.invoke_async::<i64>(&mut manager));
    match left.await {
        Ok(1) => tracing::debug!(lock = keys.lock, "an unclaimed hand-over was passed on"),
        Ok(_) => {}
        Err(e) => tracing::debug!(lock = keys.lock, error = %e, "leaving the queue failed"),
    }
}

/// One waiter: its slot for a hand-over and, once it may be queued on the
/// server, what to remove when it gives up.
struct Registration {
    router: Arc<Router>,
    id: Arc<str>,
    /// Where hand-overs to it are published.
    channel: Arc<str>,
    /// How its queue entry names that channel: the whole name, or (a Cluster
    /// client) its suffix after the key's hash tag (see the scripts'
    /// prelude).
    entry_channel: Arc<str>,
    slot: Arc<Slot>,
    /// The place in the queue from the last attempt.
    entry: Option<Entry>,
    /// Send time of the attempt that last (re)queued this waiter: every
    /// hand-over happens after that attempt ran, so a lease handed over is
    /// valid until at least this + ttl.
    entry_sent: Option<Instant>,
    leave: Option<LeaveTicket>,
}

/// What a waiter that gives up must clean up on the server.
struct LeaveTicket {
    conn: Conn,
    keys: Keys,
}

impl Registration {
    fn queued<'a>(&'a self, lease_ms: u64) -> Queued<'a> {
        Queued {
            id: &self.id,
            channel: &self.entry_channel,
            lease_ms,
            entry: self.entry.as_ref(),
        }
    }

    /// Armed before the first queued attempt is sent, so a waiter cancelled
    /// while that attempt is in flight still leaves.
    fn arm(&mut self, conn: &Conn, keys: &Keys) {
        if self.leave.is_none() {
            self.leave = Some(LeaveTicket {
                conn: conn.clone(),
                keys: keys.clone(),
            });
        }
    }

    /// Called right before a lease is returned: nothing to clean up.
    fn disarm(&mut self) {
        self.leave = None;
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        // First out of the map: a hand-over arriving from now on is passed on.
        self.router.waiters().remove(&self.id);
        if let Some(sub) = self.router.key_sub(&self.channel) {
            let (last, subscribed) = {
                let mut state = sub.state();
                state.waiters = state.waiters.saturating_sub(1);
                (state.waiters == 0, state.confirmed)
            };
            if last && subscribed {
                self.router.unsubscribe_later(Arc::clone(&self.channel));
            } else if last {
                self.router.forget_idle(&self.channel);
            }
        }
        if let Some(LeaveTicket { conn, keys }) = self.leave.take() {
            let entry = self.entry.take().map(|e| e.member);
            fenced_api::cleanup::spawn(leave(conn, keys, Arc::clone(&self.id), entry));
        }
    }
}

/// How long a waiter's queue entry stays live without a refresh: a few
/// missed re-checks.
fn waiter_lease(recheck: Duration) -> Duration {
    recheck * 3 + Duration::from_secs(1)
}

/// [`DistributedLock::acquire`](fenced_api::DistributedLock::acquire) for
/// the client whose connection is `conn` and whose waiters `router` serves:
/// see the module docs.
pub(crate) async fn acquire(
    conn: &Conn,
    router: &Arc<Router>,
    key: &LockKey,
    opts: &LockOptions,
) -> Result<Lease> {
    let start = Instant::now();
    let deadline = wait_deadline(opts.wait(), start);
    let owner = opts.owner_or_random();
    let keys = conn.keys(key);
    let recheck = conn.config().recheck_interval;
    let lease_ms = millis_ceil(waiter_lease(recheck));
    let may_wait = deadline != Some(start);
    // Not subscribed yet: the first attempt is a plain try (nothing can be
    // handed to a waiter nobody listens for); queued from the second on.
    let mut reg = if may_wait {
        let r = router.register(&keys);
        router.is_subscribed(&r.channel).then_some(r)
    } else {
        None
    };
    let mut attempts = 0u32;
    loop {
        if let Some(r) = reg.as_ref().filter(|r| !router.is_subscribed(&r.channel)) {
            // The connection now goes to a new primary (Sentinel), or the
            // key's slot moved (Cluster): subscribe there before queueing,
            // or no hand-over could reach this waiter.
            subscribe_within(router, &r.channel, deadline, key, start).await?;
        }
        if let Some(r) = reg.as_mut() {
            r.arm(conn, &keys);
        }
        let mut lane = conn.lane().await?;
        let sent = Instant::now();
        attempts += 1;
        let queued = reg.as_ref().map(|r| r.queued(lease_ms));
        let pttl = match conn
            .attempt(&mut lane, key, &keys, opts, &owner, queued)
            .await?
        {
            Attempt::Granted { token, .. } => {
                let lease = granted(key, owner, token, opts, sent);
                // Given back when too few replicas acknowledged it.
                conn.confirm_grant(&mut lane, key, || conn.give_back(&lease))
                    .await?;
                if let Some(r) = reg.as_mut() {
                    r.disarm();
                }
                if attempts > 1 {
                    tracing::debug!(key = %key, attempts, waited_ms = start.elapsed().as_millis() as u64, "acquired after waiting");
                }
                return Ok(lease);
            }
            Attempt::HandedOver { token } => {
                let Some(r) = reg.as_mut() else {
                    return Err(error::protocol("a hand-over to a waiter that never queued"));
                };
                if let Some(lease) = claim(conn, key, &owner, token, opts, r, start).await? {
                    return Ok(lease);
                }
                continue;
            }
            Attempt::AlreadyHeld => return Err(Error::AlreadyHeld { key: key.clone() }),
            Attempt::Busy { pttl, entry } => {
                if let (Some(r), Some(entry)) = (reg.as_mut(), entry) {
                    r.entry = Some(entry);
                    r.entry_sent = Some(sent);
                }
                pttl
            }
        };
        // Its connection (with min_replicas) serves other writes meanwhile.
        drop(lane);
        // A hand-over may have arrived while the attempt was in flight.
        if let Some(r) = reg.as_mut() {
            if let Some(token) = r.slot.take() {
                if let Some(lease) = claim(conn, key, &owner, token, opts, r, start).await? {
                    return Ok(lease);
                }
                continue;
            }
        }
        let now = Instant::now();
        if deadline.is_some_and(|d| now >= d) {
            return Err(Error::Timeout {
                key: key.clone(),
                waited: now - start,
            });
        }
        let Some(r) = reg.as_mut() else {
            // Not subscribed yet: subscribe (never past the caller's wait
            // bound), then try again at once — queued this time.
            let r = router.register(&keys);
            subscribe_within(router, &r.channel, deadline, key, start).await?;
            reg = Some(r);
            continue;
        };
        let nap = next_check(pttl, recheck);
        let wake = deadline.map_or(now + nap, |d| d.min(now + nap));
        tokio::select! {
            _ = r.slot.notify.notified() => {}
            _ = tokio::time::sleep_until(wake) => {}
        }
        if let Some(token) = r.slot.take() {
            if let Some(lease) = claim(conn, key, &owner, token, opts, r, start).await? {
                return Ok(lease);
            }
        }
        // Otherwise: look again (refreshing the entry), or time out at the
        // top of the next round.
    }
}

/// Subscribes to `channel`, never past the caller's wait bound.
async fn subscribe_within(
    router: &Router,
    channel: &str,
    deadline: Option<Instant>,
    key: &LockKey,
    start: Instant,
) -> Result<()> {
    match deadline {
        Some(d) => match tokio::time::timeout_at(d, router.subscribe(channel)).await {
            Ok(res) => res,
            Err(_) => Err(Error::Timeout {
                key: key.clone(),
                waited: start.elapsed(),
            }),
        },
        None => router.subscribe(channel).await,
    }
}

/// Turns a lease handed to this waiter into the caller's [`Lease`].
///
/// The release that handed it over ran after this waiter's last queued
/// attempt, so the server's expiry is at least that attempt's send time +
/// ttl: the lease counts from there (never later than the server's). When
/// that leaves less than half the TTL, one renewal makes it whole first;
/// with `min_replicas` always, so that a write of this connection follows
/// the hand-over (written by the releaser's) and `WAIT` covers both — short
/// of replicas, the lease is released (passed on to the next waiter) and
/// the error returned. `None`: the lease ran out before it could be
/// claimed; wait again.
async fn claim(
    conn: &Conn,
    key: &LockKey,
    owner: &Owner,
    token: FencingToken,
    opts: &LockOptions,
    reg: &mut Registration,
    start: Instant,
) -> Result<Option<Lease>> {
    let sent = reg.entry_sent.unwrap_or(start);
    let mut lease = granted(key, owner.clone(), token, opts, sent);
    if conn.config().min_replicas > 0 || lease.remaining() < lease.ttl / 2 {
        match conn.extend(&lease, lease.ttl).await {
            Ok(renewed) => lease = renewed,
            Err(Error::LeaseLost { .. }) => return Ok(None),
            Err(e) => {
                // Claimed on the server (a queued attempt that found it, or
                // this renewal, cleared the waiter's name from the state, so
                // its leave passes nothing on): given back here instead.
                conn.give_back(&lease).await;
                return Err(e);
            }
        }
    }
    reg.disarm();
    Ok(Some(lease))
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

    #[test]
    fn grant_messages() {
        assert_eq!(
            parse_grant("g|1796033680636908|ab12|{p/a|b}:l"),
            Some(Grant {
                token: FencingToken::new(1_796_033_680_636_908),
                waiter: "ab12",
                lock: "{p/a|b}:l",
            })
        );
        for bad in [
            "",
            "g",
            "g|x|a|b",
            "g|0|a|{p/k}:l",
            "h|1|a|{p/k}:l",
            "g|1|a",
        ] {
            assert_eq!(parse_grant(bad), None, "{bad}");
        }
    }

    fn message(ch: &str, payload: &str) -> PushInfo {
        PushInfo {
            kind: PushKind::Message,
            data: vec![
                redis::Value::BulkString(ch.as_bytes().to_vec()),
                redis::Value::BulkString(payload.as_bytes().to_vec()),
            ],
        }
    }

    async fn woke(r: &Registration) -> bool {
        tokio::time::timeout(Duration::from_millis(20), r.slot.notify.notified())
            .await
            .is_ok()
    }

    #[tokio::test]
    async fn hand_overs_reach_only_the_named_waiter() {
        let prefix = Prefix::new("p").unwrap();
        let router = Arc::new(Router::new(&prefix, "me".into(), false));
        let k = Keys::new(&prefix, &LockKey::new("k").unwrap());
        let a = router.register(&k);
        let b = router.register(&k);
        router.on_push(message("{p/}:w:me", &format!("g|42|{}|{{p/k}}:l", b.id)));
        assert!(woke(&b).await, "the named waiter has a wake-up");
        assert_eq!(b.slot.take(), Some(FencingToken::new(42)));
        assert!(!woke(&a).await, "the other waiter does not");
        assert_eq!(a.slot.take(), None);
        // Another client's channel, or garbage: ignored.
        router.on_push(message("{p/}:w:other", &format!("g|43|{}|{{p/k}}:l", a.id)));
        router.on_push(message("{p/}:w:me", "hello"));
        assert!(!woke(&a).await && a.slot.take().is_none());
        router.on_push(PushInfo {
            kind: PushKind::Disconnection,
            data: vec![],
        });
        assert!(woke(&a).await && woke(&b).await, "a disconnect wakes all");
        drop((a, b));
        assert!(router.waiters().is_empty());
    }
}
