//! Resource-side fencing in SQL: one row per resource holding the highest
//! token accepted, raised and checked in the caller's own transaction.
//!
//! One implementation for every SQL store; each backend names it for its
//! store (`fenced_mysql::fence::Fence`, `fenced_sqlite::fence::Fence`) and
//! documents there how the check runs on that store and how to use it.
//!
//! A check never answers [`FenceOutcome::Accepted`] for a token below the
//! highest committed one, whatever the snapshot of the caller's transaction.
//! How each store keeps an old snapshot from hiding a newer token:
//!
//! * MySQL/MariaDB: the token is read back with a locking read (`FOR
//!   UPDATE`), which reads the latest committed row under REPEATABLE READ
//!   too; an old snapshot gets `Stale`.
//! * SQLite: one writer at a time; a deferred transaction that read before
//!   another connection wrote cannot write (busy, retryable).
//! * PostgreSQL: the upsert works on the latest committed row under READ
//!   COMMITTED (an old snapshot gets `Stale`); under REPEATABLE READ and
//!   SERIALIZABLE it fails with a serialization failure (SQLSTATE `40001`,
//!   retryable where the backend says so) when the row changed after the
//!   transaction's snapshot.

use std::{fmt, marker::PhantomData};

use fenced_api::{Error, FencingToken, LockKey, Result};
use sqlx::{Acquire, Database};

use crate::{
    dialect::engine::{Engine, Entry, FenceSql},
    Dialect, SqlBackend, TableName,
};

/// The verdict of a fencing check (shared by every fencing helper).
pub use fenced_api::fence::FenceOutcome;

/// The fence table [`Fence::default`] uses.
///
/// Not `fenced_fence`: in MySQL every lock namespace `<base>` owns a
/// `<base>_fence` table (row_lock's token counter), so that name would be a
/// lock table of the namespace `fenced`.
pub const DEFAULT_FENCE_TABLE: &str = "fenced_fences";

/// The fence table of backend `B` and its statements. Cheap to clone; holds
/// no connection.
pub struct Fence<B: SqlBackend> {
    table: TableName<B::Db>,
    sql: FenceSql,
    backend: PhantomData<fn() -> B>,
}

impl<B: SqlBackend> Clone for Fence<B> {
    fn clone(&self) -> Self {
        Fence {
            table: self.table.clone(),
            sql: self.sql.clone(),
            backend: PhantomData,
        }
    }
}

impl<B: SqlBackend> fmt::Debug for Fence<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Fence")
            .field("table", &self.table.as_str())
            .finish_non_exhaustive()
    }
}

impl<B: SqlBackend> Default for Fence<B> {
    /// The fence in [`DEFAULT_FENCE_TABLE`].
    fn default() -> Self {
        let table = TableName::new(DEFAULT_FENCE_TABLE)
            .unwrap_or_else(|_| unreachable!("the default fence table name is valid"));
        Fence::with_table(table)
    }
}

/// The connection of `B`'s store.
type Connection<B> = <<B as SqlBackend>::Db as Database>::Connection;

impl<B: SqlBackend> Fence<B> {
    /// A fence kept in `table` (the rules of [`TableName`]).
    ///
    /// # Errors
    ///
    /// [`Error::Config`] for an invalid table name.
    pub fn new(table: &str) -> Result<Self> {
        Ok(Fence::with_table(TableName::new(table)?))
    }

    fn with_table(table: TableName<B::Db>) -> Self {
        Fence {
            sql: B::Db::fence_sql(&table.quoted("")),
            table,
            backend: PhantomData,
        }
    }

    /// The table's name.
    pub fn table(&self) -> &TableName<B::Db> {
        &self.table
    }

