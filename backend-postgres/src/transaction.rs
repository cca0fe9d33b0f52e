//! The transaction-scoped lock: [`PostgresLock::lock_in_transaction`] and
//! [`PostgresLockTransaction`]. What it guarantees, and how each strategy
//! holds the lock, is in the crate docs ("Transaction-scoped locks").
//!
//! Every transaction runs on a connection of its own — a one-connection
//! pool made for it, closed when it ends — never on the statement pool: an
//! open transaction cannot starve renewals or other locks of connections,
//! and nothing the caller changed in the session reaches another user.
//!
//! * `lease`: the lease is granted as usual (autocommit, so others' tries
//!   stay one statement and are refused at once) and renewed from a task at
//!   a third of its TTL while the transaction is open. `commit` runs the
//!   release — matching key, token, owner and a lease that has not expired
//!   — as a statement of the caller's transaction, then `COMMIT`: the
//!   business writes commit only if the lease was still held, and the
//!   release's row lock keeps anyone from taking the key until they have.
//! * `advisory`: the session advisory lock and the token are taken on the
//!   transaction's connection before `BEGIN` (so `inspect` sees the holder
//!   and the registry row is never locked by the open transaction); `commit`
//!   turns the session lock into a transaction lock
//!   (`pg_try_advisory_xact_lock` + `pg_advisory_unlock`) and commits: the
//!   lock ends with the `COMMIT`, atomically with the writes.

use std::{
    fmt,
    ops::{Deref, DerefMut},
    sync::{Arc, Mutex},
    time::Duration,
};

use fenced_api::{
    wait::wait_deadline, DistributedLock, Error, FencingToken, Label, Lease, LockKey, LockOptions,
    Owner, Result, WaitPolicy,
};
use fenced_sql::sql;
use sqlx::{
    pool::PoolConnection,
    postgres::{PgConnectOptions, PgPoolOptions},
    PgConnection, PgPool, Postgres, Row, SqlStr, Transaction,
};
use tokio::{task::JoinHandle, time::Instant};

use crate::{
    config::{PostgresConfig, Strategy, TableName},
    conn,
    error::{self, SqlResultExt},
    lock::PostgresLock,
    strategy::{
        advisory::{self, guc_ms, hash::advisory_key},
        lease::{micros, notify_channel, stored, token},
    },
};

/// `client_connection_check_interval` of an `advisory` transaction's
/// session (ms): a wait whose client went away leaves the server's queue.
const CHECK_INTERVAL_MS: u32 = 250;

/// `tcp_keepalives_idle`, `_interval`, `_count` of a transaction's session:
/// a vanished client is noticed after 10 + 3 × 5 s of silence and its
/// transaction rolled back.
const KEEPALIVE: (u32, u32, u32) = (10, 5, 3);

/// The session of a transaction's connection, as startup parameters (no
/// round trip). `statement_timeout` is left to the server's and role's
/// defaults: the caller's statements are the caller's.
fn session_options(config: &PostgresConfig, strategy: Strategy, ttl: Duration) -> PgConnectOptions {
    let (idle, interval, count) = KEEPALIVE;
    let mut params = vec![
        // The token's nextval and the commit are on disk before anyone is told.
        ("synchronous_commit", "on".to_owned()),
        ("tcp_keepalives_idle", idle.to_string()),
        ("tcp_keepalives_interval", interval.to_string()),
        ("tcp_keepalives_count", count.to_string()),
    ];
    if strategy == Strategy::Advisory {
        // The lock lives exactly as long as the session is not silent for
        // longer than the TTL: before BEGIN (idle) and inside the
        // transaction (idle in transaction). PostgreSQL 14+, which
        // `advisory` requires anyway.
        params.extend([
            ("idle_session_timeout", guc_ms(ttl)),
            ("idle_in_transaction_session_timeout", guc_ms(ttl)),
            (
                "client_connection_check_interval",
                CHECK_INTERVAL_MS.to_string(),
            ),
        ]);
    }
    conn::connect_options(config).options(params)
}

/// The one-connection pool of one transaction: it owns the connection so
/// that the transaction can be a `Transaction<'static, Postgres>`, and
/// closing it closes the connection.
fn transaction_pool(config: &PostgresConfig, strategy: Strategy, ttl: Duration) -> PgPool {
    PgPoolOptions::new()
        .max_connections(1)
        .min_connections(0)
        .idle_timeout(None)
        .max_lifetime(None)
        .test_before_acquire(false)
        .acquire_timeout(config.connect_timeout)
        .connect_lazy_with(session_options(config, strategy, ttl))
}

