//! What fenced's SQL backends (`fenced-mysql`, `fenced-sqlite`,
//! `fenced-postgres`) share, written once: validated table names
//! ([`TableName`]), the statement macro ([`sql!`]), the migration runner
//! ([`migrate`]), the fencing-token checks in SQL ([`fence`]), reading lock
//! rows back ([`rows`]) and the batch-renewal helpers ([`EXTEND_CHUNK`],
//! [`in_list`], [`extend_refused`]).
//!
//! What differs between the stores is a [`Dialect`], implemented here for
//! each sqlx database fenced supports: how identifiers are quoted (backticks
//! for MySQL, double quotes for SQLite and PostgreSQL), which table names the
//! store accepts (lowercase only on SQLite and PostgreSQL), how placeholders
//! are written (`?`, `?1`, `$1`), the largest token it keeps, and the few
//! statements that cannot be written the same way. What differs between the
//! *backends* — how a store error becomes a [`fenced_api::Error`] — is a
//! [`SqlBackend`], implemented by each backend crate on a marker type of its
//! own.
//!
//! ```
//! use fenced_sql::{sql, TableName};
//! let table = TableName::<sqlx::Sqlite>::new("jobs")?;
//! assert_eq!(table.quoted("_migrations"), "\"jobs_migrations\"");
//! let t = table.quoted("");
//! let statement = sql!("DELETE FROM {t} WHERE id = ?1");
//! assert_eq!(statement.as_str(), "DELETE FROM \"jobs\" WHERE id = ?1");
//! assert!(TableName::<sqlx::Sqlite>::new("Jobs").is_err()); // SQLite names are case-insensitive
//! assert!(TableName::<sqlx::MySql>::new("Jobs").is_ok());
//! assert!(TableName::<sqlx::Postgres>::new("Jobs").is_err()); // PostgreSQL folds unquoted names
//! assert_eq!(TableName::<sqlx::Postgres>::new("jobs")?.quoted("_keys"), "\"jobs_keys\"");
//! # Ok::<(), fenced_api::Error>(())
//! ```

mod batch;
pub mod conns;
mod dialect;
pub mod fence;
pub mod migrate;
mod mysql;
mod postgres;
pub mod rows;
pub mod sqlite;
mod table;
#[cfg(feature = "testing")]
pub mod testing;

pub use batch::{extend_refused, in_list, EXTEND_CHUNK};
pub use conns::{Conn, Conns};
pub use dialect::{leaves_session_usable, Dialect, SqlBackend};
pub use table::TableName;

#[doc(hidden)]
pub use sqlx as __sqlx;

/// Builds a prepared-statement string ([`sqlx::SqlStr`]) from `format!`
/// arguments whose only dynamic parts are quoted [`TableName`]s and
/// constants — never a value: values are bound.
#[macro_export]
macro_rules! sql {
    ($($fmt:tt)*) => {
        $crate::__sqlx::SqlSafeStr::into_sql_str($crate::__sqlx::AssertSqlSafe(
            ::std::sync::Arc::<str>::from(::std::format!($($fmt)*)),
        ))
    };
}
