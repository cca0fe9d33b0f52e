//! Resource-side fencing: the check that makes a fencing token protect
//! something, inside the caller's own transaction.
//!
//! A lock alone cannot stop a holder that was paused (GC, SIGSTOP, a slow
//! network) past its TTL: it wakes up still believing it holds the lock and
//! writes, while the next holder — granted a higher token — writes too. The
//! protected resource has to refuse the late write. [`Fence::check`] does that
//! for data in MySQL / MariaDB: in the transaction that makes the business
//! write, it raises the highest token seen for a resource and answers whether
//! the caller's token is still current. Because the check and the write are
//! one transaction, they commit together or not at all: a stale holder's
//! write never lands, and a current holder's write never lands without its
//! token being recorded.
//!
//! ```no_run
//! use fenced_api::LockClient;
//! use fenced_mysql::fence::{Fence, FenceOutcome};
//! use fenced_mysql::sqlx;
//!
//! # async fn run(client: LockClient) -> Result<(), Box<dyn std::error::Error>> {
//! let db = sqlx::MySqlPool::connect("mysql://app:secret@db.internal:3306/app").await?;
//! let fence = Fence::default();                   // table `fenced_fences`
//! fence.create_table(&db).await?;                 // once, at deploy time (idempotent)
//!
//! let guard = client.acquire("order:1001").await?;
//! // … the process may be paused here for longer than the TTL …
//! let mut tx = db.begin().await?;
//! match fence.check(&mut *tx, "order:1001", guard.token()).await? {
//!     FenceOutcome::Accepted => {
//!         sqlx::query("UPDATE orders SET state = 'shipped' WHERE id = 1001")
//!             .execute(&mut *tx)
//!             .await?;
//!         tx.commit().await?;                     // the write and the token, together
//!     }
//!     FenceOutcome::Stale { highest } => {
//!         // A newer holder (token `highest`) has written: ours must not land.
//!         tx.rollback().await?;
//!     }
//! }
//! # Ok(()) }
//! ```
//!
//! # How it works
//!
//! One row per resource in the fence table (default [`DEFAULT_FENCE_TABLE`]):
//!
//! ```sql
//! CREATE TABLE IF NOT EXISTS `fenced_fences` (
//!   resource VARBINARY(255) NOT NULL PRIMARY KEY,  -- byte-exact, like lock keys
//!   token BIGINT UNSIGNED NOT NULL,                 -- the highest token accepted
//!   updated_at DATETIME(6) NOT NULL                 -- UTC, the server's clock
//! ) ENGINE=InnoDB
//! ```
//!
//! [`Fence::check`] runs two statements on the caller's connection:
//!
//! 1. `INSERT … ON DUPLICATE KEY UPDATE token = GREATEST(token, ?)`: creates
//!    the row or raises its token, never lowers it, and takes the row's
//!    exclusive lock until the transaction ends. Writers of one resource are
//!    therefore serialised: a second check waits for the first transaction.
//! 2. `SELECT token … FOR UPDATE`: the highest token now. Equal to the
//!    caller's: accepted; higher: stale. It is a locking read on purpose: a
//!    plain `SELECT` under REPEATABLE READ may answer from a snapshot older
//!    than the upsert's current read (when the upsert changed nothing).
//!
//! Call the check **before** the business writes of the transaction: it then
//! orders whole transactions per resource. Checking after writing is just as
//! correct, but two writers then take the business rows and the fence row in
//! opposite orders and one becomes a deadlock victim (a retryable
//! [`Error::Backend`]).
//!
//! The check is only atomic with the write when the connection is **inside a
//! transaction** (`pool.begin()`, or [`RowLockTransaction::connection`]). In
//! autocommit the fence row is raised and committed on its own; the answer is
//! still safe (never "accepted" for a stale token) but the write that follows
//! is not covered.
//!
//! A rolled-back transaction also rolls back its raise. To fence out the
//! previous holder as soon as a lock is granted, before the first write,
//! run one check in its own transaction right after acquiring.
//!
//! # Keeping the token on the business row instead
//!
//! Where every write to a resource touches one row, the row can carry the
//! token itself and no fence table is needed — the conditional `UPDATE` is
//! the check (0 rows changed ⇒ stale):
//!
//! ```sql
//! ALTER TABLE orders ADD COLUMN fence_token BIGINT UNSIGNED NOT NULL DEFAULT 0;
//! UPDATE orders SET state = ?, fence_token = ? WHERE id = ? AND fence_token <= ?;
//! ```
//!
//! Bind the token to both placeholders. Decide from the number of rows
//! *matched*: sqlx connects with `CLIENT_FOUND_ROWS`, so `rows_affected()` is
//! 1 for an accepted write even when no value changed (an equal token writing
//! the same state again) and 0 only when the row is missing or the token is
//! stale; without that flag (other clients), MySQL counts only changed rows.
//! `tests/fence.rs` runs this form beside the fence table.
//!
//! # Portability
//!
//! The statements run unchanged on MariaDB 10.3+ and MySQL 8.0+. The token is
//! bound twice rather than read back with `VALUES(token)`, which MySQL 8.0.20+
//! deprecates (it still works, with a warning) and whose replacement, the
//! row alias `… AS new`, MariaDB does not have.
//!
//! Creating the table is explicit ([`Fence::create_table`]), not part of
//! `fenced migrate`: the fence table must live in the **business database**,
//! next to the rows it protects, which is often not the database that holds
//! the locks, and one fence table serves every lock namespace.
//!
//! A resource name stands for **one sequence of tokens**: fence it with the
//! tokens of one lock key of one store only. Tokens of different keys (or
//! stores) are unrelated numbers, so a resource fenced by two of them would
//! refuse writes that are current and accept ones that are stale. Name the
//! resource after the lock key that guards it.
//!
//! [`Error::Backend`]: fenced_api::Error::Backend
//! [`RowLockTransaction::connection`]: crate::RowLockTransaction::connection

