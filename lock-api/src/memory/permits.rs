//! The in-memory store's semaphores and reader-writer locks: the reference
//! implementation of the line model of [`crate::permits`].

use std::{
    collections::HashMap,
    pin::pin,
    sync::{Arc, MutexGuard},
    time::Duration,
};

use async_trait::async_trait;
use tokio::{sync::Notify, time::Instant};

use super::{MemoryLock, Store};
use crate::{
    lease::deadline_after,
    permits::{
        self, waiter_refresh, Decision, KeyHolders, LineEntry, PermitHolder, Permits,
        SemaphoreStore,
    },
    wait::wait_deadline,
    Capabilities, DistributedLock, Error, FencingToken, Label, Lease, LockInfo, LockKey,
    LockOptions, Owner, ReleaseOutcome, Result,
};

/// The semaphores of one [`MemoryLock`] store, in one namespace: what
/// [`MemoryLock::semaphores`](crate::DistributedLock::semaphores) returns.
#[derive(Debug, Clone)]
pub struct MemorySemaphores {
    store: Arc<Store>,
    namespace: Arc<str>,
}

#[derive(Debug, Default)]
pub(super) struct PermitState {
    /// Last token handed out (one counter for every key: per key it
    /// strictly increases even after an idle line is dropped).
    last_token: u64,
    lines: HashMap<(Arc<str>, LockKey), Line>,
}

/// One key's capacity and entries, in arrival (= token) order.
#[derive(Debug)]
struct Line {
    capacity: u32,
    entries: Vec<Entry>,
    /// Woken whenever an entry leaves: the waiters look again.
    changed: Arc<Notify>,
}

#[derive(Debug)]
struct Entry {
    token: FencingToken,
    owner: Owner,
    permits: Permits,
    /// A waiter's place is kept until here unless it renews it; a holder's
    /// lease ends here.
    expires_at: Instant,
    count: u32,
    label: Option<Label>,
}

impl Line {
    fn new(capacity: u32) -> Self {
        Line {
            capacity,
            entries: Vec::new(),
            changed: Arc::new(Notify::new()),
        }
    }

    /// Drops entries whose time has passed (expiry is evaluated lazily).
    fn purge(&mut self, now: Instant) {
        let before = self.entries.len();
        self.entries.retain(|e| e.expires_at > now);
        if self.entries.len() != before {
            self.changed.notify_waiters();
        }
    }

    /// How many entries, from the front, are granted.
    fn granted(&self) -> usize {
        permits::granted_count(
            self.entries.iter().map(|e| e.permits.weight()),
            self.capacity,
        )
    }

    fn position(&self, token: FencingToken) -> Option<usize> {
        self.entries.iter().position(|e| e.token == token)
    }

    /// The index of `lease`'s entry if it is granted and current.
    fn held(&self, lease: &Lease, now: Instant) -> Option<usize> {
        let i = self.position(lease.token)?;
        let e = &self.entries[i];
        (e.owner == lease.owner && e.expires_at > now && i < self.granted()).then_some(i)
    }

    fn remove(&mut self, i: usize) {
        self.entries.remove(i);
        self.changed.notify_waiters();
    }

    fn info(&self, key: &LockKey, e: &Entry, now: Instant) -> LockInfo {
        LockInfo::new(
            key.clone(),
            e.owner.clone(),
            e.token,
            e.expires_at.saturating_duration_since(now),
            e.count,
        )
        .with_label(e.label.clone())
    }
}

/// What one look at the line found for a request.
enum Look {
    Granted(Lease),
    /// Does not fit now.
    Wait,
}

impl MemoryLock {
    /// This store's semaphores, in this handle's namespace.
    pub fn memory_semaphores(&self) -> MemorySemaphores {
        MemorySemaphores {
            store: Arc::clone(&self.store),
            namespace: Arc::clone(&self.namespace),
        }
    }
}

