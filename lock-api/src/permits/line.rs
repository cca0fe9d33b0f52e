//! The line model for stores without a native wait (the SQL stores,
//! Redis): the steps a store implements ([`LineStore`]), the waiting built
//! on them ([`acquire_in_line`]), and [`LineSemaphores`], which makes such a
//! store a [`SemaphoreStore`] (and a [`DistributedLock`]) in one place.

use std::{fmt, sync::Arc, time::Duration};

use async_trait::async_trait;

use super::{KeyHolders, PermitHolder, Permits, SemaphoreStore};
use crate::{
    wait::{Backoff, Polling},
    Capabilities, DistributedLock, Error, FencingToken, Lease, LockInfo, LockKey, LockOptions,
    Owner, ReleaseOutcome, Result,
};

/// The TTL a waiting entry is kept alive by, and how often: a waiter renews
/// its place every third of its TTL, so one that stops (its process frozen
/// or gone) leaves the line after at most one TTL.
pub fn waiter_refresh(ttl: Duration) -> Duration {
    (ttl / 3).max(Duration::from_millis(1))
}

/// What a store with no native wait does on the first look at a line:
/// see [`LineStore`].
#[derive(Debug)]
pub enum Arrival {
    /// Granted at once (or re-entered): the lease.
    Granted(Lease),
    /// An entry was put at the end of the line with this token; it is not
    /// granted yet.
    Queued(FencingToken),
    /// Not granted, and not queued (the caller asked not to).
    Busy,
}

/// What a later look at a queued entry finds: see [`LineStore`].
#[derive(Debug)]
pub enum Look {
    /// The entry is granted; its lease starts with this look.
    Granted(Lease),
    /// Still waiting (its place renewed if asked).
    Waiting,
    /// The entry is gone: its place expired or was force-released.
    Gone,
}

/// The steps of the line model for stores without a native wait (the SQL
/// stores, Redis). [`LineSemaphores`] makes a `LineStore` a
/// [`SemaphoreStore`]: its acquisitions are [`try_acquire_in_line`] and
/// [`acquire_in_line`] (polling with backoff, woken early by releases in the
/// same process), and every other call goes to one step below.
///
/// Each step must be atomic on the store: `arrive` decides the grant (no
/// entry may be added before an earlier one it did not count) and `look`
/// may rely on entries before a granted one only ever leaving. Every step
/// treats an entry whose expiry has passed (on the store's clock) as gone.
#[async_trait]
pub trait LineStore: Send + Sync + fmt::Debug {
    /// Purges the key's expired entries, checks the capacity and re-entry,
    /// and grants `permits` if everything in line plus them fits; otherwise
    /// queues an entry when `queue`.
    async fn arrive(
        &self,
        key: &LockKey,
        permits: Permits,
        opts: &LockOptions,
        owner: &Owner,
        queue: bool,
    ) -> Result<Arrival>;

    /// Looks at the entry `token` of `owner`: granted (its lease starts
    /// now, for `opts.ttl()`), waiting (its place renewed for `opts.ttl()`
    /// when `renew`), or gone.
    async fn look(
        &self,
        key: &LockKey,
        opts: &LockOptions,
        owner: &Owner,
        token: FencingToken,
        renew: bool,
    ) -> Result<Look>;

    /// Takes a waiting entry out of the line (timeout, cancellation).
    async fn leave(&self, key: &LockKey, owner: &Owner, token: FencingToken) -> Result<()>;

    /// Renews the granted entry of `lease` for `ttl` (`ttl` validated; a
    /// re-entered entry's expiry never shortened); whether it was current.
    async fn renew(&self, lease: &Lease, ttl: Duration) -> Result<bool>;

    /// Extends the granted entry of `lease` for `ttl`: a
    /// [`renew`](Self::renew) whose lease then runs from the send time of
    /// that request. A store whose deadline comes from elsewhere (etcd: the
    /// keep-alive of the session lease the entry is on) overrides this.
    ///
    /// # Errors
    ///
    /// [`Error::LeaseLost`] when the entry is no longer `lease`'s; the
    /// store's errors.
    async fn extend(&self, lease: &Lease, ttl: Duration) -> Result<Lease> {
        let ttl = LockOptions::validate_ttl(ttl)?;
        let sent = tokio::time::Instant::now();
        if self.renew(lease, ttl).await? {
            return Ok(lease.renewed(ttl, sent));
        }
        Err(Error::lease_lost(
            &lease.key,
            lease.token,
            "the permit expired, was released or was force-released",
        ))
    }

