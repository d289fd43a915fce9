//! Where requests come from, and what failed authentication costs.
//!
//! - **The client address** ([`address`]): the TCP peer, or the nearest
//!   `X-Forwarded-For` hop that a proxy in `--trusted-proxies` vouches
//!   for. It is recorded on every audit row.
//! - **A per-source limit** ([`guard`]): a token bucket of failed
//!   authentications per address (IPv6 per /64). A source past it gets 429
//!   `too_many_failed_authentications` with `Retry-After` instead of 401,
//!   before any body is read. A good credential from the same address is
//!   still served: the limit costs a flood, not the tenants behind a NAT.
//! - **Aggregated rows** ([`tally`]): failed authentications are not one
//!   durable row each. Each (source, answer, window) becomes one audit row
//!   with `occurrences`, the first and last time, and the first and last
//!   key prefix seen, queued when the window ends and at drain.

mod address;
mod guard;
mod tally;

use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::http::HeaderMap;
use chrono::Utc;

pub use address::TrustedProxies;
pub use guard::GuardConfig;

use crate::audit::AuditLog;

/// The stable code of a failed authentication (as the API answers it).
pub const UNAUTHENTICATED_CODE: &str = "invalid_api_key";
/// The stable code of a source past its failed-authentication limit.
pub const THROTTLED_CODE: &str = "too_many_failed_authentications";

/// The settings of `--trusted-proxies` and the failed-authentication
/// limit.
#[derive(Debug, Clone)]
pub struct SourcesConfig {
    pub trusted_proxies: TrustedProxies,
    pub guard: GuardConfig,
    /// Seconds a failed-authentication row covers.
    pub window_secs: u32,
}

/// What a failed authentication is answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// 401, as the credential deserves.
    Unauthenticated,
    /// 429: this source has failed too often; come back after this long.
    Throttled { retry_after: Duration },
}

/// The address book of one gateway replica. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Sources {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    trusted: TrustedProxies,
    guard: Mutex<guard::Guard>,
    tally: Mutex<tally::Tally>,
}

impl Sources {
    pub fn new(config: SourcesConfig) -> Sources {
        // Twice the sources, for both answers a source can get.
        let max_windows = config.guard.max_sources.saturating_mul(2);
        Sources {
            inner: Arc::new(Inner {
                trusted: config.trusted_proxies,
                guard: Mutex::new(guard::Guard::new(config.guard)),
                tally: Mutex::new(tally::Tally::new(config.window_secs, max_windows)),
            }),
        }
    }

    /// The client address of a request from `peer` (None when the request
    /// did not come through a socket, as in-process tests).
    pub fn client(&self, peer: Option<IpAddr>, headers: &HeaderMap) -> Option<IpAddr> {
        peer.map(|p| self.inner.trusted.client(p, headers))
    }

    /// Whether a request from `peer` came through a trusted proxy, whose
    /// headers (`X-Forwarded-For`, `traceparent`) are believed.
    pub fn from_trusted_proxy(&self, peer: Option<IpAddr>) -> bool {
        peer.is_some_and(|p| self.inner.trusted.trusts_peer(p))
    }

    /// Records one failed authentication from `client`, whose credential
    /// started with `key_prefix`, and says how to answer it.
    pub fn failed(&self, client: Option<IpAddr>, key_prefix: Option<&str>) -> Verdict {
        let verdict = match client {
            None => Verdict::Unauthenticated,
            Some(ip) => {
                let mut g = self.inner.guard.lock().expect("the guard's lock");
                let wait = g.take(guard::Source::of(ip), Instant::now());
                metrics::gauge!("lorafleet_gateway_failed_auth_sources").set(g.len() as f64);
                match wait {
                    None => Verdict::Unauthenticated,
                    Some(retry_after) => Verdict::Throttled { retry_after },
                }
            }
        };
        let answer = match verdict {
            Verdict::Unauthenticated => (401, UNAUTHENTICATED_CODE),
            Verdict::Throttled { .. } => (429, THROTTLED_CODE),
        };
        metrics::counter!("lorafleet_gateway_failed_auth_total", "answer" => answer.1).increment(1);
        self.inner.tally.lock().expect("the tally's lock").add(
            client,
            answer,
            key_prefix,
            Utc::now(),
        );
        verdict
    }

    /// Queues the rows of the windows that have ended (all of them with
    /// `all`, at drain). A row the audit queue has no room for stays and
    /// is tried again: none is dropped.
    pub fn flush(&self, audit: &AuditLog, all: bool) -> usize {
        let rows = {
            let mut t = self.inner.tally.lock().expect("the tally's lock");
            let rows = t.take_closed(Utc::now(), all);
            metrics::gauge!("lorafleet_gateway_failed_auth_windows").set(t.open_windows() as f64);
            rows
        };
        let mut queued = 0;
        for row in rows {
            match audit.admit() {
                Ok(ticket) => {
                    // Nobody waits on these rows; the writer places them.
                    drop(ticket.record(row));
                    queued += 1;
                }
                Err(_) => self
                    .inner
                    .tally
                    .lock()
                    .expect("the tally's lock")
                    .put_back(row),
            }
        }
        {
            let mut g = self.inner.guard.lock().expect("the guard's lock");
            g.forget_idle(Instant::now());
        }
        queued
    }

    /// Flushes ended windows every second until the task is aborted.
    pub fn spawn_flusher(&self, audit: AuditLog) -> tokio::task::JoinHandle<()> {
        let me = self.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_secs(1));
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                me.flush(&audit, false);
            }
        })
    }
}

/// The part of a bearer credential that may be recorded: an API key's
/// prefix (`lf_…` before the dot), never a secret or a JWT.
pub fn key_prefix(headers: &HeaderMap) -> Option<String> {
    let value = headers
        .get(axum::http::header::AUTHORIZATION)?
        .to_str()
        .ok()?;
    let token = value.strip_prefix("Bearer ")?.trim();
    let (prefix, _secret) = token.split_once('.')?;
    let ok = prefix.starts_with("lf_")
        && prefix.len() <= 32
        && prefix
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_');
    ok.then(|| prefix.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_an_api_key_prefix_is_ever_recorded() {
        let h = |v: &str| {
            let mut m = HeaderMap::new();
            m.insert(axum::http::header::AUTHORIZATION, v.parse().unwrap());
            m
        };
        assert_eq!(
            key_prefix(&h("Bearer lf_ab12cd.s3cret")).as_deref(),
            Some("lf_ab12cd")
        );
        for no in [
            "Bearer lf_nodotsecret",
            "Bearer eyJhbGciOi.eyJzdWIi.sig",
            "Basic lf_a.b",
            "Bearer lf_a b.c",
        ] {
            assert_eq!(key_prefix(&h(no)), None, "{no}");
        }
    }
}
