//! Where a lock lives in Redis: one hash tag per (prefix, key).

use fenced_api::LockKey;

use crate::config::Prefix;

/// The Redis names of one lock. Both share the hash tag `{prefix/key}`, so
/// in a Redis Cluster they sit in one slot and every script touches one node.
///
/// The mapping is injective: the prefix cannot contain `/` (it ends at the
/// first one), and every name is the tag followed by a two-byte role, so no
/// (prefix, key, role) triple can spell another's name — whatever the key
/// contains, `{`, `}`, `:`, `*`, `%` and non-ASCII included. Keys are used
/// byte-exact and never as patterns.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Keys {
    /// The state string: last token, hold count, expiry, holder (see
    /// `scripts/prelude.lua`).
    pub(crate) lock: String,
    /// Waiters in arrival order: zset of entry → arrival time (µs, server clock).
    pub(crate) queue: String,
    /// The key's semaphore or reader-writer lock: a hash of its line (see
    /// `scripts/permits.lua`).
    pub(crate) permits: String,
}

impl Keys {
    pub(crate) fn new(prefix: &Prefix, key: &LockKey) -> Self {
        let (p, k) = (prefix.as_str(), key.as_str());
        let mut lock = String::with_capacity(p.len() + k.len() + 5);
        lock.push('{');
        lock.push_str(p);
        lock.push('/');
        lock.push_str(k);
        lock.push_str("}:l");
        let mut queue = lock.clone();
        queue.pop();
        queue.push('q');
        let mut permits = lock.clone();
        permits.pop();
        permits.push('p');
        Keys {
            lock,
            queue,
            permits,
        }
    }

    /// The names of the lock whose state key is `lock` (as a hand-over
    /// message names it), or `None` for a name this crate never writes.
    pub(crate) fn from_lock(lock: &str) -> Option<Self> {
        let tag = lock.strip_suffix(":l")?;
        if !(tag.starts_with('{') && tag.ends_with('}') && tag.contains('/')) {
            return None;
        }
        Some(Keys {
            lock: lock.to_owned(),
            queue: format!("{tag}:q"),
            permits: format!("{tag}:p"),
        })
    }
}

impl Keys {
    /// A Cluster client's wake-up channel for this key: `{prefix/key}` then
    /// `suffix` (`:w:<client>`), in the key's slot.
    pub(crate) fn channel(&self, suffix: &str) -> String {
        let tag = self.lock.strip_suffix(":l").unwrap_or(&self.lock);
        format!("{tag}{suffix}")
    }
}

/// The wake-up channel of one client (one [`RedisLock`](crate::RedisLock)
/// instance): `{prefix/}:w:<id>`. A lock key is never empty, so no lock's
/// tag is `{prefix/}`; channels are not keys, and Redis Cluster does not
/// hash them.
pub(crate) fn wake_channel(prefix: &Prefix, client: &str) -> String {
    format!("{{{}/}}:w:{client}", prefix.as_str())
}

/// What Redis Cluster hashes of a key name: the text between the first `{`
/// and the first `}` after it, when not empty (the rules of CLUSTER KEYSLOT).
pub(crate) fn hash_tag(name: &str) -> Option<&str> {
    let open = name.find('{')?;
    let len = name[open + 1..].find('}')?;
    (len > 0).then(|| &name[open + 1..open + 1 + len])
}

/// The cluster slot of a key name (CRC16/XMODEM of its hashed part, mod
/// 16384), for tests that check which keys share a slot.
#[cfg(test)]
pub(crate) fn cluster_slot(name: &str) -> u16 {
    let mut crc: u16 = 0;
    for &b in hash_tag(name).unwrap_or(name).as_bytes() {
        crc ^= u16::from(b) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
        }
    }
    crc % 16384
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slot(name: &str) -> u16 {
        cluster_slot(name)
    }

    #[test]
    fn slot_function_matches_redis() {
        // Values from the Redis Cluster specification / CLUSTER KEYSLOT.
        assert_eq!(slot("123456789"), 0x31C3);
        assert_eq!(slot("{user1000}.following"), slot("{user1000}.followers"));
        assert_eq!(slot("foo{}{bar}"), slot("foo{}{bar}"));
        assert_ne!(hash_tag("foo{}{bar}"), Some("bar"));
    }

    #[test]
    fn every_name_of_a_lock_is_in_one_slot() {
        let p = Prefix::new("app:locks").unwrap();
        for k in [
            "order:1001",
            "a}b",
            "}start",
            "{x}",
            "{",
            "}",
            "鍵-🔒",
            "100%_*?[a]",
        ] {
            let keys = Keys::new(&p, &LockKey::new(k).unwrap());
            let tag = hash_tag(&keys.lock);
            assert_eq!(hash_tag(&keys.queue), tag, "{k}: {}", keys.queue);
            assert_eq!(slot(&keys.queue), slot(&keys.lock), "{k}");
            assert!(keys.lock.contains(k), "byte-exact key inside {}", keys.lock);
            assert_eq!(Keys::from_lock(&keys.lock), Some(keys.clone()), "{k}");
        }
    }

    #[test]
    fn names_never_collide() {
        let mut seen = std::collections::HashMap::new();
        let prefixes = ["a", "a:b", "a.b", "fenced"];
        let keys = [
            "b:c", "c", "x}:l", "x", "x}:f", "b", "a/b", "/", "x ", "X", "e\u{301}", "\u{e9}",
        ];
        for p in prefixes {
            let prefix = Prefix::new(p).unwrap();
            for k in keys {
                let names = Keys::new(&prefix, &LockKey::new(k).unwrap());
                for (role, name) in [("lock", &names.lock), ("queue", &names.queue)] {
                    if let Some(prev) = seen.insert(name.clone(), (p, k, role)) {
                        panic!("{name} is both {prev:?} and {:?}", (p, k, role));
                    }
                }
            }
        }
    }

    #[test]
    fn wake_channels_are_no_lock_names() {
        let p = Prefix::new("app").unwrap();
        let ch = wake_channel(&p, "0123abcd");
        assert_eq!(ch, "{app/}:w:0123abcd");
        assert!(Keys::from_lock(&ch).is_none());
        for bad in ["x:l", "{a}:l", "{a/b}:q", "{a/b}"] {
            assert!(Keys::from_lock(bad).is_none(), "{bad}");
        }
        // An empty lock key is refused, so no lock's tag is `{prefix/}`.
        assert!(LockKey::new("").is_err());
    }
}
