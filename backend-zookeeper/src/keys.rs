//! Znode naming: where the queue of a lock lives, and how its entries are
//! named and ordered.
//!
//! The queue of `key` is the container `<namespace>/k<encoded key>`; each
//! holder or waiter is one ephemeral sequential child `<nonce>-<sequence>`.
//! The encoding maps every [`LockKey`] to exactly one valid znode name and
//! back: `/`, `%` and every character ZooKeeper refuses in a path are
//! percent-encoded (UTF-8 bytes as `%XX`), and the leading `k` means no name
//! is ever `.` or `..`. The nonce, fresh for each attempt, lets an acquirer
//! whose create reply was lost find (and delete) its node.

use fenced_api::LockKey;

use crate::config::allowed_in_path;

/// The znode names of one namespace.
#[derive(Debug, Clone)]
pub(crate) struct Keys {
    namespace: String,
}

impl Keys {
    pub(crate) fn new(namespace: &str) -> Keys {
        Keys {
            namespace: namespace.to_owned(),
        }
    }

    /// The namespace znode: the parent of every queue.
    pub(crate) fn namespace(&self) -> &str {
        &self.namespace
    }

    /// `<namespace>/k<encoded key>`: the queue of `key`.
    pub(crate) fn queue(&self, key: &LockKey) -> String {
        format!("{}/{}", self.namespace, encode(key))
    }

    /// `<namespace>/p<encoded key>`: the semaphore line of `key`, a
    /// namespace apart from its lock queue.
    pub(crate) fn permit_queue(&self, key: &LockKey) -> String {
        format!("{}/p{}", self.namespace, &encode(key)[1..])
    }
}

/// The key of a semaphore line's znode name (`p<encoded key>`).
pub(crate) fn decode_permit_queue(name: &str) -> Option<LockKey> {
    decode(&format!("k{}", name.strip_prefix('p')?))
}

/// The prefix of a new semaphore entry's name: `<nonce>-<capacity>.<weight>-`
/// (it starts as a lock entry's, so an entry whose create reply was lost is
/// found by its nonce alike); ZooKeeper appends the sequence.
pub(crate) fn permit_entry_prefix(nonce: &str, capacity: u32, weight: u32) -> String {
    format!("{}{capacity}.{weight}-", entry_prefix(nonce))
}

/// The (capacity, weight) in a semaphore entry's name.
pub(crate) fn permit_sizes(name: &str) -> Option<(u32, u32)> {
    let (rest, _sequence) = name.rsplit_once('-')?;
    let (_nonce, sizes) = rest.rsplit_once('-')?;
    let (c, w) = sizes.split_once('.')?;
    Some((c.parse().ok()?, w.parse().ok()?))
}

/// The znode name of a key's queue.
pub(crate) fn encode(key: &LockKey) -> String {
    let mut out = String::with_capacity(key.as_str().len() + 1);
    out.push('k');
    for c in key.as_str().chars() {
        if c == '/' || c == '%' || !allowed_in_path(c) {
            let mut buf = [0u8; 4];
            for b in c.encode_utf8(&mut buf).bytes() {
                out.push_str(&format!("%{b:02X}"));
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// The key of a queue's znode name; `None` for a name this encoding never
/// produces (a node written by hand).
pub(crate) fn decode(name: &str) -> Option<LockKey> {
    let encoded = name.strip_prefix('k')?;
    let key = fenced_api::url::percent_decode(encoded).ok()?;
    let key = LockKey::new(key).ok()?;
    (encode(&key) == name).then_some(key)
}

/// The prefix of a new entry's name (`<nonce>-`); ZooKeeper appends the
/// ten-digit sequence.
pub(crate) fn entry_prefix(nonce: &str) -> String {
    format!("{nonce}-")
}

/// The sequence number of an entry's name (`<nonce>-<sequence>`).
pub(crate) fn sequence(name: &str) -> Option<i64> {
    name.rsplit_once('-')?.1.parse().ok()
}

/// The entries of a queue in creation order (by sequence); names that are
/// not entries are left out.
pub(crate) fn in_order(mut children: Vec<String>) -> Vec<String> {
    children.retain(|c| sequence(c).is_some());
    children.sort_by_key(|c| sequence(c).unwrap_or(i64::MAX));
    children
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;

    #[test]
    fn permit_lines_and_entries() {
        let keys = Keys::new("/ns");
        let key = LockKey::new("a/b").unwrap();
        assert_eq!(keys.permit_queue(&key), "/ns/pa%2Fb");
        assert_eq!(decode_permit_queue("pa%2Fb"), Some(key.clone()));
        assert_eq!(decode("pa%2Fb"), None, "never read as a lock queue");
        let name = format!("{}0000000007", permit_entry_prefix("abc", 1 << 30, 1));
        assert_eq!(name, "abc-1073741824.1-0000000007");
        assert_eq!(permit_sizes(&name), Some((1 << 30, 1)));
        assert_eq!(sequence(&name), Some(7));
        assert!(name.starts_with(&entry_prefix("abc")));
        assert_eq!(permit_sizes("abc-0000000007"), None);
    }

    #[test]
    fn every_key_round_trips_to_one_valid_name() {
        let keys = [
            "a",
            "a/b",
            "/",
            "%",
            "%2F",
            "_",
            "\\",
            "'\"",
            "a b",
            "日本語",
            ".",
            "..",
            "k",
            "x\u{fff5}y",
            "🦀",
            "a\u{10ffff}",
            "\u{e000}",
            "a%b/c",
        ];
        let mut names = std::collections::HashSet::new();
        for k in keys {
            let key = LockKey::new(k).unwrap();
            let name = encode(&key);
            assert!(
                !name.contains('/') && name != "." && name != "..",
                "{k}: {name}"
            );
            assert!(name.chars().all(allowed_in_path), "{k}: {name}");
            assert_eq!(decode(&name), Some(key), "{k}");
            assert!(names.insert(name), "{k} collides");
        }
        assert_eq!(decode("zzz"), None);
        assert_eq!(decode("k%2f"), None, "only the canonical spelling");
        let ks = Keys::new("/ns/x");
        let key = LockKey::new("a/b").unwrap();
        assert_eq!(ks.queue(&key), "/ns/x/ka%2Fb");
    }

    #[test]
    fn entries_sort_by_sequence_not_by_nonce() {
        let order = in_order(vec![
            "b-0000000002".into(),
            "a-0000000010".into(),
            "c-0000000001".into(),
            "junk".into(),
        ]);
        assert_eq!(order, ["c-0000000001", "b-0000000002", "a-0000000010"]);
    }
}
