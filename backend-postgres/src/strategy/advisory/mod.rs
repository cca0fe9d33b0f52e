//! `advisory`: a session-level advisory lock (`pg_advisory_lock`) on a
//! connection the handle holds for the lock. The recipe, what ends a
//! holder's session and how fast, and the pitfalls are in the crate docs
//! ("The advisory strategy").
//!
//! * The lock key is a 64-bit hash of the table name and the key
//!   ([`hash`]); the registry table `<base>_advisory` records each key with
//!   its hash (`hash` is `UNIQUE`), so two keys with one hash are refused
//!   before any lock is taken, never merged.
//! * The registry row also describes the holder (owner, token, expiry,
//!   label, `pid` of the holding session): `inspect`, `list` and
//!   `force_release` read it joined with `pg_locks`, so a row whose session
//!   no longer holds the lock describes nobody.
//! * `try_acquire` is one statement on a lock connection: the try, and only
//!   once the lock is held the token (`nextval`) and the holder row.
//!   `acquire` waits in the server's own queue (FIFO) with `lock_timeout`
//!   as the wait bound, then takes the token the same way.
//! * Every statement on a holding session sets its `idle_session_timeout`
//!   to the row's new expiry: a holder that stops renewing — frozen,
//!   partitioned, gone — loses its session, and the lock, when its TTL has
//!   passed in silence on the server's clock.
//! * A hold lives in this handle ([`Hold`]): extend and release must come
//!   through it. A lease presented to another handle is checked against
//!   the registry; its release ends the holding session.

mod conn;
pub(crate) mod hash;
mod statements;

use std::{
    collections::{HashMap, HashSet},
    sync::{Arc, Mutex},
    time::Duration,
};

use fenced_api::{
    wait::wait_deadline, Capabilities, Error, Label, Lease, LockInfo, LockKey, LockOptions, Owner,
    ReleaseOutcome, Result, WaitPolicy,
};
use fenced_sql::rows::stored_key;
use sqlx::{PgConnection, PgPool, Row};
use tokio::time::Instant;

pub(crate) use self::conn::guc_ms;
use self::conn::{LockConn, LockConns, IDLE_KEEP};
pub(crate) use self::statements::{grant, Sql};
use crate::{
    config::{PostgresConfig, TableName},
    error::{self, state, PostgresBackend, SqlResultExt},
    list::info_from_row,
    strategy::lease::{micros, token},
};

/// How many registered keys a handle remembers (then it forgets them all
/// and registers again: one idempotent statement per key).
const REGISTERED_CAP: usize = 4096;

/// A lock connection shared by the calls on one hold; `None` once the hold
/// ended (its connection is closed).
type Slot = Arc<tokio::sync::Mutex<Option<LockConn>>>;

/// A lock held through this handle.
#[derive(Debug)]
struct Hold {
    owner: Owner,
    token: i64,
    /// Entries of this owner (re-entry counts here and in the row).
    count: u32,
    /// The local deadline of the latest grant or renewal: past it the
    /// server has ended (or is about to end) the session.
    deadline: Instant,
    slot: Slot,
}

/// The `advisory` strategy of one handle.
pub(crate) struct Advisory {
    pool: PgPool,
    table: TableName,
    conns: LockConns,
    sql: Sql,
    op_timeout: Duration,
    held: Mutex<HashMap<LockKey, Hold>>,
    registered: Mutex<HashSet<LockKey>>,
}

impl std::fmt::Debug for Advisory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Advisory")
            .field("table", &self.table)
            .field("conns", &self.conns)
            .finish_non_exhaustive()
    }
}

/// What one try on a lock connection found.
enum Tried {
    Granted(i64),
    Refused,
    /// Granted, but the key's registry row is gone: the lock was given up.
    NoRow,
}

/// A lease's token as stored; -1 (never a sequence value) for a token no
/// row can have, so a forged lease matches nothing.
fn stored(lease: &Lease) -> i64 {
    i64::try_from(lease.token.get()).unwrap_or(-1)
}