use std::{fmt, sync::Arc};

use fenced_api::{Error, FencingToken, LockKey, Result};
use sqlx::{Acquire, AssertSqlSafe, MySql, MySqlConnection, Row};

use crate::{config::TableName, error};

/// The fence table [`Fence::default`] uses.
///
/// Not `fenced_fence`: every lock namespace `<base>` already owns a
/// `<base>_fence` table (row_lock's token counter), so that name would be a
/// lock table of the namespace `fenced`.
pub const DEFAULT_FENCE_TABLE: &str = "fenced_fences";

/// The verdict of a fencing check (shared by every fencing helper).
pub use fenced_api::fence::FenceOutcome;

/// The fence table and its statements. Cheap to clone; holds no connection.
#[derive(Clone)]
pub struct Fence {
    table: TableName,
    raise: Arc<str>,
    read: Arc<str>,
    read_locked: Arc<str>,
}

impl fmt::Debug for Fence {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Fence")
            .field("table", &self.table.as_str())
            .finish_non_exhaustive()
    }
}

impl Default for Fence {
    /// The fence in [`DEFAULT_FENCE_TABLE`].
    fn default() -> Self {
        let table = TableName::new(DEFAULT_FENCE_TABLE)
            .unwrap_or_else(|_| unreachable!("the default fence table name is valid"));
        Fence::with_table(table)
    }
}

impl Fence {
    /// A fence kept in `table` (the rules of [`TableName`]).
    ///
    /// # Errors
    ///
    /// [`Error::Config`] for an invalid table name.
    pub fn new(table: &str) -> Result<Self> {
        Ok(Fence::with_table(TableName::new(table)?))
    }

    fn with_table(table: TableName) -> Self {
        let t = table.quoted("");
        // `updated_at` first: assignments run left to right, so its
        // condition still sees the old token (and under MariaDB's
        // SIMULTANEOUS_ASSIGNMENT it sees the old one anyway).
        let raise = format!(
            "INSERT INTO {t} (resource, token, updated_at) VALUES (?, ?, UTC_TIMESTAMP(6)) \
             ON DUPLICATE KEY UPDATE updated_at = IF(? >= token, UTC_TIMESTAMP(6), updated_at), \
             token = GREATEST(token, ?)"
        );
        Fence {
            raise: raise.into(),
            read: format!("SELECT token FROM {t} WHERE resource = ?").into(),
            read_locked: format!("SELECT token FROM {t} WHERE resource = ? FOR UPDATE").into(),
            table,
        }
    }

