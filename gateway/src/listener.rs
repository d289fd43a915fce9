//! The HTTP listeners (public and admin): hyper with deadlines and caps
//! that `axum::serve` does not set, so no connection holds a slot without
//! sending a request in time:
//!
//! - **first bytes**: a connection that sends nothing (not even the bytes
//!   hyper reads to tell HTTP/1 from HTTP/2) within the header deadline is
//!   closed;
//! - **headers**: HTTP/1's request line and headers within the deadline
//!   (hyper's timer also runs while a keep-alive connection waits for its
//!   next request, so an idle HTTP/1 connection ends there);
//! - **idle**: a connection with no request in flight and no bytes either
//!   way for the idle timeout is closed (what bounds an HTTP/2 connection
//!   that opens no stream); HTTP/2 also pings, and a peer that does not
//!   answer is dropped;
//! - **caps**: at most so many connections in all and per source address
//!   (an IPv6 source is its /64); one over a cap is closed at once. A
//!   trusted proxy (`--trusted-proxies`) carries many clients' connections
//!   and is held to the total alone.
//!
//! Each rule counts what it refuses or closes in
//! `lorafleet_gateway_connections_refused_total` and
//! `lorafleet_gateway_connections_closed_total` (label `rule`).
//!
//! On `stop`, the listener closes, idle keep-alive connections close, and
//! the returned future ends once the open requests have ended.

use std::collections::HashMap;
use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::Router;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto::Builder;
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tower::ServiceExt;

/// The deadlines and caps of one listener.
#[derive(Debug, Clone, Copy)]
pub struct ConnectionLimits {
    /// For the first bytes, and for HTTP/1's request line and headers.
    pub header_timeout: Duration,
    /// With no request in flight and no bytes either way.
    pub idle_timeout: Duration,
    /// Between HTTP/2 keep-alive pings; a ping unanswered for as long
    /// drops the connection.
    pub http2_keepalive: Duration,
    pub max_connections: usize,
    pub max_connections_per_source: usize,
}

/// Whether a peer is a trusted proxy, which the per-source cap spares.
pub type IsProxy = Arc<dyn Fn(IpAddr) -> bool + Send + Sync>;

/// Serves `app` on `listener` until `stop`, then drains.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    limits: ConnectionLimits,
    is_proxy: IsProxy,
    stop: impl Future<Output = ()>,
) {
    let mut builder = Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout);
    builder
        .http2()
        .timer(TokioTimer::new())
        .keep_alive_interval(Some(limits.http2_keepalive))
        .keep_alive_timeout(limits.http2_keepalive);
    let builder = Arc::new(builder);
    let graceful = Arc::new(GracefulShutdown::new());
    let counts = Arc::new(Counts::default());
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
        let Some(slot) = counts.admit(peer.ip(), &limits, is_proxy(peer.ip())) else {
            continue;
        };
        let (app, builder, graceful) = (app.clone(), builder.clone(), graceful.clone());
        tokio::spawn(async move {
            serve_one(tcp, peer, app, &builder, graceful, limits).await;
            drop(slot);
        });
    }
    drop(listener);
    // A connection still waiting for its first bytes holds the shutdown
    // handle until it watches its connection or its deadline passes; then
    // every watched connection is told to finish.
    while Arc::strong_count(&graceful) > 1 {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    if let Ok(g) = Arc::try_unwrap(graceful) {
        g.shutdown().await;
    }
}

