//! `LockGuard`: a held lock with its watchdog and loss signal.

use std::{
    fmt,
    sync::{Arc, Mutex, OnceLock},
    time::Duration,
};

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use tokio::sync::watch;

use crate::{
    client::ClientInner, holder::Holder, Error, FencingToken, Lease, LockKey, ReleaseOutcome,
    Result,
};

/// Why a guard considers its lock lost.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum LossReason {
    /// The safe deadline (the TTL counted from the last successful request's
    /// send time, less the [`SafetyMargin`](crate::SafetyMargin)) passed
    /// without a successful renewal: the store may expire it any moment.
    DeadlinePassed,
    /// The store refused a renewal: the lease expired there, was
    /// force-released, or the key belongs to someone else.
    RenewalRefused,
    /// The hold exceeded the client's `max_hold`; renewal stopped on purpose.
    MaxHoldExceeded,
    /// The store reported the lock gone before its deadline: the session or
    /// connection holding it ended ([`DistributedLock::loss_signal`](crate::DistributedLock::loss_signal)).
    StoreReported,
}

impl fmt::Display for LossReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            LossReason::DeadlinePassed => {
                "the safe deadline (the lease's, less the safety margin) passed without a successful renewal"
            }
            LossReason::RenewalRefused => {
                "the store refused the renewal (expired, force-released or taken over)"
            }
            LossReason::MaxHoldExceeded => "the hold exceeded max_hold and renewal was stopped",
            LossReason::StoreReported => {
                "the store reported the lock gone (the session or connection holding it ended)"
            }
        })
    }
}

/// State shared by the guards (several when reentrant) and the watchdog of one hold.
pub(crate) struct Held {
    pub(crate) client: Arc<ClientInner>,
    pub(crate) key: LockKey,
    /// The task (or thread) that took it: re-entry is per holder.
    pub(crate) holder: Holder,
    lease: Mutex<Lease>,
    /// The safe deadline of the current lease, for [`LeaseHandle::expiring`].
    safe_deadline: watch::Sender<Instant>,
    count: Mutex<u32>,
    lost: CancellationToken,
    loss: OnceLock<LossReason>,
    stop: CancellationToken,
    finished: std::sync::atomic::AtomicBool,
    acquired_at: Instant,
}

impl Held {
    /// `acquired_at` is the send time of the granting request (deadline − ttl),
    /// so time spent *waiting* for the lock never counts against `max_hold`.
    pub(crate) fn new(client: Arc<ClientInner>, lease: Lease, holder: Holder) -> Arc<Self> {
        let acquired_at = lease
            .deadline
            .checked_sub(lease.ttl)
            .unwrap_or_else(Instant::now);
        let (safe_deadline, _) = watch::channel(safe_deadline_of(&client, &lease));
        Arc::new(Held {
            client,
            key: lease.key.clone(),
            holder,
            safe_deadline,
            lease: Mutex::new(lease),
            count: Mutex::new(1),
            lost: CancellationToken::new(),
            loss: OnceLock::new(),
            stop: CancellationToken::new(),
            finished: std::sync::atomic::AtomicBool::new(false),
            acquired_at,
        })
    }

