//! Continuous batching: the engine's output for a request does not depend
//! on what shares its batch, when it arrives, whether its prefill is
//! chunked, or whether it is preempted and recomputed.

mod common;

use common::*;
use lorafleet_engine::{Engine, EngineSettings, Event, FinishReason, Prompt, Request, Sampling};

const MODEL: &str = "llama-gqa";

fn engine(settings: EngineSettings) -> Engine {
    fixture_engine(MODEL, settings)
}

fn alone(requests: &[Request]) -> Vec<(Vec<u32>, String)> {
    let mut e = engine(EngineSettings {
        max_loras: 1,
        max_cpu_loras: 1,
        ..Default::default()
    });
    requests
        .iter()
        .map(|r| {
            let c = e.run_to_completion(vec![r.clone()]).unwrap().pop().unwrap();
            assert!(c.error.is_none(), "{:?}", c.error);
            (c.token_ids, c.text)
        })
        .collect()
}

#[test]
fn a_mixed_batch_with_staggered_arrivals_equals_one_at_a_time() {
    let requests = mixed_workload();
    let expected = alone(&requests);

    // Fewer slots than adapters, small steps and chunked prefill: the pool
    // churns and requests arrive while others decode.
    let settings = EngineSettings {
        max_loras: 4,
        max_cpu_loras: 6,
        max_batched_tokens: 24,
        max_num_seqs: 12,
        ..Default::default()
    };
    let mut e = engine(settings);
    let mut outputs: Vec<(Vec<u32>, String)> = vec![Default::default(); requests.len()];
    let mut finished = 0;
    let mut pending = requests.iter().enumerate().peekable();
    let mut step = 0;
    let mut max_distinct = 0;
    while finished < requests.len() {
        // Three new arrivals every other step.
        if step % 2 == 0 {
            for _ in 0..3 {
                if let Some((_, r)) = pending.next() {
                    e.submit(r.clone()).unwrap();
                }
            }
        }
        for (id, event) in e.step().unwrap() {
            let i: usize = id[1..].parse().unwrap();
            match event {
                Event::Delta {
                    token_ids, text, ..
                } => {
                    outputs[i].0.extend(token_ids);
                    outputs[i].1.push_str(&text);
                }
                Event::Finished(_) => finished += 1,
                Event::Failed(err) => panic!("{id}: {err}"),
                Event::PromptLogprobs(_) => {}
            }
        }
        max_distinct = max_distinct.max(e.last_step().distinct_adapters);
        step += 1;
        assert!(step < 10_000, "the batch never drained");
    }
    for (i, (got, want)) in outputs.iter().zip(&expected).enumerate() {
        assert_eq!(got, want, "request r{i} differs between batched and alone");
    }
    assert!(
        max_distinct >= 2,
        "steps really mixed adapters (max {max_distinct} distinct)"
    );
    assert!(
        max_distinct <= 4,
        "never more than max_loras distinct adapters in a step"
    );
    let stats = e.stats();
    assert!(
        stats.pool.device_evictions > 0,
        "10 adapters through 4 slots evict: {:?}",
        stats.pool
    );
    assert_eq!(
        stats.kv_blocks_used, 0,
        "every block is back on the free list"
    );
}

#[test]
fn preemption_recomputes_to_the_same_tokens() {
    let requests: Vec<Request> = mixed_workload().into_iter().take(12).collect();
    let expected = alone(&requests);
    // 12 blocks of 4 tokens cannot hold twelve sequences of up to ~40 tokens.
    let settings = EngineSettings {
        max_loras: 4,
        max_cpu_loras: 10,
        kv_blocks: 12,
        block_size: 4,
        ..Default::default()
    };
    let mut e = engine(settings);
    let results = e.run_to_completion(requests).unwrap();
    let preemptions: u32 = results
        .iter()
        .map(|c| c.finish.as_ref().unwrap().preemptions)
        .sum();
    assert!(preemptions > 0, "the small cache forced preemption");
    for (c, want) in results.iter().zip(&expected) {
        assert_eq!(
            (&c.token_ids, &c.text),
            (&want.0, &want.1),
            "{}",
            c.request_id
        );
    }
}

