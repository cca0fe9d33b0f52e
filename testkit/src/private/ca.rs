//! A throw-away certificate authority for TLS tests.

use std::path::{Path, PathBuf};

use fenced_api::Result;
use rcgen::{
    date_time_ymd, BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose,
};

use super::{fail, TlsFiles};

/// A self-signed CA generated at run time: its certificate is what a client
/// trusts, and it signs server certificates for `127.0.0.1` / `localhost`.
pub struct TestCa {
    name: String,
    cert_pem: String,
    issuer: Issuer<'static, KeyPair>,
}

impl std::fmt::Debug for TestCa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TestCa")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

impl TestCa {
    /// A new CA whose subject common name is `name`.
    ///
    /// # Errors
    ///
    /// When key generation or signing fails.
    pub fn new(name: &str) -> Result<Self> {
        let mut params = CertificateParams::new(Vec::<String>::new()).map_err(tls_err)?;
        params.distinguished_name.push(DnType::CommonName, name);
        params
            .distinguished_name
            .push(DnType::OrganizationName, "fenced tests");
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        params.not_before = date_time_ymd(2020, 1, 1);
        params.not_after = date_time_ymd(2099, 12, 31);
        let key = KeyPair::generate().map_err(tls_err)?;
        let cert = params.self_signed(&key).map_err(tls_err)?;
        Ok(TestCa {
            name: name.to_owned(),
            cert_pem: cert.pem(),
            issuer: Issuer::new(params, key),
        })
    }

    /// The CA certificate, PEM.
    pub fn cert_pem(&self) -> &str {
        &self.cert_pem
    }

    /// Writes the CA certificate alone to `dir/<file>`.
    ///
    /// # Errors
    ///
    /// When the file cannot be written.
    pub fn write_ca(&self, dir: &Path, file: &str) -> Result<PathBuf> {
        let path = dir.join(file);
        std::fs::write(&path, &self.cert_pem)
            .map_err(|e| fail(format!("writing {}: {e}", path.display())))?;
        Ok(path)
    }

    /// Issues a server certificate for `127.0.0.1`, `::1` and `localhost`
    /// and writes `ca.pem`, `server.pem` and `server.key` into `dir`.
    ///
    /// # Errors
    ///
    /// When signing or writing fails.
    pub fn issue_server(&self, dir: &Path) -> Result<TlsFiles> {
        let sans: Vec<String> = vec!["127.0.0.1".into(), "::1".into(), "localhost".into()];
        let mut params = CertificateParams::new(sans).map_err(tls_err)?;
        params
            .distinguished_name
            .push(DnType::CommonName, "127.0.0.1");
        params.use_authority_key_identifier_extension = true;
        params.key_usages = vec![
            KeyUsagePurpose::DigitalSignature,
            KeyUsagePurpose::KeyEncipherment,
        ];
        // etcd also uses its serving certificate as a client one towards
        // its own gateway; both purposes keep every server happy.
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        self.sign(params, dir, "server")
    }

    /// Issues a client certificate with common name `name` (client
    /// authentication only) and writes `ca.pem`, `<name>.pem` and
    /// `<name>.key` into `dir`.
    ///
    /// # Errors
    ///
    /// When signing or writing fails.
    pub fn issue_client(&self, dir: &Path, name: &str) -> Result<TlsFiles> {
        let mut params = CertificateParams::new(Vec::<String>::new()).map_err(tls_err)?;
        params.distinguished_name.push(DnType::CommonName, name);
        params.use_authority_key_identifier_extension = true;
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        self.sign(params, dir, name)
    }

    /// Signs `params` (valid 2020–2099) with a fresh key and writes
    /// `ca.pem`, `<name>.pem` and `<name>.key` into `dir`.
    fn sign(&self, mut params: CertificateParams, dir: &Path, name: &str) -> Result<TlsFiles> {
        params.not_before = date_time_ymd(2020, 1, 1);
        params.not_after = date_time_ymd(2099, 12, 31);
        let key = KeyPair::generate().map_err(tls_err)?;
        let cert = params.signed_by(&key, &self.issuer).map_err(tls_err)?;
        let files = TlsFiles {
            ca: dir.join("ca.pem"),
            cert: dir.join(format!("{name}.pem")),
            key: dir.join(format!("{name}.key")),
        };
        self.write(&files, &cert.pem(), &key.serialize_pem())?;
        Ok(files)
    }

    /// Writes the CA certificate, `cert` and `key` where `files` says.
    fn write(&self, files: &TlsFiles, cert: &str, key: &str) -> Result<()> {
        for (path, pem) in [
            (&files.ca, &*self.cert_pem),
            (&files.cert, cert),
            (&files.key, key),
        ] {
            std::fs::write(path, pem)
                .map_err(|e| fail(format!("writing {}: {e}", path.display())))?;
        }
        Ok(())
    }
}

fn tls_err(e: rcgen::Error) -> fenced_api::Error {
    fail(format!("generating a test certificate: {e}"))
}
