//! `row_lock`: `SELECT … FOR UPDATE` on a row that exists (per-key, sharded
//! or fixed-id rows).
//!
//! The held lock **is** an open transaction on a dedicated connection kept
//! inside the backend; the lease stays plain data. Consequences, all handled:
//!
//! * waiting is InnoDB's own lock queue (native, roughly FIFO), bounded by a
//!   client-side deadline (the abandoned statement is killed) and re-armed in
//!   chunks of `innodb_lock_wait_timeout`; `try_acquire` uses `NOWAIT`;
//! * the row is created first (`INSERT IGNORE`, autocommit): a `FOR UPDATE`
//!   on a missing row would take a gap lock;
//! * a frozen or vanished holder loses the lock after its TTL because the
//!   connection's `wait_timeout` is the TTL (rounded up to whole seconds)
//!   and every renewal is a statement on that connection;
//! * a connection whose hold ends abnormally (future dropped, instance
//!   dropped, error) is closed, never reused mid-transaction.
//!
//! # Statements per acquire + release
//!
//! Two on MariaDB — one fewer than a plain `BEGIN` / `SELECT … FOR UPDATE` /
//! `COMMIT` — once a connection has served one hold:
//!
//! 1. `SET STATEMENT innodb_lock_wait_timeout = 0 FOR REPLACE INTO <base>_live
//!    … SELECT … FROM <base>_rows r JOIN <base>_live l … FOR UPDATE`: the row
//!    lock, the fencing token and the holder's description (owner, label,
//!    expiry, connection id, for `inspect` and `force_release`) in one
//!    statement.
//!    The connection runs with `autocommit = 0`, so it opens the
//!    transaction (no `START TRANSACTION`). A held row refuses it at once —
//!    a refused `try_acquire` waits for this one statement. The refusal
//!    rolls the statement back, not the transaction it opened, which keeps
//!    metadata locks on both tables (DDL on them would wait): the
//!    connection is kept with a `ROLLBACK` sent in the background, a second
//!    statement on the server that the caller does not wait for and that
//!    has answered before the connection serves again ([`conn`]). Not
//!    `NOWAIT`: that would also refuse when another holder's token
//!    statement has the `MEMORY` table's lock for a few microseconds.
//! 2. `ROLLBACK` — the release.
//!
//! An `acquire` that finds the row held queues with a plain `SELECT … FOR
//! UPDATE` (a waiting `REPLACE … SELECT` would keep the `MEMORY` table locked
//! — every other key blocked — for the whole wait), then takes its token with
//! `REPLACE INTO <base>_live … SELECT …` on the holding connection: four
//! statements for a contended acquisition, with the hand-off done by InnoDB's
//! queue. That token statement is also the proof that the hold is alive
//! after the grant: the lease counts from its send time, so a lease granted
//! after a long wait is never born expired.
//!
//! MySQL has no `SET STATEMENT`; there (and with `row_lock_one_statement=false`)
//! every grant takes the two-statement path: `SELECT … FOR UPDATE [NOWAIT]`,
//! the token `REPLACE`, `ROLLBACK` — three per cycle, a refused try one
//! (`… NOWAIT`, plus the background `ROLLBACK`).
//!
//! What a hold does not send, and why that is safe:
//!
//! * session settings (`autocommit`, `wait_timeout`, `innodb_lock_wait_timeout`)
//!   and the connection id: set once when a pooled connection becomes a lock
//!   connection ([`conn`]), `wait_timeout` again only when the TTL changes;
//!   lock connections are kept between holds and never handed back to the
//!   pool with that session;
//! * a token bump on a second connection, a holder mark, a `DO 1` proof
//!   after the grant, clearing the holder at release: the token statement
//!   does all of it; the description left after a release is harmless
//!   because `inspect` confirms with a `NOWAIT` probe and `force_release`
//!   only kills a connection whose latest grant was that key;
//! * no `COM_PING` per pool checkout or return (see [`crate::conn`]).
//!
//! The files: [`statements`] (the SQL), [`grant`] (making the row exist,
//! lock connections, the locking statement, waiting in InnoDB's queue),
//! [`token`] (the fencing token and its lifetime), [`hold`] (extend,
//! release, inspect and force-release of a hold), [`local`] (what this
//! instance knows of its own holds), [`list`], [`innodb_trx`] (reading
//! which transactions are open), [`transaction`] (the transaction-scoped
//! API) and [`conn`] (lock connections).
//!
//! # Fencing tokens without a durable write per acquire
//!
//! `<base>_live` is a `MEMORY` table: not transactional, so the token taken
//! *inside* the holder's transaction survives that transaction's rollback —
//! a released, rolled-back or killed holder never gives its token back —
//! and a write there costs no log flush. Its `AUTO_INCREMENT` id is the
//! token (one counter per table, so tokens of all keys are comparable). A
//! `MEMORY` table is emptied by a server restart; the `REPLACE … SELECT`
//! only writes while the table's lifetime row (`\x01lifetime`) exists, and a
//! fresh lifetime starts its ids at `epoch << 40`, where `epoch` is bumped
//! durably (autocommit `InnoDB` write in `<base>_fence`) once per server
//! lifetime — so every token after a restart exceeds every token before it.
//! Opening a lifetime needs a committed write, which the holding
//! transaction cannot make: the grant is given back, the lifetime opened on
//! that same connection (no second connection is ever needed while a row is
//! held, so holders cannot deadlock on a full pool), and the row locked
//! again — once per server lifetime.
//!
//! Fallbacks, both correct but a round trip dearer: if `<base>_live` is not
//! a `MEMORY` table (the engine is disabled and was substituted) the token is
//! taken in autocommit on a second connection (a durable `InnoDB` counter);
//! if the server refuses non-transactional writes inside a transaction
//! (MySQL with `enforce_gtid_consistency`), likewise, on the same `MEMORY`
//! table. That connection is reserved *before* the row is locked, and a
//! waited grant also sends `DO 1` on the holding connection before the
//! lease counts (a `NOWAIT` grant counts from the locking statement's send).

