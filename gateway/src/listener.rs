//! The public HTTP listener: hyper with a header read deadline, which
//! `axum::serve` does not set. A client that opens a connection and never
//! finishes its request line and headers is dropped at the deadline, before
//! it holds anything but a socket; the body has its own deadline in the
//! API's admission.
//!
//! On `stop`, the listener closes, idle keep-alive connections close, and
//! the returned future ends once the open requests have ended.

use std::future::Future;
use std::time::Duration;

use axum::Router;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto::Builder;
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tower::ServiceExt;

/// Serves `app` on `listener` until `stop`, then drains.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    header_read_timeout: Duration,
    stop: impl Future<Output = ()>,
) {
    let mut builder = Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(header_read_timeout);
    builder.http2().timer(TokioTimer::new());
    let graceful = GracefulShutdown::new();
    tokio::pin!(stop);
    loop {
        let (tcp, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    // Out of file descriptors, say: back off, keep serving.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = &mut stop => break,
        };
        // Small responses and SSE chunks go out at once rather than
        // waiting on the client's delayed ACK (Nagle).
        if let Err(e) = tcp.set_nodelay(true) {
            tracing::debug!(error = %e, "TCP_NODELAY");
        }
        // Handlers see the peer as axum's `ConnectInfo`.
        let service = TowerToHyperService::new(app.clone().map_request(
            move |mut r: axum::http::Request<hyper::body::Incoming>| {
                r.extensions_mut().insert(axum::extract::ConnectInfo(peer));
                r
            },
        ));
        let connection = builder
            .serve_connection(TokioIo::new(tcp), service)
            .into_owned();
        let watched = graceful.watch(connection);
        tokio::spawn(async move {
            if let Err(e) = watched.await {
                let timed_out = e
                    .downcast_ref::<hyper::Error>()
                    .is_some_and(hyper::Error::is_timeout);
                if timed_out {
                    metrics::counter!("lorafleet_gateway_header_timeouts_total").increment(1);
                    tracing::info!(%peer, "connection closed: its headers did not arrive in time");
                } else {
                    tracing::debug!(%peer, error = %e, "connection ended with an error");
                }
            }
        });
    }
    drop(listener);
    graceful.shutdown().await;
}