    /// Creates the fence table if it does not exist (idempotent), and checks
    /// that a table of that name is a fence table.
    ///
    /// # Errors
    ///
    /// [`Error::Config`] when a table of that name exists with other
    /// columns; [`Error::Backend`] when the store fails or refuses.
    pub async fn create_table<'c, A>(&self, db: A) -> Result<()>
    where
        A: Acquire<'c, Database = B::Db>,
    {
        let mut conn = db.acquire().await.map_err(B::map)?;
        B::Db::execute(&mut *conn, self.sql.create.clone())
            .await
            .map_err(|e| self.map(e))?;
        // `IF NOT EXISTS` accepts any table of that name; a foreign one
        // would only fail later, at the first check.
        let probe = format!(
            "SELECT resource, token, updated_at FROM {} LIMIT 0",
            self.table.quoted("")
        );
        B::Db::execute(&mut *conn, probe).await.map_err(|e| {
            if B::is_missing_column(&e) {
                Error::config(format!(
                    "the table `{}` exists but is not a fence table ({e}); choose another name \
                     with `Fence::new`",
                    self.table
                ))
            } else {
                self.map(e)
            }
        })
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
    ///   [`Error::Unsupported`] for a token above the store's largest
    ///   integer ([`Dialect::MAX_TOKEN`]) — all before any I/O;
    /// * [`Error::Config`] when the fence table does not exist;
    /// * [`Error::Backend`] when the store fails — retryable where the
    ///   backend says so (a lock wait timeout, a deadlock, a busy file).
    pub async fn check(
        &self,
        conn: &mut Connection<B>,
        resource: &str,
        token: FencingToken,
    ) -> Result<FenceOutcome> {
        let resource = validate::<B>(resource, token)?;
        let entry = Entry {
            resource: resource.as_str(),
            token: token.get(),
        };
        let raised = B::Db::fence_raise(conn, &self.sql, entry)
            .await
            .map_err(|e| self.map(e))?;
        outcome::<B>(&self.table, &resource, token, raised.stored, raised.highest)
    }

    /// The highest token accepted for `resource`, if any (a plain read).
    ///
    /// # Errors
    ///
    /// As [`check`](Self::check), without the token.
    pub async fn highest<'c, A>(&self, db: A, resource: &str) -> Result<Option<FencingToken>>
    where
        A: Acquire<'c, Database = B::Db>,
    {
        let resource = LockKey::new(resource)?;
        let mut conn = db.acquire().await.map_err(B::map)?;
        let token = B::Db::fence_read(&mut *conn, &self.sql.read, resource.as_str())
            .await
            .map_err(|e| self.map(e))?;
        // Only `check` writes the table, and it writes tokens >= 1.
        Ok(token
            .and_then(|t| u64::try_from(t).ok())
            .map(FencingToken::new))
    }

    /// The backend's mapping, with the fix for a missing table named.
    fn map(&self, e: sqlx::Error) -> Error {
        if B::is_missing_table(&e) {
            return Error::config(format!(
                "the fence table `{}` does not exist ({e}); create it once with \
                 `Fence::create_table`",
                self.table
            ));
        }
        B::map(e)
    }
}

/// Resource names follow the lock-key rules (they often are the lock key),
/// so one validated name works for both; token 0 is an unset token.
fn validate<B: SqlBackend>(resource: &str, token: FencingToken) -> Result<LockKey> {
    let resource = LockKey::new(resource)?;
    fenced_api::fence::check_token(token)?;
    let max = <B::Db as Dialect>::MAX_TOKEN;
    if token.get() > max {
        return Err(Error::Unsupported {
            backend: B::BACKEND,
            what: format!(
                "fencing token {token} in a fence table: {} integers are signed 64-bit, at most {max}",
                <B::Db as Database>::NAME
            ),
        });
    }
    Ok(resource)
}

/// The verdict from what the statement stored (`None`: it cannot say) and
/// the highest token right after it.
fn outcome<B: SqlBackend>(
    table: &TableName<B::Db>,
    resource: &LockKey,
    token: FencingToken,
    stored: Option<bool>,
    highest: i128,
) -> Result<FenceOutcome> {
    let t = i128::from(token.get());
    if highest == t && stored != Some(false) {
        return Ok(FenceOutcome::Accepted);
    }
    match u64::try_from(highest) {
        Ok(h) if highest > t && stored != Some(true) => Ok(FenceOutcome::Stale {
            highest: FencingToken::new(h),
        }),
        // The statement just ran holding the row (or the file's write lock):
        // only something else writing the table (a trigger, a manual UPDATE)
        // gets here.
        _ => Err(Error::backend(
            B::BACKEND,
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
    use crate::dialect::Plain;

    #[test]
    fn outcome_is_decided_by_the_statement_and_the_highest_token() {
        let t = TableName::<sqlx::Sqlite>::new("f").unwrap();
        let r = LockKey::new("r").unwrap();
        let five = FencingToken::new(5);
        let outcome = outcome::<Plain<sqlx::Sqlite>>;
        let stale = FenceOutcome::Stale {
            highest: FencingToken::new(9),
        };
        // A statement that says whether it stored the token.
        assert_eq!(
            outcome(&t, &r, five, Some(true), 5).unwrap(),
            FenceOutcome::Accepted
        );
        assert_eq!(outcome(&t, &r, five, Some(false), 9).unwrap(), stale);
        assert!(outcome(&t, &r, five, Some(false), 5).is_err());
        assert!(outcome(&t, &r, five, Some(true), 9).is_err());
        assert!(outcome(&t, &r, five, Some(false), 0).is_err());
        assert!(outcome(&t, &r, five, Some(false), -3).is_err());
        // One that cannot: the highest token decides.
        assert_eq!(
            outcome(&t, &r, five, None, 5).unwrap(),
            FenceOutcome::Accepted
        );
        assert_eq!(outcome(&t, &r, five, None, 9).unwrap(), stale);
        assert!(outcome(&t, &r, five, None, 4).is_err());
    }

    #[test]
    fn bad_input_is_refused_before_io() {
        type My = Plain<sqlx::MySql>;
        type Lite = Plain<sqlx::Sqlite>;
        type Pg = Plain<sqlx::Postgres>;
        let ok = FencingToken::new(1);
        for check in [validate::<My>, validate::<Lite>, validate::<Pg>] {
            assert!(matches!(check("", ok), Err(Error::InvalidKey { .. })));
            assert!(matches!(
                check(&"x".repeat(256), ok),
                Err(Error::InvalidKey { .. })
            ));
            assert!(matches!(
                check("r", FencingToken::new(0)),
                Err(Error::InvalidOptions { .. })
            ));
            assert!(check(&"x".repeat(255), FencingToken::new(i64::MAX as u64)).is_ok());
        }
        assert!(validate::<My>("r", FencingToken::new(u64::MAX)).is_ok());
        for check in [validate::<Lite>, validate::<Pg>] {
            match check("r", FencingToken::new(i64::MAX as u64 + 1)) {
                Err(e @ Error::Unsupported { .. }) => {
                    assert!(e.to_string().contains("signed 64-bit"), "{e}")
                }
                other => panic!("{other:?}"),
            }
        }
    }

    #[test]
    fn default_table_is_valid_everywhere_and_no_lock_table_name() {
        assert_eq!(
            Fence::<Plain<sqlx::MySql>>::default().table().as_str(),
            DEFAULT_FENCE_TABLE
        );
        assert_eq!(
            Fence::<Plain<sqlx::Sqlite>>::default().table().as_str(),
            DEFAULT_FENCE_TABLE
        );
        assert_eq!(
            Fence::<Plain<sqlx::Postgres>>::default().table().as_str(),
            DEFAULT_FENCE_TABLE
        );
        for suffix in [
            "_fence",
            "_rows",
            "_live",
            "_optimistic",
            "_migrations",
            "_token",
            "_keys",
            "_holders",
        ] {
            assert!(!DEFAULT_FENCE_TABLE.ends_with(suffix), "{suffix}");
        }
    }
}