    pub(crate) fn lease(&self) -> Lease {
        self.lease.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    fn set_lease(&self, lease: Lease) {
        self.safe_deadline
            .send_replace(safe_deadline_of(&self.client, &lease));
        *self.lease.lock().unwrap_or_else(|p| p.into_inner()) = lease;
    }

    /// The lease's deadline less the client's safety margin: from here on
    /// the store may expire the lease before this client could react.
    pub(crate) fn safe_deadline(&self) -> Instant {
        *self.safe_deadline.borrow()
    }

    /// Lost, or past its safe deadline (a watchdog stalled with its
    /// runtime has not marked it yet): not to be entered again.
    pub(crate) fn is_past(&self) -> bool {
        self.is_lost() || Instant::now() >= self.safe_deadline()
    }

    fn is_finished(&self) -> bool {
        self.finished.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Adds a reentrant hold; fails if the hold is already over.
    pub(crate) fn enter(&self) -> bool {
        let mut c = self.count.lock().unwrap_or_else(|p| p.into_inner());
        if *c == 0 {
            return false;
        }
        *c += 1;
        true
    }

    /// Drops one hold; true when it was the last.
    fn exit(&self) -> bool {
        let mut c = self.count.lock().unwrap_or_else(|p| p.into_inner());
        *c = c.saturating_sub(1);
        *c == 0
    }

    pub(crate) fn is_lost(&self) -> bool {
        self.lost.is_cancelled()
    }

    fn mark_lost(&self, reason: LossReason) {
        if self.loss.set(reason).is_ok() {
            crate::telemetry::lost(self.client.backend, reason);
            let lease = self.lease();
            match reason {
                LossReason::MaxHoldExceeded => tracing::error!(
                    key = %self.key, token = %lease.token,
                    held_ms = self.acquired_at.elapsed().as_millis() as u64,
                    "lock held longer than max_hold; renewal stopped and the lock reported lost"
                ),
                _ => tracing::warn!(key = %self.key, token = %lease.token, %reason, "lock lost"),
            }
        }
        self.lost.cancel();
    }

    pub(crate) fn loss_error(&self) -> Error {
        let reason = self.loss.get().copied().unwrap_or_else(|| {
            // Not marked yet: past its safe deadline (a stalled watchdog),
            // or refused by the store at release.
            if Instant::now() >= self.safe_deadline() {
                LossReason::DeadlinePassed
            } else {
                LossReason::RenewalRefused
            }
        });
        Error::lease_lost(&self.key, self.lease().token, reason.to_string())
    }

    /// Renews at `interval`, gives up at the lease deadline or `max_hold`.
    /// Runs until the hold ends (`stop`) or the lock is lost.
    pub(crate) async fn watchdog(self: Arc<Self>) {
        let cfg = &self.client.config;
        let Some(interval) = cfg.renew_interval else {
            return self.watch_deadline_only().await;
        };
        // An overflowing max_hold (e.g. Duration::MAX) means "no limit".
        let max_hold_at = cfg.max_hold.and_then(|m| self.acquired_at.checked_add(m));
        // Renewals are scheduled from the *send* time of the last successful
        // request (deadline − ttl), so a slow reply never pushes the next
        // renewal past the deadline; and by the TTL the store granted — a
        // store that grants less than asked (ZooKeeper: no longer than the
        // lock's session) is renewed at the same fraction of what it gave.
        let every_for = |lease: &Lease| {
            if lease.ttl < cfg.ttl {
                interval.mul_f64(lease.ttl.as_secs_f64() / cfg.ttl.as_secs_f64())
            } else {
                interval
            }
        };
        let next_after = |lease: &Lease| {
            let every = every_for(lease);
            lease
                .deadline
                .checked_sub(lease.ttl)
                .and_then(|sent| sent.checked_add(every))
                .unwrap_or_else(Instant::now)
        };
        let mut next = next_after(&self.lease());
        let store_lost = self.store_signal();
        loop {
            let deadline = self.safe_deadline();
            tokio::select! {
                biased;
                _ = self.stop.cancelled() => return,
                _ = store_lost.cancelled() => {
                    return self.mark_lost(LossReason::StoreReported);
                }
                _ = tokio::time::sleep_until(deadline) => {
                    return self.mark_lost(LossReason::DeadlinePassed);
                }
                _ = sleep_until_opt(max_hold_at) => {
                    return self.mark_lost(LossReason::MaxHoldExceeded);
                }
                _ = tokio::time::sleep_until(next) => {}
            }
            let lease = self.lease();
            // The safe deadline is checked before the renewal's answer: a
            // renewal still out when it passes is dropped and the loss
            // stands, so a late answer never revives the guard (a renewal
            // answered before it always carries a later safe deadline: it
            // was sent after the one it replaces).
            let renewal = tokio::select! {
                biased;
                _ = self.stop.cancelled() => return,
                _ = store_lost.cancelled() => {
                    return self.mark_lost(LossReason::StoreReported);
                }
                _ = tokio::time::sleep_until(deadline) => {
                    return self.mark_lost(LossReason::DeadlinePassed);
                }
                r = self.client.renewer.renew(&self.client.lock, &lease) => r,
            };
            match renewal {
                Ok(renewed) => {
                    crate::telemetry::renewed(self.client.backend);
                    tracing::debug!(key = %self.key, token = %renewed.token, valid_ms = renewed.remaining().as_millis() as u64, "lock renewed");
                    next = next_after(&renewed);
                    self.set_lease(renewed);
                }
                Err(Error::LeaseLost { .. }) => {
                    return self.mark_lost(LossReason::RenewalRefused);
                }
                Err(e) => {
                    crate::telemetry::renewal_failed(self.client.backend);
                    // The lease may still be current: retry soon, but never
                    // past the deadline (the select above catches that).
                    let retry = (every_for(&lease) / 4).max(Duration::from_millis(5));
                    tracing::warn!(key = %self.key, error = %e, retry_ms = retry.as_millis() as u64, "lock renewal failed; retrying");
                    next = Instant::now() + retry;
                }
            }
        }
    }

    async fn watch_deadline_only(&self) {
        let deadline = self.safe_deadline();
        let store_lost = self.store_signal();
        tokio::select! {
            _ = self.stop.cancelled() => {}
            _ = store_lost.cancelled() => self.mark_lost(LossReason::StoreReported),
            _ = tokio::time::sleep_until(deadline) => self.mark_lost(LossReason::DeadlinePassed),
        }
    }

    /// The store's loss signal for this hold, or a token nobody cancels.
    fn store_signal(&self) -> CancellationToken {
        self.client
            .lock
            .loss_signal(&self.lease())
            .unwrap_or_default()
    }

    /// Ends the hold: stops the watchdog and forgets it in the client.
    fn finish(self: &Arc<Self>) {
        self.finished
            .store(true, std::sync::atomic::Ordering::SeqCst);
        self.stop.cancel();
        self.client.forget(self);
    }
}

/// `lease`'s deadline less the client's margin for its granted TTL.
pub(crate) fn safe_deadline_of(client: &ClientInner, lease: &Lease) -> Instant {
    let margin = client.config.margin.for_ttl(lease.ttl);
    lease.deadline.checked_sub(margin).unwrap_or(lease.deadline)
}

async fn sleep_until_opt(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// A cloneable view of a held lock: token, validity and the loss signal.
///
/// Handed to the closure of [`LockClient::with_lock`](crate::LockClient::with_lock)
/// and available from [`LockGuard::handle`]; it does not keep the lock held.
#[derive(Clone)]
pub struct LeaseHandle {
    held: Arc<Held>,
}

impl LeaseHandle {
    /// The locked key.
    pub fn key(&self) -> &LockKey {
        &self.held.key
    }

    /// The fencing token: pass it to the protected resource with every write.
    pub fn token(&self) -> FencingToken {
        self.held.lease().token
    }

    /// The current lease as this guard counts it: its `deadline` is the
    /// safe deadline (see [`deadline`](Self::deadline)) and moves forward
    /// with each renewal.
    pub fn lease(&self) -> Lease {
        let mut lease = self.held.lease();
        lease.deadline = self.held.safe_deadline();
        lease
    }

    /// The safe deadline: the lease's deadline (TTL from the send time of
    /// the last successful grant or renewal) less the client's
    /// [`SafetyMargin`](crate::SafetyMargin). Until then the store does not
    /// expire the lease (as long as the clocks drift apart by less than the
    /// margin); it can still end it sooner — a force release, a `row_lock`
    /// connection cut by the server — which the next renewal reports.
    /// `None` once lost or released.
    pub fn deadline(&self) -> Option<Instant> {
        (!self.held.is_lost() && !self.held.is_finished()).then(|| self.held.safe_deadline())
    }

    /// How long the lock is certainly still held: time to the safe
    /// deadline, or zero once lost or released. Check it before a side
    /// effect that must not run without the lock, e.g.
    /// `if h.valid_for() > Duration::from_secs(2)`.
    pub fn valid_for(&self) -> Duration {
        self.deadline().map_or(Duration::ZERO, |d| {
            d.saturating_duration_since(Instant::now())
        })
    }

    /// Resolves once the lock is lost or its safe deadline is `lead` or less
    /// away without a renewal having moved it — the moment to start
    /// stopping work that needs `lead` to wind down, while the lock is still
    /// held. With the watchdog renewing normally the deadline keeps moving
    /// and this never resolves, as long as `lead` is shorter than the TTL
    /// less the margin, one renewal interval and that renewal's round trip
    /// (`fenced run` allows a quarter of the interval for it: `lead ≤ ttl −
    /// margin − interval × 5/4`, with the TTL the store granted and the
    /// interval scaled to it). The longer `lead` is within that bound,
    /// the fewer failed renewals it takes to resolve: at the bound, one.
    /// Never resolves once the lock was released normally.
    ///
    /// This is how `fenced run` times its SIGTERM: `expiring(grace)`, so
    /// that the command's grace has run out by the safe deadline.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: dropping it changes nothing.
    pub async fn expiring(&self, lead: Duration) {
        let mut deadlines = self.held.safe_deadline.subscribe();
        loop {
            if self.held.is_lost() {
                return;
            }
            if self.held.is_finished() {
                // Released: nothing to expire any more — unless that release
                // found the lease gone, which marks the loss a moment later.
                return self.held.lost.cancelled().await;
            }
            let deadline = *deadlines.borrow_and_update();
            // A lead longer than the clock can go back: already within it.
            let Some(at) = deadline.checked_sub(lead) else {
                return;
            };
            tokio::select! {
                biased;
                _ = self.held.lost.cancelled() => return,
                _ = self.held.stop.cancelled() => {}
                changed = deadlines.changed() => {
                    // The sender lives as long as `held`; it cannot be gone.
                    if changed.is_err() {
                        return std::future::pending().await;
                    }
                }
                _ = tokio::time::sleep_until(at) => {
                    if !self.held.is_finished() && *deadlines.borrow() == deadline {
                        return;
                    }
                }
            }
        }
    }

    /// Whether the lock has been reported lost.
    pub fn is_lost(&self) -> bool {
        self.held.is_lost()
    }

    /// Resolves when the lock is lost, with the reason. Never resolves if the
    /// lock is released normally.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: dropping it changes nothing.
    pub async fn lost(&self) -> LossReason {
        self.held.lost.cancelled().await;
        self.held
            .loss
            .get()
            .copied()
            .unwrap_or(LossReason::RenewalRefused)
    }

    /// A token cancelled when the lock is lost, for APIs that take one.
    pub fn lost_token(&self) -> CancellationToken {
        self.held.lost.child_token()
    }

    /// A token cancelled when the hold is finished (released, or its last
    /// guard dropped) — not when it is lost: what a helper task watching
    /// the hold stops on.
    pub(crate) fn ended_token(&self) -> CancellationToken {
        self.held.stop.child_token()
    }
}

impl fmt::Debug for LeaseHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let lease = self.held.lease();
        f.debug_struct("LeaseHandle")
            .field("key", &lease.key)
            .field("token", &lease.token)
            .field("lost", &self.held.is_lost())
            .finish()
    }
}

/// A held lock. Renewed in the background while it lives.
///
/// Prefer [`release`](LockGuard::release)`.await`: it reports whether the lock
/// was still held at the end. Dropping the guard instead *spawns* the release
/// on the current tokio runtime — it is not immediate, and without a runtime
/// (e.g. during shutdown) the lock simply expires after its TTL.
#[must_use = "the lock is released as soon as the guard is dropped"]
pub struct LockGuard {
    handle: LeaseHandle,
    done: bool,
}

impl LockGuard {
    pub(crate) fn new(held: Arc<Held>) -> Self {
        LockGuard {
            handle: LeaseHandle { held },
            done: false,
        }
    }

