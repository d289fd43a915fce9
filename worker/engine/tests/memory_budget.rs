//! One memory budget for KV blocks and adapter slots: the split between
//! them follows the work (few adapters and long sequences get KV, many
//! adapters get slots), the two never pass the budget together (an
//! adapter's own lm_head, packed beside its slot, counted too), an adapter
//! with live sequences is never evicted to make room, and outputs are the
//! same as each request run alone.

mod common;

use std::collections::HashMap;

use common::*;
use lorafleet_engine::backend::cpu::CpuBackend;
use lorafleet_engine::budget::MemoryUnits;
use lorafleet_engine::model::ModelConfig;
use lorafleet_engine::pool::Residency;
use lorafleet_engine::{Engine, EngineSettings, Event, Prompt, Request, Sampling};
use proptest::prelude::*;

const MODEL: &str = "llama-gqa";
const BLOCK_SIZE: usize = 16;
const MAX_LORA_RANK: usize = 16;

fn units() -> MemoryUnits {
    let config = ModelConfig::from_dir(&model_dir(MODEL)).unwrap();
    CpuBackend::memory_units(&config, BLOCK_SIZE, MAX_LORA_RANK)
}

/// A budget of `slots` adapter slots and `blocks` KV blocks' bytes.
fn budget(slots: u64, blocks: u64) -> u64 {
    let u = units();
    slots * u.slot_bytes + blocks * u.block_bytes
}

fn settings(budget_bytes: u64, max_loras: usize) -> EngineSettings {
    EngineSettings {
        max_loras,
        max_lora_rank: MAX_LORA_RANK,
        max_cpu_loras: 12,
        block_size: BLOCK_SIZE,
        max_num_seqs: 16,
        max_batched_tokens: 256,
        memory_budget_bytes: Some(budget_bytes),
        ..Default::default()
    }
}

fn request(id: String, adapter: u64, prompt_tokens: usize, max_tokens: usize) -> Request {
    // Token ids 3.. (below the vocabulary of 384), varied per request.
    let salt = id.bytes().map(u32::from).sum::<u32>();
    Request {
        adapter: (adapter > 0).then(|| aid(adapter)),
        prompt: Prompt::TokenIds(
            (0..prompt_tokens as u32)
                .map(|i| 3 + (i * 7 + salt) % 380)
                .collect(),
        ),
        params: Sampling {
            max_tokens,
            temperature: 0.0,
            ignore_eos: true,
            ..Default::default()
        }
        .validate()
        .unwrap(),
        id: id.into(),
    }
}

/// Each request's tokens, run alone on an engine with room to spare.
fn alone(requests: &[Request]) -> HashMap<String, Vec<u32>> {
    let mut e = fixture_engine(
        MODEL,
        EngineSettings {
            max_loras: 1,
            max_cpu_loras: 1,
            block_size: BLOCK_SIZE,
            ..Default::default()
        },
    );
    requests
        .iter()
        .map(|r| {
            let c = e.run_to_completion(vec![r.clone()]).unwrap().pop().unwrap();
            assert!(c.error.is_none(), "{:?}", c.error);
            (r.id.to_string(), c.token_ids)
        })
        .collect()
}

/// One step: each request's new tokens added to its output; returns how
/// many requests finished (a failed one fails the test).
fn step_into(e: &mut Engine, outputs: &mut HashMap<String, Vec<u32>>) -> usize {
    let mut finished = 0;
    for (id, event) in e.step().unwrap() {
        match event {
            Event::Delta { token_ids, .. } => outputs
                .entry(id.into_string())
                .or_default()
                .extend(token_ids),
            Event::Finished(_) => finished += 1,
            Event::Failed(err) => panic!("{id}: {err}"),
            Event::PromptLogprobs(_) => {}
        }
    }
    finished
}

/// The most of each side a run used, in blocks and slots.
#[derive(Debug, Default, Clone, Copy)]
struct Peaks {
    kv_blocks: u64,
    slots: u64,
}

