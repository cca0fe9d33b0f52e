//! The waiter queue: arrival order across clients, no barging, and entries
//! of waiters that died, froze, gave up or never claimed a hand-over not
//! blocking the others. Each test runs on a private `redis-server`; bounds
//! on waits only catch hangs (the failure they guard against costs a TTL of
//! 30 s or more).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stderr)]

mod common;

use std::{
    sync::{Arc, Mutex},
    time::Duration,
};

use common::{
    key,
    private::{Mode, PrivateRedis},
    queue_len, until_queued, url_for,
};
use fenced_api::{DistributedLock, Error, Lease, LockKey, LockOptions, ReleaseOutcome};
use fenced_redis::{redis, RedisLock};
use redis::aio::MultiplexedConnection;
use tokio::time::Instant;

/// Bound on a hand-over that must not wait for a TTL (30 s) or a lapsed entry.
const PROMPT: Duration = Duration::from_secs(3);

fn long() -> LockOptions {
    LockOptions::builder()
        .ttl(Duration::from_secs(30))
        .wait_timeout(Duration::from_secs(60))
        .build()
        .unwrap()
}

fn queue_name(prefix: &str, k: &LockKey) -> String {
    format!("{{{prefix}/{}}}:q", k.as_str())
}

/// Wake-up channels with a subscriber, for this prefix.
async fn wake_channels(admin: &mut MultiplexedConnection, prefix: &str) -> Vec<String> {
    redis::cmd("PUBSUB")
        .arg("CHANNELS")
        .arg(format!("{{{prefix}/}}:w:*"))
        .query_async(admin)
        .await
        .unwrap()
}

/// A private server set up for a test of the queue of key `name`: its admin
/// connection, a client URL in namespace `name` (with `params` appended),
/// the key and its queue.
struct Scene {
    _server: PrivateRedis,
    admin: MultiplexedConnection,
    url: String,
    k: LockKey,
    queue: String,
}

impl Scene {
    async fn start(name: &str, params: &str) -> Scene {
        let server = PrivateRedis::start(Mode::NoPersistence).await.unwrap();
        let admin = server.admin().await;
        let url = format!("{}{params}", url_for(&server.url(), name));
        let k = key(name);
        let queue = queue_name(name, &k);
        Scene {
            _server: server,
            admin,
            url,
            k,
            queue,
        }
    }

    /// `N` clients, each with its own connection.
    async fn clients<const N: usize>(&self) -> [RedisLock; N] {
        let mut clients = Vec::with_capacity(N);
        for _ in 0..N {
            clients.push(RedisLock::connect(&self.url).await.unwrap());
        }
        clients.try_into().unwrap()
    }

    /// [`Scene::start`], the key, and `N` clients, the first of which holds
    /// the key.
    async fn held<const N: usize>(
        name: &str,
        params: &str,
    ) -> (Scene, LockKey, [RedisLock; N], Lease) {
        let scene = Scene::start(name, params).await;
        let clients: [RedisLock; N] = scene.clients().await;
        let held = clients[0]
            .try_acquire(&scene.k, &long())
            .await
            .unwrap()
            .unwrap();
        let k = scene.k.clone();
        (scene, k, clients, held)
    }

    async fn until_queued(&mut self, n: usize) {
        until_queued(&mut self.admin, &self.queue, n).await;
    }
}

/// Releases `held` and takes the key `task` waits for from it: within
/// [`PROMPT`], or `what` held it up.
async fn hand_over(
    holder: &RedisLock,
    held: &Lease,
    task: tokio::task::JoinHandle<(fenced_api::Result<Lease>, Instant)>,
    what: &str,
) -> Lease {
    let released = Instant::now();
    holder.release(held).await.unwrap();
    let (got, at) = task.await.unwrap();
    let got = got.unwrap();
    let waited = at - released;
    eprintln!("the live waiter got the key {waited:?} after the release");
    assert!(waited < PROMPT, "{what} for {waited:?}");
    got
}