    /// A cloneable view (token, validity, loss signal) that outlives borrows of the guard.
    pub fn handle(&self) -> &LeaseHandle {
        &self.handle
    }

    /// The locked key.
    pub fn key(&self) -> &LockKey {
        self.handle.key()
    }

    /// The fencing token of this hold.
    pub fn token(&self) -> FencingToken {
        self.handle.token()
    }

    /// See [`LeaseHandle::valid_for`].
    pub fn valid_for(&self) -> Duration {
        self.handle.valid_for()
    }

    /// See [`LeaseHandle::deadline`].
    pub fn deadline(&self) -> Option<Instant> {
        self.handle.deadline()
    }

    /// See [`LeaseHandle::expiring`].
    pub async fn expiring(&self, lead: Duration) {
        self.handle.expiring(lead).await
    }

    /// Runs `work` in this hold's scope: inside it, asking for this key
    /// again through the same [`LockClient`](crate::LockClient) re-enters on
    /// a reentrant client and is [`Error::AlreadyHeld`] otherwise, instead
    /// of a wait on itself (see [Holders](crate::LockClient#holders)). The
    /// scope is the future's: it follows `work` wherever it is polled and
    /// ends with it; tasks spawned from inside it are other holders.
    ///
    /// ```
    /// use std::sync::Arc;
    /// use fenced_api::{LockClient, MemoryLock};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> fenced_api::Result<()> {
    /// let client = LockClient::builder(Arc::new(MemoryLock::new())).reentrant(true).build()?;
    /// let guard = client.acquire("ledger").await?;
    /// let inner = guard
    ///     .scope(async {
    ///         // Code that takes the lock itself, called while it is held.
    ///         let again = client.acquire("ledger").await?;
    ///         let token = again.token();
    ///         again.release().await?;
    ///         Ok::<_, fenced_api::Error>(token)
    ///     })
    ///     .await?;
    /// assert_eq!(inner, guard.token());
    /// guard.release().await?;
    /// # Ok(()) }
    /// ```
    pub async fn scope<F: std::future::Future>(&self, work: F) -> F::Output {
        crate::holder::within(self.held(), work).await
    }

