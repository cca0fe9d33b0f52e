//! The transport: one etcd client (one gRPC channel to the endpoints) and
//! the bounded request every call to etcd goes through.

use std::{future::Future, time::Duration};

use etcd_client::{Client, ConnectOptions, Txn, TxnOpResponse, TxnResponse};
use fenced_api::{Error, Result};
use tokio::time::Instant;

use crate::{
    config::EtcdConfig,
    error::{self, bounded},
};

/// Pause before sending again a request that never left (see [`error::never_sent`]).
const RESEND_PAUSE: Duration = Duration::from_millis(50);

/// A connected etcd client and the bound on each of its requests. Cheap to
/// clone: clones share the channel.
#[derive(Clone)]
pub(crate) struct Etcd {
    client: Client,
    timeout: Duration,
}

impl Etcd {
    /// Connects to the endpoints of `config` and checks that a member
    /// answers (`Status`).
    ///
    /// One member down must not fail the connect: a status request the
    /// channel could not even send (the connection to that member refused,
    /// timed out or unreachable) is
    /// tried again — on another member — until the connect timeout, as every
    /// later request is. When no member ever answers, the last such error
    /// (e.g. connection refused) is what the caller sees, not a bare timeout.
    pub(crate) async fn connect(config: &EtcdConfig) -> Result<Etcd> {
        if config.tls && !cfg!(feature = "tls") {
            return Err(Error::config(
                "etcds:// needs fenced-etcd built with the `tls` cargo feature",
            ));
        }
        let mut opts = ConnectOptions::new()
            .with_connect_timeout(config.connect_timeout)
            .with_timeout(config.operation_timeout);
        #[cfg(feature = "tls")]
        if config.tls {
            opts = opts.with_tls(tls_options(config)?);
        }
        if let Some((user, password)) = &config.user {
            opts = opts.with_user(user.clone(), password.clone());
        }
        let at = config.endpoints.join(",");
        Etcd::open(config, opts)
            .await
            .map_err(|e| e.connecting(&at))
    }

    async fn open(config: &EtcdConfig, opts: ConnectOptions) -> Result<Etcd> {
        let limit = config.connect_timeout;
        let connect = Client::connect(config.endpoints.clone(), Some(opts));
        let client = bounded("connecting", limit, connect)
            .await?
            .map_err(error::map)?;
        let mut refused = None;
        let deadline = Instant::now() + limit;
        let status = bounded(
            "status",
            limit,
            resend_unsent(
                &client,
                "status",
                deadline,
                &mut refused,
                |mut c| async move { c.status().await },
            ),
        )
        .await;
        match status {
            Ok(answer) => answer.map_err(error::map)?,
            Err(silent) => return Err(refused.map_or(silent, error::map)),
        };
        Ok(Etcd {
            client,
            timeout: config.operation_timeout,
        })
    }

    /// The bound on one request (the operation timeout).
    pub(crate) fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Runs one request with the operation timeout. A request that could not
    /// even be sent (the connection to one endpoint of several refused, timed
    /// out or unreachable) is
    /// retried — the channel then tries another member — until the timeout;
    /// anything that may have reached the server is never retried here.
    /// etcd's answer comes back as it is, for the caller to classify.
    pub(crate) async fn request<T, F, Fut>(
        &self,
        what: &str,
        op: F,
    ) -> Result<std::result::Result<T, etcd_client::Error>>
    where
        F: FnMut(Client) -> Fut,
        Fut: Future<Output = std::result::Result<T, etcd_client::Error>>,
    {
        let deadline = Instant::now() + self.timeout;
        let mut refused = None;
        let sent = resend_unsent(&self.client, what, deadline, &mut refused, op);
        bounded(what, self.timeout, sent).await
    }

    /// [`request`](Self::request) with etcd's errors mapped.
    pub(crate) async fn call<T, F, Fut>(&self, what: &str, op: F) -> Result<T>
    where
        F: FnMut(Client) -> Fut,
        Fut: Future<Output = std::result::Result<T, etcd_client::Error>>,
    {
        self.request(what, op).await?.map_err(error::map)
    }

    /// Sends a transaction; `Ok(None)` when etcd refused it because a lease
    /// it puts keys on does not exist (expired or revoked).
    pub(crate) async fn txn(&self, what: &str, txn: Txn) -> Result<Option<TxnResponse>> {
        let sent = self
            .request(what, |mut c| {
                let txn = txn.clone();
                async move { c.txn(txn).await }
            })
            .await?;
        match sent {
            Ok(r) => Ok(Some(r)),
            Err(e) if error::lease_not_found(&e) => Ok(None),
            Err(e) => Err(error::map(e)),
        }
    }

    /// The remaining TTL of lease `id` in whole seconds, as etcd reports it
    /// (-1: etcd does not know the lease; 0 is a live lease with under a
    /// second left).
    pub(crate) async fn lease_ttl(&self, id: i64) -> Result<i64> {
        let r = self
            .call("lease ttl", |mut c| async move {
                c.lease_time_to_live(id, None).await
            })
            .await?;
        Ok(r.ttl())
    }
}

/// Runs `op` until it fails otherwise than before reaching a server, or
/// `deadline` passes; `refused` keeps the last failure that never left.
async fn resend_unsent<T, F, Fut>(
    client: &Client,
    what: &str,
    deadline: Instant,
    refused: &mut Option<etcd_client::Error>,
    mut op: F,
) -> std::result::Result<T, etcd_client::Error>
where
    F: FnMut(Client) -> Fut,
    Fut: Future<Output = std::result::Result<T, etcd_client::Error>>,
{
    loop {
        match op(client.clone()).await {
            Err(e) if error::never_sent(&e) && Instant::now() < deadline => {
                tracing::debug!(what, error = %e, "etcd request not sent; retrying on another member");
                *refused = Some(e);
                tokio::time::sleep(RESEND_PAUSE).await;
            }
            answer => return answer,
        }
    }
}

/// The first key-value any `Get` of a transaction returned.
pub(crate) fn first_kv(resp: &TxnResponse) -> Option<etcd_client::KeyValue> {
    resp.op_responses().into_iter().find_map(|op| match op {
        TxnOpResponse::Get(g) => g.kvs().first().cloned(),
        _ => None,
    })
}

/// The store revision a response was produced at.
pub(crate) fn revision(resp: &TxnResponse) -> i64 {
    resp.header().map_or(0, |h| h.revision())
}

/// Server verification (rustls): only the CA file of the `ca` parameter
/// when given, else the platform's roots (`SSL_CERT_FILE` / `SSL_CERT_DIR`
/// honoured).
#[cfg(feature = "tls")]
fn tls_options(config: &EtcdConfig) -> Result<etcd_client::TlsOptions> {
    let tls = etcd_client::TlsOptions::new();
    match &config.ca {
        Some(path) => {
            let pem = std::fs::read(path).map_err(|e| {
                Error::config(format!(
                    "cannot read the etcd CA file `{}` (url parameter `ca`): {e}",
                    path.display()
                ))
            })?;
            if !String::from_utf8_lossy(&pem).contains("-----BEGIN CERTIFICATE-----") {
                return Err(Error::config(format!(
                    "the etcd CA file `{}` (url parameter `ca`) holds no PEM certificate",
                    path.display()
                )));
            }
            Ok(tls.ca_certificate(etcd_client::Certificate::from_pem(pem)))
        }
        None => Ok(tls.with_native_roots()),
    }
}
