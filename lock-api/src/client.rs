//! `LockClient`: the policy layer, written once for every backend.

use std::{
    collections::HashMap,
    fmt,
    future::Future,
    sync::{Arc, Mutex, OnceLock, Weak},
    time::Duration,
};

use tokio::time::Instant;
use tracing::Instrument;

use crate::{
    guard::{run_until_lost, Held},
    holder::Holder,
    DistributedLock, Error, IntoLockKey, Label, LeaseHandle, LockGuard, LockKey, LockOptions,
    Permits, Result, SafetyMargin, SemaphoreStore, WaitPolicy,
};

#[derive(Clone)]
pub(crate) struct ClientConfig {
    pub(crate) ttl: Duration,
    pub(crate) wait: WaitPolicy,
    pub(crate) renew_interval: Option<Duration>,
    pub(crate) max_hold: Option<Duration>,
    pub(crate) reentrant: bool,
    pub(crate) margin: SafetyMargin,
}

pub(crate) struct ClientInner {
    pub(crate) lock: Arc<dyn DistributedLock>,
    /// The backend's name, the `backend` label of the metrics.
    pub(crate) backend: &'static str,
    pub(crate) config: ClientConfig,
    /// The live holds of this client, by key and the task that took them:
    /// what re-entry and the same-task check look up.
    held: Mutex<HashMap<(LockKey, Holder), Weak<Held>>>,
    /// The watchdogs' renewals, batched (renewer.rs).
    pub(crate) renewer: crate::renewer::Renewer,
    /// On the client of a store's semaphores (`lock` is then that
    /// semaphore store): where permits are asked for.
    pub(crate) semaphores: Option<Arc<dyn SemaphoreStore>>,
    /// The client of this store's semaphores, made on first use: same
    /// policy, its own holds and renewals (permit leases are renewed and
    /// released through the semaphore store).
    permit_side: OnceLock<Arc<ClientInner>>,
}

/// What an acquisition asks the store for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Request {
    /// The key's mutex.
    Mutex,
    /// Permits of the key's semaphore or reader-writer lock.
    Permits(Permits),
}

impl ClientInner {
    fn new(lock: Arc<dyn DistributedLock>, config: ClientConfig) -> Self {
        ClientInner {
            backend: lock.capabilities().backend_name(),
            renewer: crate::renewer::Renewer::new(config.ttl),
            lock,
            config,
            held: Mutex::new(HashMap::new()),
            semaphores: None,
            permit_side: OnceLock::new(),
        }
    }

    /// The client of this store's semaphores (see `permit_side`).
    ///
    /// A permit is never re-entered: a task asking again for a key it holds
    /// permits of gets [`Error::AlreadyHeld`] at once (a reader asking again
    /// behind a waiting writer, or a writer asking to read, would otherwise
    /// wait on itself).
    pub(crate) fn permit_side(self: &Arc<Self>) -> Result<Arc<ClientInner>> {
        if self.semaphores.is_some() {
            return Ok(Arc::clone(self));
        }
        if let Some(side) = self.permit_side.get() {
            return Ok(Arc::clone(side));
        }
        let Some(store) = self.lock.semaphores() else {
            return Err(Error::Unsupported {
                backend: self.backend,
                what: "semaphores or reader-writer locks".into(),
            });
        };
        let lock: Arc<dyn DistributedLock> = store.clone();
        let config = ClientConfig {
            reentrant: false,
            ..self.config.clone()
        };
        let mut side = ClientInner::new(lock, config);
        side.semaphores = Some(store);
        Ok(Arc::clone(self.permit_side.get_or_init(|| Arc::new(side))))
    }

    /// Removes a finished hold from the reentrancy map (if it is still the entry).
    pub(crate) fn forget(&self, held: &Arc<Held>) {
        let mut map = self.held.lock().unwrap_or_else(|p| p.into_inner());
        let entry = (held.key.clone(), held.holder);
        if map
            .get(&entry)
            .is_some_and(|w| std::ptr::eq(w.as_ptr(), Arc::as_ptr(held)))
        {
            map.remove(&entry);
        }
    }
}