/// A preempted sequence keeps its adapter's lease while it waits to be
/// recomputed, so the slot it needs cannot be given to another adapter: after
/// every step, each adapter's active count (its leases) covers every request
/// of it that has produced tokens and not finished, preempted or running.
/// Three adapters through two slots, a cache too small for the running
/// sequences; the outputs are still each request's own.
#[test]
fn a_preempted_sequence_keeps_its_adapters_lease() {
    let prompt = "Once upon a time, there was a little model that served many adapters.";
    let request = |i: usize, adapter: u64| Request {
        id: format!("r{i}").into(),
        adapter: Some(aid(adapter)),
        prompt: Prompt::Text(prompt.into()),
        params: Sampling {
            max_tokens: 24,
            temperature: 0.0,
            ignore_eos: true,
            ..Default::default()
        }
        .validate()
        .unwrap(),
    };
    let requests: Vec<Request> = (0..6)
        .map(|i| request(i, 1 + (i % 2) as u64))
        .chain((6..8).map(|i| request(i, 3)))
        .collect();
    let expected = alone(&requests);
    let mut e = engine(EngineSettings {
        max_loras: 2,
        max_cpu_loras: 3,
        kv_blocks: 24,
        block_size: 4,
        max_num_seqs: 6,
        ..Default::default()
    });
    for r in &requests {
        e.submit(r.clone()).unwrap();
    }
    let mut outputs: Vec<Vec<u32>> = vec![Vec::new(); requests.len()];
    let mut finished = vec![false; requests.len()];
    let (mut preemptions, mut steps) = (0, 0);
    while finished.iter().any(|f| !f) {
        for (id, event) in e.step().unwrap() {
            let i: usize = id[1..].parse().unwrap();
            match event {
                Event::Delta { token_ids, .. } => outputs[i].extend(token_ids),
                Event::Finished(_) => finished[i] = true,
                Event::Failed(err) => panic!("{id}: {err}"),
                Event::PromptLogprobs(_) => {}
            }
        }
        preemptions += e.last_step().preempted;
        for status in e.stats().adapters {
            let live = requests
                .iter()
                .enumerate()
                .filter(|(i, r)| {
                    r.adapter == Some(status.id) && !outputs[*i].is_empty() && !finished[*i]
                })
                .count();
            assert!(
                status.active as usize >= live,
                "step {steps}: adapter {} holds {} leases for {live} live requests",
                status.id,
                status.active
            );
        }
        steps += 1;
        assert!(steps < 10_000, "the batch never drained");
    }
    assert!(preemptions > 0, "the small cache forced preemption");
    for (i, (got, want)) in outputs.iter().zip(&expected).enumerate() {
        assert_eq!(got, &want.0, "r{i}");
    }
}

#[test]
fn the_engine_reproduces_the_golden_greedy_tokens() {
    let golden = golden();
    for model in ["llama-gqa", "qwen2-tied"] {
        let mut e = fixture_engine(
            model,
            EngineSettings {
                max_loras: 2,
                ..Default::default()
            },
        );
        let ids = adapter_names(model);
        let cases: Vec<_> = golden.cases.iter().filter(|c| c.model == model).collect();
        let requests = golden_requests(&cases, &ids, golden.max_new_tokens);
        // All cases of a model in one batch.
        for (c, case) in e.run_to_completion(requests).unwrap().iter().zip(&cases) {
            assert_eq!(
                c.token_ids, case.greedy,
                "{model}/{:?} {:?}",
                case.adapter, case.prompt
            );
        }
    }
}

#[test]
fn cancelling_frees_kv_blocks_at_once() {
    let mut e = engine(EngineSettings::default());
    let r = Request {
        id: "long".into(),
        adapter: Some(aid(1)),
        prompt: Prompt::Text("The quick brown fox".into()),
        params: Sampling {
            max_tokens: 200,
            temperature: 0.0,
            ignore_eos: true,
            ..Default::default()
        }
        .validate()
        .unwrap(),
    };
    e.submit(r).unwrap();
    for _ in 0..5 {
        e.step().unwrap();
    }
    assert!(e.stats().kv_blocks_used > 0);
    assert_eq!(
        e.stats()
            .adapters
            .iter()
            .find(|a| a.id == aid(1))
            .unwrap()
            .active,
        1
    );
    assert!(e.abort(&"long".into()));
    assert_eq!(e.stats().kv_blocks_used, 0);
    assert_eq!(
        e.stats()
            .adapters
            .iter()
            .find(|a| a.id == aid(1))
            .unwrap()
            .active,
        0,
        "the lease is gone"
    );
    assert!(!e.has_work());
    assert!(!e.abort(&"long".into()), "aborting twice is a no-op");
}

