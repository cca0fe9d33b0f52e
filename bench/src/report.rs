//! JSON lines, the terminal summary and the BENCHMARKS.md generator.

use std::{fmt::Write as _, io::Write as _, path::Path};

use crate::{stats, CellResult, Kind, Servers};

/// Writes one JSON object per line.
///
/// # Errors
///
/// When the file cannot be written.
pub fn write_jsonl(path: &Path, results: &[CellResult]) -> std::io::Result<()> {
    let mut f = std::io::BufWriter::new(std::fs::File::create(path)?);
    for r in results {
        let line = serde_json::to_string(r).map_err(std::io::Error::other)?;
        writeln!(f, "{line}")?;
    }
    f.flush()
}

/// Reads back what [`write_jsonl`] wrote (`fenced bench --from`).
///
/// # Errors
///
/// When the file cannot be read or a line is not a cell result.
pub fn read_jsonl(path: &Path) -> std::io::Result<Vec<CellResult>> {
    std::fs::read_to_string(path)?
        .lines()
        .filter(|l| !l.trim().is_empty())
        .enumerate()
        .map(|(i, l)| {
            serde_json::from_str(l).map_err(|e| {
                std::io::Error::other(format!("{} line {}: {e}", path.display(), i + 1))
            })
        })
        .collect()
}

pub(crate) fn opt(v: Option<f64>, digits: usize) -> String {
    v.map_or_else(|| "–".to_owned(), |x| format!("{x:.digits$}"))
}

fn row(r: &CellResult) -> String {
    let handoff = match (r.handoff_p50_ms, r.handoff_p99_ms) {
        (Some(a), Some(b)) => format!("{a:.2} / {b:.2}"),
        _ => "–".to_owned(),
    };
    format!(
        "| {} | {} | {:.0} | {:.2} / {:.2} | {:.3} | {} | {} | {} / {} | {} | {:.1} / {:.1} | {} | {} | {} |",
        r.implementation,
        r.scenario.name,
        r.acq_per_s,
        r.cycle_p50_ms,
        r.cycle_p99_ms,
        r.efficiency,
        handoff,
        opt(r.barging_share, 2),
        r.per_task_min,
        r.per_task_max,
        opt(r.jain, 2),
        r.wait_p99_ms,
        r.wait_max_ms,
        opt(r.server_cmds_per_acq, 1),
        r.errors,
        r.violations,
    )
}

const HEADER: &str = "| implementation | scenario | acq/s | cycle p50 / p99 ms | efficiency | hand-off p50 / p99 ms | barging | per-task min / max | Jain | wait p99 / max ms | cmds/acq | errors | violations |\n|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|\n";

fn many_header() -> &'static str {
    "| implementation | locks held | in flight | acquire all (s) | acquire/s | held (s) | lost | requests/s while held | release all (s) | RSS before → held (MiB) | bytes per lock | server connections before → held | errors |\n|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|\n"
}

fn many_row(r: &CellResult) -> Option<String> {
    let m = r.many.as_ref()?;
    let mib = |k: Option<u64>| opt(k.map(|k| k as f64 / 1024.0), 0);
    let n = |c: Option<u64>| c.map_or_else(|| "–".to_owned(), |c| c.to_string());
    Some(format!(
        "| {} | {} / {} | {} | {:.2} | {:.0} | {:.1} | {} | {} | {:.2} | {} → {} | {} | {} → {} | {} |",
        r.implementation,
        m.held,
        m.keys,
        m.in_flight,
        m.acquire_s,
        r.acq_per_s,
        m.held_s,
        m.lost,
        opt(m.hold_requests_per_s(), 0),
        m.release_s,
        mib(m.rss_kib_before),
        mib(m.rss_kib_held),
        opt(m.bytes_per_lock(), 0),
        n(m.server_connections_before),
        n(m.server_connections_held),
        r.errors
    ))
}

