//! Semaphores and reader-writer locks through [`LockClient`]: handles over
//! the store's [`SemaphoreStore`](crate::SemaphoreStore).

use std::{fmt, time::Duration};

use crate::{
    client::Request, Error, IntoLockKey, KeyHolders, LockClient, LockGuard, LockKey, Permits,
    Result, WaitPolicy,
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

    /// The client of this store's semaphores, with this handle's label.
    fn permit_client(&self) -> Result<LockClient> {
        Ok(LockClient {
            inner: self.inner.permit_side()?,
            label: self.label.clone(),
        })
    }
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