/// Takes locks on one store and keeps them: renewal, loss signals, reentrancy,
/// `max_hold`, tracing. Cheap to clone (clones share held-lock state and the
/// renewal queue).
///
/// # Holders
///
/// **Every acquisition is its own holder.** Tasks that share one client —
/// the usual shape of a server, with one client in its state — exclude
/// each other and wait in turn, exactly as separate processes would.
///
/// Asking again for a key the asker already holds would wait on itself
/// until the wait bound. The client answers such a request at once:
///
/// * **Inside the work of a hold** — the closure of
///   [`with_lock`](Self::with_lock), or a future run by
///   [`LockGuard::scope`] — asking for the same key through this client is
///   re-entry on a client built with
///   [`reentrant(true)`](LockClientBuilder::reentrant) (a second guard on
///   the same hold: same token, the last guard released frees the key), and
///   [`Error::AlreadyHeld`] otherwise. The scope travels with the future and
///   ends with it; a task spawned from inside it is another holder and
///   waits in turn.
/// * **Outside any scope**, the task (or, outside any task, the thread)
///   that acquired a key and still holds it, asking again, re-enters on a
///   reentrant client and gets [`Error::AlreadyHeld`] otherwise — the
///   per-thread rule of Curator's and Redisson's reentrant locks, with tokio
///   tasks for threads. It follows the *acquiring* task: two futures of one
///   task (`join!`) are one holder, and a guard handed to another task still
///   counts as its acquirer's, so on a reentrant client the acquirer asking
///   again joins the hold the other task now works under. Give each worker
///   its own acquisition (or a non-reentrant client, which says
///   `AlreadyHeld`) when they must exclude each other.
///
/// Re-entry from anywhere else is explicit: [`LockGuard::reenter`]. What
/// no client can see: a task that was *handed* a guard and then asks for
/// that key again outside a scope waits on its own lock (re-enter through
/// the guard instead), and a task that waits for another task which asks
/// for the key it holds deadlocks. A wait bound
/// ([`WaitPolicy::Timeout`]) ends both; the default waits forever.
///
/// # Holding safely
///
/// A guard counts its lock as held until a [`SafetyMargin`] *before* the
/// lease's own deadline (TTL from the send time of the last successful
/// grant or renewal): [`LockGuard::valid_for`], [`LockGuard::lost`], the
/// [`lost_token`](LockGuard::lost_token), [`LockGuard::expiring`] and
/// [`with_lock`](Self::with_lock)'s cancellation all use that earlier,
/// safe deadline. Renewal is every ttl/3; a renewal that returns after the
/// safe deadline does not revive a guard already reported lost.
///
/// # Tracing
///
/// At `debug` level, through [`tracing`](https://docs.rs/tracing):
///
/// * span `fenced.acquire` (`key`, `backend`) around every acquisition;
/// * span `fenced.wait` (`key`, `backend`, `timeout_ms` — absent when
///   waiting forever) inside it, around the store's `acquire` whenever the
///   wait policy allows waiting ([`WaitPolicy::Timeout`] or
///   [`WaitPolicy::Forever`]): the time spent in it is the wait;
/// * events `lock acquired` (`key`, `token`, `waited_ms`, `backend`) and
///   `lock acquire timed out` (`key`, `waited_ms`, `backend`);
/// * events for re-entry, renewal, release, and — at `warn` / `error` — a
///   failed renewal, a lost lock and `max_hold`.
///
/// Renewals of the locks a client holds are batched: each lock's watchdog
/// decides when to renew, and the renewals due together go to the store as
/// one [`extend_many`](DistributedLock::extend_many) call (one `UPDATE` per
/// 256 leases on the SQL stores), so holding thousands of locks costs a few
/// round trips per renewal interval, not one per lock. A lone renewal is
/// sent at once. (Permits of semaphores and reader-writer locks are renewed
/// one statement each, batched only in time.)
///
/// ```
/// use std::{sync::Arc, time::Duration};
/// use fenced_api::{LockClient, MemoryLock};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> fenced_api::Result<()> {
/// let client = LockClient::builder(Arc::new(MemoryLock::new()))
///     .ttl(Duration::from_secs(10))           // renewed every ttl/3 while held
///     .max_hold(Duration::from_secs(300))     // circuit breaker for stuck jobs
///     .build()?;
///
/// let guard = client.acquire("job:nightly-report").await?;
/// let token = guard.token(); // send it with every write to the protected resource
/// assert!(token.get() >= 1);
/// guard.release().await?;
///
/// // Or scoped: the closure is cancelled if the lock is lost.
/// let total = client
///     .with_lock("job:nightly-report", |lease| async move { lease.token().get() + 1 })
///     .await?;
/// assert!(total > token.get());
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct LockClient {
    pub(crate) inner: Arc<ClientInner>,
    /// Stored with every acquisition of this handle (see [`with_label`](Self::with_label)).
    pub(crate) label: Option<Label>,
}

