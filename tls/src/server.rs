//! The worker's side: a config that requires a client certificate from the
//! fleet's CA, and the handshaken connections tonic serves.

use std::net::SocketAddr;
use std::time::Duration;

use futures::Stream;
use rustls::ServerConfig;
use rustls::server::WebPkiClientVerifier;
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::server::TlsStream;

use crate::{Loaded, Reloading, TlsError, metric, provider};

/// A server config that refuses any client without a certificate that
/// chains to `loaded.roots`, speaking HTTP/2 only (gRPC).
pub fn config(loaded: &Loaded) -> Result<ServerConfig, TlsError> {
    let [cert_flag, key_flag, ca_flag] = loaded.flags;
    let verifier = WebPkiClientVerifier::builder_with_provider(loaded.roots.clone(), provider())
        .build()
        .map_err(|e| TlsError::Config {
            flag: ca_flag,
            why: format!("cannot verify clients with it: {e}"),
        })?;
    let mut config = ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| TlsError::Config {
            flag: cert_flag,
            why: e.to_string(),
        })?
        .with_client_cert_verifier(verifier)
        .with_single_cert(loaded.chain.clone(), loaded.key.clone_key())
        .map_err(|e| TlsError::Config {
            flag: key_flag,
            why: format!("does not fit the certificate: {e}"),
        })?;
    config.alpn_protocols = vec![b"h2".to_vec()];
    Ok(config)
}

/// Accepts on `listener` and yields connections whose handshake succeeded,
/// for `tonic::transport::Server::serve_with_incoming`. Each handshake runs
/// in its own task with a deadline, so a slow or silent client holds up no
/// one else. Failures (a plain-text client, no certificate, another CA) are
/// logged with the peer's address and counted; they never reach tonic.
pub fn incoming(
    listener: TcpListener,
    config: Reloading<ServerConfig>,
    handshake_timeout: Duration,
) -> impl Stream<Item = std::io::Result<TlsStream<TcpStream>>> {
    let (tx, rx) = tokio::sync::mpsc::channel::<TlsStream<TcpStream>>(64);
    tokio::spawn(async move {
        loop {
            let (tcp, peer) = tokio::select! {
                accepted = listener.accept() => match accepted {
                    Ok(a) => a,
                    Err(e) => {
                        // Out of descriptors and the like: back off, go on.
                        tracing::warn!(error = %e, "accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                },
                () = tx.closed() => return,
            };
            let _ = tcp.set_nodelay(true);
            let acceptor = tokio_rustls::TlsAcceptor::from(config.current());
            let tx = tx.clone();
            tokio::spawn(async move {
                match tokio::time::timeout(handshake_timeout, acceptor.accept(tcp)).await {
                    Ok(Ok(stream)) => {
                        let _ = tx.send(stream).await;
                    }
                    Ok(Err(e)) => refused(peer, &e.to_string()),
                    Err(_) => refused(peer, "no handshake within the deadline"),
                }
            });
        }
    });
    futures::stream::unfold(
        rx,
        |mut rx| async move { rx.recv().await.map(|s| (Ok(s), rx)) },
    )
}

fn refused(peer: SocketAddr, why: &str) {
    tracing::warn!(%peer, why, "TLS handshake refused");
    metrics::counter!(metric::HANDSHAKE_FAILURES).increment(1);
}