    /// The table's name.
    pub fn table(&self) -> &TableName {
        &self.table
    }

    /// Creates the fence table if it does not exist (idempotent), and checks
    /// that a table of that name is a fence table.
    ///
    /// DDL commits any open transaction on MySQL: run it at deploy time, on
    /// a pool or a plain connection, not inside a business transaction.
    ///
    /// # Errors
    ///
    /// [`Error::Config`] when a table of that name exists with other
    /// columns; [`Error::Backend`] when the server fails or refuses (no
    /// `CREATE` privilege).
    pub async fn create_table<'c, A>(&self, db: A) -> Result<()>
    where
        A: Acquire<'c, Database = MySql>,
    {
        let mut conn = db.acquire().await.map_err(error::map)?;
        let t = self.table.quoted("");
        sqlx::query(AssertSqlSafe(format!(
            "CREATE TABLE IF NOT EXISTS {t} (\
             resource VARBINARY(255) NOT NULL, \
             token BIGINT UNSIGNED NOT NULL, \
             updated_at DATETIME(6) NOT NULL, \
             PRIMARY KEY (resource)) ENGINE=InnoDB"
        )))
        .execute(&mut *conn)
        .await
        .map_err(|e| self.map(e))?;
        // `IF NOT EXISTS` accepts any table of that name; a foreign one
        // would only fail later, at the first check.
        sqlx::query(AssertSqlSafe(format!(
            "SELECT resource, token, updated_at FROM {t} LIMIT 0"
        )))
        .execute(&mut *conn)
        .await
        .map_err(|e| match error::number(&e) {
            Some(ER_BAD_FIELD) => Error::config(format!(
                "the table `{}` exists but is not a fence table ({e}); choose another name with \
                 `Fence::new`",
                self.table
            )),
            _ => self.map(e),
        })?;
        Ok(())
    }

    /// Records `token` for `resource` and answers whether it is current:
    /// [`FenceOutcome::Accepted`] when it is at least the highest token seen
    /// (equal included: the same holder writing twice), otherwise
    /// [`FenceOutcome::Stale`] with the highest. A resource never seen
    /// accepts any token.
    ///
    /// Run it on the connection of the transaction that makes the business
    /// write (`&mut *tx`), before the write; on `Stale`, roll back. The fence
    /// row stays locked until that transaction ends.
    ///
    /// # Errors
    ///
    /// * [`Error::InvalidKey`] when `resource` breaks the rules of
    ///   [`LockKey`] (empty, over 255 bytes, control characters), and
    ///   [`Error::InvalidOptions`] for token 0, which no store grants —
    ///   both before any I/O;
    /// * [`Error::Config`] when the fence table does not exist;
    /// * [`Error::Backend`] when the server fails — retryable for lock wait
    ///   timeouts and deadlocks (the transaction is then rolled back on the
    ///   server: start it again).
    pub async fn check(
        &self,
        conn: &mut MySqlConnection,
        resource: &str,
        token: FencingToken,
    ) -> Result<FenceOutcome> {
        let resource = validate(resource, token)?;
        let t = token.get();
        sqlx::query(AssertSqlSafe(self.raise.clone()))
            .bind(resource.as_bytes())
            .bind(t)
            .bind(t)
            .bind(t)
            .execute(&mut *conn)
            .await
            .map_err(|e| self.map(e))?;
        // Decided from the row, not from the statement's affected-rows
        // count: that count (0, 1 or 2, and 1 vs 0 for "unchanged" depending
        // on CLIENT_FOUND_ROWS) cannot tell an equal token from a stale one.
        let highest: u64 = sqlx::query(AssertSqlSafe(self.read_locked.clone()))
            .bind(resource.as_bytes())
            .fetch_one(&mut *conn)
            .await
            .and_then(|row| row.try_get(0))
            .map_err(|e| self.map(e))?;
        outcome(&self.table, &resource, token, highest)
    }

