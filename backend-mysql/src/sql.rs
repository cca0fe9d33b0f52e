//! The statement macro and the batch size of this crate's SQL, shared with
//! the other SQL backends through `fenced-sql`.

pub(crate) use fenced_sql::{sql, EXTEND_CHUNK};
