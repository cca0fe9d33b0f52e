//! The scenarios and the two profiles (smoke, full).

use std::time::Duration;

use serde::{Deserialize, Serialize};

/// What a scenario exercises.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ScenarioKind {
    /// One task, acquire + release in a loop on one key.
    Uncontended,
    /// `tasks` tasks, each on its own key.
    ParallelKeys,
    /// `tasks` tasks on one key.
    Contended,
    /// One client takes `keys` locks, holds them all for `hold`, releases them.
    ManyKeys {
        /// How many locks are held at once.
        keys: usize,
    },
    /// `tasks` child processes on one key, one task each: every hand-off
    /// goes from one process to another, through the store.
    CrossProcess,
    /// `tasks` tasks on one semaphore of `permits` permits.
    Semaphore {
        /// The semaphore's capacity.
        permits: u32,
    },
    /// `tasks` tasks on one reader-writer lock: every `write_every`-th
    /// acquisition of a task is a write (offset by the task's number, so
    /// the writes are spread), the others reads.
    ReadWrite {
        /// One write in this many acquisitions (10: 90 % reads).
        write_every: u32,
    },
}

/// One column of the matrix.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Scenario {
    /// Short unique name (`contended-16-h20-t20`).
    pub name: String,
    /// What it exercises.
    pub kind: ScenarioKind,
    /// Concurrent tasks (each with its own client and connection).
    pub tasks: usize,
    /// Time spent inside the critical section per acquisition.
    #[serde(with = "millis")]
    pub hold: Duration,
    /// Time between a release and the task's next attempt.
    #[serde(with = "millis")]
    pub think: Duration,
    /// How long the cell measures.
    #[serde(with = "millis")]
    pub duration: Duration,
}

mod millis {
    use std::time::Duration;

    pub(super) fn serialize<S: serde::Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_f64(d.as_secs_f64() * 1e3)
    }

    pub(super) fn deserialize<'de, D: serde::Deserializer<'de>>(
        d: D,
    ) -> Result<Duration, D::Error> {
        let ms: f64 = serde::Deserialize::deserialize(d)?;
        Duration::try_from_secs_f64(ms / 1e3).map_err(serde::de::Error::custom)
    }
}

impl Scenario {
    fn new(kind: ScenarioKind, tasks: usize, hold_ms: u64, think_ms: u64, secs: f64) -> Self {
        let name = match kind {
            ScenarioKind::Uncontended => "uncontended".to_owned(),
            ScenarioKind::ParallelKeys => format!("parallel-{tasks}"),
            ScenarioKind::Contended => format!("contended-{tasks}-h{hold_ms}-t{think_ms}"),
            ScenarioKind::ManyKeys { keys } => format!("many-keys-{keys}"),
            ScenarioKind::CrossProcess => format!("xproc-{tasks}-h{hold_ms}-t{think_ms}"),
            ScenarioKind::Semaphore { permits } => {
                format!("semaphore-{permits}-{tasks}-h{hold_ms}-t{think_ms}")
            }
            ScenarioKind::ReadWrite { write_every } => format!(
                "rw-{}r-{tasks}-h{hold_ms}-t{think_ms}",
                100 - 100 / write_every.max(1)
            ),
        };
        Scenario {
            name,
            kind,
            tasks,
            hold: Duration::from_millis(hold_ms),
            think: Duration::from_millis(think_ms),
            duration: Duration::from_secs_f64(secs),
        }
    }

    /// Whether every task contends for one key (hand-offs are measured).
    pub fn shares_one_key(&self) -> bool {
        matches!(
            self.kind,
            ScenarioKind::Contended | ScenarioKind::CrossProcess
        )
    }

    /// Whether it runs a semaphore or a reader-writer lock (one key, held by
    /// several tasks at once).
    pub fn is_family(&self) -> bool {
        matches!(
            self.kind,
            ScenarioKind::Semaphore { .. } | ScenarioKind::ReadWrite { .. }
        )
    }

