//! One worker's connection, and the streams it returns.

use std::time::Duration;

use lorafleet_proto::worker::v1 as pb;
use tonic::transport::{Channel, Endpoint};

use super::{Report, UpstreamError, WorkerEvent, convert};

/// How the gateway reaches workers.
#[derive(Debug, Clone)]
pub enum Transport {
    /// `--insecure-plaintext`.
    Plaintext,
    /// Mutual TLS: the gateway's certificate, the fleet's CA, and the name
    /// every worker's certificate must carry (None: each worker's own host,
    /// as its address names it).
    MutualTls {
        config: lorafleet_tls::Reloading<lorafleet_tls::rustls::ClientConfig>,
        server_name: Option<String>,
    },
}

/// One worker's connection, made when first used and re-made after a
/// failure; cheap to clone.
#[derive(Debug, Clone)]
pub struct WorkerClient(pb::worker_client::WorkerClient<Channel>);

/// Why a worker's address cannot be called.
#[derive(Debug, thiserror::Error)]
pub enum AddressError {
    /// Not a usable HOST:PORT.
    #[error("{0}")]
    Uri(#[source] tonic::transport::Error),
    /// Its TLS name is neither a DNS name nor an IP address.
    #[error(transparent)]
    TlsName(#[from] lorafleet_tls::TlsError),
}

impl WorkerClient {
    /// A client for the worker at `addr` (HOST:PORT). The error says why
    /// the address or its TLS name is unusable.
    pub fn connect_lazy(addr: &str, transport: &Transport) -> Result<WorkerClient, AddressError> {
        let endpoint = Endpoint::from_shared(format!("http://{addr}"))
            .map_err(AddressError::Uri)?
            .connect_timeout(Duration::from_secs(2))
            .http2_keep_alive_interval(Duration::from_secs(10))
            .keep_alive_timeout(Duration::from_secs(5))
            .tcp_nodelay(true);
        let channel = match transport {
            Transport::Plaintext => endpoint.connect_lazy(),
            Transport::MutualTls {
                config,
                server_name,
            } => {
                let name = server_name.clone().unwrap_or_else(|| host_of(addr));
                let connector = lorafleet_tls::client::Connector::new(config.clone(), &name)?;
                endpoint.connect_with_connector_lazy(connector)
            }
        };
        Ok(WorkerClient(pb::worker_client::WorkerClient::new(channel)))
    }

    /// Starts a generation; its events follow on the stream.
    pub async fn generate(&self, g: &super::Generation) -> Result<Events, UpstreamError> {
        let mut client = self.0.clone();
        let stream = client
            .generate(pb::GenerateRequest::from(g))
            .await
            .map_err(|s| convert::status(&s))?
            .into_inner();
        Ok(Events(stream))
    }

    /// Opens the worker's Watch stream.
    pub async fn watch(&self, subscriber: String) -> Result<Reports, UpstreamError> {
        let mut client = self.0.clone();
        let stream = client
            .watch(pb::WatchRequest { subscriber })
            .await
            .map_err(|s| convert::status(&s))?
            .into_inner();
        Ok(Reports(stream))
    }
}

/// A generation's events; dropping it cancels the generation on the worker.
#[derive(Debug)]
pub struct Events(tonic::Streaming<pb::GenerateEvent>);

impl Events {
    /// The next event; None when the worker closed the stream.
    pub async fn next(&mut self) -> Result<Option<WorkerEvent>, UpstreamError> {
        loop {
            match self.0.message().await.map_err(|s| convert::status(&s))? {
                None => return Ok(None),
                Some(e) => {
                    if let Some(e) = convert::event(e) {
                        return Ok(Some(e));
                    }
                }
            }
        }
    }
}

/// A worker's Watch stream.
#[derive(Debug)]
pub struct Reports(tonic::Streaming<pb::WorkerReport>);

impl Reports {
    /// The next report; None when the worker closed the stream.
    pub async fn next(&mut self) -> Result<Option<Report>, UpstreamError> {
        Ok(self
            .0
            .message()
            .await
            .map_err(|s| convert::status(&s))?
            .map(|r| convert::report(&r)))
    }
}

/// The host part of `HOST:PORT` (brackets of an IPv6 address removed).
fn host_of(addr: &str) -> String {
    let host = addr.rsplit_once(':').map_or(addr, |(h, _)| h);
    host.trim_start_matches('[')
        .trim_end_matches(']')
        .to_owned()
}
