//! Prefix caching is exact and keyed by the weights' content: a request
//! served from cached blocks gives exactly the tokens it gives without the
//! cache (greedy and seeded, staggered arrivals, preemption and recompute),
//! and blocks are never shared between different weights.

mod common;

use common::*;
use lorafleet_engine::{Engine, EngineSettings, Event, Finish, Prompt, Request, Sampling};

const MODEL: &str = "llama-gqa";

/// A shared 100-token system prefix, then a short question of its own.
fn prompt(i: usize) -> Vec<u32> {
    prompt_after(37, i)
}

/// [`prompt`] after another system prefix (`system` picks it).
fn prompt_after(system: usize, i: usize) -> Vec<u32> {
    let mut ids: Vec<u32> = (0..100).map(|k| (k * system % 300 + 3) as u32).collect();
    ids.extend((0..5).map(|k| ((i * 13 + k * 7) % 300 + 3) as u32));
    ids
}

/// 8 adapters plus the base, three requests each, greedy and seeded.
fn workload() -> Vec<Request> {
    let mut out = Vec::new();
    for i in 0..27 {
        let adapter = match i % 9 {
            0 => None,
            k => Some(aid(k as u64)),
        };
        out.push(Request {
            id: format!("r{i}").into(),
            adapter,
            prompt: Prompt::TokenIds(prompt(i)),
            params: Sampling {
                max_tokens: 12,
                temperature: if i % 2 == 0 { 0.0 } else { 0.9 },
                seed: Some(1000 + i as u64),
                ignore_eos: true,
                ..Default::default()
            }
            .validate()
            .unwrap(),
        });
    }
    out
}

/// Runs `requests`, three new arrivals every other step; returns each
/// request's tokens and finish, in order, and the engine.
fn run(settings: EngineSettings, requests: &[Request]) -> (Vec<(Vec<u32>, Finish)>, Engine) {
    let mut e = fixture_engine(MODEL, settings);
    // Every adapter in the host tier first, so arrivals overlap however
    // fast the steps run (an optimized build otherwise finished requests
    // while later ones waited for their adapter to be read).
    for id in 1..=8 {
        e.prefetch(aid(id));
    }
    while e.pool().loads_in_flight() > 0 {
        e.pool().poll_loads(Some(std::time::Duration::from_secs(5)));
    }
    let mut out: Vec<(Vec<u32>, Option<Finish>)> = vec![(Vec::new(), None); requests.len()];
    let mut pending = requests.iter();
    let mut done = 0;
    let mut step = 0;
    while done < requests.len() {
        if step % 2 == 0 {
            for r in pending.by_ref().take(3) {
                e.submit(r.clone()).unwrap();
            }
        }
        for (id, event) in e.step().unwrap() {
            let i: usize = id[1..].parse().unwrap();
            match event {
                Event::Delta { token_ids, .. } => out[i].0.extend(token_ids),
                Event::Finished(f) => {
                    out[i].1 = Some(f);
                    done += 1;
                }
                Event::Failed(err) => panic!("{id}: {err}"),
                Event::PromptLogprobs(_) => {}
            }
        }
        step += 1;
        assert!(step < 10_000, "the batch never drained");
    }
    let out = out.into_iter().map(|(t, f)| (t, f.unwrap())).collect();
    (out, e)
}

fn settings(prefix_caching: bool, kv_blocks: usize) -> EngineSettings {
    EngineSettings {
        max_loras: 4,
        max_cpu_loras: 10,
        max_batched_tokens: 64,
        max_num_seqs: 8,
        kv_blocks,
        block_size: 16,
        prefix_caching,
        ..Default::default()
    }
}

#[test]
fn cached_prefixes_give_the_same_tokens_as_no_cache() {
    let requests = workload();
    for kv_blocks in [1024, 40] {
        let (off, _) = run(settings(false, kv_blocks), &requests);
        let (on, e) = run(settings(true, kv_blocks), &requests);
        for (i, ((t_on, _), (t_off, _))) in on.iter().zip(&off).enumerate() {
            assert_eq!(t_on, t_off, "r{i} with {kv_blocks} KV blocks");
        }
        let stats = e.stats();
        let cached: usize = on.iter().map(|(_, f)| f.cached_tokens).sum();
        assert!(
            cached > 0,
            "the cache served prompt tokens ({kv_blocks} blocks)"
        );
        assert!(stats.prefix.hit_tokens > 0, "{:?}", stats.prefix);
        assert!(off.iter().all(|(_, f)| f.cached_tokens == 0));
        assert_eq!(stats.kv_blocks_used, 0, "every block is released");
        if kv_blocks == 40 {
            let preempted: u32 = on.iter().map(|(_, f)| f.preemptions).sum();
            assert!(preempted > 0, "a small cache preempts and recomputes");
        } else {
            // Each of the 9 weights computes the 96 shared tokens (6 full
            // blocks) once; its later requests take from the cache what
            // has been computed when they arrive (all of it, once the
            // first request's prefill is done).
            let later: usize = on.iter().skip(9).map(|(_, f)| f.cached_tokens).sum();
            assert!(later >= 9 * 96, "{later} of at most {}", 18 * 96);
        }
    }
}