impl LockClient {
    /// A client with default policy: 30 s TTL renewed every 10 s, the
    /// default [`SafetyMargin`] (300 ms at 30 s), wait forever, no
    /// `max_hold`, not reentrant, labelled [`Label::host_pid`].
    pub fn new(lock: Arc<dyn DistributedLock>) -> Self {
        LockClient::builder(lock).build_valid()
    }

    /// Starts a builder.
    pub fn builder(lock: Arc<dyn DistributedLock>) -> LockClientBuilder {
        LockClientBuilder {
            lock,
            ttl: LockOptions::DEFAULT_TTL,
            wait: WaitPolicy::Forever,
            renew_interval: None,
            watchdog: true,
            max_hold: None,
            reentrant: false,
            margin: SafetyMargin::DEFAULT,
            label: LabelChoice::HostPid,
        }
    }

    /// The store behind this client.
    pub fn lock(&self) -> &Arc<dyn DistributedLock> {
        &self.inner.lock
    }

    /// The lease TTL this client asks for.
    pub fn ttl(&self) -> Duration {
        self.inner.config.ttl
    }

    /// How often the watchdog renews a held lock (`None`: no watchdog).
    pub fn renew_interval(&self) -> Option<Duration> {
        self.inner.config.renew_interval
    }

    /// The safety margin policy of this client's guards.
    pub fn safety_margin(&self) -> SafetyMargin {
        self.inner.config.margin
    }

    /// How long before the lease's deadline a guard of this client gives a
    /// lock up at the client's TTL: [`safety_margin`](Self::safety_margin)
    /// applied to [`ttl`](Self::ttl) (a lease granted shorter than asked
    /// gets the margin of its granted TTL).
    pub fn margin(&self) -> Duration {
        self.inner.config.margin.for_ttl(self.inner.config.ttl)
    }

    /// The label stored with this handle's acquisitions.
    pub fn label(&self) -> Option<&Label> {
        self.label.as_ref()
    }

    /// The same client (held locks, renewals, policy) labelling its
    /// acquisitions `label` — for a label per job or request:
    /// `client.with_label(Label::new("report 2024-11")?).acquire(key)`.
    pub fn with_label(&self, label: Label) -> LockClient {
        LockClient {
            inner: Arc::clone(&self.inner),
            label: Some(label),
        }
    }

    /// Takes `key`, waiting as configured (see [`LockClientBuilder::wait`]).
    ///
    /// A grant whose reply arrives after its safe deadline (the process or
    /// the network stalled for about the TTL) is never handed out as is:
    /// the store may have given the key to someone else meanwhile. One
    /// renewal sent on arrival either proves it is still this client's and
    /// restarts its TTL, or shows it is gone — then the acquisition goes on
    /// as if refused (waiting again within the bound; `None` from
    /// [`try_acquire`](Self::try_acquire)).
    ///
    /// # Errors
    ///
    /// * [`Error::InvalidKey`] before any I/O.
    /// * [`Error::AlreadyHeld`] at once if the caller already holds `key`
    ///   through this client (see [Holders](Self#holders)), unless it asks
    ///   from inside that hold's scope on a reentrant client, which
    ///   re-enters. Other tasks wait in turn.
    /// * [`Error::Timeout`] when the wait bound passes; [`Error::Backend`] when the store fails.
    ///
    /// # Cancel safety
    ///
    /// As [`DistributedLock::acquire`]: dropping the future stops waiting; a
    /// grant racing with the drop is never renewed and expires after its TTL.
    pub async fn acquire(&self, key: impl IntoLockKey) -> Result<LockGuard> {
        self.acquire_with(key, self.inner.config.wait).await
    }

