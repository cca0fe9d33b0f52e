//! `zks://` against a private ZooKeeper that serves TLS on its
//! `secureClientPort` and requires client certificates (certificates from a
//! test CA): locks work over TLS, refusals are named and come within the
//! connect timeout, and the certificate files are checked before anything
//! connects.

#![cfg(feature = "tls")]
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::{
    path::Path,
    sync::Arc,
    time::{Duration, Instant},
};

use async_trait::async_trait;
use fenced_api::{DistributedLock, Error, Result};
use fenced_conformance::Harness;
use fenced_testkit::private::{PrivateZooKeeper, TempDir, TestCa, TlsFiles, ZooKeeperOptions};
use fenced_zookeeper::ZkLock;

/// The bound on connecting in these tests; a refusal must come within it.
const CONNECT: Duration = Duration::from_secs(3);

/// A private ZooKeeper serving TLS, and client certificate files: `client`
/// from the server's CA, `stranger` from another CA (whose certificate is
/// `other_ca`).
struct TlsServer {
    zk: PrivateZooKeeper,
    client: TlsFiles,
    stranger: TlsFiles,
    _dir: TempDir,
}

impl TlsServer {
    async fn start() -> TlsServer {
        let dir = TempDir::new().unwrap();
        let ca = TestCa::new("fenced zookeeper test CA").unwrap();
        let other = TestCa::new("another CA").unwrap();
        let server_dir = dir.path().join("server");
        let stranger_dir = dir.path().join("stranger");
        for d in [&server_dir, &stranger_dir] {
            std::fs::create_dir(d).unwrap();
        }
        let server = ca.issue_server(&server_dir).unwrap();
        let client = ca.issue_client(dir.path(), "client").unwrap();
        let stranger = other.issue_client(&stranger_dir, "stranger").unwrap();
        let zk = PrivateZooKeeper::start(ZooKeeperOptions {
            tls: Some(server),
            ..ZooKeeperOptions::default()
        })
        .await
        .expect("a private ZooKeeper serving TLS starts (binaries from scripts/services.sh)");
        TlsServer {
            zk,
            client,
            stranger,
            _dir: dir,
        }
    }

    fn secure(&self) -> String {
        self.zk.secure_hostports().unwrap()
    }

    /// `zks://` to the TLS port with the client's CA and certificate.
    fn url(&self, namespace: &str) -> String {
        format!(
            "zks://{}{namespace}?{}&session_timeout=20s&connect_timeout=3s&timeout=5s",
            self.secure(),
            files(&self.client)
        )
    }
}

/// `ca=…&cert=…&key=…` of `f`.
fn files(f: &TlsFiles) -> String {
    format!(
        "ca={}&cert={}&key={}",
        f.ca.display(),
        f.cert.display(),
        f.key.display()
    )
}

/// Connects to `url`, which must fail within [`CONNECT`] (with room for a
/// slow machine), and returns the error.
async fn refused(url: &str) -> Error {
    let started = Instant::now();
    let outcome = tokio::time::timeout(CONNECT * 3, ZkLock::connect(url)).await;
    let e = match outcome {
        Err(_) => panic!("{url}: still connecting after {:?}", CONNECT * 3),
        Ok(Ok(_)) => panic!("{url}: connected"),
        Ok(Err(e)) => e,
    };
    assert!(
        started.elapsed() < CONNECT + Duration::from_secs(2),
        "{url}: refused only after {:?}: {e}",
        started.elapsed()
    );
    e
}

struct TlsHarness {
    server: Arc<TlsServer>,
    namespace: String,
}

#[async_trait]
impl Harness for TlsHarness {
    async fn client(&self) -> Result<Arc<dyn DistributedLock>> {
        Ok(Arc::new(
            ZkLock::connect(&self.server.url(&self.namespace)).await?,
        ))
    }

    async fn client_in_namespace(&self, suffix: &str) -> Result<Arc<dyn DistributedLock>> {
        let namespace = format!("{}-{suffix}", self.namespace);
        Ok(Arc::new(
            ZkLock::connect(&self.server.url(&namespace)).await?,
        ))
    }

    async fn unreachable_client(&self) -> Option<Result<Arc<dyn DistributedLock>>> {
        let url = format!(
            "zks://127.0.0.1:1/x?{}&connect_timeout=2s&timeout=2s",
            files(&self.server.client)
        );
        Some(
            ZkLock::connect(&url)
                .await
                .map(|l| Arc::new(l) as Arc<dyn DistributedLock>),
        )
    }

    fn connect_timeout(&self) -> Duration {
        Duration::from_secs(2)
    }

    fn base_ttl(&self) -> Duration {
        Duration::from_secs(2)
    }
}

/// The conformance cases of the lock's life over TLS: grant, refusal,
/// release, extend, a waiter woken by a watch, inspect and list, namespaces,
/// and an unreachable `zks://` store failing fast.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn locks_work_over_tls_with_client_certificates() {
    let server = Arc::new(TlsServer::start().await);
    let harness = TlsHarness {
        server: Arc::clone(&server),
        namespace: format!("/{}", fenced_testkit::run_name("fenced-tls-")),
    };
    let mut failures = Vec::new();
    for case in [
        "c01_free_key_grants_token",
        "c02_held_key_refused_at_once",
        "c03_release_frees_key",
        "c06_extend_keeps_lock",
        "c08_waiter_gets_lock_on_release",
        "c17_inspect_shows_holder",
        "c17_list_shows_held_locks",
        "c19_unreachable_store_fails_fast",
        "c20_namespaces_isolate",
    ] {
        if let Err(f) = fenced_conformance::run_case(&harness, case).await {
            failures.push(format!("{case}: {f:?}"));
        }
    }
    assert!(failures.is_empty(), "over TLS: {failures:#?}");
    // The plaintext port of the same server still serves plaintext clients:
    // the TLS sessions above went through the secure port.
    let plain = ZkLock::connect(&server.zk.url("/plain")).await.unwrap();
    assert!(plain.negotiated_session_timeout().is_some());
}

