//! Test support: the conformance harness over the shared ZooKeeper.

#![allow(dead_code, unreachable_pub, clippy::unwrap_used, clippy::expect_used)]

use std::{
    sync::{
        atomic::{AtomicBool, AtomicU64, Ordering::SeqCst},
        Arc,
    },
    time::Duration,
};

use async_trait::async_trait;
use fenced_api::{DistributedLock, Result};
use fenced_conformance::Harness;
use fenced_testkit::private::{PrivateZooKeeper, ZooKeeperOptions};
use fenced_zookeeper::ZkLock;

/// The hosts of the shared ZooKeeper (`FENCED_TEST_ZOOKEEPER_URL`) once it
/// serves requests; a test whose server is down fails with a message
/// naming `scripts/services.sh`.
pub async fn server_hosts() -> String {
    let url = fenced_testkit::shared::require_zookeeper().await;
    let rest = url.split_once("://").map_or(url.as_str(), |(_, r)| r);
    rest.split(['/', '?']).next().unwrap_or(rest).to_owned()
}

/// A namespace unique to this test process.
pub fn run_namespace() -> String {
    format!("/{}", fenced_testkit::run_name("fenced-test-"))
}

pub struct ZkHarness {
    hosts: String,
    namespace: String,
    private: Option<Arc<PrivateZooKeeper>>,
}

impl ZkHarness {
    pub async fn new() -> Self {
        ZkHarness {
            hosts: server_hosts().await,
            namespace: run_namespace(),
            private: None,
        }
    }

    pub fn url(&self) -> String {
        format!(
            "zk://{}{}?session_timeout=20s&connect_timeout=3s&timeout=5s",
            self.hosts, self.namespace
        )
    }

    /// `host:port[,…]` of the server.
    pub fn hosts(&self) -> &str {
        &self.hosts
    }

    /// The namespace every lock of this harness lives under.
    pub fn namespace(&self) -> &str {
        &self.namespace
    }

    pub async fn lock(&self) -> ZkLock {
        ZkLock::connect(&self.url()).await.unwrap()
    }
}

#[async_trait]
impl Harness for ZkHarness {
    async fn client(&self) -> Result<Arc<dyn DistributedLock>> {
        Ok(Arc::new(ZkLock::connect(&self.url()).await?))
    }

    async fn client_in_namespace(&self, suffix: &str) -> Result<Arc<dyn DistributedLock>> {
        let url = format!(
            "zk://{}{}-{suffix}?session_timeout=20s&connect_timeout=3s",
            self.hosts, self.namespace
        );
        Ok(Arc::new(ZkLock::connect(&url).await?))
    }

    async fn unreachable_client(&self) -> Option<Result<Arc<dyn DistributedLock>>> {
        let url = "zk://127.0.0.1:1/x?connect_timeout=2s&timeout=2s";
        Some(
            ZkLock::connect(url)
                .await
                .map(|l| Arc::new(l) as Arc<dyn DistributedLock>),
        )
    }

    fn connect_timeout(&self) -> Duration {
        Duration::from_secs(2)
    }

    async fn restart_store(&self) -> Option<Result<()>> {
        Some(self.private.as_ref()?.restart(0).await)
    }

    async fn private_store(&self) -> Option<Result<Box<dyn Harness>>> {
        let server = match PrivateZooKeeper::start(ZooKeeperOptions::default()).await {
            Ok(s) => Arc::new(s),
            Err(e) => return Some(Err(e)),
        };
        Some(Ok(Box::new(ZkHarness {
            hosts: server.hostports(),
            namespace: "/fenced-private".into(),
            private: Some(server),
        })))
    }

    fn base_ttl(&self) -> Duration {
        Duration::from_secs(2)
    }
}

/// The options of the tests' locks: `ttl`, waiting at most `wait` (a hang
/// catcher).
pub fn opts(ttl: Duration, wait: Duration) -> fenced_api::LockOptions {
    fenced_api::LockOptions::builder()
        .ttl(ttl)
        .wait_timeout(wait)
        .build()
        .unwrap()
}

/// The queue (container) node of `key` under `namespace`, for keys of
/// letters, digits and `-` only (which the encoding of `src/keys.rs` keeps
/// as they are, behind a `k`).
pub fn queue_path(namespace: &str, key: &str) -> String {
    assert!(
        key.chars().all(|c| c.is_ascii_alphanumeric() || c == '-'),
        "{key}: only keys the encoding keeps as they are"
    );
    format!("{namespace}/k{key}")
}

/// A raw ZooKeeper client on `hosts`, to look at the nodes the backend
/// writes.
pub async fn raw_client(hosts: &str) -> zookeeper_client::Client {
    zookeeper_client::Client::connector()
        .with_session_timeout(Duration::from_secs(20))
        .with_connection_timeout(Duration::from_secs(5))
        .connect(hosts)
        .await
        .unwrap_or_else(|e| panic!("a raw client on {hosts}: {e}"))
}

