//! `fenced-bench`: the runner behind `fenced bench`.
//!
//! It measures every fenced backend (through the drivers the caller passes in,
//! normally `fenced::drivers()`) side by side with the locks users would pick
//! instead — bench-only baselines written here: the raw round-trip floor of
//! each server, MySQL `GET_LOCK`, the textbook naive unique-key lock (INSERT,
//! fixed 100 ms retry sleep, DELETE), the textbook row lock (BEGIN / SELECT …
//! FOR UPDATE / COMMIT), the `rslock` crate on Redis, etcd's Lock RPC, the
//! `zookeeper-client` crate's lock recipe, and on PostgreSQL a raw advisory
//! lock pair, sqlx's `PgAdvisoryLock` and ShedLock's statements; for
//! semaphores and reader-writer locks, PostgreSQL advisory slots and shared
//! advisory locks, a Redis counter and MySQL `GET_LOCK` slots.
//!
//! A run is a matrix of [`Implementation`]s × [`Scenario`]s; each cell is
//! time-bounded and yields one [`CellResult`] (one JSON line). Every task has
//! its own client and connection. Cross-process cells run each task in a
//! child process (the running executable started again with the same
//! arguments): a binary that runs them calls [`child_main`] before anything
//! else. Numbers are printed and written, never asserted: the only checks
//! ([`CellResult::violations`], [`CellResult::errors`]) are about
//! correctness.
//!
//! ```no_run
//! # async fn demo(drivers: Vec<fenced_api::Driver>) -> Result<(), fenced_bench::BenchError> {
//! use fenced_bench::{Profile, Servers};
//! let servers = Servers::from_env();
//! let impls = fenced_bench::implementations(&drivers, &servers, &[]).await?;
//! let results = fenced_bench::run(&impls, &Profile::Smoke.scenarios(), &servers, &mut |_| {}).await;
//! for r in &results {
//!     assert_eq!(r.violations, 0);
//! }
//! # Ok(()) }
//! ```
#![forbid(unsafe_code)]
#![warn(missing_docs, missing_debug_implementations, unreachable_pub)]

mod error;
mod family;
mod fenced_impl;
mod peers;
mod readme;
mod report;
mod runner;
mod scenario;
mod stats;
mod svg;
mod xproc;

pub use error::BenchError;
pub use fenced_impl::implementations;
pub use readme::{readme_summary, replace_readme_summary, README_MARKERS};
pub use report::{markdown, read_jsonl, summary_table, write_jsonl, MachineInfo};
pub use runner::{run, ChildSpec, Implementation, Locker, Progress, Role};
pub use scenario::{Profile, Scenario, ScenarioKind};
pub use stats::{CellResult, Kind, ManyKeys, Servers};
pub use svg::write_plots;
pub use xproc::{child_main, ENV as CHILD_ENV};
