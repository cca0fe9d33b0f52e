//! The lock family on top of [`LockClient`]: semaphores, reader-writer
//! locks, all-or-nothing multi-locks and leader election.
//!
//! Every member is held through a [`LockGuard`] (or a set of them) with the
//! same policy as the mutex: a lease per grant with its own fencing token,
//! renewed by the watchdog, given up a safety margin before the store could
//! hand it on, and a loss signal.
//!
//! * [`Semaphore`] and [`RwLock`] ask the store's
//!   [`SemaphoreStore`](crate::SemaphoreStore) (see [`crate::permits`] for
//!   the model); their keys are a namespace of their own, beside the
//!   mutexes'.
//! * [`MultiGuard`] holds several mutexes at once, all or nothing
//!   ([`LockClient::acquire_all`]); it works on every store.
//! * [`Election`] is a mutex whose holder is the leader, its fencing token
//!   the term ([`LockClient::election`]); it works on every store, and
//!   shares the mutex's key: the leader of `K` holds the mutex `K`.

use std::{fmt, sync::Arc, time::Duration};

use futures_util::stream::BoxStream;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::{
    client::Request, DistributedLock, Error, FencingToken, IntoLockKey, KeyHolders, Label,
    LockClient, LockGuard, LockKey, LossReason, Owner, Permits, Result, WaitPolicy,
};

impl LockClient {
    /// A semaphore of `permits` on `key`: at most `permits` holders at once,
    /// each with a lease and fencing token of its own.
    ///
    /// Every holder of `key` must ask for the same number of permits: a
    /// request with another number fails with [`Error::KindMismatch`] while
    /// the key has holders or waiters, never silently admitting more.
    ///
    /// ```
    /// use std::sync::Arc;
    /// use fenced_api::{LockClient, MemoryLock};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> fenced_api::Result<()> {
    /// let client = LockClient::new(Arc::new(MemoryLock::new()));
    /// let gpus = client.semaphore("pool:gpu", 2)?;
    /// // Two workers (tasks) take a permit each…
    /// let mut held = Vec::new();
    /// for _ in 0..2 {
    ///     let gpus = gpus.clone();
    ///     held.push(tokio::spawn(async move { gpus.acquire().await }).await.expect("task")?);
    /// }
    /// assert!(held[1].token() > held[0].token());
    /// // …and a third asker is refused (or, with `acquire`, waits in line).
    /// assert!(gpus.try_acquire().await?.is_none());
    /// for permit in held {
    ///     permit.release().await?;
    /// }
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    ///
    /// * [`Error::InvalidKey`], or [`Error::InvalidOptions`] for 0 or more
    ///   than [`Permits::MAX_PERMITS`] permits.
    /// * [`Error::Unsupported`] when the store has no semaphores.
    pub fn semaphore(&self, key: impl IntoLockKey, permits: u32) -> Result<Semaphore> {
        let key = key.into_lock_key()?;
        let permits = Permits::semaphore(permits)?;
        Ok(Semaphore {
            client: self.permit_client()?,
            key,
            permits,
        })
    }

    /// A reader-writer lock on `key`: many readers or one writer.
    ///
    /// A writer waits for the readers and writers before it; readers that
    /// arrive while a writer waits line up behind it, so a stream of
    /// readers never starves a writer. A writer's fencing token is greater
    /// than the token of every grant before it.
    ///
    /// ```
    /// use std::sync::Arc;
    /// use fenced_api::{LockClient, MemoryLock};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> fenced_api::Result<()> {
    /// let client = LockClient::new(Arc::new(MemoryLock::new()));
    /// let config = client.rw_lock("config:tenant-7")?;
    /// let reader = config.read().await?;
    /// // Other readers are welcome, a writer is not.
    /// let other = tokio::spawn({ let c = config.clone(); async move { c.try_read().await } })
    ///     .await
    ///     .expect("task")?;
    /// assert!(other.is_some());
    /// assert!(tokio::spawn({ let c = config.clone(); async move { c.try_write().await } })
    ///     .await
    ///     .expect("task")?
    ///     .is_none());
    /// let last_read = reader.token().max(other.as_ref().map(|g| g.token()).unwrap());
    /// reader.release().await?;
    /// other.unwrap().release().await?;
    /// let writer = config.write().await?;
    /// assert!(writer.token() > last_read);
    /// writer.release().await?;
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    ///
    /// [`Error::InvalidKey`]; [`Error::Unsupported`] when the store has no
    /// semaphores (reader-writer locks are built on them).
    pub fn rw_lock(&self, key: impl IntoLockKey) -> Result<RwLock> {
        Ok(RwLock {
            client: self.permit_client()?,
            key: key.into_lock_key()?,
        })
    }

