//! `MemoryLock`: the in-process reference backend.

use std::{
    collections::{HashMap, VecDeque},
    sync::{
        atomic::{AtomicBool, AtomicU64, Ordering},
        Arc, Mutex, MutexGuard,
    },
    time::Duration,
};

use async_trait::async_trait;
use tokio::{sync::Notify, time::Instant};

use crate::{
    lease::deadline_after, wait::wait_deadline, Capabilities, DistributedLock, Error, FencingToken,
    Label, Lease, LockInfo, LockKey, LockOptions, Owner, ReleaseOutcome, Result,
};

const BACKEND: &str = "memory";

/// An in-process lock store: the reference implementation of the contract.
///
/// * TTLs are measured with tokio's clock, so tests can pause and advance time.
/// * Tokens come from one counter per store, so they strictly increase per key.
/// * Waiters are served in arrival order (FIFO hand-off on release or expiry).
/// * The holder's [`Label`] is kept with the grant; a re-entry keeps the
///   label of the first entry.
/// * Handles made with [`Clone`] or [`MemoryLock::with_namespace`] share the
///   store, like separate clients of one server.
///
/// It coordinates tasks of **one process** only; use a server backend to
/// coordinate processes or hosts. It is what the examples and the
/// documentation run on, and what `cargo test` runs the conformance suite against.
///
/// ```
/// use fenced_api::{DistributedLock, LockKey, LockOptions, MemoryLock};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> fenced_api::Result<()> {
/// let a = MemoryLock::new();
/// let b = a.clone(); // a second client of the same store
/// let key = LockKey::new("job")?;
/// let lease = a.try_acquire(&key, &LockOptions::default()).await?.unwrap();
/// assert!(b.try_acquire(&key, &LockOptions::default()).await?.is_none());
/// // Another namespace on the same store is independent.
/// assert!(a.with_namespace("other-app").try_acquire(&key, &LockOptions::default()).await?.is_some());
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct MemoryLock {
    store: Arc<Store>,
    namespace: Arc<str>,
}

#[derive(Debug, Default)]
struct Store {
    state: Mutex<State>,
    /// The semaphores and reader-writer locks (permits.rs): a namespace of
    /// their own.
    permits: Mutex<permits::PermitState>,
    available: AtomicBool,
    next_waiter: AtomicU64,
}

#[derive(Debug, Default)]
struct State {
    /// Last token handed out by this store (shared by all keys, so per key it
    /// strictly increases even after an idle entry is dropped).
    last_token: u64,
    entries: HashMap<(Arc<str>, LockKey), Entry>,
}

#[derive(Debug, Default)]
struct Entry {
    holder: Option<Holder>,
    waiters: VecDeque<Waiter>,
    /// When the key last became free (for the front waiter's grace period).
    free_since: Option<Instant>,
}

/// How long a free key stays reserved for the first waiter. A waiter whose
/// future is alive but no longer polled must not block the key forever.
const FRONT_GRACE: Duration = Duration::from_millis(250);

#[derive(Debug)]
struct Holder {
    owner: Owner,
    token: FencingToken,
    expires_at: Instant,
    count: u32,
    label: Option<Label>,
}

impl Holder {
    fn info(&self, key: &LockKey, now: Instant) -> LockInfo {
        LockInfo::new(
            key.clone(),
            self.owner.clone(),
            self.token,
            self.expires_at - now,
            self.count,
        )
        .with_label(self.label.clone())
    }
}

#[derive(Debug)]
struct Waiter {
    id: u64,
    wake: Arc<Notify>,
}

impl Entry {
    /// Drops a holder whose TTL has passed (expiry is evaluated lazily).
    fn purge_expired(&mut self, now: Instant) {
        if let Some(h) = self.holder.as_ref().filter(|h| h.expires_at <= now) {
            self.free_since = Some(h.expires_at);
            self.holder = None;
        }
    }

    /// Frees the key now and passes the turn to the first waiter.
    fn vacate(&mut self, now: Instant) {
        self.holder = None;
        self.free_since = Some(now);
        self.kick();
    }

    /// Tells the first waiter to look again (the holder changed or left).
    fn kick(&self) {
        if let Some(w) = self.waiters.front() {
            w.wake.notify_one();
        }
    }