/// The many-keys table, after `heading`, when any cell measured many keys.
fn push_many_keys(s: &mut String, results: &[CellResult], heading: &str) {
    if results.iter().any(|r| r.many.is_some()) {
        s.push_str(heading);
        s.push_str(many_header());
        for line in results.iter().filter_map(many_row) {
            s.push_str(&line);
            s.push('\n');
        }
    }
}

/// A plain-text (markdown) table of every cell, for the terminal.
pub fn summary_table(results: &[CellResult]) -> String {
    let mut s = String::from(HEADER);
    for r in results.iter().filter(|r| r.many.is_none()) {
        s.push_str(&row(r));
        s.push('\n');
    }
    push_many_keys(&mut s, results, "\n");
    let bad: Vec<&CellResult> = results
        .iter()
        .filter(|r| r.errors > 0 || r.violations > 0)
        .collect();
    for r in bad {
        let _ = writeln!(
            s,
            "! {} × {}: {} errors, {} violations{}",
            r.implementation,
            r.scenario.name,
            r.errors,
            r.violations,
            r.error_sample
                .as_deref()
                .map(|e| format!(" (first: {e})"))
                .unwrap_or_default()
        );
    }
    s
}

/// Where and when the numbers were taken (`machine.json` beside the results).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct MachineInfo {
    /// UTC date, `YYYY-MM-DD`.
    pub date: String,
    /// CPUs available to this process.
    pub cpus: usize,
    /// `SELECT VERSION()`.
    pub mysql_version: Option<String>,
    /// `INFO server` → `redis_version`.
    pub redis_version: Option<String>,
    /// etcd `/version`.
    pub etcd_version: Option<String>,
    /// ZooKeeper `srvr` → `Zookeeper version` (absent from runs before
    /// ZooKeeper was measured).
    #[serde(default)]
    pub zookeeper_version: Option<String>,
    /// PostgreSQL `SHOW server_version` (absent from runs before
    /// PostgreSQL was measured).
    #[serde(default)]
    pub postgres_version: Option<String>,
}

impl MachineInfo {
    /// Reads the date, CPU count and server versions.
    pub async fn collect(servers: &Servers) -> MachineInfo {
        use sqlx::{Connection, Row};
        let mysql_version = async {
            let mut c = sqlx::MySqlConnection::connect(&servers.mysql).await.ok()?;
            let row = sqlx::query("SELECT VERSION()")
                .fetch_one(&mut c)
                .await
                .ok()?;
            row.try_get::<String, _>(0).ok()
        }
        .await;
        let redis_version = stats::redis_info(servers, "server").await.and_then(|i| {
            i.lines()
                .find_map(|l| l.strip_prefix("redis_version:"))
                .map(|v| v.trim().to_owned())
        });
        let etcd_version = stats::http_get(&servers.etcd_host_port(), "/version")
            .await
            .map(|b| b.trim().to_owned());
        let zookeeper_version = stats::zookeeper_version(servers).await;
        let postgres_version = stats::postgres_version(servers).await;
        MachineInfo {
            date: today_utc(),
            cpus: std::thread::available_parallelism().map_or(1, |n| n.get()),
            mysql_version,
            redis_version,
            etcd_version,
            zookeeper_version,
            postgres_version,
        }
    }
}

fn today_utc() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    // Civil date from days since 1970-01-01 (H. Hinnant's algorithm).
    let z = (secs / 86_400) as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!("{y:04}-{m:02}-{d:02}")
}

pub(crate) fn get<'a>(
    results: &'a [CellResult],
    imp: &str,
    scenario: &str,
) -> Option<&'a CellResult> {
    results
        .iter()
        .find(|r| r.implementation == imp && r.scenario.name == scenario)
}

fn verdict(ok: Option<bool>) -> &'static str {
    match ok {
        Some(true) => "met",
        Some(false) => "**not met**",
        None => "not measured",
    }
}

/// The peer `fenced/postgres-advisory` is held to: sqlx's `PgAdvisoryLock`,
/// whose `acquire` waits in the server's lock queue (`pg_advisory_lock`)
/// as fenced's `acquire` does, on one connection per lock as fenced's
/// held session — the advisory lock a Rust program takes instead.
/// `peer/pg-advisory` (the raw pair, a `pg_try_advisory_lock` first) is the
/// same two round trips uncontended.
const ADVISORY_PEER: &str = "peer/sqlx-advisory";

