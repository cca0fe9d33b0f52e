//! The protected resource of the effects check: a counter that lock holders
//! increment by read – work – write, and that rejects writes carrying a
//! fencing token lower than the highest it has seen (Kleppmann's fenced
//! storage).
//!
//! The family cells use it too: a reader-writer lock's readers through
//! [`FencedResource::begin_shared`] / [`FencedResource::end_shared`]
//! (fenced by the writers' tokens), a semaphore's holders through
//! [`FencedResource::enter`] / [`FencedResource::leave`] (N users at once;
//! see [`Primitive`](crate::scenario::Primitive) for why tokens cannot fence a
//! semaphore's users).
//!
//! With fencing off ([`FencedResource::unfenced`]) it accepts every write
//! but still *notices* the stale ones, so a run without fencing shows the
//! violations the check is there to catch — proof that the check can fail.

use std::sync::Mutex;

use serde::{Deserialize, Serialize};

/// What happened to one write.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum WriteOutcome {
    /// Stored; the token was the highest seen so far (or equal to it).
    Accepted,
    /// Refused: a higher token had already written.
    Rejected,
    /// Stored although a higher token had already written (fencing off).
    AcceptedStale,
}

#[derive(Debug, Default)]
struct State {
    value: u64,
    highest: u64,
    accepted: u64,
    rejected: u64,
    accepted_stale: u64,
    /// Writes whose read was overtaken by another accepted write before
    /// they landed: a lost update, whatever the tokens said.
    lost_updates: u64,
    version: u64,
    /// Semaphore cells: the tokens using the resource right now.
    inside: Vec<u64>,
    /// Reader-writer cells: the highest token a reader has started with.
    /// A writer below it is stale (that reader was granted after it, so
    /// its lock had ended); readers are fenced by `highest` alone.
    highest_shared: u64,
}

/// Totals of a run, for the report.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ResourceTotals {
    /// Final counter value.
    pub value: u64,
    /// Writes stored (stale ones included).
    pub accepted: u64,
    /// Writes refused by the token check.
    pub rejected: u64,
    /// Writes stored with a stale token (only possible with fencing off).
    pub accepted_stale: u64,
    /// Stored writes that overwrote an update they had not read.
    pub lost_updates: u64,
}

/// A value read from the resource: what the holder saw, to write back + 1.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Read {
    /// The counter.
    pub value: u64,
    /// Its version, to tell later whether somebody wrote in between.
    pub version: u64,
}

/// The fenced counter. Shared by every client of a run.
#[derive(Debug)]
pub struct FencedResource {
    fencing: bool,
    state: Mutex<State>,
}

impl FencedResource {
    /// A resource that rejects stale tokens (the normal, safe setup).
    pub fn fenced() -> Self {
        FencedResource {
            fencing: true,
            state: Mutex::default(),
        }
    }

