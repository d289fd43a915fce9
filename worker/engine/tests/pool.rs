//! The adapter pool: eviction order (by value, and LRU), leases that prevent eviction,
//! counters on a thrashing trace, and more adapters than slots.

mod common;

use std::time::Duration;

use common::*;
use lorafleet_engine::backend::cpu::CpuBackend;
use lorafleet_engine::pool::{AdapterPool, PoolCounters};
use lorafleet_engine::{
    AdapterSource, Engine, EngineSettings, Prompt, Request, Residency, Sampling,
};

const MODEL: &str = "llama-gqa";

fn setup(slots: usize, host: usize) -> (AdapterPool, CpuBackend) {
    let (pool, backend, _) = fixture_pool(MODEL, slots, host);
    (pool, backend)
}

/// One request for `id` arriving and running to completion.
fn access(pool: &mut AdapterPool, backend: &mut CpuBackend, id: u64) -> Residency {
    let found = pool.on_arrival(aid(id));
    while pool.host_adapter(aid(id)).is_none() {
        assert!(
            pool.poll_loads(Some(Duration::from_secs(5))).is_empty(),
            "load failed"
        );
    }
    let slot = pool.ensure_device(aid(id), &[], backend).unwrap();
    assert!(slot.is_some(), "adapter {id} got a slot");
    let lease = pool.lease(aid(id));
    pool.on_dequeue(aid(id));
    drop(lease);
    found
}

/// `count` greedy requests of 4 tokens, request i on adapter i mod
/// `adapters` (ids from 1), with the prompt `prompt(i)`.
fn round_robin(count: u64, adapters: u64, prompt: impl Fn(u64) -> String) -> Vec<Request> {
    (0..count)
        .map(|i| Request {
            id: format!("r{i}").into(),
            adapter: Some(aid(i % adapters + 1)),
            prompt: Prompt::Text(prompt(i)),
            params: Sampling {
                max_tokens: 4,
                temperature: 0.0,
                ignore_eos: true,
                ..Default::default()
            }
            .validate()
            .unwrap(),
        })
        .collect()
}

fn device_set(pool: &AdapterPool) -> Vec<u64> {
    let mut v: Vec<u64> = (1..=10)
        .filter(|&id| pool.slot_of(aid(id)).is_some())
        .collect();
    v.sort();
    v
}

#[test]
fn by_value_a_popular_adapter_keeps_its_slot_over_recent_one_offs() {
    use lorafleet_engine::eviction::EvictionPolicy;
    for (policy, kept) in [
        (EvictionPolicy::Value, vec![1, 3, 4]),
        (EvictionPolicy::Lru, vec![2, 3, 4]),
    ] {
        let (mut pool, mut backend) = setup(3, 10);
        pool.set_eviction(policy);
        for _ in 0..5 {
            access(&mut pool, &mut backend, 1);
        }
        // Two one-offs after it: 1 is now the least recently used.
        access(&mut pool, &mut backend, 2);
        access(&mut pool, &mut backend, 3);
        access(&mut pool, &mut backend, 4);
        assert_eq!(device_set(&pool), kept, "{policy:?}");
    }
}

#[test]
fn the_least_recently_used_slot_is_evicted_first() {
    let (mut pool, mut backend) = setup(3, 10);
    pool.set_eviction(lorafleet_engine::eviction::EvictionPolicy::Lru);
    for id in [1, 2, 3] {
        access(&mut pool, &mut backend, id);
    }
    access(&mut pool, &mut backend, 1); // 2 is now the least recently used
    access(&mut pool, &mut backend, 4);
    assert_eq!(device_set(&pool), vec![1, 3, 4]);
    access(&mut pool, &mut backend, 5); // then 3
    assert_eq!(device_set(&pool), vec![1, 4, 5]);
    assert_eq!(
        pool.residency(aid(2)),
        Residency::Host,
        "evicted from the device, still on the host"
    );
}

