//! Where the shared test servers are, and a reachability check whose failure
//! tells the reader how to start them.
//!
//! Server-backed tests never skip when their server is down: they fail with
//! a message naming `scripts/services.sh`. Addresses default to the local
//! services that script starts and can be overridden with environment
//! variables (`FENCED_TEST_MYSQL_URL`, `FENCED_TEST_REDIS_URL`,
//! `FENCED_TEST_ETCD_URL`, `FENCED_TEST_ZOOKEEPER_URL`,
//! `FENCED_TEST_POSTGRES_URL`).
//!
//! The PostgreSQL probe logs in through sqlx and is behind this crate's
//! `postgres` feature; the others speak the store's protocol over a plain
//! TCP connection.

use std::time::Duration;

pub use fenced_api::url::redact;

use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::TcpStream,
};

/// How long a reachability probe may take before the server counts as down.
pub const PROBE_TIMEOUT: Duration = Duration::from_secs(3);

fn env_or(var: &str, default: &str) -> String {
    std::env::var(var)
        .ok()
        .filter(|v| !v.is_empty())
        .unwrap_or_else(|| default.to_owned())
}

/// The MariaDB/MySQL test URL (`FENCED_TEST_MYSQL_URL`).
pub fn mysql_url() -> String {
    env_or("FENCED_TEST_MYSQL_URL", "mysql://root@127.0.0.1:3306/test")
}

/// The Redis test URL (`FENCED_TEST_REDIS_URL`).
pub fn redis_url() -> String {
    env_or("FENCED_TEST_REDIS_URL", "redis://127.0.0.1:6379")
}

/// The Redis Cluster test URL (`FENCED_TEST_REDIS_CLUSTER_URL`): the
/// cluster `scripts/services.sh` forms on 127.0.0.1:7000-7005.
pub fn redis_cluster_url() -> String {
    env_or(
        "FENCED_TEST_REDIS_CLUSTER_URL",
        "redis+cluster://127.0.0.1:7000,127.0.0.1:7001,127.0.0.1:7002",
    )
}

/// The etcd test endpoint (`FENCED_TEST_ETCD_URL`).
pub fn etcd_url() -> String {
    env_or("FENCED_TEST_ETCD_URL", "http://127.0.0.1:2379")
}

/// The ZooKeeper test URL (`FENCED_TEST_ZOOKEEPER_URL`).
pub fn zookeeper_url() -> String {
    env_or("FENCED_TEST_ZOOKEEPER_URL", "zk://127.0.0.1:2181")
}

/// The PostgreSQL test URL (`FENCED_TEST_POSTGRES_URL`): role `postgres`
/// without a password over TCP, database `fenced_test`.
pub fn postgres_url() -> String {
    env_or(
        "FENCED_TEST_POSTGRES_URL",
        "postgres://postgres@127.0.0.1:5432/fenced_test",
    )
}

/// `host:port` of a URL such as `mysql://user:pw@host:3306/db?x=y`, using
/// `default_port` when the URL has none.
///
/// # Errors
///
/// A message when no host can be found.
pub fn host_port(url: &str, default_port: u16) -> Result<String, String> {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    let authority = rest.split(['/', '?', '#']).next().unwrap_or_default();
    let hostport = authority.rsplit_once('@').map_or(authority, |(_, h)| h);
    if hostport.is_empty() {
        return Err(format!("no host in `{}`", redact(url)));
    }
    let has_port = match hostport.rfind(']') {
        Some(end) => hostport[end..].contains(':'),
        None => hostport.contains(':'),
    };
    Ok(if has_port {
        hostport.to_owned()
    } else {
        format!("{hostport}:{default_port}")
    })
}

/// The message every server-backed test fails with when its server is down.
pub fn unreachable_message(service: &str, url: &str, error: &str) -> String {
    format!(
        "{service} is not reachable at {} ({error}); start the test services with `scripts/services.sh` \
         (or point the FENCED_TEST_* variables at running servers)",
        redact(url)
    )
}

async fn connect(service: &str, url: &str, default_port: u16) -> Result<TcpStream, String> {
    let addr = host_port(url, default_port)?;
    match tokio::time::timeout(PROBE_TIMEOUT, TcpStream::connect(&addr)).await {
        Ok(Ok(stream)) => Ok(stream),
        Ok(Err(e)) => Err(unreachable_message(service, url, &e.to_string())),
        Err(_) => Err(unreachable_message(
            service,
            url,
            &format!("no answer within {PROBE_TIMEOUT:?}"),
        )),
    }
}

