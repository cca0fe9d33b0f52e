//! Lock connections: the sessions `advisory` locks live on, opened by the
//! handle itself (never from the statement pool), at most
//! `max_lock_connections` at a time, and a few kept idle between holds.
//!
//! Every lock connection starts with these session settings (startup
//! parameters: no extra round trip):
//!
//! * `synchronous_commit = on` — the token's `nextval` is on disk before
//!   the grant is answered;
//! * `statement_timeout = 0` — a wait in the server's lock queue is bounded
//!   by `lock_timeout`, set for that one statement, never by a session-wide
//!   statement bound;
//! * `idle_session_timeout` = [`IDLE_KEEP`] — what a connection without a
//!   lock may idle for; a hold sets it to its TTL (the server ends the
//!   session of a frozen or vanished holder after that much silence, which
//!   frees the lock) and its release sets it back;
//! * `client_connection_check_interval` = [`CHECK_INTERVAL`] — a waiter
//!   whose client closed the connection (a dropped `acquire`) leaves the
//!   queue within that interval;
//! * `tcp_keepalives_*` — a waiter whose client vanished without closing
//!   is found by TCP keepalives ([`KEEPALIVE`]), then likewise leaves.
//!
//! A lock connection is dropped — closed, which ends its session and
//! whatever it held or waited for — unless it is given back clean (no lock
//! held, settings as above); only those are kept, at most [`IDLE_CAP`], for
//! less than [`IDLE_KEEP`].

use std::{
    sync::{
        atomic::{AtomicBool, AtomicUsize, Ordering},
        Arc, Mutex,
    },
    time::Duration,
};

use fenced_api::{Error, Result};
use sqlx::{postgres::PgConnectOptions, ConnectOptions, PgConnection, Row};
use tokio::{
    sync::{OwnedSemaphorePermit, Semaphore},
    time::Instant,
};

use crate::{
    config::{server_name, PostgresConfig, Strategy},
    conn::{self, Server},
    error,
};

/// How long a lock connection without a lock may stay idle: the server
/// ends it after this (its `idle_session_timeout`), the handle stops
/// reusing it a second earlier.
pub(super) const IDLE_KEEP: Duration = Duration::from_secs(30);

/// How many idle lock connections a handle keeps.
const IDLE_CAP: usize = 16;

/// `client_connection_check_interval` of lock connections.
pub(super) const CHECK_INTERVAL: Duration = Duration::from_millis(250);

/// `tcp_keepalives_idle`, `_interval`, `_count` (seconds, seconds, probes)
/// of lock connections: a silent peer is given up after 10 + 3 × 5 s.
const KEEPALIVE: (u32, u32, u32) = (10, 5, 3);

/// `ms` as a GUC value in milliseconds: at least 1, at most `i32::MAX`.
pub(crate) fn guc_ms(d: Duration) -> String {
    let ms = d.as_nanos().div_ceil(1_000_000).clamp(1, i32::MAX as u128);
    ms.to_string()
}

/// One lock connection: its session, its backend's process id and its
/// share of `max_lock_connections`.
pub(super) struct LockConn {
    conn: PgConnection,
    /// `pg_backend_pid()` of the session.
    pub(super) pid: i32,
    _permit: OwnedSemaphorePermit,
    /// When it was given back idle.
    idle_since: Instant,
    /// Whether it was kept from an earlier use: a failure on it may just
    /// mean the server ended it meanwhile.
    pub(super) reused: bool,
}

impl std::fmt::Debug for LockConn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LockConn")
            .field("pid", &self.pid)
            .field("reused", &self.reused)
            .finish_non_exhaustive()
    }
}

impl LockConn {
    pub(super) fn conn(&mut self) -> &mut PgConnection {
        &mut self.conn
    }
}

/// The lock connections of one handle.
pub(super) struct LockConns {
    options: PgConnectOptions,
    /// `host:port`, for messages.
    at: String,
    connect_timeout: Duration,
    max: u32,
    permits: Arc<Semaphore>,
    idle: Mutex<Vec<LockConn>>,
    /// Takers waiting for a free slot: a connection given back then is
    /// closed instead of kept (kept, it would keep its slot from them).
    waiting: AtomicUsize,
    closed: AtomicBool,
}

impl std::fmt::Debug for LockConns {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LockConns")
            .field("at", &self.at)
            .field("max", &self.max)
            .field("free", &self.permits.available_permits())
            .finish_non_exhaustive()
    }
}

impl LockConns {
    pub(super) fn new(config: &PostgresConfig) -> Self {
        let (idle, interval, count) = KEEPALIVE;
        let options = conn::connect_options(config).options([
            ("synchronous_commit", "on".to_owned()),
            ("statement_timeout", "0".to_owned()),
            ("idle_session_timeout", guc_ms(IDLE_KEEP)),
            ("client_connection_check_interval", guc_ms(CHECK_INTERVAL)),
            ("tcp_keepalives_idle", idle.to_string()),
            ("tcp_keepalives_interval", interval.to_string()),
            ("tcp_keepalives_count", count.to_string()),
        ]);
        LockConns {
            at: server_name(&config.connect),
            options,
            connect_timeout: config.connect_timeout,
            max: config.max_lock_connections,
            permits: Arc::new(Semaphore::new(config.max_lock_connections as usize)),
            idle: Mutex::default(),
            waiting: AtomicUsize::new(0),
            closed: AtomicBool::new(false),
        }
    }

