//! The run's clock on the machine's wall clock, for records whose times
//! are the server's wall clock (a ZooKeeper transaction log, PostgreSQL's
//! `clock_timestamp()`): the servers run on this machine, so their wall
//! clock is this process's.

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crate::history::History;

/// The run's clock against the wall clock: a pair of readings taken as
/// close together as this thread manages.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ClockPair {
    run_ns: u64,
    wall_ms: f64,
}

pub(crate) fn clock_pair(history: &History) -> ClockPair {
    let wall = || {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64() * 1e3)
    };
    let mut best: Option<(Duration, ClockPair)> = None;
    for _ in 0..8 {
        let before = Instant::now();
        let run_ns = history.now_ns();
        let wall_ms = wall();
        let spread = before.elapsed();
        if best.is_none_or(|(s, _)| spread < s) {
            best = Some((spread, ClockPair { run_ns, wall_ms }));
        }
    }
    best.map_or(
        ClockPair {
            run_ns: history.now_ns(),
            wall_ms: wall(),
        },
        |(_, p)| p,
    )
}

/// Maps the run's clock (ns) onto the wall clock (ms), linearly between
/// two readings (so a slewing wall clock does not drift the mapping).
#[derive(Debug, Clone, Copy)]
pub struct ClockMap {
    start: ClockPair,
    end: ClockPair,
}

impl ClockMap {
    /// The mapping of a run clock whose ns `run_ns` read the wall clock at
    /// `wall_ms` (one reading: no drift correction).
    pub fn fixed(run_ns: u64, wall_ms: f64) -> ClockMap {
        let p = ClockPair { run_ns, wall_ms };
        ClockMap { start: p, end: p }
    }

    /// The mapping between two readings (the start and the end of a run).
    pub(crate) fn between(start: ClockPair, end: ClockPair) -> ClockMap {
        ClockMap { start, end }
    }

    /// The wall clock (ms since the epoch) at run time `ns`.
    pub fn wall_ms(&self, ns: u64) -> f64 {
        let (a, b) = (self.start, self.end);
        let from_start_ms = (ns as f64 - a.run_ns as f64) / 1e6;
        if b.run_ns <= a.run_ns {
            return a.wall_ms + from_start_ms;
        }
        let rate = (b.wall_ms - a.wall_ms) / ((b.run_ns - a.run_ns) as f64 / 1e6);
        a.wall_ms + from_start_ms * rate
    }
}