/// Submits `requests` (`per_step` every step) and steps until all finish,
/// checking after every step that the budget holds and that every adapter
/// a sequence leases is on the device. Returns the peaks.
fn run(
    e: &mut Engine,
    requests: &[Request],
    per_step: usize,
    outputs: &mut HashMap<String, Vec<u32>>,
) -> Peaks {
    let u = units();
    let mut pending = requests.iter();
    let mut left = requests.len();
    let mut peaks = Peaks::default();
    let mut steps = 0;
    while left > 0 {
        for r in pending.by_ref().take(per_step) {
            e.submit(r.clone()).unwrap();
        }
        left -= step_into(e, outputs);
        let stats = e.stats();
        let m = stats.memory.expect("the engine has a budget");
        assert!(
            m.kv + m.adapters <= m.budget,
            "step {steps}: KV {} + adapters {} bytes pass the budget {}",
            m.kv,
            m.adapters,
            m.budget
        );
        for a in &stats.adapters {
            assert!(
                a.active == 0 || a.residency == Residency::Device,
                "step {steps}: adapter {} has {} leases but is {:?}",
                a.id,
                a.active,
                a.residency
            );
        }
        peaks.kv_blocks = peaks.kv_blocks.max(m.kv / u.block_bytes);
        peaks.slots = peaks.slots.max(m.adapters / u.slot_bytes);
        steps += 1;
        assert!(steps < 20_000, "the work never drained");
    }
    peaks
}

#[test]
fn the_split_between_kv_and_adapter_slots_follows_the_work() {
    let u = units();
    assert!(
        u.slot_bytes > 8 * u.block_bytes,
        "a slot of the test model weighs many KV blocks ({} vs {})",
        u.slot_bytes,
        u.block_bytes
    );
    // Four slots and forty blocks' worth, shared.
    let bytes = budget(4, 40);
    // Long sequences on one adapter: 10 × 130 positions = 90 blocks.
    let long: Vec<Request> = (0..10)
        .map(|i| request(format!("long{i}"), 1, 70, 60))
        .collect();
    // Short sequences on all ten adapters.
    let many: Vec<Request> = (0..30)
        .map(|i| request(format!("many{i}"), 1 + i % 10, 8, 4))
        .collect();
    let again: Vec<Request> = (0..10)
        .map(|i| request(format!("again{i}"), 2, 70, 60))
        .collect();
    let everything: Vec<Request> = long.iter().chain(&many).chain(&again).cloned().collect();
    let expected = alone(&everything);

    let mut e = fixture_engine(MODEL, settings(bytes, 8));
    assert_eq!(
        e.settings().kv_blocks as u64,
        (bytes - u.slot_bytes) / u.block_bytes,
        "the KV cache is the budget less one slot"
    );
    let mut outputs = HashMap::new();
    let first = run(&mut e, &long, 10, &mut outputs);
    let second = run(&mut e, &many, 30, &mut outputs);
    let evictions_before = e.stats().pool.device_evictions;
    let third = run(&mut e, &again, 10, &mut outputs);

    // With few adapters, KV took what four fixed slots would have kept:
    // more than the budget less two slots holds.
    let kv_beside_two_slots = (bytes - 2 * u.slot_bytes) / u.block_bytes;
    assert!(
        first.kv_blocks > kv_beside_two_slots,
        "long sequences peaked at {} KV blocks; a split with two slots has {kv_beside_two_slots}",
        first.kv_blocks
    );
    // With many adapters, slots took what that KV held: more slots at
    // once than fit beside the first phase's KV.
    let slots_beside_first = (bytes - first.kv_blocks * u.block_bytes) / u.slot_bytes;
    assert!(
        second.slots >= 4 && second.slots > slots_beside_first,
        "ten adapters peaked at {} slots; beside the first phase's KV only {slots_beside_first} fit",
        second.slots
    );
    // And back: KV took the slots' bytes again, emptying resident adapters
    // nobody was using.
    assert!(
        third.kv_blocks > kv_beside_two_slots,
        "the third phase peaked at {} KV blocks",
        third.kv_blocks
    );
    assert!(
        e.stats().pool.device_evictions > evictions_before,
        "idle adapters left their slots for KV"
    );
    for r in &everything {
        assert_eq!(outputs[r.id.as_str()], expected[r.id.as_str()], "{}", r.id);
    }
}

