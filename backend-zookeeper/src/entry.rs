//! The data of a queue entry: who holds or waits, for how long, and why.
//!
//! Three lines: the owner, the TTL in milliseconds, then the label (empty
//! when the holder gave none). Neither an owner nor a label contains a
//! control character, so the newlines always separate the fields.

use std::time::Duration;

use fenced_api::{Label, LockKey, LockOptions, Owner, Result};

use crate::error;

/// The data to create an entry with.
pub(crate) fn data(owner: &Owner, ttl: Duration, label: Option<&Label>) -> Vec<u8> {
    format!(
        "{}\n{}\n{}",
        owner.as_str(),
        ttl.as_millis(),
        label.map(Label::as_str).unwrap_or_default()
    )
    .into_bytes()
}

/// What an entry's data says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Entry {
    pub(crate) owner: Owner,
    pub(crate) ttl: Duration,
    pub(crate) label: Option<Label>,
}

/// The owner part of an entry's data, as bytes.
pub(crate) fn owner_bytes(data: &[u8]) -> &[u8] {
    data.split(|b| *b == b'\n').next().unwrap_or(data)
}

/// Decodes an entry's data. Data with no valid owner (written by hand)
/// gives a random owner; a missing TTL reads as zero; an invalid label as
/// none — it is for people, not for the lock.
pub(crate) fn decode(data: &[u8]) -> Entry {
    let text = String::from_utf8_lossy(data);
    let mut parts = text.splitn(3, '\n');
    let owner = Owner::new(parts.next().unwrap_or_default()).unwrap_or_else(|_| Owner::random());
    let ttl = parts
        .next()
        .and_then(|t| t.parse::<u64>().ok())
        .map_or(Duration::ZERO, Duration::from_millis);
    let label = parts
        .next()
        .filter(|l| !l.is_empty())
        .and_then(|l| Label::new(l).ok());
    Entry { owner, ttl, label }
}

/// Refuses an acquire whose explicit owner already holds `key` (`holder`
/// is the holder entry's data): owner reentrancy is not offered here.
pub(crate) fn check_reentry(
    key: &LockKey,
    opts: &LockOptions,
    holder: Option<&[u8]>,
) -> Result<()> {
    match (opts.owner(), holder.map(owner_bytes)) {
        (Some(owner), Some(h)) if h == owner.as_str().as_bytes() => {
            Err(opts.refuse_reentry(error::BACKEND, key))
        }
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;

    #[test]
    fn data_round_trips() {
        let owner = Owner::new("o|1 é").unwrap();
        let label = Label::new("web 1 %_'\"日本").unwrap();
        let ttl = Duration::from_millis(2500);
        let d = data(&owner, ttl, Some(&label));
        assert_eq!(owner_bytes(&d), owner.as_str().as_bytes());
        let e = decode(&d);
        assert_eq!((e.owner, e.ttl, e.label), (owner.clone(), ttl, Some(label)));
        let e = decode(&data(&owner, ttl, None));
        assert_eq!(e.label, None);
        assert_eq!(decode(b"").ttl, Duration::ZERO);
    }
}
