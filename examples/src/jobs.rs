//! quickstart, swap_by_config, cron_job (and its node processes).

use std::{
    path::Path,
    process::Stdio,
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc,
    },
    time::Duration,
};

use fenced::{LockClient, WaitPolicy};
use tokio::{
    io::{AsyncBufReadExt, AsyncWriteExt, BufReader, Lines},
    process::{Child, ChildStdin, ChildStdout, Command},
};

use crate::BoxError;

/// Takes a lock on the store named by `url` (use [`fenced::default_url`] for
/// the embedded SQLite file), runs a tiny job under it, and returns the job's
/// fencing token.
///
/// # Errors
///
/// Whatever connecting or locking fails with.
pub async fn quickstart(url: &str) -> Result<u64, BoxError> {
    let store = fenced::connect(url).await?;
    let client = LockClient::builder(store)
        .ttl(Duration::from_secs(10))
        .wait(WaitPolicy::Timeout(Duration::from_secs(10)))
        .build()?;
    let token = client
        .with_lock("quickstart", |lease| async move {
            // The protected work: pass the token along with every write.
            lease.token().get()
        })
        .await?;
    Ok(token)
}

/// The same code for every store: `workers` independent clients (one
/// connection each, like separate nodes) each run a job `rounds` times under
/// one key. Returns the tokens in the order the jobs ran; the caller checks
/// they strictly increase. The store comes from configuration only.
///
/// # Errors
///
/// Whatever connecting or locking fails with, or a detected overlap.
pub async fn swap_by_config(
    url: &str,
    workers: usize,
    rounds: usize,
) -> Result<Vec<u64>, BoxError> {
    let inside = Arc::new(AtomicUsize::new(0));
    let tokens = Arc::new(std::sync::Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for _ in 0..workers {
        let client = LockClient::builder(fenced::connect(url).await?)
            .ttl(Duration::from_secs(10))
            .wait(WaitPolicy::Timeout(Duration::from_secs(30)))
            .build()?;
        let (inside, tokens) = (inside.clone(), tokens.clone());
        tasks.push(tokio::spawn(async move {
            for _ in 0..rounds {
                let (inside, tokens) = (inside.clone(), tokens.clone());
                client
                    .with_lock("nightly-report", |lease| async move {
                        if inside.fetch_add(1, Ordering::SeqCst) != 0 {
                            return Err("two workers ran the job at once");
                        }
                        tokens
                            .lock()
                            .unwrap_or_else(|p| p.into_inner())
                            .push(lease.token().get());
                        tokio::time::sleep(Duration::from_millis(5)).await;
                        inside.fetch_sub(1, Ordering::SeqCst);
                        Ok(())
                    })
                    .await??;
            }
            Ok::<(), BoxError>(())
        }));
    }
    for t in tasks {
        t.await??;
    }
    let tokens = tokens.lock().unwrap_or_else(|p| p.into_inner()).clone();
    Ok(tokens)
}

/// A cron job deployed on `workers` nodes, each a **separate process**
/// running `node_program` (the `cron_job` example runs copies of itself; see
/// [`cron_node`] for what each does). At every tick each node tries the lock
/// once, without waiting; the one that gets it runs the job, the others skip
/// the tick. Returns how many nodes ran the job at each tick (always 1).
///
/// The winner keeps the lock until the tick is over, not just while its job
/// runs: a node whose timer fires late (clock skew, a slow start) must still
/// find the tick taken, or it runs the job a second time after the first run
/// finished. In production "the tick is over" is a time — hold the lock for
/// at least the spread of the nodes' clocks, ShedLock's `lockAtLeastFor` —
/// here it is a message from this coordinator once every node has tried, so
/// the outcome does not depend on how fast the processes are scheduled.
///
/// # Errors
///
/// Whatever starting the nodes, connecting or locking fails with, or a node
/// that breaks the line protocol.
pub async fn cron_job(
    node_program: &Path,
    url: &str,
    workers: usize,
    ticks: usize,
) -> Result<Vec<usize>, BoxError> {
    let key = format!("cron:report:{}", uuid::Uuid::new_v4().simple());
    let mut nodes = Vec::new();
    for _ in 0..workers {
        let mut child = Command::new(node_program)
            .args(["--node", &key])
            // In the environment, not the arguments, which `ps` shows to
            // every user: the URL may hold a password.
            .env("FENCED_URL", url)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| format!("cannot start the node {}: {e}", node_program.display()))?;
        let (Some(stdin), Some(stdout)) = (child.stdin.take(), child.stdout.take()) else {
            return Err("a node's stdin or stdout was not piped".into());
        };
        nodes.push(Node {
            child,
            stdin,
            stdout: BufReader::new(stdout).lines(),
        });
    }
    for node in &mut nodes {
        node.expect("ready").await?;
    }
    let mut ran = Vec::new();
    for _ in 0..ticks {
        // The tick fires on every node.
        for node in &mut nodes {
            node.say("tick").await?;
        }
        let mut runs = 0;
        for node in &mut nodes {
            match node.line().await?.as_str() {
                "ran" => runs += 1,
                "skipped" => {}
                other => return Err(format!("a node answered `{other}` to a tick").into()),
            }
        }
        ran.push(runs);
        // Every node has tried: the tick is over, the winner releases.
        for node in &mut nodes {
            node.say("end").await?;
        }
        for node in &mut nodes {
            node.expect("done").await?;
        }
    }
    for mut node in nodes {
        drop(node.stdin);
        let status = node.child.wait().await?;
        if !status.success() {
            return Err(format!("a node exited with {status}").into());
        }
    }
    Ok(ran)
}

