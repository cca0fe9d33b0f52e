//! Argument parsing, exit codes and the small subcommands.
//!
//! # `fenced run`: the timeline
//!
//! `fenced run` promises "only one of me at a time": CMD must be gone
//! before the store can grant the key to anyone else. With `--ttl T` the
//! lease is renewed every `T/3`; its **safe deadline** is `T` after the
//! send time of the last successful grant or renewal, less the client's
//! safety margin `m` = max(1 % of T, 100 ms), at most T/4 (see
//! `fenced::SafetyMargin`: clock-rate drift between fenced and the store,
//! and fenced's own reaction time). If renewals stop succeeding — the
//! store or the path to it is dead — with the last good renewal sent at `t`:
//!
//! ```text
//! t          the last renewal that succeeded was sent; renewals go on every T/3
//!            (failed ones are retried every T/12)
//! t+T−m−g    SIGTERM to CMD's process group (g = --grace): CMD may finish its step
//! t+T−m      the safe deadline: SIGKILL to the group if anything is left
//! t+T        the earliest the store can expire the lease and grant the key again
//! ```
//!
//! So `--grace` has elapsed and SIGKILL has been sent before the safe
//! deadline, which is the margin `m` before the store can expire the
//! lease. fenced keeps renewing while CMD winds down; once SIGTERM has
//! been sent the run ends as lost (exit 76) even if a renewal succeeds
//! later (CMD is already stopping), but the lock stays held until CMD is
//! gone, and is released only then.
//!
//! **The grace rule.** SIGTERM must not come while renewals are healthy:
//! the renewal sent `T/3` after the last one must be back (a quarter of
//! the interval is allowed for its round trip) before `safe deadline − g`.
//! So `g + m + T/3 + T/12 ≤ T`, i.e. `g ≤ 7/12·T − m` (17.2 s for the
//! default `--ttl 30s`, whose default `--grace 10s` fits; 3.4 s for
//! `--ttl 6s`). A longer `--grace` is refused before anything is acquired
//! (exit 78), naming the largest grace that fits and a TTL that fits the
//! grace asked for. Without `--grace` the default, 10 s, is shortened to
//! the largest that fits a shorter `--ttl` (e.g. 5.73 s for `--ttl 10s`).
//!
//! **A genuine loss** — a renewal refused (the lease expired on the store,
//! was force-released, or belongs to someone else), or the safe deadline
//! passed before fenced could act (fenced frozen or suspended past it) —
//! means the key may already belong to another holder: the group gets
//! SIGKILL at once. A SIGTERM first would only let CMD run on beside the
//! next holder for its grace.
//!
//! **`--max-hold`** (counted from the grant) is enforced by fenced, not by
//! the lock client: SIGTERM to the group, SIGKILL after `--grace` (or at
//! the safe deadline, if renewals fail meanwhile), the watchdog renewing
//! all along; then the lock is released and fenced exits 76.
//!
//! **Releasing.** After CMD ends fenced releases the lock, waiting for the
//! store at most 1 s after a loss or a stop for the lock (the store is
//! likely unreachable, and the lock expires at its TTL anyway) and at most
//! 5 s after CMD exited by itself or after a signal passed on. When the
//! bound runs out fenced logs a warning and exits anyway — with CMD's
//! status after a normal exit — and the lock expires at its TTL on the
//! store. fenced thus exits within about a second of CMD after a loss.
//!
//! # `fenced run`: what it does with the command (CMD)
//!
//! * CMD runs in a **process group of its own**, so that stopping it on a
//!   lost lock reaches everything it started (the timeline above). The
//!   lock covers the whole group: what CMD leaves running in it when it
//!   exits (by itself, or after a signal passed on: then with what is left
//!   of the one `--grace`) gets SIGTERM, and SIGKILL after `--grace` (or at the
//!   safe deadline), before the lock is released; after a stop for the
//!   lock the group gets SIGKILL. A process that leaves the group
//!   (`setsid`, a daemon) is beyond reach.
//!   It gets `FENCED_TOKEN`, `FENCED_KEY` and `FENCED_LABEL` (the holder
//!   label stored with the lock: `--label`, default `host:pid` of fenced).
//! * When stdin is a terminal and fenced is its foreground job, CMD's group
//!   is made the terminal's **foreground group** for as long as it runs (and
//!   fenced takes the terminal back after): CMD can read the terminal, and
//!   Ctrl-C / Ctrl-\ reach it directly. Ctrl-Z (or a background read or
//!   write of the terminal) stops CMD; fenced then stops itself with the
//!   same signal so that the shell sees the job stopped, and on `fg` / `bg`
//!   hands the terminal back (on `fg`) and continues CMD. A job stopped for
//!   longer than `--ttl` has lost its lock: when resumed it is killed and
//!   fenced exits 76. Without a job-control shell to resume it (fenced's
//!   process group is orphaned), fenced does not stop itself: it continues
//!   CMD at once and says so.
//! * **SIGTERM, SIGINT, SIGHUP and SIGQUIT** sent to fenced while it still
//!   waits for the lock make it leave the line (waiting up to 3 s for the
//!   store to take its place out: `fenced::cleanup::settle`) and exit 128+N
//!   without starting CMD; a place left behind would hold up every waiter
//!   behind it for its TTL.
//! * **SIGTERM, SIGINT, SIGHUP and SIGQUIT** sent to fenced once CMD runs
//!   are passed to CMD's group (followed by SIGCONT, in case it is stopped); fenced waits
//!   up to `--grace` for CMD (less if the lock's safe deadline comes first:
//!   then SIGKILL and exit 76), SIGKILLs the group if it is still there,
//!   releases the lock and exits with CMD's status (128+N when CMD died of
//!   signal N).
//! * **SIGKILL** of fenced (and the OOM killer) cannot be caught: CMD is
//!   orphaned and keeps running without the lock, which the store frees
//!   after `--ttl`. Linux's parent-death signal would need `unsafe` code
//!   (forbidden here). Where that matters, run fenced under a supervisor
//!   that kills the whole unit, e.g. systemd's default
//!   `KillMode=control-group`, or protect the resource with `FENCED_TOKEN`,
//!   which a later holder's higher token makes stale.
//!
//! # Exit codes
//!
//! 75 (`EXIT_BUSY`), 76 (`EXIT_LOST`), 69 (`EXIT_STORE`), 78
//! (`EXIT_CONFIG`), 127 (`EXIT_SPAWN`); otherwise CMD's own status.
//! CMD's own code can equal one of fenced's: fenced's own failures always
//! print a one-line `fenced: …` message on stderr, CMD's codes pass through
//! silently. A caller that must tell them apart with certainty can have CMD
//! avoid those values (e.g. `sh -c 'cmd || exit 1'`).