    /// Takes `key` waiting as `wait` says, overriding the configured policy.
    ///
    /// # Errors
    ///
    /// As [`acquire`](Self::acquire).
    ///
    /// # Cancel safety
    ///
    /// As [`acquire`](Self::acquire): dropping the future stops waiting and
    /// leaves the store's queue; a grant racing with the drop is never
    /// wrapped in a guard, never renewed, and expires after its TTL.
    pub async fn acquire_with(&self, key: impl IntoLockKey, wait: WaitPolicy) -> Result<LockGuard> {
        let key = key.into_lock_key()?;
        match self.take(key.clone(), Some(wait), Request::Mutex).await? {
            Some(guard) => Ok(guard),
            // `take` with a wait policy never reports plain contention.
            None => Err(Error::Timeout {
                key,
                waited: Duration::ZERO,
            }),
        }
    }

    /// Tries once; `Ok(None)` if someone else holds `key`.
    ///
    /// # Errors
    ///
    /// As [`acquire`](Self::acquire), except that contention is `Ok(None)`.
    ///
    /// # Cancel safety
    ///
    /// As [`DistributedLock::try_acquire`]: the request may have reached the
    /// store when the future is dropped, and a grant it made is then never
    /// wrapped in a guard, never renewed, and expires after the client's TTL.
    /// Nothing else is left behind (the guard and its watchdog only exist
    /// once the future has completed).
    pub async fn try_acquire(&self, key: impl IntoLockKey) -> Result<Option<LockGuard>> {
        let key = key.into_lock_key()?;
        self.take(key, None, Request::Mutex).await
    }

    /// Runs `work` while holding `key`, then releases it.
    ///
    /// `work` receives a [`LeaseHandle`] (fencing token, validity, loss
    /// signal). If the lock is lost first, `work` is dropped — cancelled at
    /// its next `.await` — and the result is [`Error::LeaseLost`]. `work`
    /// runs in the hold's scope: asking for `key` again through this client
    /// from inside it re-enters on a reentrant client, and is
    /// [`Error::AlreadyHeld`] otherwise (see [Holders](Self#holders)).
    ///
    /// # Errors
    ///
    /// * The errors of [`acquire`](Self::acquire).
    /// * [`Error::LeaseLost`] if the lock was lost while `work` ran, or if
    ///   the final release found it gone (the work was then not protected to
    ///   the end: rely on the fencing token for correctness). A release that
    ///   fails for another reason (store unreachable) is logged and the
    ///   work's result returned: the lock then expires after its TTL.
    ///
    /// # Cancel safety
    ///
    /// No lock outlives its TTL whenever the future is dropped:
    ///
    /// * while acquiring, as [`acquire`](Self::acquire);
    /// * while `work` runs, `work` is dropped with it (cancelled at its
    ///   current `.await`) and so is the guard, which stops renewing and
    ///   spawns the release (see [`LockGuard`]: prompt inside a tokio runtime,
    ///   at the TTL otherwise);
    /// * during the final release, renewal has already stopped: the release
    ///   either reached the store or the lock expires after its TTL.
    ///
    /// Side effects `work` made before it was dropped stay made: protect
    /// them with the fencing token, not with the lock's extent.
    pub async fn with_lock<F, Fut, T>(&self, key: impl IntoLockKey, work: F) -> Result<T>
    where
        F: FnOnce(LeaseHandle) -> Fut,
        Fut: Future<Output = T>,
    {
        let guard = self.acquire(key).await?;
        let handle = guard.handle().clone();
        // The closure itself runs inside the scope too (at the first poll).
        let for_work = handle.clone();
        let work = crate::holder::within(guard.held(), async move { work(for_work).await });
        match run_until_lost(&handle, work).await {
            Ok(out) => match guard.release().await {
                Ok(()) => Ok(out),
                Err(lost @ Error::LeaseLost { .. }) => Err(lost),
                // The work finished while the lock was held; a failed release
                // only means the lock lingers until its TTL.
                Err(e) => {
                    tracing::warn!(key = %handle.key(), error = %e, "release after with_lock failed; the lock expires after its ttl");
                    Ok(out)
                }
            },
            Err(lost) => {
                // Best effort: the lock may still be current on the store.
                let _ = guard.release().await;
                Err(lost)
            }
        }
    }

