//! The client process (`fenced-faults-client`): acquires, does the fenced
//! read – work – write through the parent's hub, releases, and reports every
//! step to the hub, until the hub says the run is over.

use std::{sync::Arc, time::Duration};

use clap::Parser;
use fenced_api::{Error, LockClient, WaitPolicy};
use tokio::{
    io::{AsyncBufReadExt, AsyncWriteExt, BufReader, Lines},
    net::{
        tcp::{OwnedReadHalf, OwnedWriteHalf},
        TcpStream,
    },
    sync::Mutex,
};

use crate::{
    family::{self, Role},
    model::Primitive,
    mutant::Mutant,
};

/// Command line of `fenced-faults-client` (started by the fault runner).
#[derive(Debug, Parser)]
#[command(about = "A lock client process of the fenced fault suite (started by fenced-faults)")]
pub struct ClientArgs {
    /// The store URL.
    #[arg(long)]
    pub url: String,
    /// The key.
    #[arg(long)]
    pub key: String,
    /// This client's number in the run.
    #[arg(long)]
    pub id: usize,
    /// The hub's address (`127.0.0.1:port`).
    #[arg(long)]
    pub hub: String,
    /// Lease TTL, ms.
    #[arg(long)]
    pub ttl_ms: u64,
    /// Shortest work between read and write, ms.
    #[arg(long, default_value_t = 1)]
    pub work_min_ms: u64,
    /// Longest work between read and write, ms.
    #[arg(long, default_value_t = 5)]
    pub work_max_ms: u64,
    /// Seed of the work times.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Rest after each hold, ms (a long holder leaves the others a turn on
    /// stores without a queue).
    #[arg(long, default_value_t = 0)]
    pub rest_ms: u64,
    /// Wrap the lock in this mutant (control runs).
    #[arg(long)]
    pub mutant: Option<String>,
    /// Directory the mutants share.
    #[arg(long)]
    pub mutant_dir: Option<std::path::PathBuf>,
    /// A semaphore holder uses the resource without checking its permit
    /// first (control runs with fencing off).
    #[arg(long)]
    pub no_permit_check: bool,
    /// What to hold: `mutex`, `semaphore` or `rw` (see `Primitive`).
    #[arg(long, default_value = "mutex")]
    pub primitive: String,
}

type Conn = (Lines<BufReader<OwnedReadHalf>>, OwnedWriteHalf);

/// The line connection to the hub; one request at a time, every request
/// answered (so an event is stamped before the step it announces happens).
#[derive(Clone)]
struct Hub(Arc<Mutex<Conn>>);

impl Hub {
    async fn ask(&self, line: &str) -> Option<String> {
        let mut c = self.0.lock().await;
        let line = line.replace('\n', " ");
        c.1.write_all(format!("{line}\n").as_bytes()).await.ok()?;
        c.0.next_line().await.ok().flatten()
    }

    async fn event(
        &self,
        op: &str,
        phase: &str,
        token: Option<u64>,
        detail: &str,
    ) -> Option<String> {
        let t = token.map_or_else(|| "-".to_owned(), |t| t.to_string());
        self.ask(&format!("EV {op} {phase} {t} {detail}")).await
    }
}

