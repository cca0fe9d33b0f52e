//! A five-minute tour of fenced on the embedded in-memory store: acquire,
//! contention, fencing tokens rejecting a paused ex-holder, loss signals,
//! tasks sharing one client, labels, and stopping before a lock can expire.
//!
//! Run: `cargo run -p fenced-examples --example tour`
#![allow(clippy::print_stdout)]

use std::{sync::Arc, time::Duration};

use fenced::{DistributedLock, Error, LockClient, LockKey, LockOptions, MemoryLock, WaitPolicy};
use fenced_examples::FencedResource;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    tracing_subscriber::fmt()
        .with_env_filter(std::env::var("RUST_LOG").unwrap_or_else(|_| "warn".into()))
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();

    // One store, two "nodes". Swap MemoryLock for a server backend via its URL
    // and nothing below changes.
    let store: Arc<dyn DistributedLock> = Arc::new(MemoryLock::new());
    let node_a = LockClient::builder(store.clone())
        .ttl(Duration::from_secs(3))
        .build()?;
    let node_b = LockClient::builder(store.clone())
        .ttl(Duration::from_secs(3))
        .wait(WaitPolicy::Timeout(Duration::from_millis(200)))
        .build()?;
    let orders = FencedResource::default();

    println!("1. acquire");
    let guard = node_a.acquire("orders:1001").await?;
    println!(
        "   node A holds orders:1001 with fencing token {}",
        guard.token()
    );
    orders.write(guard.token(), "A: reserve stock")?;

    println!("2. contention is not an error");
    let other = node_b.try_acquire("orders:1001").await?;
    println!(
        "   node B try_acquire -> {}",
        if other.is_none() {
            "None (held)"
        } else {
            "Some"
        }
    );
    match node_b.acquire("orders:1001").await {
        Err(e @ Error::Timeout { .. }) => println!("   node B acquire -> {e}"),
        other => println!("   node B acquire -> unexpected {other:?}"),
    }

    println!("3. the watchdog renews while A works past its 3 s TTL");
    tokio::time::sleep(Duration::from_millis(3500)).await;
    println!(
        "   after 3.5 s: lost = {}, valid for {:?}",
        guard.is_lost(),
        guard.valid_for()
    );
    guard.release().await?;
    println!("   released");

    println!("4. fencing: a paused ex-holder cannot corrupt the resource");
    let key = LockKey::new("orders:1001")?;
    let short = LockOptions::builder()
        .ttl(Duration::from_millis(300))
        .build()?;
    let stale = store
        .try_acquire(&key, &short)
        .await?
        .ok_or("the key should be free")?;
    println!(
        "   node A takes token {} (ttl 300 ms), then pauses for 500 ms (GC, SIGSTOP…)",
        stale.token
    );
    tokio::time::sleep(Duration::from_millis(500)).await;
    let fresh = node_b.acquire("orders:1001").await?;
    println!(
        "   meanwhile the lease expired and node B took token {}",
        fresh.token()
    );
    orders.write(fresh.token(), "B: ship order")?;
    match orders.write(stale.token, "A: cancel order") {
        Ok(()) => println!("   A's stale write was accepted (this must not happen)"),
        Err(e) => println!("   A wakes up and writes: {e}"),
    }
    println!(
        "   A's late release -> {:?} (B's lock untouched)",
        store.release(&stale).await?
    );

    println!("5. loss signals: work is cancelled when the lock goes away");
    let admin = store.clone();
    let result = node_b
        .with_lock("report:nightly", |lease| async move {
            // Simulate an operator force-releasing the key while we work.
            let key = lease.key().clone();
            tokio::spawn(async move { admin.force_release(&key).await });
            tokio::time::sleep(Duration::from_secs(60)).await;
            "finished"
        })
        .await;
    match result {
        Err(e @ Error::LeaseLost { .. }) => println!("   with_lock -> {e}"),
        other => println!("   with_lock -> unexpected {other:?}"),
    }
    fresh.release().await?;

    println!("6. tasks sharing one client take turns; the label says who holds");
    let shared = LockClient::builder(store.clone())
        .ttl(Duration::from_secs(3))
        .label("tour worker")
        .build()?;
    let first = shared.acquire("orders:1002").await?;
    let holder = store.inspect(&LockKey::new("orders:1002")?).await?;
    let label = holder.and_then(|i| i.label).map(|l| l.to_string());
    println!("   inspect shows the holder labelled {label:?}");
    match shared.try_acquire("orders:1002").await {
        Err(e @ Error::AlreadyHeld { .. }) => println!("   the same task asking again -> {e}"),
        other => println!("   the same task asking again -> unexpected {other:?}"),
    }
    let waiter = {
        let shared = shared.clone();
        tokio::spawn(async move {
            let g = shared.acquire("orders:1002").await?;
            let token = g.token();
            g.release().await?;
            Ok::<_, Error>(token)
        })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    println!(
        "   another task of the same client waits (done: {})",
        waiter.is_finished()
    );
    let first_token = first.token();
    first.release().await?;
    println!(
        "   after the release it gets token {} (> {first_token})",
        waiter.await??
    );

    println!("7. stop in time: expiring(lead) fires while the lock is still held");
    let flaky = Arc::new(MemoryLock::new());
    let client = LockClient::builder(flaky.clone())
        .ttl(Duration::from_secs(1))
        .build()?;
    let guard = client.acquire("report:weekly").await?;
    flaky.set_available(false); // renewals fail from now on
    let lead = Duration::from_millis(300);
    guard.expiring(lead).await;
    println!(
        "   renewals failed: {} ms left (the margin, {} ms, before the store's expiry), lost = {}: wind down now",
        guard.valid_for().as_millis(),
        client.margin().as_millis(),
        guard.is_lost()
    );
    let reason = guard.lost().await;
    println!("   then: {reason}");

    println!("accepted writes: {:?}", orders.values());
    Ok(())
}
