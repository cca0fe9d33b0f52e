//! One writer at a time from this process.
//!
//! SQLite has one write lock per file. Pooled connections of one process
//! that write at once do not queue for it: each one that finds it taken
//! sleeps in SQLite's busy handler (1, 2, 5, 10 … 100 ms) and looks again, so
//! a few tasks writing together spend most of their time asleep while the
//! lock is free (measured: 32 tasks sharing 4 connections did not take
//! 100 000 locks within 176 s, where one task alone takes 10 000 in 3.7 s;
//! with the gate they took them in 66 s, renewing all the while). The
//! store's writes therefore take this gate
//! first: they queue here, in arrival order, and reach SQLite one by one.
//! Writers in *other* processes still meet SQLite's busy handler, bounded
//! by `busy_timeout`. Reads do not take the gate (WAL readers never wait
//! for the writer).

use std::sync::Arc;

use tokio::sync::{Mutex, MutexGuard};

/// Shared by every write path of one store's pool; cheap to clone.
#[derive(Debug, Clone, Default)]
pub(crate) struct WriteGate(Arc<Mutex<()>>);

impl WriteGate {
    /// Waits for this process's earlier writers (FIFO); the write runs
    /// while the guard lives. Dropping the future gives up the place.
    pub(crate) async fn enter(&self) -> MutexGuard<'_, ()> {
        self.0.lock().await
    }
}
