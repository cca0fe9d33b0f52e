//! RELIABILITY.md: the fault matrix's results, one row per store × fault.

use std::{collections::BTreeMap, fmt::Write as _};

pub use crate::model::{cell_key, variant, CellKey};
use crate::{
    model::{Fault, Primitive, RunResult, Target},
    mutant::Mutant,
};

/// Aggregated results of one store × fault cell.
#[derive(Debug, Default, Clone)]
pub struct Cell {
    /// Runs.
    pub runs: usize,
    /// Runs with fencing off (control runs).
    pub control: bool,
    /// Faults injected.
    pub faults: u64,
    /// Acquisitions granted.
    pub acquisitions: u64,
    /// Stale writes the resource accepted.
    pub accepted_stale: u64,
    /// Writes refused for a stale token.
    pub rejected: u64,
    /// Lost updates.
    pub lost_updates: u64,
    /// Releases confirmed for an overtaken holder.
    pub non_owner_releases: usize,
    /// Server-side grants checked, overlapping pairs, token regressions and
    /// client grants the record does not vouch for (`None` when no run of
    /// the cell had a server record).
    pub server: Option<(usize, usize, usize, usize)>,
    /// Runs of the cell without a server record.
    pub server_missing: usize,
    /// Why overlaps cannot be judged from this store's record, if so.
    pub overlaps_unjudged: Option<&'static str>,
    /// Grants below a token already granted, and belief overlaps where the
    /// fault allows none (see [`RunResult`]).
    pub token_regressions: usize,
    /// Belief overlaps under faults that allow none.
    pub forbidden_overlaps: usize,
    /// Client-belief overlaps and the longest, ms.
    pub belief_overlaps: usize,
    /// Longest belief overlap, ms.
    pub belief_max_ms: f64,
    /// Loss-signal latencies, ms.
    pub loss_ms: Vec<f64>,
    /// Liveness after the fault, ms, per run (`None`: not live in 4 × TTL).
    pub liveness_ms: Vec<Option<f64>>,
    /// Retryable errors.
    pub transient: u64,
    /// Other errors (count and first).
    pub errors: usize,
    /// First error seen.
    pub first_error: Option<String>,
}

impl Cell {
    /// Adds one run.
    pub fn add(&mut self, r: &RunResult) {
        self.runs += 1;
        self.control = r.config.is_control();
        self.token_regressions += r.token_regressions;
        self.forbidden_overlaps += r.forbidden_overlaps;
        self.faults += r.faults;
        self.acquisitions += r.acquisitions;
        self.accepted_stale += r.resource.accepted_stale;
        self.rejected += r.resource.rejected;
        self.lost_updates += r.resource.lost_updates;
        self.non_owner_releases += r.non_owner_releases;
        match r.server_truth {
            Some(t) => {
                self.overlaps_unjudged = self.overlaps_unjudged.or(t.overlaps_unjudged);
                let s = self.server.get_or_insert((0, 0, 0, 0));
                s.0 += t.grants;
                s.1 += t.overlaps;
                s.2 += t.token_regressions;
                s.3 += t.unmatched_client_grants;
            }
            None => self.server_missing += 1,
        }
        self.belief_overlaps += r.belief_overlaps;
        self.belief_max_ms = self.belief_max_ms.max(r.belief_overlap_max_ms);
        self.loss_ms.extend(&r.loss_latency_ms);
        self.liveness_ms.push(r.liveness_ms);
        self.transient += r.transient_errors;
        self.errors += r.errors.len();
        if self.first_error.is_none() {
            self.first_error = r.errors.first().cloned();
        }
    }

    /// Whether every safety property held in every run.
    pub fn is_safe(&self) -> bool {
        self.accepted_stale == 0
            && self.lost_updates == 0
            && self.non_owner_releases == 0
            && self.token_regressions == 0
            && self.forbidden_overlaps == 0
            && self
                .server
                .is_none_or(|(_, o, r, u)| o == 0 && r == 0 && u == 0)
    }
}

/// One server-truth number of a cell; `n/a` when no run had a record, and
/// marked when only some had.
fn server_cell(c: &Cell, f: impl Fn(&(usize, usize, usize, usize)) -> usize) -> String {
    match &c.server {
        None => "n/a".into(),
        Some(s) if c.server_missing > 0 => format!("{} ({} runs n/a)", f(s), c.server_missing),
        Some(s) => f(s).to_string(),
    }
}

