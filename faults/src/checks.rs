//! History checks the newer fault scenarios add to those of
//! [`history`](crate::history): tokens never going backwards across a server
//! restart, whether the victim learnt of its loss, and how long a killed
//! holder kept the key from the others.

use crate::{
    history::{Event, Op, Phase},
    model::Primitive,
};

/// Grants whose token is not above a token already granted — and
/// acknowledged to its client — before this grant was even requested. Such
/// a grant is a regression whatever the delays: the store had issued the
/// higher token first. (Grants are compared with grants acknowledged before
/// the request, so a reply delayed past a later grant is not counted.)
pub fn token_regressions(events: &[Event]) -> usize {
    let mut last_invoke: std::collections::HashMap<(usize, &str), u64> = Default::default();
    // Acknowledged grants in time order: (ack time, token) per key.
    let mut acked: std::collections::HashMap<&str, Vec<(u64, u64)>> = Default::default();
    let mut n = 0;
    for e in events {
        match (e.op, e.phase) {
            (Op::Acquire, Phase::Invoke) => {
                last_invoke.insert((e.process, e.key.as_str()), e.t_ns);
            }
            (Op::Acquire, Phase::Ok) => {
                let Some(token) = e.token else { continue };
                let asked = last_invoke
                    .get(&(e.process, e.key.as_str()))
                    .copied()
                    .unwrap_or(0);
                let before = acked.entry(e.key.as_str()).or_default();
                if before.iter().any(|&(t, tok)| t < asked && tok >= token) {
                    n += 1;
                }
                before.push((e.t_ns, token));
            }
            _ => {}
        }
    }
    n
}

/// The first injected fault, the victim it hit, and the token of the hold
/// it hit (the hold current at the fault, else the victim's next one).
fn victim_hold(events: &[Event]) -> Option<(&Event, u64)> {
    let fault = events
        .iter()
        .find(|e| e.op == Op::Fault && e.phase == Phase::Invoke)?;
    let p = fault.process;
    let mut current = None;
    for e in events.iter().filter(|e| e.process == p) {
        if e.t_ns > fault.t_ns {
            break;
        }
        match (e.op, e.phase) {
            (Op::Acquire, Phase::Ok) => current = e.token,
            (Op::Release, Phase::Invoke) | (Op::Lost, _) => current = None,
            _ => {}
        }
    }
    let token = current.or_else(|| {
        events
            .iter()
            .find(|e| {
                e.process == p
                    && e.t_ns >= fault.t_ns
                    && e.op == Op::Acquire
                    && e.phase == Phase::Ok
            })
            .and_then(|e| e.token)
    })?;
    Some((fault, token))
}

/// Whether the victim learnt, in the hold the fault hit, that the lease was
/// gone: a loss signal, a refused release, or a write or read refused for a
/// stale token. `None` when there was no such hold.
pub fn victim_noticed_loss(events: &[Event]) -> Option<bool> {
    let (fault, token) = victim_hold(events)?;
    Some(events.iter().any(|e| {
        e.process == fault.process
            && e.token == Some(token)
            && match (e.op, e.phase) {
                (Op::Lost, _) => e.detail != "killed",
                (Op::Release, Phase::Fail) | (Op::Write, Phase::Fail) => true,
                _ => false,
            }
    }))
}

/// From the SIGKILL of a holder to the next grant to another client, ms.
pub fn takeover_ms(events: &[Event]) -> Option<f64> {
    let kill = events.iter().find(|e| {
        e.op == Op::Fault && e.phase == Phase::Invoke && e.detail.starts_with("SIGKILL")
    })?;
    events
        .iter()
        .find(|e| {
            e.t_ns > kill.t_ns
                && e.process != kill.process
                && e.op == Op::Acquire
                && e.phase == Phase::Ok
        })
        .map(|e| (e.t_ns - kill.t_ns) as f64 / 1e6)
}

