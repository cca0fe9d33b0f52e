//! Family cells: `tasks` tasks on one semaphore or one reader-writer lock.
//!
//! Each task takes the key in its [`Role`] (a permit; or a read, and every
//! `write_every`-th time a write), holds it, releases it, until the window
//! closes. What the tasks hold at once is counted in this process: more
//! permit holders than permits, or a writer beside anyone, is a violation.

use std::{
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc,
    },
    time::Duration,
};

use tokio::time::Instant;

use crate::{
    runner::{finish, setup, Implementation, Locker, Role, TaskOutcome, DRAIN},
    stats::{self, CellResult, Rec, Servers},
    BenchError, Scenario, ScenarioKind,
};

/// Who holds the key now, in this process.
#[derive(Debug, Default)]
struct Holding {
    permits: AtomicUsize,
    readers: AtomicUsize,
    writers: AtomicUsize,
}

impl Holding {
    /// Counts a new holder in `role`; whether that broke the bound.
    fn enter(&self, role: Role) -> bool {
        match role {
            Role::Permit(n) => self.permits.fetch_add(1, Ordering::SeqCst) >= n as usize,
            // Each side counts itself first, then looks at the other: of a
            // reader and a writer that overlap, at least one sees the other.
            Role::Read => {
                self.readers.fetch_add(1, Ordering::SeqCst);
                self.writers.load(Ordering::SeqCst) > 0
            }
            Role::Write => {
                let writers = self.writers.fetch_add(1, Ordering::SeqCst);
                writers > 0 || self.readers.load(Ordering::SeqCst) > 0
            }
        }
    }

    fn leave(&self, role: Role) {
        let counter = match role {
            Role::Permit(_) => &self.permits,
            Role::Read => &self.readers,
            Role::Write => &self.writers,
        };
        counter.fetch_sub(1, Ordering::SeqCst);
    }
}

/// The role of task `task`'s `n`-th acquisition in scenario `s`.
fn role(s: &Scenario, task: usize, n: u64) -> Role {
    match s.kind {
        ScenarioKind::Semaphore { permits } => Role::Permit(permits),
        ScenarioKind::ReadWrite { write_every } => {
            let every = u64::from(write_every.max(1));
            if (n + task as u64).is_multiple_of(every) {
                Role::Write
            } else {
                Role::Read
            }
        }
        _ => Role::Permit(1),
    }
}

/// One family cell (see the module docs).
pub(crate) async fn cell(imp: &dyn Implementation, s: &Scenario, servers: &Servers) -> CellResult {
    let (lockers, key) = match setup(imp, s).await {
        Ok(v) => v,
        Err(r) => return r,
    };
    let holding = Arc::new(Holding::default());
    let cmds_before = stats::commands(imp.server(), servers).await;
    let start = Instant::now();
    let deadline = start + s.duration;
    let give_up = deadline + DRAIN;
    let mut handles = Vec::with_capacity(s.tasks);
    for (task, mut locker) in lockers.into_iter().enumerate() {
        let (key, holding, s) = (key.clone(), Arc::clone(&holding), s.clone());
        handles.push(tokio::spawn(async move {
            task_loop(
                locker.as_mut(),
                &key,
                task,
                &s,
                (deadline, give_up),
                &holding,
            )
            .await
        }));
    }
    let mut all = TaskOutcome::default();
    let mut write_waits = Vec::new();
    for h in handles {
        match h.await {
            Ok((t, w)) => {
                all.merge(t);
                write_waits.extend(w);
            }
            Err(e) => all.error(BenchError::new(format!("task panicked: {e}"))),
        }
    }
    let cmds_after = stats::commands(imp.server(), servers).await;
    let mut r = CellResult::empty(imp.name(), imp.kind(), s);
    if matches!(s.kind, ScenarioKind::ReadWrite { .. }) {
        r.write_wait_p99_ms = stats::write_wait_p99(write_waits);
    }
    finish(&mut r, all, s, (start, deadline), (cmds_before, cmds_after));
    r
}

/// One task: take the key in its role, hold, release, think, until
/// `deadline`; also returns the waits of its writes.
async fn task_loop(
    locker: &mut dyn Locker,
    key: &str,
    task: usize,
    s: &Scenario,
    (deadline, give_up): (Instant, Instant),
    holding: &Holding,
) -> (TaskOutcome, Vec<Duration>) {
    let mut t = TaskOutcome::default();
    let mut write_waits = Vec::new();
    let mut n = 0u64;
    while Instant::now() < deadline {
        let role = role(s, task, n);
        n += 1;
        let t0 = Instant::now();
        match locker.acquire_as(key, role, give_up).await {
            Ok(true) => {}
            Ok(false) => {
                t.abandoned += 1;
                break;
            }
            Err(e) => {
                t.error(e);
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        }
        let t1 = Instant::now();
        if role == Role::Write {
            write_waits.push(t1 - t0);
        }
        if holding.enter(role) {
            t.violations += 1;
        }
        if t1 < deadline && !s.hold.is_zero() {
            tokio::time::sleep(s.hold).await;
        }
        let t2 = Instant::now();
        holding.leave(role);
        if let Err(e) = locker.release(key).await {
            t.error(e);
        }
        let t3 = Instant::now();
        t.recs.push(Rec {
            task,
            t0,
            t1,
            t2,
            t3,
        });
        if !s.think.is_zero() && Instant::now() < deadline {
            tokio::time::sleep(s.think).await;
        }
    }
    (t, write_waits)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bounds_are_counted() {
        let h = Holding::default();
        assert!(!h.enter(Role::Permit(2)));
        assert!(!h.enter(Role::Permit(2)));
        assert!(h.enter(Role::Permit(2)), "a third permit of two");
        let h = Holding::default();
        assert!(!h.enter(Role::Read));
        assert!(!h.enter(Role::Read));
        assert!(h.enter(Role::Write), "a writer beside readers");
        h.leave(Role::Write);
        h.leave(Role::Read);
        h.leave(Role::Read);
        assert!(!h.enter(Role::Write));
        assert!(h.enter(Role::Read), "a reader beside a writer");
    }

    #[test]
    fn one_acquisition_in_ten_is_a_write() {
        let s = crate::Profile::Full
            .scenarios()
            .into_iter()
            .find(|s| matches!(s.kind, ScenarioKind::ReadWrite { .. }))
            .expect("a reader-writer cell");
        let writes = (0..16)
            .flat_map(|task| (0..100).map(move |n| (task, n)))
            .filter(|&(task, n)| role(&s, task, n) == Role::Write)
            .count();
        assert_eq!(writes, 160);
        assert!(s.name.starts_with("rw-90r-16"), "{}", s.name);
    }
}