/// The targets, checked against this run's numbers.
fn targets(results: &[CellResult]) -> String {
    let mut s = String::from("| target | measured | verdict |\n|---|---|---|\n");
    let rate = |i: &str, sc: &str| get(results, i, sc).map(|r| r.acq_per_s);
    let u = "uncontended";
    // Uncontended.
    let (redis, floor, rs) = (
        rate("fenced/redis", u),
        rate("floor/redis-ping", u),
        rate("peer/rslock", u),
    );
    let ok = match (redis, floor, rs) {
        (Some(a), Some(f), Some(r)) => Some(a >= 0.9 * f && a >= r),
        _ => None,
    };
    let _ = writeln!(
        s,
        "| uncontended Redis ≥ 0.9× two-round-trip floor and ≥ rslock | fenced {} /s, floor {} /s (0.9× = {}), rslock {} /s | {} |",
        opt(redis, 0),
        opt(floor, 0),
        opt(floor.map(|f| 0.9 * f), 0),
        opt(rs, 0),
        verdict(ok)
    );
    let pairs = [
        ("fenced/mysql-row_lock", "peer/naive-row-lock"),
        ("fenced/mysql-unique_key", "peer/naive-insert"),
        ("fenced/mysql-optimistic", "peer/naive-insert"),
    ];
    for (a, b) in pairs {
        let (x, y) = (rate(a, u), rate(b, u));
        let _ = writeln!(
            s,
            "| uncontended {a} ≥ {b} | {} /s vs {} /s | {} |",
            opt(x, 0),
            opt(y, 0),
            verdict(x.zip(y).map(|(x, y)| x >= y))
        );
    }
    // Where a fenced row trails a peer that hands out no token: the
    // fencing floor (the token, owner check and expiry alone, see
    // `peers/fencing.rs`) splits the gap into what those cost on the server
    // and what fenced costs on top of them. A reference, not a target.
    let fencing = [
        ("fenced/redis", "floor/redis-fencing", "peer/rslock"),
        (
            "fenced/mysql-unique_key",
            "floor/mysql-fencing",
            "peer/naive-insert",
        ),
        (
            "fenced/mysql-optimistic",
            "floor/mysql-fencing",
            "peer/naive-insert",
        ),
    ];
    for (a, f, p) in fencing {
        if let (Some(x), Some(fl)) = (rate(a, u), rate(f, u)) {
            let peer = rate(p, u)
                .map(|y| format!("; {p} {y:.0} /s = {:.2}× the floor", y / fl))
                .unwrap_or_default();
            let _ = writeln!(
                s,
                "| reference: uncontended {a} against {f} (a token, an owner check and an expiry, nothing else) | {x:.0} /s = {:.2}× {f} {fl:.0} /s{peer} | reference |",
                x / fl
            );
        }
    }
    // Against the Lock RPC measured in this run; the 460/s only
    // when the peer did not run (e.g. `--only fenced/`).
    let (e, rpc) = (rate("fenced/etcd", u), rate("peer/etcd-lock", u));
    let (peer, source) = match rpc {
        Some(r) => (r, "measured in this run"),
        None => (460.0, "the issue's ≈ 460/s; not run here"),
    };
    let _ = writeln!(
        s,
        "| uncontended etcd ≥ 2× etcd's Lock RPC ({source}: {} /s) | {} /s vs {} /s | {} |",
        opt(Some(peer), 0),
        opt(e, 0),
        opt(Some(2.0 * peer), 0),
        verdict(e.map(|e| e >= 2.0 * peer))
    );
    let (z, recipe) = (rate("fenced/zookeeper", u), rate("peer/zk-lock", u));
    if z.is_some() || recipe.is_some() {
        let _ = writeln!(
            s,
            "| uncontended fenced/zookeeper ≥ peer/zk-lock (zookeeper-client's lock recipe) | {} /s vs {} /s | {} |",
            opt(z, 0),
            opt(recipe, 0),
            verdict(z.zip(recipe).map(|(z, r)| z >= r))
        );
    }
    // PostgreSQL: each strategy against the peer that does the same work
    // without fencing (see `ADVISORY_PEER`).
    let postgres_pairs = [
        ("fenced/postgres-lease", "peer/shedlock-pg"),
        ("fenced/postgres-advisory", ADVISORY_PEER),
    ];
    // The grant of either strategy waits for a WAL flush (its token must
    // survive a crash): the durable-commit floor says what that costs here.
    let commit_floor = rate("floor/pg-commit", u)
        .map(|c| format!(" (floor/pg-commit, one durable commit per cycle: {c:.0} /s)"))
        .unwrap_or_default();
    for (a, b) in postgres_pairs {
        let (x, y) = (rate(a, u), rate(b, u));
        if x.is_some() || y.is_some() {
            let _ = writeln!(
                s,
                "| uncontended {a} ≥ {b} | {} /s vs {} /s{commit_floor} | {} |",
                opt(x, 0),
                opt(y, 0),
                verdict(x.zip(y).map(|(x, y)| x >= y))
            );
        }
    }
    for f in ["fenced/postgres-lease", "fenced/postgres-advisory"] {
        if let Some(r) = results
            .iter()
            .find(|r| r.implementation == f && r.scenario.kind == crate::ScenarioKind::CrossProcess)
        {
            let _ = writeln!(
                s,
                "| {f}: hand-off between processes p99 ≤ 5 ms ({}: {} processes, hold {} ms) | p50 {} / p99 {} ms of {} | {} |",
                r.scenario.name,
                r.scenario.tasks,
                r.scenario.hold.as_millis(),
                opt(r.handoff_p50_ms, 2),
                opt(r.handoff_p99_ms, 2),
                r.handoff_samples,
                verdict(r.handoff_p99_ms.map(|g| g <= 5.0))
            );
        }
    }
    let fenced: Vec<&str> = {
        let mut v: Vec<&str> = Vec::new();
        for r in results.iter().filter(|r| r.kind == Kind::Fenced) {
            if !v.contains(&r.implementation.as_str()) {
                v.push(&r.implementation);
            }
        }
        v
    };
    for f in &fenced {
        if let Some(r) = get(results, f, "contended-16-h20-t20") {
            let ok = r.jain.map(|j| r.efficiency >= 0.93 && j >= 0.95);
            let _ = writeln!(
                s,
                "| {f}: 16 tasks, hold 20, think 20: efficiency ≥ 0.93, Jain ≥ 0.95 | {:.3} / {} | {} |",
                r.efficiency,
                opt(r.jain, 3),
                verdict(ok)
            );
        }
    }
    for f in &fenced {
        if let Some(r) = get(results, f, "contended-50-h20-t0") {
            let ok = r
                .jain
                .map(|j| j >= 0.9 && r.server_cmds_per_acq.is_none_or(|c| c <= 5.0));
            let _ = writeln!(
                s,
                "| {f}: 50 tasks, hold 20, no think: Jain ≥ 0.9, ≤ 5 server commands/acq | Jain {}, {} cmds/acq | {} |",
                opt(r.jain, 3),
                opt(r.server_cmds_per_acq, 1),
                verdict(ok)
            );
        }
    }
    for f in &fenced {
        if let Some(r) = get(results, f, "contended-16-h20-t0") {
            let bound = if f.contains("etcd") || f.contains("zookeeper") {
                5.0
            } else {
                2.0
            };
            let _ = writeln!(
                s,
                "| {f}: hand-off gap p99 ≤ {bound} ms (16 tasks, hold 20) | p50 {} / p99 {} ms of {} | {} |",
                opt(r.handoff_p50_ms, 2),
                opt(r.handoff_p99_ms, 2),
                r.handoff_samples,
                verdict(r.handoff_p99_ms.map(|g| g <= bound))
            );
        }
    }
    // ZooKeeper's queue is FIFO by construction: every 16-task cell must be fair.
    let zk16: Vec<&CellResult> = results
        .iter()
        .filter(|r| {
            r.implementation == "fenced/zookeeper" && r.scenario.name.starts_with("contended-16")
        })
        .collect();
    if !zk16.is_empty() {
        let worst = zk16
            .iter()
            .filter_map(|r| r.jain.map(|j| (j, r.scenario.name.as_str())))
            .min_by(|a, b| a.0.total_cmp(&b.0));
        let _ = writeln!(
            s,
            "| fenced/zookeeper: Jain ≥ 0.99 in every 16-task cell | lowest {} ({}) | {} |",
            opt(worst.map(|w| w.0), 3),
            worst.map_or("–", |w| w.1),
            verdict(worst.map(|w| w.0 >= 0.99 && zk16.iter().all(|r| r.jain.is_some())))
        );
    }
    for r in results.iter().filter(|r| r.kind == Kind::Fenced) {
        if let Some(m) = &r.many {
            let _ = writeln!(
                s,
                "| {}: {} locks held at once, renewal keeps up (no loss, no error) | {} held, {} lost, {} errors | {} |",
                r.implementation,
                m.keys,
                m.held,
                m.lost,
                r.errors,
                verdict(Some(m.held == m.keys && m.lost == 0 && r.errors == 0))
            );
        }
    }
    s
}

