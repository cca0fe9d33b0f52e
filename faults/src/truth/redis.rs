//! Redis server truth: what the server executed, from a `MONITOR`
//! connection held open for the whole run.
//!
//! Redis 7 shows every command a Lua script runs as its own line, marked
//! `[<db> lua]`, right after the `EVAL`/`EVALSHA` line of the script (a
//! script is atomic: nothing else runs in between). The state of a lock is
//! one string written only by `SET` inside fenced-redis's scripts
//! (`scripts/prelude.lua`): `token|count|expiry|queued|waiter|owner`, the
//! expiry in server milliseconds (the owner followed, after a newline, by
//! the holder's label when it gave one). Every such write is a fact the server
//! committed; from them, per key:
//!
//! * a **grant** starts with a write of a held state (`count > 0`) whose
//!   token or owner differs from the current grant's, at the server time of
//!   that write (the `MONITOR` timestamp, taken after the script read its
//!   clock);
//! * the write of a held state with the same token and owner is an
//!   extension or re-entry: the grant's expiry moves;
//! * a grant **ends** at its expiry (server time), or earlier when a script
//!   that *may* end it wrote the key: a release naming this grant's owner and
//!   token, a waiter leaving that names the waiter the lease was handed to,
//!   or a force release (no arguments). Any other script that replaces or
//!   frees a current lease does not end it: the next grant then overlaps it.
//!
//! Redis clock steps and `DEBUG SLEEP` are out of scope: the check uses the
//! server's own `gettimeofday` throughout.

use std::{collections::BTreeMap, time::Duration};

use tokio::{
    io::{AsyncBufReadExt as _, AsyncWriteExt as _, BufReader},
    net::TcpStream,
    task::JoinHandle,
};

use crate::history::ServerGrant;

/// One command the server executed, as `MONITOR` showed it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Call {
    /// Server time of the line, µs since the epoch.
    pub ts_us: u64,
    /// Run by a Lua script (`[0 lua]`), not by a client.
    pub lua: bool,
    /// The command and its arguments.
    pub args: Vec<String>,
}

/// Parses one `MONITOR` line: `1700000000.123456 [0 127.0.0.1:5000] "SET" "k" "v"`.
pub fn parse_line(line: &str) -> Option<Call> {
    let (ts, rest) = line.split_once(' ')?;
    let (secs, micros) = ts.split_once('.')?;
    let ts_us = secs.parse::<u64>().ok()? * 1_000_000 + micros.parse::<u64>().ok()?;
    let rest = rest.strip_prefix('[')?;
    let (client, rest) = rest.split_once("] ")?;
    let lua = client.ends_with(" lua");
    let mut args = Vec::new();
    let b = rest.as_bytes();
    let mut i = 0;
    while i < b.len() {
        if b[i] == b' ' {
            i += 1;
            continue;
        }
        if b[i] != b'"' {
            return None;
        }
        i += 1;
        let mut arg = Vec::new();
        loop {
            let c = *b.get(i)?;
            i += 1;
            match c {
                b'"' => break,
                b'\\' => {
                    let e = *b.get(i)?;
                    i += 1;
                    arg.push(match e {
                        b'n' => b'\n',
                        b'r' => b'\r',
                        b't' => b'\t',
                        b'a' => 7,
                        b'b' => 8,
                        b'x' => {
                            let h = rest.get(i..i + 2)?;
                            i += 2;
                            u8::from_str_radix(h, 16).ok()?
                        }
                        other => other,
                    });
                }
                other => arg.push(other),
            }
        }
        args.push(String::from_utf8_lossy(&arg).into_owned());
    }
    Some(Call { ts_us, lua, args })
}

/// A `MONITOR` connection collecting the lines that mention `filter`.
#[derive(Debug)]
pub struct Monitor {
    addr: String,
    password: Option<String>,
    marker: String,
    task: JoinHandle<Result<Vec<Call>, String>>,
}

/// How long the monitor may take to deliver the end marker.
const DRAIN: Duration = Duration::from_secs(30);