    /// Takes every key of `keys`, all or nothing, waiting as configured (one
    /// wait bound for the whole set).
    ///
    /// The keys are taken one by one in one global order (their bytes), so
    /// clients asking for overlapping sets in different orders never
    /// deadlock: whoever holds the lowest contested key proceeds. If a key
    /// cannot be had within the bound, the ones already taken are released
    /// and the result is [`Error::Timeout`] naming that key. Duplicate keys
    /// count once.
    ///
    /// ```
    /// use std::sync::Arc;
    /// use fenced_api::{LockClient, MemoryLock};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> fenced_api::Result<()> {
    /// let client = LockClient::new(Arc::new(MemoryLock::new()));
    /// // Move stock between two warehouses: both rows, or neither.
    /// let both = client.acquire_all(["stock:berlin", "stock:lyon"]).await?;
    /// assert_eq!(both.len(), 2);
    /// let lyon = both.token(&"stock:lyon".parse()?).expect("member");
    /// assert!(lyon.get() >= 1);
    /// both.release().await?;
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    ///
    /// * [`Error::InvalidKey`] for a bad key, [`Error::InvalidOptions`] for
    ///   an empty set — before any I/O.
    /// * [`Error::AlreadyHeld`] if the caller holds one of the keys.
    /// * [`Error::Timeout`], [`Error::Backend`] as [`acquire`](Self::acquire);
    ///   nothing stays held.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future drops the guards taken so far, which release
    /// their keys (promptly inside a tokio runtime, at their TTL otherwise).
    pub async fn acquire_all<I>(&self, keys: I) -> Result<MultiGuard>
    where
        I: IntoIterator,
        I::Item: IntoLockKey,
    {
        let wait = self.inner.config.wait;
        self.acquire_all_with(keys, wait).await
    }

    /// [`acquire_all`](Self::acquire_all) with `wait` for the whole set.
    ///
    /// # Errors
    ///
    /// As [`acquire_all`](Self::acquire_all).
    pub async fn acquire_all_with<I>(&self, keys: I, wait: WaitPolicy) -> Result<MultiGuard>
    where
        I: IntoIterator,
        I::Item: IntoLockKey,
    {
        let keys = set_of(keys)?;
        match self.take_all(keys, Some(wait)).await? {
            Some(all) => Ok(all),
            None => Err(Error::invalid_options("no key to wait for")),
        }
    }

    /// Tries once for every key of `keys`: all of them, or `Ok(None)` and
    /// none held.
    ///
    /// # Errors
    ///
    /// As [`acquire_all`](Self::acquire_all), except that contention is `Ok(None)`.
    pub async fn try_acquire_all<I>(&self, keys: I) -> Result<Option<MultiGuard>>
    where
        I: IntoIterator,
        I::Item: IntoLockKey,
    {
        let keys = set_of(keys)?;
        self.take_all(keys, None).await
    }

