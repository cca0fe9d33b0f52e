//! How `lease` waiters wait: a [`Polling`] line per handle, woken across
//! processes by `LISTEN`/`NOTIFY`.
//!
//! A release that frees a key sends `pg_notify('<base>_released', <hex
//! key>)` in its own statement (`strategy/lease.rs`); the server delivers it
//! when that statement commits to every session listening on the channel.
//! Each handle that has had to wait keeps one such session: a listener task
//! started by the first `acquire` that finds the key held, which `LISTEN`s
//! before that waiter's next try, so a release after the try cannot be
//! missed. Each notification for a key that a waiter of this handle waits
//! for calls [`Polling::freed`], which wakes the head of this process's line
//! for the key at once; it tries, and the key is handed off without a poll.
//!
//! The fallback is the line's own re-check: the head looks at the key every
//! `recheck_interval` (jittered between half of it and all of it) when no
//! notification comes. That finds what no notification announces — a lease
//! that expired (its holder died), a release whose notification was lost.
//! Notifications are lost only while the listening session is down: when it
//! comes back (reconnected with backoff), every waiter of the handle is woken
//! to look again, so a release missed meanwhile costs no re-check interval
//! either.
//!
//! The listening session is a connection of its own, never one of the
//! statement pool's (a `LISTEN` on a pooled connection would end up in
//! another caller's session). The task ends when the handle's last clone is
//! dropped, or on [`close`](crate::PostgresLock::close).

use std::{
    collections::HashMap,
    fmt,
    sync::{Arc, Mutex, MutexGuard},
    time::Duration,
};

use fenced_api::{
    wait::{wait_deadline, Backoff, Polling},
    DistributedLock, Lease, LockKey, LockOptions, Result, WaitPolicy,
};
use sqlx::postgres::{PgConnectOptions, PgListener, PgPoolOptions};
use tokio::{sync::watch, task::JoinHandle, time::Instant};

use crate::{config::PostgresConfig, conn, strategy::lease::notify_channel};

/// Pauses between attempts to (re)open the listening session.
const RECONNECT: Backoff = Backoff::new(Duration::from_millis(50), Duration::from_secs(5));

/// The waiting of one `lease` handle.
pub(crate) struct Waiting {
    polling: Polling,
    listener: Arc<Listener>,
}

impl fmt::Debug for Waiting {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Waiting")
            .field("scope", &self.polling.scope())
            .field("channel", &self.listener.channel)
            .finish_non_exhaustive()
    }
}

/// Where a handle's listening session stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// The task was started and its first session is opening.
    Starting,
    /// The channel is listened to.
    Listening,
    /// No session (not started, stopped, or reopening after a failure).
    Down,
}

/// The listening session of one handle and the keys its waiters wait for.
struct Listener {
    connect: PgConnectOptions,
    connect_timeout: Duration,
    operation_timeout: Duration,
    channel: String,
    polling: Polling,
    /// Keys a waiter of this handle waits for, with how many wait.
    waiting: Mutex<HashMap<LockKey, usize>>,
    /// Where the listening session stands.
    state: watch::Sender<State>,
    task: Mutex<Option<JoinHandle<()>>>,
}

impl Waiting {
    /// The waiting of a handle on `config`'s server and table. Its scope
    /// names both, so handles of this process on one table share one line
    /// per key and one local release signal.
    pub(crate) fn new(config: &PostgresConfig) -> Self {
        let scope = format!("{}#{}", config.display_url, config.table);
        Self::on(config, scope, notify_channel(&config.table))
    }

    /// The waiting of a handle's semaphores (`permits.rs`): the same
    /// machinery on a scope and a channel of their own.
    pub(crate) fn for_permits(config: &PostgresConfig, channel: String) -> Self {
        let scope = format!("{}#{}#permits", config.display_url, config.table);
        Self::on(config, scope, channel)
    }

    fn on(config: &PostgresConfig, scope: String, channel: String) -> Self {
        let recheck = config.recheck_interval;
        let polling = Polling::new(scope).with_backoff(Backoff::new(recheck, recheck));
        let listener = Arc::new(Listener {
            connect: conn::connect_options(config),
            connect_timeout: config.connect_timeout,
            operation_timeout: config.operation_timeout,
            channel,
            polling: polling.clone(),
            waiting: Mutex::default(),
            state: watch::Sender::new(State::Down),
            task: Mutex::default(),
        });
        Waiting { polling, listener }
    }

