//! The protected resource of the effects check: a counter that lock holders
//! increment by read – work – write, and that rejects writes carrying a
//! fencing token lower than the highest it has seen (Kleppmann's fenced
//! storage).
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

    /// Writes `read.value + 1` with `token`.
    pub fn write(&self, token: u64, read: Read) -> WriteOutcome {
        let mut st = self.state();
        let stale = token < st.highest;
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
