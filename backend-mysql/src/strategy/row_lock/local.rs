//! What this instance knows about its own holds, and when not to trust it.
//!
//! A `row_lock` hold is a transaction on one connection, so reentrancy is
//! **per [`MySqlLock`](crate::MySqlLock) instance** (its map of holds): the
//! same owner re-enters through the instance that holds the key. Through
//! another instance (another process, or a second `MySqlLock` built from
//! the same URL) the same owner is a second transaction, which InnoDB makes
//! wait for the first — it cannot join it. Waiting there would be a
//! self-deadlock until the wait bound, so a refused attempt with an
//! explicit owner checks the key's grant description: if the key is held
//! by that very owner through a connection that is still in its
//! transaction, the answer is [`Error::AlreadyHeld`] at once (reentrant or
//! not) instead of a wait — up to a second later if InnoDB's cache of
//! its transactions is behind ([`innodb_trx`](super::innodb_trx)). Best
//! effort: with `RowMode::Shards` (a description names a key, the lock is
//! the shard's row), without the `PROCESS` privilege (needed to read
//! `information_schema.INNODB_TRX`), or while something else on the server
//! reads that table more often than every 0.1 s (its cache then never
//! refills), nothing is detected and the second instance waits.
//!
//! The map can also be stale: a hold whose connection the server closed
//! (`KILL`, a force-release from another instance) stays in the map until
//! its local deadline. A `try_acquire` that finds the key held here by
//! another owner therefore asks the server whether the holding connection
//! still exists before it answers "held".

use std::time::Duration;

use fenced_api::{
    DistributedLock, Error, FencingToken, Lease, LockKey, LockOptions, Owner, Result,
};
use tokio::time::Instant;

use super::innodb_trx::TrxView;
use super::{RowLock, RowMode};

/// Whether the connection with this id is alive: absent from the process
/// list, or marked killed (rolling back), it is not. Every lock connection
/// uses the same account, so no `PROCESS` privilege is needed to see it.
pub(super) const CONN_ALIVE: &str =
    "SELECT 1 FROM information_schema.PROCESSLIST WHERE ID = ? AND COMMAND <> 'Killed'";

impl RowLock {
    /// Local reentrancy / refusal when this instance already holds `key`.
    /// `Ok(None)` means "not held here".
    pub(super) fn local(
        &self,
        key: &LockKey,
        opts: &LockOptions,
        ttl: Duration,
        sent: Instant,
    ) -> Result<Option<Option<Lease>>> {
        let mut held = self.held.lock().unwrap_or_else(|p| p.into_inner());
        let Some(h) = held.get_mut(key) else {
            return Ok(None);
        };
        if Instant::now() >= h.deadline {
            // Never renewed in time: the server has closed (or is about to
            // close) that connection. Drop it — closing it rolls back — and
            // let the caller compete afresh.
            held.remove(key);
            return Ok(None);
        }
        match opts.owner() {
            Some(owner) if *owner == h.owner => {
                if !opts.is_reentrant() {
                    return Err(Error::AlreadyHeld { key: key.clone() });
                }
                h.count += 1;
                Ok(Some(Some(Lease::new(
                    key.clone(),
                    h.owner.clone(),
                    FencingToken::new(h.token),
                    ttl,
                    sent,
                ))))
            }
            // Held by another owner through this very instance: contention
            // (if that hold is still alive: see `local_hold_gone`).
            _ => Ok(Some(None)),
        }
    }