    async fn take_all(
        &self,
        keys: Vec<LockKey>,
        wait: Option<WaitPolicy>,
    ) -> Result<Option<MultiGuard>> {
        let started = Instant::now();
        let end = wait.and_then(|w| crate::wait::wait_deadline(w, started));
        let mut guards = Vec::with_capacity(keys.len());
        for key in keys {
            let round = match (wait, end) {
                (Some(WaitPolicy::Timeout(_)), Some(end)) => Some(WaitPolicy::Timeout(
                    end.saturating_duration_since(Instant::now()),
                )),
                _ => wait,
            };
            let taken = self.take(key.clone(), round, Request::Mutex).await;
            let failed = match taken {
                Ok(Some(guard)) => {
                    guards.push(guard);
                    continue;
                }
                Ok(None) => None,
                Err(Error::Timeout { key, .. }) => Some(Error::Timeout {
                    key,
                    waited: started.elapsed(),
                }),
                Err(e) => Some(e),
            };
            tracing::debug!(key = %key, held = guards.len(), "multi-lock member not taken; releasing the others");
            release_all(guards).await;
            return failed.map_or(Ok(None), Err);
        }
        Ok(Some(MultiGuard::new(guards)))
    }

    /// Leader election on `key`: [`Election::campaign`] waits to hold the
    /// mutex `key`, whose fencing token is the leader's term;
    /// [`Election::leader`] and [`Election::observe`] show the leader to the
    /// others. The leader is labelled with this client's
    /// [`label`](Self::label) (host and pid by default; see
    /// [`with_label`](Self::with_label)).
    ///
    /// ```
    /// use std::sync::Arc;
    /// use fenced_api::{Label, LockClient, MemoryLock};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> fenced_api::Result<()> {
    /// let store = Arc::new(MemoryLock::new());
    /// let node_a = LockClient::new(store.clone()).with_label(Label::new("node-a")?);
    /// let node_b = LockClient::new(store).with_label(Label::new("node-b")?);
    ///
    /// let leadership = node_a.election("service:scheduler")?.campaign().await?;
    /// let seen = node_b.election("service:scheduler")?.leader().await?.expect("a leader");
    /// assert_eq!(seen.label.as_ref().map(|l| l.as_str()), Some("node-a"));
    /// assert_eq!(seen.term, leadership.term());
    /// leadership.resign().await?;
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    ///
    /// [`Error::InvalidKey`].
    pub fn election(&self, key: impl IntoLockKey) -> Result<Election> {
        Ok(Election {
            client: self.clone(),
            key: key.into_lock_key()?,
            every: Election::DEFAULT_OBSERVE_EVERY,
        })
    }

    /// The client of this store's semaphores, with this handle's label.
    fn permit_client(&self) -> Result<LockClient> {
        Ok(LockClient {
            inner: self.inner.permit_side()?,
            label: self.label.clone(),
        })
    }
}

/// The keys of a multi-lock, validated, in the global order, without duplicates.
fn set_of<I>(keys: I) -> Result<Vec<LockKey>>
where
    I: IntoIterator,
    I::Item: IntoLockKey,
{
    let mut keys = keys
        .into_iter()
        .map(IntoLockKey::into_lock_key)
        .collect::<Result<Vec<_>>>()?;
    if keys.is_empty() {
        return Err(Error::invalid_options(
            "a multi-lock needs at least one key",
        ));
    }
    keys.sort();
    keys.dedup();
    Ok(keys)
}

/// Releases guards, newest first; what fails expires after its TTL.
async fn release_all(guards: Vec<LockGuard>) -> Vec<Result<()>> {
    let mut out = Vec::with_capacity(guards.len());
    for guard in guards.into_iter().rev() {
        out.push(guard.release().await);
    }
    out
}

/// A semaphore on one key (see [`LockClient::semaphore`]). Cheap to clone.
#[derive(Clone)]
pub struct Semaphore {
    client: LockClient,
    key: LockKey,
    permits: Permits,
}