    pub(crate) async fn take(
        &self,
        key: LockKey,
        wait: Option<WaitPolicy>,
        request: Request,
    ) -> Result<Option<LockGuard>> {
        let cfg = &self.inner.config;
        let holder = Holder::current();
        if let Some(held) = crate::holder::scoped_hold(&self.inner, &key, holder) {
            // The work of a lost hold (or one past its safe deadline, which
            // a stalled watchdog has not marked yet) learns of the loss.
            if held.is_past() {
                return Err(held.loss_error());
            }
            if !cfg.reentrant {
                tracing::debug!(key = %key, "asked for again inside its own hold's scope; it would wait on itself");
                return Err(Error::AlreadyHeld { key });
            }
            if held.enter() {
                tracing::debug!(key = %key, "lock re-entered inside its scope");
                return Ok(Some(LockGuard::new(held)));
            }
        }
        if let Some(held) = self.current(&key, holder) {
            if !cfg.reentrant {
                tracing::debug!(key = %key, "this task already holds the key; it would wait on itself");
                return Err(Error::AlreadyHeld { key });
            }
            if held.enter() {
                tracing::debug!(key = %key, "lock re-entered by the task that acquired it");
                return Ok(Some(LockGuard::new(held)));
            }
        }
        let started = Instant::now();
        let bound = wait.map(|w| crate::wait::wait_deadline(w, started));
        let lease = loop {
            // What is left of the caller's wait bound for this round.
            let round = match (wait, bound) {
                (Some(WaitPolicy::Timeout(_)), Some(Some(end))) => Some(WaitPolicy::Timeout(
                    end.saturating_duration_since(Instant::now()),
                )),
                _ => wait,
            };
            let Some(lease) = self.acquire_once(&key, round, request).await? else {
                return Ok(None);
            };
            if let Some(lease) = self.confirm(lease).await? {
                break lease;
            }
            // The grant was over before it reached us and someone else may
            // hold the key now: as if it had been refused.
            match (wait, bound) {
                (None, _) => return Ok(None),
                (Some(_), Some(Some(end))) if Instant::now() >= end => {
                    return Err(Error::Timeout {
                        key,
                        waited: started.elapsed(),
                    })
                }
                _ => {}
            }
        };
        let backend = self.inner.backend;
        tracing::debug!(key = %key, token = %lease.token, waited_ms = started.elapsed().as_millis() as u64, backend, "lock acquired");
        let held = Held::new(Arc::clone(&self.inner), lease, holder);
        self.inner
            .held
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert((key, holder), Arc::downgrade(&held));
        tokio::spawn(Arc::clone(&held).watchdog());
        Ok(Some(LockGuard::new(held)))
    }

