//! The queue on real servers: waiters are served in the order they arrived,
//! and a release wakes one waiter (its successor), never the herd.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::{
    collections::BTreeSet,
    sync::{Arc, Mutex, OnceLock},
    time::Duration,
};

use common::{four_letter, opts, parse_wchp, queue_path, raw_client, wait_for_entries, ZkHarness};
use fenced_api::{DistributedLock, FencingToken, Lease, LockKey, ReleaseOutcome};
use fenced_testkit::private::{PrivateZooKeeper, ZooKeeperOptions};
use fenced_zookeeper::ZkLock;
use tracing_subscriber::{layer::Context, prelude::*, Layer};

/// Within every test's session timeout (20 s).
const TTL: Duration = Duration::from_secs(15);
/// Hang catcher for every wait.
const WAIT: Duration = Duration::from_secs(60);

/// One holder, then `waiters` entering the queue one after another (each
/// waiter's entry exists before the next one starts): after the holder's
/// release they are granted in exactly that order, with increasing tokens.
async fn served_in_arrival_order(h: &ZkHarness, key: &str, waiters: Vec<ZkLock>) {
    let n = waiters.len();
    let lock_key = LockKey::new(key).unwrap();
    let raw = raw_client(h.hosts()).await;
    let queue = queue_path(h.namespace(), key);
    let holder = h.lock().await;
    let first = holder.acquire(&lock_key, &opts(TTL, WAIT)).await.unwrap();
    wait_for_entries(&raw, &queue, 1).await;

    let granted = Arc::new(Mutex::new(Vec::<(usize, FencingToken)>::new()));
    let mut tasks = Vec::new();
    for (i, w) in waiters.into_iter().enumerate() {
        let (k, granted) = (lock_key.clone(), Arc::clone(&granted));
        tasks.push(tokio::spawn(async move {
            let lease = w.acquire(&k, &opts(TTL, WAIT)).await.unwrap();
            // Recorded while held: the pushes are in grant order.
            granted.lock().unwrap().push((i, lease.token));
            assert_eq!(w.release(&lease).await.unwrap(), ReleaseOutcome::Released);
        }));
        wait_for_entries(&raw, &queue, i + 2).await;
    }
    assert_eq!(
        holder.release(&first).await.unwrap(),
        ReleaseOutcome::Released
    );
    for t in tasks {
        tokio::time::timeout(WAIT, t)
            .await
            .expect("every waiter is served")
            .unwrap();
    }

    let granted = granted.lock().unwrap().clone();
    let order: Vec<usize> = granted.iter().map(|(i, _)| *i).collect();
    assert_eq!(
        order,
        (0..n).collect::<Vec<_>>(),
        "grant order = arrival order"
    );
    let mut last = first.token;
    for (i, token) in &granted {
        assert!(*token > last, "waiter {i}: token {token} after {last}");
        last = *token;
    }
    wait_for_entries(&raw, &queue, 0).await;
}

#[tokio::test]
async fn waiters_on_their_own_sessions_are_served_in_arrival_order() {
    let h = ZkHarness::new().await;
    let mut waiters = Vec::new();
    for _ in 0..10 {
        waiters.push(h.lock().await);
    }
    served_in_arrival_order(&h, "fifo-sessions", waiters).await;
}

#[tokio::test]
async fn waiters_sharing_one_client_are_served_in_arrival_order() {
    let h = ZkHarness::new().await;
    let one = h.lock().await;
    served_in_arrival_order(&h, "fifo-shared", vec![one; 10]).await;
}

/// The wake-ups of waiters, seen through the `woken: predecessor changed`
/// events of `fenced_zookeeper::wait`: (key, predecessor path).
#[derive(Clone, Default)]
struct Wakes(Arc<Mutex<Vec<(String, String)>>>);

/// The wake-ups of this test process. The subscriber is the global one:
/// a subscriber scoped to one thread misses events whose callsite another
/// thread reached first (tracing caches that callsite's interest as
/// "never"). Tests tell their wake-ups apart by key.
fn wakes() -> Wakes {
    static WAKES: OnceLock<Wakes> = OnceLock::new();
    WAKES
        .get_or_init(|| {
            let wakes = Wakes::default();
            tracing::subscriber::set_global_default(
                tracing_subscriber::registry().with(wakes.clone()),
            )
            .expect("no other global subscriber in this test binary");
            wakes
        })
        .clone()
}