#[cfg(feature = "bench")]
mod bench;
mod job;
mod run;

use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use fenced::{Error, LockInfo, LockKey};

/// Exit code: the lock was held elsewhere for the whole `--wait`.
pub(crate) const EXIT_BUSY: u8 = 75;
/// Exit code: the lock was lost or running out while the command (or what
/// it left in its group) ran, or `--max-hold` was reached — the command was
/// stopped for it; or the store had taken the lock away by the time the
/// command finished.
pub(crate) const EXIT_LOST: u8 = 76;
/// Exit code: the store failed or could not be reached.
pub(crate) const EXIT_STORE: u8 = 69;
/// Exit code: bad URL, key, option or missing schema (fix the invocation).
pub(crate) const EXIT_CONFIG: u8 = 78;
/// Exit code: the command could not be started.
pub(crate) const EXIT_SPAWN: u8 = 127;

const EXAMPLES: &str = "\
Examples:
  fenced run --key nightly-report -- ./report.sh --full
  fenced run --key deploy --wait 5m --ttl 30s --max-hold 1h -- make deploy
  fenced run --key gpu-pool --permits 4 --wait forever -- ./train.sh
  fenced run --key config --shared -- ./read-config.sh      # --exclusive for the writer
  FENCED_URL=mysql://app:pw@db/app fenced run --key orders:1001 -- ./fix-order 1001
  fenced status                                  # every held lock, every kind
  fenced status --url redis://127.0.0.1 nightly-report deploy --json
  fenced release --force deploy
  fenced migrate --url mysql://root@127.0.0.1:3306/test

Store URLs: sqlite:///path/locks.db (default), mysql://user:pw@host/db?strategy=unique_key|row_lock|optimistic,
  postgres://user:pw@host/db?strategy=lease|advisory, redis://host:6379, rediss://,
  redis+sentinel://s1:26379,s2/mymaster, redis+cluster://h1:7000,h2:7001, rediss+cluster://,
  etcd://h1:2379,h2:2379/prefix, etcds://,
  zk://h1:2181,h2:2181/prefix, zks://, memory:// (this process only).
  etcd and zk need fenced built with the `etcd` / `zookeeper` cargo features.