#[test]
fn a_lease_or_a_pin_prevents_eviction() {
    let (mut pool, mut backend) = setup(1, 10);
    access(&mut pool, &mut backend, 1);
    let lease = pool.lease(aid(1));
    pool.on_arrival(aid(2));
    while pool.host_adapter(aid(2)).is_none() {
        pool.poll_loads(Some(Duration::from_secs(5)));
    }
    assert_eq!(
        pool.ensure_device(aid(2), &[], &mut backend).unwrap(),
        None,
        "the only slot is leased"
    );
    assert_eq!(pool.slot_of(aid(1)), Some(0));
    drop(lease);
    // One slot: only a pin cap above the default lets it be pinned.
    pool.set_max_pinned(1);
    pool.set_pinned(aid(1), true).unwrap();
    assert_eq!(
        pool.ensure_device(aid(2), &[], &mut backend).unwrap(),
        None,
        "the only slot is pinned"
    );
    pool.set_pinned(aid(1), false).unwrap();
    assert_eq!(
        pool.ensure_device(aid(2), &[], &mut backend).unwrap(),
        Some(0)
    );
    assert_eq!(pool.residency(aid(1)), Residency::Host);
}

#[test]
fn a_thrashing_trace_is_counted_right() {
    // Two slots, three host entries, trace 1 2 3 1 4 1 2.
    let (mut pool, mut backend) = setup(2, 3);
    let found: Vec<Residency> = [1, 2, 3, 1, 4, 1, 2]
        .iter()
        .map(|&id| access(&mut pool, &mut backend, id))
        .collect();
    use Residency::*;
    assert_eq!(
        found,
        vec![
            NotLoaded, NotLoaded, NotLoaded, Host, NotLoaded, Device, NotLoaded
        ]
    );
    // Worked by hand: 1 and 2 fill the slots; 3 evicts 1; 1 evicts 2; 4
    // pushes 2 out of the host tier and evicts 3; 1 hits; 2 is read again,
    // pushes 3 out of the host tier and evicts 4.
    assert_eq!(
        pool.counters(),
        PoolCounters {
            device_hits: 1,
            host_hits: 1,
            misses: 5,
            host_loads: 5,
            device_loads: 6,
            device_evictions: 4,
            host_evictions: 2,
            load_failures: 0,
            prefetches: 0,
            prefetch_hits: 0,
            late_loads: 0,
        }
    );
    assert_eq!(device_set(&pool), vec![1, 2]);
}

#[test]
fn more_distinct_adapters_than_slots_all_complete() {
    let settings = EngineSettings {
        max_loras: 2,
        max_cpu_loras: 3,
        ..Default::default()
    };
    let mut e = fixture_engine(MODEL, settings);
    let names = adapter_names(MODEL);
    let requests = round_robin(names.len() as u64 * 2, names.len() as u64, |_| {
        "The quick brown fox".into()
    });
    let results = e.run_to_completion(requests).unwrap();
    assert!(
        results
            .iter()
            .all(|c| c.finish.is_some() && c.token_ids.len() == 4),
        "every request completed"
    );
    let stats = e.stats();
    assert!(
        stats.pool.device_evictions >= 8 && stats.pool.host_evictions >= 7,
        "{:?}",
        stats.pool
    );
    assert!(
        stats.adapters.len() <= 3,
        "the host tier stays within max_cpu_loras once idle"
    );
}

#[test]
fn a_request_for_a_cold_adapter_is_not_starved_by_a_hot_one() {
    // One slot. Adapter 1 always has a request running and new ones arriving;
    // a request for adapter 2 waits behind them for the slot.
    let settings = EngineSettings {
        max_loras: 1,
        max_cpu_loras: 2,
        ..Default::default()
    };
    let mut e = Engine::load_cpu(&model_dir(MODEL), settings).unwrap();
    for id in [1u64, 2] {
        let name = &adapter_names(MODEL)[id as usize];
        e.register_adapter(
            aid(id),
            AdapterSource {
                name: name.clone(),
                dir: adapter_dir(MODEL, name),
                declared_base_hash: None,
                digest: None,
            },
        )
        .unwrap();
    }
    let request = |id: String, adapter: u64| Request {
        id: id.into(),
        adapter: Some(aid(adapter)),
        prompt: Prompt::Text("The quick brown fox".into()),
        params: Sampling {
            max_tokens: 6,
            temperature: 0.0,
            ignore_eos: true,
            ..Default::default()
        }
        .validate()
        .unwrap(),
    };
    e.submit(request("hot-0".into(), 1)).unwrap();
    e.step().unwrap();
    e.submit(request("cold".into(), 2)).unwrap();
    let mut cold_done_at = None;
    for step in 1..400 {
        e.submit(request(format!("hot-{step}"), 1)).unwrap();
        for (id, ev) in e.step().unwrap() {
            if id == "cold" && matches!(ev, lorafleet_engine::Event::Finished(_)) {
                cold_done_at = Some(step);
            }
        }
        if cold_done_at.is_some() {
            break;
        }
    }
    let at = cold_done_at.expect("the cold adapter's request finished despite the hot stream");
    assert!(
        at < 100,
        "it waited about STARVATION_STEPS plus a drain, not forever: {at} steps"
    );
}

