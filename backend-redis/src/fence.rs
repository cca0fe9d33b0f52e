//! Resource-side fencing for values kept in Redis: `SET` only if the
//! writer's fencing token is at least the highest token seen for the key.
//!
//! A lock alone cannot stop a holder that was paused (GC, SIGSTOP, a slow
//! network) past its TTL: it wakes up still believing it holds the lock and
//! writes, while the next holder — granted a higher token — writes too. The
//! protected value has to refuse the late write. [`set`] does that in one
//! Lua script, so the comparison and the write are atomic: no other command
//! runs between them.
//!
//! ```no_run
//! use fenced_api::LockClient;
//! use fenced_redis::{fence, redis};
//!
//! # async fn run(client: LockClient) -> Result<(), Box<dyn std::error::Error>> {
//! let redis = redis::Client::open("redis://cache.internal:6379")?;
//! let mut conn = redis.get_multiplexed_async_connection().await?;
//!
//! let guard = client.acquire("report:daily").await?;
//! let report = "…";                               // built while holding the lock
//! // … the process may be paused here for longer than the TTL …
//! match fence::set(&mut conn, "report:daily", report, guard.token()).await? {
//!     fence::FenceOutcome::Accepted => {}         // written
//!     fence::FenceOutcome::Stale { highest } => {
//!         // A newer holder (token `highest`) has written: ours was dropped.
//!     }
//! }
//! let current = fence::get(&mut conn, "report:daily").await?; // value + its token
//! # Ok(()) }
//! ```
//!
//! # How it works
//!
//! Beside the value key `K`, a **fence key** ([`fence_key`]) keeps the
//! highest accepted token as a decimal string. The script reads it, refuses
//! a lower token (writing nothing), and otherwise writes the value and then
//! the token. Tokens are compared exactly over the whole `u64` range (as
//! digit strings: Lua's numbers are exact only below 2^53), so tokens from
//! any store work, not only Redis's own.
//!
//! The fence key has **no expiry**, even when the value has one
//! ([`set_with_ttl`]): it is the memory of the highest token, and a
//! forgotten fence lets a stale holder in again. Delete both keys together
//! when the value is retired for good. Like every key, it is lost when a
//! Redis without persistence restarts (the value with it), and a failover to
//! a replica may lose its latest raise: fence data that must survive those
//! belongs in a database ([`fenced_mysql::fence`], [`fenced_sqlite::fence`]).
//!
//! The fence key is in the value's hash slot, so the script runs in a Redis
//! Cluster too (where a script may only touch one slot): `{tag}:fence:K`,
//! with `tag` the part of `K` Redis Cluster hashes (its `{…}` hash tag, or
//! all of `K`). A key that has no hash tag and contains `}` has no such
//! name, and is refused.
//!
//! Only writes through [`set`] are fenced: a plain `SET K` by anyone else
//! bypasses the check.
//!
//! [`fenced_mysql::fence`]: https://docs.rs/fenced-mysql/latest/fenced_mysql/fence/
//! [`fenced_sqlite::fence`]: https://docs.rs/fenced-sqlite/latest/fenced_sqlite/fence/

use std::{sync::LazyLock, time::Duration};

use fenced_api::{Error, FencingToken, Result};
use redis::{aio::ConnectionLike, Script, Value};

use crate::{error, keys::hash_tag, scripts};

static FENCE_SET: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("../scripts/fence_set.lua")));

/// The verdict of a fenced write (shared by every fencing helper).
pub use fenced_api::fence::FenceOutcome;

/// A value written by [`set`], with the token of its writer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FencedValue {
    /// The value, as stored.
    pub value: Vec<u8>,
    /// The highest accepted token for the key — the token of the write that
    /// stored `value`.
    pub token: FencingToken,
}