/// The family's takeover: from the SIGKILL of a holder to the moment its
/// share is someone else's — a semaphore's permits all held by others at
/// once; after a killed writer the next grant to another client, after a
/// killed reader the next writer's grant. ms.
pub fn family_takeover_ms(events: &[Event], primitive: Primitive) -> Option<f64> {
    use crate::family::Role;
    let kill = events.iter().find(|e| {
        e.op == Op::Fault && e.phase == Phase::Invoke && e.detail.starts_with("SIGKILL")
    })?;
    let ms = |t: u64| (t - kill.t_ns) as f64 / 1e6;
    match primitive {
        Primitive::Mutex => takeover_ms(events),
        Primitive::Semaphore => {
            let mut others: std::collections::HashSet<usize> = Default::default();
            for e in events.iter().filter(|e| e.process != kill.process) {
                match (e.op, e.phase) {
                    (Op::Acquire, Phase::Ok) => {
                        others.insert(e.process);
                    }
                    (Op::Release, Phase::Invoke) | (Op::Lost, _) => {
                        others.remove(&e.process);
                    }
                    _ => {}
                }
                if e.t_ns > kill.t_ns && others.len() >= crate::model::SEMAPHORE_PERMITS as usize {
                    return Some(ms(e.t_ns));
                }
            }
            None
        }
        Primitive::ReadWrite => {
            let killed_a_writer = events
                .iter()
                .rfind(|e| {
                    e.process == kill.process
                        && e.op == Op::Acquire
                        && e.phase == Phase::Ok
                        && e.t_ns <= kill.t_ns
                })
                .is_some_and(|e| Role::from_detail(&e.detail) == Role::Exclusive);
            events
                .iter()
                .find(|e| {
                    e.t_ns > kill.t_ns
                        && e.process != kill.process
                        && e.op == Op::Acquire
                        && e.phase == Phase::Ok
                        && (killed_a_writer || Role::from_detail(&e.detail) == Role::Exclusive)
                })
                .map(|e| ms(e.t_ns))
        }
    }
}

/// The family's client-belief check: spans during which the clients that
/// believed they held a key were more than it allows at once — more than
/// the semaphore's permits, or a writer beside anyone — with how long each
/// lasted, ns. (The mutex's is [`belief_overlaps`](crate::history::belief_overlaps),
/// pair by pair.) A belief runs from the acquire's reply to the release's
/// call or the loss signal, as there.
pub fn family_belief_excess(events: &[Event], primitive: Primitive) -> Vec<u64> {
    use crate::family::Role;
    let end = events.iter().map(|e| e.t_ns).max().unwrap_or(0);
    // (time, +1 start / -1 end, role); per key.
    let mut edges: std::collections::BTreeMap<&str, Vec<(u64, i8, Role)>> = Default::default();
    let mut open: std::collections::HashMap<(usize, &str), (u64, Role)> = Default::default();
    for e in events {
        match (e.op, e.phase) {
            (Op::Acquire, Phase::Ok) => {
                open.insert((e.process, &e.key), (e.t_ns, Role::from_detail(&e.detail)));
            }
            (Op::Release, Phase::Invoke) | (Op::Lost, _) => {
                if let Some((from, role)) = open.remove(&(e.process, e.key.as_str())) {
                    let v = edges.entry(&e.key).or_default();
                    v.push((from, 1, role));
                    v.push((e.t_ns, -1, role));
                }
            }
            _ => {}
        }
    }
    for ((_, key), (from, role)) in open {
        let v = edges.entry(key).or_default();
        v.push((from, 1, role));
        v.push((end, -1, role));
    }
    let mut out = Vec::new();
    for mut v in edges.into_values() {
        // Ends before starts at one instant: a hand-off is not an excess.
        v.sort_by_key(|&(t, d, _)| (t, d));
        let (mut holders, mut writers) = (0i64, 0i64);
        let mut since: Option<u64> = None;
        for (t, d, role) in v {
            holders += i64::from(d);
            if role == Role::Exclusive {
                writers += i64::from(d);
            }
            let excess = match primitive {
                Primitive::Semaphore => holders > i64::from(crate::model::SEMAPHORE_PERMITS),
                _ => writers > 0 && holders > 1,
            };
            match (excess, since) {
                (true, None) => since = Some(t),
                (false, Some(s)) => {
                    out.push(t - s);
                    since = None;
                }
                _ => {}
            }
        }
    }
    out
}