Exit codes of `run`: the command's own code (128+N if killed by signal N, or if fenced got
  signal N while still waiting: it left the line and did not start the command);
  75 lock held elsewhere for the whole --wait; 76 lock lost or running out while the command ran, or
  --max-hold reached (the command was stopped for it); 69 store failed or unreachable; 78 bad
  URL/key/label/option, a --grace that does not fit --ttl, or missing schema; 127 command could not
  start. See `fenced run --help` for the stop timeline, signals and terminals.";

const RUN_HELP: &str = "\
Examples:
  fenced run --key nightly-report -- ./report.sh --full
  fenced run --key gpu-pool --permits 4 --wait forever -- ./train.sh   # one of at most 4
  fenced run --key config --shared --wait 1m -- ./read-config.sh        # readers together
  fenced run --key config --exclusive --wait 1m -- ./rewrite-config.sh  # the writer, alone
  fenced run --key deploy --wait 5m --ttl 30s --max-hold 1h -- make deploy
  fenced run --key cron:cleanup --wait 0s -- sh -c 'echo token $FENCED_TOKEN; ./cleanup'
  FENCED_URL=redis://127.0.0.1:6379 fenced run --key orders:1001 --label \"$(hostname) cleanup\" -- ./fix-order 1001

CMD gets FENCED_TOKEN, FENCED_KEY and FENCED_LABEL (--label, default host:pid).

Timeline when renewals fail (T = --ttl, g = --grace, m = safety margin = max(1% of T, 100ms), at most T/4):
  0 ── renew ── T/3 ── renew ── … t: the last renewal that succeeded was sent
  t+T-m-g  SIGTERM to CMD's process group (it may finish its step); renewals go on
  t+T-m    the safe deadline: SIGKILL to the group if anything is left
  t+T      the earliest the store can expire the lease and grant the key again
  So CMD is gone before anyone else can get the lock. Once SIGTERM was sent the run ends
  as lost (76), even if a renewal succeeds later; the lock is released only once CMD is gone.
  --grace must fit: g + m + T/3 + T/12 <= T, i.e. g <= 7/12 T - m (17.2s for --ttl 30s,
  3.4s for --ttl 6s); a longer --grace is refused (78) with the largest that fits. Without
  --grace: 10s, or the largest that fits --ttl if that is less.
  A genuine loss (renewal refused: expired, force-released, held by another; or the safe
  deadline passed, e.g. fenced was frozen) means the key may already be someone else's:
  SIGKILL to the group at once, no grace.
  --max-hold (from the grant): SIGTERM, SIGKILL after --grace (or at the safe deadline),
  renewing meanwhile; then the lock is released and fenced exits 76.
  What CMD leaves running in its process group (background children) gets SIGTERM when CMD
  exits, SIGKILL after --grace (or at the safe deadline: then 76), before the lock is released;
  a process that left the group (setsid, a daemon) is beyond reach.
  Releasing after CMD ends waits for the store at most 1s after a loss or stop (the lock
  expires at its TTL anyway), at most 5s after a normal exit (then a warning, CMD's status,
  and the lock expires at its TTL): fenced exits within about a second of CMD after a loss.

Exit codes: CMD's own (128+N if it died of signal N; also 128+N, CMD not run, when fenced
  got SIGTERM, SIGINT, SIGHUP or SIGQUIT while still waiting: it left the line first);
  75 lock held elsewhere for the whole --wait (CMD not run);
  76 lock lost or running out while CMD ran (see the timeline), or --max-hold reached
     (CMD was stopped for it); also when CMD finished but the store had taken the lock
     away meanwhile (a force release not yet noticed);
  69 store failed or unreachable; 78 bad URL/key/label, a --grace that does not fit
     --ttl, missing schema, or K in use as another kind (another --permits N, a reader or
     writer on a semaphore, a semaphore on a reader-writer lock); 2 a malformed command line
     (unknown or conflicting options, --permits outside 1..=1000000); 127 CMD could not start.
  CMD's own code can equal one of these: fenced's own failures always print a `fenced:` line on
  stderr, CMD's codes pass through silently.

