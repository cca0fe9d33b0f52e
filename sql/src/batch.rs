//! Renewing leases in SQL: the chunk size, the `IN (…)` list of a batch
//! statement, and the refusal of a renewal.

use fenced_api::{batch::padded_len, Error, Lease};

use crate::Dialect;

/// Leases renewed by one batch statement ([`fenced_api::batch::extend_in_chunks`]):
/// far below the parameter limits of every SQL store (MySQL 65 535, SQLite
/// 32 766), small enough that a statement stays a short write.
pub const EXTEND_CHUNK: usize = 256;

/// The placeholders of an `IN (…)` list over `chunk`, numbered from
/// `first`, padded to [`padded_len`] places (so a store prepares a handful of
/// distinct statements, not one per size), and the leases to bind to them
/// in order: the chunk, then its last lease again for each extra place.
///
/// ```
/// use std::time::Duration;
/// use fenced_api::{FencingToken, Lease, LockKey, Owner};
/// let lease = |t| Lease::new(LockKey::new("k").unwrap(), Owner::random(), FencingToken::new(t),
///     Duration::from_secs(1), tokio::time::Instant::now());
/// let (a, b, c) = (lease(1), lease(2), lease(3));
/// let chunk = [&a, &b, &c];
/// let (list, binds) = fenced_sql::in_list::<sqlx::Sqlite>(&chunk, 3);
/// assert_eq!(list, "?3, ?4, ?5, ?6");
/// let tokens: Vec<u64> = binds.map(|l| l.token.get()).collect();
/// assert_eq!(tokens, [1, 2, 3, 3]);
/// assert_eq!(fenced_sql::in_list::<sqlx::MySql>(&chunk, 3).0, "?, ?, ?, ?");
/// ```
pub fn in_list<'a, D: Dialect>(
    chunk: &'a [&'a Lease],
    first: usize,
) -> (String, impl Iterator<Item = &'a Lease> + 'a) {
    let places = padded_len(chunk.len());
    let list: Vec<String> = (0..places).map(|p| D::placeholder(first + p)).collect();
    let last = chunk.len().saturating_sub(1);
    let binds = (0..places).filter_map(move |p| chunk.get(p.min(last)).copied());
    (list.join(", "), binds)
}

/// The error of a renewal the store refused (the lease expired or another
/// holder has the key). Logged at debug only: the caller decides what it
/// means (a `LockClient` guard reports "lock lost"; a renewal racing its
/// own guard's release is no news).
pub fn extend_refused(lease: &Lease) -> Error {
    tracing::debug!(key = %lease.key, token = %lease.token, "extend refused: the lease expired or was taken over");
    Error::lease_lost(
        &lease.key,
        lease.token,
        "the row expired or belongs to another holder",
    )
}