/// The name of `key`'s fence key: `{tag}:fence:<key>`, in `key`'s hash slot.
///
/// ```
/// use fenced_redis::fence::fence_key;
/// assert_eq!(fence_key("report:daily")?, "{report:daily}:fence:report:daily");
/// assert_eq!(fence_key("{user:7}:profile")?, "{user:7}:fence:{user:7}:profile");
/// # Ok::<(), fenced_api::Error>(())
/// ```
///
/// # Errors
///
/// [`Error::InvalidKey`] for an empty key, and for a key with no hash tag
/// that contains `}` (no name in its slot can be built: give it a tag).
pub fn fence_key(key: &str) -> Result<String> {
    if key.is_empty() {
        return Err(Error::InvalidKey {
            reason: "the fenced redis key is empty".into(),
        });
    }
    let tag = match hash_tag(key) {
        Some(tag) => tag,
        None if !key.contains('}') => key,
        None => {
            return Err(Error::InvalidKey {
                reason: format!(
                    "the fenced redis key {key:?} contains `}}` but has no hash tag, so no \
                     fence key can share its cluster slot; give it one, e.g. \"{{name}}:rest\""
                ),
            })
        }
    };
    // The tag holds no `}` and is not empty, so the new name's tag is it;
    // the whole key follows, so distinct keys get distinct fence keys.
    Ok(format!("{{{tag}}}:fence:{key}"))
}

/// Writes `value` under `key` if `token` is at least the highest token seen
/// for `key` (equal included: the same holder writing twice); a key never
/// written accepts any token. Atomic: one script.
///
/// The value has no expiry (an existing one is cleared, as by `SET`); see
/// [`set_with_ttl`].
///
/// # Errors
///
/// [`Error::InvalidKey`] for a key [`fence_key`] refuses and
/// [`Error::InvalidOptions`] for token 0, which no store grants — both
/// before any I/O; [`Error::Backend`] when Redis fails, or when the fence
/// key holds something that is not a token.
pub async fn set(
    conn: &mut impl ConnectionLike,
    key: &str,
    value: impl AsRef<[u8]>,
    token: FencingToken,
) -> Result<FenceOutcome> {
    write(conn, key, value.as_ref(), token, 0).await
}

/// [`set`], with the value expiring after `ttl` (whole milliseconds,
/// rounded up). The fence key never expires.
///
/// # Errors
///
/// As [`set`]; also [`Error::InvalidOptions`] for a zero `ttl`.
pub async fn set_with_ttl(
    conn: &mut impl ConnectionLike,
    key: &str,
    value: impl AsRef<[u8]>,
    token: FencingToken,
    ttl: Duration,
) -> Result<FenceOutcome> {
    if ttl.is_zero() {
        return Err(Error::invalid_options(
            "the ttl of a fenced value must be above zero",
        ));
    }
    write(conn, key, value.as_ref(), token, scripts::millis_ceil(ttl)).await
}

async fn write(
    conn: &mut impl ConnectionLike,
    key: &str,
    value: &[u8],
    token: FencingToken,
    px: u64,
) -> Result<FenceOutcome> {
    let fence = fence_key(key)?;
    fenced_api::fence::check_token(token)?;
    let reply: Value = FENCE_SET
        .key(key)
        .key(&fence)
        .arg(token.get().to_string())
        .arg(value)
        .arg(px)
        .invoke_async(conn)
        .await
        .map_err(error::map)?;
    parse_set(reply, token)
}

fn parse_set(reply: Value, token: FencingToken) -> Result<FenceOutcome> {
    let bad = |items: &dyn std::fmt::Debug| {
        error::protocol(format!("unexpected reply to the fence script: {items:?}"))
    };
    let Value::Array(items) = reply else {
        return Err(bad(&reply));
    };
    let highest = items
        .get(1)
        .and_then(scripts::text)
        .and_then(|t| t.parse::<u64>().ok());
    match (items.first().and_then(scripts::int), highest) {
        (Some(1), Some(t)) if t == token.get() => Ok(FenceOutcome::Accepted),
        (Some(0), Some(h)) if h > token.get() => Ok(FenceOutcome::Stale {
            highest: FencingToken::new(h),
        }),
        _ => Err(bad(&items)),
    }
}

