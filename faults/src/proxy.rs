//! A TCP fault proxy for loopback tests: clients connect to the proxy, the
//! proxy connects to the real server, and the test decides what happens to
//! the bytes in between.
//!
//! Faults (all can be changed while connections are open):
//!
//! * [`latency`](FaultProxy::latency) / [`one_way_delay`](FaultProxy::one_way_delay):
//!   every chunk waits before it is forwarded (order is kept);
//! * [`blackhole`](FaultProxy::blackhole): nothing is forwarded and nothing
//!   is closed — no RST, no FIN — until it is lifted (a partition, or a peer
//!   frozen by SIGSTOP, as the client sees it);
//! * [`cut`](FaultProxy::cut): every open connection is reset at once
//!   (new ones are accepted);
//! * [`refuse`](FaultProxy::refuse): new connections are reset on accept;
//! * [`drop_reply_of`](FaultProxy::drop_reply_of): the `n`-th request from
//!   now on reaches the server, but its reply is discarded and the
//!   connection reset — the server acted, the client never heard (a lost
//!   acknowledgement).
//!
//! "Request" means one chunk read from the client side; for the
//! request/response protocols of MySQL, Redis and etcd with one request in
//! flight per connection, that is one request.

use std::{
    net::SocketAddr,
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc,
    },
    time::Duration,
};

use tokio::{
    io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt},
    net::{TcpListener, TcpStream},
    sync::watch,
    task::JoinHandle,
};

/// Which way bytes travel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    /// Client to server (requests).
    Up,
    /// Server to client (replies).
    Down,
}

#[derive(Debug, Clone, Default)]
struct Faults {
    up_delay: Duration,
    down_delay: Duration,
    blackhole: bool,
    refuse: bool,
    /// Bumped by `cut`: connections opened under an older epoch close.
    cut_epoch: u64,
    /// Global request number whose reply is to be dropped.
    drop_reply_of: Option<u64>,
}

/// Counters of what the proxy did, for the reports.
#[derive(Debug, Default)]
pub struct ProxyStats {
    /// Connections accepted (refused ones included).
    pub connections: AtomicU64,
    /// Request chunks forwarded to the server.
    pub requests: AtomicU64,
    /// Replies dropped by [`FaultProxy::drop_reply_of`].
    pub dropped_replies: AtomicU64,
    /// Connections reset by `cut`, `refuse` or a dropped reply.
    pub resets: AtomicU64,
}

/// A running fault proxy in front of one server — or of every node of a
/// Redis Cluster, a port each, all under the same faults. Dropping it stops
/// accepting; open connections end with the test's runtime.
#[derive(Debug)]
pub struct FaultProxy {
    /// Each upstream and the port in front of it.
    routes: Vec<(SocketAddr, SocketAddr)>,
    faults: watch::Sender<Faults>,
    stats: Arc<ProxyStats>,
    accept: Vec<JoinHandle<()>>,
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        for a in &self.accept {
            a.abort();
        }
    }
}

impl FaultProxy {
    /// Starts a proxy on a free loopback port that forwards to `upstream`.
    ///
    /// # Errors
    ///
    /// When no loopback port can be bound.
    pub async fn start(upstream: SocketAddr) -> std::io::Result<Self> {
        Self::start_many(&[upstream]).await
    }

    /// Starts a proxy with a free loopback port in front of each of
    /// `upstreams` (the nodes of a cluster), every port under the same
    /// faults and counted together.
    ///
    /// # Errors
    ///
    /// When no loopback port can be bound, or `upstreams` is empty.
    pub async fn start_many(upstreams: &[SocketAddr]) -> std::io::Result<Self> {
        if upstreams.is_empty() {
            return Err(std::io::Error::other("a fault proxy needs an upstream"));
        }
        let (faults, _) = watch::channel(Faults::default());
        let stats = Arc::new(ProxyStats::default());
        let mut proxy = FaultProxy {
            routes: Vec::new(),
            faults,
            stats,
            accept: Vec::new(),
        };
        for &upstream in upstreams {
            let listener = TcpListener::bind("127.0.0.1:0").await?;
            proxy.routes.push((upstream, listener.local_addr()?));
            proxy.accept.push(tokio::spawn(accept_loop(
                listener,
                upstream,
                proxy.faults.clone(),
                Arc::clone(&proxy.stats),
            )));
        }
        Ok(proxy)
    }