/// The `lease` release as a statement of the caller's transaction: as the
/// plain release (last entry expires the row and notifies, an inner one
/// counts down), but committed with the transaction, durably.
fn lease_release_sql(table: &TableName) -> SqlStr {
    let t = table.quoted("");
    sql!(
        "WITH r AS (UPDATE {t} SET \
         reentrant_count = CASE WHEN reentrant_count > 1 THEN reentrant_count - 1 ELSE 0 END, \
         expire_at = CASE WHEN reentrant_count > 1 THEN expire_at ELSE clock_timestamp() END \
         WHERE lock_key = $1 AND token = $2 AND owner = $3 AND expire_at > clock_timestamp() \
         RETURNING lock_key, reentrant_count) \
         SELECT reentrant_count, \
         CASE WHEN reentrant_count = 0 THEN pg_notify($4, encode(lock_key, 'hex'))::text END \
         FROM r"
    )
}

/// The statements of `advisory`'s transaction-scoped lock that the
/// advisory strategy has no use for; the registry's and the lock's are
/// the strategy's own ([`advisory::Sql`]), on the transaction's connection.
struct TransactionSql {
    /// As the strategy's `take_token` (the grant sets the same columns),
    /// for a lock `wait_lock` got; also gives `statement_timeout` back to
    /// the session's default.
    take_token: SqlStr,
    /// `$1` hash, `$2` key, `$3` token: inside the transaction, the session
    /// lock becomes a transaction lock (`got`, `unlocked`: both true when
    /// this session held it) and the holder row is marked released.
    to_xact: SqlStr,
}

impl TransactionSql {
    fn new(table: &TableName) -> Self {
        let t = &table.quoted("_advisory");
        let grant = advisory::grant(table);
        TransactionSql {
            take_token: sql!(
                "UPDATE {t} SET {grant} WHERE lock_key = $2 AND hash = $1 \
                 RETURNING token, set_config('statement_timeout', NULL, false)"
            ),
            // `x` runs before the unlock reads its row: the transaction
            // lock is taken while the session lock still holds the key (a
            // try, so a session that lost its lock never waits here).
            to_xact: sql!(
                "WITH x AS MATERIALIZED (SELECT pg_try_advisory_xact_lock($1) AS got), \
                 r AS (UPDATE {t} SET reentrant_count = 0, expire_at = clock_timestamp(), \
                 pid = NULL WHERE lock_key = $2 AND token = $3 AND pid = pg_backend_pid() \
                 RETURNING 1) \
                 SELECT x.got, pg_advisory_unlock($1) FROM x"
            ),
        }
    }
}

/// A lock connection of the lock phase (`advisory`): if the call is
/// abandoned before the transaction begins, the connection is closed — it
/// may be waiting in the server's queue or holding the lock — never put
/// back into its pool.
struct Closing(Option<PoolConnection<Postgres>>);

impl Closing {
    fn conn(&mut self) -> Result<&mut PgConnection> {
        self.0
            .as_deref_mut()
            .ok_or_else(|| Error::backend(error::BACKEND, false, "the lock connection is gone"))
    }

    /// Hands the connection back to its pool, session intact.
    fn keep(mut self) {
        drop(self.0.take());
    }
}

impl Drop for Closing {
    fn drop(&mut self) {
        if let Some(mut c) = self.0.take() {
            c.close_on_drop();
        }
    }
}

/// How the transaction holds the lock.
#[derive(Debug, Clone, Copy)]
enum Hold {
    /// A lease row, renewed while the transaction is open.
    Lease,
    /// The session advisory lock on `hash`, held by the transaction's
    /// connection.
    Advisory { hash: i64 },
}

/// Everything but the transaction: what `commit` and `rollback` need, and
/// what is undone when the value is dropped before either ran.
struct Held {
    lock: PostgresLock,
    /// The transaction's own pool (one connection).
    pool: PgPool,
    /// The lease as last granted or renewed.
    current: Arc<Mutex<Lease>>,
    hold: Hold,
    /// The task renewing a lease.
    renewal: Option<JoinHandle<()>>,
    /// Whether dropping this still has to end the hold.
    armed: bool,
}