/// One node process of [`cron_job`] (started with `--node KEY` and the store
/// in `FENCED_URL`): connects to `url`, says `ready`, then
/// for each `tick` line on stdin tries `key` once and answers `ran` (it runs
/// the job and keeps the lock) or `skipped`; for each `end` line releases
/// the lock if it holds it and answers `done`. Returns at the end of stdin.
///
/// # Errors
///
/// Whatever connecting, locking or the pipes fail with.
pub async fn cron_node(url: &str, key: &str) -> Result<(), BoxError> {
    let client = LockClient::builder(fenced::connect(url).await?)
        .ttl(Duration::from_secs(10))
        .wait(WaitPolicy::NoWait)
        .build()?;
    let mut out = tokio::io::stdout();
    let mut lines = BufReader::new(tokio::io::stdin()).lines();
    out.write_all(b"ready\n").await?;
    out.flush().await?;
    let mut held = None;
    while let Some(line) = lines.next_line().await? {
        let answer: &[u8] = match line.as_str() {
            "tick" => match client.try_acquire(key).await? {
                Some(guard) => {
                    // The job: anything that must not run twice per tick.
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    held = Some(guard);
                    b"ran\n"
                }
                None => b"skipped\n",
            },
            "end" => {
                if let Some(guard) = held.take() {
                    guard.release().await?;
                }
                b"done\n"
            }
            other => return Err(format!("unexpected line `{other}`").into()),
        };
        out.write_all(answer).await?;
        out.flush().await?;
    }
    Ok(())
}

/// The coordinator's end of one node's pipes.
struct Node {
    child: Child,
    stdin: ChildStdin,
    stdout: Lines<BufReader<ChildStdout>>,
}

impl Node {
    async fn say(&mut self, line: &str) -> Result<(), BoxError> {
        self.stdin.write_all(format!("{line}\n").as_bytes()).await?;
        self.stdin.flush().await?;
        Ok(())
    }

    async fn line(&mut self) -> Result<String, BoxError> {
        // A node that failed has said why on stderr (inherited).
        self.stdout
            .next_line()
            .await?
            .ok_or_else(|| "a node exited early (see its error above)".into())
    }

    async fn expect(&mut self, want: &str) -> Result<(), BoxError> {
        let got = self.line().await?;
        if got == want {
            Ok(())
        } else {
            Err(format!("a node said `{got}` instead of `{want}`").into())
        }
    }
}
