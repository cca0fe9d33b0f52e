//! All-or-nothing multi-locks through [`LockClient`].

use std::{fmt, time::Duration};

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::{
    client::Request, Error, FencingToken, IntoLockKey, LockClient, LockGuard, LockKey, LossReason,
    Result, WaitPolicy,
};

impl LockClient {
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
