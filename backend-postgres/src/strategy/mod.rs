//! The strategies, and the one place that dispatches on them: [`Engine`].
//!
//! `lock.rs` bounds each call and hands it here; each arm goes to its
//! strategy's files (`lease.rs` with `list.rs` and `wait.rs`; `advisory`).

use std::time::Duration;

use fenced_api::{
    batch::ChunkVerdict, Capabilities, DistributedLock, Lease, LockInfo, LockKey, LockOptions,
    ReleaseOutcome, Result,
};
use sqlx::PgPool;

use crate::{
    config::{PostgresConfig, Strategy},
    error,
    list::Scans,
    wait::Waiting,
};

pub(crate) mod advisory;
pub(crate) mod lease;

use advisory::Advisory;
use lease::LeaseRows;

/// The strategy of a handle, with everything it needs. One per handle,
/// behind its `Arc`, never moved: the variants' sizes do not matter.
#[derive(Debug)]
#[allow(clippy::large_enum_variant)]
pub(crate) enum Engine {
    Lease(LeaseEngine),
    Advisory(Advisory),
}

/// `lease`: the rows, their scans, and the waiting (`LISTEN`/`NOTIFY`).
#[derive(Debug)]
pub(crate) struct LeaseEngine {
    pub(crate) rows: LeaseRows,
    pub(crate) scans: Scans,
    pub(crate) waiting: Waiting,
}

impl Engine {
    /// The engine of `config`'s strategy over the statement pool.
    pub(crate) fn new(config: &PostgresConfig, pool: PgPool) -> Result<Engine> {
        match config.strategy {
            Strategy::Lease => Ok(Engine::Lease(LeaseEngine {
                rows: LeaseRows::new(pool.clone(), &config.table),
                scans: Scans::new(pool, &config.table),
                waiting: Waiting::new(config),
            })),
            Strategy::Advisory => Ok(Engine::Advisory(Advisory::new(config, pool))),
        }
    }

    /// The statement pool.
    pub(crate) fn pool(&self) -> &PgPool {
        match self {
            Engine::Lease(e) => e.rows.pool(),
            Engine::Advisory(a) => a.pool(),
        }
    }

    /// Closes the statement pool (and `lease`'s hot connections in front
    /// of it), waiting until every connection of it is closed.
    pub(crate) async fn close_pool(&self) {
        match self {
            Engine::Lease(e) => e.rows.close().await,
            Engine::Advisory(a) => a.pool().close().await,
        }
    }

    /// The `lease` engine, if that is the strategy.
    pub(crate) fn lease(&self) -> Option<&LeaseEngine> {
        match self {
            Engine::Lease(e) => Some(e),
            Engine::Advisory(_) => None,
        }
    }

    /// Stops background work (the listener) before the pool closes.
    pub(crate) fn stop(&self) {
        match self {
            Engine::Lease(e) => e.waiting.stop(),
            Engine::Advisory(a) => a.stop(),
        }
    }

    pub(crate) async fn try_acquire(
        &self,
        key: &LockKey,
        opts: &LockOptions,
    ) -> Result<Option<Lease>> {
        match self {
            Engine::Lease(e) => e.rows.try_acquire(key, opts).await,
            Engine::Advisory(a) => a.try_acquire(key, opts).await,
        }
    }

    /// `acquire`; `handle` is the [`PostgresLock`](crate::PostgresLock)
    /// whose (bounded) `try_acquire` the waiting calls.
    pub(crate) async fn acquire(
        &self,
        handle: &(dyn DistributedLock + '_),
        key: &LockKey,
        opts: &LockOptions,
    ) -> Result<Lease> {
        match self {
            Engine::Lease(e) => e.waiting.acquire(handle, key, opts).await,
            Engine::Advisory(a) => a.acquire(key, opts).await,
        }
    }

    pub(crate) async fn extend(&self, lease: &Lease, ttl: Duration) -> Result<Lease> {
        match self {
            Engine::Lease(e) => e.rows.extend(lease, ttl).await,
            Engine::Advisory(a) => a.extend(lease, ttl).await,
        }
    }

    pub(crate) async fn extend_chunk(
        &self,
        chunk: &[&Lease],
        ttl: Duration,
    ) -> Result<ChunkVerdict> {
        match self {
            Engine::Lease(e) => e.rows.extend_chunk(chunk, ttl).await,
            // Each hold renews on its own connection: one by one.
            Engine::Advisory(_) => Ok(ChunkVerdict::Unknown),
        }
    }

    pub(crate) async fn release(&self, lease: &Lease) -> Result<ReleaseOutcome> {
        match self {
            Engine::Lease(e) => {
                let done = e.rows.release(lease).await?;
                // The notification reaches other processes; this process's
                // waiters need not wait for it.
                if done.freed {
                    e.waiting.polling().freed(&lease.key);
                }
                Ok(done.outcome)
            }
            Engine::Advisory(a) => a.release(lease).await,
        }
    }

    pub(crate) async fn force_release(&self, key: &LockKey) -> Result<bool> {
        match self {
            Engine::Lease(e) => {
                let done = e.rows.force_release(key).await?;
                if done.freed {
                    e.waiting.polling().freed(key);
                }
                Ok(done.outcome)
            }
            Engine::Advisory(a) => a.force_release(key).await,
        }
    }

    pub(crate) async fn inspect(&self, key: &LockKey) -> Result<Option<LockInfo>> {
        match self {
            Engine::Lease(e) => e.scans.inspect(key).await,
            Engine::Advisory(a) => a.inspect(key).await,
        }
    }

    pub(crate) async fn list(&self, limit: usize) -> Result<Vec<LockInfo>> {
        match self {
            Engine::Lease(e) => e.scans.list(limit).await,
            Engine::Advisory(a) => a.list(limit).await,
        }
    }

    /// What the strategy promises (checked by the conformance suite).
    pub(crate) fn capabilities(&self) -> Capabilities {
        let base = Capabilities::none().backend(error::BACKEND);
        match self {
            // Durable: rows and the sequence survive a restart
            // (synchronous_commit = on). Woken by NOTIFY, not only by
            // polling; but not FIFO across processes: every process's
            // head waiter races for a freed key.
            Engine::Lease(_) => base
                .durable(true)
                .fencing(true)
                .reentrant(true)
                .native_wait(true),
            // Not durable: a restart ends every session and its locks
            // (the tokens survive). FIFO: the server grants a waited-for
            // lock in queue order. Re-entry through the holding handle.
            Engine::Advisory(_) => Advisory::capabilities(base),
        }
    }
}