Signals and terminals:
  While fenced waits for the lock, SIGTERM, SIGINT, SIGHUP and SIGQUIT make it leave the line
  (so nobody behind it waits for its turn) and exit 128+N without running CMD.
  Once CMD runs, SIGTERM, SIGINT, SIGHUP and SIGQUIT are passed to CMD's process group; fenced waits up to
  --grace (SIGKILL then, or at the safe deadline if renewals fail meanwhile), releases the lock
  and exits with CMD's status — 76 if the store had taken the lock away meanwhile.
  With stdin a terminal, CMD's group gets the terminal while it runs (it can read input; Ctrl-C
  reaches it). Ctrl-Z stops CMD and fenced together; `fg` resumes both. A job stopped longer than
  --ttl has lost the lock and is killed when resumed (76).
  SIGKILL or the OOM killer on fenced cannot be passed on: CMD keeps running without the lock,
  which expires after --ttl. Run fenced where the whole job is killed together (e.g. a systemd
  unit, KillMode=control-group) if that matters.";

const STATUS_HELP: &str = "\
Every holder is shown with its kind: `mutex`, `permit/N` (one of a semaphore's N), `reader` or
`writer`; for a semaphore or reader-writer lock, `waiting` counts the line behind its holders
(JSON field `waiting`; a separate line on stderr in the table).

Examples:
  fenced status                          # every held lock: key, holder, token, TTL, label
  fenced status nightly-report deploy    # these keys, held or free
  fenced status --url redis://127.0.0.1:6379 --json nightly-report
  fenced status --limit 20 --json | jq '.[].key'";

const RELEASE_HELP: &str = "\
Examples:
  fenced release --force nightly-report
  fenced release --force --url mysql://root@127.0.0.1:3306/test orders:1001

The evicted holder notices at its next renewal (within a third of its TTL); a `fenced run`
holder then kills its command at once (SIGKILL: the key may already be someone else's) and
exits 76.";

const MIGRATE_HELP: &str = "\
Examples:
  fenced migrate --url mysql://root@127.0.0.1:3306/test
  fenced migrate --url 'mysql://app:pw@db/app?strategy=row_lock&table=job_locks'
  FENCED_URL=sqlite:///var/lib/app/locks.db fenced migrate

Idempotent: run it at every deployment before the new version starts. Redis, etcd and memory://
need no schema (the URL is still checked).";

/// Run commands under a distributed lock with a fencing token.
#[derive(Debug, Parser)]
#[command(name = "fenced", version, after_help = EXAMPLES)]
pub(crate) struct Cli {
    /// Store URL. Default: $FENCED_URL, else the embedded SQLite file.
    #[arg(long, global = true, env = "FENCED_URL", hide_env_values = true)]
    pub(crate) url: Option<String>,

    /// Log filter for diagnostics on stderr (e.g. `info`, `fenced=debug`).
    #[arg(
        long,
        global = true,
        env = "FENCED_LOG",
        hide_env_values = true,
        default_value = "warn"
    )]
    pub(crate) log: String,

    #[command(subcommand)]
    pub(crate) command: Command,
}

#[derive(Debug, Subcommand)]
pub(crate) enum Command {
    /// Hold a lock while a command runs; renew it; stop the command if the lock is lost.
    #[command(after_help = RUN_HELP)]
    Run(RunArgs),
    /// Show who holds the given keys, or every held lock (holder, fencing token, remaining TTL, label).
    #[command(after_help = STATUS_HELP)]
    Status(StatusArgs),
    /// Administrative: free a key whoever holds it.
    #[command(after_help = RELEASE_HELP)]
    Release(ReleaseArgs),
    /// Create or upgrade the schema of an SQL store (idempotent).
    #[command(after_help = MIGRATE_HELP)]
    Migrate,
    /// Measure every backend side by side with the locks users would pick instead
    /// (built with the `bench` feature; see scripts/bench.sh).
    #[cfg(feature = "bench")]
    Bench(bench::BenchArgs),
}