impl Wakes {
    /// The predecessors whose change woke a waiter of `key`, in order.
    fn of(&self, key: &str) -> Vec<String> {
        let all = self.0.lock().unwrap();
        all.iter()
            .filter(|(k, _)| k == key)
            .map(|(_, p)| p.clone())
            .collect()
    }
}

#[derive(Default)]
struct Fields {
    message: String,
    key: String,
    predecessor: String,
}

impl tracing::field::Visit for Fields {
    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        let v = format!("{value:?}");
        match field.name() {
            "message" => self.message = v,
            "key" => self.key = v,
            "predecessor" => self.predecessor = v,
            _ => {}
        }
    }
}

impl<S: tracing::Subscriber> Layer<S> for Wakes {
    fn on_event(&self, event: &tracing::Event<'_>, _: Context<'_, S>) {
        if event.metadata().target() != "fenced_zookeeper::wait" {
            return;
        }
        let mut f = Fields::default();
        event.record(&mut f);
        if f.message == "woken: predecessor changed" {
            self.0.lock().unwrap().push((f.key, f.predecessor));
        }
    }
}

const HERD: usize = 16;

/// Waits until the server's `wchp` shows exactly the paths `watched` of
/// `queue` watched, then checks each is watched by exactly one session.
async fn watched_once_each(hostport: &str, queue: &str, watched: &[String]) {
    let until = tokio::time::Instant::now() + Duration::from_secs(20);
    let want: BTreeSet<String> = watched.iter().map(|n| format!("{queue}/{n}")).collect();
    loop {
        let mut now = parse_wchp(&four_letter(hostport, "wchp").await);
        now.retain(|path, sessions| path.starts_with(&format!("{queue}/")) && !sessions.is_empty());
        if now.keys().eq(&want) {
            for (path, sessions) in &now {
                assert_eq!(sessions.len(), 1, "{path} watched by {sessions:?}");
            }
            return;
        }
        assert!(
            tokio::time::Instant::now() < until,
            "the server never showed {want:?} watched once each; it shows {now:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// One holder and `waiters` (entering one after another); the test
/// releases the holder, then each waiter in turn as it is granted. Each
/// release must wake exactly one waiter — the next in line, watching the
/// released node — and the server must show every queue node watched by
/// at most one session throughout.
async fn one_wake_per_release(
    wakes: &Wakes,
    zk: &PrivateZooKeeper,
    key: &str,
    waiters: Vec<ZkLock>,
) {
    let hostport = zk.members()[0].hostport();
    let url = zk.url("/herd") + "?session_timeout=20s&connect_timeout=5s&timeout=5s";
    let lock_key = LockKey::new(key).unwrap();
    let raw = raw_client(&hostport).await;
    let queue = queue_path("/herd", key);
    let holder = ZkLock::connect(&url).await.unwrap();
    let first = holder.acquire(&lock_key, &opts(TTL, WAIT)).await.unwrap();
    wait_for_entries(&raw, &queue, 1).await;

    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<(usize, Lease)>();
    for (i, w) in waiters.iter().enumerate() {
        let (w, k, tx) = (w.clone(), lock_key.clone(), tx.clone());
        tokio::spawn(async move {
            let lease = w.acquire(&k, &opts(TTL, WAIT)).await.unwrap();
            tx.send((i, lease)).unwrap();
        });
        wait_for_entries(&raw, &queue, i + 2).await;
    }
    let nodes = wait_for_entries(&raw, &queue, waiters.len() + 1).await;
    watched_once_each(&hostport, &queue, &nodes[..waiters.len()]).await;
    assert!(wakes.of(key).is_empty(), "woken before any release");

    let (mut client, mut lease) = (holder, first);
    for i in 0..waiters.len() {
        assert_eq!(
            client.release(&lease).await.unwrap(),
            ReleaseOutcome::Released
        );
        let (j, next) = tokio::time::timeout(WAIT, rx.recv())
            .await
            .expect("the next waiter is granted")
            .unwrap();
        assert_eq!(j, i, "grant order = arrival order");
        assert!(next.token > lease.token);
        // The grant follows the successor's wake-up; any other waiter woken
        // by the same release was notified at the same time.
        let woken = wakes.of(key);
        assert_eq!(
            woken.len(),
            i + 1,
            "release {} woke {} waiters: {woken:?}",
            i + 1,
            woken.len() - i
        );
        watched_once_each(&hostport, &queue, &nodes[i + 1..waiters.len()]).await;
        (client, lease) = (waiters[j].clone(), next);
    }
    assert_eq!(
        client.release(&lease).await.unwrap(),
        ReleaseOutcome::Released
    );
    wait_for_entries(&raw, &queue, 0).await;
    // Every waiter returned: every wake-up has been recorded. One per
    // released node, by the waiter behind it.
    let want: Vec<String> = nodes[..waiters.len()]
        .iter()
        .map(|n| format!("{queue}/{n}"))
        .collect();
    assert_eq!(wakes.of(key), want);
}

async fn herd(wakes: Wakes) {
    let zk = PrivateZooKeeper::start(ZooKeeperOptions::default())
        .await
        .unwrap();
    let url = zk.url("/herd") + "?session_timeout=20s&connect_timeout=5s&timeout=5s";
    let mut sessions = Vec::new();
    for _ in 0..HERD {
        sessions.push(ZkLock::connect(&url).await.unwrap());
    }
    one_wake_per_release(&wakes, &zk, "herd-sessions", sessions).await;
    let one = ZkLock::connect(&url).await.unwrap();
    one_wake_per_release(&wakes, &zk, "herd-shared", vec![one; HERD]).await;
}

/// Sixteen waiters on sixteen sessions, then sixteen sharing one client.
#[tokio::test]
async fn a_release_wakes_only_the_successor() {
    herd(wakes()).await;
}

/// The packets the server has received on the one client session it
/// serves (`cons`: the probe's own connection has no session id).
async fn received_by_the_client(server: &str) -> (u64, String) {
    let cons = four_letter(server, "cons").await;
    let lines: Vec<&str> = cons
        .lines()
        .filter(|l| l.contains("sid=0x") && !l.contains("lop=NA"))
        .collect();
    assert_eq!(lines.len(), 1, "one client session expected:\n{cons}");
    let recved = lines[0]
        .split(&['(', ','][..])
        .find_map(|f| f.strip_prefix("recved="))
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no recved= in {}", lines[0]));
    (recved, lines[0].to_owned())
}

/// Entering the queue is one round trip: the children read goes out right
/// behind the create, without waiting for the create's reply. With every
/// reply held back, the server still receives both requests; a client that
/// waited for the create's reply would send the read never.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_children_read_goes_out_before_the_create_is_answered() {
    let zk = PrivateZooKeeper::start(ZooKeeperOptions::default())
        .await
        .expect("a private ZooKeeper starts (binaries from scripts/services.sh)");
    let server = zk.members()[0].hostport();
    let proxy = common::Blackhole::start(&server).await;
    // zookeeper-client pings after about two fifths of the connect timeout
    // without a request, and gives a silent connection up after all of it:
    // with 20 s, neither happens within the test's 5 s, so the requests
    // counted are the acquire's.
    let url = format!(
        "zk://{}/pipelined?session_timeout=30s&connect_timeout=20s&timeout=25s",
        proxy.hostport()
    );
    let store = ZkLock::connect(&url).await.unwrap();
    let k = LockKey::new("k").unwrap();
    // The namespace and the queue exist from here on: the next acquire
    // sends its create and its read, nothing else.
    let lease = store.acquire(&k, &opts(TTL, WAIT)).await.unwrap();
    assert_eq!(
        store.release(&lease).await.unwrap(),
        ReleaseOutcome::Released
    );
    let (before, _) = received_by_the_client(&server).await;
    proxy.mute_replies();
    let trying = tokio::spawn({
        let (store, k) = (store.clone(), k.clone());
        async move { store.try_acquire(&k, &opts(TTL, WAIT)).await }
    });
    let until = tokio::time::Instant::now() + Duration::from_secs(5);
    // `recved` counts a request when it arrives, `lop` names it once it
    // is processed (the read waits for the create's fsync): both must show.
    loop {
        let (now, line) = received_by_the_client(&server).await;
        if now >= before + 2 && line.contains("lop=GETC") {
            break;
        }
        assert!(
            tokio::time::Instant::now() < until,
            "{} request(s) reached the server while the create's reply was held back, the \
             last processed not the children read: {line}",
            now - before
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    trying.abort();
}