async fn connect(addr: &str, password: Option<&str>) -> Result<BufReader<TcpStream>, String> {
    let s = tokio::time::timeout(Duration::from_secs(5), TcpStream::connect(addr))
        .await
        .map_err(|_| format!("redis truth: no connection to {addr} within 5s"))?
        .map_err(|e| {
            format!("redis truth: connecting to {addr}: {e}; are the services up? run scripts/services.sh")
        })?;
    let mut s = BufReader::new(s);
    if let Some(pw) = password {
        command(&mut s, &["AUTH", pw]).await?;
    }
    Ok(s)
}

/// Sends one command and reads a one-line reply (`+OK`, `$n` + data…).
async fn command(s: &mut BufReader<TcpStream>, args: &[&str]) -> Result<String, String> {
    let mut req = format!("*{}\r\n", args.len());
    for a in args {
        req.push_str(&format!("${}\r\n{a}\r\n", a.len()));
    }
    s.get_mut()
        .write_all(req.as_bytes())
        .await
        .map_err(|e| format!("redis truth: sending {}: {e}", args[0]))?;
    let mut line = String::new();
    tokio::time::timeout(Duration::from_secs(5), s.read_line(&mut line))
        .await
        .map_err(|_| format!("redis truth: no answer to {} within 5s", args[0]))?
        .map_err(|e| format!("redis truth: reading the answer to {}: {e}", args[0]))?;
    if line.starts_with('-') || line.is_empty() {
        return Err(format!("redis truth: {} refused: {}", args[0], line.trim()));
    }
    if line.starts_with('$') {
        let mut data = String::new();
        let _ = s.read_line(&mut data).await;
        return Ok(data.trim_end().to_owned());
    }
    Ok(line.trim_end().to_owned())
}

/// `host:port` of the primary that serves the slot of the key `name` in the
/// Redis Cluster whose URL is `url` (`redis+cluster://seed,…`), as its
/// first seed sees it.
///
/// # Errors
///
/// When the seed cannot be asked or no primary serves the slot.
pub async fn slot_node(url: &str, name: &str) -> Result<String, String> {
    let mut c = seed(url).await?;
    let (_, (host, port)) = fenced_testkit::private::cluster_slot_owner(&mut c, name)
        .await
        .map_err(|e| format!("redis truth: {e}"))?;
    Ok(format!("{host}:{port}"))
}

/// `host:port` of the primary that the first sentinel of `url`
/// (`redis+sentinel://s1,…/name`) names.
///
/// # Errors
///
/// When the sentinel cannot be asked or names no primary.
pub async fn sentinel_primary(url: &str) -> Result<String, String> {
    use fenced::redis::redis;
    let mut c = seed(url).await?;
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    let name = rest
        .split_once('/')
        .map(|(_, p)| p.split(['/', '?']).next().unwrap_or(p))
        .filter(|n| !n.is_empty())
        .ok_or_else(|| format!("redis sentinel: no primary name in `{url}`"))?;
    let named: Option<(String, String)> = redis::cmd("SENTINEL")
        .arg("GET-MASTER-ADDR-BY-NAME")
        .arg(name)
        .query_async(&mut c)
        .await
        .map_err(|e| format!("redis sentinel: SENTINEL GET-MASTER-ADDR-BY-NAME: {e}"))?;
    let (host, port) = named.ok_or_else(|| format!("redis sentinel: no primary `{name}`"))?;
    Ok(format!("{host}:{port}"))
}

/// An admin connection to the first seed of the cluster URL `url` (or the
/// first sentinel of a Sentinel URL).
async fn seed(url: &str) -> Result<fenced::redis::redis::aio::MultiplexedConnection, String> {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    let seed = rest.split([',', '/', '?']).next().unwrap_or(rest);
    fenced_testkit::private::admin_connection(&format!("redis://{seed}"))
        .await
        .map_err(|e| format!("redis cluster: {e}"))
}