#[derive(Debug, Args)]
pub(crate) struct RunArgs {
    /// The lock's name.
    #[arg(long)]
    pub(crate) key: String,
    /// Lease TTL: how long a crashed holder keeps the lock. Renewed every ttl/3.
    #[arg(long, default_value = "30s", value_parser = parse_duration)]
    pub(crate) ttl: Duration,
    /// How long to wait for a held lock: a duration, or `forever`. Default: do not wait.
    #[arg(long, default_value = "0s", value_parser = parse_wait)]
    pub(crate) wait: Wait,
    /// Stop the command after this long (from the grant): SIGTERM, SIGKILL after --grace; exit 76.
    #[arg(long, value_parser = parse_duration)]
    pub(crate) max_hold: Option<Duration>,
    /// After SIGTERM, how long the command gets before SIGKILL. Once renewals fail, SIGTERM
    /// comes this long before the lock's safe deadline; at most 7/12 of --ttl less the safety
    /// margin (a longer one is refused). [default: 10s, or the largest that fits --ttl if less]
    #[arg(long, value_parser = parse_duration)]
    pub(crate) grace: Option<Duration>,
    /// Run as one of at most N holders of KEY's semaphore (every holder of KEY must give
    /// the same N). Semaphores and reader-writer locks are a namespace apart from plain keys.
    #[arg(long, value_name = "N", conflicts_with_all = ["shared", "exclusive"],
          value_parser = clap::value_parser!(u32).range(1..=i64::from(fenced::Permits::MAX_PERMITS)))]
    pub(crate) permits: Option<u32>,
    /// Run as a reader of KEY's reader-writer lock: beside other readers, never beside its writer.
    #[arg(long, conflicts_with = "exclusive")]
    pub(crate) shared: bool,
    /// Run as the writer of KEY's reader-writer lock: alone, after the readers before it;
    /// readers that come later wait for it.
    #[arg(long)]
    pub(crate) exclusive: bool,
    /// A human-readable label stored with the lock and shown by `fenced status`
    /// (also FENCED_LABEL for the command). Default: host:pid of fenced.
    #[arg(long, value_name = "TEXT")]
    pub(crate) label: Option<String>,
    /// The command and its arguments (after `--`). It gets FENCED_TOKEN, FENCED_KEY, FENCED_LABEL.
    #[arg(required = true, trailing_var_arg = true, num_args = 1.., value_name = "CMD")]
    pub(crate) command: Vec<String>,
}

/// `--wait` value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Wait {
    For(Duration),
    Forever,
}

fn parse_wait(s: &str) -> Result<Wait, String> {
    if s == "forever" {
        return Ok(Wait::Forever);
    }
    parse_duration(s)
        .map(Wait::For)
        .map_err(|_| format!("invalid duration `{s}`; use e.g. 0s, 10s, 5m or `forever`"))
}

/// A duration argument, in the syntax URL parameters use too (`500ms`,
/// `5s`, `1m 30s`, or a bare number of seconds).
fn parse_duration(s: &str) -> Result<Duration, String> {
    fenced::url::parse_duration_syntax(s)
        .map_err(|_| format!("invalid duration `{s}`; use e.g. 500ms, 5s or 2m"))
}

#[derive(Debug, Args)]
pub(crate) struct StatusArgs {
    /// Print JSON instead of a table.
    #[arg(long)]
    pub(crate) json: bool,
    /// With no KEY: show at most this many held locks (the first in key order).
    #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    pub(crate) limit: u64,
    /// The keys to inspect, held or free. None: every held lock (stores that can list them).
    #[arg(value_name = "KEY")]
    pub(crate) keys: Vec<String>,
}

#[derive(Debug, Args)]
pub(crate) struct ReleaseArgs {
    /// Required: confirms you mean to evict whoever holds the key.
    #[arg(long, required = true)]
    pub(crate) force: bool,
    /// The key to free: its mutex and every holder (and waiter) of its
    /// semaphore or reader-writer lock. Evicted holders learn it at their
    /// next renewal; fencing tokens keep them from the resource meanwhile.
    pub(crate) key: String,
}

/// Prints one line to stderr, prefixed with the program name.
pub(crate) fn say(msg: &str) {
    #[allow(clippy::print_stderr)]
    {
        eprintln!("fenced: {msg}");
    }
}

/// The exit code for a library error, after saying what to do.
pub(crate) fn fail(e: &Error) -> u8 {
    say(&e.to_string());
    match e {
        Error::Backend { .. } => EXIT_STORE,
        Error::Timeout { .. } => EXIT_BUSY,
        Error::LeaseLost { .. } => EXIT_LOST,
        _ => EXIT_CONFIG,
    }
}

/// `--url`, else `$FENCED_URL` (clap reads it into `--url`), else the
/// embedded per-user SQLite file.
fn store_url(cli_url: Option<String>) -> Result<String, Error> {
    match cli_url {
        Some(u) if !u.trim().is_empty() => Ok(u),
        _ => fenced::default_url(),
    }
}

async fn connect(
    url: Option<String>,
) -> Result<std::sync::Arc<dyn fenced::DistributedLock>, Error> {
    fenced::connect(&store_url(url)?).await
}

