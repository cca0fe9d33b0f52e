//! Unit tests of the per-lock deadline tracker and its reaper.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use super::*;

const RETRY: Duration = Duration::from_secs(1);
const RETRY_MAX: Duration = Duration::from_secs(16);

type Tracker = Deadlines<(String, i64), i64>;

fn tracker() -> Tracker {
    Deadlines::new(RETRY, RETRY_MAX)
}

fn key(path: &str, token: i64) -> (String, i64) {
    (path.to_string(), token)
}

/// A deletion of an expired lock the store did not answer is retried
/// after a pause — without moving the lock's deadline, which a holder's
/// `inspect` reports as the remaining TTL.
#[test]
fn a_failed_deletion_keeps_the_passed_deadline() {
    let t = tracker();
    let k = key("/a", 7);
    let deadline = Instant::now()
        .checked_sub(Duration::from_millis(10))
        .unwrap();
    t.track(k.clone(), 1, deadline);
    let now = Instant::now();
    assert_eq!(t.take_due(now), [(k.clone(), 1)], "due at its deadline");
    assert!(t.take_due(now).is_empty(), "one deletion at a time");
    t.reap_failed(&k);

    assert_eq!(
        t.deadline(&k),
        Some(deadline),
        "the retry pause must not become remaining TTL"
    );
    assert_eq!(t.begin_extend(&k), Tracked::Expired);
    // Retried after the pause, not before.
    assert!(t.next_due().unwrap() <= now + RETRY_MAX);
    assert!(t.take_due(Instant::now()).is_empty());
    let later = Instant::now() + RETRY_MAX + Duration::from_secs(1);
    assert_eq!(t.take_due(later).len(), 1, "retried after the pause");
}

/// The pause after a failed deletion doubles, capped; equal bounds
/// give a fixed pause.
#[test]
fn the_retry_pause_backs_off_up_to_its_cap() {
    for (max, pauses) in [(RETRY_MAX, [2, 4, 8, 16, 16]), (RETRY, [1; 5])] {
        let t: Tracker = Deadlines::new(RETRY, max);
        let k = key("/a", 7);
        t.track(k.clone(), 1, Instant::now());
        for secs in pauses {
            let start = Instant::now() + Duration::from_secs(100);
            assert_eq!(t.take_due(start).len(), 1);
            t.reap_failed(&k);
            let retry = t.state().held[&k].retry_at.unwrap();
            let pause = retry.saturating_duration_since(Instant::now());
            assert!(pause <= Duration::from_secs(secs), "{pause:?} > {secs}s");
            assert!(pause + Duration::from_secs(1) > Duration::from_secs(secs));
            t.state().held.get_mut(&k).unwrap().retry_at = None;
        }
    }
}

/// A lock found gone alone, or every lock of a session that ended, is
/// refused at its next extend (and forgotten then); the others are not.
#[test]
fn lost_locks_refuse_extends() {
    let t = tracker();
    let later = Instant::now() + Duration::from_secs(60);
    t.track(key("/a", 7), 1, later);
    t.track(key("/a", 8), 1, later);
    t.track(key("/b", 9), 2, later);
    t.track(key("/c", 10), 3, later);
    t.lose(&key("/a", 7));
    assert_eq!(t.begin_extend(&key("/a", 7)), Tracked::Lost);
    assert_eq!(t.begin_extend(&key("/a", 7)), Tracked::No, "forgotten");
    assert_eq!(t.begin_extend(&key("/a", 8)), Tracked::Yes(1));
    t.lose_where(|_, &session| session == 2);
    assert_eq!(t.begin_extend(&key("/b", 9)), Tracked::Lost);
    assert_eq!(t.begin_extend(&key("/c", 10)), Tracked::Yes(3));
}

/// An expired lock refuses extends and is no longer held; a renewed one
/// takes its new deadline and data, and its deadline never moves back.
#[test]
fn extends_of_expired_and_renewed_locks() {
    let t = tracker();
    let later = Instant::now() + Duration::from_secs(60);
    t.track(key("/b", 8), 2, later);
    t.track(key("/c", 9), 2, Instant::now());
    assert_eq!(t.begin_extend(&key("/b", 99)), Tracked::No);
    assert_eq!(t.begin_extend(&key("/b", 8)), Tracked::Yes(2));
    assert_eq!(t.begin_extend(&key("/c", 9)), Tracked::Expired);
    assert!(!t.holds(|k| k.0 == "/c"), "expired");
    assert_eq!(t.take_due(Instant::now()), [(key("/c", 9), 2)]);
    let renewed = later + Duration::from_secs(1);
    t.end_extend(&key("/b", 8), Some((renewed, 3)));
    assert_eq!(t.deadline(&key("/b", 8)), Some(renewed));
    assert_eq!(
        t.begin_extend(&key("/b", 8)),
        Tracked::Yes(3),
        "data renewed"
    );
    t.end_extend(&key("/b", 8), Some((later, 3)));
    assert_eq!(t.deadline(&key("/b", 8)), Some(renewed), "never moves back");
    assert_eq!(t.find(|k| k.1 == 8), Some(key("/b", 8)));
    assert!(t.holds(|k| k.0 == "/b"));
}