#[test]
fn a_sequence_that_needs_a_preempted_ones_slot_for_its_kv_gets_it() {
    // Two slots and ten blocks: two long sequences on two adapters start
    // together. Beside both slots KV holds 10 blocks; each needs 15 in the
    // end, so the newer is preempted and, holding no KV, gives its lease
    // and then its slot's bytes to the older. Without that the older
    // would preempt itself over and over.
    let bytes = budget(2, 10);
    let requests = vec![
        request("a".into(), 1, 40, 200),
        request("b".into(), 2, 40, 200),
    ];
    let expected = alone(&requests);
    let mut e = fixture_engine(MODEL, settings(bytes, 2));
    let mut outputs = HashMap::new();
    run(&mut e, &requests, 2, &mut outputs);
    for r in &requests {
        assert_eq!(outputs[r.id.as_str()], expected[r.id.as_str()], "{}", r.id);
    }
    assert!(
        e.stats().pool.device_evictions > 0,
        "the preempted sequence's adapter left its slot for KV"
    );
}

#[test]
fn a_budget_that_cannot_hold_a_slot_and_a_block_is_refused_by_name() {
    let u = units();
    let err = Engine::load_cpu(
        &model_dir(MODEL),
        settings(u.slot_bytes + u.block_bytes - 1, 4),
    )
    .unwrap_err()
    .to_string();
    assert!(err.starts_with("memory_budget_bytes: "), "{err}");
    // A request longer than the budget's KV is refused at submission.
    let mut e = fixture_engine(MODEL, settings(budget(1, 4), 4));
    let err = e
        .submit(request("big".into(), 1, 60, 40))
        .unwrap_err()
        .to_string();
    assert!(err.contains("KV blocks"), "{err}");
}

#[test]
fn the_cuda_backend_refuses_a_shared_budget_by_name() {
    let err = Engine::load(
        &model_dir(MODEL),
        settings(budget(4, 40), 4),
        lorafleet_engine::BackendChoice::Cuda {
            device: 0,
            dtype: lorafleet_engine::backend::cuda::Dtype::F32,
            lora_dtype: lorafleet_engine::backend::cuda::Dtype::F32,
            graphs: false,
            pdl: false,
        },
    )
    .unwrap_err()
    .to_string();
    // Without a GPU the probe may refuse first; either way nothing loads.
    assert!(
        err.starts_with("memory_budget_bytes: ") || err.to_lowercase().contains("cuda"),
        "{err}"
    );
}

#[derive(Debug, Clone)]
struct Arrival {
    adapter: u64,
    prompt_tokens: usize,
    max_tokens: usize,
}

