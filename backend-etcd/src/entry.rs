//! The value of a line entry: who holds or waits.
//!
//! The owner, then — when the holder gave one — a newline and its label.
//! Neither an owner nor a label contains a control character, so the first
//! newline always ends the owner; a value without one is an owner alone
//! and reads as unlabelled. The entry's path names the owner too
//! (`<prefix>\0lock\0<key>\0<owner>`), so guards compare paths and create
//! revisions, never values.

use fenced_api::{permits::Permits, Label, LockKey, LockOptions, Owner, Result};

use crate::error;

/// Who an entry is: its owner and label.
pub(crate) type Holder = (Owner, Option<Label>);

/// The value to put for an entry.
pub(crate) fn value(owner: &Owner, label: Option<&Label>) -> Vec<u8> {
    let mut v = owner.as_str().as_bytes().to_vec();
    if let Some(label) = label {
        v.push(b'\n');
        v.extend_from_slice(label.as_str().as_bytes());
    }
    v
}

/// The owner part of a value, as bytes.
pub(crate) fn owner_bytes(value: &[u8]) -> &[u8] {
    value.split(|b| *b == b'\n').next().unwrap_or(value)
}

/// The owner and label of a value. A value with no valid owner (the store
/// was written by hand) gives a random owner; an invalid label is shown as
/// none — it is for people, not for the lock.
pub(crate) fn decode(key: &LockKey, value: &[u8]) -> Holder {
    let owner = owner_bytes(value);
    let owner = Owner::new(String::from_utf8_lossy(owner)).unwrap_or_else(|_| Owner::random());
    let label = value.get(owner_len(value) + 1..).and_then(|l| {
        std::str::from_utf8(l).ok().and_then(|l| {
            Label::new(l)
                .inspect_err(
                    |e| tracing::warn!(key = %key, error = %e, "ignoring an invalid stored label"),
                )
                .ok()
        })
    });
    (owner, label)
}

fn owner_len(value: &[u8]) -> usize {
    owner_bytes(value).len()
}

/// The value to put for a semaphore entry: the owner, a newline, the
/// capacity and weight (`<capacity> <weight>`), then — when given — a
/// newline and the label. The owner comes first, as in a lock's value, so
/// the ownership checks of extend read both alike.
pub(crate) fn permit_value(owner: &Owner, permits: Permits, label: Option<&Label>) -> Vec<u8> {
    let mut v = owner.as_str().as_bytes().to_vec();
    v.extend_from_slice(format!("\n{} {}", permits.capacity(), permits.weight()).as_bytes());
    if let Some(label) = label {
        v.push(b'\n');
        v.extend_from_slice(label.as_str().as_bytes());
    }
    v
}

/// A semaphore entry's value decoded: owner and label as [`decode`] reads
/// a lock's, and the (capacity, weight) — `None` when the value has none (the
/// store was written by hand).
pub(crate) fn decode_permit(key: &LockKey, value: &[u8]) -> (Holder, Option<(u32, u32)>) {
    let owner = owner_bytes(value);
    let rest = value.get(owner.len() + 1..).unwrap_or_default();
    let (sizes, label) = match rest.iter().position(|b| *b == b'\n') {
        Some(nl) => (&rest[..nl], &rest[nl..]),
        None => (rest, &rest[rest.len()..]),
    };
    let parsed = std::str::from_utf8(sizes).ok().and_then(|s| {
        let (c, w) = s.split_once(' ')?;
        Some((c.parse().ok()?, w.parse().ok()?))
    });
    // `label` is empty or starts with the newline after the sizes: the
    // same shape as a lock's value after its owner.
    let mut as_lock = owner.to_vec();
    as_lock.extend_from_slice(label);
    (decode(key, &as_lock), parsed)
}

/// Refuses an acquire whose explicit owner already holds `key` (the holder's
/// entry value is `holder`): owner reentrancy is not offered here.
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
    use super::*;

    #[test]
    fn values_round_trip_and_plain_owners_read_unlabelled() {
        let key = LockKey::new("k").unwrap();
        let owner = Owner::new("o|1 é").unwrap();
        let label = Label::new("web 1\u{a0}%_'\"日本").unwrap();
        let v = value(&owner, Some(&label));
        assert_eq!(owner_bytes(&v), owner.as_str().as_bytes());
        assert_eq!(decode(&key, &v), (owner.clone(), Some(label)));
        // Written without a label.
        let plain = value(&owner, None);
        assert_eq!(plain, owner.as_str().as_bytes());
        assert_eq!(decode(&key, &plain), (owner.clone(), None));
        // An empty label part is no label.
        let mut empty = plain.clone();
        empty.push(b'\n');
        assert_eq!(decode(&key, &empty), (owner, None));
    }

    #[test]
    fn permit_values_round_trip() {
        let key = LockKey::new("k").unwrap();
        let owner = Owner::new("o 1").unwrap();
        let label = Label::new("web 1").unwrap();
        let p = Permits::semaphore(4).unwrap();
        let v = permit_value(&owner, p, Some(&label));
        assert_eq!(owner_bytes(&v), owner.as_str().as_bytes());
        assert_eq!(
            decode_permit(&key, &v),
            ((owner.clone(), Some(label)), Some((4, 1)))
        );
        let w = Permits::write();
        let v = permit_value(&owner, w, None);
        assert_eq!(
            decode_permit(&key, &v),
            ((owner.clone(), None), Some((w.capacity(), w.weight())))
        );
        // Written by hand: no sizes.
        assert_eq!(decode_permit(&key, b"o 1").1, None);
        assert_eq!(decode_permit(&key, b"o 1\nfour 1").1, None);
    }
}