async fn exchange(
    service: &str,
    url: &str,
    mut stream: TcpStream,
    request: &[u8],
) -> Result<String, String> {
    let io = async {
        stream.write_all(request).await?;
        let mut buf = vec![0u8; 512];
        let n = stream.read(&mut buf).await?;
        buf.truncate(n);
        Ok::<_, std::io::Error>(buf)
    };
    match tokio::time::timeout(PROBE_TIMEOUT, io).await {
        Ok(Ok(bytes)) => Ok(String::from_utf8_lossy(&bytes).into_owned()),
        Ok(Err(e)) => Err(unreachable_message(service, url, &e.to_string())),
        Err(_) => Err(unreachable_message(service, url, "no reply to the probe")),
    }
}

/// Checks that a MySQL-protocol server answers at `url` with its handshake.
///
/// # Errors
///
/// [`unreachable_message`] when it does not.
pub async fn probe_mysql(url: &str) -> Result<(), String> {
    let mut stream = connect("MariaDB/MySQL", url, 3306).await?;
    let mut header = [0u8; 5];
    match tokio::time::timeout(PROBE_TIMEOUT, stream.read_exact(&mut header)).await {
        // Initial handshake packet: 3-byte length, sequence id 0, protocol version 10.
        Ok(Ok(_)) if header[3] == 0 && header[4] == 10 => Ok(()),
        Ok(Ok(_)) => Err(unreachable_message(
            "MariaDB/MySQL",
            url,
            "the server did not send a protocol-10 handshake",
        )),
        Ok(Err(e)) => Err(unreachable_message("MariaDB/MySQL", url, &e.to_string())),
        Err(_) => Err(unreachable_message("MariaDB/MySQL", url, "no handshake")),
    }
}

/// Checks that Redis answers `PING` at `url`.
///
/// # Errors
///
/// [`unreachable_message`] when it does not.
pub async fn probe_redis(url: &str) -> Result<(), String> {
    let stream = connect("Redis", url, 6379).await?;
    let reply = exchange("Redis", url, stream, b"PING\r\n").await?;
    if reply.starts_with("+PONG") {
        Ok(())
    } else {
        Err(unreachable_message(
            "Redis",
            url,
            &format!("PING answered {reply:?}"),
        ))
    }
}

/// Checks that the first seed node of the cluster at `url`
/// (`redis+cluster://h:p,…`) answers and sees the cluster as ok.
///
/// # Errors
///
/// [`unreachable_message`] when it does not.
pub async fn probe_redis_cluster(url: &str) -> Result<(), String> {
    let first = url.split(',').next().unwrap_or(url);
    let stream = connect("Redis Cluster", first, 6379).await?;
    let reply = exchange("Redis Cluster", url, stream, b"CLUSTER INFO\r\n").await?;
    if reply.contains("cluster_state:ok") {
        Ok(())
    } else {
        Err(unreachable_message(
            "Redis Cluster",
            url,
            &format!("CLUSTER INFO answered {reply:?}"),
        ))
    }
}

/// Checks that etcd reports itself healthy at `url`.
///
/// # Errors
///
/// [`unreachable_message`] when it does not.
pub async fn probe_etcd(url: &str) -> Result<(), String> {
    let stream = connect("etcd", url, 2379).await?;
    let request = b"GET /health HTTP/1.0\r\nHost: localhost\r\n\r\n";
    let reply = exchange("etcd", url, stream, request).await?;
    if reply.contains("\"health\":\"true\"") {
        Ok(())
    } else {
        Err(unreachable_message(
            "etcd",
            url,
            "/health did not report healthy",
        ))
    }
}

/// Checks that ZooKeeper serves requests at `url` (its first host): the
/// `srvr` command, on ZooKeeper's default whitelist, answers with the
/// server's mode.
///
/// # Errors
///
/// [`unreachable_message`] when it does not.
pub async fn probe_zookeeper(url: &str) -> Result<(), String> {
    probe_zookeeper_mode(url).await.map(|_| ())
}