    /// Finishes a local re-entry: the holding connection's expiry is pushed
    /// out (and the hold count published) like an extend. `None` if the
    /// connection turned out to be gone — the caller then acquires afresh.
    pub(super) async fn reentered(&self, lease: Lease, ttl: Duration) -> Result<Option<Lease>> {
        match self.extend(&lease, ttl).await {
            Ok(l) => Ok(Some(l)),
            Err(Error::LeaseLost { .. }) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Whether this instance's hold of `key` is gone on the server although
    /// the map still lists it (its connection was killed — by an admin, or
    /// by another instance's `force_release` — or closed). If so the entry
    /// is dropped and the caller competes on the server. One read on a
    /// plain connection (a refused try through the holding instance costs
    /// that statement instead of none); a hold whose connection is in use
    /// right now (an extend or release in flight) is trusted as it is.
    pub(super) async fn local_hold_gone(&self, key: &LockKey) -> Result<bool> {
        let (slot, token) = {
            let held = self.held.lock().unwrap_or_else(|p| p.into_inner());
            match held.get(key) {
                Some(h) => (std::sync::Arc::clone(&h.conn), h.token),
                None => return Ok(true),
            }
        };
        let conn_id = match slot.try_lock() {
            Ok(mut g) => match g.as_mut().and_then(|h| h.lock_conn().ok()) {
                Some(lc) => Some(lc.id),
                None => None,
            },
            Err(_) => return Ok(false),
        };
        let gone = match conn_id {
            None => true,
            Some(id) => self
                .fetch_optional(sqlx::query(CONN_ALIVE).bind(id))
                .await?
                .is_none(),
        };
        if gone {
            let removed = {
                let mut held = self.held.lock().unwrap_or_else(|p| p.into_inner());
                match held.get(key) {
                    Some(h) if h.token == token => held.remove(key),
                    _ => None,
                }
            };
            if removed.is_some() {
                tracing::warn!(key = %key, token, "a hold through this instance was lost (its connection was killed or closed); the key is contended afresh");
            }
            // Dropping the entry closes what is left of its connection.
            drop(removed);
        }
        Ok(gone)
    }

    /// After a refused attempt by an explicit owner: whether `key` is held
    /// by that same owner through a connection of another instance (see
    /// the module docs). Shards are skipped: a key's description does not
    /// say who holds its shard.
    ///
    /// First the key's description alone (one read of a `MEMORY` table):
    /// refused by another owner — the usual contention — it ends there. If
    /// it names this owner, `INNODB_TRX` decides whether that connection is
    /// still in its transaction, read with a witness
    /// ([`innodb_trx`](super::innodb_trx)): its cache can be 0.1 s or more
    /// behind, and a hold granted a moment ago would be missed. A stale
    /// cache that still shows the hold is believed; one that never became
    /// current within [`TRIES`](super::innodb_trx::TRIES) reads (someone
    /// reads `INNODB_TRX` more often than every 0.1 s) detects nothing, as
    /// without `PROCESS`.
    pub(super) async fn same_owner_elsewhere(&self, key: &LockKey, owner: &Owner) -> Result<bool> {
        if matches!(self.mode, RowMode::Shards(_)) {
            return Ok(false);
        }
        let described = sqlx::query(self.sql.same_owner_described.clone())
            .bind(key.as_bytes())
            .bind(owner.as_str().as_bytes());
        if self.fetch_optional(described).await?.is_none() {
            return Ok(false);
        }
        let view = self
            .read_innodb_trx(
                || {
                    sqlx::query(self.sql.same_owner.clone())
                        .bind(key.as_bytes())
                        .bind(owner.as_str().as_bytes())
                },
                |rows| !rows.is_empty(),
            )
            .await?;
        match view {
            TrxView::Rows { rows, .. } => Ok(!rows.is_empty()),
            TrxView::Denied(e) => {
                tracing::debug!(error = %e, "no PROCESS privilege: same-owner holds through other instances are not detected");
                Ok(false)
            }
        }
    }

    /// [`same_owner_elsewhere`](Self::same_owner_elsewhere) as the error to return.
    pub(super) async fn refuse_same_owner(&self, key: &LockKey, opts: &LockOptions) -> Result<()> {
        let Some(owner) = opts.owner() else {
            return Ok(());
        };
        if self.same_owner_elsewhere(key, owner).await? {
            tracing::warn!(
                key = %key,
                owner = owner.as_str(),
                "row_lock: the key is held by this same owner through another instance; \
                 reentrancy is per MySqlLock instance, so this would wait for itself"
            );
            return Err(Error::AlreadyHeld { key: key.clone() });
        }
        Ok(())
    }
}
