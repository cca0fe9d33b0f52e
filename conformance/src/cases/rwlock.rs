//! RW1–RW5: reader-writer locks (`Permits::read` / `Permits::write` on the
//! store's `SemaphoreStore`, and `LockClient::rw_lock`).

use std::{
    sync::{
        atomic::{AtomicBool, AtomicUsize, Ordering},
        Arc,
    },
    time::Duration,
};

use fenced_api::{Error, LockClient, LockOptions, Permits, WaitPolicy};
use tokio::time::Instant;

use super::{
    expiry_slack, fresh_key, rises,
    semaphore::{store, until_waiting, wait_opts},
};
use crate::{
    check::{ensure, some, CaseResult, Failure, Outcome},
    Harness,
};

/// RW1: readers share the key; a writer is refused while any reader holds,
/// and holds it alone.
pub async fn readers_share_writer_excludes(h: &dyn Harness) -> CaseResult {
    let s = store!(h);
    let other = store!(h);
    let key = fresh_key("rw01");
    let opts = LockOptions::builder().ttl(h.base_ttl() * 10).build()?;
    let r1 = some(
        s.try_acquire_permits(&key, Permits::read(), &opts).await?,
        "a reader of a free key",
    )?;
    let r2 = some(
        other
            .try_acquire_permits(&key, Permits::read(), &opts)
            .await?,
        "a second reader beside the first",
    )?;
    ensure!(
        other
            .try_acquire_permits(&key, Permits::write(), &opts)
            .await?
            .is_none(),
        "a writer was granted beside two readers"
    );
    s.release(&r1).await?;
    ensure!(
        s.try_acquire_permits(&key, Permits::write(), &opts)
            .await?
            .is_none(),
        "a writer was granted beside a reader"
    );
    other.release(&r2).await?;
    let w = some(
        s.try_acquire_permits(&key, Permits::write(), &opts).await?,
        "the writer once the readers left",
    )?;
    rises(w.token, r2.token, "of the writer")?;
    ensure!(
        other
            .try_acquire_permits(&key, Permits::read(), &opts)
            .await?
            .is_none(),
        "a reader was granted beside the writer"
    );
    ensure!(
        other
            .try_acquire_permits(&key, Permits::write(), &opts)
            .await?
            .is_none(),
        "a second writer was granted"
    );
    let seen = some(other.holders(&key).await?, "the writer as holder")?;
    ensure!(
        seen.holders.len() == 1 && seen.holders[0].permits.role() == "writer",
        "holders of a written key: {seen:?}"
    );
    s.release(&w).await?;
    Ok(Outcome::Passed)
}

/// RW2: a waiting writer holds back readers that arrive after it; it is
/// granted when the earlier readers leave, before the later readers, and
/// the later readers' tokens are above its own.
pub async fn waiting_writer_holds_back_new_readers(h: &dyn Harness) -> CaseResult {
    let s = store!(h);
    let key = fresh_key("rw02");
    let opts = wait_opts(h.base_ttl() * 10, Duration::from_secs(30))?;
    let r1 = some(
        s.try_acquire_permits(&key, Permits::read(), &opts).await?,
        "a reader",
    )?;
    let writer = {
        let w = store!(h);
        let (key, opts) = (key.clone(), opts.clone());
        tokio::spawn(async move {
            let lease = w.acquire_permits(&key, Permits::write(), &opts).await;
            (lease, Instant::now(), w)
        })
    };
    until_waiting(s.as_ref(), &key, 1).await?;
    ensure!(!writer.is_finished(), "the writer got in beside a reader");
    let late = store!(h);
    ensure!(
        late.try_acquire_permits(&key, Permits::read(), &opts)
            .await?
            .is_none(),
        "a reader overtook a waiting writer"
    );
    let reader = {
        let (key, opts) = (key.clone(), opts.clone());
        tokio::spawn(async move {
            let lease = late.acquire_permits(&key, Permits::read(), &opts).await;
            (lease, Instant::now(), late)
        })
    };
    until_waiting(s.as_ref(), &key, 2).await?;
    ensure!(
        !reader.is_finished(),
        "a late reader got in while a writer waited"
    );
    s.release(&r1).await?;
    let (w, w_at, ws) = writer
        .await
        .map_err(|e| Failure(format!("writer panicked: {e}")))?;
    let w = w?;
    rises(w.token, r1.token, "of the writer after the reader")?;
    tokio::time::sleep(Duration::from_millis(100)).await;
    ensure!(!reader.is_finished(), "a reader got in beside the writer");
    let released = Instant::now();
    ws.release(&w).await?;
    let (r2, r2_at, rs) = reader
        .await
        .map_err(|e| Failure(format!("reader panicked: {e}")))?;
    let r2 = r2?;
    ensure!(
        r2_at >= released && r2_at > w_at,
        "the late reader got in before the writer left"
    );
    rises(r2.token, w.token, "of the reader after the writer")?;
    rs.release(&r2).await?;
    Ok(Outcome::Passed)
}

/// RW3: a writer's token is above the token of every grant before it.
pub async fn writer_token_above_every_earlier_grant(h: &dyn Harness) -> CaseResult {
    let s = store!(h);
    let key = fresh_key("rw03");
    let opts = LockOptions::builder().ttl(h.base_ttl() * 10).build()?;
    let mut readers = Vec::new();
    for _ in 0..4 {
        readers.push(some(
            s.try_acquire_permits(&key, Permits::read(), &opts).await?,
            "a reader",
        )?);
    }
    let highest = some(readers.iter().map(|l| l.token).max(), "the readers' tokens")?;
    for r in &readers {
        s.release(r).await?;
    }
    let w = some(
        s.try_acquire_permits(&key, Permits::write(), &opts).await?,
        "the writer",
    )?;
    rises(w.token, highest, "of the writer after four readers")?;
    s.release(&w).await?;
    let w2 = some(
        s.try_acquire_permits(&key, Permits::write(), &opts).await?,
        "a second writer",
    )?;
    rises(w2.token, w.token, "of the second writer")?;
    s.release(&w2).await?;
    Ok(Outcome::Passed)
}