    /// Gives back one hold of `lease`'s entry: the last removes it.
    async fn give_back(&self, lease: &Lease) -> Result<ReleaseOutcome>;

    /// The live entries of `key`, in line order.
    async fn read_line(&self, key: &LockKey) -> Result<Vec<LineRow>>;

    /// Removes every entry of `key`; whether a live one was there.
    async fn clear(&self, key: &LockKey) -> Result<bool>;

    /// The granted entries of every key of the namespace, in key order and
    /// line order, at most `limit`.
    async fn list_granted(&self, limit: usize) -> Result<Vec<LockInfo>>;

    /// The scope and release signal of this store's waiters (see
    /// [`Polling`]): a scope of their own, apart from the mutexes'.
    fn polling(&self) -> &Polling;

    /// What the store's semaphores can promise.
    fn line_capabilities(&self) -> Capabilities;

    /// The pause between looks of a waiter.
    fn backoff(&self) -> Backoff {
        Backoff::default()
    }

    /// Called before a waiter joins the line; what it returns is kept for
    /// as long as it waits (PostgreSQL: listening for the releases of other
    /// processes). Nothing by default.
    async fn waiting_for<'a>(&'a self, key: &LockKey, opts: &LockOptions) -> Box<dyn Send + 'a> {
        let _ = (key, opts);
        Box::new(())
    }
}

/// A live entry of a line as [`LineStore::read_line`] reads it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct LineRow {
    /// Owner, token (its place), remaining TTL, hold count, label.
    pub info: LockInfo,
    /// The capacity it was made with.
    pub capacity: u32,
    /// Its weight.
    pub weight: u32,
}

impl LineRow {
    /// Builds a row (for backend implementors).
    pub fn new(info: LockInfo, capacity: u32, weight: u32) -> Self {
        LineRow {
            info,
            capacity,
            weight,
        }
    }
}

/// One entry of a key's line as a [`LineStore`] read it, in line order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LineEntry {
    /// The capacity the entry was made with.
    pub capacity: u32,
    /// Its weight.
    pub weight: u32,
    /// Whether its owner is the one now asking.
    pub mine: bool,
}

/// What an arrival does, decided from the live entries of the line (see
/// [`decide`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// The asker holds entry number `at` (granted, same weight) and may
    /// re-enter it.
    Reenter {
        /// Its index in the line.
        at: usize,
    },
    /// Put a granted entry at the end.
    Grant,
    /// Put a waiting entry at the end.
    Queue,
    /// Neither: it does not fit and the asker does not queue.
    Busy,
}

/// The arrival rule of the line model, for stores that read the line and
/// then write (inside one transaction, or under a lock on the key):
/// refuses another capacity ([`Error::KindMismatch`]) and a second entry
/// of the same owner ([`Error::AlreadyHeld`], unless `opts` is reentrant
/// and that entry is granted with the same weight), and grants when the
/// whole line plus `permits` fits.
///
/// # Errors
///
/// [`Error::KindMismatch`], [`Error::AlreadyHeld`], as above.
pub fn decide(
    key: &LockKey,
    line: &[LineEntry],
    permits: Permits,
    opts: &LockOptions,
    queue: bool,
) -> Result<Decision> {
    let mut total = 0u64;
    let mut mine = None;
    for (at, e) in line.iter().enumerate() {
        if e.capacity != permits.capacity() {
            return Err(permits.mismatch(key, e.capacity));
        }
        total += u64::from(e.weight);
        if e.mine {
            mine = Some((at, total <= u64::from(e.capacity), e.weight));
        }
    }
    if let Some((at, granted, weight)) = mine {
        if opts.is_reentrant() && granted && weight == permits.weight() {
            return Ok(Decision::Reenter { at });
        }
        return Err(Error::AlreadyHeld { key: key.clone() });
    }
    Ok(
        if total + u64::from(permits.weight()) <= u64::from(permits.capacity()) {
            Decision::Grant
        } else if queue {
            Decision::Queue
        } else {
            Decision::Busy
        },
    )
}

/// How many entries from the front of a line with these weights are
/// granted under `capacity`.
pub fn granted_count(weights: impl IntoIterator<Item = u32>, capacity: u32) -> usize {
    let mut sum = 0u64;
    weights
        .into_iter()
        .take_while(|w| {
            sum += u64::from(*w);
            sum <= u64::from(capacity)
        })
        .count()
}