    /// A lease whose reply arrived after its safe deadline (the process or
    /// the network stalled for about the TTL) may already have been given
    /// to someone else by the store: it is never handed out as is. One
    /// renewal, sent now, either proves it is still ours and restarts its
    /// TTL from now (`Some`), or shows it is gone (`None`).
    async fn confirm(&self, lease: crate::Lease) -> Result<Option<crate::Lease>> {
        let unsafe_now =
            |l: &crate::Lease| Instant::now() >= crate::guard::safe_deadline_of(&self.inner, l);
        if !unsafe_now(&lease) {
            return Ok(Some(lease));
        }
        tracing::warn!(key = %lease.key, token = %lease.token, backend = self.inner.backend, "the store's grant arrived after the lease's safe deadline; renewing it before use");
        match self.inner.lock.extend(&lease, lease.ttl).await {
            Ok(renewed) if !unsafe_now(&renewed) => Ok(Some(renewed)),
            Ok(renewed) => {
                // Even the renewal came back too late: give it up.
                let _ = self.inner.lock.release(&renewed).await;
                Ok(None)
            }
            Err(Error::LeaseLost { .. }) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// One acquisition attempt through the store, with its span and metrics.
    async fn acquire_once(
        &self,
        key: &LockKey,
        wait: Option<WaitPolicy>,
        request: Request,
    ) -> Result<Option<crate::Lease>> {
        let cfg = &self.inner.config;
        let backend = self.inner.backend;
        let span = tracing::debug_span!("fenced.acquire", key = %key, backend);
        let started = Instant::now();
        let mut opts = LockOptions::builder().ttl(cfg.ttl);
        if let Some(w) = wait {
            opts = opts.wait(w);
        }
        if let Some(label) = &self.label {
            opts = opts.label(label.as_str());
        }
        let opts = opts.build()?;
        let store = &self.inner.lock;
        // Permits are asked of the permit side only, whose `semaphores` is set.
        let no_semaphores = || Error::Unsupported {
            backend: self.inner.backend,
            what: "semaphores or reader-writer locks".into(),
        };
        let acquire = || async {
            match (request, &self.inner.semaphores) {
                (Request::Permits(p), Some(sem)) => sem.acquire_permits(key, p, &opts).await,
                (Request::Permits(_), None) => Err(no_semaphores()),
                (Request::Mutex, _) => store.acquire(key, &opts).await,
            }
        };
        let lease = async {
            match wait {
                None => match (request, &self.inner.semaphores) {
                    (Request::Permits(p), Some(sem)) => {
                        sem.try_acquire_permits(key, p, &opts).await
                    }
                    (Request::Permits(_), None) => Err(no_semaphores()),
                    (Request::Mutex, _) => store.try_acquire(key, &opts).await,
                },
                Some(WaitPolicy::NoWait) => acquire().await.map(Some),
                // The policy allows waiting: the store's acquire is the wait.
                Some(w) => {
                    let timeout_ms = match w {
                        WaitPolicy::Timeout(d) => Some(d.as_millis() as u64),
                        WaitPolicy::NoWait | WaitPolicy::Forever => None,
                    };
                    let waiting =
                        tracing::debug_span!("fenced.wait", key = %key, backend, timeout_ms);
                    acquire().instrument(waiting).await.map(Some)
                }
            }
        }
        .instrument(span)
        .await;
        let outcome = match &lease {
            Ok(Some(_)) => "acquired",
            Ok(None) => "contended",
            Err(Error::Timeout { .. }) => "timeout",
            Err(_) => "error",
        };
        crate::telemetry::acquire(backend, outcome, started.elapsed());
        if outcome == "timeout" {
            tracing::debug!(key = %key, waited_ms = started.elapsed().as_millis() as u64, backend, "lock acquire timed out");
        }
        lease
    }

    /// The live, not-lost hold of `key` by `holder` through this client, if any.
    /// Past its safe deadline it counts as gone (a new acquisition then
    /// waits at most for that lease to expire on the store).
    fn current(&self, key: &LockKey, holder: Holder) -> Option<Arc<Held>> {
        let map = self.inner.held.lock().unwrap_or_else(|p| p.into_inner());
        map.get(&(key.clone(), holder))
            .and_then(Weak::upgrade)
            .filter(|h| !h.is_past())
    }
}

impl fmt::Debug for LockClient {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let cfg = &self.inner.config;
        f.debug_struct("LockClient")
            .field("lock", &self.inner.lock)
            .field("ttl", &cfg.ttl)
            .field("wait", &cfg.wait)
            .field("renew_interval", &cfg.renew_interval)
            .field("max_hold", &cfg.max_hold)
            .field("reentrant", &cfg.reentrant)
            .field("margin", &cfg.margin)
            .field("label", &self.label)
            .finish()
    }
}

/// Builder for [`LockClient`]; [`build`](Self::build) validates the policy.
#[must_use]
pub struct LockClientBuilder {
    lock: Arc<dyn DistributedLock>,
    ttl: Duration,
    wait: WaitPolicy,
    renew_interval: Option<Duration>,
    watchdog: bool,
    max_hold: Option<Duration>,
    reentrant: bool,
    margin: SafetyMargin,
    label: LabelChoice,
}

/// What a [`LockClientBuilder`] was told to label acquisitions with.
#[derive(Debug)]
enum LabelChoice {
    /// [`Label::host_pid`], the default.
    HostPid,
    /// No label.
    None,
    /// This one, checked by `build`.
    Given(String),
}

impl LockClientBuilder {
    /// Lease TTL (default 30 s). A crashed holder's lock lives this long.
    pub fn ttl(mut self, ttl: Duration) -> Self {
        self.ttl = ttl;
        self
    }

    /// Wait policy of [`LockClient::acquire`] (default [`WaitPolicy::Forever`]).
    pub fn wait(mut self, wait: WaitPolicy) -> Self {
        self.wait = wait;
        self
    }

