//! TLS (`zks://`): the certificates of a session's connections, read from
//! the URL's PEM files when the session opens (before anything is sent),
//! and what a refused handshake was about.
//!
//! zookeeper-client builds its rustls settings with
//! `ClientConfig::builder()`, which needs a process-wide crypto provider
//! whenever more than one is compiled in — and here there always are two:
//! zookeeper-client's rustls brings aws-lc-rs, this crate (as the other
//! backends) ring. So ring is installed as that default before a TLS
//! session is built, unless the application installed one (as the Redis
//! backend does).
//!
//! The client reports a handshake that failed on every server as "no
//! available hosts", which reads as an unreachable ensemble. When a TLS
//! connect fails, [`explain`] does one handshake of its own with the same
//! certificates and, if the server refused it or was refused, returns that
//! (not retryable: a retry meets the same certificates).

use fenced_api::{Error, Result};
use tokio::time::Instant;
use zookeeper_client::{Client, Connector, Error as ZkError};

use crate::config::ZkConfig;

#[cfg(not(feature = "tls"))]
mod imp {
    use super::*;

    /// Uninhabited: a build without the `tls` feature has no TLS session.
    #[derive(Debug)]
    pub(crate) enum Tls {}

    impl Tls {
        pub(crate) fn load(config: &ZkConfig) -> Result<Option<Tls>> {
            if config.tls {
                return Err(Error::config(
                    "zks:// needs fenced-zookeeper built with the `tls` cargo feature",
                ));
            }
            Ok(None)
        }

        pub(super) async fn connect(
            &self,
            _: Connector,
            _: &str,
        ) -> std::result::Result<Client, ZkError> {
            match *self {}
        }

        pub(super) async fn diagnose(&self, _: &[String], _: Instant) -> Option<Error> {
            match *self {}
        }
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn zks_needs_the_tls_feature() {
            let c = ZkConfig::from_url("zks://h/p?ca=/ca.pem").unwrap_or_else(|e| panic!("{e}"));
            match Tls::load(&c) {
                Err(e @ Error::Config { .. }) => {
                    assert!(e.to_string().contains("`tls` cargo feature"), "{e}")
                }
                other => panic!("{other:?}"),
            }
            let plain = ZkConfig::from_url("zk://h/p").unwrap_or_else(|e| panic!("{e}"));
            assert!(matches!(Tls::load(&plain), Ok(None)));
        }
    }
}

#[cfg(feature = "tls")]
mod imp {
    use std::{fmt, path::Path, sync::Arc, time::Duration};

    use rustls::{
        client::WantsClientCert,
        crypto::CryptoProvider,
        pki_types::{pem::PemObject, CertificateDer, PrivateKeyDer, ServerName},
        AlertDescription, CertificateError, ClientConfig, ConfigBuilder, RootCertStore,
    };
    use tokio::io::AsyncReadExt;
    use zookeeper_client::TlsOptions;

    use super::*;
    use crate::error::BACKEND;

    /// How long a finished handshake is watched for the server's refusal
    /// (TLS 1.3 servers refuse a client certificate after the client
    /// finished): one round trip, with room for a slow one.
    const REFUSAL_WAIT: Duration = Duration::from_secs(1);

    /// The certificates of one session: zookeeper-client's options and the
    /// same settings as a rustls client, for [`explain`](super::explain).
    pub(crate) struct Tls {
        options: TlsOptions,
        rustls: Arc<ClientConfig>,
        /// Whether a client certificate is sent (for the refusal's hint).
        identity: bool,
        /// The `ca` file, for messages.
        ca: String,
    }