fn quantile(v: &[f64], q: f64) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let i = ((s.len() - 1) as f64 * q).round() as usize;
    s.get(i).copied()
}

fn ms(v: Option<f64>) -> String {
    v.map_or_else(|| "–".into(), |x| format!("{x:.0}"))
}

fn variant_label(v: usize) -> String {
    match v {
        0 => String::new(),
        1 => " **(fencing off)**".into(),
        _ => format!(
            " **(mutant: {})**",
            Mutant::ALL.get(v - 2).map_or("?", |m| m.name())
        ),
    }
}

/// Groups results by (variant, store, fault).
pub fn cells(results: &[RunResult]) -> BTreeMap<CellKey, Cell> {
    let mut m: BTreeMap<CellKey, Cell> = BTreeMap::new();
    for r in results {
        m.entry(cell_key(r)).or_default().add(r);
    }
    m
}

/// Which code the runs tested and how many each cell got: a resumed
/// profile is written over several sittings, possibly several commits.
fn provenance(results: &[RunResult]) -> String {
    let mut commits: BTreeMap<&str, usize> = BTreeMap::new();
    for r in results {
        *commits
            .entry(r.commit.as_deref().unwrap_or("not recorded"))
            .or_default() += 1;
    }
    let per_cell: Vec<usize> = cells(results)
        .values()
        .filter(|c| !c.control)
        .map(|c| c.runs)
        .collect();
    let hours = results.iter().filter_map(|r| r.elapsed_s).sum::<f64>() / 3600.0;
    let commits = commits
        .iter()
        .map(|(c, n)| format!("`{c}` ({n} runs)"))
        .collect::<Vec<_>>()
        .join(", ");
    format!(
        "{} runs; per store × fault cell (controls aside) {} to {} runs; run time summed over \
         runs {hours:.1} h. Code: {commits}.",
        results.len(),
        per_cell.iter().min().copied().unwrap_or(0),
        per_cell.iter().max().copied().unwrap_or(0),
    )
}