    /// The shared hold behind this guard.
    pub(crate) fn held(&self) -> Arc<Held> {
        Arc::clone(&self.handle.held)
    }

    /// A second guard on this same hold — explicit re-entry, for instance
    /// from another task that this one hands the work to. The key stays
    /// held (same token, one lease, one watchdog) until the last of the
    /// guards is released or dropped.
    ///
    /// # Errors
    ///
    /// [`Error::LeaseLost`] if the lock is already lost or past its safe
    /// deadline.
    pub fn reenter(&self) -> Result<LockGuard> {
        let held = &self.handle.held;
        if held.is_past() || !held.enter() {
            return Err(held.loss_error());
        }
        tracing::debug!(key = %held.key, "lock re-entered through its guard");
        Ok(LockGuard::new(Arc::clone(held)))
    }

    /// See [`LeaseHandle::is_lost`].
    pub fn is_lost(&self) -> bool {
        self.handle.is_lost()
    }

    /// See [`LeaseHandle::lost`].
    pub async fn lost(&self) -> LossReason {
        self.handle.lost().await
    }

    /// A [`CancellationToken`] cancelled when the lock is lost, for APIs
    /// and tasks that stop on one (see [`LeaseHandle::lost_token`]).
    ///
    /// It is a child of the guard's loss signal: cancelling the returned
    /// token stops what listens to it but neither releases the lock nor
    /// marks it lost. It is never cancelled by a normal release.
    ///
    /// ```
    /// use std::{sync::Arc, time::Duration};
    /// use fenced_api::{DistributedLock, LockClient, LockKey, MemoryLock};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> fenced_api::Result<()> {
    /// let store = Arc::new(MemoryLock::new());
    /// let client = LockClient::builder(store.clone())
    ///     .ttl(Duration::from_millis(300)) // renewed every 100 ms
    ///     .build()?;
    /// let guard = client.acquire("report:2024").await?;
    ///
    /// // Work that must stop once the lock is gone.
    /// let lost = guard.lost_token();
    /// let work = tokio::spawn(async move {
    ///     lost.cancelled().await;
    ///     "stopped"
    /// });
    ///
    /// // An operator frees the key; the next renewal is refused.
    /// store.force_release(&LockKey::new("report:2024")?).await?;
    /// assert_eq!(work.await.unwrap(), "stopped");
    /// assert!(guard.is_lost());
    /// # Ok(()) }
    /// ```
    pub fn lost_token(&self) -> CancellationToken {
        self.handle.lost_token()
    }

