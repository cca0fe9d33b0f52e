//! Validated table names.

use std::{fmt, hash, marker::PhantomData};

use fenced_api::{Error, Result};

use crate::Dialect;

/// A validated table name of dialect `D` — a lock namespace, or the fence
/// table: ASCII letters (lowercase only where `D` compares names
/// case-insensitively or folds unquoted ones, [`Dialect::MIXED_CASE`]),
/// digits and `_`, not starting with a digit, at most
/// [`TableName::MAX_LEN`] characters, and not in a prefix `D` reserves.
/// Always used quoted, so reserved words are fine; names derived from it
/// (`<name>_migrations`, …) are quoted the same way by [`quoted`](Self::quoted).
///
/// The backends name it for their store (`fenced_mysql::TableName`,
/// `fenced_sqlite::TableName`).
pub struct TableName<D> {
    name: String,
    dialect: PhantomData<fn() -> D>,
}

impl<D: Dialect> TableName<D> {
    /// Longest name accepted. With a suffix of up to
    /// [`MAX_SUFFIX_LEN`](Self::MAX_SUFFIX_LEN) a derived name stays within
    /// every store's identifier limit ([`Dialect::MAX_IDENTIFIER_LEN`]).
    pub const MAX_LEN: usize = 48;

    /// Longest suffix of a derived name (`_migrations`, `_optimistic` are
    /// 11 today): [`MAX_LEN`](Self::MAX_LEN) + 15 is PostgreSQL's 63-byte
    /// limit, the smallest. PostgreSQL truncates a longer identifier with
    /// only a notice, so two derived names could silently become one.
    pub const MAX_SUFFIX_LEN: usize = 15;

    /// Validates a table name.
    ///
    /// # Errors
    ///
    /// [`Error::Config`] naming the rule that was broken.
    pub fn new(name: &str) -> Result<Self> {
        let letter = |c: char| {
            if D::MIXED_CASE {
                c.is_ascii_alphabetic()
            } else {
                c.is_ascii_lowercase()
            }
        };
        let mut chars = name.chars();
        let valid_start = chars.next().is_some_and(|c| letter(c) || c == '_');
        if !valid_start || !chars.all(|c| letter(c) || c.is_ascii_digit() || c == '_') {
            let (case, why) = if D::MIXED_CASE {
                ("", String::new())
            } else {
                ("lowercase ", format!(" ({})", D::LOWERCASE_BECAUSE))
            };
            return Err(Error::config(format!(
                "invalid table name {name:?}: use {case}ASCII letters, digits and `_`, \
                 not starting with a digit{why}"
            )));
        }
        if name.len() > Self::MAX_LEN {
            return Err(Error::config(format!(
                "table name {name:?} is {} characters long; the maximum is {}",
                name.len(),
                Self::MAX_LEN
            )));
        }
        if let Some(prefix) = D::RESERVED_PREFIX.filter(|p| name.starts_with(p)) {
            return Err(Error::config(format!(
                "table name {name:?} starts with `{prefix}`, which {} reserves for itself",
                <D as sqlx::Database>::NAME
            )));
        }
        Ok(TableName {
            name: name.to_owned(),
            dialect: PhantomData,
        })
    }

    /// The name.
    pub fn as_str(&self) -> &str {
        &self.name
    }

    /// The quoted physical table `<name><suffix>` (`suffix` is a constant
    /// such as `_migrations`, at most [`MAX_SUFFIX_LEN`](Self::MAX_SUFFIX_LEN)
    /// bytes).
    pub fn quoted(&self, suffix: &str) -> String {
        // The suffix is a constant of the calling code: a longer one is a
        // bug its tests should stop at.
        debug_assert!(
            suffix.len() <= Self::MAX_SUFFIX_LEN,
            "suffix {suffix:?} is longer than {}",
            Self::MAX_SUFFIX_LEN
        );
        D::quote(&format!("{}{suffix}", self.name))
    }
}

impl<D> Clone for TableName<D> {
    fn clone(&self) -> Self {
        TableName {
            name: self.name.clone(),
            dialect: PhantomData,
        }
    }
}

impl<D> PartialEq for TableName<D> {
    fn eq(&self, other: &Self) -> bool {
        self.name == other.name
    }
}

impl<D> Eq for TableName<D> {}

impl<D> hash::Hash for TableName<D> {
    fn hash<H: hash::Hasher>(&self, state: &mut H) {
        self.name.hash(state);
    }
}

impl<D> fmt::Debug for TableName<D> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("TableName").field(&self.name).finish()
    }
}

