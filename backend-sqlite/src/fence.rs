//! Resource-side fencing: the check that makes a fencing token protect
//! something, inside the caller's own transaction.
//!
//! A lock alone cannot stop a holder that was paused (GC, SIGSTOP, a slow
//! disk) past its TTL: it wakes up still believing it holds the lock and
//! writes, while the next holder — granted a higher token — writes too. The
//! protected resource has to refuse the late write. [`Fence::check`] does that
//! for data in SQLite: in the transaction that makes the business write, it
//! raises the highest token seen for a resource and answers whether the
//! caller's token is still current. Because the check and the write are one
//! transaction, they commit together or not at all: a stale holder's write
//! never lands, and a current holder's write never lands without its token
//! being recorded.
//!
//! ```
//! use std::sync::Arc;
//! use fenced_api::{DistributedLock, LockClient, MemoryLock};
//! use fenced_sqlite::fence::{Fence, FenceOutcome};
//! use fenced_sqlite::sqlx::{self, sqlite::SqlitePoolOptions};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let db = SqlitePoolOptions::new().max_connections(1).connect("sqlite::memory:").await?;
//! sqlx::query("CREATE TABLE orders (id INTEGER PRIMARY KEY, state TEXT)").execute(&db).await?;
//! let fence = Fence::default();                   // table `fenced_fences`
//! fence.create_table(&db).await?;                 // once (idempotent)
//!
//! // One write under the lock: the check and the write in one transaction.
//! async fn ship(db: &sqlx::SqlitePool, fence: &Fence, token: fenced_api::FencingToken, by: &str)
//!     -> Result<FenceOutcome, Box<dyn std::error::Error>> {
//!     let mut tx = db.begin_with("BEGIN IMMEDIATE").await?;
//!     let outcome = fence.check(&mut *tx, "order:1001", token).await?;
//!     if outcome.is_accepted() {
//!         sqlx::query("INSERT OR REPLACE INTO orders VALUES (1001, ?)")
//!             .bind(by)
//!             .execute(&mut *tx)
//!             .await?;
//!         tx.commit().await?;                     // the write and the token, together
//!     }                                           // Stale: dropping `tx` rolls back
//!     Ok(outcome)
//! }
//!
//! let store = Arc::new(MemoryLock::new());
//! let (node_a, node_b) = (LockClient::new(store.clone()), LockClient::new(store.clone()));
//! let a = node_a.acquire("order:1001").await?;
//! // A is paused past its TTL (here: evicted), and B is granted the lock.
//! store.force_release(&"order:1001".parse()?).await?;
//! let b = node_b.acquire("order:1001").await?;
//! assert!(ship(&db, &fence, b.token(), "B").await?.is_accepted());
//! // A wakes up and writes with its old token: refused, and its write rolled back.
//! assert_eq!(ship(&db, &fence, a.token(), "A").await?, FenceOutcome::Stale { highest: b.token() });
//! let state: String = sqlx::query_scalar("SELECT state FROM orders").fetch_one(&db).await?;
//! assert_eq!(state, "B");
//! # Ok(()) }
//! ```
//!
//! # How it works
//!
//! One row per resource in the fence table (default [`DEFAULT_FENCE_TABLE`]):
//!
//! ```sql
//! CREATE TABLE IF NOT EXISTS "fenced_fences" (
//!   resource TEXT NOT NULL PRIMARY KEY,   -- byte-exact (BINARY collation)
//!   token INTEGER NOT NULL,               -- the highest token accepted
//!   updated_at INTEGER NOT NULL           -- µs since the Unix epoch, SQLite's clock
//! ) STRICT, WITHOUT ROWID
//! ```
//!
//! [`Fence::check`] is one statement on the caller's connection:
//! `INSERT … ON CONFLICT (resource) DO UPDATE SET token = excluded.token …
//! WHERE excluded.token >= token RETURNING token`. It creates the row or
//! raises its token, never lowers it; a row comes back exactly when the
//! token was accepted. Only for a stale token is the highest then read (a
//! second statement). SQLite has one writer at a time, so the check and
//! everything after it in the transaction run with no other writer in
//! between.
//!
//! Open the transaction with `BEGIN IMMEDIATE`
//! (`pool.begin_with("BEGIN IMMEDIATE")`): a deferred transaction that
//! reads first and writes later fails with `SQLITE_BUSY` (a retryable
//! [`Error::Backend`]) when another connection wrote in between, instead of
//! waiting for the write lock.
//!
//! The check is only atomic with the write when the connection is **inside a
//! transaction**. In autocommit the fence row is raised and committed on its
//! own; the answer is still safe (never "accepted" for a stale token) but the
//! write that follows is not covered.
//!
//! A rolled-back transaction also rolls back its raise. To fence out the
//! previous holder as soon as a lock is granted, before the first write,
//! run one check in its own transaction right after acquiring.
//!
//! Tokens are stored as SQLite's signed 64-bit integers: a token above
//! `i64::MAX` is refused ([`Error::Unsupported`]). No built-in store comes
//! near it (Redis tokens, the largest, are server microseconds, about 2^51).
//!
//! A resource name stands for **one sequence of tokens**: fence it with the
//! tokens of one lock key of one store only. Tokens of different keys (or
//! stores) are unrelated numbers, so a resource fenced by two of them would
//! refuse writes that are current and accept ones that are stale. Name the
//! resource after the lock key that guards it.
//!
//! # Keeping the token on the business row instead
//!
//! Where every write to a resource touches one row, the row can carry the
//! token itself and no fence table is needed — the conditional `UPDATE` is
//! the check (0 rows changed ⇒ stale):
//!
//! ```sql
//! ALTER TABLE orders ADD COLUMN fence_token INTEGER NOT NULL DEFAULT 0;
//! UPDATE orders SET state = ?1, fence_token = ?2 WHERE id = ?3 AND fence_token <= ?2;
//! ```
//!
//! SQLite counts every row the `WHERE` matched, changed or not, so
//! `rows_affected()` is 1 for an accepted write (an equal token included)
//! and 0 for a stale token or a missing row. `tests/fence.rs` runs this form
//! beside the fence table.
//!
//! The API is the same as `fenced_mysql::fence`, so code moves between the
//! two with its connection type.
//!
//! [`Error::Backend`]: fenced_api::Error::Backend
//! [`Error::Unsupported`]: fenced_api::Error::Unsupported

