//! Validated lock keys.

use std::{fmt, str::FromStr, sync::Arc};

use crate::{Error, Result};

/// A validated lock name, such as `"order:1001"` or `"job/refresh-cache"`.
///
/// # Rules
///
/// * 1 to [`LockKey::MAX_LEN`] (255) **bytes** of UTF-8;
/// * no control characters (`\0`, `\n`, `\t`, DEL, C1 controls…), because they
///   break logs, protocols and key-space listings;
/// * everything else is allowed and kept **byte-exact**: quotes, `%`, `_`, `\`,
///   spaces (including trailing ones), slashes and non-ASCII. Backends must
///   never fold case, trim, normalise Unicode or treat `%`/`_` as patterns, so
///   `Lock` / `lock`, `a` / `a ` and the NFC / NFD forms of `é` are different
///   keys everywhere.
///
/// Validation happens before any I/O: an invalid key never reaches a store.
///
/// ```
/// use fenced_api::LockKey;
///
/// let key = LockKey::new("order:1001")?;
/// assert_eq!(key.as_str(), "order:1001");
/// assert!(LockKey::new("").is_err());
/// assert!(LockKey::new("bad\nkey").is_err());
/// # Ok::<(), fenced_api::Error>(())
/// ```
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LockKey(Arc<str>);

impl LockKey {
    /// The longest key accepted, in bytes (fits an indexed `VARBINARY(255)`).
    pub const MAX_LEN: usize = 255;

    /// Validates `key` and wraps it.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidKey`] when the key is empty, longer than
    /// [`LockKey::MAX_LEN`] bytes, or contains a control character.
    pub fn new(key: impl AsRef<str>) -> Result<Self> {
        let key = key.as_ref();
        validate(key)?;
        Ok(LockKey(Arc::from(key)))
    }

    /// The key as a string slice, exactly as given.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The key's UTF-8 bytes, exactly as given.
    pub fn as_bytes(&self) -> &[u8] {
        self.0.as_bytes()
    }
}

fn validate(key: &str) -> Result<()> {
    let invalid = |reason: String| Err(Error::InvalidKey { reason });
    if key.is_empty() {
        return invalid("the key is empty; give every lock a non-empty name".into());
    }
    if key.len() > LockKey::MAX_LEN {
        return invalid(format!(
            "the key is {} bytes long; the maximum is {} bytes (hash longer names before locking)",
            key.len(),
            LockKey::MAX_LEN
        ));
    }
    if let Some((at, c)) = key.char_indices().find(|(_, c)| c.is_control()) {
        return invalid(format!(
            "the key contains the control character {:?} at byte {at}; control characters are not allowed",
            c
        ));
    }
    Ok(())
}

impl fmt::Display for LockKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for LockKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&*self.0, f)
    }
}

impl AsRef<str> for LockKey {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

impl FromStr for LockKey {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        LockKey::new(s)
    }
}

impl TryFrom<&str> for LockKey {
    type Error = Error;
    fn try_from(s: &str) -> Result<Self> {
        LockKey::new(s)
    }
}

impl TryFrom<String> for LockKey {
    type Error = Error;
    fn try_from(s: String) -> Result<Self> {
        LockKey::new(s)
    }
}

/// Anything that can name a lock: `&str`, `String`, or an already validated
/// [`LockKey`]. Lets [`LockClient`](crate::LockClient) take `"order:1"`
/// directly while still validating before any I/O.
pub trait IntoLockKey {
    /// Validates and converts.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidKey`] as described on [`LockKey`].
    fn into_lock_key(self) -> Result<LockKey>;
}

impl IntoLockKey for LockKey {
    fn into_lock_key(self) -> Result<LockKey> {
        Ok(self)
    }
}

impl IntoLockKey for &LockKey {
    fn into_lock_key(self) -> Result<LockKey> {
        Ok(self.clone())
    }
}

impl IntoLockKey for &str {
    fn into_lock_key(self) -> Result<LockKey> {
        LockKey::new(self)
    }
}

impl IntoLockKey for String {
    fn into_lock_key(self) -> Result<LockKey> {
        LockKey::new(self)
    }
}

impl IntoLockKey for &String {
    fn into_lock_key(self) -> Result<LockKey> {
        LockKey::new(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_awkward_but_legal_keys() {
        for k in [
            "a",
            "order:1001",
            "it's \"quoted\"",
            "100%_done",
            r"back\slash",
            "with space ",
            " leading",
            "naïve-ключ-鍵-🔒",
            "a/b/c",
            "`drop table x;--",
        ] {
            let key = LockKey::new(k).unwrap();
            assert_eq!(key.as_str(), k, "kept byte-exact");
        }
        let max = "x".repeat(LockKey::MAX_LEN);
        assert!(LockKey::new(&max).is_ok());
        // 4-byte characters count as 4 bytes.
        let emoji = "🔒".repeat(63); // 252 bytes
        assert!(LockKey::new(&emoji).is_ok());
        assert!(LockKey::new(format!("{emoji}🔒")).is_err());
    }

    #[test]
    fn rejects_bad_keys_with_clear_reasons() {
        let cases: [(String, &str); 6] = [
            (String::new(), "empty"),
            ("x".repeat(256), "256 bytes"),
            ("a\0b".into(), "control character"),
            ("line\nbreak".into(), "control character"),
            ("tab\there".into(), "control character"),
            ("c1\u{85}".into(), "control character"),
        ];
        for (k, want) in cases {
            match LockKey::new(&k) {
                Err(Error::InvalidKey { reason }) => {
                    assert!(reason.contains(want), "{reason:?} should mention {want:?}")
                }
                other => panic!("{k:?}: expected InvalidKey, got {other:?}"),
            }
        }
    }

    #[test]
    fn distinct_spellings_stay_distinct() {
        let nfc = LockKey::new("\u{e9}").unwrap();
        let nfd = LockKey::new("e\u{301}").unwrap();
        assert_ne!(nfc, nfd);
        assert_ne!(LockKey::new("Lock").unwrap(), LockKey::new("lock").unwrap());
        assert_ne!(LockKey::new("a").unwrap(), LockKey::new("a ").unwrap());
    }

    #[test]
    fn conversions() {
        let k: LockKey = "x".parse().unwrap();
        assert_eq!(k, LockKey::try_from("x").unwrap());
        assert_eq!(k, LockKey::try_from(String::from("x")).unwrap());
        assert_eq!(k, (&k).into_lock_key().unwrap());
        assert_eq!(format!("{k}"), "x");
        assert_eq!(format!("{k:?}"), "\"x\"");
        assert!("".into_lock_key().is_err());
    }
}