impl MemorySemaphores {
    fn state(&self) -> MutexGuard<'_, PermitState> {
        self.store.permits.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn slot(&self, key: &LockKey) -> (Arc<str>, LockKey) {
        (Arc::clone(&self.namespace), key.clone())
    }

    fn check_available(&self) -> Result<()> {
        self.handle().check_available()
    }

    fn handle(&self) -> MemoryLock {
        MemoryLock {
            store: Arc::clone(&self.store),
            namespace: Arc::clone(&self.namespace),
        }
    }

    /// The first look of a request: re-entry, a grant, or — when `queue` —
    /// a place at the end of the line (returned as its token).
    fn arrive(
        &self,
        key: &LockKey,
        permits: Permits,
        opts: &LockOptions,
        owner: &Owner,
        queue: bool,
    ) -> Result<(Option<Look>, Option<FencingToken>)> {
        self.check_available()?;
        let sent = Instant::now();
        let now = sent;
        let mut state = self.state();
        let PermitState { last_token, lines } = &mut *state;
        let slot = self.slot(key);
        let line = lines
            .entry(slot.clone())
            .or_insert_with(|| Line::new(permits.capacity()));
        line.purge(now);
        if line.entries.is_empty() {
            line.capacity = permits.capacity();
        }
        let entries: Vec<LineEntry> = line
            .entries
            .iter()
            .map(|e| LineEntry {
                capacity: line.capacity,
                weight: e.permits.weight(),
                mine: e.owner == *owner,
            })
            .collect();
        let fits = match permits::decide(key, &entries, permits, opts, queue)? {
            Decision::Reenter { at } => {
                let e = &mut line.entries[at];
                e.count = e.count.saturating_add(1);
                e.expires_at = e.expires_at.max(deadline_after(now, opts.ttl()));
                let lease = Lease::new(key.clone(), owner.clone(), e.token, opts.ttl(), sent);
                return Ok((Some(Look::Granted(lease)), None));
            }
            Decision::Busy => {
                if line.entries.is_empty() {
                    lines.remove(&slot);
                }
                return Ok((Some(Look::Wait), None));
            }
            Decision::Grant => true,
            Decision::Queue => false,
        };
        *last_token += 1;
        let token = FencingToken::new(*last_token);
        line.entries.push(Entry {
            token,
            owner: owner.clone(),
            permits,
            expires_at: deadline_after(now, opts.ttl()),
            count: 1,
            label: opts.label().cloned(),
        });
        if fits {
            let lease = Lease::new(key.clone(), owner.clone(), token, opts.ttl(), sent);
            return Ok((Some(Look::Granted(lease)), Some(token)));
        }
        Ok((None, Some(token)))
    }

    /// A waiting entry looks again: granted (its lease starts now), or its
    /// place renewed for another TTL. `None` when the entry is gone
    /// (force-released, or not renewed in time).
    fn look_again(
        &self,
        key: &LockKey,
        opts: &LockOptions,
        owner: &Owner,
        token: FencingToken,
    ) -> Result<Option<Look>> {
        self.check_available()?;
        let sent = Instant::now();
        let mut state = self.state();
        let Some(line) = state.lines.get_mut(&self.slot(key)) else {
            return Ok(None);
        };
        line.purge(sent);
        let Some(i) = line.position(token) else {
            return Ok(None);
        };
        line.entries[i].expires_at = deadline_after(sent, opts.ttl());
        if i < line.granted() {
            let lease = Lease::new(key.clone(), owner.clone(), token, opts.ttl(), sent);
            return Ok(Some(Look::Granted(lease)));
        }
        Ok(Some(Look::Wait))
    }

    fn leave(&self, key: &LockKey, token: FencingToken) {
        let mut state = self.state();
        let slot = self.slot(key);
        if let Some(line) = state.lines.get_mut(&slot) {
            if let Some(i) = line.position(token) {
                line.remove(i);
            }
            if line.entries.is_empty() {
                state.lines.remove(&slot);
            }
        }
    }