impl Held {
    fn lease(&self) -> Lease {
        self.current
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    fn op_timeout(&self) -> Duration {
        self.lock.config().operation_timeout
    }

    fn stop_renewal(&mut self) {
        if let Some(renewal) = self.renewal.take() {
            renewal.abort();
        }
    }

    /// Closes the transaction's connection (a transaction still open on it
    /// is rolled back by the server) and, for `lease` with `release`, then
    /// releases the lease — the connection first, so a new holder never
    /// waits on row locks of this transaction's writes. Bounded; a lease
    /// that cannot be released expires by its TTL.
    async fn end(&mut self, release: bool) -> Result<()> {
        self.armed = false;
        self.stop_renewal();
        let _ = tokio::time::timeout(self.op_timeout(), self.pool.close()).await;
        match self.hold {
            Hold::Lease if release => {
                let lease = self.lease();
                self.lock.release(&lease).await.map(drop)
            }
            _ => Ok(()),
        }
    }

    fn lease_lost(&self, reason: impl Into<String>) -> Error {
        let lease = self.lease();
        Error::lease_lost(&lease.key, lease.token, reason)
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        self.stop_renewal();
        if tokio::runtime::Handle::try_current().is_err() {
            // No runtime to run statements on: the lease expires after its
            // TTL; the connection closes as its pool is dropped.
            return;
        }
        let mut rest = Held {
            lock: self.lock.clone(),
            pool: self.pool.clone(),
            current: Arc::clone(&self.current),
            hold: self.hold,
            renewal: None,
            armed: false,
        };
        fenced_api::cleanup::spawn(async move {
            if let Err(e) = rest.end(true).await {
                let lease = rest.lease();
                tracing::warn!(key = %lease.key, token = %lease.token, error = %e,
                    "a dropped transaction-scoped lock could not be released; it expires by its ttl");
            }
        });
    }
}

/// A lock held by an open transaction on PostgreSQL, whose connection the
/// caller writes through.
///
/// Business writes made through it (it dereferences to the transaction's
/// [`PgConnection`]) commit **atomically with the release**
/// ([`commit`](Self::commit)), and only if the lock is still held at that
/// moment; [`rollback`](Self::rollback) — or dropping this value — undoes
/// them and releases the lock. Nothing the transaction wrote is visible to
/// others before the commit, and whoever gets the key next sees all of it.
///
/// The transaction is sqlx's: `begin()` on it opens a savepoint, and
/// `SET TRANSACTION ISOLATION LEVEL …` may be its first statement (fenced
/// runs nothing in it before you do; see the crate docs for what
/// REPEATABLE READ costs with `lease`). Never send `COMMIT`, `ROLLBACK` or `BEGIN` yourself: that would end the
/// locking transaction early and run what follows without the lock. The
/// connection is the transaction's own and is closed when it ends, so
/// session settings you change there go nowhere else.
///
/// # Example
///
/// A fenced write: the token checked in the same transaction
/// ([`Fence`](crate::fence::Fence)), the write, and the release, all in one
/// commit.
///
/// ```
/// use fenced_api::{LockKey, LockOptions};
/// use fenced_postgres::fence::{Fence, FenceOutcome};
/// use fenced_postgres::{sqlx, PostgresLock};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let url = "postgres://postgres@127.0.0.1:5432/fenced_test";
/// let locks = PostgresLock::connect(url).await?;
/// let db = sqlx::PgPool::connect(url).await?;
/// sqlx::raw_sql("CREATE TABLE IF NOT EXISTS fenced_doc_orders (id INT PRIMARY KEY, state TEXT)")
///     .execute(&db)
///     .await?;
/// let fence = Fence::default();
/// fence.create_table(&db).await?;
///
/// let key = LockKey::new("order:1001")?;
/// let opts = LockOptions::builder().wait_timeout(std::time::Duration::from_secs(10)).build()?;
/// let mut tx = locks.lock_in_transaction(&key, &opts).await?;
/// let token = tx.token();
/// match fence.check(&mut tx, "order:1001", token).await? {
///     FenceOutcome::Accepted => {
///         sqlx::query(
///             "INSERT INTO fenced_doc_orders (id, state) VALUES (1001, 'shipped') \
///              ON CONFLICT (id) DO UPDATE SET state = excluded.state",
///         )
///         .execute(&mut *tx)
///         .await?;
///         // The write, the fence's token and the release: one commit. It
///         // fails with `LeaseLost`, committing nothing, if the lock was lost.
///         tx.commit().await?;
///     }
///     FenceOutcome::Stale { .. } => tx.rollback().await?,
/// }
/// # Ok(())
/// # }
/// ```
pub struct PostgresLockTransaction {
    tx: Transaction<'static, Postgres>,
    held: Held,
}

impl fmt::Debug for PostgresLockTransaction {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PostgresLockTransaction")
            .field("lease", &self.held.lease())
            .finish_non_exhaustive()
    }
}

