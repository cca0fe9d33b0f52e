//! The README's block written by `scripts/bench.sh`: the stores side by
//! side — what each guarantees and costs, beside what this run measured.

use std::fmt::Write as _;

use crate::{
    report::{get, opt, MachineInfo},
    stats::{CellResult, Kind},
    ScenarioKind,
};

/// Where [`readme_summary`] goes in the README.
pub const README_MARKERS: (&str, &str) = (
    "<!-- fenced bench summary: written by scripts/bench.sh -->",
    "<!-- end of fenced bench summary -->",
);

/// What a store guarantees and costs, for the table's descriptive columns.
struct Profile {
    consistency: &'static str,
    /// Connections held per lock.
    held: &'static str,
    dead_holder: &'static str,
    choose: &'static str,
}

/// The descriptive columns of a fenced backend (`fenced/<name>` rows).
fn profile(name: &str) -> Option<Profile> {
    let p = |consistency, held, dead_holder, choose| {
        Some(Profile {
            consistency,
            held,
            dead_holder,
            choose,
        })
    };
    match name {
        "sqlite" => p(
            "one file on one host (WAL); no failover",
            "none (the store is a file)",
            "after its TTL (host clock)",
            "every process is on one host: cron jobs, CLI tools",
        ),
        "mysql-unique_key" | "mysql-optimistic" => p(
            "one primary; a failover to an asynchronous replica can lose the latest grants",
            "none (a pool per client)",
            "after its TTL (database clock)",
            "the database is already there; jobs, compensations, cache rebuilds",
        ),
        "mysql-row_lock" => p(
            "one primary; the lock is an open transaction, gone with its connection",
            "one, with an open transaction",
            "at once when its connection drops; after its TTL otherwise",
            "business writes must commit with the release",
        ),
        "redis" => p(
            "one node, asynchronous replication: a failover can lose held locks",
            "none (one multiplexed connection per client)",
            "after its TTL (server clock)",
            "fast efficiency locks; fencing tokens guard correctness",
        ),
        "redis-cluster" => p(
            "a primary per shard, asynchronous replication: a shard's failover can lose held locks",
            "none (two connections per client: scripts, and sharded hand-over messages)",
            "after its TTL (the shard's server clock)",
            "Redis already runs as a cluster; locks spread over the shards by key",
        ),
        "etcd" => p(
            "Raft quorum (CP): locks survive a leader failure",
            "none (one channel per client; a lease per TTL)",
            "after its TTL, or one TTL later if its client died",
            "locks must survive node failures",
        ),
        "zookeeper" => p(
            "ZAB quorum (CP): locks survive a leader failure",
            "none (one session per client; one more per longer TTL)",
            "after its TTL, or one session timeout later if its client died",
            "a ZooKeeper ensemble already runs (Kafka, HBase, Solr)",
        ),
        "postgres-lease" => p(
            "one primary (a hot standby is refused); a failover to an asynchronous standby can \
             lose the latest grants",
            "none (a statement pool per client; one LISTEN session once a client has waited)",
            "after its TTL (database clock)",
            "PostgreSQL is already there; waiters in other processes are woken by NOTIFY",
        ),
        "postgres-advisory" => p(
            "one primary (a hot standby is refused); the lock is the holder's session, gone with \
             it, never carried over by a failover",
            "one session per held lock and per waiting acquire",
            "at once when its session ends; a silent client's session after its TTL \
             (idle_session_timeout)",
            "long-held locks of long-lived processes; the server queues the waiters",
        ),
        _ => None,
    }
}

