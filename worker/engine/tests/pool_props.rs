//! The adapter pool under random sequences of operations: arrivals (with
//! their loads and device placement), leases taken and dropped, pins,
//! dequeues and unloads. After every operation: an adapter that was on the
//! device while leased or pinned is still there, no slot holds two
//! adapters, and the counters add up.

mod common;

use std::collections::HashMap;
use std::time::Duration;

use common::*;
use lorafleet_engine::backend::cpu::CpuBackend;
use lorafleet_engine::pool::{AdapterPool, Lease};
use proptest::prelude::*;

const MODEL: &str = "llama-gqa";
const SLOTS: usize = 2;
const HOST: usize = 3;

#[derive(Debug, Clone)]
enum Op {
    Arrive(u64),
    Lease(u64),
    Release(usize),
    Pin(u64, bool),
    Dequeue(u64),
    Unload(u64),
}

fn op(adapters: u64) -> impl Strategy<Value = Op> {
    let id = 1..=adapters;
    prop_oneof![
        4 => id.clone().prop_map(Op::Arrive),
        2 => id.clone().prop_map(Op::Lease),
        2 => (0usize..8).prop_map(Op::Release),
        1 => (id.clone(), any::<bool>()).prop_map(|(i, p)| Op::Pin(i, p)),
        2 => id.clone().prop_map(Op::Dequeue),
        1 => id.prop_map(Op::Unload),
    ]
}

fn setup() -> (AdapterPool, CpuBackend, u64) {
    fixture_pool(MODEL, SLOTS, HOST)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(96))]

    #[test]
    fn leased_or_pinned_adapters_stay_and_counters_add_up(
        ops in prop::collection::vec(op(5), 1..48)
    ) {
        let (mut pool, mut backend, adapters) = setup();
        let mut leases: Vec<Lease> = Vec::new();
        let mut pinned: HashMap<u64, bool> = HashMap::new();
        let mut arrivals = 0u64;
        // Unloads asked for and not yet undone by an arrival: these may
        // leave the device as soon as their leases end.
        let mut unloading: std::collections::HashSet<u64> = Default::default();
        for op in ops {
            // What must stay on the device through this operation.
            let held: Vec<(u64, usize)> = (1..=adapters)
                .filter(|id| {
                    leases.iter().any(|l| l.adapter() == aid(*id))
                        || pinned.get(id).copied().unwrap_or(false)
                })
                .filter(|id| !unloading.contains(id))
                .filter_map(|id| pool.slot_of(aid(id)).map(|s| (id, s)))
                .collect();
            match op {
                Op::Arrive(id) if id <= adapters => {
                    pool.on_arrival(aid(id));
                    unloading.remove(&id);
                    arrivals += 1;
                    while pool.loads_in_flight() > 0 {
                        pool.poll_loads(Some(Duration::from_secs(5)));
                    }
                    pool.ensure_device(aid(id), &[], &mut backend).unwrap();
                }
                Op::Lease(id) if id <= adapters && pool.slot_of(aid(id)).is_some() => {
                    leases.push(pool.lease(aid(id)));
                }
                Op::Release(k) if !leases.is_empty() => {
                    leases.remove(k % leases.len());
                    pool.settle_unloads(&mut backend).unwrap();
                }
                Op::Pin(id, pin) if id <= adapters && pool.set_pinned(aid(id), pin).is_ok() => {
                    pinned.insert(id, pin);
                    if pin {
                        unloading.remove(&id);
                    }
                }
                Op::Dequeue(id) if id <= adapters => pool.on_dequeue(aid(id)),
                Op::Unload(id) if id <= adapters => {
                    pool.unload(aid(id), &mut backend).unwrap();
                    // An unload takes the adapter out of both tiers and
                    // ends its pin (at once, or when its last lease ends).
                    pinned.remove(&id);
                    unloading.insert(id);
                }
                _ => {}
            }
            for (id, slot) in held {
                // Unloaded by this very operation: leaving is right.
                if unloading.contains(&id) {
                    continue;
                }
                prop_assert_eq!(
                    pool.slot_of(aid(id)),
                    Some(slot),
                    "adapter {} was leased or pinned in slot {} and lost it",
                    id,
                    slot
                );
            }
            let mut slots: Vec<usize> = (1..=adapters).filter_map(|id| pool.slot_of(aid(id))).collect();
            let occupied = slots.len();
            slots.sort_unstable();
            slots.dedup();
            prop_assert_eq!(slots.len(), occupied, "two adapters share a slot");
            prop_assert!(occupied <= SLOTS);
            let c = pool.counters();
            prop_assert_eq!(c.device_hits + c.host_hits + c.misses, arrivals);
            prop_assert!(c.device_loads >= c.device_evictions + occupied as u64);
        }
    }
}