#[test]
fn pins_are_capped_so_one_slot_serves_unpinned_traffic() {
    let (mut pool, mut backend) = setup(4, 10);
    for id in [1, 2, 3] {
        pool.set_pinned(aid(id), true).unwrap();
        access(&mut pool, &mut backend, id);
    }
    let err = pool.set_pinned(aid(4), true).unwrap_err();
    assert!(err.to_string().contains("max_pinned"), "{err}");
    // Unpinned adapters share the one slot left, one after another.
    for id in [4, 5, 6, 4] {
        access(&mut pool, &mut backend, id);
    }
    assert_eq!(device_set(&pool), vec![1, 2, 3, 4]);
    // Unpinning makes room for another pin.
    pool.set_pinned(aid(1), false).unwrap();
    pool.set_pinned(aid(4), true).unwrap();
}

#[test]
fn an_unload_during_a_load_leaves_the_adapter_unloaded() {
    let (mut pool, mut backend) = setup(2, 10);
    pool.request_load(aid(1));
    assert_eq!(pool.residency(aid(1)), Residency::Loading);
    pool.unload(aid(1), &mut backend).unwrap();
    assert_eq!(pool.residency(aid(1)), Residency::NotLoaded);
    while pool.loads_in_flight() > 0 {
        pool.poll_loads(Some(Duration::from_secs(5)));
    }
    assert_eq!(
        pool.residency(aid(1)),
        Residency::NotLoaded,
        "the load's result was dropped"
    );
    assert!(pool.host_adapter(aid(1)).is_none());
    // A request after the unload loads it again.
    assert_eq!(access(&mut pool, &mut backend, 1), Residency::NotLoaded);
    assert_eq!(pool.residency(aid(1)), Residency::Device);
}

#[test]
fn device_eviction_passes_over_adapters_that_requests_wait_for() {
    let (mut pool, mut backend) = setup(2, 10);
    access(&mut pool, &mut backend, 1);
    access(&mut pool, &mut backend, 2);
    // 1 is the least recently used, but a request waits for it.
    pool.on_arrival(aid(1));
    access(&mut pool, &mut backend, 3);
    assert_eq!(device_set(&pool), vec![1, 3], "2 went, not 1");
}

#[test]
fn an_unloaded_id_may_come_back_with_other_files() {
    let (mut pool, mut backend) = setup(2, 10);
    access(&mut pool, &mut backend, 1);
    let other = fixture_source(MODEL, "patterns");
    assert!(
        pool.register(aid(1), other.clone()).is_err(),
        "not while it is resident"
    );
    pool.unload(aid(1), &mut backend).unwrap();
    pool.register(aid(1), other).unwrap();
    assert_eq!(access(&mut pool, &mut backend, 1), Residency::NotLoaded);
    assert_eq!(pool.host_adapter(aid(1)).unwrap().name, "patterns");
}

