//! MySQL/MariaDB server truth from the binary log (work in progress).

use crate::{history::ServerGrant, scenario::Target};

/// The binary-log record of one MySQL run.
#[derive(Debug)]
pub struct BinlogLog {
    _target: Target,
}

impl BinlogLog {
    /// Starts recording, or `None` when the run uses the shared server
    /// (no binary log).
    ///
    /// # Errors
    ///
    /// When the private server cannot be used.
    pub async fn start(_target: Target, _url: &str) -> Result<Option<BinlogLog>, String> {
        Ok(None)
    }

    /// The grants the binary log shows.
    ///
    /// # Errors
    ///
    /// When the log cannot be read.
    pub async fn finish(self) -> Result<Vec<ServerGrant>, String> {
        Ok(Vec::new())
    }
}