/// What one cycle of each implementation is, for those that say.
fn push_notes(s: &mut String, results: &[CellResult]) {
    let mut seen: Vec<&str> = Vec::new();
    for r in results {
        let Some(note) = r.note.as_deref() else {
            continue;
        };
        if seen.contains(&r.implementation.as_str()) {
            continue;
        }
        if seen.is_empty() {
            s.push_str(
                "\n## What one acquire + release is\n\n| implementation | per cycle |\n|---|---|\n",
            );
        }
        seen.push(&r.implementation);
        let _ = writeln!(s, "| {} | {} |", r.implementation, note.replace('|', "\\|"));
    }
}

/// Chooses the scenarios of one table by name.
type Pick = fn(&str) -> bool;

/// BENCHMARKS.md: machine, tables per scenario group, the targets, then
/// `notes` (hand-written analysis) verbatim.
pub fn markdown(
    results: &[CellResult],
    machine: &MachineInfo,
    plots: &[String],
    notes: &str,
) -> String {
    let v = |o: &Option<String>| o.clone().unwrap_or_else(|| "unknown".to_owned());
    let mut s = String::new();
    let _ = writeln!(
        s,
        "# fenced benchmarks\n\n\
         Generated by `scripts/bench.sh` (`fenced bench --full`) on {date}: {cpus} CPUs, \
         loopback servers MariaDB {my}, Redis {rd}, etcd {et}, ZooKeeper {zk}, PostgreSQL {pg}. Raw data: \
         `bench/results/results.jsonl` (one line per implementation × scenario).\n\n\
         Every task has its own client and connection, and takes and gives back a key of \
         its own once, untimed, before the cell's window opens (the window measures running \
         clients, not first connections). `fenced/*` rows use the \
         `DistributedLock` trait (`acquire` with a wait bound, `release`); many-keys uses \
         `LockClient` (watchdog renewal). `peer/*` and `floor/*` are bench-only baselines. \
         The servers are shared with other tests, so `cmds/acq` (Redis `INFO commandstats`, \
         MariaDB `Questions`, etcd `grpc_server_started_total`, ZooKeeper `mntr`'s \
         `zk_packets_received`, PostgreSQL `pg_stat_database`'s transactions of the database — \
         one per autocommit statement —, deltas over the cell / \
         acquisitions) is an upper bound polluted by other clients. Efficiency = Σ measured \
         hold / wall time (summed over keys for parallel keys). Hand-off gap = release start → \
         acquired by a different task that was already waiting. Barging = share of releases with \
         another task waiting that the releasing task re-acquired. Cross-process cells (`xproc-…`) \
         run each task in a process of its own, times taken on `CLOCK_MONOTONIC` (one clock for \
         every process of the machine), so every hand-off there goes from one process to another \
         through the store. Family cells run one semaphore (`semaphore-N-…`: N permits) or one \
         reader-writer lock (`rw-90r-…`: every tenth acquisition of a task a write) with every \
         task on the one key; `fenced/*` rows use the store's `SemaphoreStore`; their hand-off \
         gap pairs each acquisition that was waiting with the latest release by another task \
         that it waited through, and a violation is more holders than permits, or a writer \
         beside anyone, in this process.\n",
        date = machine.date,
        cpus = machine.cpus,
        my = v(&machine.mysql_version),
        rd = v(&machine.redis_version),
        et = v(&machine.etcd_version),
        zk = v(&machine.zookeeper_version),
        pg = v(&machine.postgres_version),
    );
    let groups: [(&str, Pick); 5] = [
        ("Uncontended and parallel keys", |n| {
            n == "uncontended" || n.starts_with("parallel")
        }),
        ("Contended, 16 tasks on one key", |n| {
            n.starts_with("contended-16")
        }),
        ("Contended, 50 tasks on one key", |n| {
            n.starts_with("contended-50")
        }),
        (
            "Contended across processes: one task per process, one key",
            |n| n.starts_with("xproc"),
        ),
        (
            "Semaphores and reader-writer locks, every task on one key",
            |n| n.starts_with("semaphore") || n.starts_with("rw-"),
        ),
    ];
    for (title, pick) in groups {
        if !results.iter().any(|r| pick(&r.scenario.name)) {
            continue;
        }
        let _ = writeln!(s, "\n## {title}\n");
        s.push_str(HEADER);
        let mut rows: Vec<&CellResult> = results
            .iter()
            .filter(|r| pick(&r.scenario.name) && r.many.is_none())
            .collect();
        rows.sort_by(|a, b| a.scenario.name.cmp(&b.scenario.name));
        for r in &rows {
            s.push_str(&row(r));
            s.push('\n');
        }
        let writers: Vec<String> = rows
            .iter()
            .filter_map(|r| {
                let w = r.write_wait_p99_ms?;
                Some(format!("{} {w:.1}", r.implementation))
            })
            .collect();
        if !writers.is_empty() {
            let _ = writeln!(
                s,
                "\nWriters' wait p99 (ms) in the reader-writer cells: {}.",
                writers.join(", ")
            );
        }
    }
    push_many_keys(
        &mut s,
        results,
        "\n## Many keys held at once by one client\n\n",
    );
    push_notes(&mut s, results);
    let problems: Vec<String> = results
        .iter()
        .filter(|r| r.errors > 0 || r.violations > 0)
        .map(|r| {
            format!(
                "- {} × {}: {} errors, {} violations{}",
                r.implementation,
                r.scenario.name,
                r.errors,
                r.violations,
                r.error_sample
                    .as_deref()
                    .map(|e| format!(" — first: `{e}`"))
                    .unwrap_or_default()
            )
        })
        .collect();
    s.push_str("\n## Errors and violations\n\n");
    if problems.is_empty() {
        s.push_str("None: every cell ran with 0 errors and 0 mutual-exclusion violations.\n");
    } else {
        s.push_str(&problems.join("\n"));
        s.push('\n');
    }
    if !plots.is_empty() {
        s.push_str("\n## Plots\n\n");
        for p in plots {
            let _ = writeln!(s, "![{p}](bench/results/{p})\n");
        }
    }
    s.push_str("\n## Targets, checked automatically against this run\n\n");
    s.push_str(&targets(results));
    if !notes.trim().is_empty() {
        s.push('\n');
        s.push_str(notes.trim_end());
        s.push('\n');
    }
    s
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use crate::{
        readme::{readme_summary, replace_readme_summary, README_MARKERS},
        stats::Kind,
        Profile,
    };

    /// `fenced bench --from` redraws a report from what a run wrote: every
    /// field must come back as written, scenario durations included.
    #[test]
    fn results_read_back_as_written() {
        let mut results = Vec::new();
        for s in Profile::Full.scenarios() {
            let mut r = CellResult::empty("fenced/x", Kind::Fenced, &s);
            r.acq_per_s = 1234.5;
            r.handoff_p99_ms = Some(0.75);
            r.per_task = vec![3, 4];
            results.push(r);
        }
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("results.jsonl");
        write_jsonl(&path, &results).unwrap();
        assert_eq!(read_jsonl(&path).unwrap(), results);
        let machine = MachineInfo {
            date: "2026-01-01".into(),
            cpus: 2,
            mysql_version: None,
            redis_version: None,
            etcd_version: None,
            zookeeper_version: None,
            postgres_version: None,
        };
        let summary = readme_summary(&results, &machine);
        assert!(
            summary.contains("| x | – | – | – | 1234 (0.00) |"),
            "{summary}"
        );
        let (start, end) = README_MARKERS;
        let readme = format!("# t\n{start}\nSTALE-BLOCK\n{end}\nrest\n");
        let new = replace_readme_summary(&readme, &summary).unwrap();
        assert!(
            !new.contains("STALE-BLOCK") && new.ends_with(&format!("{end}\nrest\n")),
            "{new}"
        );
        assert_eq!(replace_readme_summary(&new, &summary).unwrap(), new);
        assert!(replace_readme_summary("# t\n", &summary).is_err());
        std::fs::write(&path, "{\"not\": \"a cell\"}\n").unwrap();
        let err = read_jsonl(&path).unwrap_err().to_string();
        assert!(err.contains("line 1"), "{err}");
    }
    /// The PostgreSQL targets: each strategy against its peer of the same
    /// run, and the hand-off between processes (the cross-process cell).
    #[test]
    fn postgres_targets_are_checked() {
        let mut results = Vec::new();
        for s in Profile::Full.scenarios() {
            for (name, kind, rate, handoff) in [
                ("fenced/postgres-lease", Kind::Fenced, 2000.0, 3.0),
                ("fenced/postgres-advisory", Kind::Fenced, 1500.0, 6.5),
                ("peer/shedlock-pg", Kind::Peer, 1900.0, 1.0),
                ("peer/sqlx-advisory", Kind::Peer, 2500.0, 1.0),
                ("floor/pg-commit", Kind::Floor, 2100.0, 1.0),
            ] {
                let mut r = CellResult::empty(name, kind, &s);
                r.acq_per_s = rate;
                r.handoff_p50_ms = Some(handoff / 2.0);
                r.handoff_p99_ms = Some(handoff);
                r.note = Some(format!("what {name} | does"));
                results.push(r);
            }
        }
        let t = targets(&results);
        let line = |what: &str| {
            t.lines()
                .find(|l| l.contains(what))
                .unwrap_or_else(|| panic!("no `{what}` row in\n{t}"))
                .to_owned()
        };
        assert!(
            line("fenced/postgres-lease ≥ peer/shedlock-pg").ends_with("| met |"),
            "{t}"
        );
        assert!(
            line("fenced/postgres-advisory ≥ peer/sqlx-advisory").ends_with("| **not met** |"),
            "{t}"
        );
        let lease = line("fenced/postgres-lease: hand-off between processes p99 ≤ 5 ms");
        assert!(
            lease.contains("xproc-8-h5-t0: 8 processes") && lease.ends_with("| met |"),
            "{lease}"
        );
        let advisory = line("fenced/postgres-advisory: hand-off between processes");
        assert!(advisory.ends_with("| **not met** |"), "{advisory}");
        let machine = MachineInfo {
            date: "2026-01-01".into(),
            cpus: 2,
            mysql_version: None,
            redis_version: None,
            etcd_version: None,
            zookeeper_version: None,
            postgres_version: Some("15.20".into()),
        };
        let md = markdown(&results, &machine, &[], "");
        assert!(md.contains("PostgreSQL 15.20"), "{md}");
        assert!(md.contains("## Contended across processes"), "{md}");
        assert!(
            md.contains("| fenced/postgres-lease | xproc-8-h5-t0 |"),
            "{md}"
        );
        // Each implementation's note once, its `|` escaped.
        assert_eq!(
            md.matches("| peer/shedlock-pg | what peer/shedlock-pg \\| does |")
                .count(),
            1,
            "{md}"
        );
        let summary = readme_summary(&results, &machine);
        assert!(
            summary.contains("8 processes on one key, hold 5 ms: hand-off between processes"),
            "{summary}"
        );
        assert!(
            summary.contains("| postgres-lease | one primary"),
            "{summary}"
        );
        assert!(summary.contains(" | 1.50 / 3.00 | "), "{summary}");
    }

    /// The fencing floors split a fenced row's gap to a peer without a
    /// token: a reference line with both ratios, only when the floor ran.
    #[test]
    fn fencing_floor_reference_lines() {
        let s = Profile::Smoke
            .scenarios()
            .into_iter()
            .find(|s| s.name == "uncontended")
            .expect("an uncontended cell");
        let mut results = Vec::new();
        for (name, kind, rate) in [
            ("fenced/redis", Kind::Fenced, 6000.0),
            ("floor/redis-fencing", Kind::Floor, 7500.0),
            ("peer/rslock", Kind::Peer, 9000.0),
            ("fenced/mysql-unique_key", Kind::Fenced, 2000.0),
            ("peer/naive-insert", Kind::Peer, 2500.0),
        ] {
            let mut r = CellResult::empty(name, kind, &s);
            r.acq_per_s = rate;
            results.push(r);
        }
        let t = targets(&results);
        let redis = t
            .lines()
            .find(|l| l.contains("fenced/redis against floor/redis-fencing"))
            .unwrap_or_else(|| panic!("no fencing floor line in\n{t}"));
        assert!(
            redis.contains("6000 /s = 0.80× floor/redis-fencing 7500 /s; peer/rslock 9000 /s = 1.20× the floor")
                && redis.ends_with("| reference |"),
            "{redis}"
        );
        // floor/mysql-fencing did not run: no MySQL reference line.
        assert!(!t.contains("floor/mysql-fencing"), "{t}");
    }

    /// The ZooKeeper targets: against the recipe measured in the same run,
    /// the 5 ms hand-off bound, and Jain ≥ 0.99 judged by the worst 16-task
    /// cell.
    #[test]
    fn zookeeper_targets_are_checked() {
        let mut results = Vec::new();
        for s in Profile::Full.scenarios() {
            for (name, kind, rate) in [
                ("fenced/zookeeper", Kind::Fenced, 700.0),
                ("peer/zk-lock", Kind::Peer, 600.0),
            ] {
                let mut r = CellResult::empty(name, kind, &s);
                r.acq_per_s = rate;
                r.handoff_p99_ms = Some(4.5);
                r.jain = Some(if s.name == "contended-16-h5-t20" {
                    0.98
                } else {
                    1.0
                });
                results.push(r);
            }
        }
        let t = targets(&results);
        let line = |what: &str| {
            t.lines()
                .find(|l| l.contains(what))
                .unwrap_or_else(|| panic!("no `{what}` row in\n{t}"))
                .to_owned()
        };
        assert!(
            line("fenced/zookeeper ≥ peer/zk-lock").ends_with("| met |"),
            "{t}"
        );
        let handoff = line("fenced/zookeeper: hand-off gap p99 ≤ 5 ms");
        assert!(handoff.ends_with("| met |"), "{handoff}");
        let jain = line("fenced/zookeeper: Jain ≥ 0.99");
        assert!(
            jain.contains("0.980 (contended-16-h5-t20)") && jain.ends_with("| **not met** |"),
            "{jain}"
        );
        // Without ZooKeeper rows, no ZooKeeper targets.
        let others: Vec<CellResult> = results
            .into_iter()
            .filter(|r| {
                !r.implementation.contains("zookeeper") && !r.implementation.contains("zk-")
            })
            .collect();
        assert!(!targets(&others).contains("zookeeper"));
    }
}