impl Deref for PostgresLockTransaction {
    type Target = PgConnection;
    fn deref(&self) -> &PgConnection {
        &self.tx
    }
}

impl DerefMut for PostgresLockTransaction {
    fn deref_mut(&mut self) -> &mut PgConnection {
        &mut self.tx
    }
}

impl PostgresLockTransaction {
    /// The lease: key, owner, fencing token, TTL and local deadline — the
    /// latest renewal's with `lease` (renewed while the transaction is
    /// open); the grant's with `advisory`, whose lock ends only with the
    /// transaction or with its session (silent for longer than the TTL).
    pub fn lease(&self) -> Lease {
        self.held.lease()
    }

    /// The locked key.
    pub fn key(&self) -> LockKey {
        self.held.lease().key
    }

    /// The fencing token of this hold.
    pub fn token(&self) -> FencingToken {
        self.held.lease().token
    }

    /// The connection, inside the locking transaction: run the business
    /// statements on it (as `&mut *tx` does).
    pub fn connection(&mut self) -> &mut PgConnection {
        &mut self.tx
    }

    /// Commits the business writes and releases the lock, atomically — and
    /// only if the lock is still held: otherwise nothing is committed.
    ///
    /// # Errors
    ///
    /// In every case below nothing was committed and the lock is released
    /// (or was already gone), except where the outcome is unknown:
    ///
    /// * [`Error::LeaseLost`]: the lock was gone before the commit — the
    ///   lease expired or was taken over (`lease`), the session holding it
    ///   ended (`advisory`: terminated, idle past the TTL, server restart).
    /// * [`Error::Backend`] for a transaction PostgreSQL refused to commit:
    ///   an error earlier in it (the transaction was aborted), a deferred
    ///   constraint, a serialization failure (retryable).
    /// * [`Error::Backend`], not retryable, saying the outcome is unknown,
    ///   when the connection failed while `COMMIT` was under way: the
    ///   writes and the release either both committed or neither did; the
    ///   lock is released either way.
    pub async fn commit(self) -> Result<()> {
        let PostgresLockTransaction { mut tx, mut held } = self;
        held.stop_renewal();
        let op = held.op_timeout();
        let lease = held.lease();
        // Inside the transaction: release (lease) or turn the session lock
        // into a transaction lock (advisory), checking it is still held.
        let checked = match held.hold {
            Hold::Lease => {
                let cfg = held.lock.config();
                let release = lease_release_sql(&cfg.table);
                let channel = notify_channel(&cfg.table);
                error::bounded("commit", op, async {
                    let row = sqlx::query(release)
                        .bind(lease.key.as_bytes())
                        .bind(stored(lease.token))
                        .bind(lease.owner.as_str().as_bytes())
                        .bind(channel)
                        .fetch_optional(&mut *tx)
                        .await;
                    Ok(match row {
                        Ok(Some(row)) => Ok(row.try_get::<i32, _>(0).unwrap_or(0)),
                        Ok(None) => Err(None),
                        Err(e) => Err(Some(e)),
                    })
                })
                .await
            }
            Hold::Advisory { hash } => {
                let sql = TransactionSql::new(&held.lock.config().table);
                error::bounded("commit", op, async {
                    let row = sqlx::query(sql.to_xact)
                        .bind(hash)
                        .bind(lease.key.as_bytes())
                        .bind(stored(lease.token))
                        .fetch_one(&mut *tx)
                        .await;
                    Ok(match row {
                        Ok(row) => {
                            let got: bool = row.try_get(0).unwrap_or(false);
                            let unlocked: bool = row.try_get(1).unwrap_or(false);
                            if got && unlocked {
                                Ok(0)
                            } else {
                                Err(None)
                            }
                        }
                        Err(e) => Err(Some(e)),
                    })
                })
                .await
            }
        };
        let left = match checked {
            Ok(Ok(left)) => left,
            Ok(Err(None)) => {
                if let Some(e) = snapshot_too_old(&mut tx, &held, &lease).await {
                    drop(tx);
                    let _ = held.end(true).await;
                    return Err(e);
                }
                let reason = match held.hold {
                    Hold::Lease => {
                        "the lease expired or was taken over before commit; nothing was committed"
                    }
                    Hold::Advisory { .. } => {
                        "the session no longer held the advisory lock at commit; nothing was \
                         committed"
                    }
                };
                drop(tx);
                // Not held any more, as far as the transaction can tell; a
                // release that finds it held after all frees it now.
                let _ = held.end(true).await;
                return Err(held.lease_lost(reason));
            }
            Ok(Err(Some(e))) => {
                drop(tx);
                // An advisory lock ends with its session; a lease does not.
                let lost = matches!(held.hold, Hold::Advisory { .. }) && session_ended(&e);
                let _ = held.end(true).await;
                return Err(if lost {
                    held.lease_lost(format!(
                        "the session holding the lock ended before commit ({}); nothing was \
                         committed",
                        why_ended(&e)
                    ))
                } else {
                    error::map(e)
                });
            }
            Err(e) => {
                drop(tx);
                let _ = held.end(true).await;
                return Err(e);
            }
        };
        let committed = error::bounded("commit", op, async { Ok(tx.commit().await) }).await;
        let outcome = match committed {
            Ok(Ok(())) => Ok(()),
            // The server answered: the transaction was rolled back.
            Ok(Err(e @ sqlx::Error::Database(_))) => Err(error::map(e)),
            Ok(Err(e)) => Err(unknown_outcome(&lease, &e.to_string())),
            Err(e) => Err(unknown_outcome(&lease, &e.to_string())),
        };
        // Committed: the release committed with it. Not committed (or not
        // known): the lease is released on its own — after the server
        // settled the transaction, since it waits for the row the
        // transaction's release locked.
        let ended = held.end(outcome.is_err()).await;
        if outcome.is_ok() && left == 0 {
            if let Some(e) = held.lock.engine().lease() {
                e.waiting.polling().freed(&lease.key);
            }
        }
        if let Err(e) = &ended {
            tracing::debug!(key = %lease.key, error = %e, "closing a committed lock transaction");
        }
        outcome
    }