/// The mode ZooKeeper's `srvr` reports at `url` (its first host):
/// `standalone`, `leader` or `follower`.
///
/// # Errors
///
/// [`unreachable_message`] when the server does not serve requests.
pub async fn probe_zookeeper_mode(url: &str) -> Result<String, String> {
    let first = match url.split_once("://") {
        Some((scheme, rest)) => format!("{scheme}://{}", rest.split(',').next().unwrap_or(rest)),
        None => url.to_owned(),
    };
    let stream = connect("ZooKeeper", &first, 2181).await?;
    let reply = exchange("ZooKeeper", &first, stream, b"srvr").await?;
    match reply.lines().find_map(|l| l.strip_prefix("Mode: ")) {
        Some(mode) => Ok(mode.trim().to_owned()),
        None => Err(unreachable_message(
            "ZooKeeper",
            url,
            "srvr did not report a serving mode",
        )),
    }
}

/// Checks that PostgreSQL lets the URL's role log in to the URL's database
/// at `url` and answers `SELECT 1`, within [`PROBE_TIMEOUT`]. A login is
/// the check because a server that is starting up, refuses the role or
/// lacks the database accepts TCP connections all the same.
///
/// # Errors
///
/// [`unreachable_message`] when it does not.
#[cfg(feature = "postgres")]
pub async fn probe_postgres(url: &str) -> Result<(), String> {
    use sqlx::{Connection, PgConnection};

    let check = async {
        let mut conn = PgConnection::connect(url).await?;
        let one: i32 = sqlx::query_scalar("SELECT 1").fetch_one(&mut conn).await?;
        let _ = conn.close().await;
        Ok::<_, sqlx::Error>(one)
    };
    match tokio::time::timeout(PROBE_TIMEOUT, check).await {
        Ok(Ok(1)) => Ok(()),
        Ok(Ok(other)) => Err(unreachable_message(
            "PostgreSQL",
            url,
            &format!("SELECT 1 answered {other}"),
        )),
        Ok(Err(e)) => Err(unreachable_message("PostgreSQL", url, &e.to_string())),
        Err(_) => Err(unreachable_message(
            "PostgreSQL",
            url,
            &format!("no answer within {PROBE_TIMEOUT:?}"),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_port_table() {
        let cases = [
            ("mysql://root@127.0.0.1:3306/test", 3306, "127.0.0.1:3306"),
            (
                "mysql://u:p%40ss@db.example:3307/x?strategy=row_lock",
                3306,
                "db.example:3307",
            ),
            ("redis://127.0.0.1", 6379, "127.0.0.1:6379"),
            ("redis://:secret@[::1]:6380/0", 6379, "[::1]:6380"),
            ("rediss://[::1]/0", 6379, "[::1]:6379"),
            ("http://127.0.0.1:2379", 2379, "127.0.0.1:2379"),
            ("localhost", 1, "localhost:1"),
        ];
        for (url, port, want) in cases {
            assert_eq!(host_port(url, port).unwrap(), want, "{url}");
        }
        assert!(host_port("mysql:///db", 3306).is_err());
    }

    #[tokio::test]
    async fn a_closed_zookeeper_port_names_the_services_script() {
        let e = probe_zookeeper("zk://app:hunter2@127.0.0.1:1,127.0.0.1:2/fenced")
            .await
            .unwrap_err();
        assert!(
            e.contains("scripts/services.sh") && !e.contains("hunter2"),
            "{e}"
        );
        assert!(e.contains("ZooKeeper"), "{e}");
    }

    #[cfg(feature = "postgres")]
    #[tokio::test]
    async fn a_closed_postgres_port_names_the_services_script() {
        let e = probe_postgres("postgres://app:hunter2@127.0.0.1:1/fenced_test")
            .await
            .unwrap_err();
        assert!(
            e.contains("scripts/services.sh") && e.contains("PostgreSQL") && !e.contains("hunter2"),
            "{e}"
        );
    }

    #[test]
    fn passwords_never_appear() {
        assert_eq!(
            redact("mysql://root:hunter2@h:1/db"),
            "mysql://root:***@h:1/db"
        );
        assert_eq!(redact("redis://:hunter2@h"), "redis://:***@h");
        assert_eq!(redact("mysql://root@h/db"), "mysql://root@h/db");
        let msg = unreachable_message("x", "mysql://a:hunter2@h/db", "refused");
        assert!(
            !msg.contains("hunter2") && msg.contains("scripts/services.sh"),
            "{msg}"
        );
    }
}
