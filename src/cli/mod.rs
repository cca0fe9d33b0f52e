//! Argument parsing, exit codes and the small subcommands.

#[cfg(feature = "bench")]
mod bench;
mod run;

use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use fenced::{Error, LockKey};

/// Exit code: the lock was held elsewhere for the whole `--wait`.
pub(crate) const EXIT_BUSY: u8 = 75;
/// Exit code: the lock was lost while the command ran; the command was terminated.
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
  FENCED_URL=mysql://app:pw@db/app fenced run --key orders:1001 -- ./fix-order 1001
  fenced status --url redis://127.0.0.1 nightly-report deploy --json
  fenced release --force deploy
  fenced migrate --url mysql://root@127.0.0.1:3306/test

Store URLs: sqlite:///path/locks.db (default), mysql://user:pw@host/db?strategy=unique_key|row_lock|optimistic,
  redis://host:6379, etcd://h1:2379,h2:2379/prefix, memory:// (this process only).

Exit codes of `run`: the command's own code (128+N if killed by signal N);
  75 lock held elsewhere for the whole --wait; 76 lock lost while the command ran (command terminated);
  69 store failed or unreachable; 78 bad URL/key/option or missing schema; 127 command could not start.";

/// Run commands under a distributed lock with a fencing token.
#[derive(Debug, Parser)]
#[command(name = "fenced", version, after_help = EXAMPLES)]
pub(crate) struct Cli {
    /// Store URL. Default: $FENCED_URL, else the embedded SQLite file.
    #[arg(long, global = true, env = "FENCED_URL", hide_env_values = true)]
    pub(crate) url: Option<String>,

    /// Log filter for diagnostics on stderr (e.g. `info`, `fenced=debug`).
    #[arg(long, global = true, env = "FENCED_LOG", default_value = "warn")]
    pub(crate) log: String,

    #[command(subcommand)]
    pub(crate) command: Command,
}

#[derive(Debug, Subcommand)]
pub(crate) enum Command {
    /// Hold a lock while a command runs; renew it; stop the command if the lock is lost.
    Run(RunArgs),
    /// Show who holds the given keys (holder, fencing token, remaining TTL).
    Status(StatusArgs),
    /// Administrative: free a key whoever holds it.
    Release(ReleaseArgs),
    /// Create or upgrade the schema of an SQL store (idempotent).
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
    #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
    pub(crate) ttl: Duration,
    /// How long to wait for a held lock: a duration, or `forever`. Default: do not wait.
    #[arg(long, default_value = "0s", value_parser = parse_wait)]
    pub(crate) wait: Wait,
    /// Stop renewing (and terminate the command) after this long.
    #[arg(long, value_parser = humantime::parse_duration)]
    pub(crate) max_hold: Option<Duration>,
    /// After SIGTERM, how long the command gets before SIGKILL.
    #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
    pub(crate) grace: Duration,
    /// The command and its arguments (after `--`). It gets FENCED_TOKEN and FENCED_KEY.
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
    humantime::parse_duration(s)
        .map(Wait::For)
        .map_err(|e| format!("{e} (use e.g. 0s, 10s, 5m or `forever`)"))
}

#[derive(Debug, Args)]
pub(crate) struct StatusArgs {
    /// Print JSON instead of a table.
    #[arg(long)]
    pub(crate) json: bool,
    /// The keys to inspect.
    #[arg(required = true, value_name = "KEY")]
    pub(crate) keys: Vec<String>,
}

#[derive(Debug, Args)]
pub(crate) struct ReleaseArgs {
    /// Required: confirms you mean to evict whoever holds the key.
    #[arg(long, required = true)]
    pub(crate) force: bool,
    /// The key to free.
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
    let mut rows = Vec::new();
    for key in &keys {
        match store.inspect(key).await {
            Ok(info) => rows.push((key, info)),
            Err(e) => return fail(&e),
        }
    }
    let mut out = String::new();
    if args.json {
        let list: Vec<serde_json::Value> = rows
            .iter()
            .map(|(k, info)| match info {
                Some(i) => serde_json::json!({
                    "key": k.as_str(), "held": true, "owner": i.owner.as_str(),
                    "token": i.token.get(), "remaining_ms": i.remaining_ttl.as_millis() as u64,
                    "hold_count": i.hold_count,
                }),
                None => serde_json::json!({ "key": k.as_str(), "held": false }),
            })
            .collect();
        out.push_str(&serde_json::Value::Array(list).to_string());
        out.push('\n');
    } else {
        out.push_str(&format!(
            "{:<32} {:<38} {:>12} {:>10}\n",
            "KEY", "HOLDER", "TOKEN", "TTL"
        ));
        for (k, info) in &rows {
            match info {
                Some(i) => out.push_str(&format!(
                    "{:<32} {:<38} {:>12} {:>10}\n",
                    k.as_str(),
                    i.owner.as_str(),
                    i.token.get(),
                    format!("{:.1}s", i.remaining_ttl.as_secs_f64())
                )),
                None => out.push_str(&format!(
                    "{:<32} {:<38} {:>12} {:>10}\n",
                    k.as_str(),
                    "-",
                    "-",
                    "free"
                )),
            }
        }
    }
    print(&out);
    0
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
    match store.force_release(&key).await {
        Ok(true) => {
            print(&format!("released `{key}`\n"));
            0
        }
        Ok(false) => {
            print(&format!("`{key}` was not held\n"));
            0
        }
        Err(e) => fail(&e),
    }
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