#[test]
fn max_tokens_stop_strings_and_utf8_stay_whole() {
    let mut e = engine(EngineSettings::default());
    let base = |id: &str, max_tokens, stop: Vec<String>| Request {
        id: id.into(),
        adapter: None,
        prompt: Prompt::Text("Grüße aus München! 🚀".into()),
        params: Sampling {
            max_tokens,
            temperature: 0.0,
            stop,
            ignore_eos: true,
            ..Default::default()
        }
        .validate()
        .unwrap(),
    };
    let full = e
        .run_to_completion(vec![base("full", 40, vec![])])
        .unwrap()
        .pop()
        .unwrap();
    let finish = full.finish.unwrap();
    assert_eq!(
        (finish.reason, full.token_ids.len()),
        (FinishReason::Length, 40)
    );
    assert_eq!(
        full.text,
        e.tokenizer().decode(&full.token_ids).unwrap(),
        "deltas add up to the whole text"
    );
    // Cut at a stop string taken from the middle of the unconstrained text.
    let chars: Vec<char> = full.text.chars().collect();
    assert!(chars.len() > 6, "the model produced text: {:?}", full.text);
    let stop: String = chars[chars.len() / 2..chars.len() / 2 + 2].iter().collect();
    let cut = e
        .run_to_completion(vec![base("cut", 40, vec![stop.clone()])])
        .unwrap()
        .pop()
        .unwrap();
    let at = full.text.find(&stop).unwrap();
    assert_eq!(
        cut.text,
        full.text[..at],
        "text stops right before {stop:?}"
    );
    assert_eq!(
        cut.finish.unwrap().stop,
        Some(lorafleet_engine::StopReason::String(stop))
    );
}

#[test]
fn a_batch_larger_than_the_waiting_queue_still_runs_whole() {
    let mut e = engine(EngineSettings {
        max_waiting: 3,
        ..Default::default()
    });
    let requests: Vec<Request> = (0..10)
        .map(|i| Request {
            id: format!("q{i}").into(),
            adapter: Some(aid(i % 3 + 1)),
            prompt: Prompt::Text("def forward(self, x):".into()),
            params: Sampling {
                max_tokens: 3,
                temperature: 0.0,
                ignore_eos: true,
                ..Default::default()
            }
            .validate()
            .unwrap(),
        })
        .collect();
    let duplicate = with(requests[0].clone(), |p| p.max_tokens = 5);
    let mut all = requests;
    all.push(duplicate);
    let results = e.run_to_completion(all).unwrap();
    assert!(
        results[..10]
            .iter()
            .all(|c| c.error.is_none() && c.token_ids.len() == 3)
    );
    let err = results[10]
        .error
        .as_ref()
        .expect("a repeated id is refused")
        .to_string();
    assert!(err.contains("appears twice"), "{err}");
}

/// Device time per request: each step's wall time is shared among its
/// sequences by the tokens each fed it, so over a run the requests' shares
/// add up to the engine's busy time (within 1%: they add up exactly but
/// for nanosecond rounding) and every request that ran has a share. Two
/// requests that share their steps, one with a 120-token prompt and one
/// with 2, split the prefill steps about 60 to 1: the long one's share is
/// more than 6 times the short one's (19 times measured; an even split
/// per sequence gave 2.2).
#[test]
fn requests_device_time_adds_up_to_the_engines_busy_time() {
    let mut e = engine(EngineSettings {
        max_loras: 4,
        max_cpu_loras: 6,
        max_batched_tokens: 64,
        max_num_seqs: 8,
        ..Default::default()
    });
    let requests = mixed_workload();
    let busy_before = e.stats().run.busy;
    let done = e.run_to_completion(requests.clone()).unwrap();
    let busy = e.stats().run.busy - busy_before;
    let mut total = std::time::Duration::ZERO;
    for c in &done {
        assert!(c.error.is_none(), "{}: {:?}", c.request_id, c.error);
        let finish = c.finish.as_ref().expect("finished");
        assert!(
            !finish.device_time.is_zero(),
            "{} has no device time",
            c.request_id
        );
        total += finish.device_time;
    }
    assert_eq!(done.len(), requests.len());
    assert!(!busy.is_zero());
    let gap = (total.as_secs_f64() - busy.as_secs_f64()).abs() / busy.as_secs_f64();
    assert!(gap <= 0.01, "requests {total:?} against busy {busy:?}");

    let long = Request {
        id: "long".into(),
        adapter: None,
        prompt: Prompt::TokenIds((0..120).map(|k| (k * 7 % 90 + 3) as u32).collect()),
        params: Sampling {
            max_tokens: 2,
            ignore_eos: true,
            ..Default::default()
        }
        .validate()
        .unwrap(),
    };
    let short = Request {
        id: "short".into(),
        prompt: Prompt::TokenIds(vec![5, 6]),
        ..long.clone()
    };
    let done = e.run_to_completion(vec![long, short]).unwrap();
    let of = |id: &str| {
        done.iter()
            .find(|c| c.request_id == id)
            .and_then(|c| c.finish.as_ref())
            .expect("finished")
            .device_time
    };
    assert!(
        of("long") > of("short") * 6,
        "a 120-token prompt's share {:?} against a 2-token one's {:?}",
        of("long"),
        of("short")
    );
}

