//! The bench's error type: a message, since errors are counted and reported, not matched.

use std::fmt;

/// Something failed while setting up or running a benchmark cell.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BenchError(pub String);

impl BenchError {
    /// An error with this message.
    pub fn new(msg: impl Into<String>) -> Self {
        BenchError(msg.into())
    }
}

impl fmt::Display for BenchError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for BenchError {}

impl From<fenced_api::Error> for BenchError {
    fn from(e: fenced_api::Error) -> Self {
        BenchError(e.to_string())
    }
}

impl From<sqlx::Error> for BenchError {
    fn from(e: sqlx::Error) -> Self {
        BenchError(format!("mysql: {e}"))
    }
}

impl From<redis::RedisError> for BenchError {
    fn from(e: redis::RedisError) -> Self {
        BenchError(format!("redis: {e}"))
    }
}

impl From<std::io::Error> for BenchError {
    fn from(e: std::io::Error) -> Self {
        BenchError(format!("io: {e}"))
    }
}