    impl fmt::Debug for Tls {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.debug_struct("Tls")
                .field("ca", &self.ca)
                .field("identity", &self.identity)
                .finish_non_exhaustive()
        }
    }

    impl Tls {
        /// Reads and checks the files of a `zks://` config (nothing for a
        /// plaintext one), and installs the process's crypto provider.
        ///
        /// # Errors
        ///
        /// [`Error::Config`] naming the file and the parameter: unreadable,
        /// no PEM certificate or key in it, a key that does not belong to
        /// the certificate, a host no certificate can name.
        pub(crate) fn load(config: &ZkConfig) -> Result<Option<Tls>> {
            if !config.tls {
                return Ok(None);
            }
            let ca_path = config.ca.as_deref().ok_or_else(|| {
                Error::config("zks:// needs `ca=<path>`: a PEM file with the CA that signed the ZooKeeper servers' certificates")
            })?;
            for host in &config.hosts {
                server_name(host)?;
            }
            let _ = rustls::crypto::ring::default_provider().install_default();
            let provider = CryptoProvider::get_default()
                .cloned()
                .unwrap_or_else(|| Arc::new(rustls::crypto::ring::default_provider()));

            let ca_pem = read(ca_path, "ca", "CA")?;
            let certs = certificates(&ca_pem, ca_path, "ca", "CA")?;
            let mut roots = RootCertStore::empty();
            let (added, _) = roots.add_parsable_certificates(certs);
            if added == 0 {
                return Err(Error::config(format!(
                    "the ZooKeeper CA file `{}` (url parameter `ca`) holds no usable CA certificate",
                    ca_path.display()
                )));
            }
            let mut options = TlsOptions::new().with_pem_ca(&ca_pem).map_err(|e| {
                Error::config(format!(
                    "the ZooKeeper CA file `{}` (url parameter `ca`): {e}",
                    ca_path.display()
                ))
            })?;
            let builder: ConfigBuilder<ClientConfig, WantsClientCert> =
                ClientConfig::builder_with_provider(provider)
                    .with_safe_default_protocol_versions()
                    .map_err(|e| Error::config(format!("no TLS version for ZooKeeper: {e}")))?
                    .with_root_certificates(roots);
            let rustls = match &config.identity {
                None => builder.with_no_client_auth(),
                Some((cert_path, key_path)) => {
                    let cert_pem = read(cert_path, "cert", "client certificate")?;
                    let chain = certificates(&cert_pem, cert_path, "cert", "client certificate")?;
                    let key_pem = read(key_path, "key", "client key")?;
                    // The parser's message is not shown: it may quote the file.
                    let no_key = || {
                        Error::config(format!(
                            "the ZooKeeper client key file `{}` (url parameter `key`) holds no PEM private key (PKCS#8, PKCS#1 or SEC1)",
                            key_path.display()
                        ))
                    };
                    let key =
                        PrivateKeyDer::from_pem_slice(key_pem.as_bytes()).map_err(|_| no_key())?;
                    options = options
                        .with_pem_identity(&cert_pem, &key_pem)
                        .map_err(|_| no_key())?;
                    builder.with_client_auth_cert(chain, key).map_err(|e| {
                        Error::config(format!(
                            "the ZooKeeper client key `{}` cannot be used with the certificate `{}` (url parameters `key`, `cert`): {e}",
                            key_path.display(),
                            cert_path.display()
                        ))
                    })?
                }
            };
            Ok(Some(Tls {
                options,
                rustls: Arc::new(rustls),
                identity: config.identity.is_some(),
                ca: ca_path.display().to_string(),
            }))
        }

        /// Connects over TLS to every host of `at`.
        pub(super) async fn connect(
            &self,
            connector: Connector,
            at: &str,
        ) -> std::result::Result<Client, ZkError> {
            connector
                .with_tls(self.options.clone())
                .secure_connect(at)
                .await
        }

        /// One handshake per host until one tells: the refusal of the
        /// first host that refused, `None` when a host completed it (the
        /// failure was not TLS) or none could be reached by `deadline`.
        pub(super) async fn diagnose(&self, hosts: &[String], deadline: Instant) -> Option<Error> {
            for host in hosts {
                match tokio::time::timeout_at(deadline, self.handshake(host)).await {
                    Ok(Handshake::Refused(e)) => return Some(e),
                    Ok(Handshake::Fine) => return None,
                    Ok(Handshake::Unreachable) => continue,
                    Err(_) => return None,
                }
            }
            None
        }

        async fn handshake(&self, host: &str) -> Handshake {
            let Ok(name) = server_name(host) else {
                return Handshake::Unreachable;
            };
            let Ok(tcp) = tokio::net::TcpStream::connect(host).await else {
                return Handshake::Unreachable;
            };
            let connector = tokio_rustls::TlsConnector::from(Arc::clone(&self.rustls));
            let mut stream = match connector.connect(name, tcp).await {
                Ok(s) => s,
                Err(e) => return Handshake::Refused(self.refused(host, &e)),
            };
            // A server that took the handshake waits for a request and
            // sends nothing; one that refused our certificate after it
            // says so now (or just closes).
            let mut byte = [0u8; 1];
            match tokio::time::timeout(REFUSAL_WAIT, stream.read(&mut byte)).await {
                Err(_) | Ok(Ok(1..)) => Handshake::Fine,
                Ok(Ok(0)) => Handshake::Refused(Error::backend(
                    BACKEND,
                    false,
                    format!(
                        "ZooKeeper at {host} closed the TLS connection right after the handshake: {}",
                        self.certificate_hint()
                    ),
                )),
                Ok(Err(e)) => Handshake::Refused(self.refused(host, &e)),
            }
        }

        /// The error of a refused handshake, with what to check.
        fn refused(&self, host: &str, e: &std::io::Error) -> Error {
            let tls = e
                .get_ref()
                .and_then(|inner| inner.downcast_ref::<rustls::Error>());
            let hint = match tls {
                Some(rustls::Error::InvalidCertificate(c)) => match c {
                    CertificateError::UnknownIssuer | CertificateError::BadSignature => format!(
                        "the server's certificate is not signed by a CA of `{}` (url parameter `ca`)",
                        self.ca
                    ),
                    CertificateError::NotValidForName
                    | CertificateError::NotValidForNameContext { .. } => format!(
                        "the server's certificate does not name `{}`: write the host as its certificate names it",
                        host_part(host)
                    ),
                    _ => "the server's certificate was refused".to_owned(),
                },
                Some(rustls::Error::AlertReceived(
                    AlertDescription::CertificateRequired
                    | AlertDescription::HandshakeFailure
                    | AlertDescription::BadCertificate
                    | AlertDescription::UnknownCA
                    | AlertDescription::CertificateUnknown
                    | AlertDescription::AccessDenied,
                )) => self.certificate_hint(),
                Some(_) => "the TLS handshake failed".to_owned(),
                // No TLS message, the connection just ended: what a
                // plaintext port does with a TLS handshake.
                None => format!("is {host} the server's TLS port (its secureClientPort)?"),
            };
            let cause = e.to_string().replace(['\n', '\r'], " ");
            Error::backend(
                BACKEND,
                false,
                format!("TLS with ZooKeeper at {host} failed ({cause}): {hint}"),
            )
        }

        fn certificate_hint(&self) -> String {
            if self.identity {
                "the server refused this client's certificate (url parameters `cert`, `key`): is it signed by a CA the server trusts?".to_owned()
            } else {
                "the server requires a client certificate: add `cert=<path>&key=<path>` to the url"
                    .to_owned()
            }
        }
    }

    enum Handshake {
        Fine,
        Refused(Error),
        Unreachable,
    }

    /// The contents of the file of url parameter `param`.
    fn read(path: &Path, param: &str, what: &str) -> Result<String> {
        std::fs::read_to_string(path).map_err(|e| {
            Error::config(format!(
                "cannot read the ZooKeeper {what} file `{}` (url parameter `{param}`): {e}",
                path.display()
            ))
        })
    }

    /// The PEM certificates of `pem`; at least one.
    fn certificates(
        pem: &str,
        path: &Path,
        param: &str,
        what: &str,
    ) -> Result<Vec<CertificateDer<'static>>> {
        let certs = CertificateDer::pem_slice_iter(pem.as_bytes())
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(|e| {
                Error::config(format!(
                    "the ZooKeeper {what} file `{}` (url parameter `{param}`) is not valid PEM: {e}",
                    path.display()
                ))
            })?;
        if certs.is_empty() {
            return Err(Error::config(format!(
                "the ZooKeeper {what} file `{}` (url parameter `{param}`) holds no PEM certificate",
                path.display()
            )));
        }
        Ok(certs)
    }

    /// The name a server's certificate must carry: the host of `host:port`
    /// (an IPv6 address without its brackets).
    fn server_name(hostport: &str) -> Result<ServerName<'static>> {
        let host = host_part(hostport);
        ServerName::try_from(host.to_owned()).map_err(|e| {
            Error::config(format!(
                "the ZooKeeper host `{host}` cannot be checked against a TLS certificate: {e}"
            ))
        })
    }

    fn host_part(hostport: &str) -> &str {
        let host = hostport.rsplit_once(':').map_or(hostport, |(h, _)| h);
        host.strip_prefix('[')
            .and_then(|h| h.strip_suffix(']'))
            .unwrap_or(host)
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn server_names_from_host_lists() {
            assert_eq!(host_part("127.0.0.1:2181"), "127.0.0.1");
            assert_eq!(host_part("[::1]:2281"), "::1");
            assert_eq!(host_part("zk-1.example:2281"), "zk-1.example");
            for ok in [
                "127.0.0.1:1",
                "[::1]:2181",
                "zk-1.example:2281",
                "localhost:2",
            ] {
                assert!(server_name(ok).is_ok(), "{ok}");
            }
            for bad in ["bad host:2181", "a..b:1", "-x!:1"] {
                assert!(
                    matches!(server_name(bad), Err(Error::Config { .. })),
                    "{bad}"
                );
            }
        }
    }
}

pub(crate) use imp::Tls;

/// Connects `connector` to `at`: over TLS when `tls` says so.
pub(crate) async fn connect(
    tls: Option<&Tls>,
    connector: Connector,
    at: &str,
) -> std::result::Result<Client, ZkError> {
    match tls {
        Some(tls) => tls.connect(connector, at).await,
        None => connector.connect(at).await,
    }
}

/// `failed`, or — for a retryable failure of a TLS connect — the refusal a
/// handshake of our own meets on `hosts` before `deadline`.
pub(crate) async fn explain(
    tls: Option<&Tls>,
    hosts: &[String],
    deadline: Instant,
    failed: Error,
) -> Error {
    match tls {
        Some(tls) if failed.is_retryable() && Instant::now() < deadline => {
            tls.diagnose(hosts, deadline).await.unwrap_or(failed)
        }
        _ => failed,
    }
}
