//! `list` for `row_lock`: which row locks are held, across instances.
//!
//! A held lock is an open transaction holding a row lock; nothing in a
//! table says so by itself. What the store has is `<base>_live`, the
//! description of each key's **latest grant** (owner, token, expiry, the
//! holding connection's id), kept after the release. So the listing is:
//!
//! 1. one `SELECT` of the candidates, in key order: each key's latest
//!    grant whose connection has not gone on to a later grant (a lock
//!    connection holds one key at a time and ends each hold before the
//!    next) and — when the account may read `information_schema.INNODB_TRX`
//!    (the `PROCESS` privilege) — whose connection is inside a
//!    transaction. That table is a cache InnoDB refills at most every
//!    0.1 s, so it is read with a witness ([`innodb_trx`](super::innodb_trx),
//!    three more statements; up to a second more while it is stale, up to
//!    2 s more while other such reads of the process wait for their turn).
//!    Without the privilege, or if the cache stays stale, every such
//!    description is a candidate (released keys whose connection sits idle
//!    included, until their description is pruned);
//! 2. per candidate, the truth: a hold through this very instance (same
//!    token, deadline not passed) is listed as it is, with its local hold
//!    count; any other is confirmed with the `NOWAIT` probe `inspect` uses
//!    (a lock attempt on the key's row, rolled back at once): refused means
//!    held. Stops once `limit` are confirmed.
//!
//! Cost: one `SELECT` over `<base>_live` (a `MEMORY` table; rows = keys
//! granted and not yet pruned) in the witness's transaction, then one probe
//! (two to three statements on a lock connection) per candidate not held
//! through this instance — about one per lock held elsewhere with
//! `PROCESS`, up to one per described key without it.
//!
//! What it cannot see exactly, as `inspect`:
//!
//! * `RowMode::Shards`: the probe tests the key's **shard** row, so a
//!   released key whose description is still a candidate is listed while
//!   another key of the same shard is held;
//! * the instants between a grant's row lock and its token statement (the
//!   two-statement path): the key is held but still described by its
//!   previous grant (listed with the previous token, or not at all if its
//!   description was pruned);
//! * remaining TTL is the description's expiry on the server's clock; a
//!   transaction-scoped hold running a long statement can outlive it (the
//!   server's `wait_timeout` only counts idle time): it is then listed with
//!   0 left, as `inspect` shows it.

use fenced_api::{Error, LockInfo, Result};
use tokio::time::Instant;

use super::{innodb_trx::TrxView, token::LIFETIME_KEY, RowLock};
use crate::error;
use crate::list::infos_from_rows;

impl RowLock {
    /// The held row locks of this table, first `limit` in key order (see
    /// the module docs).
    pub(super) async fn list_held(&self, limit: usize) -> Result<Vec<LockInfo>> {
        if limit == 0 {
            return Ok(Vec::new());
        }
        let mut held = Vec::new();
        for mut info in self.bounded("list", self.list_candidates()).await? {
            if held.len() >= limit {
                break;
            }
            let here = self
                .held
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .get(&info.key)
                .filter(|h| h.token == info.token.get() && Instant::now() < h.deadline)
                .map(|h| h.count);
            if let Some(count) = here {
                info.hold_count = count;
                held.push(info);
                continue;
            }
            match self.bounded("list probe", self.probe_held(&info.key)).await {
                Ok(true) => held.push(info),
                Ok(false) => {}
                // Fixed rows: the key's row was deleted since its grant, so
                // nothing can hold it.
                Err(Error::Config { .. }) => {}
                Err(e) => return Err(e),
            }
        }
        Ok(held)
    }

    /// Each step within the operation timeout: a silent server yields a
    /// retryable error, never a hang (a dropped probe closes its connection).
    async fn bounded<T>(
        &self,
        what: &str,
        step: impl std::future::Future<Output = Result<T>>,
    ) -> Result<T> {
        error::bounded(what, self.op_timeout, step).await
    }

    /// Step 1 of the module docs: the candidate descriptions, in key order.
    async fn list_candidates(&self) -> Result<Vec<LockInfo>> {
        let view = self
            .read_innodb_trx(
                || sqlx::query(self.sql.list_in_trx.clone()).bind(LIFETIME_KEY),
                |_| false,
            )
            .await?;
        let rows = match view {
            TrxView::Rows { rows, fresh: true } => rows,
            // A stale cache can miss a hold; every description is then a
            // candidate, as without the privilege.
            TrxView::Rows { fresh: false, .. } => self.described().await?,
            TrxView::Denied(e) => {
                tracing::debug!(error = %e, "no PROCESS privilege: listing probes every described key");
                self.described().await?
            }
        };
        infos_from_rows(&rows)
    }

    /// Every description whose connection has not moved on.
    async fn described(&self) -> Result<Vec<sqlx::mysql::MySqlRow>> {
        let mut c = self.plain().await?;
        let r = sqlx::query(self.sql.list_described.clone())
            .bind(LIFETIME_KEY)
            .fetch_all(c.conn())
            .await;
        c.finish(&r);
        r.map_err(error::map)
    }
}