    /// The address clients should connect to (in front of the first
    /// upstream).
    pub fn addr(&self) -> SocketAddr {
        self.routes[0].1
    }

    /// Each upstream and the address in front of it.
    pub fn routes(&self) -> &[(SocketAddr, SocketAddr)] {
        &self.routes
    }

    /// What the proxy has done so far.
    pub fn stats(&self) -> &ProxyStats {
        &self.stats
    }

    /// The same delay on every chunk in both directions.
    pub fn latency(&self, d: Duration) {
        self.faults.send_modify(|f| {
            f.up_delay = d;
            f.down_delay = d;
        });
    }

    /// A delay on the chunks of one direction only.
    pub fn one_way_delay(&self, dir: Direction, d: Duration) {
        self.faults.send_modify(|f| match dir {
            Direction::Up => f.up_delay = d,
            Direction::Down => f.down_delay = d,
        });
    }

    /// Holds every byte in both directions (buffered, delivered when
    /// lifted) while keeping every socket open.
    pub fn blackhole(&self, on: bool) {
        self.faults.send_modify(|f| f.blackhole = on);
    }

    /// Resets every open connection now.
    pub fn cut(&self) {
        self.faults.send_modify(|f| f.cut_epoch += 1);
    }

    /// Resets new connections as soon as they are accepted.
    pub fn refuse(&self, on: bool) {
        self.faults.send_modify(|f| f.refuse = on);
    }

    /// Lets the `n`-th request from now (1 = the next one) reach the
    /// server, then drops its reply and resets that connection.
    pub fn drop_reply_of(&self, n: u64) {
        let base = self.stats.requests.load(Ordering::SeqCst);
        self.faults
            .send_modify(|f| f.drop_reply_of = Some(base + n.max(1)));
    }

    /// Back to a transparent proxy (open connections stay open).
    pub fn heal(&self) {
        self.faults.send_modify(|f| {
            let epoch = f.cut_epoch;
            *f = Faults {
                cut_epoch: epoch,
                ..Faults::default()
            };
        });
    }
}

async fn accept_loop(
    listener: TcpListener,
    upstream: SocketAddr,
    faults: watch::Sender<Faults>,
    stats: Arc<ProxyStats>,
) {
    loop {
        let Ok((client, _)) = listener.accept().await else {
            continue;
        };
        stats.connections.fetch_add(1, Ordering::Relaxed);
        let rx = faults.subscribe();
        if rx.borrow().refuse {
            stats.resets.fetch_add(1, Ordering::Relaxed);
            reset(client);
            continue;
        }
        let stats = Arc::clone(&stats);
        let faults = faults.clone();
        tokio::spawn(async move {
            let Ok(server) = TcpStream::connect(upstream).await else {
                reset(client);
                return;
            };
            let _ = client.set_nodelay(true);
            let _ = server.set_nodelay(true);
            connection(client, server, faults, rx, stats).await;
        });
    }
}

/// Closes with RST rather than FIN, as a crashed peer or middlebox would.
fn reset(stream: TcpStream) {
    // tokio deprecates SO_LINGER because a *non-zero* linger blocks the
    // thread on drop; a zero linger never blocks: the kernel sends RST.
    #[allow(deprecated)]
    let _ = stream.set_linger(Some(Duration::ZERO));
    drop(stream);
}

/// What a pump reports when it stops.
enum End {
    /// One side closed normally.
    Closed,
    /// The connection must be reset (cut, dropped reply, I/O error).
    Reset,
}

