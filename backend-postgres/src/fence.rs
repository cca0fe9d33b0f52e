#![doc = include_str!("../docs/fence.md")]

pub use crate::error::PostgresBackend;
pub use fenced_sql::fence::{FenceOutcome, DEFAULT_FENCE_TABLE};

/// The fence table and its statements, on PostgreSQL. Cheap to clone;
/// holds no connection. The shared implementation
/// ([`fenced_sql::fence::Fence`]) with this crate's error mapping.
pub type Fence = fenced_sql::fence::Fence<PostgresBackend>;