/// Why a holding session's statement failed, for `LeaseLost`.
fn session_end_reason(e: &sqlx::Error) -> String {
    match error::sqlstate(e).as_deref() {
        Some("57P01") => {
            "its session was terminated (pg_terminate_backend, a force_release)".into()
        }
        Some(state::IDLE_SESSION_TIMEOUT) => {
            "the server ended its idle session: the ttl passed without a renewal".into()
        }
        _ => format!("its session ended: {e}"),
    }
}

/// A failed `pg_terminate_backend`: refused for want of the right to
/// signal the holder's session, said so.
fn terminate_failed(e: sqlx::Error) -> Error {
    if error::sqlstate(&e).as_deref() == Some(state::INSUFFICIENT_PRIVILEGE) {
        Error::config(format!(
            "ending the holding session with pg_terminate_backend was refused ({e}): it needs \
             the holder's role (or membership in it) or the pg_signal_backend role, and a \
             superuser's session only a superuser may end"
        ))
    } else {
        error::map(e)
    }
}

fn lease_lost(lease: &Lease, reason: impl Into<String>) -> Error {
    Error::lease_lost(&lease.key, lease.token, reason)
}

/// Records `key` with its hash in the registry, on `c` (any session: a
/// lock connection, or the connection of a transaction-scoped lock).
/// `Ok(None)` once the key is recorded; `Ok(Some(other))` when another key
/// has that hash (`other` is `None` if its row could not be found).
pub(crate) async fn register(
    sql: &Sql,
    c: &mut PgConnection,
    key: &LockKey,
    hash: i64,
) -> std::result::Result<Option<Option<String>>, sqlx::Error> {
    let done = sqlx::query(sql.register.clone())
        .bind(key.as_bytes())
        .bind(hash)
        .execute(&mut *c)
        .await;
    match done {
        Ok(_) => Ok(None),
        // A unique violation on `hash`: another key has it — or this very
        // key was being recorded by another session at the same moment
        // (`ON CONFLICT` arbitrates on `lock_key` only).
        Err(e) if error::is_unique_violation(&e) => {
            let other = sqlx::query(sql.registered_with.clone())
                .bind(hash)
                .fetch_optional(&mut *c)
                .await?
                .map(|row| row.try_get::<Vec<u8>, _>(0))
                .transpose()?;
            if other.as_deref() == Some(key.as_bytes()) {
                Ok(None)
            } else {
                Ok(Some(
                    other.map(|raw| String::from_utf8_lossy(&raw).into_owned()),
                ))
            }
        }
        Err(e) => Err(e),
    }
}

/// The error for `key`, whose hash `other` (`None`: a key not found) has
/// in `table`'s registry.
pub(crate) fn collision(
    table: &TableName,
    key: &LockKey,
    hash: i64,
    other: Option<String>,
) -> Error {
    let other = other.map_or_else(|| "another key".to_owned(), |o| format!("`{o}`"));
    tracing::error!(key = %key, hash, "advisory key collision");
    Error::config(format!(
        "lock keys `{key}` and {other} have the same advisory key {hash} in table `{table}`; \
         fenced never lets two keys share one lock: take one of them in another table, \
         or use the lease strategy"
    ))
}

impl Advisory {
    pub(crate) fn new(config: &PostgresConfig, pool: PgPool) -> Self {
        Advisory {
            pool,
            table: config.table.clone(),
            conns: LockConns::new(config),
            sql: Sql::new(&config.table),
            op_timeout: config.operation_timeout,
            held: Mutex::default(),
            registered: Mutex::default(),
        }
    }

    fn held(&self) -> std::sync::MutexGuard<'_, HashMap<LockKey, Hold>> {
        self.held.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// How long `pg_terminate_backend` waits for the session to be gone.
    fn terminate_wait_ms(&self) -> i64 {
        let d = (self.op_timeout / 2).min(Duration::from_secs(5));
        i64::try_from(d.as_millis()).unwrap_or(5000).max(1)
    }

    /// Stops using lock connections (the handle was closed).
    pub(crate) fn stop(&self) {
        self.conns.close();
    }