/// Each delta carries its request's device and load time so far: never
/// less than the delta before, and the last one (in the step that finishes
/// it) says what `Finished` does, so a request cancelled mid-way accounts
/// for what it used up to its last delta.
#[test]
fn each_delta_carries_the_time_its_request_has_used_so_far() {
    let mut e = engine(EngineSettings {
        max_loras: 4,
        max_cpu_loras: 6,
        max_batched_tokens: 64,
        max_num_seqs: 8,
        ..Default::default()
    });
    let requests = mixed_workload();
    let n = requests.len();
    for r in requests {
        e.submit(r).unwrap();
    }
    let mut last = std::collections::HashMap::new();
    let mut finished = 0;
    while e.has_work() {
        for (id, event) in e.step().unwrap() {
            match event {
                Event::Delta {
                    device_time,
                    load_time,
                    ..
                } => {
                    assert!(!device_time.is_zero(), "{id}");
                    let before = last.insert(id.clone(), (device_time, load_time));
                    if let Some((d, l)) = before {
                        assert!(device_time >= d && load_time >= l, "{id}");
                    }
                }
                Event::Finished(f) => {
                    assert_eq!(last[&id], (f.device_time, f.load_time), "{id}");
                    finished += 1;
                }
                Event::Failed(err) => panic!("{id}: {err}"),
                Event::PromptLogprobs(_) => {}
            }
        }
    }
    assert_eq!(finished, n);
    assert!(
        last.values().any(|(_, load)| !load.is_zero()),
        "some adapter was copied in"
    );
}

/// Adapter copies per request: each copy of an adapter into a device slot
/// is split among the live requests of that adapter, so over a run the
/// requests' shares and the copies no request waited for add up to the
/// engine's copy time exactly. Ten adapters through four slots: every
/// adapter request was live when its adapter was first copied in, so each
/// has a share; the base model's requests have none.
#[test]
fn adapter_copies_are_charged_to_the_requests_that_waited_for_them() {
    let mut e = engine(EngineSettings {
        max_loras: 4,
        max_cpu_loras: 12,
        max_batched_tokens: 64,
        max_num_seqs: 8,
        ..Default::default()
    });
    let requests = mixed_workload();
    let before = e.stats();
    let done = e.run_to_completion(requests.clone()).unwrap();
    let after = e.stats();
    assert_eq!(done.len(), requests.len());
    let copies = after.pool.device_loads - before.pool.device_loads;
    assert!(
        copies >= 10,
        "ten adapters through four slots: {copies} copies"
    );
    let loads = after.run.loads - before.run.loads;
    let unattributed = after.run.unattributed_loads - before.run.unattributed_loads;
    assert!(!loads.is_zero());
    assert!(
        unattributed.is_zero(),
        "every copy had waiters: {unattributed:?}"
    );
    let mut charged = std::time::Duration::ZERO;
    for r in &requests {
        let c = done.iter().find(|c| c.request_id == r.id).expect("done");
        let finish = c.finish.as_ref().expect("finished");
        match r.adapter {
            Some(_) => assert!(
                !finish.load_time.is_zero(),
                "{} waited for its adapter's copy and has no share of it",
                r.id
            ),
            None => assert!(finish.load_time.is_zero(), "{}", r.id),
        }
        charged += finish.load_time;
    }
    assert_eq!(charged + unattributed, loads);
}