    /// The error of a `try_acquire` that finds every lock connection taken.
    fn exhausted(&self) -> Error {
        Error::backend(
            error::BACKEND,
            true,
            format!(
                "all {} lock connections of this handle are in use (one per held lock and per \
                 waiting acquire); release a lock, or raise max_lock_connections",
                self.max
            ),
        )
    }

    fn closed_error() -> Error {
        Error::backend(error::BACKEND, false, "this PostgresLock was closed")
    }

    /// A lock connection now: an idle one, or a new one if a slot is free;
    /// a retryable error naming `max_lock_connections` when none is.
    pub(super) async fn take_now(&self) -> Result<LockConn> {
        if let Some(c) = self.pop() {
            return Ok(c);
        }
        if self.closed.load(Ordering::Acquire) {
            return Err(Self::closed_error());
        }
        match Arc::clone(&self.permits).try_acquire_owned() {
            Ok(permit) => self.open(permit).await,
            Err(_) => Err(self.exhausted()),
        }
    }

    /// A lock connection, waiting for a free slot until `deadline` (`None`:
    /// without bound); `Ok(None)` when the deadline passed first.
    pub(super) async fn take_until(&self, deadline: Option<Instant>) -> Result<Option<LockConn>> {
        if let Some(c) = self.pop() {
            return Ok(Some(c));
        }
        if self.closed.load(Ordering::Acquire) {
            return Err(Self::closed_error());
        }
        if let Ok(permit) = Arc::clone(&self.permits).try_acquire_owned() {
            return self.open(permit).await.map(Some);
        }
        let permit = {
            let _waiting = fenced_sql::conns::Queued::new(&self.waiting);
            // Given back before this taker counted itself: kept idle.
            if let Some(c) = self.pop() {
                return Ok(Some(c));
            }
            let permit = Arc::clone(&self.permits).acquire_owned();
            match deadline {
                None => permit.await,
                Some(d) => match tokio::time::timeout_at(d, permit).await {
                    Ok(p) => p,
                    Err(_) => return Ok(None),
                },
            }
        };
        // The semaphore is never closed.
        let permit = permit.map_err(|_| Self::closed_error())?;
        self.open(permit).await.map(Some)
    }

    /// Opens and checks a new lock connection (bounded by the connect timeout).
    async fn open(&self, permit: OwnedSemaphorePermit) -> Result<LockConn> {
        let opened = tokio::time::timeout(self.connect_timeout, async {
            let mut conn = self.options.connect().await?;
            let row = sqlx::query(
                "SELECT pg_backend_pid(), pg_is_in_recovery(), \
                 current_setting('server_version_num')::int",
            )
            .fetch_one(&mut conn)
            .await?;
            let pid: i32 = row.try_get(0)?;
            let server = Server {
                in_recovery: row.try_get(1)?,
                version: row.try_get(2)?,
            };
            Ok::<_, sqlx::Error>((conn, pid, server))
        })
        .await;
        match opened {
            Ok(Ok((conn, pid, server))) => {
                conn::check_server(server, &self.at, Strategy::Advisory)?;
                Ok(LockConn {
                    conn,
                    pid,
                    _permit: permit,
                    idle_since: Instant::now(),
                    reused: false,
                })
            }
            Ok(Err(e)) => Err(error::connect_failed(&self.at, e)),
            Err(_) => Err(
                fenced_api::no_answer(error::BACKEND, "connect", self.connect_timeout)
                    .connecting(&self.at),
            ),
        }
    }

    /// An idle connection the server has not ended for idleness.
    fn pop(&self) -> Option<LockConn> {
        let limit = IDLE_KEEP - Duration::from_secs(1);
        let mut idle = self.idle.lock().unwrap_or_else(|p| p.into_inner());
        while let Some(c) = idle.pop() {
            if c.idle_since.elapsed() < limit {
                return Some(c);
            }
        }
        None
    }

    /// Keeps a clean connection (no lock held, idle timeout [`IDLE_KEEP`])
    /// for the next hold, or closes it when enough are kept.
    pub(super) fn put(&self, mut c: LockConn) {
        if self.closed.load(Ordering::Acquire) {
            return;
        }
        let mut idle = self.idle.lock().unwrap_or_else(|p| p.into_inner());
        // Read under the lock: a taker counts itself before it looks at
        // the idle connections, so either it finds this one or this one is
        // closed for it.
        if self.waiting.load(Ordering::SeqCst) == 0 && idle.len() < IDLE_CAP {
            c.idle_since = Instant::now();
            c.reused = true;
            idle.push(c);
        }
    }

    /// Closes the idle connections; later takes fail.
    pub(super) fn close(&self) {
        self.closed.store(true, Ordering::Release);
        let idle = std::mem::take(&mut *self.idle.lock().unwrap_or_else(|p| p.into_inner()));
        drop(idle);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn guc_milliseconds_round_up_and_stay_in_range() {
        assert_eq!(guc_ms(Duration::from_millis(10)), "10");
        assert_eq!(guc_ms(Duration::from_micros(10_001)), "11");
        assert_eq!(guc_ms(Duration::ZERO), "1");
        assert_eq!(guc_ms(Duration::from_secs(86_400)), "86400000");
        assert_eq!(guc_ms(Duration::from_secs(u64::MAX)), i32::MAX.to_string());
    }
}