impl<D> fmt::Display for TableName<D> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(e: Error) -> String {
        match e {
            Error::Config { reason } => reason,
            other => panic!("expected a config error, got {other:?}"),
        }
    }

    #[test]
    fn mysql_names_allow_mixed_case() {
        type T = TableName<sqlx::MySql>;
        for ok in [
            "locks",
            "Locks",
            "_x",
            "a1",
            "select",
            "sqlite_x",
            &"a".repeat(48),
        ] {
            assert!(T::new(ok).is_ok(), "{ok}");
        }
        for bad in ["", "9x", "a-b", "a.b", "a b", "a`b", "é", &"a".repeat(49)] {
            assert!(T::new(bad).is_err(), "{bad}");
        }
        assert_eq!(T::new("select").unwrap().quoted("_rows"), "`select_rows`");
        assert_eq!(
            message(T::new("a-b").unwrap_err()),
            "invalid table name \"a-b\": use ASCII letters, digits and `_`, not starting with a digit"
        );
    }

    #[test]
    fn sqlite_names_are_lowercase_and_not_reserved() {
        type T = TableName<sqlx::Sqlite>;
        for ok in ["locks", "_x", "locks_2", "select", "order", &"a".repeat(48)] {
            assert!(T::new(ok).is_ok(), "{ok}");
        }
        for bad in [
            "",
            "9x",
            "a-b",
            "a.b",
            "a b",
            "\"a\"",
            "a\"; DROP TABLE t; --",
            "Locks",
            "é",
            "sqlite_x",
            &"a".repeat(49),
        ] {
            assert!(T::new(bad).is_err(), "{bad}");
        }
        assert_eq!(
            T::new("select").unwrap().quoted("_migrations"),
            "\"select_migrations\""
        );
        assert_eq!(
            message(T::new("Locks").unwrap_err()),
            "invalid table name \"Locks\": use lowercase ASCII letters, digits and `_`, \
             not starting with a digit (SQLite table names are case-insensitive)"
        );
        assert_eq!(
            message(T::new("sqlite_x").unwrap_err()),
            "table name \"sqlite_x\" starts with `sqlite_`, which SQLite reserves for itself"
        );
        assert_eq!(
            message(T::new(&"a".repeat(49)).unwrap_err()),
            format!(
                "table name {:?} is 49 characters long; the maximum is 48",
                "a".repeat(49)
            )
        );
    }

    #[test]
    fn postgres_names_are_lowercase_and_not_reserved() {
        type T = TableName<sqlx::Postgres>;
        for ok in [
            "locks",
            "_x",
            "locks_2",
            "select",
            "user",
            "sqlite_x",
            "pgx",
            &"a".repeat(48),
        ] {
            assert!(T::new(ok).is_ok(), "{ok}");
        }
        for bad in [
            "",
            "9x",
            "a-b",
            "a.b",
            "a b",
            "\"a\"",
            "a\"; DROP TABLE t; --",
            "a$b",
            "Locks",
            "LOCKS",
            "é",
            "pg_x",
            "pg_",
            &"a".repeat(49),
        ] {
            assert!(T::new(bad).is_err(), "{bad}");
        }
        assert_eq!(T::new("user").unwrap().quoted("_keys"), "\"user_keys\"");
        assert_eq!(T::new("jobs").unwrap().quoted(""), "\"jobs\"");
        assert_eq!(
            message(T::new("Locks").unwrap_err()),
            "invalid table name \"Locks\": use lowercase ASCII letters, digits and `_`, \
             not starting with a digit (PostgreSQL folds unquoted names to lowercase)"
        );
        assert_eq!(
            message(T::new("pg_x").unwrap_err()),
            "table name \"pg_x\" starts with `pg_`, which PostgreSQL reserves for itself"
        );
    }

    #[test]
    fn derived_names_fit_every_store() {
        fn fits<D: Dialect>() -> bool {
            TableName::<D>::MAX_LEN + TableName::<D>::MAX_SUFFIX_LEN <= D::MAX_IDENTIFIER_LEN
        }
        assert!(fits::<sqlx::MySql>());
        assert!(fits::<sqlx::Sqlite>());
        assert!(fits::<sqlx::Postgres>());
        // The longest name with the longest suffix is exactly PostgreSQL's limit.
        let longest = TableName::<sqlx::Postgres>::new(&"a".repeat(48)).unwrap();
        assert_eq!(longest.quoted("_keys_expire_at").len(), 63 + 2);
    }

    #[test]
    fn names_compare_and_print_as_their_text() {
        let a = TableName::<sqlx::Sqlite>::new("jobs").unwrap();
        assert_eq!(a.clone(), a);
        assert_eq!(a.to_string(), "jobs");
        assert_eq!(format!("{a:?}"), "TableName(\"jobs\")");
    }
}
