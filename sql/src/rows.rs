//! Reading the columns of a lock row back into fenced's types. A value that
//! is not valid (the table was edited by hand) is an error naming it, or,
//! for what is only shown to people, nothing — never a panic.

use fenced_api::{Error, Label, LockKey, Result};

use crate::SqlBackend;

/// The `lock_key` column of a row of backend `B`.
///
/// # Errors
///
/// A non-retryable [`Error::Backend`] naming the value when it is no valid
/// [`LockKey`].
pub fn stored_key<B: SqlBackend>(raw: &[u8]) -> Result<LockKey> {
    std::str::from_utf8(raw)
        .ok()
        .and_then(|k| LockKey::new(k).ok())
        .ok_or_else(|| {
            Error::backend(
                B::BACKEND,
                false,
                format!(
                    "a lock row has an invalid lock_key {:?}; was the table edited by hand?",
                    String::from_utf8_lossy(raw)
                ),
            )
        })
}

/// A `label` column's value. One that is no valid label is shown as none
/// rather than failing `inspect` (it is for people, not for the lock), and
/// logged.
pub fn stored_label(key: &LockKey, raw: &[u8]) -> Option<Label> {
    std::str::from_utf8(raw)
        .map_err(|e| Error::config(e.to_string()))
        .and_then(Label::new)
        .inspect_err(|e| tracing::warn!(key = %key, error = %e, "ignoring an invalid stored label"))
        .ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    type Test = crate::dialect::Plain<sqlx::Sqlite>;

    #[test]
    fn bad_stored_values_are_errors_or_nothing_never_panics() {
        assert_eq!(stored_key::<Test>(b"job:1").unwrap().as_str(), "job:1");
        for raw in [&b""[..], b"a\nb", b"\xff"] {
            match stored_key::<Test>(raw) {
                Err(Error::Backend {
                    backend: "test",
                    retryable: false,
                    ..
                }) => {}
                other => panic!("{raw:?}: {other:?}"),
            }
        }
        let key = LockKey::new("k").unwrap();
        assert_eq!(
            stored_label(&key, b"deploy 42").map(|l| l.as_str().to_owned()),
            Some("deploy 42".to_owned())
        );
        assert!(stored_label(&key, b"\xff").is_none());
    }
}
