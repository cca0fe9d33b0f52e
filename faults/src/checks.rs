//! History checks the newer fault scenarios add to those of
//! [`history`](crate::history): tokens never going backwards across a server
//! restart, whether the victim learnt of its loss, and how long a killed
//! holder kept the key from the others.

use crate::history::{Event, Op, Phase};

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
                e.process == p && e.t_ns >= fault.t_ns && e.op == Op::Acquire && e.phase == Phase::Ok
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
