//! `etcds://` through the facade with its `etcd` feature alone (no other
//! crate of the workspace switching on `fenced-etcd/tls` by feature
//! unification): the URL must reach the etcd driver's TLS connect, not stop
//! at "needs the `tls` cargo feature".

#![cfg(feature = "etcd")]

use fenced::Error;

#[tokio::test]
async fn etcds_urls_need_only_the_etcd_feature() {
    // Nothing listens on port 1: the connect fails as an unreachable store
    // (retryable `Backend`), never as a build without TLS (`Config`).
    let e = match fenced::connect("etcds://127.0.0.1:1/facade?connect_timeout=1s&timeout=1s").await
    {
        Ok(_) => panic!("connected to a port nobody listens on"),
        Err(e) => e,
    };
    assert!(
        matches!(e, Error::Backend { .. }) && e.is_retryable(),
        "etcds:// with the facade's etcd feature: {e}"
    );
}