    /// Rolls the business writes back and releases the lock.
    ///
    /// # Errors
    ///
    /// The writes are discarded in every case. [`Error::Backend`] when the
    /// lock could not be released (`lease`: the release statement failed;
    /// the lease then expires by its TTL).
    pub async fn rollback(self) -> Result<()> {
        let PostgresLockTransaction { tx, mut held } = self;
        held.stop_renewal();
        let op = held.op_timeout();
        let _ = error::bounded("rollback", op, async { Ok(tx.rollback().await) }).await;
        if let Hold::Advisory { hash } = held.hold {
            // The session lock is not transactional: given up explicitly,
            // so the key is free when this returns (closing the connection
            // frees it too, but the server finishes that on its own time).
            let pool = held.pool.clone();
            let _ = error::bounded("rollback", op, async move {
                let mut c = pool.acquire().await.db()?;
                sqlx::query("SELECT pg_advisory_unlock($1)")
                    .bind(hash)
                    .execute(&mut *c)
                    .await
                    .db()
            })
            .await;
        }
        held.end(true).await
    }
}

/// Whether `e` ended the session it came from (and an advisory lock
/// with it): connection failures, the operator interventions, and any
/// FATAL report — such as `idle_in_transaction_session_timeout` (25P03).
fn session_ended(e: &sqlx::Error) -> bool {
    if !error::leaves_session_usable(e) {
        return true;
    }
    e.as_database_error()
        .and_then(|d| d.try_downcast_ref::<sqlx::postgres::PgDatabaseError>())
        .is_some_and(|d| {
            matches!(
                d.severity(),
                sqlx::postgres::PgSeverity::Fatal | sqlx::postgres::PgSeverity::Panic
            )
        })
}

/// Why a session ended, for `LeaseLost`.
fn why_ended(e: &sqlx::Error) -> String {
    match error::sqlstate(e).as_deref() {
        Some("25P03") => "the server ended it: the transaction was idle for longer than the \
                          lock's ttl (idle_in_transaction_session_timeout)"
            .to_owned(),
        Some("57P01") => "it was terminated (pg_terminate_backend, a force_release)".to_owned(),
        _ => e.to_string(),
    }
}

