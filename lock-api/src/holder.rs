//! Who asks for a lock inside this process, and which holds the running
//! code works under — what lets [`LockClient`](crate::LockClient) tell a
//! task asking again for its own key (which would wait on itself) from
//! another holder (which must wait in turn).
//!
//! Two sources, one precise and one a fallback:
//!
//! * **Scopes.** [`LockClient::with_lock`](crate::LockClient::with_lock)
//!   and [`LockGuard::scope`](crate::LockGuard::scope) run their work with
//!   the hold recorded in a tokio task-local. The record travels with the
//!   future, wherever it is polled, and ends with it: inside it, asking for
//!   the same key through the same client is re-entry (or `AlreadyHeld`),
//!   never a wait. Each record names the task that entered the scope and
//!   counts only for it: a task spawned from inside, or another task that
//!   happens to be polled inside (a `LocalSet` driven from the work, say),
//!   is another holder and waits in turn.
//! * **The acquiring task.** Outside any scope, a hold remembers the task
//!   (or, outside any task, the thread) that took it. The same task asking
//!   again re-enters (reentrant client) or gets `AlreadyHeld`, at once,
//!   rather than a silent wait until its bound. It is the acquirer's, not
//!   the guard's: a guard handed to another task still counts as its
//!   acquiring task's here.

use std::{future::Future, sync::Arc};

use crate::{client::ClientInner, guard::Held, LockKey};

/// The task that takes a lock (by its tokio task id), or — for code that
/// runs outside any task, such as the future given to `block_on` or
/// `#[tokio::main]` — the thread.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Holder {
    Task(tokio::task::Id),
    Thread(std::thread::ThreadId),
}

impl Holder {
    pub(crate) fn current() -> Holder {
        match tokio::task::try_id() {
            Some(id) => Holder::Task(id),
            None => Holder::Thread(std::thread::current().id()),
        }
    }
}

tokio::task_local! {
    /// The holds whose work the current future runs under (innermost first).
    static SCOPE: Scope;
}

/// A chain of holds, innermost first.
#[derive(Clone, Default)]
struct Scope(Option<Arc<Node>>);

struct Node {
    held: Arc<Held>,
    /// The task that entered the scope: the only one it counts for.
    holder: Holder,
    outer: Scope,
}

impl Scope {
    fn current() -> Scope {
        SCOPE.try_with(Scope::clone).unwrap_or_default()
    }
}

/// The hold of `key` through `client` that the running task `me` works under,
/// if any — lost or not: asking for the key inside the work of a lost hold
/// is answered with that loss.
pub(crate) fn scoped_hold(
    client: &Arc<ClientInner>,
    key: &LockKey,
    me: Holder,
) -> Option<Arc<Held>> {
    let mut at = Scope::current().0;
    while let Some(node) = at {
        if node.holder == me && Arc::ptr_eq(&node.held.client, client) && node.held.key == *key {
            return Some(Arc::clone(&node.held));
        }
        at = node.outer.0.clone();
    }
    None
}

/// Runs `work` with `held` recorded as the hold the current task works
/// under.
pub(crate) async fn within<F: Future>(held: Arc<Held>, work: F) -> F::Output {
    let scope = Scope(Some(Arc::new(Node {
        held,
        holder: Holder::current(),
        outer: Scope::current(),
    })));
    SCOPE.scope(scope, work).await
}
