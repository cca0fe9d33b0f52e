//! Leader election through [`LockClient`]: the mutex of a key, whose
//! holder is the leader and whose fencing token is the term.

use std::{fmt, sync::Arc, time::Duration};

use futures_util::stream::BoxStream;
use tokio_util::sync::CancellationToken;

use crate::{
    DistributedLock, FencingToken, IntoLockKey, Label, LockClient, LockGuard, LockKey, LossReason,
    Owner, Result, WaitPolicy,
};

impl LockClient {
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
    /// [`Error::InvalidKey`](crate::Error::InvalidKey).
    pub fn election(&self, key: impl IntoLockKey) -> Result<Election> {
        Ok(Election {
            client: self.clone(),
            key: key.into_lock_key()?,
            every: Election::DEFAULT_OBSERVE_EVERY,
        })
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
    /// [`Error::Backend`](crate::Error::Backend) when the store fails.
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
