//! Case outcomes and the assertion helpers cases use.

use std::fmt;

/// How a case ended when it did not fail.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Every check held.
    Passed,
    /// The backend truthfully lacks what the case needs (declared in its
    /// `Capabilities` or harness); the reason says what.
    Skipped(String),
}

/// Why a case failed: a message that says what was expected and what happened.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failure(pub String);

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Failure {}

impl From<fenced_api::Error> for Failure {
    fn from(e: fenced_api::Error) -> Self {
        Failure(format!("unexpected error: {e}"))
    }
}

/// The result of one case.
pub type CaseResult = Result<Outcome, Failure>;

/// Fails the case with a formatted message unless `cond` holds.
macro_rules! ensure {
    ($cond:expr, $($msg:tt)+) => {
        if !$cond {
            return Err($crate::check::Failure(format!($($msg)+)));
        }
    };
}
pub(crate) use ensure;

/// Fails the case with a formatted message.
macro_rules! fail {
    ($($msg:tt)+) => {
        return Err($crate::check::Failure(format!($($msg)+)))
    };
}
pub(crate) use fail;

/// Unwraps an `Option` or fails with a message.
pub(crate) fn some<T>(v: Option<T>, what: &str) -> Result<T, Failure> {
    v.ok_or_else(|| Failure(format!("expected {what}, got None")))
}
