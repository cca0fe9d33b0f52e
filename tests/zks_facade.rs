//! `zks://` through the facade with its `zookeeper` feature alone: the URL
//! must reach the ZooKeeper driver's TLS connect (not stop at "needs the
//! `tls` cargo feature"), and building the TLS settings must not panic in a
//! build where rustls has two crypto providers (ring from the other
//! backends, aws-lc-rs from zookeeper-client) and nobody installed one.

#![cfg(feature = "zookeeper")]

use fenced::Error;

/// A CA certificate whose key was thrown away: something valid to trust.
const CA: &str = "-----BEGIN CERTIFICATE-----
MIIBtjCCAV2gAwIBAgIUOsh9x2EjgOipkU3CApHycLhO8YswCgYIKoZIzj0EAwIw
MDEuMCwGA1UEAwwlZmVuY2VkIGZhY2FkZSB0ZXN0IENBIChrZXkgZGlzY2FyZGVk
KTAgFw0yNjEyMDIwMjMzNTNaGA8yMTI2MTEwODAyMzM1M1owMDEuMCwGA1UEAwwl
ZmVuY2VkIGZhY2FkZSB0ZXN0IENBIChrZXkgZGlzY2FyZGVkKTBZMBMGByqGSM49
AgEGCCqGSM49AwEHA0IABEhfh2xXWCEWdLpM+zFTeSC3pBbZHzX+cgz1msX0OoxI
TXIhmomj+T4uXvaPTaSKpejvnQen8h76PJ39COUsJH2jUzBRMB0GA1UdDgQWBBQS
J3/p2/u167JMSoZw6P8LRy/uRDAfBgNVHSMEGDAWgBQSJ3/p2/u167JMSoZw6P8L
Ry/uRDAPBgNVHRMBAf8EBTADAQH/MAoGCCqGSM49BAMCA0cAMEQCIEf8uHyEJOyK
nluG5njfSIvXDgAVoZiCVdfsLD1d/UNQAiA8TdKisFpvvYMH28mnFP6zPtNm9rm4
4B+YHZpqmvMYfg==
-----END CERTIFICATE-----
";

#[tokio::test]
async fn zks_urls_need_only_the_zookeeper_feature() {
    let ca = std::env::temp_dir().join(format!("fenced-zks-facade-{}.pem", std::process::id()));
    std::fs::write(&ca, CA).unwrap();
    // Nothing listens on port 1: the connect fails as an unreachable store
    // (retryable `Backend`), never as a build without TLS (`Config`).
    let url = format!(
        "zks://127.0.0.1:1/facade?ca={}&connect_timeout=1s&timeout=1s",
        ca.display()
    );
    let outcome = fenced::connect(&url).await;
    std::fs::remove_file(&ca).unwrap();
    let e = match outcome {
        Ok(_) => panic!("connected to a port nobody listens on"),
        Err(e) => e,
    };
    assert!(
        matches!(e, Error::Backend { .. }) && e.is_retryable(),
        "zks:// with the facade's zookeeper feature: {e}"
    );
}