/// Every node of the Redis Cluster whose URL is `url`, as its first seed
/// names them (`CLUSTER NODES`: primaries and replicas).
///
/// # Errors
///
/// When the seed cannot be asked or names a node without an address.
pub async fn cluster_nodes(url: &str) -> Result<Vec<std::net::SocketAddr>, String> {
    use fenced::redis::redis;
    let mut c = seed(url).await?;
    let nodes: String = redis::cmd("CLUSTER")
        .arg("NODES")
        .query_async(&mut c)
        .await
        .map_err(|e| format!("redis cluster: CLUSTER NODES: {e}"))?;
    nodes
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            // `<id> <ip:port@bus[,hostname]> <flags> …`
            let addr = l
                .split_whitespace()
                .nth(1)
                .and_then(|a| a.split('@').next())
                .ok_or_else(|| format!("redis cluster: a node line without an address: {l}"))?;
            addr.parse()
                .map_err(|e| format!("redis cluster: node address `{addr}`: {e}"))
        })
        .collect()
}

impl Monitor {
    /// Opens `MONITOR` on the server of `url` (plain `redis://` only) and
    /// keeps the lines containing `filter` until [`finish`](Self::finish).
    ///
    /// # Errors
    ///
    /// When the server cannot be reached (naming `scripts/services.sh`) or
    /// refuses `MONITOR`.
    pub async fn start(url: &str, filter: &str) -> Result<Monitor, String> {
        if url.starts_with("rediss://") {
            return Err("redis truth: MONITOR over TLS is not supported by the fault suite".into());
        }
        let addr = fenced_conformance::services::host_port(url, 6379)?;
        let password = url
            .split_once("://")
            .and_then(|(_, r)| r.split(['/', '?']).next())
            .and_then(|a| a.rsplit_once('@'))
            .and_then(|(ui, _)| ui.split_once(':').map(|(_, p)| p.to_owned()))
            .filter(|p| !p.is_empty());
        let mut s = connect(&addr, password.as_deref()).await?;
        let ok = command(&mut s, &["MONITOR"]).await?;
        if ok != "+OK" {
            return Err(format!("redis truth: MONITOR answered {ok}"));
        }
        let marker = format!("fenced-faults-truth-end {filter}");
        let (filter, want) = (filter.to_owned(), marker.clone());
        let task = tokio::spawn(async move {
            let mut calls = Vec::new();
            let mut buf = Vec::new();
            loop {
                buf.clear();
                let n = s
                    .read_until(b'\n', &mut buf)
                    .await
                    .map_err(|e| format!("redis truth: reading MONITOR: {e}"))?;
                if n == 0 {
                    return Err("redis truth: the server closed the MONITOR connection".into());
                }
                let line = String::from_utf8_lossy(&buf);
                let line = line.trim_end();
                let Some(line) = line.strip_prefix('+') else {
                    continue;
                };
                if !line.contains(filter.as_str()) {
                    continue;
                }
                let Some(call) = parse_line(line) else {
                    return Err(format!("redis truth: unreadable MONITOR line: {line}"));
                };
                if call.args.iter().any(|a| a == &want) {
                    return Ok(calls);
                }
                calls.push(call);
            }
        });
        Ok(Monitor {
            addr,
            password,
            marker,
            task,
        })
    }

    /// Sends the end marker, waits until the monitor has seen it, and
    /// returns every line seen before it.
    ///
    /// # Errors
    ///
    /// When the marker cannot be sent or does not arrive within 30 s.
    pub async fn finish(self) -> Result<Vec<Call>, String> {
        let mut s = connect(&self.addr, self.password.as_deref()).await?;
        command(&mut s, &["ECHO", &self.marker]).await?;
        let task = self.task;
        match tokio::time::timeout(DRAIN, task).await {
            Ok(Ok(r)) => r,
            Ok(Err(e)) => Err(format!("redis truth: the monitor task failed: {e}")),
            Err(_) => Err(format!(
                "redis truth: the end marker did not come through MONITOR within {DRAIN:?}"
            )),
        }
    }
}

/// A lock state as fenced-redis writes it.
#[derive(Debug, Clone, PartialEq, Eq)]
struct State {
    token: u64,
    count: u64,
    expiry_ms: u64,
    waiter: String,
    owner: String,
}