/// RELIABILITY.md's second table: for the process and server faults (and
/// their controls), whether each fault was confirmed to have happened, and
/// the checks those faults add.
pub fn evidence_markdown(results: &[crate::model::RunResult]) -> String {
    use std::fmt::Write as _;

    use crate::model::{Fault, FaultKind, Target};
    let mut cells: std::collections::BTreeMap<
        crate::model::CellKey,
        Vec<&crate::model::RunResult>,
    > = Default::default();
    for r in results {
        if r.config.fault.kind() == FaultKind::InProcess && r.config.mutant.is_none() {
            continue;
        }
        cells.entry(crate::model::cell_key(r)).or_default().push(r);
    }
    let mut out = String::new();
    if cells.is_empty() {
        return out;
    }
    let _ = writeln!(
        out,
        "\n## Process and server faults: evidence and their own checks\n\n\
         | store | fault | runs | faults confirmed / injected | token regressions | overlaps where none is allowed | victim noticed its loss (runs) | takeover after SIGKILL p50 / max ms | deadlocks / lock-wait timeouts (server) | evidence (first run) |\n\
         |---|---|--:|--:|--:|--:|--:|--:|--:|---|"
    );
    for ((v, p, t, f), runs) in &cells {
        let confirmed: u64 = runs.iter().map(|r| r.confirmed_faults).sum();
        let injected: u64 = runs.iter().map(|r| r.faults).sum();
        let regressions: usize = runs.iter().map(|r| r.token_regressions).sum();
        let forbidden: usize = runs.iter().map(|r| r.forbidden_overlaps).sum();
        let noticed = runs
            .iter()
            .filter(|r| r.victim_noticed_loss == Some(true))
            .count();
        let mut take: Vec<f64> = runs.iter().filter_map(|r| r.takeover_ms).collect();
        take.sort_by(f64::total_cmp);
        let take = match (take.get(take.len() / 2), take.last()) {
            (Some(p50), Some(max)) => format!("{p50:.0} / {max:.0}"),
            _ => "–".into(),
        };
        let conflicts = runs
            .iter()
            .filter_map(|r| r.lock_conflicts)
            .fold(None, |acc: Option<(u64, u64)>, (d, w)| {
                let (a, b) = acc.unwrap_or((0, 0));
                Some((a + d, b + w))
            })
            .map_or_else(|| "–".into(), |(d, w)| format!("{d} / {w}"));
        let evidence = runs
            .first()
            .map(|r| r.evidence.join("; ").replace('|', "/"))
            .unwrap_or_default();
        let label = match v {
            0 => String::new(),
            1 => " **(fencing off)**".into(),
            _ => format!(
                " **(mutant: {})**",
                runs.first()
                    .and_then(|r| r.config.mutant)
                    .map_or("?", |m| m.name())
            ),
        };
        let _ = writeln!(
            out,
            "| {} | {}{label} | {} | {confirmed} / {injected} | {regressions} | {forbidden} | {noticed} of {} | {take} | {conflicts} | {evidence} |",
            crate::model::Primitive::ALL[*p].store_label(Target::ALL[*t]),
            Fault::ALL[*f].name(Target::ALL[*t]),
            runs.len(),
            runs.len(),
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ev(process: usize, op: Op, phase: Phase, token: Option<u64>, t_ns: u64) -> Event {
        Event {
            process,
            op,
            phase,
            key: "k".into(),
            token,
            t_ns,
            detail: String::new(),
        }
    }

    fn hold(process: usize, role: &str, from: u64, to: u64) -> [Event; 2] {
        let mut a = ev(process, Op::Acquire, Phase::Ok, Some(from), from);
        a.detail = role.into();
        [a, ev(process, Op::Release, Phase::Invoke, Some(from), to)]
    }

    fn timeline(holds: &[[Event; 2]]) -> Vec<Event> {
        let mut v: Vec<Event> = holds.iter().flatten().cloned().collect();
        v.sort_by_key(|e| e.t_ns);
        v
    }

    #[test]
    fn a_family_takeover_waits_for_the_killed_holders_share() {
        let kill = |t| {
            let mut e = ev(0, Op::Fault, Phase::Invoke, Some(1), t);
            e.detail = "SIGKILL pid 1".into();
            e
        };
        // Permit 1 killed at 10; client 1 already held the other permit,
        // client 2 gets one at 12 (free all along), both held at 12.
        let sem = timeline(&[
            hold(0, "permit", 1, 100),
            hold(1, "permit", 5, 30),
            hold(2, "permit", 12, 40),
        ]);
        let mut sem: Vec<Event> = sem
            .into_iter()
            .filter(|e| e.process != 0 || e.op == Op::Acquire)
            .collect();
        sem.push(kill(10));
        sem.sort_by_key(|e| e.t_ns);
        assert_eq!(family_takeover_ms(&sem, Primitive::Semaphore), Some(2e-6));
        // A killed reader: other readers do not count, the writer does.
        let mut rw = timeline(&[hold(1, "read", 12, 20), hold(2, "write", 30, 40)]);
        let mut a = ev(0, Op::Acquire, Phase::Ok, Some(1), 1);
        a.detail = "read".into();
        rw.push(a);
        rw.push(kill(10));
        rw.sort_by_key(|e| e.t_ns);
        assert_eq!(family_takeover_ms(&rw, Primitive::ReadWrite), Some(20e-6));
    }

    #[test]
    fn family_beliefs_beyond_what_the_key_allows_are_found() {
        // Two permits at once are fine, a third is an excess of 5 ns.
        let sem = timeline(&[
            hold(0, "permit", 0, 20),
            hold(1, "permit", 5, 30),
            hold(2, "permit", 10, 15),
            hold(3, "permit", 30, 40),
        ]);
        assert_eq!(family_belief_excess(&sem, Primitive::Semaphore), vec![5]);
        // Readers together are fine; a writer beside a reader is not; a
        // hand-off at one instant is no excess.
        let rw = timeline(&[
            hold(0, "read", 0, 20),
            hold(1, "read", 5, 30),
            hold(2, "write", 30, 40),
            hold(3, "read", 35, 50),
        ]);
        assert_eq!(family_belief_excess(&rw, Primitive::ReadWrite), vec![5]);
        let clean = timeline(&[hold(0, "read", 0, 20), hold(1, "write", 20, 30)]);
        assert!(family_belief_excess(&clean, Primitive::ReadWrite).is_empty());
    }

    #[test]
    fn a_token_below_an_acknowledged_one_is_a_regression_a_late_reply_is_not() {
        let fine = [
            ev(0, Op::Acquire, Phase::Invoke, None, 0),
            ev(1, Op::Acquire, Phase::Invoke, None, 1),
            ev(1, Op::Acquire, Phase::Ok, Some(20), 5),
            // 0's grant (10) was issued first; its reply came late.
            ev(0, Op::Acquire, Phase::Ok, Some(10), 6),
        ];
        assert_eq!(token_regressions(&fine), 0);
        let reset = [
            ev(0, Op::Acquire, Phase::Invoke, None, 0),
            ev(0, Op::Acquire, Phase::Ok, Some(20), 1),
            ev(1, Op::Acquire, Phase::Invoke, None, 10),
            // A restart that forgot the counter hands out 1 again.
            ev(1, Op::Acquire, Phase::Ok, Some(1), 11),
        ];
        assert_eq!(token_regressions(&reset), 1);
    }

    #[test]
    fn victim_loss_and_takeover() {
        let mut fault = ev(0, Op::Fault, Phase::Invoke, None, 10);
        fault.detail = "SIGKILL pid 1".into();
        let h = [
            ev(0, Op::Acquire, Phase::Ok, Some(1), 5),
            fault,
            ev(1, Op::Acquire, Phase::Ok, Some(2), 1_000_010),
        ];
        assert_eq!(victim_noticed_loss(&h), Some(false));
        assert_eq!(takeover_ms(&h), Some(1.0));
        let mut noticed = h.to_vec();
        noticed.push(ev(0, Op::Write, Phase::Fail, Some(1), 2_000_000));
        assert_eq!(victim_noticed_loss(&noticed), Some(true));
    }
}