    /// Whether a bare round trip (a floor, not a lock) can run this scenario.
    pub fn without_exclusion(&self) -> bool {
        matches!(
            self.kind,
            ScenarioKind::Uncontended | ScenarioKind::ParallelKeys
        )
    }
}

/// Processes of the full profile's cross-process cell: a waiter in each of
/// seven others whenever one holds (more would mostly measure the start-up
/// of processes on a 2-CPU machine).
const XPROC_PROCESSES: usize = 8;

/// How long the cell whose hand-off p99 is judged (16 tasks, hold 20 ms,
/// no think) measures. A 2.5 s cell holds about 120 hand-offs, so its p99
/// is the second-slowest one and swings from run to run with one fsync
/// stall of the store; 12 s gives about 550, enough for a p99 to be a
/// percentile.
const HANDOFF_CELL_SECS: f64 = 12.0;

/// Which matrix to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Profile {
    /// A tiny subset (about 10 s for every implementation): what CI runs.
    Smoke,
    /// The whole matrix (about an hour with every backend on 2 cores).
    Full,
}

/// Locks one client holds at once in the full profile's many-keys cell.
const MANY_KEYS: usize = 100_000;

impl Profile {
    /// The scenarios of this profile, in run order.
    pub fn scenarios(self) -> Vec<Scenario> {
        use ScenarioKind::*;
        match self {
            Profile::Smoke => vec![
                Scenario::new(Uncontended, 1, 0, 0, 0.3),
                Scenario::new(Contended, 6, 2, 0, 0.4),
                Scenario::new(ManyKeys { keys: 50 }, 1, 300, 0, 0.3),
                Scenario::new(CrossProcess, 3, 2, 0, 0.4),
                Scenario::new(Semaphore { permits: 2 }, 4, 2, 0, 0.4),
                Scenario::new(ReadWrite { write_every: 4 }, 4, 2, 0, 0.4),
            ],
            Profile::Full => {
                let mut v = vec![
                    Scenario::new(Uncontended, 1, 0, 0, 3.0),
                    Scenario::new(ParallelKeys, 16, 0, 0, 2.0),
                ];
                for tasks in [16, 50] {
                    for hold in [0, 5, 20] {
                        for think in [0, 20] {
                            let secs = if (tasks, hold, think) == (16, 20, 0) {
                                HANDOFF_CELL_SECS
                            } else {
                                2.5
                            };
                            v.push(Scenario::new(Contended, tasks, hold, think, secs));
                        }
                    }
                }
                v.push(Scenario::new(CrossProcess, XPROC_PROCESSES, 5, 0, 4.0));
                v.push(Scenario::new(Semaphore { permits: 4 }, 16, 5, 0, 4.0));
                v.push(Scenario::new(ReadWrite { write_every: 10 }, 16, 5, 0, 4.0));
                // Held 12 s: longer than the 10 s renewal interval of the
                // cell's 30 s TTL, so the last lock taken is renewed too.
                v.push(Scenario::new(
                    ManyKeys { keys: MANY_KEYS },
                    1,
                    12_000,
                    0,
                    12.0,
                ));
                v
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The cell whose hand-off p99 the targets judge holds enough hand-offs
    /// for a percentile: one per hold at most, so duration / hold of them.
    #[test]
    fn the_judged_hand_off_cell_holds_hundreds_of_hand_offs() {
        let full = Profile::Full.scenarios();
        let cell = full
            .iter()
            .find(|s| s.name == "contended-16-h20-t0")
            .expect("the judged cell is in the full profile");
        let most = cell.duration.as_secs_f64() / cell.hold.as_secs_f64();
        assert!(most >= 500.0, "{cell:?} holds at most {most} hand-offs");
        // Every other contended cell stays short: the profile's run time.
        let long = full
            .iter()
            .filter(|s| s.duration > Duration::from_secs(5) && s.kind == ScenarioKind::Contended)
            .count();
        assert_eq!(long, 1);
    }
}