fn spawn_waiter(
    lock: &RedisLock,
    k: &LockKey,
    opts: &LockOptions,
) -> tokio::task::JoinHandle<(fenced_api::Result<Lease>, Instant)> {
    let (lock, k, opts) = (lock.clone(), k.clone(), opts.clone());
    tokio::spawn(async move {
        let r = lock.acquire(&k, &opts).await;
        (r, Instant::now())
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiters_get_the_key_in_arrival_order_across_clients() {
    const N: usize = 5;
    let (mut scene, k, [holder], held) = Scene::held("order", "").await;
    let served = Arc::new(Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for i in 0..N {
        // Its own client, so its own connection: arrival order is the server's.
        let [lock] = scene.clients().await;
        let (k, served) = (k.clone(), served.clone());
        tasks.push(tokio::spawn(async move {
            let lease = lock.acquire(&k, &long()).await.unwrap();
            served.lock().unwrap().push((i, lease.token));
            tokio::time::sleep(Duration::from_millis(20)).await;
            assert_eq!(
                lock.release(&lease).await.unwrap(),
                ReleaseOutcome::Released
            );
        }));
        scene.until_queued(i + 1).await;
    }
    holder.release(&held).await.unwrap();
    for t in tasks {
        tokio::time::timeout(Duration::from_secs(30), t)
            .await
            .expect("every waiter is served")
            .unwrap();
    }
    let served = served.lock().unwrap().clone();
    eprintln!("served: {served:?}");
    let order: Vec<usize> = served.iter().map(|(i, _)| *i).collect();
    assert_eq!(
        order,
        (0..N).collect::<Vec<_>>(),
        "served out of arrival order"
    );
    assert!(served.windows(2).all(|w| w[0].1 < w[1].1), "tokens rise");
    assert!(served[0].1 > held.token);
    assert_eq!(queue_len(&mut scene.admin, &scene.queue).await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_holder_expires_the_queue_goes_before_a_polling_try() {
    let mut scene = Scene::start("expiry", "").await;
    let [crashed, a, b, poller] = scene.clients().await;
    let k = scene.k.clone();
    // Long enough for both waiters to queue first, even on a loaded machine.
    let short = LockOptions::builder()
        .ttl(Duration::from_secs(3))
        .build()
        .unwrap();
    // Never released: the lease runs out.
    let dead = crashed.try_acquire(&k, &short).await.unwrap().unwrap();
    let order = Arc::new(Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for (name, lock) in [("a", &a), ("b", &b)] {
        let (lock, k, order) = (lock.clone(), k.clone(), order.clone());
        tasks.push(tokio::spawn(async move {
            let lease = lock.acquire(&k, &long()).await.unwrap();
            order.lock().unwrap().push(name);
            tokio::time::sleep(Duration::from_millis(50)).await;
            lock.release(&lease).await.unwrap();
        }));
        scene.until_queued(tasks.len()).await;
    }
    // A plain try in a tight loop across the expiry: never ahead of the queue.
    let start = Instant::now();
    let mine = loop {
        if let Some(l) = poller.try_acquire(&k, &long()).await.unwrap() {
            break l;
        }
        assert!(start.elapsed() < Duration::from_secs(20), "never free");
        tokio::time::sleep(Duration::from_millis(5)).await;
    };
    order.lock().unwrap().push("poller");
    for t in tasks {
        t.await.unwrap();
    }
    assert_eq!(*order.lock().unwrap(), vec!["a", "b", "poller"]);
    assert!(mine.token > dead.token);
    poller.release(&mine).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn try_acquire_never_queues_nor_barges() {
    let (mut scene, k, [holder, waiter, other], held) = Scene::held("barge", "").await;
    let task = spawn_waiter(&waiter, &k, &long());
    scene.until_queued(1).await;
    assert!(other.try_acquire(&k, &long()).await.unwrap().is_none());
    assert_eq!(
        queue_len(&mut scene.admin, &scene.queue).await,
        1,
        "a try never queues"
    );
    // The release hands the key to the waiter in the same step: a try right
    // after it finds the key held.
    holder.release(&held).await.unwrap();
    assert!(other.try_acquire(&k, &long()).await.unwrap().is_none());
    let (got, _) = task.await.unwrap();
    let got = got.unwrap();
    let info = other.inspect(&k).await.unwrap().unwrap();
    assert_eq!(info.token, got.token);
    assert_eq!(info.owner, got.owner);
    waiter.release(&got).await.unwrap();
    let next = other.try_acquire(&k, &long()).await.unwrap().unwrap();
    assert!(next.token > got.token);
    other.release(&next).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_timed_out_waiter_leaves_the_queue() {
    let (mut scene, k, [holder, waiter], held) = Scene::held("timeout", "").await;
    let brief = long()
        .to_builder()
        .wait_timeout(Duration::from_millis(300))
        .build()
        .unwrap();
    match waiter.acquire(&k, &brief).await {
        Err(Error::Timeout { .. }) => {}
        other => panic!("expected a timeout, got {other:?}"),
    }
    scene.until_queued(0).await;
    assert_eq!(
        holder.inspect(&k).await.unwrap().unwrap().token,
        held.token,
        "the holder is undisturbed"
    );
    holder.release(&held).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_hand_over_is_renewed_before_it_is_returned() {
    // No re-check while waiting: the hand-over comes 1.4 s after the waiter queued.
    let (mut scene, k, [holder, waiter], held) = Scene::held("late", "&recheck_interval=10s").await;
    let ttl = Duration::from_secs(2);
    let opts = long().to_builder().ttl(ttl).build().unwrap();
    let task = spawn_waiter(&waiter, &k, &opts);
    scene.until_queued(1).await;
    tokio::time::sleep(Duration::from_millis(1400)).await;
    holder.release(&held).await.unwrap();
    let (got, _) = task.await.unwrap();
    let got = got.unwrap();
    // Counted from the waiter's queued attempt, the lease would have under
    // 600 ms left; it was renewed first (a second of room for slow replies).
    let left = got.remaining();
    assert!(left > ttl / 2 && left <= ttl, "{left:?} left of {ttl:?}");
    let info = waiter.inspect(&k).await.unwrap().unwrap();
    assert_eq!(info.token, got.token);
    assert!(info.remaining_ttl > ttl / 2, "{info:?}");
    waiter.release(&got).await.unwrap();
}

/// A client on its own runtime in its own thread, as another process would be.
struct Remote {
    thread: std::thread::JoinHandle<()>,
    /// Tells the remote runtime what to do next.
    order: tokio::sync::mpsc::UnboundedSender<&'static str>,
}

/// Starts a waiter for `k` on a separate single-threaded runtime. On
/// "crash" the runtime is shut down without running anything else (no
/// leave script; the connection closes); on "freeze" its only thread blocks
/// for `freeze` (the connection stays open, nothing is answered), then the
/// waiter carries on and releases whatever it gets.
fn remote_waiter(url: String, k: LockKey, freeze: Duration) -> Remote {
    let (order, mut orders) = tokio::sync::mpsc::unbounded_channel();
    let thread = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let lock = rt.block_on(RedisLock::connect(&url)).unwrap();
        let task = {
            let lock = lock.clone();
            rt.spawn(async move { lock.acquire(&k, &long()).await })
        };
        match rt.block_on(orders.recv()) {
            Some("freeze") => {
                rt.block_on(async {
                    std::thread::sleep(freeze);
                    if let Ok(Ok(lease)) = task.await {
                        let _ = lock.release(&lease).await;
                    }
                });
            }
            _ => rt.shutdown_background(),
        }
    });
    Remote { thread, order }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_waiter_is_skipped_at_once() {
    // A 10 s re-check: the dead waiter's entry would stay live for 31 s.
    let (mut scene, k, [holder, live], held) = Scene::held("dead", "&recheck_interval=10s").await;
    let dead = remote_waiter(scene.url.clone(), k.clone(), Duration::ZERO);
    scene.until_queued(1).await;
    dead.order.send("crash").unwrap();
    dead.thread.join().unwrap();
    // The server has seen the connection close.
    let start = Instant::now();
    while !wake_channels(&mut scene.admin, "dead").await.is_empty() {
        assert!(start.elapsed() < Duration::from_secs(10));
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let task = spawn_waiter(&live, &k, &long());
    scene.until_queued(2).await;
    let what = "the dead waiter's entry held the queue up";
    let got = hand_over(&holder, &held, task, what).await;
    assert_eq!(
        queue_len(&mut scene.admin, &scene.queue).await,
        0,
        "the dead entry was dropped"
    );
    live.release(&got).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_waiter_is_skipped_once_its_entry_lapses() {
    let (mut scene, k, [holder, live], held) = Scene::held("frozen", "").await;
    // Re-checks every 100 ms while running: its entry lapses 1.3 s after the
    // last one. Frozen for 4 s, connection open and subscribed.
    let frozen = remote_waiter(
        format!("{}&recheck_interval=100ms", scene.url),
        k.clone(),
        Duration::from_secs(4),
    );
    scene.until_queued(1).await;
    frozen.order.send("freeze").unwrap();
    let frozen_at = Instant::now();
    let task = spawn_waiter(&live, &k, &long());
    scene.until_queued(2).await;
    assert_eq!(wake_channels(&mut scene.admin, "frozen").await.len(), 2);
    tokio::time::sleep_until(frozen_at + Duration::from_millis(2000)).await;
    let got = hand_over(&holder, &held, task, "the lapsed entry held the queue up").await;
    assert!(
        frozen_at.elapsed() < Duration::from_secs(4),
        "served before the frozen waiter woke up"
    );
    live.release(&got).await.unwrap();
    // Thawed, the frozen waiter queues again and is served.
    tokio::task::spawn_blocking(move || frozen.thread.join().unwrap())
        .await
        .unwrap();
    scene.until_queued(0).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hand_over_nobody_claims_is_passed_on() {
    let mut scene = Scene::start("ghost", "&recheck_interval=10s").await;
    let [holder, other, live] = scene.clients().await;
    // `other` waits once, so its wake-up channel is subscribed.
    let k0 = key("warm");
    let l0 = holder.try_acquire(&k0, &long()).await.unwrap().unwrap();
    let brief = long()
        .to_builder()
        .wait_timeout(Duration::from_millis(200))
        .build()
        .unwrap();
    assert!(other.acquire(&k0, &brief).await.is_err());
    holder.release(&l0).await.unwrap();
    let channels = wake_channels(&mut scene.admin, "ghost").await;
    assert_eq!(channels.len(), 1, "{channels:?}");

    let k = scene.k.clone();
    let held = holder.try_acquire(&k, &long()).await.unwrap().unwrap();
    let task = spawn_waiter(&live, &k, &long());
    scene.until_queued(1).await;
    // Ahead of it: an entry of a waiter of `other` that no longer exists
    // (as if its leave script had failed), live for a minute, asking 30 s.
    let (secs, _): (u64, u64) = redis::cmd("TIME")
        .query_async(&mut scene.admin)
        .await
        .unwrap();
    let ghost = format!(
        "{}|30000|{}|{}|ghost",
        secs * 1000 + 60_000,
        uuid::Uuid::new_v4().simple(),
        channels[0]
    );
    let _: () = redis::cmd("ZADD")
        .arg(&scene.queue)
        .arg(0)
        .arg(&ghost)
        .query_async(&mut scene.admin)
        .await
        .unwrap();
    let got = hand_over(&holder, &held, task, "the unclaimed hand-over held the key").await;
    assert!(got.token > held.token);
    live.release(&got).await.unwrap();
}