/// Runs the chosen subcommand; returns the process exit code.
pub(crate) async fn dispatch(cli: Cli) -> u8 {
    match cli.command {
        Command::Run(args) => run::run(cli.url, args).await,
        Command::Status(args) => status(cli.url, args).await,
        Command::Release(args) => release(cli.url, args).await,
        Command::Migrate => migrate(cli.url).await,
        #[cfg(feature = "bench")]
        Command::Bench(args) => bench::bench(args).await,
    }
}

async fn status(url: Option<String>, args: StatusArgs) -> u8 {
    let keys = match args
        .keys
        .iter()
        .map(LockKey::new)
        .collect::<Result<Vec<_>, _>>()
    {
        Ok(k) => k,
        Err(e) => return fail(&e),
    };
    let store = match connect(url).await {
        Ok(s) => s,
        Err(e) => return fail(&e),
    };
    let limit = usize::try_from(args.limit).unwrap_or(usize::MAX);
    match status_rows(&*store, keys, limit).await {
        Ok((rows, note)) => {
            if let Some(note) = note {
                say(&note);
            }
            print(&if args.json {
                status_json(&rows)
            } else {
                status_table(&rows)
            });
            0
        }
        Err(Error::Unsupported { backend, .. }) => {
            say(&cannot_list(backend));
            EXIT_CONFIG
        }
        Err(e) => fail(&e),
    }
}

/// One line of `status`: a key's mutex (held or free), or one holder of
/// its semaphore or reader-writer lock.
#[derive(Debug, Clone)]
pub(crate) struct StatusRow {
    pub(crate) key: LockKey,
    /// `mutex`, `permit`, `reader` or `writer`.
    pub(crate) lock: &'static str,
    /// A semaphore's number of permits.
    pub(crate) permits: Option<u32>,
    /// A semaphore's or reader-writer lock's entries waiting in line.
    pub(crate) waiting: Option<usize>,
    pub(crate) info: Option<LockInfo>,
}

impl StatusRow {
    fn mutex(key: LockKey, info: Option<LockInfo>) -> Self {
        StatusRow {
            key,
            lock: "mutex",
            permits: None,
            waiting: None,
            info,
        }
    }

    /// `mutex`, `reader`, `writer`, `permit/4` (one of 4).
    fn lock_column(&self) -> String {
        match self.permits {
            Some(n) => format!("{}/{n}", self.lock),
            None => self.lock.to_owned(),
        }
    }
}

/// The holders of `key`'s semaphore or reader-writer lock, and a note when
/// some wait.
async fn permit_rows(
    sem: &dyn fenced::SemaphoreStore,
    key: &LockKey,
    rows: &mut Vec<StatusRow>,
    notes: &mut Vec<String>,
) -> Result<(), Error> {
    let Some(line) = sem.holders(key).await? else {
        return Ok(());
    };
    for h in line.holders {
        rows.push(StatusRow {
            key: key.clone(),
            lock: h.permits.role(),
            permits: (!h.permits.is_rw()).then_some(line.capacity),
            waiting: Some(line.waiting),
            info: Some(h.info),
        });
    }
    if line.waiting > 0 {
        notes.push(format!(
            "`{key}` ({}): {} waiting",
            fenced::Permits::describe_capacity(line.capacity),
            line.waiting
        ));
    }
    Ok(())
}

/// Each key with its holders (its mutex, held or free, and the holders of
/// its semaphore or reader-writer lock), or — with no keys — every held
/// lock up to `limit`, in key order, with a note when there are more.
async fn status_rows(
    store: &dyn fenced::DistributedLock,
    keys: Vec<LockKey>,
    limit: usize,
) -> Result<(Vec<StatusRow>, Option<String>), Error> {
    let sem = store.semaphores();
    let mut rows = Vec::new();
    let mut notes = Vec::new();
    if !keys.is_empty() {
        for key in keys {
            let info = store.inspect(&key).await?;
            let held = info.is_some();
            let at = rows.len();
            rows.push(StatusRow::mutex(key.clone(), info));
            if let Some(sem) = &sem {
                permit_rows(sem.as_ref(), &key, &mut rows, &mut notes).await?;
                // A free mutex beside a held semaphore is noise.
                if !held && rows.len() > at + 1 {
                    rows.remove(at);
                }
            }
        }
        return Ok((rows, (!notes.is_empty()).then(|| notes.join("; "))));
    }
    let held = store.list(limit.saturating_add(1)).await?;
    rows.extend(
        held.into_iter()
            .map(|i| StatusRow::mutex(i.key.clone(), Some(i))),
    );
    if let Some(sem) = &sem {
        let mut keys: Vec<LockKey> = sem
            .list(limit.saturating_add(1))
            .await?
            .into_iter()
            .map(|i| i.key)
            .collect();
        keys.dedup();
        for key in keys {
            permit_rows(sem.as_ref(), &key, &mut rows, &mut notes).await?;
        }
    }
    rows.sort_by(|a, b| a.key.cmp(&b.key));
    if rows.len() > limit {
        rows.truncate(limit);
        notes.push(format!(
            "showing {limit} of the held locks (SQL stores and etcd: the first in key order; \
             Redis: the first its scan found); raise --limit to see more"
        ));
    }
    Ok((rows, (!notes.is_empty()).then(|| notes.join("; "))))
}