/// One request run alone, to completion, on `e`.
fn one(e: &mut Engine, adapter: Option<u64>, ids: Vec<u32>) -> Finish {
    let id = format!("q{}", e.stats().prefix.queried_tokens);
    e.submit(Request {
        id: id.into(),
        adapter: adapter.map(aid),
        prompt: Prompt::TokenIds(ids),
        params: Sampling {
            max_tokens: 2,
            temperature: 0.0,
            ignore_eos: true,
            ..Default::default()
        }
        .validate()
        .unwrap(),
    })
    .unwrap();
    loop {
        for (_, event) in e.step().unwrap() {
            match event {
                Event::Finished(f) => return f,
                Event::Failed(err) => panic!("{err}"),
                Event::Delta { .. } | Event::PromptLogprobs(_) => {}
            }
        }
    }
}

#[test]
fn blocks_are_shared_by_weights_content_never_by_name_or_id() {
    let mut e = fixture_engine(MODEL, settings(true, 256));
    let names = adapter_names(MODEL);
    let p = prompt(0);
    assert_eq!(one(&mut e, Some(1), p.clone()).cached_tokens, 0);
    // Another adapter, the same prompt: nothing shared.
    assert_eq!(one(&mut e, Some(2), p.clone()).cached_tokens, 0);
    // The base model, the same prompt: nothing shared.
    assert_eq!(one(&mut e, None, p.clone()).cached_tokens, 0);
    // The first adapter again: its blocks are found.
    assert_eq!(one(&mut e, Some(1), p.clone()).cached_tokens, 96);

    // Two ids under one name, with different files (two versions with
    // different digests): nothing shared.
    let source = |dir_name: &str| lorafleet_engine::AdapterSource {
        name: "support".into(),
        dir: adapter_dir(MODEL, dir_name),
        declared_base_hash: None,
        digest: None,
    };
    e.register_adapter(aid(101), source(&names[0])).unwrap();
    e.register_adapter(aid(102), source(&names[1])).unwrap();
    let q = prompt_after(41, 1);
    assert_eq!(one(&mut e, Some(101), q.clone()).cached_tokens, 0);
    assert_eq!(one(&mut e, Some(102), q.clone()).cached_tokens, 0);
    // The same files under yet another id share with the first: the key
    // is the weights' content.
    e.register_adapter(aid(103), source(&names[0])).unwrap();
    assert_eq!(one(&mut e, Some(103), q).cached_tokens, 96);
}

/// The backend's view of a hit: a second sequence that reuses the first's
/// full blocks of a prefix and computes only the rest gives the same logit
/// bits as computing the whole prompt itself, with and without an adapter.
#[test]
fn a_prefix_hit_gives_the_logit_bits_of_a_miss() {
    use lorafleet_engine::backend::cpu::CpuBackend;
    use lorafleet_engine::backend::{Backend, BackendShape, StepBatch};
    use lorafleet_engine::lora::{AdapterLimits, HostAdapter};
    use lorafleet_engine::model::ModelConfig;

    let dir = model_dir(MODEL);
    let config = ModelConfig::from_dir(&dir).unwrap();
    let shape = BackendShape {
        slots: 1,
        max_lora_rank: 16,
        kv_blocks: 32,
        block_size: 16,
        ring_len: 0,
        ring_blocks: 0,
    };
    let mut backend = CpuBackend::load(&dir, &config, shape).unwrap();
    let name = &adapter_names(MODEL)[0];
    let limits = AdapterLimits {
        model: &config,
        max_lora_rank: 16,
        base_hash_check: None,
    };
    let adapter = HostAdapter::load(name, &adapter_dir(MODEL, name), limits).unwrap();
    backend.write_slot(0, &adapter).unwrap();
    let ids = prompt(3);
    for slot in [None, Some(0)] {
        let mut forward = |tokens: &[u32], start: usize, table: &[u32]| {
            let mut batch = StepBatch::default();
            batch.push(tokens, start, table, slot, true);
            batch.finish();
            backend.forward(&batch).unwrap()
        };
        // A miss: the whole prompt into its own blocks.
        let miss = forward(&ids, 0, &[0, 1, 2, 3, 4, 5, 6]);
        // A hit: the six full blocks (96 tokens) of another sequence that
        // computed the same prefix, then the rest in a block of its own.
        let first = forward(&ids, 0, &[10, 11, 12, 13, 14, 15, 16]);
        assert_eq!(
            first.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            miss.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
        );
        let hit = forward(&ids[96..], 96, &[10, 11, 12, 13, 14, 15, 20]);
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&hit), bits(&miss), "slot {slot:?}");
    }
}