async fn serve_one(
    tcp: TcpStream,
    peer: SocketAddr,
    app: Router,
    builder: &Builder<TokioExecutor>,
    graceful: Arc<GracefulShutdown>,
    limits: ConnectionLimits,
) {
    // Small responses and SSE chunks go out at once rather than waiting
    // on the client's delayed ACK (Nagle).
    if let Err(e) = tcp.set_nodelay(true) {
        tracing::debug!(error = %e, "TCP_NODELAY");
    }
    // Nothing is read, and nothing held but the socket, until the first
    // bytes come: hyper's protocol detection has no timer of its own.
    let mut first = [0u8; 1];
    match tokio::time::timeout(limits.header_timeout, tcp.peek(&mut first)).await {
        Ok(Ok(n)) if n > 0 => {}
        Ok(_) => return,
        Err(_) => {
            closed("first_bytes");
            tracing::info!(%peer, "connection closed: it sent nothing in time");
            return;
        }
    }
    let activity = Arc::new(Activity::new());
    // Handlers see the peer as axum's `ConnectInfo`; each request is in
    // flight until its response is built (a streamed body's bytes count as
    // activity after that).
    let on_request = activity.clone();
    let service = TowerToHyperService::new(
        app.map_request(move |mut r: axum::http::Request<hyper::body::Incoming>| {
            r.extensions_mut().insert(axum::extract::ConnectInfo(peer));
            on_request.in_flight.fetch_add(1, Ordering::AcqRel);
            r
        })
        .map_response({
            let activity = activity.clone();
            move |r| {
                activity.in_flight.fetch_sub(1, Ordering::AcqRel);
                activity.touch();
                r
            }
        }),
    );
    let io = TokioIo::new(Watched {
        inner: tcp,
        activity: activity.clone(),
    });
    let connection = graceful.watch(builder.serve_connection(io, service).into_owned());
    drop(graceful);
    tokio::select! {
        result = connection => {
            if let Err(e) = result {
                let timed_out = e
                    .downcast_ref::<hyper::Error>()
                    .is_some_and(hyper::Error::is_timeout);
                if timed_out {
                    metrics::counter!("lorafleet_gateway_header_timeouts_total").increment(1);
                    closed("headers");
                    tracing::info!(%peer, "connection closed: its headers did not arrive in time");
                } else {
                    tracing::debug!(%peer, error = %e, "connection ended with an error");
                }
            }
        }
        () = activity.idle_for(limits.idle_timeout) => {
            closed("idle");
            tracing::debug!(%peer, "connection closed: idle");
        }
    }
}

fn closed(rule: &'static str) {
    metrics::counter!("lorafleet_gateway_connections_closed_total", "rule" => rule).increment(1);
}

/// A connection's requests in flight and its last byte either way.
struct Activity {
    in_flight: AtomicUsize,
    /// Milliseconds since `start` of the last byte read or written.
    last: AtomicU64,
    start: Instant,
}

impl Activity {
    fn new() -> Activity {
        Activity {
            in_flight: AtomicUsize::new(0),
            last: AtomicU64::new(0),
            start: Instant::now(),
        }
    }

    fn touch(&self) {
        let now = self.start.elapsed().as_millis() as u64;
        self.last.store(now, Ordering::Relaxed);
    }

    /// Resolves once nothing has been in flight and no byte has moved for
    /// `timeout`.
    async fn idle_for(&self, timeout: Duration) {
        loop {
            let since = self.start.elapsed().as_millis() as u64 - self.last.load(Ordering::Relaxed);
            let quiet = Duration::from_millis(since);
            if self.in_flight.load(Ordering::Acquire) == 0 && quiet >= timeout {
                return;
            }
            let wait = timeout.saturating_sub(quiet).max(Duration::from_millis(50));
            tokio::time::sleep(wait).await;
        }
    }
}

/// A socket whose reads and writes mark the connection active.
struct Watched {
    inner: TcpStream,
    activity: Arc<Activity>,
}

impl AsyncRead for Watched {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let r = Pin::new(&mut self.inner).poll_read(cx, buf);
        if buf.filled().len() > before {
            self.activity.touch();
        }
        r
    }
}

impl AsyncWrite for Watched {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write(cx, buf);
        if matches!(r, Poll::Ready(Ok(n)) if n > 0) {
            self.activity.touch();
        }
        r
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        if matches!(r, Poll::Ready(Ok(n)) if n > 0) {
            self.activity.touch();
        }
        r
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}

/// Open connections, in all and by source.
#[derive(Default)]
struct Counts {
    total: AtomicUsize,
    by_source: Mutex<HashMap<Source, usize>>,
}