async fn connection(
    mut client: TcpStream,
    mut server: TcpStream,
    faults: watch::Sender<Faults>,
    rx: watch::Receiver<Faults>,
    stats: Arc<ProxyStats>,
) {
    let epoch = rx.borrow().cut_epoch;
    let end = {
        let (cr, cw) = client.split();
        let (sr, sw) = server.split();
        // The reply the up pump marked as doomed: the down pump drops it.
        let (doom_tx, doom_rx) = watch::channel(false);
        let up = pump(
            cr,
            sw,
            Direction::Up,
            &faults,
            rx.clone(),
            epoch,
            &stats,
            Some(&doom_tx),
            None,
        );
        let down = pump(
            sr,
            cw,
            Direction::Down,
            &faults,
            rx,
            epoch,
            &stats,
            None,
            Some(doom_rx),
        );
        // Whichever side ends first decides for the whole connection.
        tokio::select! {
            e = up => e,
            e = down => e,
        }
    };
    match end {
        End::Closed => {
            let _ = client.shutdown().await;
            let _ = server.shutdown().await;
        }
        End::Reset => {
            stats.resets.fetch_add(1, Ordering::Relaxed);
            reset(client);
            reset(server);
        }
    }
}

#[allow(clippy::too_many_arguments)]
async fn pump<R, W>(
    mut from: R,
    mut to: W,
    dir: Direction,
    faults: &watch::Sender<Faults>,
    mut rx: watch::Receiver<Faults>,
    epoch: u64,
    stats: &ProxyStats,
    doom_tx: Option<&watch::Sender<bool>>,
    mut doom_rx: Option<watch::Receiver<bool>>,
) -> End
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = tokio::select! {
            r = from.read(&mut buf) => match r {
                Ok(0) => return End::Closed,
                Ok(n) => n,
                Err(_) => return End::Reset,
            },
            changed = rx.changed() => {
                if changed.is_err() || rx.borrow().cut_epoch != epoch {
                    return End::Reset;
                }
                continue;
            }
        };
        // Hold the chunk while blackholed; a cut during the hold resets.
        loop {
            let f = rx.borrow_and_update().clone();
            if f.cut_epoch != epoch {
                return End::Reset;
            }
            if !f.blackhole {
                break;
            }
            if rx.changed().await.is_err() {
                return End::Reset;
            }
        }
        let delay = {
            let f = rx.borrow();
            match dir {
                Direction::Up => f.up_delay,
                Direction::Down => f.down_delay,
            }
        };
        if !delay.is_zero() {
            tokio::time::sleep(delay).await;
        }
        if dir == Direction::Up {
            let nth = stats.requests.fetch_add(1, Ordering::SeqCst) + 1;
            let doomed = faults.send_if_modified(|f| {
                if f.drop_reply_of == Some(nth) {
                    f.drop_reply_of = None;
                    true
                } else {
                    false
                }
            });
            if let (true, Some(tx)) = (doomed, doom_tx) {
                let _ = tx.send(true);
            }
        }
        if let Some(doom) = &mut doom_rx {
            if *doom.borrow_and_update() {
                stats.dropped_replies.fetch_add(1, Ordering::Relaxed);
                return End::Reset;
            }
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return End::Reset;
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;

    /// An echo server that counts the bytes it received.
    async fn echo() -> (SocketAddr, Arc<AtomicU64>) {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let seen = Arc::new(AtomicU64::new(0));
        let s = Arc::clone(&seen);
        tokio::spawn(async move {
            loop {
                let (mut c, _) = l.accept().await.unwrap();
                let s = Arc::clone(&s);
                tokio::spawn(async move {
                    let mut b = [0u8; 1024];
                    loop {
                        match c.read(&mut b).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => {
                                s.fetch_add(n as u64, Ordering::SeqCst);
                                if c.write_all(&b[..n]).await.is_err() {
                                    return;
                                }
                            }
                        }
                    }
                });
            }
        });
        (addr, seen)
    }

    async fn roundtrip(c: &mut TcpStream, msg: &[u8]) -> std::io::Result<Vec<u8>> {
        c.write_all(msg).await?;
        let mut out = vec![0u8; msg.len()];
        c.read_exact(&mut out).await?;
        Ok(out)
    }

    const HANG: Duration = Duration::from_secs(10);

    #[tokio::test]
    async fn transparent_until_told_otherwise() {
        let (up, _) = echo().await;
        let p = FaultProxy::start(up).await.unwrap();
        let mut c = TcpStream::connect(p.addr()).await.unwrap();
        assert_eq!(roundtrip(&mut c, b"ping").await.unwrap(), b"ping");
        assert_eq!(p.stats().requests.load(Ordering::SeqCst), 1);
    }

    #[tokio::test]
    async fn blackhole_holds_bytes_without_closing_then_delivers() {
        let (up, seen) = echo().await;
        let p = FaultProxy::start(up).await.unwrap();
        let mut c = TcpStream::connect(p.addr()).await.unwrap();
        p.blackhole(true);
        c.write_all(b"held").await.unwrap();
        let mut b = [0u8; 4];
        let r = tokio::time::timeout(Duration::from_millis(300), c.read_exact(&mut b)).await;
        assert!(r.is_err(), "bytes crossed a blackhole: {r:?}");
        assert_eq!(seen.load(Ordering::SeqCst), 0, "the server saw held bytes");
        p.blackhole(false);
        tokio::time::timeout(HANG, c.read_exact(&mut b))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(&b, b"held");
    }

    #[tokio::test]
    async fn cut_ends_open_connections_but_accepts_new_ones() {
        let (up, _) = echo().await;
        let p = FaultProxy::start(up).await.unwrap();
        let mut c = TcpStream::connect(p.addr()).await.unwrap();
        roundtrip(&mut c, b"a").await.unwrap();
        p.cut();
        let r = tokio::time::timeout(HANG, roundtrip(&mut c, b"b"))
            .await
            .unwrap();
        assert!(r.is_err(), "a cut connection still answered");
        let mut c2 = TcpStream::connect(p.addr()).await.unwrap();
        assert_eq!(roundtrip(&mut c2, b"c").await.unwrap(), b"c");
    }

    #[tokio::test]
    async fn a_dropped_reply_reached_the_server_but_not_the_client() {
        let (up, seen) = echo().await;
        let p = FaultProxy::start(up).await.unwrap();
        let mut c = TcpStream::connect(p.addr()).await.unwrap();
        roundtrip(&mut c, b"1").await.unwrap();
        p.drop_reply_of(1);
        let r = tokio::time::timeout(HANG, roundtrip(&mut c, b"2"))
            .await
            .unwrap();
        assert!(r.is_err(), "the doomed reply arrived: {r:?}");
        assert_eq!(
            seen.load(Ordering::SeqCst),
            2,
            "the request never reached the server"
        );
        assert_eq!(p.stats().dropped_replies.load(Ordering::SeqCst), 1);
        // Only that one: the next connection is served normally.
        let mut c2 = TcpStream::connect(p.addr()).await.unwrap();
        assert_eq!(roundtrip(&mut c2, b"3").await.unwrap(), b"3");
    }

    #[tokio::test]
    async fn refused_connections_are_reset() {
        let (up, _) = echo().await;
        let p = FaultProxy::start(up).await.unwrap();
        p.refuse(true);
        let r = tokio::time::timeout(HANG, async {
            let mut c = TcpStream::connect(p.addr()).await?;
            roundtrip(&mut c, b"x").await
        })
        .await
        .unwrap();
        assert!(r.is_err());
        p.heal();
        let mut c = TcpStream::connect(p.addr()).await.unwrap();
        assert_eq!(roundtrip(&mut c, b"y").await.unwrap(), b"y");
    }

    #[tokio::test]
    async fn one_way_delay_applies_to_its_direction() {
        let (up, seen) = echo().await;
        let p = FaultProxy::start(up).await.unwrap();
        let mut c = TcpStream::connect(p.addr()).await.unwrap();
        p.one_way_delay(Direction::Down, Duration::from_millis(1_500));
        c.write_all(b"d").await.unwrap();
        // The request goes up at once; the echo waits on the way down.
        let mut b = [0u8; 1];
        let r = tokio::time::timeout(Duration::from_millis(500), c.read_exact(&mut b)).await;
        assert!(r.is_err(), "the delayed reply came early");
        assert_eq!(
            seen.load(Ordering::SeqCst),
            1,
            "the request was delayed too"
        );
        tokio::time::timeout(Duration::from_secs(5), c.read_exact(&mut b))
            .await
            .unwrap()
            .unwrap();
    }
}