/// `lease` under REPEATABLE READ or SERIALIZABLE: the release reads the
/// row as of the transaction's snapshot, so a lease renewed after the
/// snapshot looks expired (or, when it does not, the update is a
/// serialization failure). If the lease is in fact still current, that is
/// what is reported — retryable — rather than a lost lease.
async fn snapshot_too_old(
    tx: &mut Transaction<'static, Postgres>,
    held: &Held,
    lease: &Lease,
) -> Option<Error> {
    if !matches!(held.hold, Hold::Lease) {
        return None;
    }
    let op = held.op_timeout();
    let isolation = error::bounded("commit", op, async {
        sqlx::query("SELECT current_setting('transaction_isolation')")
            .fetch_one(&mut **tx)
            .await
            .db()?
            .try_get::<String, _>(0)
            .db()
    })
    .await
    .ok()?;
    if isolation == "read committed" {
        return None;
    }
    let current = held.lock.inspect(&lease.key).await.ok()??;
    (current.token == lease.token && current.owner == lease.owner).then(|| {
        Error::backend(
            error::BACKEND,
            true,
            format!(
                "the lease on `{}` was renewed after the snapshot of this {isolation} \
                 transaction, and PostgreSQL cannot release a row changed after the \
                 snapshot (a serialization conflict); nothing was committed. Run \
                 transaction-scoped locks at READ COMMITTED, keep {isolation} ones shorter \
                 than a third of the ttl, or use the advisory strategy",
                lease.key
            ),
        )
    })
}

fn unknown_outcome(lease: &Lease, cause: &str) -> Error {
    Error::backend(
        error::BACKEND,
        false,
        format!(
            "the connection failed during COMMIT of the transaction holding `{}` (token {}): \
             {cause}; whether its writes committed is unknown (with the lock's release or \
             not at all); the lock is released either way",
            lease.key, lease.token
        ),
    )
}

/// Renews `current` at a third of its TTL until aborted or lost; a lost
/// lease makes `commit` fail, so here it is only logged.
async fn keep_alive(lock: PostgresLock, current: Arc<Mutex<Lease>>) {
    loop {
        let lease = current.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let ttl = lease.ttl;
        let due = lease
            .deadline
            .checked_sub(ttl - ttl / 3)
            .unwrap_or_else(Instant::now);
        tokio::time::sleep_until(due).await;
        loop {
            match lock.extend(&lease, ttl).await {
                Ok(renewed) => {
                    *current.lock().unwrap_or_else(|p| p.into_inner()) = renewed;
                    break;
                }
                Err(e) if e.is_retryable() && !lease.is_expired() => {
                    tracing::warn!(key = %lease.key, error = %e, "renewing a transaction-scoped lease failed; retrying");
                    tokio::time::sleep((ttl / 10).min(Duration::from_millis(500))).await;
                }
                Err(e) => {
                    tracing::warn!(key = %lease.key, token = %lease.token, error = %e,
                        "a transaction-scoped lease was lost; its commit will fail");
                    return;
                }
            }
        }
    }
}

impl PostgresLock {
    /// Takes `key` inside a transaction whose connection the caller writes
    /// through; [`PostgresLockTransaction::commit`] commits those writes
    /// and releases the lock atomically. Waits as `opts` say, like
    /// `acquire`. Both strategies (see the crate docs, "Transaction-scoped
    /// locks", for how each holds the lock).
    ///
    /// Re-entry is refused: an owner already holding `key` gets
    /// [`Error::AlreadyHeld`].
    ///
    /// # Errors
    ///
    /// As `acquire` ([`Error::Timeout`] when the wait bound passes, …), and
    /// [`Error::Backend`] when the transaction's connection cannot be
    /// opened (the lock is then released).
    pub async fn lock_in_transaction(
        &self,
        key: &LockKey,
        opts: &LockOptions,
    ) -> Result<PostgresLockTransaction> {
        let opts = opts.to_builder().reentrant(false).build()?;
        match self.config().strategy {
            Strategy::Lease => self.lease_in_transaction(key, &opts).await,
            Strategy::Advisory => {
                let op = self.config().operation_timeout;
                let bound = self.config().connect_timeout.saturating_add(op);
                let call = self.advisory_in_transaction(key, &opts);
                match opts.wait() {
                    WaitPolicy::Forever => call.await,
                    WaitPolicy::NoWait => error::bounded("lock_in_transaction", bound, call).await,
                    WaitPolicy::Timeout(d) => {
                        error::bounded("lock_in_transaction", d.saturating_add(bound), call).await
                    }
                }
            }
        }
    }

