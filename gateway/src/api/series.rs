//! Which tenants have request metrics of their own: the `top` with the most
//! recent device time, so that a fleet of thousands of tenants (each with
//! its adapters) exports a bounded number of series. Every other tenant's
//! requests count under `tenant="other", adapter="other"`.
//!
//! Each finished request charges its tenant its device time (and one
//! microsecond, so that requests that ran on no device still count). While
//! fewer than `top` tenants are named, a tenant is named at its first
//! request; once `top` are, the names are re-ranked every [`RERANK`] by the
//! charges since, each past charge halved at every re-ranking, so a
//! tenant's share fades as it goes quiet. A tenant that drops out keeps
//! its old series in the exporter (their values no longer grow).

use std::collections::{HashMap, HashSet};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How often the named tenants are re-ranked once `top` are named.
pub const RERANK: Duration = Duration::from_secs(60);

/// The label of every tenant not named, and of its adapters.
pub const OTHER: &str = "other";

/// The named tenants and what each was charged.
#[derive(Debug)]
pub struct TenantSeries {
    top: usize,
    state: Mutex<Ranking>,
}

#[derive(Debug)]
struct Ranking {
    /// Decayed device microseconds by tenant name.
    charged: HashMap<String, f64>,
    named: HashSet<String>,
    ranked_at: Instant,
}

impl TenantSeries {
    /// Series for at most `top` tenants (0: none, all are `other`).
    pub fn new(top: usize) -> TenantSeries {
        TenantSeries {
            top,
            state: Mutex::new(Ranking {
                charged: HashMap::new(),
                named: HashSet::new(),
                ranked_at: Instant::now(),
            }),
        }
    }

    /// Whether `tenant` has series of its own now (named at once while
    /// fewer than `top` are, as at its first charge).
    pub fn named(&self, tenant: &str) -> bool {
        if self.top == 0 || tenant.is_empty() {
            return false;
        }
        let mut s = self.state.lock().expect("not poisoned");
        if s.named.len() < self.top {
            s.named.insert(tenant.to_owned());
        }
        s.named.contains(tenant)
    }

    /// Charges a finished request's device time to `tenant`: whether the
    /// tenant has series of its own.
    pub fn charge(&self, tenant: &str, device: Duration) -> bool {
        self.charge_at(tenant, device, Instant::now())
    }

    fn charge_at(&self, tenant: &str, device: Duration, now: Instant) -> bool {
        if self.top == 0 || tenant.is_empty() {
            return false;
        }
        let mut s = self.state.lock().expect("not poisoned");
        let cost = device.as_micros() as f64 + 1.0;
        match s.charged.get_mut(tenant) {
            Some(c) => *c += cost,
            None => {
                s.charged.insert(tenant.to_owned(), cost);
            }
        }
        if s.named.len() < self.top {
            s.named.insert(tenant.to_owned());
        } else if now.duration_since(s.ranked_at) >= RERANK {
            s.rerank(self.top, now);
        }
        s.named.contains(tenant)
    }
}

impl Ranking {
    /// Names the `top` most charged (ties by name), then halves every
    /// charge and forgets the ones that faded to nothing.
    fn rerank(&mut self, top: usize, now: Instant) {
        let mut by_charge: Vec<(&String, f64)> =
            self.charged.iter().map(|(t, &c)| (t, c)).collect();
        by_charge.sort_by(|a, b| b.1.total_cmp(&a.1).then_with(|| a.0.cmp(b.0)));
        self.named = by_charge
            .into_iter()
            .take(top)
            .map(|(t, _)| t.clone())
            .collect();
        self.charged.retain(|_, c| {
            *c /= 2.0;
            *c >= 0.5
        });
        self.ranked_at = now;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_top_tenants_are_named_then_the_most_charged_since() {
        let series = TenantSeries::new(2);
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        assert!(series.charge_at("a", ms(1), t0));
        assert!(series.charge_at("b", ms(1), t0));
        // The names are full: c waits for the next ranking.
        assert!(!series.charge_at("c", ms(50), t0));
        assert!(!series.charge_at("c", ms(50), t0 + RERANK / 2));
        assert!(series.named("a") && series.named("b") && !series.named("c"));
        // Before its first charge, a tenant is named while there is room.
        let roomy = TenantSeries::new(2);
        assert!(roomy.named("x") && roomy.named("y") && !roomy.named("z"));
        // At the ranking, c (100 ms) and b (now 10 ms) outrank a (1 ms).
        assert!(series.charge_at("b", ms(9), t0 + RERANK));
        assert!(series.named("c") && !series.named("a"));
        assert!(!series.charge_at("a", ms(1), t0 + RERANK));
        // Charges fade: after c goes quiet, a steady a outranks it.
        let mut now = t0 + RERANK;
        for _ in 0..6 {
            now += RERANK;
            series.charge_at("a", ms(40), now);
            series.charge_at("b", ms(60), now);
        }
        assert!(series.named("a") && series.named("b") && !series.named("c"));
        // With none to name, every tenant is `other`.
        let none = TenantSeries::new(0);
        assert!(!none.charge_at("a", ms(1), t0));
        assert!(!none.named("a"));
    }
}