    /// The line of this handle's waiters (for the release signal).
    pub(crate) fn polling(&self) -> &Polling {
        &self.polling
    }

    /// `DistributedLock::acquire` through `lock` (the handle, whose
    /// `try_acquire` is bounded).
    pub(crate) async fn acquire(
        &self,
        lock: &(dyn DistributedLock + '_),
        key: &LockKey,
        opts: &LockOptions,
    ) -> Result<Lease> {
        if opts.wait() == WaitPolicy::NoWait {
            return self.polling.acquire(lock, key, opts).await;
        }
        let _waiting = self.listener.wait_for(key);
        if !self.listener.is_started() {
            // This handle's first wait: a free key needs no listener.
            if let Some(lease) = lock.try_acquire(key, opts).await? {
                return Ok(lease);
            }
        }
        self.listener.start();
        if *self.listener.state.borrow() == State::Starting {
            // Listening before the line's first try, so that a release
            // after that try is heard. A session that fails to open, or is
            // down later, is not waited for: its waiters re-check, and are
            // all woken when it is back.
            let start = Instant::now();
            let limit = start + self.listener.connect_timeout;
            let bound = wait_deadline(opts.wait(), start).map_or(limit, |d| d.min(limit));
            if !self.listener.settled(bound).await {
                tracing::debug!(key = %key, channel = %self.listener.channel, "not listening yet; waiting by re-checks until the listener is up");
            }
        }
        self.polling.acquire(lock, key, opts).await
    }

    /// Registers a waiter of `key` and starts the listener, waiting (at
    /// most the connect timeout, or the wait bound) for its first session:
    /// a semaphore waiter holds the returned guard while in line, so a
    /// notification for `key` wakes it through its line's release signal.
    pub(crate) async fn listen_for(&self, key: &LockKey, opts: &LockOptions) -> impl Drop + '_ {
        let waiting = self.listener.wait_for(key);
        self.listener.start();
        if *self.listener.state.borrow() == State::Starting {
            let start = Instant::now();
            let limit = start + self.listener.connect_timeout;
            let bound = wait_deadline(opts.wait(), start).map_or(limit, |d| d.min(limit));
            self.listener.settled(bound).await;
        }
        waiting
    }

    /// Stops listening (the handle is closing).
    pub(crate) fn stop(&self) {
        self.listener.stop();
    }
}

impl Drop for Waiting {
    fn drop(&mut self) {
        self.listener.stop();
    }
}

/// Counts a waiter of one key while alive.
struct WaitingFor<'a> {
    listener: &'a Listener,
    key: LockKey,
}

impl Drop for WaitingFor<'_> {
    fn drop(&mut self) {
        let mut waiting = self.listener.waiting();
        if let Some(n) = waiting.get_mut(&self.key) {
            *n -= 1;
            if *n == 0 {
                waiting.remove(&self.key);
            }
        }
    }
}