    fn changed(&self, key: &LockKey) -> Option<Arc<Notify>> {
        self.state()
            .lines
            .get(&self.slot(key))
            .map(|l| Arc::clone(&l.changed))
    }
}

/// Takes a waiting entry out of the line when its `acquire` ends without a
/// grant, including when the future is dropped mid-wait (cancel safety).
struct Place<'a> {
    store: &'a MemorySemaphores,
    key: &'a LockKey,
    token: Option<FencingToken>,
}

impl Drop for Place<'_> {
    fn drop(&mut self) {
        if let Some(token) = self.token {
            self.store.leave(self.key, token);
        }
    }
}

#[async_trait]
impl SemaphoreStore for MemorySemaphores {
    async fn try_acquire_permits(
        &self,
        key: &LockKey,
        permits: Permits,
        opts: &LockOptions,
    ) -> Result<Option<Lease>> {
        let owner = opts.owner_or_random();
        match self.arrive(key, permits, opts, &owner, false)? {
            (Some(Look::Granted(lease)), _) => Ok(Some(lease)),
            _ => Ok(None),
        }
    }

    async fn acquire_permits(
        &self,
        key: &LockKey,
        permits: Permits,
        opts: &LockOptions,
    ) -> Result<Lease> {
        let start = Instant::now();
        let deadline = wait_deadline(opts.wait(), start);
        let owner = opts.owner_or_random();
        let queue = deadline.is_none_or(|d| d > start);
        let (look, token) = self.arrive(key, permits, opts, &owner, queue)?;
        if let Some(Look::Granted(lease)) = look {
            return Ok(lease);
        }
        let timeout = || Error::Timeout {
            key: key.clone(),
            waited: start.elapsed(),
        };
        let Some(mut token) = token else {
            return Err(timeout());
        };
        let mut place = Place {
            store: self,
            key,
            token: Some(token),
        };
        let refresh = waiter_refresh(opts.ttl());
        loop {
            // Registered before looking, so an entry leaving between the
            // look and the wait still wakes this waiter.
            let changed = self.changed(key).unwrap_or_default();
            let mut notified = pin!(changed.notified());
            notified.as_mut().enable();
            match self.look_again(key, opts, &owner, token)? {
                Some(Look::Granted(lease)) => {
                    place.token = None;
                    return Ok(lease);
                }
                Some(Look::Wait) => {}
                None => {
                    // Our place was taken away (force-released): join the
                    // line again at its end.
                    let (look, again) = self.arrive(key, permits, opts, &owner, true)?;
                    place.token = again;
                    if let Some(Look::Granted(lease)) = look {
                        place.token = None;
                        return Ok(lease);
                    }
                    let Some(again) = again else {
                        return Err(timeout());
                    };
                    token = again;
                    continue;
                }
            }
            let now = Instant::now();
            if deadline.is_some_and(|d| now >= d) {
                return Err(timeout());
            }
            let wake_at = deadline.map_or(now + refresh, |d| d.min(now + refresh));
            tokio::select! {
                _ = notified => {}
                _ = tokio::time::sleep_until(wake_at) => {}
            }
        }
    }

    async fn holders(&self, key: &LockKey) -> Result<Option<KeyHolders>> {
        self.check_available()?;
        let now = Instant::now();
        let mut state = self.state();
        let slot = self.slot(key);
        let Some(line) = state.lines.get_mut(&slot) else {
            return Ok(None);
        };
        line.purge(now);
        if line.entries.is_empty() {
            state.lines.remove(&slot);
            return Ok(None);
        }
        let granted = line.granted();
        let holders = line.entries[..granted]
            .iter()
            .map(|e| PermitHolder::new(line.info(key, e, now), e.permits))
            .collect();
        Ok(Some(KeyHolders::new(
            key.clone(),
            line.capacity,
            holders,
            line.entries.len() - granted,
        )))
    }
}

