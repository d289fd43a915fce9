//! A rollout's plan and its gates: the weights of each step, and whether a
//! step's window lets the candidate go on, from what the audit log says the
//! candidate and the stable version did over it.

use serde::{Deserialize, Serialize};

use crate::registry::WEIGHT_TOTAL;

/// What one version did over a step's window (its audit rows).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Figures {
    /// Requests that reached a worker's answer or failure: `ok` and
    /// `error` rows. Refusals (the client's 4xx) and cancellations are
    /// neither success nor failure of the version.
    pub requests: u64,
    /// Of those, worker failures and 5xx answers.
    pub errors: u64,
    /// 95th percentile time to first token, in milliseconds.
    pub ttft_p95_ms: Option<f64>,
    /// 95th percentile time per output token after the first, in
    /// milliseconds.
    pub tpot_p95_ms: Option<f64>,
}

impl Figures {
    pub fn error_rate(&self) -> f64 {
        if self.requests == 0 {
            0.0
        } else {
            self.errors as f64 / self.requests as f64
        }
    }
}

/// The thresholds a step's window must pass.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Gates {
    /// Requests each version needs in the window before any decision.
    pub min_requests: u64,
    /// How far the candidate's error rate may exceed the stable's
    /// (absolute: 0.01 is one percentage point).
    pub max_error_rate_increase: f64,
    /// The candidate's p95 time to first token may be at most this
    /// multiple of the stable's.
    pub max_ttft_p95_ratio: f64,
    /// The same for the p95 time per output token.
    pub max_tpot_p95_ratio: f64,
}

impl Default for Gates {
    fn default() -> Self {
        Gates {
            min_requests: 20,
            max_error_rate_increase: 0.01,
            max_ttft_p95_ratio: 1.5,
            max_tpot_p95_ratio: 1.5,
        }
    }
}

/// Why a gate value is refused, naming the field.
pub fn check_gates(g: &Gates) -> Result<(), (&'static str, String)> {
    if g.min_requests == 0 || g.min_requests > 1_000_000 {
        return Err((
            "min_requests",
            format!("{} must be between 1 and 1000000", g.min_requests),
        ));
    }
    if !(0.0..=1.0).contains(&g.max_error_rate_increase) {
        return Err((
            "max_error_rate_increase",
            format!(
                "{} must be between 0 and 1 (a fraction of requests)",
                g.max_error_rate_increase
            ),
        ));
    }
    for (field, v) in [
        ("max_ttft_p95_ratio", g.max_ttft_p95_ratio),
        ("max_tpot_p95_ratio", g.max_tpot_p95_ratio),
    ] {
        if !(v.is_finite() && (1.0..=100.0).contains(&v)) {
            return Err((field, format!("{v} must be between 1 and 100")));
        }
    }
    Ok(())
}

/// Checks a rollout's steps (the candidate's share at each, in basis
/// points): rising, each in (0, 10000], ending at 10000. Reaching the last
/// ends the rollout.
pub fn check_steps(steps: &[u32]) -> Result<(), (&'static str, String)> {
    if steps.len() < 2 || steps.len() > 20 {
        return Err((
            "steps",
            "give between 2 and 20 steps, the last 10000 (one step of all traffic is a promote)"
                .into(),
        ));
    }
    let mut last = 0;
    for (i, &s) in steps.iter().enumerate() {
        if s == 0 || s > WEIGHT_TOTAL {
            return Err((
                "steps",
                format!("steps[{i}]: {s} is not in (0, {WEIGHT_TOTAL}] basis points"),
            ));
        }
        if s <= last {
            return Err((
                "steps",
                format!("steps[{i}]: {s} does not rise above the step before ({last})"),
            ));
        }
        last = s;
    }
    if last != WEIGHT_TOTAL {
        return Err((
            "steps",
            format!("the last step must be {WEIGHT_TOTAL} (all traffic), not {last}"),
        ));
    }
    Ok(())
}

/// A step's decision.
#[derive(Debug, Clone, PartialEq)]
pub enum Verdict {
    /// Not yet: too few requests, or the hold time is not over.
    Wait(String),
    /// Every gate holds over a full window: the next step.
    Advance,
    /// A gate failed: back to the stable version at once.
    RollBack(String),
}