    fn is_registered(&self, key: &LockKey) -> bool {
        self.registered
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .contains(key)
    }

    fn remember_registered(&self, key: &LockKey) {
        let mut known = self.registered.lock().unwrap_or_else(|p| p.into_inner());
        if known.len() >= REGISTERED_CAP {
            known.clear();
        }
        known.insert(key.clone());
    }

    /// Records `key` with its hash in the registry, on `c`, unless this
    /// handle did already. `Some(other)` when another key has that hash
    /// (see [`register`]).
    async fn register_on(
        &self,
        c: &mut LockConn,
        key: &LockKey,
        hash: i64,
    ) -> std::result::Result<Option<Option<String>>, sqlx::Error> {
        if self.is_registered(key) {
            return Ok(None);
        }
        let other = register(&self.sql, c.conn(), key, hash).await?;
        if other.is_none() {
            self.remember_registered(key);
        }
        Ok(other)
    }

    /// The error for a key whose hash `other` has.
    fn collision(&self, key: &LockKey, hash: i64, other: Option<String>) -> Error {
        collision(&self.table, key, hash, other)
    }

    fn forget_registered(&self, key: &LockKey) {
        self.registered
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(key);
    }

    /// Re-entry or refusal when this handle already holds `key` for the
    /// owner `opts` names; `Ok(None)` when the server must decide.
    async fn enter_local(&self, key: &LockKey, opts: &LockOptions) -> Result<Option<Lease>> {
        let Some(owner) = opts.owner() else {
            return Ok(None);
        };
        let (slot, t) = {
            let mut held = self.held();
            let Some(h) = held.get(key) else {
                return Ok(None);
            };
            if Instant::now() >= h.deadline {
                // Not renewed in time: the server has ended that session or
                // is about to; closing it frees the lock now.
                held.remove(key);
                return Ok(None);
            }
            if h.owner != *owner {
                return Ok(None);
            }
            if !opts.is_reentrant() {
                return Err(Error::AlreadyHeld { key: key.clone() });
            }
            (Arc::clone(&h.slot), h.token)
        };
        let mut guard = slot.lock().await;
        let Some(c) = guard.as_mut() else {
            self.drop_hold(key, t);
            return Ok(None);
        };
        let sent = Instant::now();
        let row = sqlx::query(self.sql.reenter.clone())
            .bind(micros(opts.ttl()))
            .bind(key.as_bytes())
            .bind(t)
            .bind(owner.as_str().as_bytes())
            .fetch_optional(c.conn())
            .await;
        match row {
            Ok(Some(_)) => {
                let mut held = self.held();
                if let Some(h) = held.get_mut(key).filter(|h| h.token == t) {
                    h.count += 1;
                    h.deadline = h.deadline.max(sent + opts.ttl());
                }
                Ok(Some(Lease::new(
                    key.clone(),
                    owner.clone(),
                    token(t),
                    opts.ttl(),
                    sent,
                )))
            }
            Ok(None) => {
                *guard = None;
                drop(guard);
                self.drop_hold(key, t);
                Ok(None)
            }
            Err(e) if !error::leaves_session_usable(&e) => {
                *guard = None;
                drop(guard);
                self.drop_hold(key, t);
                Ok(None)
            }
            Err(e) => Err(error::map(e)),
        }
    }

    /// Removes the hold of `key` with `token`, if it is still the one in
    /// the map (dropping it closes what is left of its connection).
    fn drop_hold(&self, key: &LockKey, token: i64) {
        let removed = {
            let mut held = self.held();
            match held.get(key) {
                Some(h) if h.token == token => held.remove(key),
                _ => None,
            }
        };
        drop(removed);
    }