/// What `status` says for a store without `list`: every built-in store
/// lists; a third-party store may not implement it.
fn cannot_list(backend: &str) -> String {
    format!(
        "this store ({backend}) cannot list locks (a store outside fenced's own backends); \
         name the keys: fenced status KEY…"
    )
}

/// `[{"key", "lock", "held", "owner", "label", "token", "remaining_ms", "hold_count"}…]`,
/// one line: `lock` is `mutex`, `permit` (with `permits`, the semaphore's
/// number), `reader` or `writer` (those three with `waiting`, the entries
/// in the key's line behind its holders; 0 where the store cannot tell);
/// `label` null when the holder gave none or the store keeps none; only
/// `key`, `lock` and `held` for a free key.
fn status_json(rows: &[StatusRow]) -> String {
    let list: Vec<serde_json::Value> = rows
        .iter()
        .map(|row| {
            let mut v = match &row.info {
                Some(i) => serde_json::json!({
                    "key": row.key.as_str(), "lock": row.lock, "held": true,
                    "owner": i.owner.as_str(),
                    "label": i.label.as_ref().map(|l| l.as_str()),
                    "token": i.token.get(),
                    "remaining_ms": u64::try_from(i.remaining_ttl.as_millis()).unwrap_or(u64::MAX),
                    "hold_count": i.hold_count,
                }),
                None => {
                    serde_json::json!({ "key": row.key.as_str(), "lock": row.lock, "held": false })
                }
            };
            if let Some(obj) = v.as_object_mut() {
                if let Some(n) = row.permits {
                    obj.insert("permits".into(), n.into());
                }
                if let Some(n) = row.waiting {
                    obj.insert("waiting".into(), n.into());
                }
            }
            v
        })
        .collect();
    let mut out = serde_json::Value::Array(list).to_string();
    out.push('\n');
    out
}

fn status_table(rows: &[StatusRow]) -> String {
    // The label last: it is free text of any width.
    let line = |k: &str, lock: &str, holder: &str, token: &str, ttl: &str, label: &str| {
        format!("{k:<32} {lock:<12} {holder:<38} {token:>12} {ttl:>10}  {label}")
            .trim_end()
            .to_owned()
            + "\n"
    };
    let mut out = line("KEY", "LOCK", "HOLDER", "TOKEN", "TTL", "LABEL");
    for row in rows {
        let lock = row.lock_column();
        out.push_str(&match &row.info {
            Some(i) => line(
                row.key.as_str(),
                &lock,
                i.owner.as_str(),
                &i.token.get().to_string(),
                &format!("{:.1}s", i.remaining_ttl.as_secs_f64()),
                i.label.as_ref().map_or("-", |l| l.as_str()),
            ),
            None => line(row.key.as_str(), &lock, "-", "-", "free", ""),
        });
    }
    out
}

async fn release(url: Option<String>, args: ReleaseArgs) -> u8 {
    debug_assert!(args.force);
    let key = match LockKey::new(&args.key) {
        Ok(k) => k,
        Err(e) => return fail(&e),
    };
    let store = match connect(url).await {
        Ok(s) => s,
        Err(e) => return fail(&e),
    };
    // A key names a mutex and, apart from it, a semaphore or reader-writer
    // lock (their namespaces are separate): free whichever is held.
    let mutex = match store.force_release(&key).await {
        Ok(freed) => freed,
        Err(e) => return fail(&e),
    };
    let family = match store.semaphores() {
        Some(sems) => match sems.force_release(&key).await {
            Ok(freed) => freed,
            Err(e) => return fail(&e),
        },
        None => false,
    };
    match (mutex, family) {
        (true, true) => print(&format!(
            "released `{key}` (the mutex, and every holder of its semaphore or reader-writer lock)\n"
        )),
        (true, false) => print(&format!("released `{key}`\n")),
        (false, true) => print(&format!(
            "released `{key}` (every holder of its semaphore or reader-writer lock)\n"
        )),
        (false, false) => print(&format!("`{key}` was not held\n")),
    }
    0
}

