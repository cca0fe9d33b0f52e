//! Helpers shared by the runnable examples of fenced (`cargo run -p
//! fenced-examples --example tour`).
#![forbid(unsafe_code)]
#![warn(missing_docs, missing_debug_implementations, unreachable_pub)]

use std::sync::Mutex;

use fenced::FencingToken;

/// A stand-in for the resource a lock protects (a database row, a file, an
/// object store key) that does the one thing fencing needs: it remembers the
/// highest token it has seen and rejects writes carrying a lower one.
///
/// In SQL this is `UPDATE t SET v = ?, fence = ? WHERE id = ? AND fence <= ?`.
///
/// ```
/// use fenced::FencingToken;
/// use fenced_examples::FencedResource;
///
/// let r = FencedResource::default();
/// r.write(FencingToken::new(2), "from the new holder")?;
/// assert!(r.write(FencingToken::new(1), "from a paused ex-holder").is_err());
/// assert_eq!(r.values(), vec!["from the new holder".to_string()]);
/// # Ok::<(), String>(())
/// ```
#[derive(Debug, Default)]
pub struct FencedResource {
    state: Mutex<(u64, Vec<String>)>,
}

impl FencedResource {
    /// Applies `value` if `token` is at least the highest token seen so far.
    ///
    /// # Errors
    ///
    /// A message naming both tokens when the write is stale.
    pub fn write(&self, token: FencingToken, value: &str) -> Result<(), String> {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if token.get() < state.0 {
            return Err(format!(
                "rejected stale write with token {token}: token {} was already seen",
                state.0
            ));
        }
        state.0 = token.get();
        state.1.push(value.to_owned());
        Ok(())
    }

    /// The accepted values, in order.
    pub fn values(&self) -> Vec<String> {
        self.state
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .1
            .clone()
    }
}