    /// Records a grant and builds its lease.
    fn hold(
        &self,
        key: &LockKey,
        owner: Owner,
        t: i64,
        opts: &LockOptions,
        sent: Instant,
        c: LockConn,
    ) -> Lease {
        let lease = Lease::new(key.clone(), owner.clone(), token(t), opts.ttl(), sent);
        let replaced = self.held().insert(
            key.clone(),
            Hold {
                owner,
                token: t,
                count: 1,
                deadline: lease.deadline,
                slot: Arc::new(tokio::sync::Mutex::new(Some(c))),
            },
        );
        // A hold of this key left in the map whose session has ended (the
        // server granted the key again): closed.
        drop(replaced);
        tracing::debug!(key = %key, token = t, "advisory lock acquired");
        lease
    }

    /// One try on `c`.
    async fn try_on(
        &self,
        c: &mut LockConn,
        hash: i64,
        key: &LockKey,
        owner: &Owner,
        opts: &LockOptions,
    ) -> std::result::Result<Tried, sqlx::Error> {
        let row = sqlx::query(self.sql.try_lock.clone())
            .bind(hash)
            .bind(key.as_bytes())
            .bind(owner.as_str().as_bytes())
            .bind(micros(opts.ttl()))
            .bind(opts.label().map(Label::as_str))
            .fetch_one(c.conn())
            .await?;
        let got: bool = row.try_get(0)?;
        let t: Option<i64> = row.try_get(1)?;
        Ok(match (got, t) {
            (false, _) => Tried::Refused,
            (true, Some(t)) => Tried::Granted(t),
            (true, None) => {
                sqlx::query(self.sql.unlock.clone())
                    .bind(hash)
                    .execute(c.conn())
                    .await?;
                Tried::NoRow
            }
        })
    }

    /// After a refusal with an explicit owner: that owner holding the key
    /// through another handle would be waiting for itself.
    async fn refuse_same_owner(
        &self,
        c: &mut LockConn,
        key: &LockKey,
        opts: &LockOptions,
    ) -> Result<()> {
        let Some(owner) = opts.owner() else {
            return Ok(());
        };
        let held = sqlx::query(self.sql.owner_holds.clone())
            .bind(key.as_bytes())
            .bind(owner.as_str().as_bytes())
            .fetch_optional(c.conn())
            .await
            .db()?;
        match held {
            Some(_) => Err(opts.refuse_reentry(error::BACKEND, key)),
            None => Ok(()),
        }
    }

    /// Registers the key (once per handle) and tries, on lock connections,
    /// until the server answers on a live one: a kept connection the server
    /// ended meanwhile is replaced once, a key whose registry row vanished
    /// is registered again once. The connection comes back with the answer
    /// unless the lock was granted. A key whose hash another key has is
    /// refused before any lock is asked for.
    async fn try_with(
        &self,
        mut c: LockConn,
        hash: i64,
        key: &LockKey,
        owner: &Owner,
        opts: &LockOptions,
    ) -> Result<(Option<Lease>, Option<LockConn>)> {
        let mut fresh_tries = 0;
        let mut replaced = false;
        loop {
            let sent = Instant::now();
            let tried = match self.register_on(&mut c, key, hash).await {
                Ok(Some(other)) => {
                    self.conns.put(c);
                    return Err(self.collision(key, hash, other));
                }
                Ok(None) => self.try_on(&mut c, hash, key, owner, opts).await,
                Err(e) => Err(e),
            };
            match tried {
                Ok(Tried::Granted(t)) => {
                    return Ok((Some(self.hold(key, owner.clone(), t, opts, sent, c)), None))
                }
                Ok(Tried::Refused) => return Ok((None, Some(c))),
                Ok(Tried::NoRow) if fresh_tries == 0 => {
                    fresh_tries += 1;
                    self.forget_registered(key);
                }
                Ok(Tried::NoRow) => {
                    return Err(Error::backend(
                        error::BACKEND,
                        true,
                        format!("the registry row of `{key}` keeps disappearing; try again"),
                    ))
                }
                Err(e) if c.reused && !replaced && !error::leaves_session_usable(&e) => {
                    replaced = true;
                    drop(c);
                    c = self.conns.take_now().await?;
                }
                Err(e) => return Err(error::map(e)),
            }
        }
    }

