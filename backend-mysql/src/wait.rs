//! How waiters wait.
//!
//! * `unique_key` and `optimistic`: the server cannot tell a client that a
//!   row was freed, so their waiters poll, through one
//!   [`Polling`] per store handle built here:
//!   backoff from 5 ms doubling to 200 ms with jitter, the waiters of one
//!   process in a FIFO line per key of which only the head polls. The scope
//!   is the server and the table, so every handle on the same table shares
//!   the line and a release through one handle wakes the waiters of
//!   another at once. Every release and force-release outcome passes
//!   through it (`strategy/rows.rs`; for `unique_key` a release that finds
//!   its row gone, `NOT_HELD_FREES`, wakes the line too, and so does every
//!   force-release, `strategy/unique_key.rs`).
//! * `row_lock` waits natively: a waiter's `SELECT … FOR UPDATE` queues in
//!   InnoDB's lock queue and the server hands it the row when the holder's
//!   transaction ends. The client bounds the wait at the caller's deadline,
//!   re-arms it in chunks of the connection's `innodb_lock_wait_timeout`,
//!   and kills the statement of a wait it abandons (`wait_for_row` in
//!   `strategy/row_lock/grant.rs`).

use fenced_api::wait::Polling;

use crate::config::MySqlConfig;

/// The polling of a `unique_key` or `optimistic` handle on `config`'s
/// server and table.
pub(crate) fn polling(config: &MySqlConfig) -> Polling {
    Polling::new(format!("{}#{}", config.display_url, config.table))
}