/// The reaper leaves a lock alone while an extend is in flight, and
/// takes it once the extend ends without renewing it.
#[test]
fn an_extend_in_flight_holds_the_reaper_off() {
    let t = tracker();
    let soon = Instant::now() + Duration::from_millis(50);
    t.track(key("/a", 7), 1, soon);
    assert_eq!(t.begin_extend(&key("/a", 7)), Tracked::Yes(1));
    let past = soon + Duration::from_secs(1);
    assert!(t.take_due(past).is_empty(), "extend in flight");
    t.end_extend(&key("/a", 7), None);
    assert_eq!(t.next_due(), Some(soon));
    assert_eq!(t.take_due(past), [(key("/a", 7), 1)]);
    assert!(!t.holds(|_| true));
}

/// A lost lock is forgotten when it comes due, not deleted.
#[test]
fn a_lost_lock_is_forgotten_not_reaped() {
    let t = tracker();
    t.track(key("/a", 7), 1, Instant::now());
    t.lose_where(|_, _| true);
    assert!(t.take_due(Instant::now()).is_empty());
    assert!(t.is_empty());
}

/// The driver deletes what comes due, forgets it on success, retries a
/// failure, and ends when its context is gone.
#[tokio::test(start_paused = true)]
async fn the_reaper_deletes_due_locks_and_retries_failures() {
    let t = Arc::new(tracker());
    let context = Arc::new(Mutex::new(Vec::new()));
    let reaper = tokio::spawn(Arc::clone(&t).run_reaper(
        Arc::downgrade(&context),
        |calls: Arc<Mutex<Vec<(String, i64)>>>, k: (String, i64), _| async move {
            let mut calls = calls.lock().unwrap();
            calls.push(k.clone());
            // The first attempt at /b fails.
            if k.0 == "/b" && calls.iter().filter(|c| c.0 == "/b").count() == 1 {
                Reaped::Failed
            } else {
                Reaped::Done
            }
        },
    ));
    let now = Instant::now();
    t.track(key("/a", 1), 0, now + Duration::from_secs(5));
    t.track(key("/b", 2), 0, now + Duration::from_secs(10));
    t.track(key("/c", 3), 0, now + Duration::from_secs(60));
    tokio::time::sleep(Duration::from_secs(11)).await;
    assert_eq!(*context.lock().unwrap(), [key("/a", 1), key("/b", 2)]);
    assert_eq!(t.len(), 2, "/b stays until its deletion succeeds");
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(t.len(), 1, "/b retried after the pause");
    drop(context);
    tokio::time::sleep(Duration::from_secs(60)).await;
    assert!(reaper.is_finished(), "the reaper ends with its context");
    assert_eq!(t.len(), 1);
}

/// The guard ends the extend when dropped — with the renewal it recorded,
/// also when the extend's future is dropped half way; a guard for no
/// extend in flight does nothing.
#[test]
fn the_extending_guard_ends_the_extend() {
    let t = tracker();
    let soon = Instant::now() + Duration::from_millis(50);
    let past = soon + Duration::from_secs(1);
    t.track(key("/a", 7), 1, soon);
    assert_eq!(t.begin_extend(&key("/a", 7)), Tracked::Yes(1));
    let mut ending = t.extending(Some(key("/a", 7)));
    assert!(ending.is_active());
    ending.renewed(past + Duration::from_secs(1), 2);
    assert!(t.take_due(past).is_empty(), "extend in flight");
    drop(ending);
    assert_eq!(t.begin_extend(&key("/a", 7)), Tracked::Yes(2), "renewed");
    drop(t.extending(Some(key("/a", 7))));
    drop(t.extending(None));
    assert!(
        t.take_due(past).is_empty(),
        "not due before its new deadline"
    );
    let later = past + Duration::from_secs(2);
    assert_eq!(t.take_due(later), [(key("/a", 7), 2)], "extend ended");
}

/// Tracking a lock tracked already (two extends of one lease finishing out
/// of order) keeps the later deadline and takes the newer data.
#[test]
fn tracking_again_never_moves_a_deadline_back() {
    let t = tracker();
    let k = key("/a", 7);
    let later = Instant::now() + Duration::from_secs(60);
    t.track(k.clone(), 1, later);
    t.track(k.clone(), 2, later - Duration::from_secs(30));
    assert_eq!(t.deadline(&k), Some(later));
    assert_eq!(t.data(&k), Some(2));
    t.track(k.clone(), 3, later + Duration::from_secs(1));
    assert_eq!(t.deadline(&k), Some(later + Duration::from_secs(1)));
}
