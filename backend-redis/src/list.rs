//! `list`: the held locks of one prefix, found with `SCAN`.
//!
//! Every lock's state key is `{prefix/key}:l` (see [`Keys`](crate::keys::Keys)),
//! so `SCAN … MATCH {prefix/*}:l` (the prefix escaped) finds them all, in
//! batches of [`SCAN_COUNT`] slots — never `KEYS`, which blocks the server.
//! Each name found is read with the `inspect` script (pipelined, one round
//! trip per batch): a state key outlives its hold (it keeps the last token),
//! so only the ones with a current lease are held. Names come back from the
//! server byte-exact and are mapped back to their keys by stripping the tag,
//! so keys containing `*`, `?`, `[`, `{`, `}` are listed as they are. In a
//! Redis Cluster every primary is walked in turn ([`Scan`]), and each batch
//! is read on the node that returned it.

use std::collections::BTreeMap;

use fenced_api::{LockInfo, LockKey, Result};
use redis::Value;

use crate::{
    config::Prefix,
    conn::{Conn, Node},
    error, scripts,
};

/// Slots walked by one `SCAN` call (its `COUNT`).
pub(crate) const SCAN_COUNT: usize = 1000;

/// `literal` as a Redis glob matching exactly itself: every byte that is
/// not an ASCII letter or digit is escaped with `\` (which makes any byte
/// literal, `*`, `?`, `[`, `]`, `\` and `^` included).
pub(crate) fn glob_escape(literal: &str) -> String {
    let mut out = String::with_capacity(literal.len() * 2);
    for c in literal.chars() {
        if !c.is_ascii_alphanumeric() {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

/// The `MATCH` pattern of every state key under `prefix`: `{prefix/*}:l`.
pub(crate) fn state_pattern(prefix: &Prefix) -> String {
    role_pattern(prefix, "l")
}

/// The SCAN pattern of every name of `role` (`l`, `p`) under `prefix`.
pub(crate) fn role_pattern(prefix: &Prefix, role: &str) -> String {
    format!(
        "{}*{}",
        glob_escape(&format!("{{{}/", prefix.as_str())),
        glob_escape(&format!("}}:{role}"))
    )
}

/// The key whose state key is `name`, or `None` for a name this crate
/// never writes under `prefix`.
pub(crate) fn key_of(prefix: &Prefix, name: &[u8]) -> Option<LockKey> {
    key_of_role(prefix, name, "l")
}

/// The lock key of the name `name` of `role`, or `None` for another name.
pub(crate) fn key_of_role(prefix: &Prefix, name: &[u8], role: &str) -> Option<LockKey> {
    let head = format!("{{{}/", prefix.as_str());
    let rest = name.strip_prefix(head.as_bytes())?;
    let key = rest.strip_suffix(format!("}}:{role}").as_bytes())?;
    LockKey::new(std::str::from_utf8(key).ok()?).ok()
}

/// The held locks under `conn`'s prefix, at most `limit`, sorted by key:
/// [`DistributedLock::list`](fenced_api::DistributedLock::list) on
/// [`RedisLock`](crate::RedisLock); see the module docs.
pub(crate) async fn held(conn: &Conn, limit: usize) -> Result<Vec<LockInfo>> {
    if limit == 0 {
        return Ok(Vec::new());
    }
    let prefix = &conn.config().prefix;
    let mut scan = Scan::new(conn, state_pattern(prefix)).await?;
    // By key: SCAN may return a name twice (the table was resized while
    // scanning); the second reading replaces the first.
    let mut held: BTreeMap<LockKey, LockInfo> = BTreeMap::new();
    while let Some((mut node, names)) = scan.next().await? {
        let found: Vec<(Vec<u8>, LockKey)> = names
            .into_iter()
            .filter_map(|n| key_of(prefix, &n).map(|k| (n, k)))
            .collect();
        if !found.is_empty() {
            let mut pipe = redis::pipe();
            pipe.load_script(&scripts::INSPECT).ignore();
            for (name, _) in &found {
                pipe.invoke_script(&scripts::INSPECT.key(name.as_slice()));
            }
            let replies: Vec<Value> = conn
                .bounded(
                    "the inspect scripts of a listing",
                    pipe.query_async(&mut node),
                )
                .await?;
            if replies.len() != found.len() {
                return Err(error::protocol(format!(
                    "{} replies to {} inspect scripts",
                    replies.len(),
                    found.len()
                )));
            }
            for ((name, key), reply) in found.into_iter().zip(replies) {
                let Some(h) = scripts::parse_inspect(reply)? else {
                    continue;
                };
                let info = h.info(&key, &String::from_utf8_lossy(&name))?;
                held.insert(key, info);
            }
        }
        if held.len() >= limit {
            break;
        }
    }
    Ok(held.into_values().take(limit).collect())
}

/// A `SCAN … MATCH pattern` over every primary in turn (one server, or each
/// Cluster primary), one batch per call, each call bounded by the operation
/// timeout; the walk as a whole is not.
pub(crate) struct Scan<'a> {
    conn: &'a Conn,
    pattern: String,
    nodes: std::vec::IntoIter<Node>,
    /// The node being walked and the cursor to go on from.
    current: Option<(Node, u64)>,
}

impl<'a> Scan<'a> {
    pub(crate) async fn new(conn: &'a Conn, pattern: String) -> Result<Scan<'a>> {
        let link = conn.manager();
        let nodes = conn
            .bounded("CLUSTER SLOTS", async { link.primaries().await })
            .await?;
        Ok(Scan {
            conn,
            pattern,
            nodes: nodes.into_iter(),
            current: None,
        })
    }

    /// The next batch of names and the node that holds them; `None` once
    /// every node was walked.
    pub(crate) async fn next(&mut self) -> Result<Option<(Node, Vec<Vec<u8>>)>> {
        let (mut node, cursor) = match self.current.take() {
            Some(current) => current,
            None => match self.nodes.next() {
                Some(node) => (node, 0),
                None => return Ok(None),
            },
        };
        let (next, names): (u64, Vec<Vec<u8>>) = self
            .conn
            .bounded(
                "SCAN",
                redis::cmd("SCAN")
                    .arg(cursor)
                    .arg("MATCH")
                    .arg(&self.pattern)
                    .arg("COUNT")
                    .arg(SCAN_COUNT)
                    .query_async(&mut node),
            )
            .await?;
        if next != 0 {
            self.current = Some((node.clone(), next));
        }
        Ok(Some((node, names)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::keys::Keys;

    #[test]
    fn glob_escape_leaves_only_alphanumerics_bare() {
        assert_eq!(
            glob_escape("a*b?c[d]e\\f^g{h}i"),
            r"a\*b\?c\[d\]e\\f\^g\{h\}i"
        );
        assert_eq!(glob_escape("Az09"), "Az09");
        assert_eq!(
            state_pattern(&Prefix::new("app:x-1").unwrap()),
            r"\{app\:x\-1\/*\}\:l"
        );
    }

    #[test]
    fn names_map_back_to_their_keys_byte_exact() {
        let p = Prefix::new("app").unwrap();
        for k in ["a", "*", "a}:l", "{x}", "[ab]?", "}:q", "鍵 %_\\", "/"] {
            let key = LockKey::new(k).unwrap();
            let name = Keys::new(&p, &key).lock;
            assert_eq!(key_of(&p, name.as_bytes()), Some(key), "{name}");
            let queue = Keys::new(&p, &LockKey::new(k).unwrap()).queue;
            assert_eq!(key_of(&p, queue.as_bytes()), None, "{queue}");
        }
        let other = Prefix::new("app2").unwrap();
        let name = Keys::new(&other, &LockKey::new("a").unwrap()).lock;
        assert_eq!(key_of(&p, name.as_bytes()), None);
    }

    /// On the real server: the escaped pattern matches its literal and
    /// none of the names its unescaped glob characters would match.
    #[tokio::test]
    async fn the_escaped_pattern_matches_only_its_literal_on_the_server() {
        let url = fenced_conformance::services::redis_url();
        if let Err(message) = fenced_conformance::services::probe_redis(&url).await {
            panic!("{message}");
        }
        let client = redis::Client::open(url).unwrap();
        let mut conn = client.get_multiplexed_async_connection().await.unwrap();
        let id = &uuid::Uuid::new_v4().simple().to_string()[..12];
        let literal = format!("fenced-glob-{id}{{a*?[bc]\\^-]}}:l");
        let decoys = [
            format!("fenced-glob-{id}{{aXY?[bc]\\^-]}}:l"), // `*`
            format!("fenced-glob-{id}{{a*X[bc]\\^-]}}:l"),  // `?`
            format!("fenced-glob-{id}{{a*?b\\^-]}}:l"),     // `[bc]`
            format!("fenced-glob-{id}{{a*?[bc]\\^-]}}:lX"), // end anchor
        ];
        for name in decoys.iter().chain([&literal]) {
            let () = redis::cmd("SET")
                .arg(name)
                .arg("x")
                .arg("EX")
                .arg(60)
                .query_async(&mut conn)
                .await
                .unwrap();
        }
        let pattern = glob_escape(&literal);
        let mut cursor: u64 = 0;
        let mut found: Vec<String> = Vec::new();
        loop {
            let (next, names): (u64, Vec<String>) = redis::cmd("SCAN")
                .arg(cursor)
                .arg("MATCH")
                .arg(&pattern)
                .arg("COUNT")
                .arg(SCAN_COUNT)
                .query_async(&mut conn)
                .await
                .unwrap();
            found.extend(names);
            if next == 0 {
                break;
            }
            cursor = next;
        }
        found.dedup();
        for name in decoys.iter().chain([&literal]) {
            let _: i64 = redis::cmd("DEL")
                .arg(name)
                .query_async(&mut conn)
                .await
                .unwrap();
        }
        assert_eq!(found, [literal]);
    }
}
