//! How waiters wait: ZooKeeper's native wait, herd-free. Each waiter
//! watches only its predecessor in the queue (an `exists` watch); when the
//! watch fires it reads the queue again before it believes it is first, so
//! waiters are served in the order their entries were created.

use fenced_api::{Error, Lease, LockKey, LockOptions, Result, WaitPolicy};
use tokio::time::Instant;

use crate::{
    entry,
    error::{self, kind, Kind},
    queue::{Attempt, Parts, Place},
};

/// Takes `key`, waiting in its queue as `opts.wait()` allows (not
/// [`WaitPolicy::NoWait`], which is `try_acquire`).
pub(crate) async fn acquire(parts: Parts<'_>, key: &LockKey, opts: &LockOptions) -> Result<Lease> {
    let start = Instant::now();
    let until = match opts.wait() {
        WaitPolicy::Timeout(d) => start.checked_add(d),
        WaitPolicy::NoWait => Some(start),
        _ => None,
    };
    let timeout = || Error::Timeout {
        key: key.clone(),
        waited: start.elapsed(),
    };
    let owner = opts.owner_or_random();
    // Dropped on every early return: the entry leaves the queue.
    let mut attempt = Attempt::enter(parts, key, &owner, opts.ttl(), opts.label()).await?;
    let mut checked_reentry = opts.owner().is_none();
    loop {
        let (place, sent) = attempt.place().await?;
        let (predecessor, holder) =
            match place {
                Place::First => return attempt.grant(parts.tracker, key, owner, sent).await,
                Place::Behind {
                    predecessor,
                    holder,
                } => (predecessor, holder),
                Place::Gone => return Err(Error::backend(
                    error::BACKEND,
                    true,
                    "the queue entry vanished while waiting (the session ended, or it was deleted)",
                )),
            };
        if !checked_reentry {
            let data = attempt.data_of(&holder).await?;
            entry::check_reentry(key, opts, data.as_deref())?;
            checked_reentry = true;
        }
        if until.is_some_and(|u| Instant::now() >= u) {
            return Err(timeout());
        }
        let s = attempt.session();
        let path = attempt.path_of(&predecessor);
        let watcher = match s
            .run("exists", s.client().check_and_watch_stat(&path))
            .await?
        {
            Ok((Some(_), watcher)) => watcher,
            // Gone already: read the queue again.
            Ok((None, _)) => continue,
            Err(e) if kind(&e) == Kind::NoNode => continue,
            Err(e) => return Err(error::map(e)),
        };
        match until {
            Some(u) => {
                tokio::select! {
                    _ = watcher.changed() => {}
                    _ = tokio::time::sleep_until(u) => return Err(timeout()),
                }
            }
            None => {
                watcher.changed().await;
            }
        }
        // One event per wake-up: the tests count them to show that a release
        // wakes only the successor.
        tracing::debug!(key = %key, predecessor = %path, "woken: predecessor changed");
    }
}