use std::{fmt, sync::Arc};

use fenced_api::{Error, FencingToken, LockKey, Result};
use sqlx::{Acquire, AssertSqlSafe, Row, Sqlite, SqliteConnection};

use crate::{config::TableName, error};

/// The fence table [`Fence::default`] uses.
pub const DEFAULT_FENCE_TABLE: &str = "fenced_fences";

/// SQLite's clock in µs since the Unix epoch, as the lock table keeps it
/// (millisecond resolution, exact multiples of 1000).
const NOW_US: &str = "(CAST(ROUND(unixepoch('subsec') * 1000) AS INTEGER) * 1000)";

/// The verdict of a fencing check (shared by every fencing helper).
pub use fenced_api::fence::FenceOutcome;

/// The fence table and its statements. Cheap to clone; holds no connection.
#[derive(Clone)]
pub struct Fence {
    table: TableName,
    raise: Arc<str>,
    read: Arc<str>,
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
        let raise = format!(
            "INSERT INTO {t} (resource, token, updated_at) VALUES (?1, ?2, {NOW_US}) \
             ON CONFLICT (resource) DO UPDATE SET token = excluded.token, \
             updated_at = excluded.updated_at WHERE excluded.token >= {t}.token \
             RETURNING token"
        );
        Fence {
            raise: raise.into(),
            read: format!("SELECT token FROM {t} WHERE resource = ?1").into(),
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
    /// # Errors
    ///
    /// [`Error::Config`] when a table of that name exists with other
    /// columns; [`Error::Backend`] when SQLite fails (read-only file, busy).
    pub async fn create_table<'c, A>(&self, db: A) -> Result<()>
    where
        A: Acquire<'c, Database = Sqlite>,
    {
        let mut conn = db.acquire().await.map_err(error::map)?;
        let t = self.table.quoted("");
        sqlx::query(AssertSqlSafe(format!(
            "CREATE TABLE IF NOT EXISTS {t} (\
             resource TEXT NOT NULL PRIMARY KEY, \
             token INTEGER NOT NULL, \
             updated_at INTEGER NOT NULL) STRICT, WITHOUT ROWID"
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
        .map_err(|e| match &e {
            sqlx::Error::Database(db) if db.message().contains("no such column") => {
                Error::config(format!(
                    "the table `{}` exists but is not a fence table ({e}); choose another name \
                     with `Fence::new`",
                    self.table
                ))
            }
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
    /// write (`&mut *tx`), before the write; on `Stale`, roll back.
    ///
    /// # Errors
    ///
    /// * [`Error::InvalidKey`] when `resource` breaks the rules of
    ///   [`LockKey`] (empty, over 255 bytes, control characters),
    ///   [`Error::InvalidOptions`] for token 0, which no store grants, and
    ///   [`Error::Unsupported`] for a token above `i64::MAX` — all before any
    ///   I/O;
    /// * [`Error::Config`] when the fence table does not exist;
    /// * [`Error::Backend`] when SQLite fails — retryable when busy.
    pub async fn check(
        &self,
        conn: &mut SqliteConnection,
        resource: &str,
        token: FencingToken,
    ) -> Result<FenceOutcome> {
        let (resource, t) = validate(resource, token)?;
        let raised: Option<i64> = sqlx::query(AssertSqlSafe(self.raise.clone()))
            .bind(resource.as_str())
            .bind(t)
            .fetch_optional(&mut *conn)
            .await
            .and_then(|row| row.map(|r| r.try_get(0)).transpose())
            .map_err(|e| self.map(e))?;
        // RETURNING yields the row only when it was inserted or updated,
        // i.e. exactly when the token passed the `WHERE`.
        let highest = match raised {
            Some(h) => h,
            None => sqlx::query(AssertSqlSafe(self.read.clone()))
                .bind(resource.as_str())
                .fetch_optional(&mut *conn)
                .await
                .and_then(|row| row.map(|r| r.try_get::<i64, _>(0)).transpose())
                .map_err(|e| self.map(e))?
                .unwrap_or(0),
        };
        outcome(&self.table, &resource, token, raised.is_some(), highest)
    }

    /// The highest token accepted for `resource`, if any.
    ///
    /// # Errors
    ///
    /// As [`check`](Self::check), without the token.
    pub async fn highest<'c, A>(&self, db: A, resource: &str) -> Result<Option<FencingToken>>
    where
        A: Acquire<'c, Database = Sqlite>,
    {
        let resource = LockKey::new(resource)?;
        let mut conn = db.acquire().await.map_err(error::map)?;
        let token: Option<i64> = sqlx::query(AssertSqlSafe(self.read.clone()))
            .bind(resource.as_str())
            .fetch_optional(&mut *conn)
            .await
            .and_then(|row| row.map(|r| r.try_get(0)).transpose())
            .map_err(|e| self.map(e))?;
        // Only `check` writes the table, and it writes tokens >= 1.
        Ok(token
            .and_then(|t| u64::try_from(t).ok())
            .map(FencingToken::new))
    }

    /// The crate's mapping, with the fix for a missing table named.
    fn map(&self, e: sqlx::Error) -> Error {
        if let sqlx::Error::Database(db) = &e {
            if db.message().contains("no such table") {
                return Error::config(format!(
                    "the fence table `{}` does not exist ({e}); create it once with \
                     `Fence::create_table`",
                    self.table
                ));
            }
        }
        error::map(e)
    }
}

/// Resource names follow the lock-key rules (they often are the lock key),
/// so one validated name works for both; token 0 is an unset token.
fn validate(resource: &str, token: FencingToken) -> Result<(LockKey, i64)> {
    let resource = LockKey::new(resource)?;
    fenced_api::fence::check_token(token)?;
    let t = i64::try_from(token.get()).map_err(|_| Error::Unsupported {
        backend: error::BACKEND,
        what: format!(
            "fencing token {token} in a fence table: SQLite integers are signed 64-bit, at most {}",
            i64::MAX
        ),
    })?;
    Ok((resource, t))
}

fn outcome(
    table: &TableName,
    resource: &LockKey,
    token: FencingToken,
    raised: bool,
    highest: i64,
) -> Result<FenceOutcome> {
    let t = token.get();
    match u64::try_from(highest) {
        Ok(h) if raised && h == t => Ok(FenceOutcome::Accepted),
        Ok(h) if !raised && h > t => Ok(FenceOutcome::Stale {
            highest: FencingToken::new(h),
        }),
        // The statement just ran under SQLite's write lock: only something
        // else writing the table (a trigger, a manual UPDATE) gets here.
        _ => Err(Error::backend(
            error::BACKEND,
            false,
            format!(
                "the fence row of `{resource}` in `{table}` holds token {highest} right after \
                 token {token} was checked; is something else writing that table?"
            ),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outcome_is_decided_by_the_statement() {
        let t = TableName::new("f").unwrap();
        let r = LockKey::new("r").unwrap();
        assert_eq!(
            outcome(&t, &r, FencingToken::new(5), true, 5).unwrap(),
            FenceOutcome::Accepted
        );
        assert_eq!(
            outcome(&t, &r, FencingToken::new(5), false, 9).unwrap(),
            FenceOutcome::Stale {
                highest: FencingToken::new(9)
            }
        );
        assert!(outcome(&t, &r, FencingToken::new(5), false, 5).is_err());
        assert!(outcome(&t, &r, FencingToken::new(5), true, 9).is_err());
        assert!(outcome(&t, &r, FencingToken::new(5), false, 0).is_err());
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
        assert!(matches!(
            validate("r", FencingToken::new(i64::MAX as u64 + 1)),
            Err(Error::Unsupported { .. })
        ));
        assert!(validate("r", FencingToken::new(i64::MAX as u64)).is_ok());
        assert_eq!(Fence::default().table().as_str(), DEFAULT_FENCE_TABLE);
    }
}
