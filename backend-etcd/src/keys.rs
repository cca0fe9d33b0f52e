//! Key naming: where the line of a lock lives, and how one entry of a line
//! is picked.
//!
//! The line of `key` is the entries `<prefix>\0lock\0<key>\0<owner>`, one
//! per holder or waiter, ordered by create revision. NUL cannot occur in
//! keys, owners or prefixes, so `a` and `a/b` — or prefixes `x` and
//! `x/lock` — never overlap, and in etcd's key order the entries of one key
//! are contiguous.

use etcd_client::{GetOptions, SortOrder, SortTarget};
use fenced_api::LockKey;

/// The key names of one namespace (prefix).
#[derive(Debug, Clone)]
pub(crate) struct Keys {
    /// `<prefix>\0lock\0`.
    lines: Vec<u8>,
}

impl Keys {
    pub(crate) fn new(prefix: &str) -> Keys {
        let mut lines = prefix.as_bytes().to_vec();
        lines.extend_from_slice(b"\0lock\0");
        Keys { lines }
    }

    /// `<prefix>\0lock\0`: what every line of the namespace starts with.
    pub(crate) fn lines(&self) -> &[u8] {
        &self.lines
    }

    /// `<prefix>\0lock\0<key>\0`: the line of `key` — its holder and its
    /// waiters, one entry each.
    pub(crate) fn line(&self, key: &LockKey) -> Vec<u8> {
        let mut p = Vec::with_capacity(self.lines.len() + key.as_bytes().len() + 1 + 36);
        p.extend_from_slice(&self.lines);
        p.extend_from_slice(key.as_bytes());
        p.push(0);
        p
    }

    /// `<prefix>\0lock\0<key>\0<owner>`: the entry of one owner in the line.
    pub(crate) fn entry(&self, key: &LockKey, owner: &[u8]) -> Vec<u8> {
        let mut p = self.line(key);
        p.extend_from_slice(owner);
        p
    }
}

/// The oldest entry of a line: the holder.
pub(crate) fn oldest() -> GetOptions {
    by_creation(SortOrder::Ascend)
}

/// The newest entry of a line (the last in line).
pub(crate) fn newest() -> GetOptions {
    by_creation(SortOrder::Descend)
}

/// The newest entry of a line created before `revision` (a waiter's
/// predecessor).
pub(crate) fn newest_before(revision: i64) -> GetOptions {
    by_creation(SortOrder::Descend).with_max_create_revision(revision - 1)
}

fn by_creation(order: SortOrder) -> GetOptions {
    GetOptions::new()
        .with_prefix()
        .with_sort(SortTarget::Create, order)
        .with_limit(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_and_entries_are_nul_separated() {
        let keys = Keys::new("app");
        let k = LockKey::new("a/b").unwrap();
        assert_eq!(keys.lines(), b"app\0lock\0");
        assert_eq!(keys.line(&k), b"app\0lock\0a/b\0".to_vec());
        assert_eq!(keys.entry(&k, b"me"), b"app\0lock\0a/b\0me".to_vec());
    }
}