/// The README's trade-off table: per fenced backend what it guarantees and
/// costs, and this run's headline numbers; the peers' uncontended rates
/// for scale.
pub fn readme_summary(results: &[CellResult], machine: &MachineInfo) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "From `scripts/bench.sh` on {} ({} CPUs, loopback servers): the numeric columns are this \
         run's, every cell and the targets are in [`BENCHMARKS.md`](BENCHMARKS.md).\n",
        machine.date, machine.cpus
    );
    let cross = results
        .iter()
        .find(|r| r.scenario.kind == ScenarioKind::CrossProcess)
        .map(|r| &r.scenario);
    let xproc = cross.map_or_else(
        || "between processes: hand-off p50 / p99 ms".to_owned(),
        |c| {
            format!(
                "{} processes on one key, hold {} ms: hand-off between processes p50 / p99 ms",
                c.tasks,
                c.hold.as_millis()
            )
        },
    );
    let _ = writeln!(
        s,
        "| store | consistency; failover | connections held per lock | a dead holder's key is free | \
         uncontended acq/s (cycle p50 ms) | 16 tasks on one key: acq/s, hand-off p50 / p99 ms | \
         {xproc} | \
         16 tasks, hold 20 ms, think 20 ms: efficiency / Jain | locks held by one client: lost of held | choose it when |\n\
         |---|---|---|---|--:|--:|--:|--:|--:|---|"
    );
    let mut seen: Vec<&str> = Vec::new();
    for r in results.iter().filter(|r| r.kind == Kind::Fenced) {
        let name = r.implementation.as_str();
        if seen.contains(&name) {
            continue;
        }
        seen.push(name);
        let short = name.trim_start_matches("fenced/");
        let profile = profile(short);
        let text = |f: fn(&Profile) -> &'static str| profile.as_ref().map_or("–", f);
        let u = get(results, name, "uncontended");
        let hot = get(results, name, "contended-16-h0-t0");
        let xp = cross.and_then(|c| get(results, name, &c.name));
        let c16 = get(results, name, "contended-16-h20-t20");
        let many = results
            .iter()
            .find(|m| m.implementation == name && m.many.is_some())
            .and_then(|m| m.many.as_ref());
        let _ = writeln!(
            s,
            "| {short} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            text(|p| p.consistency),
            text(|p| p.held),
            text(|p| p.dead_holder),
            u.map_or_else(
                || "–".to_owned(),
                |u| format!("{:.0} ({:.2})", u.acq_per_s, u.cycle_p50_ms)
            ),
            hot.map_or_else(
                || "–".to_owned(),
                |c| format!(
                    "{:.0}, {} / {}",
                    c.acq_per_s,
                    opt(c.handoff_p50_ms, 2),
                    opt(c.handoff_p99_ms, 2)
                )
            ),
            xp.map_or_else(
                || "–".to_owned(),
                |c| format!(
                    "{} / {}",
                    opt(c.handoff_p50_ms, 2),
                    opt(c.handoff_p99_ms, 2)
                )
            ),
            c16.map_or_else(
                || "–".to_owned(),
                |c| format!("{:.3} / {}", c.efficiency, opt(c.jain, 3))
            ),
            many.map_or_else(
                || "not run".to_owned(),
                |m| format!("{} of {}", m.lost, m.held)
            ),
            text(|p| p.choose),
        );
    }
    let peers: Vec<String> = results
        .iter()
        .filter(|r| r.kind != Kind::Fenced && r.scenario.name == "uncontended")
        .map(|r| format!("{} {:.0}", r.implementation, r.acq_per_s))
        .collect();
    if !peers.is_empty() {
        let _ = writeln!(
            s,
            "\nPeers and floors, uncontended acq/s: {}.",
            peers.join(", ")
        );
    }
    s
}
/// `readme` with the block between [`README_MARKERS`] replaced by `summary`.
///
/// # Errors
///
/// When the markers are missing or out of order (the text is not changed).
pub fn replace_readme_summary(readme: &str, summary: &str) -> Result<String, String> {
    let (start, end) = README_MARKERS;
    let (Some(a), Some(b)) = (readme.find(start), readme.find(end)) else {
        return Err(format!(
            "the README has no summary block: add the lines `{start}` and `{end}` where it goes"
        ));
    };
    if b < a {
        return Err("the README's summary markers are out of order".to_owned());
    }
    Ok(format!(
        "{}{start}\n{summary}{}",
        &readme[..a],
        &readme[b..]
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every store `fenced bench` measures has its descriptive columns (a
    /// new backend without them would show dashes in the README).
    #[test]
    fn every_measured_store_is_described() {
        for name in [
            "sqlite",
            "mysql-unique_key",
            "mysql-row_lock",
            "mysql-optimistic",
            "redis",
            "redis-cluster",
            "etcd",
            "zookeeper",
            "postgres-lease",
            "postgres-advisory",
        ] {
            assert!(profile(name).is_some(), "{name}");
        }
        assert!(profile("consul").is_none());
    }
}
