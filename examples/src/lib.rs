//! The runnable examples of fenced, as functions the example binaries call
//! and the tests run against every store (`cargo run -p fenced-examples
//! --example <name>`; see `examples/`).
#![forbid(unsafe_code)]
#![warn(missing_docs, missing_debug_implementations, unreachable_pub)]

mod family;
mod jobs;
mod migration;
mod resource;

pub use family::{family, FamilyReport};
pub use jobs::{cron_job, cron_node, quickstart, swap_by_config};
pub use migration::{migrate_mysql_to_redis, Phase};
pub use resource::{fenced_resource, transactional_row_lock, FencedResource};

/// The error type of the examples.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;
