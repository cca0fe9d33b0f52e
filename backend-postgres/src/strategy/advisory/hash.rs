//! The 64-bit advisory lock key of a lock key.
//!
//! `hash = first 8 bytes, big endian, as a signed 64-bit integer, of
//! SHA-256("fenced" ‖ 0x00 ‖ base table name ‖ 0x00 ‖ key)`: the table name
//! keeps namespaces apart (two tables never share an advisory key by
//! construction, C20), and the key is its UTF-8 bytes.
//! [`ADVISORY_KEY_SQL`] is the same formula in SQL, for other languages
//! that want to take the same lock.

use fenced_api::LockKey;
use sha2::{Digest, Sha256};

use crate::config::TableName;

/// The advisory key as a PostgreSQL expression of `$1` (the base table
/// name, `text`) and `$2` (the key, `bytea`; `convert_to(key, 'UTF8')` for
/// a `text` key): what [`advisory_key`] computes. Needs PostgreSQL 11
/// (`sha256`).
///
/// ```sql
/// SELECT pg_advisory_lock(('x' || encode(substr(sha256('\x66656e63656400'::bytea
///     || convert_to('fenced_locks', 'UTF8') || '\x00'::bytea
///     || convert_to('order:1001', 'UTF8')), 1, 8), 'hex'))::bit(64)::bigint);
/// ```
pub const ADVISORY_KEY_SQL: &str = "('x' || encode(substr(sha256(\
     '\\x66656e63656400'::bytea || convert_to($1, 'UTF8') || '\\x00'::bytea || $2), 1, 8), \
     'hex'))::bit(64)::bigint";

/// The 64-bit key of `key`'s advisory lock in the table `table`: the
/// first 8 bytes, big endian, of SHA-256 over `"fenced"`, a zero byte, the
/// base table name, a zero byte and the key's UTF-8 bytes, as a signed
/// integer (what `pg_advisory_lock` takes). For `order:1001` in
/// `fenced_locks` it is -550903650157692581.
pub fn advisory_key(table: &TableName, key: &LockKey) -> i64 {
    key_of(table.as_str(), key.as_bytes())
}

fn key_of(table: &str, key: &[u8]) -> i64 {
    let digest = Sha256::new()
        .chain_update(b"fenced\0")
        .chain_update(table.as_bytes())
        .chain_update([0u8])
        .chain_update(key)
        .finalize();
    let mut first = [0u8; 8];
    first.copy_from_slice(&digest[..8]);
    i64::from_be_bytes(first)
}

/// The `pg_locks` columns a session-level advisory lock on a 64-bit key
/// shows: `classid` the high 32 bits, `objid` the low 32 bits (both as
/// unsigned `oid`s), `objsubid` 1 (2 is the two-`int4` form).
#[cfg(test)]
pub(crate) fn pg_locks_ids(hash: i64) -> (u32, u32) {
    let bits = hash as u64;
    ((bits >> 32) as u32, bits as u32)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Fixed vectors: changing the formula would make two versions of
    /// fenced take different advisory locks for one key.
    #[test]
    fn known_vectors() {
        for (table, key, expected) in [
            ("fenced_locks", "order:1001", -550_903_650_157_692_581),
            ("fenced_locks", "", 2_656_038_477_416_552_808),
            ("jobs", "order:1001", -3_217_789_308_715_160_772),
            ("fenced_locks", "ключ/ü ✓", 8_425_580_411_382_774_710),
        ] {
            assert_eq!(
                key_of(table, key.as_bytes()),
                expected,
                "{table} {key:?}: {:#018x}",
                key_of(table, key.as_bytes())
            );
        }
    }

    #[test]
    fn the_namespace_and_the_separator_count() {
        let k = key_of("t", b"a");
        assert_ne!(k, key_of("u", b"a"));
        assert_ne!(k, key_of("t", b"b"));
        // Table names have no NUL, so the first 0 after the prefix ends the
        // table name: moving bytes between table and key changes the input.
        assert_ne!(key_of("ta", b"b"), key_of("t", b"ab"));
    }

    #[test]
    fn pg_locks_ids_split_the_key() {
        assert_eq!(pg_locks_ids(5), (0, 5));
        // Measured on PostgreSQL 15: pg_advisory_lock(-1234567890123456789)
        // shows classid 4007522059, objid 2182512363, objsubid 1.
        assert_eq!(
            pg_locks_ids(-1_234_567_890_123_456_789),
            (4_007_522_059, 2_182_512_363)
        );
    }
}