    fn is_idle(&self) -> bool {
        self.holder.is_none() && self.waiters.is_empty()
    }

    fn current(&self, lease: &Lease, now: Instant) -> bool {
        self.holder
            .as_ref()
            .is_some_and(|h| h.owner == lease.owner && h.token == lease.token && h.expires_at > now)
    }
}

/// Result of one attempt under the state mutex.
enum Attempt {
    Granted(Lease),
    Busy { until: Option<Instant> },
}

impl MemoryLock {
    /// A new, empty store (default namespace).
    pub fn new() -> Self {
        MemoryLock {
            store: Arc::new(Store {
                available: AtomicBool::new(true),
                ..Store::default()
            }),
            namespace: Arc::from(""),
        }
    }

    /// A handle on the same store whose keys live in `namespace`, invisible
    /// to other namespaces.
    pub fn with_namespace(&self, namespace: impl AsRef<str>) -> Self {
        MemoryLock {
            store: Arc::clone(&self.store),
            namespace: Arc::from(namespace.as_ref()),
        }
    }

    /// Simulates an outage of the whole store: while unavailable, every
    /// operation on every handle fails with a retryable [`Error::Backend`].
    /// Used to test renewal failures and loss detection.
    pub fn set_available(&self, available: bool) {
        self.store.available.store(available, Ordering::SeqCst);
    }

    fn check_available(&self) -> Result<()> {
        if self.store.available.load(Ordering::SeqCst) {
            Ok(())
        } else {
            Err(Error::backend(
                BACKEND,
                true,
                "the in-memory store is unavailable (simulated outage)",
            ))
        }
    }

    fn state(&self) -> MutexGuard<'_, State> {
        // A panic while holding the mutex cannot leave the maps half-updated
        // in a way that breaks exclusion, so recover instead of propagating.
        self.store.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn slot(&self, key: &LockKey) -> (Arc<str>, LockKey) {
        (Arc::clone(&self.namespace), key.clone())
    }

    /// One attempt: grant, re-enter, or report when to look again.
    /// `me` is the caller's waiter id when it is queued (FIFO: only the first
    /// waiter may take a free key while others queue).
    fn attempt(
        &self,
        key: &LockKey,
        opts: &LockOptions,
        owner: &Owner,
        me: Option<u64>,
        sent: Instant,
    ) -> Result<Attempt> {
        self.check_available()?;
        let now = Instant::now();
        let mut state = self.state();
        let State {
            last_token,
            entries,
        } = &mut *state;
        let entry = entries.entry(self.slot(key)).or_default();
        entry.purge_expired(now);
        match &mut entry.holder {
            Some(h) if h.owner == *owner => {
                if !opts.is_reentrant() {
                    return Err(Error::AlreadyHeld { key: key.clone() });
                }
                h.count = h.count.saturating_add(1);
                h.expires_at = h.expires_at.max(deadline_after(now, opts.ttl()));
                let lease = Lease::new(key.clone(), owner.clone(), h.token, opts.ttl(), sent);
                Ok(Attempt::Granted(lease))
            }
            Some(h) => Ok(Attempt::Busy {
                until: Some(h.expires_at),
            }),
            None => {
                let reserved_until = entry.free_since.map(|t| t + FRONT_GRACE);
                let my_turn = match entry.waiters.front() {
                    None => true,
                    // Only the first waiter may take a free key — unless it
                    // did not claim it within the grace period.
                    Some(first) => Some(first.id) == me || reserved_until.is_some_and(|t| now >= t),
                };
                if !my_turn {
                    entry.kick();
                    return Ok(Attempt::Busy {
                        until: reserved_until,
                    });
                }
                entry.free_since = None;
                *last_token += 1;
                let token = FencingToken::new(*last_token);
                entry.holder = Some(Holder {
                    owner: owner.clone(),
                    token,
                    expires_at: deadline_after(now, opts.ttl()),
                    count: 1,
                    label: opts.label().cloned(),
                });
                if let Some(id) = me {
                    entry.waiters.retain(|w| w.id != id);
                }
                // The next waiter must learn the new holder's expiry.
                entry.kick();
                Ok(Attempt::Granted(Lease::new(
                    key.clone(),
                    owner.clone(),
                    token,
                    opts.ttl(),
                    sent,
                )))
            }
        }
    }