    /// Renewal interval (default ttl/3). At most half the TTL, so that a failed
    /// renewal can be retried before the lease runs out. A lease the store
    /// granted for less than the TTL asked (see [`Lease::ttl`](crate::Lease::ttl)) is renewed
    /// at the same fraction of its granted TTL.
    pub fn renew_interval(mut self, every: Duration) -> Self {
        self.renew_interval = Some(every);
        self
    }

    /// Turns the watchdog off (default on): the lock is then reported lost at
    /// its safe deadline. Extending the lease directly through the store
    /// ([`DistributedLock::extend`]) does not move the guard's deadline.
    pub fn watchdog(mut self, on: bool) -> Self {
        self.watchdog = on;
        self
    }

    /// Circuit breaker: stop renewing after this long, log an error and report
    /// the lock lost ([`LossReason::MaxHoldExceeded`](crate::LossReason::MaxHoldExceeded)).
    /// A job stuck under a lock then cannot block the key forever.
    pub fn max_hold(mut self, max: Duration) -> Self {
        self.max_hold = Some(max);
        self
    }

    /// Whether asking again for a key one holds re-enters it — from the
    /// task that acquired it, or from inside the hold's scope
    /// ([`LockClient::with_lock`]'s work, [`LockGuard::scope`]) — with a
    /// second guard on the same hold (default false: [`Error::AlreadyHeld`]
    /// at once). Never across holders: other tasks sharing the client wait
    /// in turn (see [Holders](LockClient#holders)).
    pub fn reentrant(mut self, yes: bool) -> Self {
        self.reentrant = yes;
        self
    }

    /// How long before the lease's deadline a guard gives its lock up
    /// (default [`SafetyMargin::DEFAULT`]: 1 % of the TTL, at least 100 ms).
    pub fn safety_margin(mut self, margin: SafetyMargin) -> Self {
        self.margin = margin;
        self
    }

    /// The label stored with every acquisition and shown by `inspect` and
    /// `fenced status` (default [`Label::host_pid`]; see [`Label`] for the
    /// rules, checked by [`build`](Self::build)).
    pub fn label(mut self, label: impl Into<String>) -> Self {
        self.label = LabelChoice::Given(label.into());
        self
    }

    /// Stores no label with this client's acquisitions.
    pub fn no_label(mut self) -> Self {
        self.label = LabelChoice::None;
        self
    }

    /// Validates and builds.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidOptions`] for a TTL out of bounds, a renewal interval
    /// that is zero or above half the TTL, a zero `max_hold`, or an invalid
    /// label.
    pub fn build(self) -> Result<LockClient> {
        LockOptions::validate_ttl(self.ttl)?;
        if let Some(every) = self.renew_interval {
            // At most half the TTL, so a failed renewal still leaves time to retry.
            if every.is_zero() || every > self.ttl / 2 {
                return Err(Error::invalid_options(format!(
                    "the renewal interval {every:?} must be above zero and at most half the ttl {:?} (ttl/3 is the default)",
                    self.ttl
                )));
            }
        }
        if self.max_hold.is_some_and(|m| m.is_zero()) {
            return Err(Error::invalid_options("max_hold is zero"));
        }
        if let LabelChoice::Given(label) = &self.label {
            Label::new(label)?;
        }
        Ok(self.build_valid())
    }

    fn build_valid(self) -> LockClient {
        let label = match &self.label {
            LabelChoice::HostPid => Some(Label::host_pid()),
            LabelChoice::None => None,
            // Checked by `build`; `new` passes the default.
            LabelChoice::Given(l) => Label::new(l).ok(),
        };
        let renew_interval = self
            .watchdog
            .then(|| self.renew_interval.unwrap_or(self.ttl / 3));
        let config = ClientConfig {
            ttl: self.ttl,
            wait: self.wait,
            renew_interval,
            max_hold: self.max_hold,
            reentrant: self.reentrant,
            margin: self.margin,
        };
        LockClient {
            inner: Arc::new(ClientInner::new(self.lock, config)),
            label,
        }
    }
}

impl fmt::Debug for LockClientBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LockClientBuilder")
            .field("lock", &self.lock)
            .field("ttl", &self.ttl)
            .finish_non_exhaustive()
    }
}
