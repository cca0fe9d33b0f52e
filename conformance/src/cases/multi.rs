//! M1–M4: all-or-nothing multi-locks (`LockClient::acquire_all`) and
//! E1–E3: leader election (`LockClient::election`), on the store's mutexes.

use std::{sync::Arc, time::Duration};

use fenced_api::{Error, Label, Leader, LockClient, LockKey, WaitPolicy};
use futures_util::StreamExt;

use super::{expiry_slack, fresh_key, rises};
use crate::{
    check::{ensure, fail, some, CaseResult, Failure, Outcome},
    Harness,
};

async fn client(h: &dyn Harness, ttl: Duration) -> Result<LockClient, Failure> {
    Ok(LockClient::builder(h.client().await?)
        .ttl(ttl)
        .wait(WaitPolicy::Timeout(Duration::from_secs(20)))
        .build()?)
}

fn keys(tag: &str, n: usize) -> Vec<LockKey> {
    (0..n).map(|i| fresh_key(&format!("{tag}-{i}"))).collect()
}

/// M1: a set with one held member is not taken at all, and is taken whole
/// once that member is free.
pub async fn multi_all_or_nothing(h: &dyn Harness) -> CaseResult {
    let a = client(h, h.base_ttl() * 5).await?;
    let b = client(h, h.base_ttl() * 5).await?;
    let k = keys("m01", 3);
    let middle = a.acquire(k[1].clone()).await?;
    ensure!(
        b.try_acquire_all(k.clone()).await?.is_none(),
        "a set was granted while one member was held"
    );
    // Nothing of the set stayed held.
    let probe = h.client().await?;
    for key in [&k[0], &k[2]] {
        ensure!(
            probe.inspect(key).await?.is_none(),
            "`{key}` stayed held after a refused multi-lock"
        );
    }
    let taker = {
        let (b, k) = (b.clone(), k.clone());
        tokio::spawn(async move { b.acquire_all(k).await })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    ensure!(
        !taker.is_finished(),
        "the set was taken while a member was held"
    );
    middle.release().await?;
    let all = taker
        .await
        .map_err(|e| Failure(format!("taker panicked: {e}")))??;
    ensure!(all.len() == 3, "{} members held of 3", all.len());
    for key in &k {
        let seen = some(probe.inspect(key).await?, "every member held")?;
        ensure!(
            all.token(key) == Some(seen.token),
            "member `{key}` has token {:?}, the store shows {}",
            all.token(key),
            seen.token
        );
    }
    all.release().await?;
    for key in &k {
        ensure!(
            probe.inspect(key).await?.is_none(),
            "`{key}` held after release"
        );
    }
    Ok(Outcome::Passed)
}

/// M2: two clients taking overlapping sets in opposite orders, 8 rounds
/// each, starting every round together: all finish, and neither ever sees
/// the other take a member it holds.
pub async fn multi_opposite_orders_never_deadlock(h: &dyn Harness) -> CaseResult {
    const ROUNDS: usize = 8;
    let k = keys("m02", 3);
    let start = Arc::new(tokio::sync::Barrier::new(2));
    let mut tasks = Vec::new();
    for reverse in [false, true] {
        let c = client(h, h.base_ttl() * 5).await?;
        let probe = h.client().await?;
        let mut set = k.clone();
        if reverse {
            set.reverse();
        }
        let start = Arc::clone(&start);
        tasks.push(tokio::spawn(async move {
            for _ in 0..ROUNDS {
                start.wait().await;
                let all = c.acquire_all(set.clone()).await?;
                tokio::time::sleep(Duration::from_millis(20)).await;
                for (key, token) in all.tokens() {
                    let now = probe.inspect(&key).await?.map(|i| i.token);
                    if now != Some(token) {
                        return Err(Failure(format!(
                            "`{key}` shows token {now:?} while this client holds it with {token}"
                        )));
                    }
                }
                all.release().await?;
            }
            Ok(())
        }));
    }
    let bound = Duration::from_secs(60);
    let aborts: Vec<_> = tasks.iter().map(|t| t.abort_handle()).collect();
    // The first failure ends the case (its partner would wait at the barrier).
    let all = futures_util::future::try_join_all(tasks.into_iter().map(|t| async move {
        t.await
            .map_err(|e| Failure(format!("a client panicked: {e}")))?
    }));
    let outcome = tokio::time::timeout(bound, all).await;
    aborts.iter().for_each(tokio::task::AbortHandle::abort);
    match outcome {
        Ok(done) => done.map(|_| Outcome::Passed),
        Err(_) => fail!("the clients did not finish {ROUNDS} rounds within {bound:?}: deadlock"),
    }
}

/// M3: a set whose last member stays held times out within the bound,
/// naming that member, and leaves the members it took free.
pub async fn multi_timeout_releases_taken_keys(h: &dyn Harness) -> CaseResult {
    let a = client(h, h.base_ttl() * 10).await?;
    let b = client(h, h.base_ttl() * 10).await?;
    let mut k = keys("m03", 3);
    k.sort();
    let last = a.acquire(k[2].clone()).await?;
    let bound = Duration::from_millis(600);
    match b
        .acquire_all_with(k.clone(), WaitPolicy::Timeout(bound))
        .await
    {
        Err(Error::Timeout { key, waited }) => {
            ensure!(
                key == k[2],
                "the timeout names `{key}`, not the held `{}`",
                k[2]
            );
            ensure!(
                waited >= bound && waited < bound + Duration::from_secs(5),
                "gave up after {waited:?} for a bound of {bound:?}"
            );
        }
        other => fail!("a set with a held member gave {other:?}, not Timeout"),
    }
    let probe = h.client().await?;
    for key in &k[..2] {
        ensure!(
            probe.inspect(key).await?.is_none(),
            "`{key}` stayed held after the set timed out"
        );
    }
    last.release().await?;
    Ok(Outcome::Passed)
}

/// M4: the set is lost when any member is lost (force-released here), and
/// says which.
pub async fn multi_lost_with_any_member(h: &dyn Harness) -> CaseResult {
    let ttl = h.base_ttl() * 3;
    let a = client(h, ttl).await?;
    let k = keys("m04", 2);
    let all = a.acquire_all(k.clone()).await?;
    let admin = h.client().await?;
    ensure!(
        admin.force_release(&k[1]).await?,
        "force_release found `{}` free",
        k[1]
    );
    let (key, _why) = tokio::time::timeout(expiry_slack(ttl), all.lost())
        .await
        .map_err(|_| Failure("the multi-lock never noticed a lost member".into()))?;
    ensure!(key == k[1], "the loss names `{key}`, not `{}`", k[1]);
    ensure!(all.is_lost(), "is_lost is false after a member was lost");
    ensure!(
        matches!(all.release().await, Err(Error::LeaseLost { .. })),
        "releasing a set with a lost member was not LeaseLost"
    );
    ensure!(
        admin.inspect(&k[0]).await?.is_none(),
        "the other member stayed held"
    );
    Ok(Outcome::Passed)
}

/// E1: one leader at a time, seen by the others with its label and term;
/// the next leader's term is greater.
pub async fn election_one_leader_rising_terms(h: &dyn Harness) -> CaseResult {
    let ttl = h.base_ttl() * 5;
    let a = client(h, ttl).await?.with_label(Label::new("node-a")?);
    let b = client(h, ttl).await?.with_label(Label::new("node-b")?);
    let key = fresh_key("e01");
    let (ea, eb) = (a.election(key.clone())?, b.election(key.clone())?);
    ensure!(eb.leader().await?.is_none(), "a leader before any campaign");
    let first = ea.campaign().await?;
    ensure!(eb.try_campaign().await?.is_none(), "two leaders at once");
    let seen = some(eb.leader().await?, "the leader")?;
    ensure!(
        seen.term == first.term() && seen.label.as_ref().map(|l| l.as_str()) == Some("node-a"),
        "the others see {seen:?}, not node-a in term {}",
        first.term()
    );
    let next = {
        let eb = eb.clone();
        tokio::spawn(async move { eb.campaign().await })
    };
    tokio::time::sleep(Duration::from_millis(200)).await;
    ensure!(!next.is_finished(), "b became leader while a led");
    let old = first.term();
    first.resign().await?;
    let second = next
        .await
        .map_err(|e| Failure(format!("campaign panicked: {e}")))??;
    rises(second.term(), old, "of the next leader")?;
    let seen = some(ea.leader().await?, "the new leader")?;
    ensure!(
        seen.label.as_ref().map(|l| l.as_str()) == Some("node-b"),
        "the new leader is shown as {seen:?}"
    );
    second.resign().await?;
    Ok(Outcome::Passed)
}

/// E2: `observe` yields the leader now, then each new leader, then none.
pub async fn election_observe_sees_changes(h: &dyn Harness) -> CaseResult {
    let ttl = h.base_ttl() * 5;
    let a = client(h, ttl).await?.with_label(Label::new("node-a")?);
    let b = client(h, ttl).await?.with_label(Label::new("node-b")?);
    let key = fresh_key("e02");
    let watcher = client(h, ttl)
        .await?
        .election(key.clone())?
        .observe_every(Duration::from_millis(50));
    let mut changes = watcher.observe();
    let bound = Duration::from_secs(10);
    ensure!(
        next(&mut changes, bound).await?.is_none(),
        "a leader seen before any campaign"
    );
    let la = a.election(key.clone())?.campaign().await?;
    let seen = some(next(&mut changes, bound).await?, "node-a as leader")?;
    ensure!(
        seen.term == la.term(),
        "observed term {} for {}",
        seen.term,
        la.term()
    );
    la.resign().await?;
    let lb = b.election(key.clone())?.campaign().await?;
    // The leaderless moment between the two may be seen or not.
    let mut seen = next(&mut changes, bound).await?;
    if seen.is_none() {
        seen = next(&mut changes, bound).await?;
    }
    let seen = some(seen, "node-b as leader")?;
    ensure!(
        seen.term == lb.term() && seen.label.as_ref().map(|l| l.as_str()) == Some("node-b"),
        "observed {seen:?} after node-b won term {}",
        lb.term()
    );
    lb.resign().await?;
    ensure!(
        next(&mut changes, bound).await?.is_none(),
        "a leader seen after the last resigned"
    );
    Ok(Outcome::Passed)
}

async fn next(
    changes: &mut futures_util::stream::BoxStream<'static, fenced_api::Result<Option<Leader>>>,
    bound: Duration,
) -> Result<Option<Leader>, Failure> {
    match tokio::time::timeout(bound, changes.next()).await {
        Ok(Some(seen)) => Ok(seen?),
        Ok(None) => Err(Failure("the observe stream ended".into())),
        Err(_) => Err(Failure(format!("no change seen within {bound:?}"))),
    }
}

/// E3: a leader whose leadership is taken away (force-released) learns it.
pub async fn election_leader_learns_of_loss(h: &dyn Harness) -> CaseResult {
    let ttl = h.base_ttl() * 3;
    let a = client(h, ttl).await?;
    let key = fresh_key("e03");
    let leadership = a.election(key.clone())?.campaign().await?;
    let admin = h.client().await?;
    ensure!(
        admin.force_release(&key).await?,
        "force_release found no leader"
    );
    tokio::time::timeout(expiry_slack(ttl), leadership.lost())
        .await
        .map_err(|_| Failure("the deposed leader never learned of it".into()))?;
    ensure!(
        leadership.is_lost(),
        "is_lost is false for a deposed leader"
    );
    Ok(Outcome::Passed)
}