    async fn lease_in_transaction(
        &self,
        key: &LockKey,
        opts: &LockOptions,
    ) -> Result<PostgresLockTransaction> {
        let cfg = self.config();
        let op = cfg.operation_timeout;
        let pool = transaction_pool(cfg, Strategy::Lease, opts.ttl());
        // Connected before the wait, so that connecting — a new server
        // process — is not part of the hold.
        let c = pool.acquire().await.db()?;
        let lease = match self.acquire(key, opts).await {
            Ok(lease) => lease,
            Err(e) => {
                drop(c);
                let _ = tokio::time::timeout(op, pool.close()).await;
                return Err(e);
            }
        };
        let current = Arc::new(Mutex::new(lease));
        let renewal = tokio::spawn(keep_alive(self.clone(), Arc::clone(&current)));
        let mut held = Held {
            lock: self.clone(),
            pool: pool.clone(),
            current,
            hold: Hold::Lease,
            renewal: Some(renewal),
            armed: true,
        };
        // Back to its pool (the only connection there) and out again
        // inside a transaction.
        drop(c);
        match error::bounded("lock_in_transaction", op, async { pool.begin().await.db() }).await {
            Ok(tx) => Ok(PostgresLockTransaction { tx, held }),
            Err(e) => {
                let _ = held.end(true).await;
                Err(e)
            }
        }
    }

    async fn advisory_in_transaction(
        &self,
        key: &LockKey,
        opts: &LockOptions,
    ) -> Result<PostgresLockTransaction> {
        let start = Instant::now();
        let cfg = self.config();
        let op = cfg.operation_timeout;
        let sql = advisory::Sql::new(&cfg.table);
        let own = TransactionSql::new(&cfg.table);
        let hash = advisory_key(&cfg.table, key);
        let owner = opts.owner_or_random();
        let pool = transaction_pool(cfg, Strategy::Advisory, opts.ttl());
        let mut c = Closing(Some(pool.acquire().await.db()?));

        register(&sql, c.conn()?, key, hash, &cfg.table, op).await?;
        let (t, sent) = match try_lock(&sql, c.conn()?, hash, key, &owner, opts, op).await? {
            Some(granted) => granted,
            None => {
                if let Some(o) = opts.owner() {
                    let mine = error::bounded("lock_in_transaction", op, async {
                        sqlx::query(sql.owner_holds.clone())
                            .bind(key.as_bytes())
                            .bind(o.as_str().as_bytes())
                            .fetch_optional(self.engine().pool())
                            .await
                            .db()
                    })
                    .await?;
                    if mine.is_some() {
                        return Err(Error::AlreadyHeld { key: key.clone() });
                    }
                }
                let deadline = wait_deadline(opts.wait(), start);
                let lock_timeout = match deadline {
                    None => "0".to_owned(),
                    Some(d) => {
                        let left = d.saturating_duration_since(Instant::now());
                        if left.is_zero() {
                            return Err(Error::Timeout {
                                key: key.clone(),
                                waited: start.elapsed(),
                            });
                        }
                        guc_ms(left)
                    }
                };
                wait_lock(
                    &sql,
                    &own,
                    c.conn()?,
                    hash,
                    key,
                    &owner,
                    opts,
                    lock_timeout,
                    op,
                    start,
                )
                .await?
            }
        };
        let lease = Lease::new(key.clone(), owner, token(t), opts.ttl(), sent);
        tracing::debug!(key = %key, token = t, "advisory lock acquired for a transaction");
        let mut held = Held {
            lock: self.clone(),
            pool: pool.clone(),
            current: Arc::new(Mutex::new(lease)),
            hold: Hold::Advisory { hash },
            renewal: None,
            armed: true,
        };
        // Back to its pool with the session (and its lock) intact, and out
        // again inside a transaction: the pool holds this one connection.
        // Had it been lost meanwhile, `commit` finds the session lock gone.
        c.keep();
        match error::bounded("lock_in_transaction", op, async { pool.begin().await.db() }).await {
            Ok(tx) => Ok(PostgresLockTransaction { tx, held }),
            Err(e) => {
                let _ = held.end(true).await;
                Err(e)
            }
        }
    }
}

