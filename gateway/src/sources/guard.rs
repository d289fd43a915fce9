//! A token bucket of failed authentications per source: a source that
//! keeps presenting bad credentials is answered 429 with `Retry-After`
//! instead of 401, before any body is read. The map is bounded: past its
//! size, idle sources are forgotten, and when none is idle new sources
//! share one overflow bucket.

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::time::{Duration, Instant};

/// Where requests come from, as the limit counts them: an IPv4 address,
/// or an IPv6 /64 (what one host usually holds, so rotating addresses
/// within it does not reset the bucket).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) struct Source(IpAddr);

impl Source {
    pub(super) fn of(ip: IpAddr) -> Source {
        match ip {
            IpAddr::V4(_) => Source(ip),
            IpAddr::V6(v6) => {
                let bits = u128::from(v6) & !((1u128 << 64) - 1);
                Source(IpAddr::V6(Ipv6Addr::from(bits)))
            }
        }
    }

    /// Every source past the map's bound, together.
    const OVERFLOW: Source = Source(IpAddr::V4(Ipv4Addr::UNSPECIFIED));
}

/// The limit: `burst` failures at once, refilled at `per_minute`.
#[derive(Debug, Clone, Copy)]
pub struct GuardConfig {
    pub burst: u32,
    pub per_minute: u32,
    /// Sources remembered at once.
    pub max_sources: usize,
}

#[derive(Debug, Clone, Copy)]
struct Bucket {
    tokens: f64,
    at: Instant,
}

#[derive(Debug)]
pub(super) struct Guard {
    config: GuardConfig,
    buckets: HashMap<Source, Bucket>,
}

impl Guard {
    pub(super) fn new(config: GuardConfig) -> Guard {
        Guard {
            config,
            buckets: HashMap::new(),
        }
    }

    fn rate(&self) -> f64 {
        f64::from(self.config.per_minute) / 60.0
    }

    fn refill(&self, b: &mut Bucket, now: Instant) {
        let dt = now.saturating_duration_since(b.at).as_secs_f64();
        b.tokens = (b.tokens + dt * self.rate()).min(f64::from(self.config.burst));
        b.at = now;
    }

    /// Takes one failure from `source`'s bucket: None when it had room,
    /// else how long until it has.
    pub(super) fn take(&mut self, source: Source, now: Instant) -> Option<Duration> {
        let key = self.key(source, now);
        let full = Bucket {
            tokens: f64::from(self.config.burst),
            at: now,
        };
        let mut b = *self.buckets.get(&key).unwrap_or(&full);
        self.refill(&mut b, now);
        let verdict = if b.tokens >= 1.0 {
            b.tokens -= 1.0;
            None
        } else if self.config.per_minute == 0 {
            Some(Duration::from_secs(60))
        } else {
            Some(Duration::from_secs_f64((1.0 - b.tokens) / self.rate()))
        };
        self.buckets.insert(key, b);
        verdict
    }

    /// The bucket `source` uses: its own, unless the map is full of
    /// sources that are not idle.
    fn key(&mut self, source: Source, now: Instant) -> Source {
        if self.buckets.contains_key(&source) || self.buckets.len() < self.config.max_sources {
            return source;
        }
        self.forget_idle(now);
        if self.buckets.len() < self.config.max_sources {
            source
        } else {
            metrics::counter!("lorafleet_gateway_failed_auth_overflow_total").increment(1);
            Source::OVERFLOW
        }
    }

    /// Drops the buckets that have refilled: they hold nothing to remember.
    pub(super) fn forget_idle(&mut self, now: Instant) {
        let burst = f64::from(self.config.burst);
        let rate = self.rate();
        self.buckets.retain(|_, b| {
            let dt = now.saturating_duration_since(b.at).as_secs_f64();
            b.tokens + dt * rate < burst
        });
    }

    pub(super) fn len(&self) -> usize {
        self.buckets.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn guard(burst: u32, per_minute: u32, max_sources: usize) -> Guard {
        Guard::new(GuardConfig {
            burst,
            per_minute,
            max_sources,
        })
    }

    fn src(s: &str) -> Source {
        Source::of(s.parse().unwrap())
    }

    #[test]
    fn a_source_gets_its_burst_then_waits_for_the_refill() {
        let mut g = guard(3, 60, 100);
        let t0 = Instant::now();
        let a = src("203.0.113.9");
        for _ in 0..3 {
            assert_eq!(g.take(a, t0), None);
        }
        let wait = g.take(a, t0).expect("the fourth is refused");
        assert!(
            (0.9..=1.0).contains(&wait.as_secs_f64()),
            "one a second: {wait:?}"
        );
        // Another source is untouched.
        assert_eq!(g.take(src("203.0.113.10"), t0), None);
        // A second later, one more.
        let t1 = t0 + Duration::from_secs(1);
        assert_eq!(g.take(a, t1), None);
        assert!(g.take(a, t1).is_some());
    }

    #[test]
    fn an_ipv6_host_is_one_source_across_its_64() {
        let mut g = guard(2, 60, 100);
        let t0 = Instant::now();
        assert_eq!(g.take(src("2001:db8:1:2::1"), t0), None);
        assert_eq!(g.take(src("2001:db8:1:2::ffff"), t0), None);
        assert!(g.take(src("2001:db8:1:2:aaaa::7"), t0).is_some());
        assert_eq!(g.take(src("2001:db8:1:3::1"), t0), None);
    }

    #[test]
    fn the_map_is_bounded_and_idle_sources_are_forgotten() {
        let mut g = guard(1, 60, 4);
        let t0 = Instant::now();
        for i in 0..4 {
            assert_eq!(g.take(src(&format!("198.51.100.{i}")), t0), None);
        }
        // Full of busy sources: the newcomers share the overflow bucket.
        assert_eq!(g.take(src("198.51.100.200"), t0), None);
        assert!(g.take(src("198.51.100.201"), t0).is_some());
        assert_eq!(g.len(), 5, "four sources and the overflow");
        // Once they have refilled they are forgotten, and a new source
        // gets its own bucket again.
        let later = t0 + Duration::from_secs(5);
        assert_eq!(g.take(src("198.51.100.202"), later), None);
        assert_eq!(g.len(), 1);
    }
}
