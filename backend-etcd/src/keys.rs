//! Key naming: where the line of a lock lives, and how one entry of a line
//! is picked.
//!
//! The line of `key` is the entries `<prefix>\0lock\0<key>\0<owner>`, one
//! per holder or waiter, ordered by create revision. NUL cannot occur in
//! keys, owners or prefixes, so `a` and `a/b` — or prefixes `x` and
//! `x/lock` — never overlap, and in etcd's key order the entries of one key
//! are contiguous.
//!
//! Semaphores and reader-writer locks live beside them, in lines of their
//! own: `<prefix>\0permits\0<key>\0<owner>` (module `permits`).

use etcd_client::{GetOptions, SortOrder, SortTarget};
use fenced_api::LockKey;

/// The key names of one namespace (prefix).
#[derive(Debug, Clone)]
pub(crate) struct Keys {
    /// `<prefix>\0lock\0`.
    lines: Vec<u8>,
    /// `<prefix>\0permits\0`.
    permits: Vec<u8>,
}

impl Keys {
    pub(crate) fn new(prefix: &str) -> Keys {
        let named = |role: &[u8]| {
            let mut p = prefix.as_bytes().to_vec();
            p.push(0);
            p.extend_from_slice(role);
            p.push(0);
            p
        };
        Keys {
            lines: named(b"lock"),
            permits: named(b"permits"),
        }
    }

    /// `<prefix>\0lock\0`: what every line of the namespace starts with.
    pub(crate) fn lines(&self) -> &[u8] {
        &self.lines
    }

    /// `<prefix>\0lock\0<key>\0`: the line of `key` — its holder and its
    /// waiters, one entry each.
    pub(crate) fn line(&self, key: &LockKey) -> Vec<u8> {
        line_in(&self.lines, key)
    }

    /// `<prefix>\0lock\0<key>\0<owner>`: the entry of one owner in the line.
    pub(crate) fn entry(&self, key: &LockKey, owner: &[u8]) -> Vec<u8> {
        let mut p = self.line(key);
        p.extend_from_slice(owner);
        p
    }

    /// `<prefix>\0permits\0`: what every semaphore line starts with.
    pub(crate) fn permit_lines(&self) -> &[u8] {
        &self.permits
    }

    /// `<prefix>\0permits\0<key>\0`: the semaphore line of `key`.
    pub(crate) fn permit_line(&self, key: &LockKey) -> Vec<u8> {
        line_in(&self.permits, key)
    }

    /// `<prefix>\0permits\0<key>\0<owner>`: one owner's entry in it.
    pub(crate) fn permit_entry(&self, key: &LockKey, owner: &[u8]) -> Vec<u8> {
        let mut p = self.permit_line(key);
        p.extend_from_slice(owner);
        p
    }
}

fn line_in(base: &[u8], key: &LockKey) -> Vec<u8> {
    let mut p = Vec::with_capacity(base.len() + key.as_bytes().len() + 1 + 36);
    p.extend_from_slice(base);
    p.extend_from_slice(key.as_bytes());
    p.push(0);
    p
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
        assert_eq!(
            keys.permit_entry(&k, b"me"),
            b"app\0permits\0a/b\0me".to_vec()
        );
    }
}