/// Found by `pool_props`: an unload waiting on a queued request, then a
/// pin. The pin asks for the adapter again, so the unload is dropped and
/// the pinned adapter is never evicted.
#[test]
fn a_pin_after_a_pending_unload_keeps_the_adapter() {
    let (mut pool, mut backend) = setup(2, 10);
    pool.on_arrival(aid(4));
    while pool.loads_in_flight() > 0 {
        pool.poll_loads(Some(Duration::from_secs(5)));
    }
    let slot = pool.ensure_device(aid(4), &[], &mut backend).unwrap();
    assert!(slot.is_some());
    pool.unload(aid(4), &mut backend).unwrap();
    pool.set_pinned(aid(4), true).unwrap();
    pool.on_dequeue(aid(4));
    pool.settle_unloads(&mut backend).unwrap();
    assert_eq!(pool.slot_of(aid(4)), slot, "the pin kept it");
    for id in [1, 2, 3] {
        access(&mut pool, &mut backend, id);
    }
    assert_eq!(
        pool.slot_of(aid(4)),
        slot,
        "a pinned adapter is never evicted"
    );
}

#[test]
fn an_adapter_with_expert_weights_costs_its_real_size_in_the_host_tier() {
    // qwen3-moe's fixture adapters, ids in name order: 1 all-linear-r4,
    // 2 experts-only-r8, 3 experts-r4, 4 kv-r16, 5 patterns, 6 qv-r8.
    let (mut pool, mut backend, n) = fixture_pool("qwen3-moe", 1, 6);
    assert_eq!(n, 6);
    let (experts_id, qv_id, kv_id) = (3, 6, 4);
    for id in [experts_id, qv_id, kv_id] {
        access(&mut pool, &mut backend, id);
    }
    let bytes = |pool: &AdapterPool, id: u64| pool.host_adapter(aid(id)).map(|a| a.bytes);
    let (experts, qv, kv) = (
        bytes(&pool, experts_id).unwrap(),
        bytes(&pool, qv_id).unwrap(),
        bytes(&pool, kv_id).unwrap(),
    );
    assert!(
        experts > qv.max(kv),
        "LoRA on every expert weighs more: {experts} vs {qv} and {kv}"
    );
    assert_eq!(pool.host_bytes(), experts + qv + kv);
    // Three adapters are well under the count of 5; the byte budget fits
    // the two attention-only ones, so the least recently used goes.
    pool.set_host_byte_budget(Some(qv + kv));
    assert_eq!(
        bytes(&pool, experts_id),
        None,
        "the expert adapter left the host tier"
    );
    assert!(bytes(&pool, qv_id).is_some() && bytes(&pool, kv_id).is_some());
    assert_eq!(pool.counters().host_evictions, 1);
    assert!(pool.host_bytes() <= qv + kv);
    // Brought back, it pushes out what it needs to, least recently used
    // first, but never the adapter in the device slot.
    access(&mut pool, &mut backend, experts_id);
    assert!(bytes(&pool, experts_id).is_some());
    assert_eq!(bytes(&pool, qv_id), None);
    assert_eq!(bytes(&pool, kv_id), None);
}

/// Requests spread round-robin over more adapters than device slots, all
/// waiting at once: admission by residency serves each resident adapter's
/// queued requests before loading another, so the loads are about one per
/// adapter, where arrival order made one per request (every admission
/// evicted an adapter that the next requests needed). The tokens are those
/// of a run where every adapter has a slot of its own.
#[test]
fn admission_by_residency_loads_each_adapter_about_once() {
    let adapters = adapter_names(MODEL).len() as u64;
    assert!(adapters >= 8, "the fixture has enough adapters");
    let requests = round_robin(4 * adapters, adapters, |i| {
        format!("request {i}: the quick brown fox")
    });
    let run = |slots: usize| {
        let mut e = fixture_engine(
            MODEL,
            EngineSettings {
                max_loras: slots,
                max_cpu_loras: adapters as usize,
                max_num_seqs: 4,
                ..Default::default()
            },
        );
        for id in 1..=adapters {
            e.prefetch(aid(id));
        }
        while e.pool().loads_in_flight() > 0 {
            e.pool().poll_loads(Some(Duration::from_secs(5)));
        }
        let mut done = e.run_to_completion(requests.clone()).unwrap();
        done.sort_by(|a, b| a.request_id.cmp(&b.request_id));
        let tokens: Vec<Vec<u32>> = done
            .into_iter()
            .map(|c| {
                assert!(c.error.is_none(), "{:?}", c.error);
                c.token_ids
            })
            .collect();
        (tokens, e.stats().pool.device_loads)
    };
    let (every_slot, loads_with_room) = run(adapters as usize);
    assert_eq!(loads_with_room, adapters, "one load per adapter with room");
    let (four_slots, loads) = run(4);
    assert_eq!(
        four_slots, every_slot,
        "admission order changes no request's tokens"
    );
    // Arrival order: one load per request (4 x adapters). Residency
    // first: each adapter once, plus the few that anti-starvation forces.
    assert!(
        loads <= adapters + adapters / 2,
        "{loads} device loads for {} requests over {adapters} adapters and 4 slots",
        requests.len()
    );
}