/// The value under `key` and the token of the write that stored it, or
/// `None` when there is no value (never written, expired or deleted).
/// One `MGET`, so value and token are read at one instant.
///
/// # Errors
///
/// As [`set`]; also [`Error::Backend`] when a value exists without a fence
/// (it was written by something other than [`set`]).
pub async fn get(conn: &mut impl ConnectionLike, key: &str) -> Result<Option<FencedValue>> {
    let fence = fence_key(key)?;
    let (value, token): (Option<Vec<u8>>, Option<String>) = redis::cmd("MGET")
        .arg(key)
        .arg(&fence)
        .query_async(conn)
        .await
        .map_err(error::map)?;
    let Some(value) = value else {
        return Ok(None);
    };
    let token = parse_token(token.as_deref(), &fence)?.ok_or_else(|| {
        error::protocol(format!(
            "`{key}` has a value but no fence key `{fence}`: it was not written by fence::set"
        ))
    })?;
    Ok(Some(FencedValue { value, token }))
}

/// The highest token accepted for `key`, if any.
///
/// # Errors
///
/// As [`get`].
pub async fn highest(conn: &mut impl ConnectionLike, key: &str) -> Result<Option<FencingToken>> {
    let fence = fence_key(key)?;
    let token: Option<String> = redis::cmd("GET")
        .arg(&fence)
        .query_async(conn)
        .await
        .map_err(error::map)?;
    parse_token(token.as_deref(), &fence)
}

fn parse_token(token: Option<&str>, fence: &str) -> Result<Option<FencingToken>> {
    token
        .map(|t| {
            t.parse::<u64>()
                .ok()
                .filter(|t| *t >= 1)
                .map(FencingToken::new)
                .ok_or_else(|| {
                    error::protocol(format!(
                        "unexpected value under `{fence}` (not a fencing token): {t:?}"
                    ))
                })
        })
        .transpose()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slot(name: &str) -> u16 {
        crate::keys::cluster_slot(name)
    }

    #[test]
    fn fence_keys_share_the_slot_and_never_collide() {
        assert_eq!(slot("123456789"), 0x31C3);
        let keys = [
            "k",
            "{k}",
            "{k}x",
            "x{k}",
            "a{b",
            "{",
            "{}",
            "{a}{b}",
            "{{a}}",
            "鍵-🔒",
            "a:fence:b",
            "{a}:fence:b",
        ];
        let mut seen = std::collections::HashMap::new();
        for k in keys {
            let Ok(f) = fence_key(k) else {
                assert!(k.contains('}'), "{k} refused");
                continue;
            };
            assert_eq!(slot(&f), slot(k), "{k} -> {f}");
            assert!(!keys.contains(&f.as_str()), "{k} -> {f} is another key");
            if let Some(prev) = seen.insert(f.clone(), k) {
                panic!("{prev} and {k} share the fence key {f}");
            }
        }
        assert_eq!(fence_key("k").unwrap(), "{k}:fence:k");
        assert_eq!(fence_key("{k}x").unwrap(), "{k}:fence:{k}x");
        for bad in ["", "a}b", "a{}b", "}{"] {
            assert!(
                matches!(fence_key(bad), Err(Error::InvalidKey { .. })),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn set_replies() {
        let t = FencingToken::new(7);
        let bulk = |s: &str| Value::BulkString(s.as_bytes().to_vec());
        assert_eq!(
            parse_set(Value::Array(vec![Value::Int(1), bulk("7")]), t).unwrap(),
            FenceOutcome::Accepted
        );
        assert_eq!(
            parse_set(
                Value::Array(vec![Value::Int(0), bulk("18446744073709551615")]),
                t
            )
            .unwrap(),
            FenceOutcome::Stale {
                highest: FencingToken::new(u64::MAX)
            }
        );
        for bad in [
            Value::Nil,
            Value::Array(vec![Value::Int(1), bulk("8")]),
            Value::Array(vec![Value::Int(0), bulk("7")]),
            Value::Array(vec![Value::Int(0), bulk("x")]),
            Value::Array(vec![Value::Int(2), bulk("9")]),
        ] {
            assert!(parse_set(bad.clone(), t).is_err(), "{bad:?}");
        }
    }
}