    /// A resource that accepts every write (the "can fail" control run).
    pub fn unfenced() -> Self {
        FencedResource {
            fencing: false,
            state: Mutex::default(),
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Reads the counter. A read with a stale token is refused too when
    /// fencing is on (`None`): the holder has lost the lock.
    pub fn read(&self, token: u64) -> Option<Read> {
        let st = self.state();
        if self.fencing && token < st.highest {
            return None;
        }
        Some(Read {
            value: st.value,
            version: st.version,
        })
    }

    /// Writes `read.value + 1` with `token`: stale below the highest token
    /// written with, or below a reader's that started.
    pub fn write(&self, token: u64, read: Read) -> WriteOutcome {
        let mut st = self.state();
        let stale = token < st.highest.max(st.highest_shared);
        if stale && self.fencing {
            st.rejected += 1;
            return WriteOutcome::Rejected;
        }
        if st.version != read.version {
            st.lost_updates += 1;
        }
        st.value = read.value + 1;
        st.version += 1;
        st.highest = st.highest.max(token);
        st.accepted += 1;
        if stale {
            st.accepted_stale += 1;
            WriteOutcome::AcceptedStale
        } else {
            WriteOutcome::Accepted
        }
    }

    /// A reader of a reader-writer lock starts: like [`read`](Self::read)
    /// (refused below the highest token written with). It raises the bar
    /// for writers only — readers hold together, in any token order, but a
    /// writer with a lower token than a reader that got in has lost its
    /// lock (a writer's token exceeds every grant before it).
    pub fn begin_shared(&self, token: u64) -> Option<Read> {
        let mut st = self.state();
        if self.fencing && token < st.highest {
            return None;
        }
        st.highest_shared = st.highest_shared.max(token);
        Some(Read {
            value: st.value,
            version: st.version,
        })
    }

    /// The reader is done with what it read: refused when a writer with a
    /// higher token has written since (the reader had lost its lock to
    /// that writer; fencing on), counted as a lost update when anybody
    /// wrote during the read at all (a writer beside a reader).
    pub fn end_shared(&self, token: u64, read: Read) -> WriteOutcome {
        let mut st = self.state();
        let stale = token < st.highest;
        if stale && self.fencing {
            st.rejected += 1;
            return WriteOutcome::Rejected;
        }
        if st.version != read.version {
            st.lost_updates += 1;
        }
        st.accepted += 1;
        if stale {
            st.accepted_stale += 1;
            WriteOutcome::AcceptedStale
        } else {
            WriteOutcome::Accepted
        }
    }

    /// A semaphore holder starts using the resource, which `capacity`
    /// users may use at once: one more is counted as a stale use
    /// ([`WriteOutcome::AcceptedStale`]), whatever the fencing (the holder
    /// checks its permit before, see
    /// [`Primitive::Semaphore`](crate::scenario::Primitive::Semaphore)).
    pub fn enter(&self, token: u64, capacity: usize) -> WriteOutcome {
        let mut st = self.state();
        let over = st.inside.len() >= capacity;
        st.inside.push(token);
        st.accepted += 1;
        st.value += 1;
        if over {
            st.accepted_stale += 1;
            WriteOutcome::AcceptedStale
        } else {
            WriteOutcome::Accepted
        }
    }

    /// The holder with `token` stops using the resource.
    pub fn leave(&self, token: u64) {
        let mut st = self.state();
        if let Some(i) = st.inside.iter().position(|t| *t == token) {
            st.inside.swap_remove(i);
        }
    }

    /// A holder refused to use the resource (its permit was past its safe
    /// deadline): counted with the refused stale writes.
    pub fn refused_by_holder(&self) {
        self.state().rejected += 1;
    }

    /// The totals so far.
    pub fn totals(&self) -> ResourceTotals {
        let st = self.state();
        ResourceTotals {
            value: st.value,
            accepted: st.accepted,
            rejected: st.rejected,
            accepted_stale: st.accepted_stale,
            lost_updates: st.lost_updates,
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn fenced_resource_rejects_an_overtaken_holder() {
        let r = FencedResource::fenced();
        let old = r.read(1).unwrap();
        let new = r.read(2).unwrap();
        assert_eq!(r.write(2, new), WriteOutcome::Accepted);
        assert_eq!(r.write(1, old), WriteOutcome::Rejected);
        assert!(r.read(1).is_none());
        let t = r.totals();
        assert_eq!(
            (t.value, t.accepted, t.rejected, t.lost_updates),
            (1, 1, 1, 0)
        );
    }

    #[test]
    fn readers_share_and_a_later_writer_refuses_an_earlier_reader() {
        let r = FencedResource::fenced();
        let (a, b) = (r.begin_shared(3).unwrap(), r.begin_shared(2).unwrap());
        assert_eq!(r.end_shared(3, a), WriteOutcome::Accepted);
        let stale = r.begin_shared(4).unwrap();
        let w = r.read(5).unwrap();
        assert_eq!(r.write(5, w), WriteOutcome::Accepted);
        assert_eq!(r.end_shared(4, stale), WriteOutcome::Rejected);
        assert_eq!(r.end_shared(2, b), WriteOutcome::Rejected);
        let u = FencedResource::unfenced();
        let stale = u.begin_shared(1).unwrap();
        let w = u.read(2).unwrap();
        assert_eq!(u.write(2, w), WriteOutcome::Accepted);
        assert_eq!(u.end_shared(1, stale), WriteOutcome::AcceptedStale);
        assert_eq!((u.totals().accepted_stale, u.totals().lost_updates), (1, 1));
    }

    #[test]
    fn a_writer_overtaken_by_readers_only_is_refused() {
        // The writer (token 5) lost its lock while paused; only readers
        // (6, 7) got in since: its write must not land.
        let r = FencedResource::fenced();
        let w = r.read(5).unwrap();
        let reader = r.begin_shared(6).unwrap();
        assert_eq!(r.end_shared(6, reader), WriteOutcome::Accepted);
        assert_eq!(r.write(5, w), WriteOutcome::Rejected);
        // A later writer is not held back by earlier readers.
        let w2 = r.read(8).unwrap();
        assert_eq!(r.write(8, w2), WriteOutcome::Accepted);
        let u = FencedResource::unfenced();
        let w = u.read(5).unwrap();
        let _ = u.begin_shared(6).unwrap();
        assert_eq!(u.write(5, w), WriteOutcome::AcceptedStale);
    }

    #[test]
    fn a_use_beyond_capacity_is_counted() {
        let r = FencedResource::fenced();
        assert_eq!(r.enter(1, 2), WriteOutcome::Accepted);
        assert_eq!(r.enter(2, 2), WriteOutcome::Accepted);
        assert_eq!(r.enter(3, 2), WriteOutcome::AcceptedStale);
        r.leave(1);
        r.leave(3);
        assert_eq!(r.enter(4, 2), WriteOutcome::Accepted);
        assert_eq!(r.totals().accepted_stale, 1);
    }

    #[test]
    fn unfenced_resource_shows_the_lost_update() {
        let r = FencedResource::unfenced();
        let old = r.read(1).unwrap();
        let new = r.read(2).unwrap();
        assert_eq!(r.write(2, new), WriteOutcome::Accepted);
        assert_eq!(r.write(1, old), WriteOutcome::AcceptedStale);
        let t = r.totals();
        assert_eq!(t.value, 1, "two increments, one survived");
        assert_eq!((t.accepted_stale, t.lost_updates), (1, 1));
    }
}