mod conn;
mod grant;
mod hold;
mod innodb_trx;
mod list;
mod local;
mod statements;
mod token;
mod transaction;

use std::{
    collections::{HashMap, HashSet},
    fmt,
    sync::{atomic::AtomicBool, Arc, Mutex},
    time::Duration,
};

use async_trait::async_trait;
use fenced_api::{
    wait::wait_deadline, Capabilities, DistributedLock, Error, Label, Lease, LockInfo, LockKey,
    LockOptions, Owner, ReleaseOutcome, Result,
};
use sqlx::MySqlPool;
use tokio::time::Instant;

use self::conn::{HeldConn, LockConns};
use self::statements::Sql;
pub(crate) use self::statements::Tables;
use self::token::Granted;
pub(crate) use self::token::{live_is_memory, LIFETIME_KEY};
pub use self::transaction::RowLockTransaction;
use crate::conn::Conns;
use crate::error;

/// Which row a key locks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum RowMode {
    /// One row per key, created on first use (default).
    #[default]
    PerKey,
    /// Rows created ahead of time with [`MySqlLock::create_rows`](crate::MySqlLock::create_rows)
    /// (a fixed set of lock ids; `migrate` creates none). Locking an
    /// unknown key is an [`Error::Config`], found by a plain (non-locking)
    /// read — a `FOR UPDATE` on the missing row would take a gap lock.
    /// Rows seen once are cached, so a known key costs no extra statement.
    Fixed,
    /// Keys hashed onto N rows: bounded table size, but two keys on the same
    /// shard exclude each other.
    Shards(u32),
}

/// Who a grant is for, as its description in `<base>_live` records it.
#[derive(Clone, Copy)]
struct Grant<'a> {
    owner: &'a Owner,
    /// The effective TTL (whole seconds, see [`effective_ttl`]).
    ttl: Duration,
    label: Option<&'a Label>,
}

impl<'a> Grant<'a> {
    fn new(owner: &'a Owner, ttl: Duration, opts: &'a LockOptions) -> Self {
        Grant {
            owner,
            ttl,
            label: opts.label(),
        }
    }

    fn label_param(&self) -> Option<&'a [u8]> {
        self.label.map(|l| l.as_str().as_bytes())
    }
}

/// A fresh grant, before the token.
struct Locked<'a> {
    held: HeldConn,
    /// When the locking statement was sent.
    sent: Instant,
    /// Whether the grant came after a (possibly long) wait.
    waited: bool,
    /// Only when tokens are taken in autocommit: the side connection for
    /// it, reserved *before* locking — waiting for the pool while holding
    /// could deadlock holders that each wait for a second connection.
    side: Option<crate::conn::Conn<'a>>,
    /// The token, when the locking statement took it too.
    token: Option<u64>,
}

struct HeldRow {
    owner: Owner,
    token: u64,
    count: u32,
    /// The lease deadline: after it the hold is treated as gone here.
    deadline: Instant,
    conn: Arc<tokio::sync::Mutex<Option<HeldConn>>>,
}

pub(crate) struct RowLock {
    conns: Conns,
    locks: LockConns,
    max_connections: u32,
    mode: RowMode,
    op_timeout: Duration,
    /// Token inside the holder's transaction (see the module docs).
    token_in_txn: AtomicBool,
    /// Lock and token in one statement (see the module docs).
    one_statement: AtomicBool,
    held: Mutex<HashMap<LockKey, HeldRow>>,
    known_rows: Mutex<HashSet<Vec<u8>>>,
    sql: Sql,
}

impl fmt::Debug for RowLock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RowLock")
            .field("mode", &self.mode)
            .field("token_in_txn", &self.token_in_txn)
            .field("one_statement", &self.one_statement)
            .finish_non_exhaustive()
    }
}