    /// The highest token accepted for `resource`, if any (a plain read).
    ///
    /// # Errors
    ///
    /// As [`check`](Self::check), without the token.
    pub async fn highest<'c, A>(&self, db: A, resource: &str) -> Result<Option<FencingToken>>
    where
        A: Acquire<'c, Database = MySql>,
    {
        let resource = LockKey::new(resource)?;
        let mut conn = db.acquire().await.map_err(error::map)?;
        let token: Option<u64> = sqlx::query(AssertSqlSafe(self.read.clone()))
            .bind(resource.as_bytes())
            .fetch_optional(&mut *conn)
            .await
            .and_then(|row| row.map(|r| r.try_get(0)).transpose())
            .map_err(|e| self.map(e))?;
        Ok(token.map(FencingToken::new))
    }

    /// The crate's mapping, with the fix for a missing table named.
    fn map(&self, e: sqlx::Error) -> Error {
        if error::number(&e) == Some(error::code::NO_SUCH_TABLE) {
            return Error::config(format!(
                "the fence table `{}` does not exist ({e}); create it once with \
                 `Fence::create_table`",
                self.table
            ));
        }
        error::map(e)
    }
}

/// ER_BAD_FIELD_ERROR: unknown column.
const ER_BAD_FIELD: u16 = 1054;

/// Resource names follow the lock-key rules (they often are the lock key),
/// so one validated name works for both; token 0 is an unset token.
fn validate(resource: &str, token: FencingToken) -> Result<LockKey> {
    let resource = LockKey::new(resource)?;
    fenced_api::fence::check_token(token)?;
    Ok(resource)
}

fn outcome(
    table: &TableName,
    resource: &LockKey,
    token: FencingToken,
    highest: u64,
) -> Result<FenceOutcome> {
    match highest.cmp(&token.get()) {
        std::cmp::Ordering::Equal => Ok(FenceOutcome::Accepted),
        std::cmp::Ordering::Greater => Ok(FenceOutcome::Stale {
            highest: FencingToken::new(highest),
        }),
        // The raise just ran under the row lock: only something else
        // writing the table (a trigger, a manual UPDATE) can get here.
        std::cmp::Ordering::Less => Err(Error::backend(
            error::BACKEND,
            false,
            format!(
                "the fence row of `{resource}` in `{table}` holds token {highest} right after \
                 token {token} was recorded; is something else lowering tokens in that table?"
            ),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_table_is_no_lock_table_name() {
        assert_eq!(Fence::default().table().as_str(), DEFAULT_FENCE_TABLE);
        assert!(TableName::new(DEFAULT_FENCE_TABLE).is_ok());
        for suffix in ["_fence", "_rows", "_live", "_optimistic", "_migrations"] {
            assert!(!DEFAULT_FENCE_TABLE.ends_with(suffix), "{suffix}");
        }
    }

    #[test]
    fn statements_never_use_values_function() {
        let f = Fence::new("orders_fence").unwrap();
        assert!(f.raise.contains("`orders_fence`"));
        assert!(!f.raise.contains("VALUES(token)"));
        assert!(f.read_locked.ends_with("FOR UPDATE"));
    }

    #[test]
    fn outcome_is_decided_by_the_highest_token() {
        let t = TableName::new("f").unwrap();
        let r = LockKey::new("r").unwrap();
        assert_eq!(
            outcome(&t, &r, FencingToken::new(5), 5).unwrap(),
            FenceOutcome::Accepted
        );
        assert_eq!(
            outcome(&t, &r, FencingToken::new(5), 9).unwrap(),
            FenceOutcome::Stale {
                highest: FencingToken::new(9)
            }
        );
        assert!(outcome(&t, &r, FencingToken::new(5), 4).is_err());
    }

    #[test]
    fn bad_input_is_refused_before_io() {
        let ok = FencingToken::new(1);
        assert!(matches!(validate("", ok), Err(Error::InvalidKey { .. })));
        assert!(matches!(
            validate(&"x".repeat(256), ok),
            Err(Error::InvalidKey { .. })
        ));
        assert!(matches!(
            validate("r", FencingToken::new(0)),
            Err(Error::InvalidOptions { .. })
        ));
        assert!(validate(&"x".repeat(255), FencingToken::new(u64::MAX)).is_ok());
    }
}
