//! Properties of the routing policy over random fleets: loads, residency,
//! eligibility and membership drawn at random, each property checked on
//! every decision.

use proptest::prelude::*;

use super::policy::{Policy, Reason, Router, Tier, WorkerView};

fn ids(n: usize) -> Vec<String> {
    (0..n).map(|i| format!("worker-{i}")).collect()
}

fn residency() -> impl Strategy<Value = Tier> {
    prop_oneof![Just(Tier::Device), Just(Tier::Host), Just(Tier::Absent)]
}

/// A fleet of 1-12 workers, each with a load, a residency and eligibility.
fn fleet() -> impl Strategy<Value = Vec<(u32, Tier, bool)>> {
    prop::collection::vec((0u32..40, residency(), prop::bool::weighted(0.8)), 1..12)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    /// The first choice is at or under the load bound that applies to it
    /// (the resident one where the adapter is in its device slots) unless
    /// every eligible worker is at its bound (then the decision says
    /// Saturated), and no choice at all is ineligible.
    #[test]
    fn the_first_choice_respects_the_bound_and_eligibility(
        fleet in fleet(),
        key in 0u64..1000,
        load_factor in 1.0f64..2.0,
        resident_extra in 0.0f64..1.0,
    ) {
        let names = ids(fleet.len());
        let refs: Vec<&str> = names.iter().map(String::as_str).collect();
        let mut router = Router::new(Policy {
            load_factor,
            resident_load_factor: load_factor + resident_extra,
        });
        router.set_workers(&refs);
        let views: Vec<WorkerView<'_>> = fleet
            .iter()
            .zip(&names)
            .map(|(&(load, residency, eligible), id)| WorkerView { id, load, residency, eligible })
            .collect();
        let eligible: Vec<usize> = (0..views.len()).filter(|&i| views[i].eligible).collect();
        let Some(decision) = router.choose(key, &views) else {
            prop_assert!(eligible.is_empty(), "a decision whenever a worker is eligible");
            return Ok(());
        };
        prop_assert!(!eligible.is_empty());
        for &i in &decision.order {
            prop_assert!(views[i].eligible, "worker {i} is not eligible but was chosen");
        }
        let total: u64 = eligible.iter().map(|&i| u64::from(views[i].load)).sum();
        // The policy's bounds, with their floor (an idle fleet's bound is
        // never below MIN_BOUND), computed here from their definitions.
        let mean = (total + 1) as f64 / eligible.len() as f64;
        let floor = crate::router::policy::MIN_BOUND;
        let bound = (load_factor * mean).ceil().max(floor);
        let resident = ((load_factor + resident_extra) * mean).ceil().max(floor);
        let under = |i: usize| {
            let b = if key != 0 && views[i].residency == Tier::Device { resident } else { bound };
            f64::from(views[i].load) + 1.0 <= b
        };
        let first = decision.order[0];
        if decision.reason == Reason::Saturated {
            prop_assert!(eligible.iter().all(|&i| !under(i)), "Saturated while {eligible:?} had room");
        } else {
            prop_assert!(under(first), "first choice {first} is over the bound {bound}");
        }
    }

    /// Removing one of N workers moves exactly the keys it owned: every
    /// other key keeps its ring owner, so about 1/N of adapters move.
    #[test]
    fn removing_a_worker_moves_only_its_own_keys(n in 2usize..12, gone in 0usize..12) {
        let gone = gone % n;
        let names = ids(n);
        let all: Vec<&str> = names.iter().map(String::as_str).collect();
        let rest: Vec<&str> = all.iter().copied().filter(|&w| w != all[gone]).collect();
        let mut before = Router::new(Policy::default());
        before.set_workers(&all);
        let mut after = Router::new(Policy::default());
        after.set_workers(&rest);
        let keys = 4000u64;
        let mut moved = 0u64;
        for key in 1..=keys {
            let owner = all[before.ring_order(key)[0]];
            let now = rest[after.ring_order(key)[0]];
            if owner == all[gone] {
                moved += 1;
            } else {
                prop_assert_eq!(owner, now, "key {} moved off a worker that stayed", key);
            }
        }
        // Each worker owns about 1/N of the keys (160 virtual nodes each).
        let share = moved as f64 / keys as f64;
        let expected = 1.0 / n as f64;
        prop_assert!(
            (share - expected).abs() < expected * 0.5,
            "{moved} of {keys} keys moved with {n} workers"
        );
    }
}