/// Runs one client process; the exit code.
pub async fn main(args: ClientArgs) -> i32 {
    let hub = match TcpStream::connect(&args.hub).await {
        Ok(s) => {
            let (r, w) = s.into_split();
            Hub(Arc::new(Mutex::new((BufReader::new(r).lines(), w))))
        }
        Err(_) => return 2,
    };
    let wall_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis());
    if hub
        .ask(&format!(
            "HELLO {} {wall_ms} {}",
            args.id,
            std::process::id()
        ))
        .await
        .is_none()
    {
        return 2;
    }
    let ttl = Duration::from_millis(args.ttl_ms);
    let lock = match fenced::connect(&args.url).await {
        Ok(l) => l,
        Err(e) => {
            hub.ask(&format!("ERR 0 client {}: connect: {e}", args.id))
                .await;
            return 1;
        }
    };
    let lock = match (&args.mutant, &args.mutant_dir) {
        (Some(name), Some(dir)) => match Mutant::from_name(name) {
            Some(m) => m.wrap(lock, dir),
            None => {
                hub.ask(&format!("ERR 0 unknown mutant {name}")).await;
                return 1;
            }
        },
        _ => lock,
    };
    let client = match LockClient::builder(lock)
        .ttl(ttl)
        .wait(WaitPolicy::Timeout(ttl * 3))
        .build()
    {
        Ok(c) => c,
        Err(e) => {
            hub.ask(&format!("ERR 0 client {}: {e}", args.id)).await;
            return 1;
        }
    };
    let Some(primitive) = Primitive::from_arg(&args.primitive) else {
        hub.ask(&format!("ERR 0 unknown primitive {}", args.primitive))
            .await;
        return 1;
    };
    let mut rng = fastrand::Rng::with_seed(args.seed.wrapping_mul(1_000_003) ^ args.id as u64);
    loop {
        match hub.event("acquire", "invoke", None, "").await.as_deref() {
            Some("OK") => {}
            _ => return 0, // "END", or the hub is gone
        }
        // The hub picks the victim's hold to hit; a reader-writer victim
        // is a reader or a writer by chance here.
        let role = Role::pick(primitive, false, args.seed, &mut rng);
        let guard = match family::acquire(&client, &args.key, primitive, role).await {
            Ok(g) => g,
            Err(Error::Timeout { .. }) => {
                hub.event("acquire", "fail", None, "timeout").await;
                continue;
            }
            Err(e) => {
                hub.event("acquire", "unknown", None, &e.to_string()).await;
                let r = u8::from(e.is_retryable());
                hub.ask(&format!("ERR {r} client {}: acquire: {e}", args.id))
                    .await;
                tokio::time::sleep(ttl / 10).await;
                continue;
            }
        };
        let token = guard.token().get();
        hub.event("acquire", "ok", Some(token), role.detail(primitive))
            .await;
        let watcher = {
            let h = guard.handle().clone();
            let hub = hub.clone();
            tokio::spawn(async move {
                let reason = h.lost().await;
                hub.event("lost", "ok", Some(token), &format!("{reason:?}"))
                    .await;
            })
        };
        // The hub's words for the three ways of using the resource (see
        // procs/mod.rs): the counter's read – write, a reader's read and
        // its validation, a permit holder's use of one of N places.
        let (begin, end) = match role {
            Role::Exclusive => ("READ", "WRITE"),
            Role::Shared => ("RREAD", "RDONE"),
            Role::Permit => ("PERMIT", "LEAVE"),
        };
        let read = hub
            .ask(&format!("{begin} {token}"))
            .await
            .unwrap_or_default();
        let mut it = read.split_whitespace();
        if let (Some("VAL"), Some(value), Some(version)) = (it.next(), it.next(), it.next()) {
            let work = rng.u64(args.work_min_ms..=args.work_max_ms.max(args.work_min_ms));
            if role == Role::Permit {
                if family::permit_still_held(&guard, !args.no_permit_check) {
                    hub.ask(&format!("ENTER {token}")).await;
                    tokio::time::sleep(Duration::from_millis(work)).await;
                    hub.ask(&format!("LEAVE {token}")).await;
                } else {
                    hub.ask(&format!("REFUSED {token}")).await;
                }
            } else {
                tokio::time::sleep(Duration::from_millis(work)).await;
                hub.ask(&format!("{end} {token} {value} {version}")).await;
            }
        }
        hub.event("release", "invoke", Some(token), "").await;
        match guard.release().await {
            Ok(()) => hub.event("release", "ok", Some(token), "").await,
            Err(Error::LeaseLost { .. }) => {
                hub.event("release", "fail", Some(token), "lease lost")
                    .await
            }
            Err(e) => {
                hub.event("release", "unknown", Some(token), &e.to_string())
                    .await
            }
        };
        watcher.abort();
        tokio::time::sleep(Duration::from_millis(rng.u64(0..=3) + args.rest_ms)).await;
    }
}