fn arrival() -> impl Strategy<Value = Arrival> {
    (0u64..=10, 1usize..96, 1usize..48).prop_map(|(adapter, prompt_tokens, max_tokens)| Arrival {
        adapter,
        prompt_tokens,
        max_tokens,
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    /// Random work under random budgets: after every step the budget
    /// holds and every leased adapter is on the device; every request
    /// finishes with the tokens it gets alone.
    #[test]
    fn under_any_budget_the_accounting_holds_and_outputs_do_not_change(
        slots in 1u64..5,
        blocks in 10u64..48,
        max_loras in 1usize..8,
        per_step in 1usize..8,
        arrivals in prop::collection::vec(arrival(), 1..24),
    ) {
        let requests: Vec<Request> = arrivals
            .iter()
            .enumerate()
            .map(|(i, a)| request(format!("p{i}"), a.adapter, a.prompt_tokens, a.max_tokens))
            .collect();
        let expected = alone(&requests);
        let mut e = fixture_engine(MODEL, settings(budget(slots, blocks), max_loras));
        let mut outputs = HashMap::new();
        run(&mut e, &requests, per_step, &mut outputs);
        for r in &requests {
            prop_assert_eq!(&outputs[r.id.as_str()], &expected[r.id.as_str()], "{}", r.id);
        }
    }
}

/// Submits `requests` (`per_step` every step) and steps until all finish,
/// checking after every step that the budget's adapter bytes are the
/// filled slots and, beside the adapters in `own_heads`, their lm_heads of
/// `head` bytes, and that KV and adapters never pass the budget. Returns
/// the outputs and whether every adapter of `own_heads` was on the device
/// at once.
fn drain_counting_heads(
    e: &mut Engine,
    requests: &[Request],
    per_step: usize,
    own_heads: &[lorafleet_engine::pool::AdapterId],
    head: u64,
) -> (HashMap<String, Vec<u32>>, bool) {
    let u = units();
    // Every adapter the requests name in the host tier first, so the
    // device slots are contended however fast the steps run (an optimized
    // build otherwise drained one head's requests while the other's
    // adapter was still being read).
    for id in requests.iter().filter_map(|r| r.adapter) {
        e.prefetch(id);
    }
    while e.pool().loads_in_flight() > 0 {
        e.pool().poll_loads(Some(std::time::Duration::from_secs(5)));
    }
    let mut outputs: HashMap<String, Vec<u32>> = HashMap::new();
    let (mut pending, mut left, mut steps) = (requests.iter(), requests.len(), 0);
    let mut all_heads_resident = false;
    while left > 0 {
        for r in pending.by_ref().take(per_step) {
            e.submit(r.clone()).unwrap();
        }
        left -= step_into(e, &mut outputs);
        let stats = e.stats();
        let m = stats.memory.expect("the engine has a budget");
        let resident: Vec<_> = stats
            .adapters
            .iter()
            .filter(|a| a.residency == Residency::Device)
            .map(|a| a.id)
            .collect();
        let held: u64 = resident
            .iter()
            .map(|id| u.slot_bytes + if own_heads.contains(id) { head } else { 0 })
            .sum();
        assert_eq!(
            m.adapters, held,
            "step {steps}: the budget's adapter bytes against the slots and heads held ({resident:?})"
        );
        assert!(
            m.kv + m.adapters <= m.budget,
            "step {steps}: KV {} + adapters {} bytes pass the budget {}",
            m.kv,
            m.adapters,
            m.budget
        );
        all_heads_resident |= own_heads.iter().all(|h| resident.contains(h));
        steps += 1;
        assert!(steps < 20_000, "the work never drained");
    }
    (outputs, all_heads_resident)
}

/// Adapters with an lm_head of their own (`modules_to_save`) hold it
/// beside their slot: the budget counts those bytes, so after every step
/// the filled slots, the heads beside them and the KV blocks are what the
/// budget says they are and never pass it; an adapter with a head takes an
/// empty slot only where its head fits too (else a resident adapter gives
/// way); and each request's tokens are its tokens alone.
#[test]
fn an_adapter_s_own_lm_head_counts_against_the_budget() {
    let config = ModelConfig::from_dir(&model_dir(MODEL)).unwrap();
    // The fixtures' saved lm_heads are f32 `[vocab, hidden]`.
    let head = (config.vocab_size * config.hidden_size * 4) as u64;
    let own_heads = [aid(101), aid(102)];
    let with_heads = |e: &mut Engine| {
        for (id, name) in own_heads.iter().zip(["head-qv-r4", "embed-head-o-r4"]) {
            e.register_adapter(*id, fixture_source("saved/llama-gqa", name))
                .unwrap();
        }
    };
    let requests: Vec<Request> = (0..24)
        .map(|i| request(format!("h{i}"), [101, 1, 102, 2, 0, 3][i % 6], 24, 8))
        .collect();
    let mut solo = fixture_engine(
        MODEL,
        EngineSettings {
            max_loras: 1,
            max_cpu_loras: 1,
            block_size: BLOCK_SIZE,
            ..Default::default()
        },
    );
    with_heads(&mut solo);
    let expected: HashMap<String, Vec<u32>> = requests
        .iter()
        .map(|r| {
            let c = solo.run_to_completion(vec![r.clone()]).unwrap().remove(0);
            assert!(c.error.is_none(), "{:?}", c.error);
            (r.id.to_string(), c.token_ids)
        })
        .collect();
    // Four slots' and 24 blocks' bytes: both heads (each most of a slot
    // again) with their slots leave room for one more slot and some KV.
    let mut e = fixture_engine(MODEL, settings(budget(4, 24), 4));
    with_heads(&mut e);
    let (outputs, both) = drain_counting_heads(&mut e, &requests, 4, &own_heads, head);
    assert!(both, "both heads were on the device at once");
    for r in &requests {
        assert_eq!(outputs[r.id.as_str()], expected[r.id.as_str()], "{}", r.id);
    }
    // Three slots' and nine blocks' bytes: two plain adapters' sequences
    // run (their slots leased), the third slot is empty, but its bytes
    // cannot hold a head beside it: the adapter with a head waits until
    // the plain ones finish and their slots can give way.
    let mut e = fixture_engine(MODEL, settings(budget(3, 9), 3));
    with_heads(&mut e);
    let late = [
        request("plain1".into(), 1, 24, 40),
        request("plain2".into(), 2, 24, 40),
        request("head".into(), 101, 24, 8),
    ];
    let (outputs, _) = drain_counting_heads(&mut e, &late, 2, &own_heads, head);
    for r in &late {
        assert_eq!(
            outputs[r.id.as_str()],
            expected_alone(r, with_heads),
            "{}",
            r.id
        );
    }
    assert!(e.stats().pool.device_evictions >= 1);
}

/// An adapter with an lm_head of its own gets in where only the idle
/// prefix cache and a resident adapter together make its room (one slot,
/// held by an idle adapter, and idle cached blocks hold the rest), and one
/// whose slot and head could never fit the budget is refused by name
/// rather than waited for.
#[test]
fn an_adapter_with_its_own_lm_head_gets_its_room_or_is_refused() {
    let config = ModelConfig::from_dir(&model_dir(MODEL)).unwrap();
    let head = (config.vocab_size * config.hidden_size * 4) as u64;
    let own_heads = [aid(101)];
    let with_head = |e: &mut Engine| {
        e.register_adapter(aid(101), fixture_source("saved/llama-gqa", "head-qv-r4"))
            .unwrap();
    };
    let u = units();
    let mut e = fixture_engine(MODEL, settings(budget(1, 16), 1));
    with_head(&mut e);
    // A long prompt on a plain adapter leaves 13 idle cached blocks and
    // the adapter resident: 24 KiB free, the adapter's slot 116 KiB, and
    // the head with its slot needs 212 KiB.
    let first = [request("long".into(), 1, 200, 4)];
    drain_counting_heads(&mut e, &first, 1, &own_heads, head);
    let m = e.stats().memory.unwrap();
    assert!(
        m.free() + u.slot_bytes < u.slot_bytes + head,
        "the resident adapter alone cannot make the head's room"
    );
    let then = [request("head".into(), 101, 24, 8)];
    let (outputs, resident) = drain_counting_heads(&mut e, &then, 1, &own_heads, head);
    assert!(resident);
    assert_eq!(outputs["head"], expected_alone(&then[0], with_head));
    // Beside its slot and its head the budget leaves 4 blocks of KV: a
    // request of the adapter that needs 6 is refused (a plain adapter's
    // gets the 16).
    let err = e
        .submit(request("big".into(), 101, 24, 60))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("need 6 KV blocks") && err.contains("has 4"),
        "{err}"
    );
    e.submit(request("plain-big".into(), 1, 24, 60)).unwrap();
    // The same request asked before its adapter is read is refused once
    // it is, never admitted to preempt itself for ever.
    // `r`'s refusal on a fresh engine of `budget` bytes and one slot.
    let refusal = |budget_bytes: u64, r: Request| {
        let mut e = fixture_engine(MODEL, settings(budget_bytes, 1));
        with_head(&mut e);
        let done = e.run_to_completion(vec![r]).unwrap().remove(0);
        done.error.expect("refused").to_string()
    };
    let err = refusal(budget(1, 16), request("early".into(), 101, 24, 60));
    assert!(
        err.contains("need 6 KV blocks") && err.contains("own lm_head the cache has 4"),
        "{err}"
    );

    // One slot and two blocks: the slot and its head can never fit.
    let err = refusal(budget(1, 2), request("never".into(), 101, 8, 4));
    assert!(
        err.contains("modules_to_save") && err.contains("cannot hold both"),
        "{err}"
    );
}

/// `r`'s tokens on an engine of its own with room to spare.
fn expected_alone(r: &Request, register: impl Fn(&mut Engine)) -> Vec<u32> {
    let mut e = fixture_engine(MODEL, EngineSettings::default());
    register(&mut e);
    let c = e.run_to_completion(vec![r.clone()]).unwrap().remove(0);
    assert!(c.error.is_none(), "{:?}", c.error);
    c.token_ids
}
