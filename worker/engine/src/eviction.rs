//! Which device slot gives way when an adapter needs one (leased and
//! pinned slots never do).
//!
//! - [`EvictionPolicy::Value`], the default: an adapter no queued request
//!   waits for goes first, then the one with the lowest recent request
//!   rate ([`RequestRate`]: its arrivals, each weighing half as much every
//!   [`RATE_HALF_LIFE`] arrivals at the pool), then the least recently
//!   used. A popular adapter between two bursts keeps its slot; a one-off
//!   that just ran does not.
//! - [`EvictionPolicy::Lru`]: an adapter requests wait for goes last, then
//!   the least recently used; what the pool did before, kept to compare
//!   against (`--adapter-eviction lru`).

use std::str::FromStr;

/// How a device slot is chosen for eviction.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum EvictionPolicy {
    /// No queued requests, then lowest recent request rate, then least
    /// recently used.
    #[default]
    Value,
    /// No queued requests, then least recently used.
    Lru,
}

impl FromStr for EvictionPolicy {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "value" => Ok(EvictionPolicy::Value),
            "lru" => Ok(EvictionPolicy::Lru),
            other => Err(format!("{other:?} is not value or lru")),
        }
    }
}

/// Arrivals at the pool over which an adapter's request rate halves:
/// long enough to tell a popular adapter from a one-off across many
/// steps, short enough to follow a shift in traffic within a few hundred
/// requests.
pub const RATE_HALF_LIFE: f64 = 256.0;

/// An adapter's recent request rate, in decayed arrivals, on the clock of
/// arrivals at its pool (so it counts the same on any machine).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct RequestRate {
    value: f64,
    at: u64,
}

impl RequestRate {
    /// The rate as of arrival `now`.
    pub fn at(&self, now: u64) -> f64 {
        let elapsed = now.saturating_sub(self.at) as f64;
        self.value * (-elapsed * std::f64::consts::LN_2 / RATE_HALF_LIFE).exp()
    }

    /// Counts one arrival at `now`.
    pub fn arrive(&mut self, now: u64) {
        self.value = self.at(now) + 1.0;
        self.at = now;
    }
}

/// The order in which evictable slots give way, smallest first: whether
/// requests wait for the adapter, then (by value) its rate, then its last
/// use.
pub fn victim_key(
    policy: EvictionPolicy,
    queued: bool,
    rate: f64,
    last_used: u64,
) -> (bool, u64, u64) {
    let rate = match policy {
        // Non-negative floats order as their bits do.
        EvictionPolicy::Value => rate.max(0.0).to_bits(),
        EvictionPolicy::Lru => 0,
    };
    (queued, rate, last_used)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_rate_halves_every_half_life_and_counts_each_arrival() {
        let mut r = RequestRate::default();
        r.arrive(10);
        r.arrive(10);
        assert!((r.at(10) - 2.0).abs() < 1e-9);
        let later = 10 + RATE_HALF_LIFE as u64;
        assert!((r.at(later) - 1.0).abs() < 1e-9);
        r.arrive(later);
        assert!((r.at(later) - 2.0).abs() < 1e-9);
    }

    #[test]
    fn by_value_a_popular_adapter_outlasts_a_recent_one_off() {
        let mut popular = RequestRate::default();
        for t in 0..20 {
            popular.arrive(t * 5);
        }
        let mut one_off = RequestRate::default();
        one_off.arrive(120);
        let now = 121;
        let (p, o) = (popular.at(now), one_off.at(now));
        // Popular was used at 95, the one-off at 120.
        let value = EvictionPolicy::Value;
        assert!(victim_key(value, false, o, 120) < victim_key(value, false, p, 95));
        let lru = EvictionPolicy::Lru;
        assert!(victim_key(lru, false, p, 95) < victim_key(lru, false, o, 120));
        // Under either, an adapter requests wait for goes last.
        assert!(victim_key(value, false, p, 95) < victim_key(value, true, o, 120));
        assert!(victim_key(lru, false, o, 120) < victim_key(lru, true, p, 95));
    }

    #[test]
    fn the_flag_names_its_choices() {
        assert_eq!("value".parse(), Ok(EvictionPolicy::Value));
        assert_eq!("lru".parse(), Ok(EvictionPolicy::Lru));
        assert!("lfu".parse::<EvictionPolicy>().unwrap_err().contains("lfu"));
    }
}