/// RW4: a writer gets in within a bound while readers keep arriving (three
/// readers taking turns so that one always holds).
pub async fn writer_not_starved_by_readers(h: &dyn Harness) -> CaseResult {
    let key = fresh_key("rw04");
    let stop = Arc::new(AtomicBool::new(false));
    let reads = Arc::new(AtomicUsize::new(0));
    let mut readers = Vec::new();
    for i in 0..3u64 {
        let s = store!(h);
        let (key, stop, reads) = (key.clone(), Arc::clone(&stop), Arc::clone(&reads));
        let opts = wait_opts(h.base_ttl() * 10, Duration::from_secs(30))?;
        readers.push(tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(40 * i)).await;
            while !stop.load(Ordering::SeqCst) {
                let lease = s.acquire_permits(&key, Permits::read(), &opts).await?;
                reads.fetch_add(1, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(120)).await;
                s.release(&lease).await?;
            }
            Ok::<(), Error>(())
        }));
    }
    // The readers are at it: one holds when the writer joins.
    let w = store!(h);
    let start = Instant::now();
    while w.holders(&key).await?.is_none_or(|k| k.holders.is_empty()) {
        if start.elapsed() > Duration::from_secs(10) {
            return Err(Failure("no reader held the key within 10 s".into()));
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let opts = wait_opts(h.base_ttl() * 10, Duration::from_secs(10))?;
    let got = w.acquire_permits(&key, Permits::write(), &opts).await;
    stop.store(true, Ordering::SeqCst);
    let got = got.map_err(|e| Failure(format!("the writer never got in among readers: {e}")))?;
    w.release(&got).await?;
    for r in readers {
        r.await
            .map_err(|e| Failure(format!("a reader panicked: {e}")))??;
    }
    ensure!(
        reads.load(Ordering::SeqCst) >= 2,
        "the readers did not keep arriving ({} reads)",
        reads.load(Ordering::SeqCst)
    );
    Ok(Outcome::Passed)
}

/// RW5: a writer that stops renewing is gone after its TTL; waiting readers
/// then get in, with greater tokens.
pub async fn dead_writer_expires(h: &dyn Harness) -> CaseResult {
    let s = store!(h);
    let r = store!(h);
    let key = fresh_key("rw05");
    let short = LockOptions::builder().ttl(h.base_ttl()).build()?;
    let crashed = some(
        s.try_acquire_permits(&key, Permits::write(), &short)
            .await?,
        "the writer",
    )?;
    let wait = wait_opts(h.base_ttl() * 10, expiry_slack(crashed.ttl) * 2)?;
    let start = Instant::now();
    let got = r.acquire_permits(&key, Permits::read(), &wait).await?;
    ensure!(
        start.elapsed() <= expiry_slack(crashed.ttl),
        "the reader got in only {:?} after a crashed writer (ttl {:?})",
        start.elapsed(),
        crashed.ttl
    );
    rises(
        got.token,
        crashed.token,
        "of the reader after the crashed writer",
    )?;
    r.release(&got).await?;
    Ok(Outcome::Passed)
}

/// RW through `LockClient`: guards for readers and the writer, the same
/// task asking again is told at once, and a semaphore on the key is a
/// `KindMismatch`.
pub async fn client_rw_lock(h: &dyn Harness) -> CaseResult {
    let _ = store!(h);
    let client = LockClient::builder(h.client().await?)
        .ttl(h.base_ttl() * 3)
        .wait(WaitPolicy::Timeout(Duration::from_secs(10)))
        .build()?;
    let key = fresh_key("rw06");
    let rw = client.rw_lock(key.clone())?;
    let reader = rw.read().await?;
    ensure!(
        matches!(rw.try_write().await, Err(Error::AlreadyHeld { .. })),
        "a reader asking to write was not AlreadyHeld"
    );
    let pool = client.semaphore(key.clone(), 2)?;
    let mixed = tokio::spawn(async move { pool.try_acquire().await })
        .await
        .map_err(|e| Failure(format!("semaphore task panicked: {e}")))?;
    ensure!(
        matches!(mixed, Err(Error::KindMismatch { .. })),
        "a semaphore on a reader-writer key gave {mixed:?}, not KindMismatch"
    );
    let other = {
        let rw = rw.clone();
        tokio::spawn(async move { rw.try_read().await })
            .await
            .map_err(|e| Failure(format!("reader task panicked: {e}")))??
    };
    let other = some(other, "a second reader through the client")?;
    let writer = {
        let rw = rw.clone();
        tokio::spawn(async move { rw.write().await })
    };
    tokio::time::sleep(Duration::from_millis(200)).await;
    ensure!(
        !writer.is_finished(),
        "the writer got in beside two readers"
    );
    let highest = reader.token().max(other.token());
    reader.release().await?;
    other.release().await?;
    let writer = writer
        .await
        .map_err(|e| Failure(format!("writer task panicked: {e}")))??;
    rises(writer.token(), highest, "of the writer")?;
    writer.release().await?;
    Ok(Outcome::Passed)
}