impl Semaphore {
    /// Takes a permit, waiting in line as the client is configured to wait.
    ///
    /// A task holds at most one permit of a key through one client: asking
    /// again while holding one is [`Error::AlreadyHeld`] at once.
    ///
    /// # Errors
    ///
    /// [`Error::KindMismatch`] when the key's holders agreed on another
    /// number of permits (or it is a reader-writer lock);
    /// [`Error::AlreadyHeld`], [`Error::Timeout`], [`Error::Backend`] as
    /// [`LockClient::acquire`].
    ///
    /// # Cancel safety
    ///
    /// Dropping the future leaves the line; a grant that raced with the drop
    /// is never renewed and expires after its TTL.
    pub async fn acquire(&self) -> Result<LockGuard> {
        let wait = self.client.inner.config.wait;
        self.acquire_with(wait).await
    }

    /// Takes a permit, waiting as `wait` allows.
    ///
    /// # Errors
    ///
    /// As [`acquire`](Self::acquire).
    pub async fn acquire_with(&self, wait: WaitPolicy) -> Result<LockGuard> {
        take_permits(&self.client, &self.key, self.permits, wait).await
    }

    /// Takes a permit if one is free and nobody waits; `Ok(None)` otherwise.
    ///
    /// # Errors
    ///
    /// As [`acquire`](Self::acquire), except that contention is `Ok(None)`.
    pub async fn try_acquire(&self) -> Result<Option<LockGuard>> {
        let request = Request::Permits(self.permits);
        self.client.take(self.key.clone(), None, request).await
    }

    /// Every holder of the key, and how many wait.
    ///
    /// # Errors
    ///
    /// [`Error::Backend`] when the store fails.
    pub async fn holders(&self) -> Result<Option<KeyHolders>> {
        holders(&self.client, &self.key).await
    }

    /// The key.
    pub fn key(&self) -> &LockKey {
        &self.key
    }

    /// How many permits the semaphore has.
    pub fn permits(&self) -> u32 {
        self.permits.capacity()
    }
}

impl fmt::Debug for Semaphore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Semaphore")
            .field("key", &self.key)
            .field("permits", &self.permits.capacity())
            .finish_non_exhaustive()
    }
}

/// A reader-writer lock on one key (see [`LockClient::rw_lock`]). Cheap to clone.
#[derive(Clone)]
pub struct RwLock {
    client: LockClient,
    key: LockKey,
}

impl RwLock {
    /// Takes the key as a reader, waiting as the client is configured to.
    ///
    /// A task holds at most one grant of a key through one client: a reader
    /// asking again, or asking to write, is [`Error::AlreadyHeld`] at once
    /// (behind a waiting writer it would wait on itself).
    ///
    /// # Errors
    ///
    /// [`Error::KindMismatch`] when the key is a semaphore;
    /// [`Error::AlreadyHeld`], [`Error::Timeout`], [`Error::Backend`] as
    /// [`LockClient::acquire`].
    ///
    /// # Cancel safety
    ///
    /// As [`Semaphore::acquire`].
    pub async fn read(&self) -> Result<LockGuard> {
        let wait = self.client.inner.config.wait;
        take_permits(&self.client, &self.key, Permits::read(), wait).await
    }

    /// Takes the key as its writer, waiting as the client is configured to.
    ///
    /// # Errors
    ///
    /// As [`read`](Self::read).
    ///
    /// # Cancel safety
    ///
    /// As [`Semaphore::acquire`].
    pub async fn write(&self) -> Result<LockGuard> {
        let wait = self.client.inner.config.wait;
        take_permits(&self.client, &self.key, Permits::write(), wait).await
    }

    /// [`read`](Self::read) waiting as `wait` allows.
    ///
    /// # Errors
    ///
    /// As [`read`](Self::read).
    pub async fn read_with(&self, wait: WaitPolicy) -> Result<LockGuard> {
        take_permits(&self.client, &self.key, Permits::read(), wait).await
    }

    /// [`write`](Self::write) waiting as `wait` allows.
    ///
    /// # Errors
    ///
    /// As [`read`](Self::read).
    pub async fn write_with(&self, wait: WaitPolicy) -> Result<LockGuard> {
        take_permits(&self.client, &self.key, Permits::write(), wait).await
    }