fn parse_state(v: &str) -> Option<State> {
    let mut it = v.splitn(6, '|');
    let token = it.next()?.parse().ok()?;
    let count = it.next()?.parse().ok()?;
    let expiry_ms = it.next()?.parse().ok()?;
    let _queued = it.next()?;
    let waiter = it.next()?.to_owned();
    // The holder is the owner, then a newline and the label when it gave
    // one; only the owner identifies the grant.
    let holder = it.next()?;
    let owner = holder
        .split_once('\n')
        .map_or(holder, |(o, _)| o)
        .to_owned();
    Some(State {
        token,
        count,
        expiry_ms,
        waiter,
        owner,
    })
}

#[derive(Debug)]
struct Open {
    state: State,
    from_us: u64,
}

/// The script arguments (`ARGV`) of an `EVAL`/`EVALSHA` line.
fn script_argv(c: &Call) -> Option<Vec<String>> {
    let cmd = c.args.first()?.to_ascii_lowercase();
    if cmd != "evalsha" && cmd != "eval" && cmd != "evalsha_ro" && cmd != "eval_ro" {
        return None;
    }
    let nkeys: usize = c.args.get(2)?.parse().ok()?;
    Some(c.args.get(3 + nkeys..).unwrap_or_default().to_vec())
}

/// Whether a script called with `argv` may end the grant `g` (see the
/// module docs).
fn may_end(argv: Option<&[String]>, g: &State) -> bool {
    match argv {
        Some([]) => true,
        Some([a, b]) => {
            (*a == g.owner && *b == g.token.to_string()) || (!g.waiter.is_empty() && *a == g.waiter)
        }
        _ => false,
    }
}