/// Judges a step's window. Gates are checked as soon as both versions have
/// `min_requests`, so a failing candidate is rolled back without waiting
/// for the hold time; passing needs the hold time too.
pub fn judge(g: &Gates, candidate: &Figures, stable: &Figures, held: bool) -> Verdict {
    for (who, f) in [("candidate", candidate), ("stable", stable)] {
        if f.requests < g.min_requests {
            return Verdict::Wait(format!(
                "{who}: {} of {} requests in the window",
                f.requests, g.min_requests
            ));
        }
    }
    let (c, s) = (candidate.error_rate(), stable.error_rate());
    if c > s + g.max_error_rate_increase {
        return Verdict::RollBack(format!(
            "error rate {:.2}% against the stable version's {:.2}% (at most {:.2} points more)",
            100.0 * c,
            100.0 * s,
            100.0 * g.max_error_rate_increase
        ));
    }
    for (name, c, s, limit) in [
        (
            "p95 time to first token",
            candidate.ttft_p95_ms,
            stable.ttft_p95_ms,
            g.max_ttft_p95_ratio,
        ),
        (
            "p95 time per output token",
            candidate.tpot_p95_ms,
            stable.tpot_p95_ms,
            g.max_tpot_p95_ratio,
        ),
    ] {
        if let (Some(c), Some(s)) = (c, s)
            && c > s * limit
        {
            return Verdict::RollBack(format!(
                "{name} {c:.1} ms against the stable version's {s:.1} ms (at most {limit}x)"
            ));
        }
    }
    if held {
        Verdict::Advance
    } else {
        Verdict::Wait("holding: the step's hold time is not over".into())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn figures(requests: u64, errors: u64, ttft: f64, tpot: f64) -> Figures {
        Figures {
            requests,
            errors,
            ttft_p95_ms: Some(ttft),
            tpot_p95_ms: Some(tpot),
        }
    }

    #[test]
    fn a_step_waits_for_requests_then_for_its_hold_time() {
        let g = Gates::default();
        let good = figures(100, 0, 50.0, 10.0);
        assert!(matches!(
            judge(&g, &figures(19, 0, 50.0, 10.0), &good, true),
            Verdict::Wait(w) if w.contains("19 of 20")
        ));
        assert!(matches!(
            judge(&g, &good, &figures(5, 0, 50.0, 10.0), true),
            Verdict::Wait(w) if w.starts_with("stable")
        ));
        assert!(matches!(judge(&g, &good, &good, false), Verdict::Wait(_)));
        assert_eq!(judge(&g, &good, &good, true), Verdict::Advance);
    }

    #[test]
    fn each_gate_rolls_back_before_the_hold_time_is_over() {
        let g = Gates::default();
        let stable = figures(100, 1, 50.0, 10.0);
        let cases = [
            (figures(20, 1, 50.0, 10.0), "error rate 5.00%"),
            (figures(20, 0, 76.0, 10.0), "time to first token 76.0 ms"),
            (figures(20, 0, 50.0, 15.1), "time per output token 15.1 ms"),
        ];
        for (candidate, why) in cases {
            match judge(&g, &candidate, &stable, false) {
                Verdict::RollBack(r) => assert!(r.contains(why), "{r}"),
                other => panic!("{candidate:?}: {other:?}"),
            }
        }
        // At the limits exactly, it passes.
        let at_limit = figures(100, 2, 75.0, 15.0);
        assert_eq!(judge(&g, &at_limit, &stable, true), Verdict::Advance);
    }

    #[test]
    fn steps_and_gates_are_refused_by_field() {
        assert!(check_steps(&[100, 1000, 5000, 10000]).is_ok());
        for (steps, why) in [
            (vec![], "between 2 and 20"),
            (vec![10000], "is a promote"),
            (vec![100, 100, 10000], "steps[1]: 100 does not rise"),
            (vec![0, 10000], "steps[0]: 0 is not in"),
            (vec![100, 5000], "must be 10000"),
            (vec![100, 20000], "steps[1]: 20000"),
        ] {
            let (field, msg) = check_steps(&steps).unwrap_err();
            assert_eq!(field, "steps");
            assert!(msg.contains(why), "{steps:?}: {msg}");
        }
        let bad = [
            (
                Gates {
                    min_requests: 0,
                    ..Gates::default()
                },
                "min_requests",
            ),
            (
                Gates {
                    max_error_rate_increase: 2.0,
                    ..Gates::default()
                },
                "max_error_rate_increase",
            ),
            (
                Gates {
                    max_ttft_p95_ratio: 0.5,
                    ..Gates::default()
                },
                "max_ttft_p95_ratio",
            ),
            (
                Gates {
                    max_tpot_p95_ratio: f64::NAN,
                    ..Gates::default()
                },
                "max_tpot_p95_ratio",
            ),
        ];
        for (g, field) in bad {
            assert_eq!(check_gates(&g).unwrap_err().0, field);
        }
    }
}