    /// Reads if nobody writes or waits to write; `Ok(None)` otherwise.
    ///
    /// # Errors
    ///
    /// As [`read`](Self::read), except that contention is `Ok(None)`.
    pub async fn try_read(&self) -> Result<Option<LockGuard>> {
        let request = Request::Permits(Permits::read());
        self.client.take(self.key.clone(), None, request).await
    }

    /// Writes if nobody holds or waits for the key; `Ok(None)` otherwise.
    ///
    /// # Errors
    ///
    /// As [`read`](Self::read), except that contention is `Ok(None)`.
    pub async fn try_write(&self) -> Result<Option<LockGuard>> {
        let request = Request::Permits(Permits::write());
        self.client.take(self.key.clone(), None, request).await
    }

    /// Every holder of the key (readers, or the writer), and how many wait.
    ///
    /// # Errors
    ///
    /// [`Error::Backend`] when the store fails.
    pub async fn holders(&self) -> Result<Option<KeyHolders>> {
        holders(&self.client, &self.key).await
    }

    /// The key.
    pub fn key(&self) -> &LockKey {
        &self.key
    }
}

impl fmt::Debug for RwLock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RwLock")
            .field("key", &self.key)
            .finish_non_exhaustive()
    }
}

async fn take_permits(
    client: &LockClient,
    key: &LockKey,
    permits: Permits,
    wait: WaitPolicy,
) -> Result<LockGuard> {
    match client
        .take(key.clone(), Some(wait), Request::Permits(permits))
        .await?
    {
        Some(guard) => Ok(guard),
        None => Err(Error::Timeout {
            key: key.clone(),
            waited: Duration::ZERO,
        }),
    }
}

async fn holders(client: &LockClient, key: &LockKey) -> Result<Option<KeyHolders>> {
    match &client.inner.semaphores {
        Some(store) => store.holders(key).await,
        None => Err(Error::Unsupported {
            backend: client.inner.backend,
            what: "semaphores or reader-writer locks".into(),
        }),
    }
}

/// Several mutexes held together (see [`LockClient::acquire_all`]): one
/// guard, lost when any member is lost, released together.
///
/// Each member keeps its own lease and fencing token (a resource checks the
/// token of the key that protects it: [`token`](Self::token)). Dropping the
/// guard releases every member, as dropping a [`LockGuard`] does.
pub struct MultiGuard {
    /// In key order.
    guards: Vec<LockGuard>,
    /// Cancelled when the first member is lost, by one watcher task that
    /// ends with the members' holds.
    lost: CancellationToken,
}

impl MultiGuard {
    /// Needs a tokio runtime (called from `take_all`, inside one).
    fn new(guards: Vec<LockGuard>) -> Self {
        let lost = CancellationToken::new();
        let members: Vec<CancellationToken> = guards.iter().map(LockGuard::lost_token).collect();
        let ended: Vec<CancellationToken> =
            guards.iter().map(|g| g.handle().ended_token()).collect();
        let any = lost.clone();
        tokio::spawn(async move {
            let lost =
                futures_util::future::select_all(members.iter().map(|t| Box::pin(t.cancelled())));
            let all_ended =
                futures_util::future::join_all(ended.iter().map(CancellationToken::cancelled));
            tokio::select! {
                // A loss wins over the end of the holds it caused.
                biased;
                _ = lost => any.cancel(),
                _ = all_ended => {}
            }
        });
        MultiGuard { guards, lost }
    }

    /// The members' guards, in key order.
    pub fn guards(&self) -> &[LockGuard] {
        &self.guards
    }

    /// How many keys are held.
    pub fn len(&self) -> usize {
        self.guards.len()
    }

    /// Always false: a multi-lock holds at least one key.
    pub fn is_empty(&self) -> bool {
        self.guards.is_empty()
    }

    /// The keys, in the order they were taken.
    pub fn keys(&self) -> impl Iterator<Item = &LockKey> {
        self.guards.iter().map(LockGuard::key)
    }

