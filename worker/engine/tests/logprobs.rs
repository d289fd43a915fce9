//! Log probabilities against transformers + PEFT (`golden_logprobs.json`,
//! made by `scripts/make_logprob_goldens.py`): prompt tokens (echo) and
//! completion tokens, with their top alternatives, on the dense and MoE
//! fixtures, for the base and every adapter, in one mixed batch.

mod common;

use common::*;
use lorafleet_engine::logprobs::TokenLogprob;
use lorafleet_engine::{Completion, EngineSettings, Prompt, Request, SamplingParams};

#[derive(Debug, serde::Deserialize)]
struct Entry {
    token: u32,
    logprob: f32,
    top: Vec<(u32, f32)>,
}

#[derive(Debug, serde::Deserialize)]
struct Case {
    model: String,
    adapter: Option<String>,
    prompt_ids: Vec<u32>,
    prompt: Vec<Entry>,
    completion: Vec<Entry>,
}

#[derive(Debug, serde::Deserialize)]
struct Golden {
    top: usize,
    new_tokens: usize,
    cases: Vec<Case>,
}

fn golden() -> Golden {
    let text = std::fs::read_to_string(fixtures().join("golden_logprobs.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

const TOLERANCE: f32 = 1e-4;

fn check(what: &str, got: &TokenLogprob, want: &Entry) {
    assert_eq!(got.token, want.token, "{what}: token");
    let lp = got
        .logprob
        .expect("a scored position has a log probability");
    assert!(
        (lp - want.logprob).abs() <= TOLERANCE,
        "{what}: logprob {lp} against {}",
        want.logprob
    );
    assert_eq!(got.top.len(), want.top.len(), "{what}: top entries");
    for (i, (g, w)) in got.top.iter().zip(&want.top).enumerate() {
        assert_eq!(g.0, w.0, "{what}: top[{i}] token");
        assert!(
            (g.1 - w.1).abs() <= TOLERANCE,
            "{what}: top[{i}] logprob {} against {}",
            g.1,
            w.1
        );
    }
}

fn request(id: String, case: &Case, adapter: Option<u64>, g: &Golden) -> Request {
    Request {
        id,
        adapter: adapter.map(aid),
        prompt: Prompt::TokenIds(case.prompt_ids.clone()),
        params: SamplingParams {
            max_tokens: g.new_tokens,
            temperature: 0.0,
            logprobs: Some(g.top),
            prompt_logprobs: Some(g.top),
            ..Default::default()
        },
    }
}

fn check_case(case: &Case, c: &Completion) {
    let what = format!("{} {:?}", case.model, case.adapter);
    assert!(c.error.is_none(), "{what}: {:?}", c.error);
    // Every prompt token, the first with no log probability.
    assert_eq!(c.prompt_logprobs.len(), case.prompt_ids.len(), "{what}");
    assert_eq!(c.prompt_logprobs[0].token, case.prompt_ids[0]);
    assert_eq!(c.prompt_logprobs[0].logprob, None);
    for (i, (got, want)) in c.prompt_logprobs[1..].iter().zip(&case.prompt).enumerate() {
        check(&format!("{what} prompt[{}]", i + 1), got, want);
    }
    assert_eq!(
        c.logprobs.len(),
        case.completion.len(),
        "{what}: completion"
    );
    assert_eq!(
        c.token_ids.len(),
        case.completion.len(),
        "{what}: completion"
    );
    for (i, (got, want)) in c.logprobs.iter().zip(&case.completion).enumerate() {
        check(&format!("{what} completion[{i}]"), got, want);
    }
}

#[test]
fn logprobs_match_transformers_and_peft_for_the_base_and_every_adapter() {
    let g = golden();
    let mut checked = 0;
    for model in ["llama-gqa", "qwen2-tied", "qwen3-moe", "mixtral-moe"] {
        let names = adapter_names(model);
        // Small prefill chunks: a prompt is scored over several steps.
        let mut e = fixture_engine(
            model,
            EngineSettings {
                max_batched_tokens: 8,
                ..Default::default()
            },
        );
        let cases: Vec<&Case> = g.cases.iter().filter(|c| c.model == model).collect();
        assert!(!cases.is_empty(), "{model}: no golden cases");
        let requests: Vec<Request> = cases
            .iter()
            .enumerate()
            .map(|(i, case)| {
                let adapter = case.adapter.as_ref().map(|a| {
                    names
                        .iter()
                        .position(|n| n == a)
                        .expect("a fixture adapter") as u64
                        + 1
                });
                request(format!("r{i}"), case, adapter, &g)
            })
            .collect();
        // Every case in one mixed batch.
        let out = e.run_to_completion(requests).unwrap();
        for (case, c) in cases.iter().zip(&out) {
            check_case(case, c);
            checked += 1;
        }
    }
    assert_eq!(checked, g.cases.len());
}

#[test]
fn asking_for_logprobs_changes_no_token_and_the_prompt_alone_can_be_scored() {
    let g = golden();
    let case = g
        .cases
        .iter()
        .find(|c| c.model == "llama-gqa" && c.adapter.is_none())
        .unwrap();
    let settings = EngineSettings {
        max_batched_tokens: 8,
        ..Default::default()
    };
    let mut e = fixture_engine("llama-gqa", settings);
    let sampled = |id: &str, logprobs: Option<usize>| Request {
        id: id.into(),
        adapter: Some(aid(2)),
        prompt: Prompt::TokenIds(case.prompt_ids.clone()),
        params: SamplingParams {
            max_tokens: 10,
            temperature: 0.9,
            seed: Some(7),
            logprobs,
            prompt_logprobs: logprobs,
            ..Default::default()
        },
    };
    let prompt_only = Request {
        id: "prompt-only".into(),
        adapter: None,
        prompt: Prompt::TokenIds(case.prompt_ids.clone()),
        params: SamplingParams {
            max_tokens: 0,
            prompt_logprobs: Some(0),
            ..Default::default()
        },
    };
    let out = e
        .run_to_completion(vec![
            sampled("plain", None),
            sampled("scored", Some(3)),
            prompt_only,
        ])
        .unwrap();
    assert_eq!(out[0].token_ids, out[1].token_ids, "same seed, same tokens");
    assert!(out[0].logprobs.is_empty() && out[0].prompt_logprobs.is_empty());
    assert_eq!(out[1].logprobs.len(), out[1].token_ids.len());
    assert!(out[1].logprobs.iter().all(|l| l.top.len() == 3));
    // The prompt alone: every position scored, no token drawn.
    let p = &out[2];
    assert!(p.error.is_none(), "{:?}", p.error);
    assert!(p.token_ids.is_empty());
    assert_eq!(p.finish.as_ref().unwrap().completion_tokens, 0);
    assert_eq!(p.prompt_logprobs.len(), case.prompt_ids.len());
    for (got, want) in p.prompt_logprobs[1..].iter().zip(&case.prompt) {
        assert!(got.top.is_empty());
        assert!((got.logprob.unwrap() - want.logprob).abs() <= TOLERANCE);
    }
    // A second scoring of the same prompt finds its blocks in the prefix
    // cache and still scores every position.
    let again = e
        .run_to_completion(vec![Request {
            id: "again".into(),
            ..out_request(&case.prompt_ids)
        }])
        .unwrap();
    assert_eq!(again[0].prompt_logprobs.len(), case.prompt_ids.len());
    assert_eq!(again[0].finish.as_ref().unwrap().cached_tokens, 0);
}

fn out_request(ids: &[u32]) -> Request {
    Request {
        id: String::new(),
        adapter: None,
        prompt: Prompt::TokenIds(ids.to_vec()),
        params: SamplingParams {
            max_tokens: 0,
            prompt_logprobs: Some(1),
            ..Default::default()
        },
    }
}
