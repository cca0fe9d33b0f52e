//! The TLS files a private server is started with.

use std::path::PathBuf;

/// PEM files for a server: the CA that signed it, its certificate and key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsFiles {
    /// The CA certificate (what clients trust).
    pub ca: PathBuf,
    /// The server certificate, signed by `ca`.
    pub cert: PathBuf,
    /// The server's private key (PKCS#8 PEM).
    pub key: PathBuf,
}

/// rustls needs one process-wide crypto provider; ring is the one every
/// TLS stack in this workspace is built with. Without the `tls` feature no
/// TLS connection is made and there is nothing to install.
#[cfg(any(feature = "redis", all(feature = "etcd", feature = "tls")))]
pub(crate) fn install_crypto_provider() {
    #[cfg(feature = "tls")]
    let _ = rustls::crypto::ring::default_provider().install_default();
}