/// The scheduler issue's case: 96 interleaved requests over 4 adapters
/// with 2 device slots load at most 12 times (arrival order loads about
/// once per request), all finish, and each output equals the request run
/// alone.
#[test]
fn ninety_six_interleaved_requests_over_four_adapters_and_two_slots_load_at_most_twelve_times() {
    let requests = round_robin(96, 4, |i| format!("request {i}: over the lazy dog"));
    let engine = |slots: usize| {
        let mut e = fixture_engine(
            MODEL,
            EngineSettings {
                max_loras: slots,
                max_cpu_loras: 4,
                max_num_seqs: 8,
                ..Default::default()
            },
        );
        for id in 1..=4 {
            e.prefetch(aid(id));
        }
        while e.pool().loads_in_flight() > 0 {
            e.pool().poll_loads(Some(Duration::from_secs(5)));
        }
        e
    };
    let mut e = engine(2);
    let mut done = e.run_to_completion(requests.clone()).unwrap();
    let loads = e.stats().pool.device_loads;
    assert_eq!(done.len(), 96, "every request finishes");
    assert!(
        loads <= 12,
        "{loads} device loads for 96 requests on 2 slots"
    );
    done.sort_by(|a, b| a.request_id.cmp(&b.request_id));
    // Alone: one request at a time, with a slot for each adapter.
    let mut alone_engine = engine(4);
    let mut alone: Vec<_> = requests
        .iter()
        .map(|r| {
            alone_engine
                .run_to_completion(vec![r.clone()])
                .unwrap()
                .remove(0)
        })
        .collect();
    alone.sort_by(|a, b| a.request_id.cmp(&b.request_id));
    for (batched, single) in done.iter().zip(&alone) {
        assert!(batched.error.is_none(), "{:?}", batched.error);
        assert_eq!(
            batched.token_ids, single.token_ids,
            "{}: batched with the others as alone",
            batched.request_id
        );
    }
}

/// Prefetch: with free slots and requests that wait for their turn (one
/// sequence a step), the adapters the waiting requests need are copied into
/// the free slots while the first one runs, and each later admission finds
/// its adapter there. The loads are the same (one per adapter), and so are
/// the tokens.
#[test]
fn free_slots_take_the_waiting_requests_adapters_before_their_admission() {
    let requests = round_robin(4, 4, |i| format!("request {i}: a prefetch"));
    let run = |settings: EngineSettings| {
        let mut e = fixture_engine(MODEL, settings);
        for id in 1..=4 {
            e.prefetch(aid(id));
        }
        while e.pool().loads_in_flight() > 0 {
            e.pool().poll_loads(Some(Duration::from_secs(5)));
        }
        let mut done = e.run_to_completion(requests.clone()).unwrap();
        done.sort_by(|a, b| a.request_id.cmp(&b.request_id));
        let tokens: Vec<Vec<u32>> = done.into_iter().map(|c| c.token_ids).collect();
        (tokens, e.stats().pool)
    };
    let (one_at_a_time, pool) = run(EngineSettings {
        max_loras: 4,
        max_cpu_loras: 4,
        max_num_seqs: 1,
        ..Default::default()
    });
    assert_eq!(pool.device_loads, 4, "{pool:?}");
    assert_eq!(
        pool.prefetches, 3,
        "the three waiting requests' adapters: {pool:?}"
    );
    assert_eq!(
        pool.prefetch_hits, 3,
        "each used by its admission: {pool:?}"
    );
    let (together, _) = run(EngineSettings {
        max_loras: 4,
        max_cpu_loras: 4,
        max_num_seqs: 4,
        ..Default::default()
    });
    assert_eq!(one_at_a_time, together, "prefetch changes no token");
    // No free slot, no prefetch: a guess never evicts.
    let (_, full) = run(EngineSettings {
        max_loras: 1,
        max_cpu_loras: 4,
        max_num_seqs: 1,
        ..Default::default()
    });
    assert_eq!((full.prefetches, full.device_loads), (0, 4), "{full:?}");
}