    pub(crate) async fn try_acquire(
        &self,
        key: &LockKey,
        opts: &LockOptions,
    ) -> Result<Option<Lease>> {
        if let Some(lease) = self.enter_local(key, opts).await? {
            return Ok(Some(lease));
        }
        let owner = opts.owner_or_random();
        let hash = hash::advisory_key(&self.table, key);
        let c = self.conns.take_now().await?;
        let (lease, c) = self.try_with(c, hash, key, &owner, opts).await?;
        if let Some(mut c) = c {
            match self.refuse_same_owner(&mut c, key, opts).await {
                Ok(()) => self.conns.put(c),
                Err(e) => {
                    // The connection is fine after a refusal of the owner.
                    if matches!(e, Error::AlreadyHeld { .. } | Error::Unsupported { .. }) {
                        self.conns.put(c);
                    }
                    return Err(e);
                }
            }
        }
        Ok(lease)
    }

    pub(crate) async fn acquire(&self, key: &LockKey, opts: &LockOptions) -> Result<Lease> {
        let start = Instant::now();
        if let Some(lease) = self.enter_local(key, opts).await? {
            return Ok(lease);
        }
        let timeout = |start: Instant| Error::Timeout {
            key: key.clone(),
            waited: start.elapsed(),
        };
        let owner = opts.owner_or_random();
        let hash = hash::advisory_key(&self.table, key);
        let deadline = wait_deadline(opts.wait(), start);
        let Some(c) = self.conns.take_until(deadline).await? else {
            return Err(timeout(start));
        };
        let (lease, c) = self.try_with(c, hash, key, &owner, opts).await?;
        let mut c = match (lease, c) {
            (Some(lease), _) => return Ok(lease),
            (None, Some(c)) => c,
            (None, None) => return Err(timeout(start)),
        };
        self.refuse_same_owner(&mut c, key, opts).await?;
        let lock_timeout = match (opts.wait(), deadline) {
            (WaitPolicy::NoWait, _) => {
                self.conns.put(c);
                return Err(timeout(start));
            }
            (_, None) => "0".to_owned(),
            (_, Some(d)) => {
                let left = d.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    self.conns.put(c);
                    return Err(timeout(start));
                }
                guc_ms(left)
            }
        };
        // Dropped here (the caller gave up), `c` is closed: the server ends
        // the wait within the connection check interval.
        let waited = sqlx::query(self.sql.wait_lock.clone())
            .bind(hash)
            .bind(lock_timeout)
            .bind(guc_ms(opts.ttl()))
            .execute(c.conn())
            .await;
        match waited {
            Ok(_) => {}
            Err(e) if error::is_lock_not_available(&e) => {
                // The refusal rolled the statement's settings back.
                self.conns.put(c);
                return Err(timeout(start));
            }
            Err(e) => return Err(error::map(e)),
        }
        // The lease counts from this statement: the server's idle timer
        // restarts when it ends.
        let sent = Instant::now();
        let row = sqlx::query(self.sql.take_token.clone())
            .bind(hash)
            .bind(key.as_bytes())
            .bind(owner.as_str().as_bytes())
            .bind(micros(opts.ttl()))
            .bind(opts.label().map(Label::as_str))
            .fetch_optional(c.conn())
            .await
            .db()?;
        match row {
            Some(row) => {
                let t: i64 = row.try_get(0).db()?;
                Ok(self.hold(key, owner, t, opts, sent, c))
            }
            None => {
                // The registry row vanished while this waited (deleted by
                // hand): give the lock up (closing the session does) and
                // let the caller try again.
                self.forget_registered(key);
                drop(c);
                Err(Error::backend(
                    error::BACKEND,
                    true,
                    format!("the registry row of `{key}` disappeared during the wait; try again"),
                ))
            }
        }
    }

    /// The hold of `lease` in this handle (matching owner and token).
    fn hold_of(&self, lease: &Lease) -> Option<(Slot, u32)> {
        let held = self.held();
        let h = held.get(&lease.key)?;
        (h.token == stored(lease) && h.owner == lease.owner).then(|| (Arc::clone(&h.slot), h.count))
    }

    /// The pid of the session holding `lease`, if that lease is current
    /// (held through any handle).
    async fn holder_pid(&self, lease: &Lease) -> Result<Option<i32>> {
        let row = sqlx::query(self.sql.holder_pid.clone())
            .bind(lease.key.as_bytes())
            .bind(stored(lease))
            .bind(lease.owner.as_str().as_bytes())
            .fetch_optional(&self.pool)
            .await
            .db()?;
        row.map(|r| r.try_get::<i32, _>(0)).transpose().db()
    }

    pub(crate) async fn extend(&self, lease: &Lease, ttl: Duration) -> Result<Lease> {
        let ttl = LockOptions::validate_ttl(ttl)?;
        let Some((slot, _)) = self.hold_of(lease) else {
            return match self.holder_pid(lease).await? {
                Some(pid) => Err(Error::Unsupported {
                    backend: error::BACKEND,
                    what: format!(
                        "renewing an advisory lock through another PostgresLock than the one \
                         holding it (session {pid}); extend it through that handle"
                    ),
                }),
                None => Err(fenced_sql::extend_refused(lease)),
            };
        };
        let token = stored(lease);
        let mut guard = slot.lock().await;
        let Some(c) = guard.as_mut() else {
            drop(guard);
            self.drop_hold(&lease.key, token);
            return Err(lease_lost(lease, "its session has ended"));
        };
        let sent = Instant::now();
        let row = sqlx::query(self.sql.extend.clone())
            .bind(micros(ttl))
            .bind(lease.key.as_bytes())
            .bind(token)
            .bind(lease.owner.as_str().as_bytes())
            .fetch_optional(c.conn())
            .await;
        let reason = match row {
            Ok(Some(_)) => {
                let renewed = lease.renewed(ttl, sent);
                if let Some(h) = self.held().get_mut(&lease.key).filter(|h| h.token == token) {
                    h.deadline = renewed.deadline;
                }
                return Ok(renewed);
            }
            Ok(None) => "its registry row no longer names this holder".to_owned(),
            Err(e) if !error::leaves_session_usable(&e) => session_end_reason(&e),
            Err(e) => return Err(error::map(e)),
        };
        *guard = None;
        drop(guard);
        self.drop_hold(&lease.key, token);
        tracing::warn!(key = %lease.key, token = %lease.token, reason, "advisory lock lost");
        Err(lease_lost(lease, reason))
    }

    pub(crate) async fn release(&self, lease: &Lease) -> Result<ReleaseOutcome> {
        let Some((slot, count)) = self.hold_of(lease) else {
            return self.release_elsewhere(lease).await;
        };
        let token = stored(lease);
        let mut guard = slot.lock().await;
        if count > 1 {
            let Some(c) = guard.as_mut() else {
                drop(guard);
                self.drop_hold(&lease.key, token);
                return Ok(ReleaseOutcome::NotHeld);
            };
            let row = sqlx::query(self.sql.leave.clone())
                .bind(lease.key.as_bytes())
                .bind(token)
                .bind(lease.owner.as_str().as_bytes())
                .fetch_optional(c.conn())
                .await;
            match row {
                Ok(Some(row)) => {
                    let left: i32 = row.try_get(0).db()?;
                    let left = u32::try_from(left).unwrap_or(1).max(1);
                    if let Some(h) = self.held().get_mut(&lease.key).filter(|h| h.token == token) {
                        h.count = left;
                    }
                    return Ok(ReleaseOutcome::StillHeld { remaining: left });
                }
                Ok(None) => {}
                Err(e) if !error::leaves_session_usable(&e) => {}
                Err(e) => return Err(error::map(e)),
            }
            *guard = None;
            drop(guard);
            self.drop_hold(&lease.key, token);
            return Ok(ReleaseOutcome::NotHeld);
        }
        // The last entry: the hold leaves the map before the statement, so
        // a release dropped half-way closes the connection, which frees
        // the lock as well.
        let taken = guard.take();
        drop(guard);
        self.drop_hold(&lease.key, token);
        let Some(mut c) = taken else {
            return Ok(ReleaseOutcome::NotHeld);
        };
        let hash = hash::advisory_key(&self.table, &lease.key);
        let row = sqlx::query(self.sql.release.clone())
            .bind(hash)
            .bind(lease.key.as_bytes())
            .bind(token)
            .bind(guc_ms(IDLE_KEEP))
            .fetch_one(c.conn())
            .await;
        match row {
            Ok(row) => {
                let unlocked: bool = row.try_get(0).db()?;
                if unlocked {
                    self.conns.put(c);
                    Ok(ReleaseOutcome::Released)
                } else {
                    // The session held no such lock (not ours to keep).
                    Ok(ReleaseOutcome::NotHeld)
                }
            }
            // The session ended before: so did the lock.
            Err(e) if !error::leaves_session_usable(&e) => Ok(ReleaseOutcome::NotHeld),
            // Closing the connection (dropping `c`) frees the lock.
            Err(e) => {
                tracing::warn!(key = %lease.key, error = %e, "advisory release statement failed; the lock connection is closed instead");
                Ok(ReleaseOutcome::Released)
            }
        }
    }

    /// A lease not held through this handle: if it is current (another
    /// handle holds it), its session is ended.
    async fn release_elsewhere(&self, lease: &Lease) -> Result<ReleaseOutcome> {
        let Some(pid) = self.holder_pid(lease).await? else {
            return Ok(ReleaseOutcome::NotHeld);
        };
        let ended: bool = sqlx::query(self.sql.terminate.clone())
            .bind(pid)
            .bind(self.terminate_wait_ms())
            .fetch_one(&self.pool)
            .await
            .map_err(terminate_failed)?
            .try_get(0)
            .db()?;
        Ok(if ended {
            tracing::info!(key = %lease.key, pid, "advisory lock released by ending the holding session of another handle");
            ReleaseOutcome::Released
        } else {
            ReleaseOutcome::NotHeld
        })
    }

    /// Ends every session holding `key`'s advisory lock (needs the same
    /// role as the holder, or `pg_signal_backend`).
    pub(crate) async fn force_release(&self, key: &LockKey) -> Result<bool> {
        let hash = hash::advisory_key(&self.table, key);
        let ended: bool = sqlx::query(self.sql.terminate_holders.clone())
            .bind(hash)
            .bind(self.terminate_wait_ms())
            .fetch_one(&self.pool)
            .await
            .map_err(terminate_failed)?
            .try_get(0)
            .db()?;
        if ended {
            tracing::warn!(key = %key, "advisory lock force-released (holding session terminated)");
        }
        Ok(ended)
    }

    pub(crate) async fn inspect(&self, key: &LockKey) -> Result<Option<LockInfo>> {
        let row = sqlx::query(self.sql.inspect.clone())
            .bind(key.as_bytes())
            .fetch_optional(&self.pool)
            .await
            .db()?;
        row.map(|r| info_from_row(key, &r)).transpose()
    }

    pub(crate) async fn list(&self, limit: usize) -> Result<Vec<LockInfo>> {
        let rows = sqlx::query(self.sql.list.clone())
            .bind(i64::try_from(limit).unwrap_or(i64::MAX))
            .fetch_all(&self.pool)
            .await
            .db()?;
        let mut held = Vec::with_capacity(rows.len());
        for row in &rows {
            let raw: Vec<u8> = row.try_get(5).db()?;
            let key = stored_key::<PostgresBackend>(&raw)?;
            held.push(info_from_row(&key, row)?);
        }
        Ok(held)
    }

    /// Not durable (a restart ends every session, and its locks); FIFO
    /// (the server grants a waited-for lock in queue order); re-entry per
    /// owner through the holding handle.
    pub(crate) fn capabilities(base: Capabilities) -> Capabilities {
        base.fencing(true)
            .reentrant(true)
            .native_wait(true)
            .fifo(true)
    }

    pub(crate) fn pool(&self) -> &PgPool {
        &self.pool
    }
}