/// Records `key` with its advisory hash ([`advisory::register`]); a hash
/// another key has is refused.
async fn register(
    sql: &advisory::Sql,
    c: &mut PgConnection,
    key: &LockKey,
    hash: i64,
    table: &TableName,
    op: Duration,
) -> Result<()> {
    let other = error::bounded("lock_in_transaction", op, async {
        advisory::register(sql, c, key, hash).await.db()
    })
    .await?;
    match other {
        None => Ok(()),
        Some(other) => Err(advisory::collision(table, key, hash, other)),
    }
}

/// One try; the token and when its statement was sent, if granted.
async fn try_lock(
    sql: &advisory::Sql,
    c: &mut PgConnection,
    hash: i64,
    key: &LockKey,
    owner: &Owner,
    opts: &LockOptions,
    op: Duration,
) -> Result<Option<(i64, Instant)>> {
    let sent = Instant::now();
    let row = error::bounded("lock_in_transaction", op, async {
        sqlx::query(sql.try_lock.clone())
            .bind(hash)
            .bind(key.as_bytes())
            .bind(owner.as_str().as_bytes())
            .bind(micros(opts.ttl()))
            .bind(opts.label().map(Label::as_str))
            .fetch_one(&mut *c)
            .await
            .db()
    })
    .await?;
    let got: bool = row.try_get(0).db()?;
    let t: Option<i64> = row.try_get(1).db()?;
    match (got, t) {
        (false, _) => Ok(None),
        (true, Some(t)) => Ok(Some((t, sent))),
        // Closing the connection (the caller drops it) gives the lock up.
        (true, None) => Err(vanished(key)),
    }
}

fn vanished(key: &LockKey) -> Error {
    Error::backend(
        error::BACKEND,
        true,
        format!("the registry row of `{key}` disappeared; try again"),
    )
}

/// Waits in the server's queue (bounded by `lock_timeout`), then takes
/// the token.
#[allow(clippy::too_many_arguments)]
async fn wait_lock(
    sql: &advisory::Sql,
    own: &TransactionSql,
    c: &mut PgConnection,
    hash: i64,
    key: &LockKey,
    owner: &Owner,
    opts: &LockOptions,
    lock_timeout: String,
    op: Duration,
    start: Instant,
) -> Result<(i64, Instant)> {
    // No statement bound on the wait itself (the session default may have
    // one); `take_token` restores it.
    error::bounded("lock_in_transaction", op, async {
        sqlx::query("SELECT set_config('statement_timeout', '0', false)")
            .execute(&mut *c)
            .await
            .db()
    })
    .await?;
    // The idle timeout after the grant stays the session's: the TTL.
    let waited = sqlx::query(sql.wait_lock.clone())
        .bind(hash)
        .bind(lock_timeout)
        .bind(guc_ms(opts.ttl()))
        .execute(&mut *c)
        .await;
    match waited {
        Ok(_) => {}
        Err(e) if error::is_lock_not_available(&e) => {
            return Err(Error::Timeout {
                key: key.clone(),
                waited: start.elapsed(),
            })
        }
        Err(e) => return Err(error::map(e)),
    }
    let sent = Instant::now();
    let row = error::bounded("lock_in_transaction", op, async {
        sqlx::query(own.take_token.clone())
            .bind(hash)
            .bind(key.as_bytes())
            .bind(owner.as_str().as_bytes())
            .bind(micros(opts.ttl()))
            .bind(opts.label().map(Label::as_str))
            .fetch_optional(&mut *c)
            .await
            .db()
    })
    .await?;
    match row {
        Some(row) => Ok((row.try_get::<i64, _>(0).db()?, sent)),
        None => Err(vanished(key)),
    }
}

/// Compile-time check: the transaction can move between tasks.
#[allow(dead_code)]
fn _assert_send() {
    fn ok<T: Send + 'static>() {}
    ok::<PostgresLockTransaction>();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statements_name_the_tables() {
        let table = TableName::new("jobs").unwrap();
        let release = lease_release_sql(&table);
        assert!(
            release.as_str().contains("UPDATE \"jobs\" SET"),
            "{}",
            release.as_str()
        );
        // Committed with the transaction, durably: no synchronous_commit off.
        assert!(!release.as_str().contains("synchronous_commit"));
        let a = TransactionSql::new(&table);
        assert!(a.take_token.as_str().contains("\"jobs_advisory\""));
        assert!(a.take_token.as_str().contains("nextval('\"jobs_token\"')"));
        assert!(a
            .to_xact
            .as_str()
            .starts_with("WITH x AS MATERIALIZED (SELECT pg_try_advisory_xact_lock($1)"));
    }
}