/// `SemaphoreStore::try_acquire_permits` from a [`LineStore`].
///
/// # Errors
///
/// Those of [`LineStore::arrive`].
pub async fn try_acquire_in_line<L: LineStore + ?Sized>(
    store: &L,
    key: &LockKey,
    permits: Permits,
    opts: &LockOptions,
) -> Result<Option<Lease>> {
    let owner = opts.owner_or_random();
    match store.arrive(key, permits, opts, &owner, false).await? {
        Arrival::Granted(lease) => Ok(Some(lease)),
        Arrival::Queued(token) => {
            // A store that queued anyway: leave again, report contention.
            store.leave(key, &owner, token).await?;
            Ok(None)
        }
        Arrival::Busy => Ok(None),
    }
}

/// `SemaphoreStore::acquire_permits` from a [`LineStore`]: takes a place in
/// line, then looks again after each local release in `scope` (see
/// [`Polling`](crate::wait::Polling) for scopes) or after a backoff delay,
/// renewing the place every third of its TTL. A waiter that times out, or
/// whose future is dropped or fails, leaves the line (by a spawned `leave`
/// inside a tokio runtime; at its TTL when that fails too).
///
/// # Errors
///
/// [`Error::Timeout`] at the wait bound; the errors of the store's steps.
pub async fn acquire_in_line<L: LineStore + Clone + 'static>(
    store: &L,
    scope: &str,
    key: &LockKey,
    permits: Permits,
    opts: &LockOptions,
    backoff: crate::wait::Backoff,
) -> Result<Lease> {
    let start = tokio::time::Instant::now();
    let deadline = crate::wait::wait_deadline(opts.wait(), start);
    let timeout = || Error::Timeout {
        key: key.clone(),
        waited: start.elapsed(),
    };
    let owner = opts.owner_or_random();
    let queue = deadline.is_none_or(|d| d > start);
    let mut token = match store.arrive(key, permits, opts, &owner, queue).await? {
        Arrival::Granted(lease) => return Ok(lease),
        Arrival::Busy => return Err(timeout()),
        Arrival::Queued(token) => token,
    };
    let mut place = Place {
        store: store.clone(),
        key: key.clone(),
        owner: owner.clone(),
        token: Some(token),
    };
    let line = crate::wait::line(scope, key);
    let refresh = waiter_refresh(opts.ttl());
    let mut renewed_at = tokio::time::Instant::now();
    let mut attempt = 0u32;
    loop {
        let changed = line.changed.notified();
        tokio::pin!(changed);
        changed.as_mut().enable();
        let now = tokio::time::Instant::now();
        let renew = now >= renewed_at + refresh;
        match store.look(key, opts, &owner, token, renew).await? {
            Look::Granted(lease) => {
                place.token = None;
                return Ok(lease);
            }
            Look::Waiting => {
                if renew {
                    renewed_at = now;
                }
            }
            Look::Gone => {
                // Force-released (or not renewed in time): line up again.
                match store.arrive(key, permits, opts, &owner, true).await? {
                    Arrival::Granted(lease) => {
                        place.token = None;
                        return Ok(lease);
                    }
                    Arrival::Busy => return Err(timeout()),
                    Arrival::Queued(again) => {
                        token = again;
                        place.token = Some(again);
                        renewed_at = tokio::time::Instant::now();
                    }
                }
            }
        }
        let now = tokio::time::Instant::now();
        if deadline.is_some_and(|d| now >= d) {
            // Left here, or (if that fails) by the place's spawned leave,
            // else at its TTL; the caller learns of the timeout either way.
            if store.leave(key, &owner, token).await.is_ok() {
                place.token = None;
            }
            return Err(timeout());
        }
        let mut wake = (now + backoff.delay(attempt)).min(renewed_at + refresh);
        if let Some(d) = deadline {
            wake = wake.min(d);
        }
        attempt = attempt.saturating_add(1);
        tokio::select! {
            _ = &mut changed => attempt = 0,
            _ = tokio::time::sleep_until(wake) => {}
        }
    }
}

/// A queued entry that leaves the line when its `acquire` ends without a
/// grant, including when the future is dropped.
struct Place<L: LineStore + Clone + 'static> {
    store: L,
    key: LockKey,
    owner: Owner,
    token: Option<FencingToken>,
}