    fn enqueue(&self, key: &LockKey, id: u64, wake: &Arc<Notify>) {
        let mut state = self.state();
        let entry = state.entries.entry(self.slot(key)).or_default();
        if !entry.waiters.iter().any(|w| w.id == id) {
            entry.waiters.push_back(Waiter {
                id,
                wake: Arc::clone(wake),
            });
        }
    }
}

impl MemoryLock {
    /// Checks a `memory://` URL: it takes no host, path or parameter, so
    /// anything after the scheme is a mistake worth reporting (a typo such
    /// as `memory://?prefix=x` must not pass silently).
    ///
    /// # Errors
    ///
    /// [`Error::Config`](crate::Error::Config) for anything but `memory://`.
    pub fn check_url(url: &str) -> crate::Result<()> {
        match url.strip_prefix("memory://") {
            Some("") => Ok(()),
            Some(_) => Err(crate::Error::config(
                "`memory://` takes no host, path or parameters",
            )),
            None => Err(crate::Error::config("expected a memory:// url")),
        }
    }

    /// The `memory://` driver. Every `connect` makes a **new, empty** store:
    /// in-process locks cannot be shared through a URL.
    pub fn driver() -> crate::Driver {
        crate::Driver {
            name: "memory",
            schemes: &["memory"],
            connect: |url| {
                crate::Driver::boxed(async move {
                    Self::check_url(&url)?;
                    Ok(MemoryLock::new())
                })
            },
            migrate: None,
        }
    }
}

impl Default for MemoryLock {
    fn default() -> Self {
        Self::new()
    }
}

/// Removes a waiter from the queue when its `acquire` ends in any way,
/// including being dropped mid-wait (cancel safety), and passes the turn on.
struct QueueSlot<'a> {
    lock: &'a MemoryLock,
    key: &'a LockKey,
    id: u64,
}

impl Drop for QueueSlot<'_> {
    fn drop(&mut self) {
        let mut state = self.lock.state();
        let slot = self.lock.slot(self.key);
        if let Some(entry) = state.entries.get_mut(&slot) {
            let was_first = entry.waiters.front().is_some_and(|w| w.id == self.id);
            entry.waiters.retain(|w| w.id != self.id);
            if was_first {
                entry.kick();
            }
            if entry.is_idle() {
                state.entries.remove(&slot);
            }
        }
    }
}

#[async_trait]
impl DistributedLock for MemoryLock {
    async fn try_acquire(&self, key: &LockKey, opts: &LockOptions) -> Result<Option<Lease>> {
        let sent = Instant::now();
        let owner = opts.owner_or_random();
        match self.attempt(key, opts, &owner, None, sent)? {
            Attempt::Granted(lease) => Ok(Some(lease)),
            Attempt::Busy { .. } => {
                let mut state = self.state();
                let slot = self.slot(key);
                if state.entries.get(&slot).is_some_and(Entry::is_idle) {
                    state.entries.remove(&slot);
                }
                Ok(None)
            }
        }
    }

    async fn acquire(&self, key: &LockKey, opts: &LockOptions) -> Result<Lease> {
        let start = Instant::now();
        let deadline = wait_deadline(opts.wait(), start);
        let owner = opts.owner_or_random();
        let id = self.store.next_waiter.fetch_add(1, Ordering::Relaxed);
        let wake = Arc::new(Notify::new());
        let _slot = QueueSlot {
            lock: self,
            key,
            id,
        };
        let mut queued = false;
        loop {
            let sent = Instant::now();
            let until = match self.attempt(key, opts, &owner, queued.then_some(id), sent)? {
                Attempt::Granted(lease) => return Ok(lease),
                Attempt::Busy { until } => until,
            };
            let now = Instant::now();
            if deadline.is_some_and(|d| now >= d) {
                return Err(Error::Timeout {
                    key: key.clone(),
                    waited: now - start,
                });
            }
            if !queued {
                self.enqueue(key, id, &wake);
                queued = true;
                // Re-check at once: the holder may have left between the
                // attempt and joining the queue.
                continue;
            }
            let wake_at = match (until, deadline) {
                (Some(u), Some(d)) => Some(u.min(d)),
                (u, d) => u.or(d),
            };
            match wake_at {
                Some(at) => {
                    tokio::select! {
                        _ = wake.notified() => {}
                        _ = tokio::time::sleep_until(at) => {}
                    }
                }
                None => wake.notified().await,
            }
        }
    }