    /// Releases the lock now (or one reentrant hold of it).
    ///
    /// # Errors
    ///
    /// * [`Error::LeaseLost`] if the store no longer had this lease: someone
    ///   else may have held the key while this guard believed it held it.
    /// * [`Error::Backend`] if the store failed; the lock expires after its TTL.
    pub async fn release(mut self) -> Result<()> {
        self.done = true;
        let held = Arc::clone(&self.handle.held);
        if !held.exit() {
            return Ok(());
        }
        held.finish();
        let lease = held.lease();
        let backend = held.client.backend;
        let outcome = held.client.lock.release(&lease).await;
        crate::telemetry::released(
            backend,
            match &outcome {
                Ok(ReleaseOutcome::NotHeld) => "not_held",
                Ok(_) => "released",
                Err(_) => "error",
            },
            held.acquired_at.elapsed(),
        );
        match outcome? {
            ReleaseOutcome::Released | ReleaseOutcome::StillHeld { .. } => {
                tracing::debug!(key = %lease.key, token = %lease.token, held_ms = held.acquired_at.elapsed().as_millis() as u64, "lock released");
                Ok(())
            }
            ReleaseOutcome::NotHeld => {
                if held.loss.get().is_none() {
                    held.mark_lost(LossReason::RenewalRefused);
                }
                Err(held.loss_error())
            }
        }
    }