/// A source address as the caps count it: an IPv4 address, or an IPv6
/// address's /64 (one host holds a whole /64).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Source {
    V4(std::net::Ipv4Addr),
    V6(u64),
}

impl Source {
    fn of(ip: IpAddr) -> Source {
        match ip {
            IpAddr::V4(v4) => Source::V4(v4),
            IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
                Some(v4) => Source::V4(v4),
                None => Source::V6((u128::from(v6) >> 64) as u64),
            },
        }
    }
}

/// One admitted connection's place in the counts, given back on drop.
struct Slot {
    counts: Arc<Counts>,
    source: Source,
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.counts.total.fetch_sub(1, Ordering::AcqRel);
        let mut by = self.counts.by_source.lock().expect("the counts' lock");
        if let Some(n) = by.get_mut(&self.source) {
            *n -= 1;
            if *n == 0 {
                by.remove(&self.source);
            }
        }
    }
}

impl Counts {
    /// A slot for a connection from `ip`, or None (counted by the cap it
    /// meets) when it would pass one; a proxy's connections meet the total
    /// alone.
    fn admit(self: &Arc<Self>, ip: IpAddr, limits: &ConnectionLimits, proxy: bool) -> Option<Slot> {
        let refuse = |rule: &'static str| {
            metrics::counter!("lorafleet_gateway_connections_refused_total", "rule" => rule)
                .increment(1);
            tracing::debug!(%ip, rule, "connection refused");
            None
        };
        if self.total.load(Ordering::Acquire) >= limits.max_connections {
            return refuse("total");
        }
        let source = Source::of(ip);
        {
            let mut by = self.by_source.lock().expect("the counts' lock");
            let n = by.entry(source).or_insert(0);
            if *n >= limits.max_connections_per_source && !proxy {
                return refuse("per_source");
            }
            *n += 1;
        }
        self.total.fetch_add(1, Ordering::AcqRel);
        Some(Slot {
            counts: self.clone(),
            source,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_ipv6_source_is_its_64_and_a_mapped_ipv4_its_address() {
        let a: IpAddr = "2001:db8:1:2::1".parse().unwrap();
        let b: IpAddr = "2001:db8:1:2:ffff::9".parse().unwrap();
        let c: IpAddr = "2001:db8:1:3::1".parse().unwrap();
        assert_eq!(Source::of(a), Source::of(b));
        assert_ne!(Source::of(a), Source::of(c));
        let mapped: IpAddr = "::ffff:10.1.2.3".parse().unwrap();
        assert_eq!(Source::of(mapped), Source::of("10.1.2.3".parse().unwrap()));
    }

    #[test]
    fn caps_count_open_connections_in_all_and_by_source() {
        let limits = ConnectionLimits {
            header_timeout: Duration::from_secs(1),
            idle_timeout: Duration::from_secs(1),
            http2_keepalive: Duration::from_secs(1),
            max_connections: 3,
            max_connections_per_source: 2,
        };
        let counts = Arc::new(Counts::default());
        let (a, b): (IpAddr, IpAddr) = ("10.0.0.1".parse().unwrap(), "10.0.0.2".parse().unwrap());
        let a1 = counts.admit(a, &limits, false).unwrap();
        let _a2 = counts.admit(a, &limits, false).unwrap();
        assert!(counts.admit(a, &limits, false).is_none(), "per source");
        let _b1 = counts.admit(b, &limits, false).unwrap();
        assert!(counts.admit(b, &limits, false).is_none(), "in all");
        drop(a1);
        let a3 = counts.admit(a, &limits, false);
        assert!(a3.is_some(), "a closed slot is free again");
        // A proxy passes the per-source cap, never the total.
        let counts = Arc::new(Counts::default());
        let p: IpAddr = "10.0.0.9".parse().unwrap();
        let held: Vec<_> = (0..3)
            .map(|_| counts.admit(p, &limits, true).unwrap())
            .collect();
        assert!(counts.admit(p, &limits, true).is_none(), "in all");
        drop(held);
    }
}