    /// The fencing token of member `key`.
    pub fn token(&self, key: &LockKey) -> Option<FencingToken> {
        self.guards
            .iter()
            .find(|g| g.key() == key)
            .map(LockGuard::token)
    }

    /// Every member's key and fencing token, in key order.
    pub fn tokens(&self) -> Vec<(LockKey, FencingToken)> {
        self.guards
            .iter()
            .map(|g| (g.key().clone(), g.token()))
            .collect()
    }

    /// How long every member is still safely held (the shortest).
    pub fn valid_for(&self) -> Duration {
        self.guards
            .iter()
            .map(LockGuard::valid_for)
            .min()
            .unwrap_or(Duration::ZERO)
    }

    /// Whether any member is lost.
    pub fn is_lost(&self) -> bool {
        self.guards.iter().any(LockGuard::is_lost)
    }

    /// Resolves when the first member is lost, with its key and the reason.
    /// Never resolves if the set is released normally.
    pub async fn lost(&self) -> (LockKey, LossReason) {
        let each = self.guards.iter().map(|g| {
            Box::pin(async move {
                let reason = g.lost().await;
                (g.key().clone(), reason)
            })
        });
        futures_util::future::select_all(each).await.0
    }

    /// A token cancelled when any member is lost (see
    /// [`LockGuard::lost_token`]); cancelling it stops what listens to it,
    /// nothing else.
    pub fn lost_token(&self) -> CancellationToken {
        self.lost.child_token()
    }

    /// Releases every member, newest first.
    ///
    /// # Errors
    ///
    /// The first member's error, after every member was asked:
    /// [`Error::LeaseLost`] if one was found lost (the work was then not
    /// protected to the end), [`Error::Backend`] if a release failed (that
    /// member expires after its TTL).
    pub async fn release(self) -> Result<()> {
        release_all(self.guards)
            .await
            .into_iter()
            .find(Result::is_err)
            .unwrap_or(Ok(()))
    }
}

impl fmt::Debug for MultiGuard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MultiGuard")
            .field("members", &self.tokens())
            .finish()
    }
}

/// Leader election on one key (see [`LockClient::election`]). Cheap to clone.
#[derive(Clone)]
pub struct Election {
    client: LockClient,
    key: LockKey,
    every: Duration,
}

/// The leader of an election, as the others see it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Leader {
    /// The leader's label (its client's; host and pid by default).
    pub label: Option<Label>,
    /// The leader's term: the fencing token of its leadership, greater than
    /// every earlier leader's.
    pub term: FencingToken,
    /// The store's owner id of the leadership.
    pub owner: Owner,
    /// How long the leadership lasts unless renewed (the store's view, at the read).
    pub remaining_ttl: Duration,
}

impl Election {
    /// How often [`observe`](Self::observe) looks at the store by default.
    pub const DEFAULT_OBSERVE_EVERY: Duration = Duration::from_millis(200);

    /// The same election observed every `every` (at least 1 ms).
    #[must_use]
    pub fn observe_every(mut self, every: Duration) -> Self {
        self.every = every.max(Duration::from_millis(1));
        self
    }

    /// Waits to become the leader, as the client is configured to wait (by
    /// default for ever). The leadership is renewed by the watchdog until
    /// it is resigned, dropped or lost.
    ///
    /// # Errors
    ///
    /// As [`LockClient::acquire`].
    ///
    /// # Cancel safety
    ///
    /// As [`LockClient::acquire`]: dropping the future leaves the campaign.
    pub async fn campaign(&self) -> Result<Leadership> {
        Ok(Leadership {
            guard: self.client.acquire(self.key.clone()).await?,
        })
    }

    /// Campaigns waiting as `wait` allows.
    ///
    /// # Errors
    ///
    /// As [`LockClient::acquire`].
    pub async fn campaign_with(&self, wait: WaitPolicy) -> Result<Leadership> {
        Ok(Leadership {
            guard: self.client.acquire_with(self.key.clone(), wait).await?,
        })
    }

