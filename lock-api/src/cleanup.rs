//! The work a dropped future or guard leaves behind, and waiting for it.
//!
//! Dropping an `acquire` future takes its place out of the store's line,
//! and dropping a [`LockGuard`](crate::LockGuard) releases its lock. `Drop`
//! cannot wait, so the stores send those requests from a task spawned on
//! the current runtime through [`spawn`]. A process that is about to exit —
//! a CLI that caught Ctrl-C while waiting, a service shutting down — calls
//! [`settle`] first: otherwise the runtime ends with the tasks unfinished,
//! and what they would have given back stays taken until its TTL (a waiter
//! left in line holds up everyone behind it that long).
//!
//! ```
//! # async fn shutdown() {
//! // After the last guard and wait of this process are dropped:
//! let settled = fenced_api::cleanup::settle(std::time::Duration::from_secs(2)).await;
//! if !settled {
//!     eprintln!("some locks or places in line are left to their TTL");
//! }
//! # }
//! ```

use std::{
    future::Future,
    sync::{LazyLock, Mutex},
    time::Duration,
};

use tokio_util::task::TaskTracker;

/// Every clean-up task of this process (tracked, never awaited by Drop).
static CLEANUPS: LazyLock<TaskTracker> = LazyLock::new(TaskTracker::new);
/// How many [`settle`] calls are waiting on [`CLEANUPS`].
static SETTLING: Mutex<usize> = Mutex::new(0);

/// Runs `work` on the current tokio runtime as a clean-up [`settle`] waits
/// for. Without a runtime nothing runs (and `false` is returned): what it
/// would have given back then lapses after its TTL.
pub fn spawn<F>(work: F) -> bool
where
    F: Future<Output = ()> + Send + 'static,
{
    spawn_in(&CLEANUPS, work)
}

fn spawn_in<F>(tracker: &TaskTracker, work: F) -> bool
where
    F: Future<Output = ()> + Send + 'static,
{
    match tokio::runtime::Handle::try_current() {
        Ok(rt) => {
            tracker.spawn_on(work, &rt);
            true
        }
        Err(_) => false,
    }
}

/// Waits, at most `within`, until every clean-up spawned so far (and any
/// spawned meanwhile) has finished; `true` if they all did. Clean-ups still
/// running afterwards keep running.
pub async fn settle(within: Duration) -> bool {
    settle_in(&CLEANUPS, &SETTLING, within).await
}

/// A tracker's `wait` ends only while it is closed; it is opened again once
/// the last of the overlapping callers is done (the count and the close or
/// reopen change together, so one caller's reopen never strands another).
async fn settle_in(tracker: &TaskTracker, settling: &Mutex<usize>, within: Duration) -> bool {
    {
        let mut n = settling.lock().unwrap_or_else(|p| p.into_inner());
        *n += 1;
        tracker.close();
    }
    let settled = tokio::time::timeout(within, tracker.wait()).await.is_ok();
    let mut n = settling.lock().unwrap_or_else(|p| p.into_inner());
    *n -= 1;
    if *n == 0 {
        tracker.reopen();
    }
    settled
}

#[cfg(test)]
mod tests {
    use std::sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    };

    use super::*;

    #[tokio::test]
    async fn settle_waits_for_spawned_cleanups() {
        let tracker = TaskTracker::new();
        let settling = Mutex::new(0);
        let done = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&done);
        assert!(spawn_in(&tracker, async move {
            tokio::time::sleep(Duration::from_millis(50)).await;
            flag.store(true, Ordering::SeqCst);
        }));
        assert!(settle_in(&tracker, &settling, Duration::from_secs(5)).await);
        assert!(
            done.load(Ordering::SeqCst),
            "settled before the clean-up ran"
        );
        // Open again: later clean-ups are waited for too.
        assert!(spawn_in(
            &tracker,
            tokio::time::sleep(Duration::from_secs(60))
        ));
        assert!(!settle_in(&tracker, &settling, Duration::from_millis(20)).await);
    }

    #[test]
    fn without_a_runtime_nothing_is_spawned() {
        assert!(!spawn(async {}));
    }

    /// Overlapping callers: the first to finish does not reopen the tracker
    /// under the other, which still sees the clean-ups end.
    #[tokio::test]
    async fn overlapping_settles_both_see_the_end() {
        let tracker = TaskTracker::new();
        let settling = Mutex::new(0);
        assert!(spawn_in(
            &tracker,
            tokio::time::sleep(Duration::from_millis(200))
        ));
        let (short, long) = tokio::join!(
            settle_in(&tracker, &settling, Duration::from_millis(10)),
            settle_in(&tracker, &settling, Duration::from_secs(5)),
        );
        assert!(!short, "the short wait ends before the clean-up");
        assert!(long, "the long wait was stranded by the short one's reopen");
    }
}