/// The markdown report.
pub fn markdown(results: &[RunResult], command: &str, machine: &str) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "# Reliability\n\nWritten by `{command}` on {machine}. Every row is one store × fault cell; \
         every run is seeded (the seed is in `faults/results/runs.jsonl`) and can be re-run alone.\n"
    );
    let _ = writeln!(out, "{}\n", provenance(results));
    let _ = writeln!(
        out,
        "How a run works: 4 clients contend for one key through their own TCP fault proxy; \
         each holder reads a counter, works, and writes it back with its fencing token to a \
         resource that rejects tokens lower than the highest it has seen. Client 0 suffers the \
         fault while it holds the lock; it runs on its own thread and runtime, so a pause \
         freezes its watchdog too (the in-process SIGSTOP). After the run a fresh client must \
         get the key (liveness).\n\n\
         The safety margin: every client is a `LockClient` with the default `SafetyMargin`, so a \
         guard counts its lock held only until its safe deadline — the lease's local deadline \
         (TTL from the send time of the last successful grant or renewal) less max(TTL × 1 %, \
         100 ms), at most TTL / 4: 100 ms at the 600 ms and 2 s TTLs used here, 75 ms at the \
         storm's 300 ms. Its loss signal fires there, at least that long before the store can \
         expire the lease and grant the key to anyone else. For the belief overlaps this means: \
         where the victim's runtime keeps running (blackhole, cut connection, delayed replies \
         and renewals, a lost acquire acknowledgement) a belief ends the margin before the \
         store's expiry, so an overlap there needs the store to grant early or the clocks to \
         drift apart by more than the margin (the checker counts them in these cells, it does \
         not forbid them); under a freeze (pause past the TTL, SIGSTOP) the frozen process \
         cannot act on any deadline, so its overlaps last as long as the freeze allows — the \
         reason the resource checks tokens. Loss detection is measured from the safe \
         deadline.\n\n\
         ZooKeeper: TTL 2 s and a session timeout of 2 s, the shortest the shared server \
         (tickTime 1 s) grants. A lock's TTL is enforced by its holder's own client, whose \
         reaper deletes the node at the lease's deadline; the session is the backstop: a holder \
         that cannot delete its node (frozen, cut off, dead) keeps the key until the server \
         expires its session, one session timeout — rounded up to the server's next tick — \
         after the last request the server got from it. That request is never earlier than the \
         grant or renewal the holder's deadline counts from, so with the TTL at most the session \
         timeout the server cannot free the key before the holder's deadline. The cells' \
         private servers tick every 500 ms, so such takeovers come 2–2.5 s after the holder fell \
         silent, inside the shortest freeze here (1.5 × TTL, the starved watchdog), as on the \
         other stores. With a 1 s tick the takeover can come at 3 s, as the starved victim wakes: \
         in a trial run the key changed hands just then, and the victim's stale write landed \
         between the successor's read and its write — a lost update no token check can refuse, \
         since the resource learns a token only when it is written.\n\n\
         Redis Cluster (`redis-cluster`): the shared cluster of `scripts/services.sh` (three \
         primaries, a replica each, on 7000–7005). A cluster client connects to the nodes the \
         cluster names, so each client's proxy has a port in front of every node, all under the \
         same faults, and the client's URL maps each node's announced address to its port \
         (`address_map`): a blackhole silences every node to that client at once. The server \
         record is `MONITOR` on the primary that serves the lock's slot. Sentinel \
         (`redis-sentinel`): every run starts a private primary, replica and sentinel (quorum \
         1), so it has the cells the other stores' profiles start from — contention, pause, \
         blackhole — and the failover. Clients ask the sentinel directly; in the blackhole cell \
         each reaches the primary through its own proxy, whose port the URL maps the primary's \
         address to (`address_map`). The server record is `MONITOR` on the primary the sentinel \
         names.\n\n\
         PostgreSQL: TTL 600 ms as on MySQL, the shared server (database `fenced_test`) through \
         the proxy, plain TCP (`sslmode=disable`: a reply the proxy drops must go missing, not \
         break a TLS record stream). `postgres-lease` keeps a lock in a row whose expiry the \
         server's clock judges, so it behaves like `mysql-unique_key`. `postgres-advisory` holds \
         a session-level advisory lock on a connection of its own per lock, whose \
         `idle_session_timeout` is set to the row's expiry by every grant and renewal: a silent \
         holder (frozen, blackholed) loses its session — and the lock — once its expiry has \
         passed on the server's clock, which is after its client's deadline (counted from the \
         request's send time); a connection that closes (a cut, a killed process or holder) \
         frees the lock at once. So, like `mysql-row_lock`, its connection-cut and \
         server-terminate-backend cells can show belief overlaps of a few ms: the server frees \
         the lock the moment the session ends, and the holder's client learns it from the same \
         connection (its monitor cancels the guard's loss signal) a moment later, while a waiter \
         may already have been granted; a stale write then meets the successor's token. Cells left out for PostgreSQL, and why: `server-restart-aof-always` \
         (Redis only), the leader kills (etcd and ZooKeeper clusters), `lock-conflict-storm` (its \
         conflict injector is InnoDB's: shared next-key locks, deadlock victims chosen by undo \
         size, `INNODB_METRICS`) and, for `postgres-lease`, `server-terminate-backend` (a lease \
         is a row: a holder's pool connections carry no lock, and a lost connection is the \
         connection-cut cell's business).\n"
    );
    let _ = writeln!(
        out,
        "Process and server faults (second table below) work differently. \
         **Client processes** (`process-sigstop`, `process-sigkill`, `client-clock-skew`): the 4 \
         clients are `fenced-faults-client` processes; they share the fenced counter and the history \
         through a loopback TCP hub in the runner, which stamps every step before the client takes \
         it. When the victim has read the counter (it holds the lock) the hub SIGSTOPs it for \
         2 × TTL — and until a successor has written — then SIGCONTs it, or SIGKILLs it; the fault \
         counts as confirmed only when `/proc/<pid>/stat` shows the process stopped or dead. \
         `client-clock-skew` runs one client under libfaketime an hour behind (it holds 2 × TTL \
         through renewals: nobody may take the key from it) and one an hour ahead, SIGKILLed \
         holding (the key must be free after the TTL, not after its clock's hour); overlaps are \
         forbidden there. SQLite is left out of that cell: its clock is the client process's own \
         (the store runs inside the client), so a skewed client is a skewed store — the short \
         profile shows the check catching exactly that. **Server faults** run against a private \
         server (own port and data): `server-restart` SIGKILLs and restarts it while the victim \
         holds (MariaDB with InnoDB, Redis without persistence, etcd, a standalone ZooKeeper on \
         the same data directory, whose zxids — the tokens — must keep rising, PostgreSQL — \
         the postmaster and every backend — recovering from its WAL: lease rows and the token \
         sequence survive, advisory locks die with the sessions), \
         `server-restart-aof-always` does the same to a Redis with AOF `appendfsync always`, \
         `etcd-leader-kill` and `zk-leader-kill` (one fault, named per store) SIGKILL the leader \
         of a 3-member etcd cluster or ZooKeeper ensemble, `cluster-primary-kill` SIGKILLs the \
         primary serving the lock's slot in a Redis Cluster of three primaries with a replica \
         each (node timeout 1 s; confirmed when another node serves the slot) and \
         `sentinel-primary-kill` the primary a sentinel watches (confirmed when the sentinel \
         names the replica) — Redis replicates asynchronously, so a failover may lose the lock \
         and overlaps are counted, not forbidden, there —, `server-kill-connection` runs `KILL` on the connection \
         holding the `row_lock` transaction and `server-terminate-backend` (the same fault, named \
         per store) runs `pg_terminate_backend` on the backend holding the PostgreSQL advisory \
         lock (found in `pg_locks`), and `lock-conflict-storm` runs 16 clients (TTL \
         300 ms, every third holder dying) for 8 s on a MariaDB with `innodb_lock_wait_timeout = 1` \
         while a conflict injector — a heavy transaction (300 scratch rows updated) that takes \
         shared locks on every lock table, waits until a fenced statement queues behind them, and \
         then either asks for exclusive locks (a deadlock whose victim InnoDB picks as the lighter \
         transaction: fenced's, 1213) or keeps its locks past the timeout (1205) — makes sure \
         fenced's statements get both answers; overlaps are forbidden there, so a conflict read as \
         a grant or a renewal would show. The server's own deadlock and lock-wait-timeout counters \
         (less the injector's own) confirm it: both for `unique_key` and `optimistic`, deadlocks \
         for `row_lock`, whose waits run under its own 50 s `innodb_lock_wait_timeout` and are \
         bounded (and killed) on the client. Restarts are confirmed \
         by a new pid, the leader kill by a new leader, the KILL by the connection id, \
         `pg_terminate_backend` by the backend's pid (it waits until the backend is gone). \
         Server faults have no server record, except on PostgreSQL, whose audit table is \
         committed with the lock rows it records and survives the crash and the terminated \
         session with them (method below). After a \
         server fault the victim waits a TTL before writing, so a successor — if the store let \
         one in — writes first. **Mutant controls** wrap the real store in a lock with one safety \
         mechanism removed (owner check on release, NX on acquire, expiry judged on the clients' \
         wall clocks) and run the fault that exposes it; each must come out unsafe (the owner-check \
         victim releases its stale lease again each time a successor holds the key, until the broken \
         release frees someone else's lock; a correct store refuses every one).\n"
    );
    let _ = writeln!(
        out,
        "**Semaphores and reader-writer locks** (rows `<store> semaphore-2` and `<store> rw`): \
         the same 4 clients, each hold a permit of a semaphore of 2 or a read or write lock \
         (one hold in three a writer; in the client threads the victim's faulted hold is a writer \
         on even seeds and a reader on odd ones, in the client processes either, by chance), under a holder paused past its TTL, a blackhole, a holder dying in the process \
         (`kill-holder`) and a SIGKILLed client process. A reader-writer lock is fenced by its \
         tokens: writers do the counter's read – work – write, readers read, work and have their \
         read validated at the end, and the resource refuses any step whose token is below the \
         highest a writer has written with (a writer's token exceeds every grant before it), so a \
         stale reader or writer is refused and a write during a read shows as a lost update. A \
         semaphore's tokens cannot do that — each permit is a lease of its own, a later permit \
         does not end an earlier one, so no token order tells a resource which of N + 1 users is \
         stale — so a permit holder checks its permit's safe deadline (`valid_for`) before it uses \
         the resource, which N users may use at once: a use beyond N counts as a stale write \
         accepted, a use the holder refused as a stale write rejected (the faulted hold uses it \
         a quarter TTL, so a use it should not have made meets the others'). Belief overlaps \
         there are spans with more clients believing they hold than the key allows (a third permit \
         of two, a writer beside anyone). Server truth for these rows is the store's own list of \
         the key's holders (`holders()`: one read of the store's state, decided by the store's rule \
         on its clock), asked straight from the server every millisecond or so all run long: \
         a client hold with a look made wholly inside it that does not list its token is an \
         unvouched client grant (the client was told it holds, the store's rule says it does \
         not; holds whose client suffered the fault are left out), a token first seen below a \
         token seen in an earlier look is a token regression (a later arrival let in ahead of \
         the line); the list applies the store's rule, so it can never show more holders than \
         the capacity, and server overlaps are n/a; server grants counts the grants the looks \
         saw. Non-owner releases are n/a for semaphores (a later permit does not end an earlier \
         one); takeover after SIGKILL runs until the killed holder's share is someone else's \
         (both permits held by others; after a killed reader, the next writer). \
         Controls: the same pause with fencing off (no permit check; a resource that takes any \
         token).\n"
    );
    let _ = writeln!(
        out,
        "| store | fault | runs | faults | acquisitions | server grants | server overlaps | token regressions | unvouched client grants | stale writes accepted | lost updates | non-owner releases | stale writes rejected | belief overlaps (max ms) | loss detection p50 / p99 ms | live after p50 / max ms | retryable errors | errors |\n\
         |---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|"
    );
    let all = cells(results);
    for ((v, p, t, f), c) in &all {
        let name = format!(
            "{}{}",
            Fault::ALL[*f].name(Target::ALL[*t]),
            variant_label(*v)
        );
        let live: Vec<f64> = c.liveness_ms.iter().flatten().copied().collect();
        let not_live = c.liveness_ms.iter().filter(|l| l.is_none()).count();
        let live_cell = if not_live > 0 {
            format!(
                "{} / {} (**{not_live} not live**)",
                ms(quantile(&live, 0.5)),
                ms(quantile(&live, 1.0))
            )
        } else {
            format!(
                "{} / {}",
                ms(quantile(&live, 0.5)),
                ms(quantile(&live, 1.0))
            )
        };
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} ({:.0}) | {} / {} | {} | {} | {} |",
            Primitive::ALL[*p].store_label(Target::ALL[*t]),
            name,
            c.runs,
            c.faults,
            c.acquisitions,
            server_cell(c, |s| s.0),
            if c.overlaps_unjudged.is_some() {
                "n/a".to_owned()
            } else {
                server_cell(c, |s| s.1)
            },
            server_cell(c, |s| s.2),
            server_cell(c, |s| s.3),
            c.accepted_stale,
            c.lost_updates,
            // A semaphore's later permits do not end earlier ones: no
            // release can be judged overtaken there.
            if Primitive::ALL[*p] == Primitive::Semaphore {
                "n/a".to_owned()
            } else {
                c.non_owner_releases.to_string()
            },
            c.rejected,
            c.belief_overlaps,
            c.belief_max_ms,
            ms(quantile(&c.loss_ms, 0.5)),
            ms(quantile(&c.loss_ms, 0.99)),
            live_cell,
            c.transient,
            c.errors,
        );
    }
    let unsafe_cells: Vec<String> = all
        .iter()
        .filter(|((v, _, _, _), c)| *v == 0 && !c.is_safe())
        .map(|((_, p, t, f), _)| {
            format!(
                "{} × {}",
                Primitive::ALL[*p].store_label(Target::ALL[*t]),
                Fault::ALL[*f].name(Target::ALL[*t])
            )
        })
        .collect();
    let caught = all
        .iter()
        .filter(|((v, _, _, _), c)| *v > 0 && !c.is_safe())
        .count();
    let controls = all.keys().filter(|(v, _, _, _)| *v > 0).count();
    let _ = writeln!(out, "\n## Verdict\n");
    if unsafe_cells.is_empty() {
        let _ = writeln!(
            out,
            "- With fencing on, no stale write was accepted, no update was lost and no release \
             freed another holder's lock, in every cell."
        );
    } else {
        let _ = writeln!(
            out,
            "- **Safety violated** in: {}.",
            unsafe_cells.join(", ")
        );
    }
    let (mut grants, mut bad, mut missing, mut unjudged) = (0, 0, 0, Vec::new());
    for ((v, _, t, _), c) in &all {
        if *v > 0 {
            continue;
        }
        if let Some((g, o, r, u)) = c.server {
            grants += g;
            bad += o + r + u;
        }
        missing += c.server_missing;
        if c.overlaps_unjudged.is_some() && !unjudged.contains(&Target::ALL[*t].name()) {
            unjudged.push(Target::ALL[*t].name());
        }
    }
    let _ = writeln!(
        out,
        "- Server truth: the stores' own records show {grants} grants; {bad} overlaps, token \
         regressions or unvouched client grants{}{}.",
        if missing > 0 {
            format!("; {missing} runs had no record")
        } else {
            String::new()
        },
        if unjudged.is_empty() {
            String::new()
        } else {
            format!(
                " (overlaps not judged for {}: see the method)",
                unjudged.join(", ")
            )
        }
    );
    let _ = writeln!(
        out,
        "- Control runs (fencing off, or a mutant lock): {caught} of {controls} showed the violations the \
         checks exist for (the checker can fail)."
    );
    let errors: Vec<String> = all
        .iter()
        .filter_map(|((_, p, t, f), c)| {
            c.first_error.as_ref().map(|e| {
                format!(
                    "{} × {}: {e}",
                    Primitive::ALL[*p].store_label(Target::ALL[*t]),
                    Fault::ALL[*f].name(Target::ALL[*t])
                )
            })
        })
        .collect();
    if !errors.is_empty() {
        let _ = writeln!(out, "\n## First error per cell\n");
        for e in errors {
            let _ = writeln!(out, "- {e}");
        }
    }
    out.push_str(&crate::checks::evidence_markdown(results));
    let _ = writeln!(
        out,
        "\n## Reading the columns\n\n\
         - **server grants / server overlaps / token regressions / unvouched client grants**: \
           grants rebuilt from what the store itself recorded, never from a client (method below). \
           Per key no two may intersect on the store's own clock or order (overlaps), tokens must \
           strictly increase (regressions), and every grant a client reported must be one the \
           record shows — with a token the store granted, to that client only, and (etcd) not \
           already deleted when the client asked, (ZooKeeper) created after the client asked \
           and made the holder before the client was told, (PostgreSQL) recorded between the ask \
           and the answer, for `advisory` by a backend holding the lock (unvouched). All must be 0. `n/a`: the run had \
           no server record (reason below).\n\
         - **stale writes accepted / lost updates / non-owner releases** must be 0 with fencing on.\n\
         - **belief overlaps**: times two clients both believed they held the key. Under a pause \
           longer than the TTL these cannot be avoided — the paused process cannot know — which \
           is why the resource checks tokens.\n\
         - **loss detection**: from the guard's safe deadline (the lease's local deadline less \
           the safety margin) to its loss signal (negative: noticed before, e.g. a refused \
           renewal). After a freeze the signal can only fire when the process runs again.\n\
         - **live after**: how long a fresh client waited for the key after the run.\n\
         - **retryable errors**: acquires the store answered with \"try again\" (a cut \
           connection, overload); the caller retries them.\n\
         - **token regressions** (second table): grants whose token is not above a token already \
           granted and acknowledged before the grant was requested — across restarts and \
           failovers too. Must be 0.\n\
         - **overlaps where none is allowed**: belief overlaps under faults that freeze or cut off \
           nobody, or on stores that keep their locks through the fault (contention, clock skew, \
           storms, restarts of durable stores, the leader kills). Must be 0.\n\
         - **victim noticed its loss**: runs in which the holder hit by the fault learnt that its \
           lease was gone (loss signal, refused release, refused write). Required where the store \
           loses the lock (SIGSTOP past the TTL, Redis restart without persistence, row_lock after \
           a restart or a KILL, a PostgreSQL advisory lock after a restart or a terminated \
           backend); a durable store may keep the lease instead.\n\
         - **takeover after SIGKILL**: from the kill of a holder to the next grant to another client.\n"
    );
    let _ = writeln!(out, "{}", crate::truth::METHOD);
    out
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use crate::history::ServerTruth;

    fn result(target: Target, truth: Option<ServerTruth>) -> RunResult {
        RunResult {
            config: crate::model::RunConfig::new(target, Fault::Contention, 1),
            acquisitions: 10,
            faults: 1,
            belief_overlaps: 0,
            belief_overlap_max_ms: 0.0,
            resource: Default::default(),
            server_truth: truth,
            non_owner_releases: 0,
            loss_latency_ms: Vec::new(),
            liveness_ms: Some(1.0),
            errors: Vec::new(),
            transient_errors: 0,
            confirmed_faults: 1,
            evidence: Vec::new(),
            token_regressions: 0,
            forbidden_overlaps: 0,
            victim_noticed_loss: None,
            takeover_ms: None,
            lock_conflicts: None,
            commit: None,
            elapsed_s: None,
            history: String::new(),
        }
    }

    #[test]
    fn server_truth_columns_show_counts_n_a_and_violations() {
        let clean = ServerTruth {
            grants: 11,
            ..ServerTruth::default()
        };
        let md = markdown(
            &[
                result(Target::Redis, Some(clean)),
                result(Target::MySqlUniqueKey, None),
                result(
                    Target::MySqlRowLock,
                    Some(ServerTruth {
                        overlaps_unjudged: Some("why"),
                        ..clean
                    }),
                ),
            ],
            "cmd",
            "here",
        );
        assert!(
            md.contains("| redis | contention | 1 | 1 | 10 | 11 | 0 | 0 | 0 |"),
            "{md}"
        );
        assert!(
            md.contains("| mysql-unique_key | contention | 1 | 1 | 10 | n/a | n/a | n/a | n/a |"),
            "{md}"
        );
        assert!(
            md.contains("| mysql-row_lock | contention | 1 | 1 | 10 | 11 | n/a | 0 | 0 |"),
            "{md}"
        );
        assert!(md.contains("1 runs had no record"), "{md}");
        assert!(md.contains("## Server truth: method"), "{md}");
        let bad = markdown(
            &[result(
                Target::Etcd,
                Some(ServerTruth {
                    unmatched_client_grants: 1,
                    ..clean
                }),
            )],
            "cmd",
            "here",
        );
        assert!(
            bad.contains("**Safety violated** in: etcd × contention"),
            "{bad}"
        );
    }

    #[test]
    fn quantiles() {
        assert_eq!(quantile(&[], 0.5), None);
        assert_eq!(quantile(&[3.0, 1.0, 2.0], 0.5), Some(2.0));
        assert_eq!(quantile(&[3.0, 1.0, 2.0], 1.0), Some(3.0));
    }

    /// `--resume` reads the recorded rows back: what a row says must come
    /// back unchanged, the unjudged reason included, and the report must
    /// name the commits.
    #[test]
    fn recorded_runs_read_back_for_resume() {
        let mut r = result(
            Target::MySqlRowLock,
            Some(ServerTruth {
                grants: 7,
                overlaps_unjudged: Some(crate::truth::binlog::ROW_LOCK_UNJUDGED),
                ..Default::default()
            }),
        );
        r.commit = Some("abc123".into());
        r.elapsed_s = Some(2.5);
        r.config.mutant = Some(crate::mutant::Mutant::NxDropped);
        let line = serde_json::to_string(&r).unwrap();
        let back: RunResult = serde_json::from_str(&line).unwrap();
        assert_eq!(back.server_truth, r.server_truth);
        assert_eq!(back.config.target, r.config.target);
        assert_eq!(back.config.mutant, r.config.mutant);
        assert_eq!(back.config.ttl, r.config.ttl);
        assert_eq!(back.commit.as_deref(), Some("abc123"));
        assert_eq!(serde_json::to_string(&back).unwrap(), line);
        let md = markdown(&[back], "x", "y");
        assert!(md.contains("`abc123` (1 runs)"), "{md}");
    }
}