    /// Becomes the leader if there is none; `Ok(None)` otherwise.
    ///
    /// # Errors
    ///
    /// As [`LockClient::try_acquire`].
    pub async fn try_campaign(&self) -> Result<Option<Leadership>> {
        Ok(self
            .client
            .try_acquire(self.key.clone())
            .await?
            .map(|guard| Leadership { guard }))
    }

    /// The current leader, if any.
    ///
    /// # Errors
    ///
    /// [`Error::Backend`] when the store fails.
    pub async fn leader(&self) -> Result<Option<Leader>> {
        leader_of(self.client.lock().as_ref(), &self.key).await
    }

    /// The leader now, then each change of leader (a new term, or no
    /// leader), looked up every [`observe_every`](Self::observe_every).
    /// A failed look is yielded as an error and the next one follows at the
    /// usual interval; the stream ends only when dropped.
    ///
    /// A change shorter than the interval can be missed (the terms seen
    /// still only increase): read [`Leader::term`], not the count of changes.
    pub fn observe(&self) -> BoxStream<'static, Result<Option<Leader>>> {
        let lock = Arc::clone(self.client.lock());
        let key = self.key.clone();
        let every = self.every;
        // State: the last term yielded (`Some(None)`: no leader yielded) and
        // whether this is the first look.
        let start: (Option<Option<FencingToken>>, bool) = (None, true);
        Box::pin(futures_util::stream::unfold(
            start,
            move |(mut last, mut first)| {
                let lock = Arc::clone(&lock);
                let key = key.clone();
                async move {
                    loop {
                        if !first {
                            tokio::time::sleep(every).await;
                        }
                        first = false;
                        match leader_of(lock.as_ref(), &key).await {
                            Ok(now) => {
                                let term = now.as_ref().map(|l| l.term);
                                if last != Some(term) {
                                    last = Some(term);
                                    return Some((Ok(now), (last, first)));
                                }
                            }
                            Err(e) => return Some((Err(e), (last, first))),
                        }
                    }
                }
            },
        ))
    }

    /// The election's key (the mutex the leader holds).
    pub fn key(&self) -> &LockKey {
        &self.key
    }
}

impl fmt::Debug for Election {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Election")
            .field("key", &self.key)
            .field("observe_every", &self.every)
            .finish_non_exhaustive()
    }
}

async fn leader_of(lock: &dyn DistributedLock, key: &LockKey) -> Result<Option<Leader>> {
    Ok(lock.inspect(key).await?.map(|info| Leader {
        label: info.label,
        term: info.token,
        owner: info.owner,
        remaining_ttl: info.remaining_ttl,
    }))
}

/// The leadership won by [`Election::campaign`]: a held lock whose fencing
/// token is the term. Dropping it resigns (the release is spawned).
#[derive(Debug)]
pub struct Leadership {
    guard: LockGuard,
}

impl Leadership {
    /// The term: greater than every earlier leader's. Pass it with every
    /// write the leader makes, so a deposed leader's late writes are refused.
    pub fn term(&self) -> FencingToken {
        self.guard.token()
    }

    /// Whether the leadership is lost (not renewed in time, taken away).
    pub fn is_lost(&self) -> bool {
        self.guard.is_lost()
    }

    /// Resolves when the leadership is lost, with the reason; never after a
    /// normal resignation.
    pub async fn lost(&self) -> LossReason {
        self.guard.lost().await
    }

    /// A token cancelled when the leadership is lost (see [`LockGuard::lost_token`]).
    pub fn lost_token(&self) -> CancellationToken {
        self.guard.lost_token()
    }

    /// The underlying guard (validity, scope, expiring signal).
    pub fn guard(&self) -> &LockGuard {
        &self.guard
    }

    /// Steps down: the next campaigner becomes leader with a greater term.
    ///
    /// # Errors
    ///
    /// As [`LockGuard::release`].
    pub async fn resign(self) -> Result<()> {
        self.guard.release().await
    }
}