    async fn extend(&self, lease: &Lease, ttl: Duration) -> Result<Lease> {
        let ttl = LockOptions::validate_ttl(ttl)?;
        let sent = Instant::now();
        self.check_available()?;
        let now = Instant::now();
        let mut state = self.state();
        match state.entries.get_mut(&self.slot(&lease.key)) {
            Some(entry) if entry.current(lease, now) => {
                if let Some(h) = entry.holder.as_mut() {
                    let new = deadline_after(now, ttl);
                    // Re-entered: never cut the expiry another entry relies on.
                    h.expires_at = if h.count > 1 {
                        h.expires_at.max(new)
                    } else {
                        new
                    };
                }
                Ok(lease.renewed(ttl, sent))
            }
            _ => Err(Error::lease_lost(
                &lease.key,
                lease.token,
                "the lease expired or the key has another holder",
            )),
        }
    }

    async fn release(&self, lease: &Lease) -> Result<ReleaseOutcome> {
        self.check_available()?;
        let now = Instant::now();
        let mut state = self.state();
        let slot = self.slot(&lease.key);
        let Some(entry) = state.entries.get_mut(&slot) else {
            return Ok(ReleaseOutcome::NotHeld);
        };
        if !entry.current(lease, now) {
            entry.purge_expired(now);
            if entry.is_idle() {
                state.entries.remove(&slot);
            }
            return Ok(ReleaseOutcome::NotHeld);
        }
        let outcome = match entry.holder.as_mut() {
            Some(h) if h.count > 1 => {
                h.count -= 1;
                ReleaseOutcome::StillHeld { remaining: h.count }
            }
            _ => {
                entry.vacate(now);
                ReleaseOutcome::Released
            }
        };
        if entry.is_idle() {
            state.entries.remove(&slot);
        }
        Ok(outcome)
    }

    async fn inspect(&self, key: &LockKey) -> Result<Option<LockInfo>> {
        self.check_available()?;
        let now = Instant::now();
        let mut state = self.state();
        let slot = self.slot(key);
        if let Some(entry) = state.entries.get_mut(&slot) {
            entry.purge_expired(now);
            if entry.is_idle() {
                state.entries.remove(&slot);
            }
        }
        Ok(state
            .entries
            .get(&slot)
            .and_then(|e| e.holder.as_ref())
            .map(|h| h.info(key, now)))
    }

    async fn force_release(&self, key: &LockKey) -> Result<bool> {
        self.check_available()?;
        let now = Instant::now();
        let mut state = self.state();
        let slot = self.slot(key);
        let Some(entry) = state.entries.get_mut(&slot) else {
            return Ok(false);
        };
        entry.purge_expired(now);
        let removed = entry.holder.is_some();
        entry.vacate(now);
        if entry.is_idle() {
            state.entries.remove(&slot);
        }
        if removed {
            tracing::warn!(key = %key, "lock force-released");
        }
        Ok(removed)
    }

    async fn list(&self, limit: usize) -> Result<Vec<LockInfo>> {
        self.check_available()?;
        let now = Instant::now();
        let state = self.state();
        let mut held: Vec<LockInfo> = state
            .entries
            .iter()
            .filter(|((ns, _), _)| *ns == self.namespace)
            .filter_map(|((_, key), e)| {
                let h = e.holder.as_ref().filter(|h| h.expires_at > now)?;
                Some(h.info(key, now))
            })
            .collect();
        held.sort_by(|a, b| a.key.cmp(&b.key));
        held.truncate(limit);
        Ok(held)
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities::none()
            .backend(BACKEND)
            .native_wait(true)
            .fifo(true)
            .fencing(true)
            .reentrant(true)
    }

    fn semaphores(&self) -> Option<Arc<dyn crate::SemaphoreStore>> {
        Some(Arc::new(self.memory_semaphores()))
    }
}

mod permits;
pub use permits::MemorySemaphores;

#[cfg(test)]
mod tests;