/// The entries of a queue (children of its container node) in creation
/// order; none when the container does not exist.
pub async fn entries(raw: &zookeeper_client::Client, queue: &str) -> Vec<String> {
    let mut children = match raw.list_children(queue).await {
        Ok(c) => c,
        Err(zookeeper_client::Error::NoNode) => Vec::new(),
        Err(e) => panic!("listing {queue}: {e}"),
    };
    children.sort_by_key(|c| c.rsplit_once('-').map(|(_, seq)| seq.to_owned()));
    children
}

/// Waits until the queue holds exactly `n` entries (at most 20 s, a hang
/// catcher), and returns them in creation order.
pub async fn wait_for_entries(
    raw: &zookeeper_client::Client,
    queue: &str,
    n: usize,
) -> Vec<String> {
    let until = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let now = entries(raw, queue).await;
        if now.len() == n {
            return now;
        }
        assert!(
            tokio::time::Instant::now() < until,
            "the queue {queue} never held {n} entries: {now:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Sends a four-letter word to the server at `hostport` and returns its
/// answer (the word must be in the server's `4lw.commands.whitelist`).
pub async fn four_letter(hostport: &str, word: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(hostport)
        .await
        .unwrap_or_else(|e| panic!("connecting to {hostport}: {e}"));
    stream.write_all(word.as_bytes()).await.unwrap();
    let mut answer = String::new();
    tokio::time::timeout(Duration::from_secs(10), stream.read_to_string(&mut answer))
        .await
        .unwrap_or_else(|_| panic!("{word} on {hostport} did not answer"))
        .unwrap();
    assert!(
        !answer.contains("is not executed because it is not in the whitelist"),
        "{word}: {answer}"
    );
    answer
}

/// What `wchp` reports: per watched path, the sessions watching it.
pub fn parse_wchp(answer: &str) -> std::collections::BTreeMap<String, Vec<String>> {
    let mut watched = std::collections::BTreeMap::<String, Vec<String>>::new();
    let mut path = None;
    for line in answer.lines() {
        if line.starts_with('/') {
            path = Some(line.trim().to_owned());
            watched.entry(line.trim().to_owned()).or_default();
        } else if let (Some(p), session) = (&path, line.trim()) {
            if session.starts_with("0x") {
                watched.get_mut(p).unwrap().push(session.to_owned());
            }
        }
    }
    watched
}

/// A TCP proxy in front of one server whose traffic can be swallowed
/// (what is read is dropped, nothing is closed: no FIN, no RST), as a
/// partition or a frozen peer looks to the other side. A swallowed stream
/// is never resumed.
pub struct Blackhole {
    addr: std::net::SocketAddr,
    state: Arc<BlackholeState>,
    accept: tokio::task::JoinHandle<()>,
}

#[derive(Default)]
struct BlackholeState {
    /// Everything swallowed, both ways, on every connection.
    blackhole: AtomicBool,
    /// Replies swallowed on the connections numbered below this.
    muted_below: AtomicU64,
    next: AtomicU64,
}

impl Drop for Blackhole {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

impl Blackhole {
    /// Starts forwarding 127.0.0.1:<port> to `upstream`.
    pub async fn start(upstream: &str) -> Blackhole {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let state = Arc::new(BlackholeState::default());
        let upstream = upstream.to_owned();
        let shared = Arc::clone(&state);
        let accept = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let Ok(server) = tokio::net::TcpStream::connect(&upstream).await else {
                    continue;
                };
                let n = shared.next.fetch_add(1, SeqCst);
                let (client_r, client_w) = client.into_split();
                let (server_r, server_w) = server.into_split();
                let up = Arc::clone(&shared);
                tokio::spawn(pipe(client_r, server_w, move || up.blackhole.load(SeqCst)));
                let down = Arc::clone(&shared);
                tokio::spawn(pipe(server_r, client_w, move || {
                    down.blackhole.load(SeqCst) || n < down.muted_below.load(SeqCst)
                }));
            }
        });
        Blackhole {
            addr,
            state,
            accept,
        }
    }

    /// `127.0.0.1:<port>` of the proxy.
    pub fn hostport(&self) -> String {
        self.addr.to_string()
    }

    /// From now on, nothing passes either way, on any connection.
    pub fn blackhole(&self) {
        self.state.blackhole.store(true, SeqCst);
    }

    /// The connections open now still carry requests to the server, but
    /// their replies are swallowed: the server acts, the client never hears.
    /// Connections opened later pass everything.
    pub fn mute_replies(&self) {
        let open = self.state.next.load(SeqCst);
        self.state.muted_below.store(open, SeqCst);
    }
}

/// Forwards one direction until either end closes — except while
/// `swallowing()`: then what is read is dropped, and the other end is kept
/// open when this one closes.
async fn pipe(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    swallowing: impl Fn() -> bool,
) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        if swallowing() {
            continue;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
    if swallowing() {
        // Closing would tell the other side: keep it open until the test's
        // runtime ends.
        std::future::pending::<()>().await;
    }
}