impl<L: LineStore + Clone + 'static> Drop for Place<L> {
    fn drop(&mut self) {
        let Some(token) = self.token.take() else {
            return;
        };
        // Without a runtime the entry expires after its TTL.
        let (store, key, owner) = (self.store.clone(), self.key.clone(), self.owner.clone());
        crate::cleanup::spawn(async move {
            if let Err(e) = store.leave(&key, &owner, token).await {
                tracing::debug!(key = %key, error = %e, "a cancelled waiter could not leave the line; it expires after its ttl");
            }
        });
    }
}

/// A [`LineStore`] as a [`SemaphoreStore`] and [`DistributedLock`]: what
/// the SQL stores and Redis return from
/// [`DistributedLock::semaphores`]. Cheap to clone when the store is.
#[derive(Debug, Clone)]
pub struct LineSemaphores<L>(L);

impl<L: LineStore + Clone + 'static> LineSemaphores<L> {
    /// The semaphores of `store`.
    pub fn new(store: L) -> Self {
        LineSemaphores(store)
    }

    /// The store.
    pub fn store(&self) -> &L {
        &self.0
    }
}

#[async_trait]
impl<L: LineStore + Clone + 'static> SemaphoreStore for LineSemaphores<L> {
    async fn try_acquire_permits(
        &self,
        key: &LockKey,
        permits: Permits,
        opts: &LockOptions,
    ) -> Result<Option<Lease>> {
        try_acquire_in_line(&self.0, key, permits, opts).await
    }

    async fn acquire_permits(
        &self,
        key: &LockKey,
        permits: Permits,
        opts: &LockOptions,
    ) -> Result<Lease> {
        let _waiting = match opts.wait() {
            crate::WaitPolicy::NoWait => None,
            _ => Some(self.0.waiting_for(key, opts).await),
        };
        let scope = self.0.polling().scope();
        acquire_in_line(&self.0, scope, key, permits, opts, self.0.backoff()).await
    }

    async fn holders(&self, key: &LockKey) -> Result<Option<KeyHolders>> {
        let rows = self.0.read_line(key).await?;
        let Some(capacity) = rows.first().map(|r| r.capacity) else {
            return Ok(None);
        };
        let granted = granted_count(rows.iter().map(|r| r.weight), capacity);
        let mut holders = Vec::with_capacity(granted);
        for row in rows.iter().take(granted) {
            let permits = Permits::from_parts(row.capacity, row.weight).map_err(|_| {
                Error::backend(
                    self.0.line_capabilities().backend_name(),
                    false,
                    format!(
                        "an entry of `{key}` has capacity {} and weight {}; was the store edited by hand?",
                        row.capacity, row.weight
                    ),
                )
            })?;
            holders.push(PermitHolder::new(row.info.clone(), permits));
        }
        Ok(Some(KeyHolders::new(
            key.clone(),
            capacity,
            holders,
            rows.len() - granted,
        )))
    }
}

#[async_trait]
impl<L: LineStore + Clone + 'static> DistributedLock for LineSemaphores<L> {
    async fn try_acquire(&self, key: &LockKey, opts: &LockOptions) -> Result<Option<Lease>> {
        self.try_acquire_permits(key, Permits::semaphore(1)?, opts)
            .await
    }

    async fn acquire(&self, key: &LockKey, opts: &LockOptions) -> Result<Lease> {
        self.acquire_permits(key, Permits::semaphore(1)?, opts)
            .await
    }

    async fn extend(&self, lease: &Lease, ttl: Duration) -> Result<Lease> {
        self.0.extend(lease, ttl).await
    }

    async fn release(&self, lease: &Lease) -> Result<ReleaseOutcome> {
        let outcome = self.0.give_back(lease).await?;
        Ok(self.0.polling().released(&lease.key, outcome))
    }

    async fn inspect(&self, key: &LockKey) -> Result<Option<LockInfo>> {
        Ok(self
            .holders(key)
            .await?
            .and_then(|k| k.holders.into_iter().next())
            .map(|h| h.info))
    }

    async fn force_release(&self, key: &LockKey) -> Result<bool> {
        let live = self.0.clear(key).await?;
        if live {
            tracing::warn!(key = %key, "semaphore force-released");
        }
        Ok(self.0.polling().force_released(key, live))
    }

    async fn list(&self, limit: usize) -> Result<Vec<LockInfo>> {
        self.0.list_granted(limit).await
    }

    fn capabilities(&self) -> Capabilities {
        self.0.line_capabilities()
    }

    /// Itself: a semaphore store's mutex is its semaphore of one permit.
    fn semaphores(&self) -> Option<Arc<dyn SemaphoreStore>> {
        Some(Arc::new(self.clone()))
    }
}