/// The grants the server's writes of lock states amount to (see the module
/// docs); `from`/`to` are server µs since the epoch.
///
/// # Errors
///
/// A state write fenced-redis would never make (unparseable value).
pub fn grants(calls: &[Call]) -> Result<Vec<ServerGrant>, String> {
    let mut open: BTreeMap<String, Open> = BTreeMap::new();
    let mut out = Vec::new();
    let mut argv: Option<Vec<String>> = None;
    let close = |key: &str, o: Open, end_us: Option<u64>, out: &mut Vec<ServerGrant>| {
        let exp = o.state.expiry_ms.saturating_mul(1000);
        let to = end_us.map_or(exp, |e| e.min(exp)).max(o.from_us);
        out.push(ServerGrant {
            key: key.to_owned(),
            token: o.state.token,
            from: o.from_us,
            to,
        });
    };
    for c in calls {
        if !c.lua {
            argv = script_argv(c);
            continue;
        }
        let cmd = c.args.first().map(|a| a.to_ascii_uppercase());
        let Some(key) = c.args.get(1).filter(|k| k.ends_with("}:l")) else {
            continue;
        };
        match cmd.as_deref() {
            Some("SET") => {
                let v = c.args.get(2).map(String::as_str).unwrap_or_default();
                let st = parse_state(v)
                    .ok_or_else(|| format!("redis truth: unexpected state {v:?} under {key}"))?;
                let prev = open.remove(key);
                if let Some(mut o) = prev {
                    if st.count > 0 && st.token == o.state.token && st.owner == o.state.owner {
                        o.state = st;
                        open.insert(key.clone(), o);
                        continue;
                    }
                    let end = may_end(argv.as_deref(), &o.state).then_some(c.ts_us);
                    close(key, o, end, &mut out);
                }
                if st.count > 0 {
                    open.insert(
                        key.clone(),
                        Open {
                            state: st,
                            from_us: c.ts_us,
                        },
                    );
                }
            }
            Some("DEL" | "UNLINK" | "GETDEL") => {
                if let Some(o) = open.remove(key) {
                    let end = may_end(argv.as_deref(), &o.state).then_some(c.ts_us);
                    close(key, o, end, &mut out);
                }
            }
            _ => {}
        }
    }
    for (key, o) in std::mem::take(&mut open) {
        close(&key, o, None, &mut out);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use crate::history::check_server_grants;

    const S: &str = "{ffx/k}:l";

    fn script(ts: u64, argv: &[&str]) -> Call {
        let mut args = vec![
            "evalsha".into(),
            "abc".into(),
            "2".into(),
            S.into(),
            "{ffx/k}:q".into(),
        ];
        args.extend(argv.iter().map(|a| a.to_string()));
        Call {
            ts_us: ts,
            lua: false,
            args,
        }
    }

    fn set(ts: u64, v: &str) -> Call {
        Call {
            ts_us: ts,
            lua: true,
            args: vec![
                "SET".into(),
                S.into(),
                v.into(),
                "PX".into(),
                "604800000".into(),
            ],
        }
    }

    #[test]
    fn monitor_lines_parse_with_escapes() {
        let c = parse_line(
            r#"1796053703.201894 [0 lua] "SET" "{tt/x}:l" "a|b \"q\"\n\x41" "PX" "1000""#,
        )
        .unwrap();
        assert!(c.lua);
        assert_eq!(c.ts_us, 1_796_053_703_201_894);
        assert_eq!(c.args, ["SET", "{tt/x}:l", "a|b \"q\"\nA", "PX", "1000"]);
        let c = parse_line(r#"1796053703.000001 [0 127.0.0.1:52576] "evalsha" "ab" "0""#).unwrap();
        assert!(!c.lua);
        assert_eq!(script_argv(&c), Some(vec![]));
        assert!(parse_line("garbage").is_none());
    }

    /// Acquire, extend, release with hand-over, expiry takeover: disjoint,
    /// tokens rising.
    #[test]
    fn a_correct_history_has_no_violation() {
        let calls = [
            // o1 is labelled (the label follows the owner after a newline)
            script(1_000_000, &["o1", "600", "0", "web:1", "", "", "", "", ""]),
            set(1_000_010, "1000010|1|1600|0||o1\nweb:1"),
            script(1_200_000, &["o1", "1000010", "600"]),
            set(1_200_010, "1000010|1|1800|0||o1\nweb:1"),
            // o2 queues (same grant, queued flag set)
            script(
                1_300_000,
                &["o2", "600", "0", "", "ab", "ch", "900", "", ""],
            ),
            set(1_300_010, "1000010|1|1800|1||o1\nweb:1"),
            // o1 releases; the lease is handed to waiter ab (o2)
            script(1_400_000, &["o1", "1000010"]),
            set(1_400_010, "1400010|1|2000|1|ab|o2"),
            // o2 freezes; o3 takes over after the expiry (2000 ms)
            script(2_000_500, &["o3", "600", "0", "", "", "", "", "", ""]),
            set(2_000_510, "2000510|1|2600|0||o3"),
            script(2_100_000, &["o3", "2000510"]),
            set(2_100_010, "2000510|0|0|0||"),
        ];
        let g = grants(&calls).unwrap();
        assert_eq!(g.len(), 3, "{g:?}");
        assert_eq!(g[0].to, 1_400_010, "ended by its release");
        assert_eq!(g[1].to, 2_000_000, "ended by its expiry");
        let t = check_server_grants(&g);
        assert_eq!((t.overlaps, t.token_regressions), (0, 0), "{g:?}");
    }

    /// The checker can fail: a grant over a current lease that nobody
    /// released, and a token that goes back.
    #[test]
    fn a_takeover_of_a_current_lease_and_a_token_going_back_are_caught() {
        let calls = [
            script(1_000_000, &["o1", "600", "0", "", "", "", "", "", ""]),
            set(1_000_010, "50|1|1600|0||o1"),
            // o2's acquire writes a new holder while o1's lease runs to 1600 ms
            script(1_100_000, &["o2", "600", "0", "", "", "", "", "", ""]),
            set(1_100_010, "49|1|1700|0||o2"),
        ];
        let g = grants(&calls).unwrap();
        let t = check_server_grants(&g);
        assert_eq!((t.overlaps, t.token_regressions), (1, 1), "{g:?}");
        // A release by someone else (wrong token) does not end o1's grant either.
        let calls = [
            script(1_000_000, &["o1", "600", "0", "", "", "", "", "", ""]),
            set(1_000_010, "50|1|1600|0||o1"),
            script(1_050_000, &["o1", "49"]),
            set(1_050_010, "50|0|0|0||"),
            script(1_100_000, &["o2", "600", "0", "", "", "", "", "", ""]),
            set(1_100_010, "51|1|1700|0||o2"),
        ];
        let t = check_server_grants(&grants(&calls).unwrap());
        assert_eq!(t.overlaps, 1);
    }
}