impl Listener {
    fn waiting(&self) -> MutexGuard<'_, HashMap<LockKey, usize>> {
        // The map stays consistent whatever a panicking holder did.
        self.waiting.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn task(&self) -> MutexGuard<'_, Option<JoinHandle<()>>> {
        self.task.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn wait_for(&self, key: &LockKey) -> WaitingFor<'_> {
        *self.waiting().entry(key.clone()).or_insert(0) += 1;
        WaitingFor {
            listener: self,
            key: key.clone(),
        }
    }

    fn is_started(&self) -> bool {
        self.task().as_ref().is_some_and(|t| !t.is_finished())
    }

    /// Starts the listener task unless it runs.
    fn start(self: &Arc<Self>) {
        let mut task = self.task();
        if task.as_ref().is_some_and(|t| !t.is_finished()) {
            return;
        }
        self.state.send_replace(State::Starting);
        *task = Some(tokio::spawn(Arc::clone(self).run()));
    }

    /// Waits until the task's first session listens or fails, or `until`
    /// passes; returns whether the channel is listened to.
    async fn settled(&self, until: Instant) -> bool {
        let mut state = self.state.subscribe();
        let settled = tokio::time::timeout_at(until, state.wait_for(|s| *s != State::Starting))
            .await
            .is_ok_and(|r| r.is_ok());
        settled && *self.state.borrow() == State::Listening
    }

    fn stop(&self) {
        if let Some(task) = self.task().take() {
            task.abort();
        }
        self.state.send_replace(State::Down);
    }

    /// Wakes every waiter of this handle: a release may have gone unheard.
    fn wake_all(&self) {
        let keys: Vec<LockKey> = self.waiting().keys().cloned().collect();
        for key in &keys {
            self.polling.freed(key);
        }
    }

    fn on_notification(&self, payload: &str) {
        let Some(key) = key_from_payload(payload) else {
            tracing::debug!(payload, channel = %self.channel, "ignoring a notification that names no lock key");
            return;
        };
        if self.waiting().contains_key(&key) {
            self.polling.freed(&key);
        }
    }

    /// Listens until the handle goes away, reopening the session with
    /// backoff whenever it fails.
    async fn run(self: Arc<Self>) {
        let op = self.operation_timeout;
        let pool = PgPoolOptions::new()
            .max_connections(1)
            .min_connections(0)
            .acquire_timeout(self.connect_timeout)
            .idle_timeout(None)
            .max_lifetime(None)
            .after_connect(move |c, _| Box::pin(async move { conn::set_up(c, op).await.map(drop) }))
            .connect_lazy_with(self.connect.clone());
        let mut failures = 0u32;
        loop {
            let result = self.session(&pool).await;
            let was_up = self.state.send_replace(State::Down) == State::Listening;
            match result {
                Ok(()) => {
                    tracing::warn!(channel = %self.channel, "the LISTEN session was lost; reopening it");
                }
                Err(e) => {
                    tracing::warn!(channel = %self.channel, error = %e, "the LISTEN session failed; reopening it");
                }
            }
            if was_up {
                failures = 0;
            }
            tokio::time::sleep(RECONNECT.delay(failures)).await;
            failures = failures.saturating_add(1).min(20);
        }
    }

    /// One listening session: `LISTEN`, then notifications until the
    /// connection is lost (`Ok`) or fails (`Err`).
    async fn session(&self, pool: &sqlx::PgPool) -> std::result::Result<(), sqlx::Error> {
        let mut listener = tokio::time::timeout(self.connect_timeout, async {
            let mut l = PgListener::connect_with(pool).await?;
            l.ignore_pool_close_event(true);
            l.eager_reconnect(false);
            l.listen(&self.channel).await?;
            Ok::<_, sqlx::Error>(l)
        })
        .await
        .map_err(|_| sqlx::Error::PoolTimedOut)??;
        self.state.send_replace(State::Listening);
        tracing::debug!(channel = %self.channel, "listening for releases");
        // Waiters that started while the session was down may have missed
        // a release.
        self.wake_all();
        loop {
            match listener.try_recv().await? {
                Some(n) => self.on_notification(n.payload()),
                None => return Ok(()),
            }
        }
    }
}

/// The lock key of a notification's payload (the key's bytes in hex).
fn key_from_payload(payload: &str) -> Option<LockKey> {
    let hex = payload.as_bytes();
    if !hex.len().is_multiple_of(2) {
        return None;
    }
    let digit = |c: u8| (c as char).to_digit(16);
    let bytes: Option<Vec<u8>> = hex
        .chunks(2)
        .map(|p| u8::try_from(digit(p[0])? * 16 + digit(p[1])?).ok())
        .collect();
    let text = String::from_utf8(bytes?).ok()?;
    LockKey::new(text).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn payloads_are_hex_keys() {
        assert_eq!(key_from_payload("6a6f623a31").unwrap().as_str(), "job:1");
        assert_eq!(key_from_payload("c3a92025").unwrap().as_str(), "é %");
        for bad in ["", "6", "zz", "ff", "0a"] {
            assert!(key_from_payload(bad).is_none(), "{bad:?}");
        }
    }
}