async fn migrate(url: Option<String>) -> u8 {
    let url = match store_url(url) {
        Ok(u) => u,
        Err(e) => return fail(&e),
    };
    match fenced::migrate(&url).await {
        Ok(true) => {
            print(&format!(
                "schema of {} is up to date\n",
                fenced::redact(&url)
            ));
            0
        }
        Ok(false) => {
            print(&format!("{} needs no schema\n", fenced::redact(&url)));
            0
        }
        Err(e) => fail(&e),
    }
}

/// Writes command output to stdout.
pub(crate) fn print(s: &str) {
    use std::io::Write;
    let _ = std::io::stdout().write_all(s.as_bytes());
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use clap::CommandFactory;
    use fenced::{async_trait, DistributedLock, LockOptions, MemoryLock, Result};

    use super::*;

    #[test]
    fn the_arguments_are_consistent() {
        Cli::command().debug_assert();
        // KEY is optional for status; --limit must be at least 1.
        assert!(Cli::try_parse_from(["fenced", "status"]).is_ok());
        assert!(Cli::try_parse_from(["fenced", "status", "--limit", "0"]).is_err());
    }

    /// A store that cannot list, as stores outside fenced's own backends
    /// may (the trait's default `list`).
    #[derive(Debug)]
    struct NoList(MemoryLock);

    #[async_trait]
    impl fenced::WrapLock for NoList {
        fn inner(&self) -> &dyn DistributedLock {
            &self.0
        }
        async fn list(&self, _limit: usize) -> Result<Vec<LockInfo>> {
            Err(Error::Unsupported {
                backend: "memory",
                what: "listing held locks".into(),
            })
        }
    }
    fenced::wrap_lock!(NoList);

    #[tokio::test]
    async fn status_without_keys_on_a_store_that_cannot_list_says_to_name_them() {
        let store = NoList(MemoryLock::new());
        let key = LockKey::new("k").unwrap();
        store
            .try_acquire(&key, &LockOptions::default())
            .await
            .unwrap()
            .unwrap();
        let Err(Error::Unsupported { backend, .. }) = status_rows(&store, vec![], 10).await else {
            panic!("listing a store without `list` did not report Unsupported");
        };
        let msg = cannot_list(backend);
        assert!(
            msg.contains("cannot list locks (a store outside fenced's own backends); name the keys: fenced status KEY"),
            "{msg}"
        );
        // Named keys still work on it.
        let (rows, _) = status_rows(&store, vec![key.clone()], 10).await.unwrap();
        assert_eq!(rows.len(), 1);
        assert!(rows[0].info.is_some());
    }

    #[tokio::test]
    async fn status_without_keys_lists_in_key_order_up_to_the_limit() {
        let store = MemoryLock::new();
        for k in ["b", "c", "a"] {
            store
                .try_acquire(&LockKey::new(k).unwrap(), &LockOptions::default())
                .await
                .unwrap()
                .unwrap();
        }
        let (rows, note) = status_rows(&store, vec![], 10).await.unwrap();
        let keys: Vec<&str> = rows.iter().map(|r| r.key.as_str()).collect();
        assert_eq!(keys, ["a", "b", "c"]);
        assert!(note.is_none());
        let (rows, note) = status_rows(&store, vec![], 2).await.unwrap();
        assert_eq!(rows.len(), 2);
        assert!(note.unwrap().contains("raise --limit"));
        let table = status_table(&rows);
        assert!(table.starts_with("KEY"), "{table}");
        assert_eq!(table.lines().count(), 3);
        let json: serde_json::Value = serde_json::from_str(&status_json(&rows)).unwrap();
        assert_eq!(json[1]["key"], "b");
        assert_eq!(json[1]["held"], true);
        // No label given: the field is there, null; the table shows `-`.
        assert!(json[1]["label"].is_null(), "{json}");
        assert!(table.lines().next().unwrap().ends_with("LABEL"), "{table}");
    }
}