#[async_trait]
impl DistributedLock for MemorySemaphores {
    async fn try_acquire(&self, key: &LockKey, opts: &LockOptions) -> Result<Option<Lease>> {
        self.try_acquire_permits(key, Permits::semaphore(1)?, opts)
            .await
    }

    async fn acquire(&self, key: &LockKey, opts: &LockOptions) -> Result<Lease> {
        self.acquire_permits(key, Permits::semaphore(1)?, opts)
            .await
    }

    async fn extend(&self, lease: &Lease, ttl: Duration) -> Result<Lease> {
        let ttl = LockOptions::validate_ttl(ttl)?;
        self.check_available()?;
        let sent = Instant::now();
        let mut state = self.state();
        let line = state.lines.get_mut(&self.slot(&lease.key));
        let Some((line, i)) = line.and_then(|l| l.held(lease, sent).map(|i| (l, i))) else {
            return Err(Error::lease_lost(
                &lease.key,
                lease.token,
                "the permit expired or was force-released",
            ));
        };
        let e = &mut line.entries[i];
        let new = deadline_after(sent, ttl);
        // Re-entered: never cut the expiry another entry relies on.
        e.expires_at = if e.count > 1 {
            e.expires_at.max(new)
        } else {
            new
        };
        Ok(lease.renewed(ttl, sent))
    }

    async fn release(&self, lease: &Lease) -> Result<ReleaseOutcome> {
        self.check_available()?;
        let now = Instant::now();
        let mut state = self.state();
        let slot = self.slot(&lease.key);
        let Some(line) = state.lines.get_mut(&slot) else {
            return Ok(ReleaseOutcome::NotHeld);
        };
        let outcome = match line.held(lease, now) {
            None => ReleaseOutcome::NotHeld,
            Some(i) if line.entries[i].count > 1 => {
                line.entries[i].count -= 1;
                ReleaseOutcome::StillHeld {
                    remaining: line.entries[i].count,
                }
            }
            Some(i) => {
                line.remove(i);
                ReleaseOutcome::Released
            }
        };
        line.purge(now);
        if line.entries.is_empty() {
            state.lines.remove(&slot);
        }
        Ok(outcome)
    }

    async fn inspect(&self, key: &LockKey) -> Result<Option<LockInfo>> {
        Ok(self
            .holders(key)
            .await?
            .and_then(|h| h.holders.into_iter().next())
            .map(|h| h.info))
    }

    async fn force_release(&self, key: &LockKey) -> Result<bool> {
        self.check_available()?;
        let now = Instant::now();
        let Some(mut line) = self.state().lines.remove(&self.slot(key)) else {
            return Ok(false);
        };
        line.purge(now);
        let removed = line.granted() > 0;
        line.changed.notify_waiters();
        if removed {
            tracing::warn!(key = %key, "semaphore force-released");
        }
        Ok(removed)
    }

    async fn list(&self, limit: usize) -> Result<Vec<LockInfo>> {
        self.check_available()?;
        let now = Instant::now();
        let state = self.state();
        let mut held: Vec<LockInfo> = state
            .lines
            .iter()
            .filter(|((ns, _), _)| *ns == self.namespace)
            .flat_map(|((_, key), line)| {
                line.entries[..line.granted()]
                    .iter()
                    .filter(|e| e.expires_at > now)
                    .map(|e| line.info(key, e, now))
                    .collect::<Vec<_>>()
            })
            .collect();
        held.sort_by(|a, b| a.key.cmp(&b.key).then(a.token.cmp(&b.token)));
        held.truncate(limit);
        Ok(held)
    }

    fn capabilities(&self) -> Capabilities {
        self.handle().capabilities()
    }

    /// Itself: a semaphore store's mutex is its semaphore of one permit.
    fn semaphores(&self) -> Option<Arc<dyn SemaphoreStore>> {
        Some(Arc::new(self.clone()))
    }
}
