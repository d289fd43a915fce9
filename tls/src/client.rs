//! The gateway's side: a config that presents the gateway's certificate and
//! trusts only the fleet's CA, and a connector for tonic channels.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use hyper_util::rt::TokioIo;
use rustls::ClientConfig;
use rustls::pki_types::ServerName;
use tokio::net::TcpStream;
use tokio_rustls::client::TlsStream;

use crate::{Loaded, Reloading, TlsError, provider};

/// A client config with the gateway's certificate, trusting `loaded.roots`
/// only, speaking HTTP/2 only (gRPC).
pub fn config(loaded: &Loaded) -> Result<ClientConfig, TlsError> {
    let [cert_flag, key_flag, _] = loaded.flags;
    let mut config = ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| TlsError::Config {
            flag: cert_flag,
            why: e.to_string(),
        })?
        .with_root_certificates(loaded.roots.clone())
        .with_client_auth_cert(loaded.chain.clone(), loaded.key.clone_key())
        .map_err(|e| TlsError::Config {
            flag: key_flag,
            why: format!("does not fit the certificate: {e}"),
        })?;
    config.alpn_protocols = vec![b"h2".to_vec()];
    Ok(config)
}

/// Connects to one worker over TLS and checks that its certificate names
/// `server_name`. Give it to `Endpoint::connect_with_connector_lazy` with an
/// `http://` URI: the TLS is ours, so tonic must not add its own. Every new
/// connection uses the config current at that moment.
#[derive(Clone, Debug)]
pub struct Connector {
    config: Reloading<ClientConfig>,
    server_name: ServerName<'static>,
}

impl Connector {
    /// `server_name` is a DNS name or an IP address; an error says why it
    /// is neither.
    pub fn new(
        config: Reloading<ClientConfig>,
        server_name: &str,
    ) -> Result<Connector, crate::TlsError> {
        let server_name = ServerName::try_from(server_name.to_owned()).map_err(|e| {
            crate::TlsError::ServerName {
                name: server_name.to_owned(),
                why: e.to_string(),
            }
        })?;
        Ok(Connector {
            config,
            server_name,
        })
    }
}

type Connecting =
    Pin<Box<dyn Future<Output = std::io::Result<TokioIo<TlsStream<TcpStream>>>> + Send>>;

impl tower::Service<http::Uri> for Connector {
    type Response = TokioIo<TlsStream<TcpStream>>;
    type Error = std::io::Error;
    type Future = Connecting;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, uri: http::Uri) -> Self::Future {
        let connector = tokio_rustls::TlsConnector::from(self.config.current());
        let name = self.server_name.clone();
        Box::pin(async move {
            let (Some(host), Some(port)) = (uri.host(), uri.port_u16()) else {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::InvalidInput,
                    format!("{uri} has no host and port"),
                ));
            };
            let tcp = TcpStream::connect((host.trim_matches(['[', ']']), port)).await?;
            tcp.set_nodelay(true)?;
            Ok(TokioIo::new(connector.connect(name, tcp).await?))
        })
    }
}