/// Each refusal says what to fix, within the connect timeout, and is not
/// retryable (the same certificates meet the same refusal).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusals_are_named_and_quick() {
    let server = TlsServer::start().await;
    let secure = server.secure();
    let client = &server.client;
    let stranger = &server.stranger;
    let cases: [(String, &[&str]); 3] = [
        // The server's certificate checked against another CA.
        (
            format!(
                "zks://{secure}/t?ca={}&cert={}&key={}&connect_timeout=3s",
                stranger.ca.display(),
                client.cert.display(),
                client.key.display()
            ),
            &[
                "not signed by a CA of",
                &*stranger.ca.display().to_string(),
                "UnknownIssuer",
            ],
        ),
        // No client certificate for a server that requires one.
        (
            format!(
                "zks://{secure}/t?ca={}&connect_timeout=3s",
                client.ca.display()
            ),
            &["requires a client certificate", "cert=<path>&key=<path>"],
        ),
        // A client certificate from a CA the server does not trust.
        (
            format!(
                "zks://{secure}/t?ca={}&cert={}&key={}&connect_timeout=3s",
                client.ca.display(),
                stranger.cert.display(),
                stranger.key.display()
            ),
            &["refused this client's certificate"],
        ),
    ];
    for (url, says) in cases {
        let e = refused(&url).await;
        let text = e.to_string();
        assert!(
            matches!(e, Error::Backend { .. }) && !e.is_retryable(),
            "{url}: {e:?}"
        );
        for s in says {
            assert!(text.contains(s), "{url}: `{s}` not in: {text}");
        }
        assert!(text.contains(&secure), "{url}: names the server: {text}");
    }
    // TLS to the plaintext port and plaintext to the TLS port: refused
    // within the bound too.
    let plain_port = server.zk.members()[0].hostport();
    let e = refused(&format!(
        "zks://{plain_port}/t?{}&connect_timeout=3s",
        files(client)
    ))
    .await;
    assert!(
        e.to_string()
            .contains(&format!("is {plain_port} the server's TLS port")),
        "{e}"
    );
    refused(&format!("zk://{secure}/t?connect_timeout=3s")).await;
}

/// The files are read and checked before anything is sent: each problem is
/// a `Config` error naming the file and the parameter, and no message
/// quotes a key. Port 1 has no server: only a check that passes reaches it.
#[tokio::test]
async fn certificate_files_are_checked_before_connecting() {
    let dir = TempDir::new().unwrap();
    let ca = TestCa::new("checks").unwrap();
    let good = ca.issue_client(dir.path(), "good").unwrap();
    let other = ca.issue_client(dir.path(), "other").unwrap();
    let write = |name: &str, text: &str| {
        let p = dir.path().join(name);
        std::fs::write(&p, text).unwrap();
        p
    };
    let not_pem = write("not.pem", "just text\n");
    let secret_key = write(
        "secret.key",
        "-----BEGIN PRIVATE KEY-----\nc2VjcmV0LWtleS1tYXRlcmlhbA==\n-----END PRIVATE KEY-----\n",
    );
    let missing = dir.path().join("missing.pem");
    let url = |ca: &Path, cert: &Path, key: &Path| {
        format!(
            "zks://127.0.0.1:1/t?ca={}&cert={}&key={}&connect_timeout=2s",
            ca.display(),
            cert.display(),
            key.display()
        )
    };
    for (url, says) in [
        (
            url(&missing, &good.cert, &good.key),
            "cannot read the ZooKeeper CA file",
        ),
        (
            url(&not_pem, &good.cert, &good.key),
            "holds no PEM certificate",
        ),
        (
            url(&good.ca, &missing, &good.key),
            "cannot read the ZooKeeper client certificate file",
        ),
        (
            url(&good.ca, &good.key, &good.key),
            "holds no PEM certificate",
        ),
        (
            url(&good.ca, &good.cert, &missing),
            "cannot read the ZooKeeper client key file",
        ),
        (
            url(&good.ca, &good.cert, &not_pem),
            "holds no PEM private key",
        ),
        (
            url(&good.ca, &good.cert, &secret_key),
            "cannot be used with the certificate",
        ),
        (
            url(&good.ca, &good.cert, &other.key),
            "cannot be used with the certificate",
        ),
        (
            format!(
                "zks://bad_host!:1/t?ca={}&connect_timeout=2s",
                good.ca.display()
            ),
            "cannot be checked against a TLS certificate",
        ),
    ] {
        match ZkLock::connect(&url).await {
            Err(e @ Error::Config { .. }) => {
                let text = e.to_string();
                assert!(text.contains(says), "{url}: {text}");
                assert!(!text.contains("c2VjcmV0"), "{url}: a key quoted: {text}");
            }
            Err(e) => panic!("{url}: not a configuration error: {e:?}"),
            Ok(_) => panic!("{url}: connected"),
        }
    }
    // Good files pass the checks and meet the closed port: an unreachable
    // server, retryable, the TLS settings built without a panic although
    // both ring and aws-lc-rs are compiled in.
    let e = refused(&url(&good.ca, &good.cert, &good.key)).await;
    assert!(
        matches!(e, Error::Backend { .. }) && e.is_retryable(),
        "{e:?}"
    );
    assert!(e.to_string().contains("127.0.0.1:1"), "{e}");
}
