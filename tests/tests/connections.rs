//! No connection holds a slot without sending a request in time: a real
//! gateway on loopback, flooded with connections that send nothing, one
//! that sends only HTTP/2's preface and one that idles after its request.
//! Connections past the per-source cap are closed at once, the rest at
//! the first-bytes deadline; the HTTP/2 one at the idle timeout, the
//! HTTP/1 keep-alive one when its next headers miss their deadline; each
//! rule's count is in the metrics, and the gateway serves on.

#[path = "support/fleet.rs"]
mod fleet;

use std::time::{Duration, Instant};

use fleet::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Reads until the peer closes (or resets); how long that took, or None
/// if it was still open at `limit`.
async fn closed_within(stream: &mut TcpStream, limit: Duration) -> Option<Duration> {
    let start = Instant::now();
    let mut buf = [0u8; 4096];
    loop {
        match tokio::time::timeout(limit.saturating_sub(start.elapsed()), stream.read(&mut buf))
            .await
        {
            Err(_) => return None,
            Ok(Ok(0)) | Ok(Err(_)) => return Some(start.elapsed()),
            Ok(Ok(_)) => {}
        }
    }
}

/// A counter's value for `rule` in the gateway's metrics.
async fn counter(f: &Fleet, name: &str, rule: &str) -> f64 {
    let text = reqwest::get(format!("http://{}/metrics", f.gateway.addr("metrics")))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    text.lines()
        .find(|l| l.starts_with(name) && l.contains(&format!("rule=\"{rule}\"")))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_connection_holds_a_slot_without_sending_a_request_in_time() {
    let f = fleet_with(
        "connection_flood",
        &[
            "--header-timeout-secs",
            "1",
            "--idle-timeout-secs",
            "2",
            "--max-connections-per-source",
            "20",
        ],
    )
    .await;
    let addr = f.base_url.trim_start_matches("http://").to_owned();

    // 50 connections that send nothing: 30 past the cap of 20 from this
    // source are closed at once, the 20 admitted at the first-bytes
    // deadline (1 s); none is left open.
    let mut silent = Vec::new();
    for _ in 0..50 {
        silent.push(TcpStream::connect(&addr).await.unwrap());
    }
    let start = Instant::now();
    let closes = futures::future::join_all(
        silent
            .iter_mut()
            .map(|s| closed_within(s, Duration::from_secs(5))),
    )
    .await;
    let mut early = 0;
    for (i, c) in closes.iter().enumerate() {
        let c = c.unwrap_or_else(|| panic!("connection {i} was still open after 5 s"));
        if c < Duration::from_millis(700) {
            early += 1;
        }
    }
    assert_eq!(early, 30, "those past the cap closed at once: {closes:?}");
    assert!(start.elapsed() < Duration::from_secs(4));
    assert!(
        counter(
            &f,
            "lorafleet_gateway_connections_refused_total",
            "per_source"
        )
        .await
            >= 30.0
    );
    assert!(
        counter(
            &f,
            "lorafleet_gateway_connections_closed_total",
            "first_bytes"
        )
        .await
            >= 20.0
    );

    // The slots are free again: a request is served.
    let r = f
        .http
        .get(format!("{}/healthz", f.base_url))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);

    // HTTP/2's preface alone (what protocol detection reads), then nothing:
    // closed once idle, not held.
    let mut preface = TcpStream::connect(&addr).await.unwrap();
    preface
        .write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
        .await
        .unwrap();
    // A keep-alive HTTP/1 connection after its request is answered: open
    // while it might send another, closed when the next request's headers
    // do not come within their deadline (1 s).
    let mut kept = TcpStream::connect(&addr).await.unwrap();
    kept.write_all(b"GET /healthz HTTP/1.1\r\nHost: gateway\r\n\r\n")
        .await
        .unwrap();
    let mut buf = [0u8; 1024];
    let n = kept.read(&mut buf).await.unwrap();
    assert!(
        String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 200"),
        "{}",
        String::from_utf8_lossy(&buf[..n])
    );
    let (a, b) = tokio::join!(
        closed_within(&mut preface, Duration::from_secs(6)),
        closed_within(&mut kept, Duration::from_secs(6)),
    );
    let a = a.expect("the preface-only connection was still open after 6 s");
    let b = b.expect("the idle keep-alive connection was still open after 6 s");
    assert!(
        a >= Duration::from_millis(1500),
        "closed before it was idle 2 s: {a:?}"
    );
    assert!(
        b >= Duration::from_millis(900),
        "closed before its deadline: {b:?}"
    );
    assert!(counter(&f, "lorafleet_gateway_connections_closed_total", "idle").await >= 1.0);
    assert!(counter(&f, "lorafleet_gateway_connections_closed_total", "headers").await >= 1.0);
}