    /// Stops renewing and forgets the guard without releasing: the lock
    /// expires after its TTL, unless released later with the returned lease
    /// through [`DistributedLock::release`](crate::DistributedLock::release).
    /// The lease is the store's, as the last grant or renewal returned it:
    /// its `deadline` is the lease's own, without the safety margin that
    /// [`LeaseHandle::lease`] takes off.
    pub fn leak(mut self) -> Lease {
        self.done = true;
        let held = Arc::clone(&self.handle.held);
        if held.exit() {
            held.finish();
        }
        held.lease()
    }
}

impl Drop for LockGuard {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        let held = Arc::clone(&self.handle.held);
        if !held.exit() {
            return;
        }
        held.finish();
        let lease = held.lease();
        let lock = Arc::clone(&held.client.lock);
        let (backend, acquired_at) = (held.client.backend, held.acquired_at);
        let spawned = crate::cleanup::spawn({
            let lease = lease.clone();
            async move {
                let outcome = lock.release(&lease).await;
                let label = match &outcome {
                    Ok(ReleaseOutcome::NotHeld) => "not_held",
                    Ok(_) => "released",
                    Err(_) => "error",
                };
                crate::telemetry::released(backend, label, acquired_at.elapsed());
                match outcome {
                    Ok(_) => {
                        tracing::debug!(key = %lease.key, token = %lease.token, "lock released on drop")
                    }
                    Err(e) => {
                        tracing::warn!(key = %lease.key, error = %e, "release on drop failed; the lock expires after its ttl")
                    }
                }
            }
        });
        if !spawned {
            tracing::warn!(
                key = %lease.key,
                "lock guard dropped outside a tokio runtime; the lock expires after its ttl"
            );
        }
    }
}

impl fmt::Debug for LockGuard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LockGuard")
            .field("handle", &self.handle)
            .finish()
    }
}

/// Runs `work` while `handle`'s lock is held; `Err(LeaseLost)` if lost first.
pub(crate) async fn run_until_lost<Fut: std::future::Future>(
    handle: &LeaseHandle,
    work: Fut,
) -> std::result::Result<Fut::Output, Error> {
    tokio::select! {
        biased;
        _ = handle.lost() => Err(handle.held.loss_error()),
        out = work => Ok(out),
    }
}