/// The TTL the server enforces: `wait_timeout` is in whole seconds.
pub(crate) fn effective_ttl(ttl: Duration) -> (u64, Duration) {
    let secs = ttl.as_micros().div_ceil(1_000_000).max(1) as u64;
    (secs, Duration::from_secs(secs))
}

/// Fixed-row mode, and the key has no row.
fn no_fixed_row(key: &LockKey) -> Error {
    Error::config(format!(
        "no lock row for `{key}`: fixed-row mode needs its rows created first, with \
         MySqlLock::create_rows (once, e.g. at deploy time after migrate)"
    ))
}

impl RowLock {
    pub(crate) fn new(
        pool: MySqlPool,
        tables: Tables,
        mode: RowMode,
        op_timeout: Duration,
        live_is_memory: bool,
        one_statement: bool,
    ) -> Self {
        let max_connections = pool.options().get_max_connections();
        RowLock {
            conns: Conns::new(pool),
            locks: LockConns::new(),
            max_connections,
            mode,
            op_timeout,
            token_in_txn: AtomicBool::new(live_is_memory),
            one_statement: AtomicBool::new(live_is_memory && one_statement),
            held: Mutex::default(),
            known_rows: Mutex::default(),
            sql: Sql::new(&tables),
        }
    }
}

#[async_trait]
impl DistributedLock for RowLock {
    async fn try_acquire(&self, key: &LockKey, opts: &LockOptions) -> Result<Option<Lease>> {
        let (ttl_secs, ttl) = effective_ttl(opts.ttl());
        let sent = Instant::now();
        match self.local(key, opts, ttl, sent)? {
            Some(Some(lease)) => {
                if let Some(lease) = self.reentered(lease, opts.ttl()).await? {
                    return Ok(Some(lease));
                }
            }
            // Held through this instance by another owner — unless its
            // connection has died meanwhile: then compete on the server.
            Some(None) if !self.local_hold_gone(key).await? => return Ok(None),
            Some(None) | None => {}
        }
        let owner = opts.owner_or_random();
        let grant = Grant::new(&owner, ttl, opts);
        for _ in 0..3 {
            let Some(locked) = self
                .lock_row(key, Some(grant), Some(ttl_secs), None)
                .await?
            else {
                self.refuse_same_owner(key, opts).await?;
                return Ok(None);
            };
            if let Granted::Lease(l) = self.register(key, grant, locked).await? {
                return Ok(Some(l));
            }
        }
        Err(Error::backend(
            error::BACKEND,
            true,
            "the row_lock token table kept being reset; try again",
        ))
    }

    async fn acquire(&self, key: &LockKey, opts: &LockOptions) -> Result<Lease> {
        let (ttl_secs, ttl) = effective_ttl(opts.ttl());
        let start = Instant::now();
        if let Some(Some(lease)) = self.local(key, opts, ttl, start)? {
            if let Some(lease) = self.reentered(lease, opts.ttl()).await? {
                return Ok(lease);
            }
        }
        // An explicit owner tries without waiting first: a refusal tells
        // whether that owner holds the key through another instance, where
        // waiting would be waiting for itself (one more statement, only for
        // a contended acquire with an explicit owner).
        if opts.owner().is_some() && opts.wait() != fenced_api::WaitPolicy::NoWait {
            if let Some(lease) = self.try_acquire(key, opts).await? {
                return Ok(lease);
            }
        }
        let owner = opts.owner_or_random();
        let grant = Grant::new(&owner, ttl, opts);
        let deadline = wait_deadline(opts.wait(), start);
        loop {
            let locked = self
                .wait_for_row(key, grant, ttl_secs, deadline, start)
                .await?;
            if let Granted::Lease(l) = self.register(key, grant, locked).await? {
                return Ok(l);
            }
        }
    }

    async fn extend(&self, lease: &Lease, ttl: Duration) -> Result<Lease> {
        self.extend_hold(lease, ttl).await
    }

    async fn release(&self, lease: &Lease) -> Result<ReleaseOutcome> {
        self.release_hold(lease).await
    }

    async fn inspect(&self, key: &LockKey) -> Result<Option<LockInfo>> {
        self.inspect_key(key).await
    }

    /// See [`list_held`](Self::list_held): one `SELECT` of the grant
    /// descriptions, then a `NOWAIT` probe per candidate not held through
    /// this instance.
    async fn list(&self, limit: usize) -> Result<Vec<LockInfo>> {
        self.list_held(limit).await
    }

    async fn force_release(&self, key: &LockKey) -> Result<bool> {
        self.force_release_key(key).await
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities::none()
            .backend("mysql/row_lock")
            .native_wait(true)
            .transaction_scoped(true)
            .fencing(true)
            .reentrant(true)
            .min_ttl(Duration::from_secs(1))
    }
}