/// The time a request waited for its adapter: none for the base model,
/// zero for an adapter already in a slot, and, with one slot, the second
/// adapter's request waits at least as long as the first one runs.
#[test]
fn the_wait_for_an_adapter_is_measured() {
    let settings = EngineSettings {
        max_loras: 1,
        max_cpu_loras: 10,
        ..Default::default()
    };
    let mut e = fixture_engine(MODEL, settings);
    let mut requests = round_robin(2, 2, |i| format!("wait {i}"));
    let mut base = requests[0].clone();
    base.id = "base".into();
    base.adapter = None;
    requests.push(base);
    let done = e.run_to_completion(requests).unwrap();
    let finish = |id: &str| {
        done.iter()
            .find(|c| c.request_id == id)
            .and_then(|c| c.finish.clone())
            .unwrap()
    };
    let (first, second) = (finish("r0"), finish("r1"));
    assert_eq!(finish("base").adapter_wait, None);
    let waited = second.adapter_wait.expect("an adapter request");
    assert!(
        waited + Duration::from_millis(5) >= first.total_time,
        "r1 waited {waited:?} for the only slot, which r0 held for {:?}",
        first.total_time
    );
    // Its adapter now in the slot, a new request waits for nothing.
    let again = e
        .run_to_completion(vec![Request {
            id: "again".into(),
            ..round_robin(2, 2, |i| format!("wait {i}"))[1].clone()
        }])
        .unwrap();
    assert_eq!(
        again[0].finish.as_ref().unwrap().adapter_wait,
        Some(Duration::ZERO)
    );
}

/// A load at admission is counted as late when a prefetch could have
/// started it a step earlier (the adapter was in the host tier, requests
/// waited for it and a slot was free, but the step's prefetches, at most
/// `PREFETCH_PER_STEP`, went to others); requests that arrive one step
/// apart are all prefetched in time and none is late.
#[test]
fn loads_that_a_prefetch_could_have_started_are_counted_as_late() {
    let engine = || {
        let mut e = fixture_engine(
            MODEL,
            EngineSettings {
                max_loras: 8,
                max_cpu_loras: 10,
                max_num_seqs: 4,
                ..Default::default()
            },
        );
        for id in 1..=10 {
            e.prefetch(aid(id));
        }
        while e.pool().loads_in_flight() > 0 {
            e.pool().poll_loads(Some(Duration::from_secs(5)));
        }
        e
    };
    let one_token = |i: u64| Request {
        id: format!("r{i}").into(),
        adapter: Some(aid(i % 10 + 1)),
        prompt: Prompt::Text(format!("request {i}")),
        params: Sampling {
            max_tokens: 1,
            temperature: 0.0,
            ..Default::default()
        }
        .validate()
        .unwrap(),
    };
    // Ten at once, four a step: the first four load at admission (nothing
    // could have been prefetched before), two are prefetched, and the
    // next step's other two loads are late.
    let mut e = engine();
    let done = e
        .run_to_completion((0..10).map(one_token).collect())
        .unwrap();
    assert!(done.iter().all(|c| c.error.is_none()));
    let p = e.stats().pool;
    assert!(p.late_loads >= 2, "{p:?}");
    assert!(p.late_loads <= p.device_loads - p.prefetches, "{p:?}");
    // One arrival a step: each is admitted the step it arrives, before
    // any prefetch could start it, so none is late.
    let mut e = engine();
    for i in 0..10 {
        e.submit(one_token(i)).unwrap();
        e.step().unwrap();
    }
    while e.has_work() {
        e.step().unwrap();
    }
    let p = e.stats().pool;
    assert_eq!(p.late_loads, 0, "{p:?}");
    assert_eq!(p.device_loads, 10, "{p:?}");
}
