//! Log probabilities against transformers + PEFT (`golden_logprobs.json`,
//! made by `scripts/make_logprob_goldens.py`): prompt tokens (echo) and
//! completion tokens, with their top alternatives, on the dense and MoE
//! fixtures, for the base and every adapter, in one mixed batch.

mod common;

use common::*;
use lorafleet_engine::{EngineSettings, Prompt, Request, Sampling};

fn golden() -> LogprobGolden {
    logprob_golden("golden_logprobs.json")
}

#[test]
fn logprobs_match_transformers_and_peft_for_the_base_and_every_adapter() {
    let g = logprob_golden("golden_logprobs.json");
    let mut checked = 0;
    for model in ["llama-gqa", "qwen2-tied", "qwen3-moe", "mixtral-moe"] {
        checked += check_logprob_goldens(&g, model);
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
        params: Sampling {
            max_tokens: 10,
            temperature: 0.9,
            seed: Some(7),
            logprobs,
            prompt_logprobs: logprobs,
            ..Default::default()
        }
        .validate()
        .unwrap(),
    };
    let prompt_only = Request {
        id: "prompt-only".into(),
        adapter: None,
        prompt: Prompt::TokenIds(case.prompt_ids.clone()),
        params: Sampling {
            max_tokens: 0,
            prompt_logprobs: Some(0),
            ..Default::default()
        }
        .validate()
        .unwrap(),
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
        assert!((got.logprob.unwrap() - want.logprob).abs() <= LOGPROB_TOLERANCE);
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
        id: String::new().into(),
        adapter: None,
        prompt: Prompt::TokenIds(ids.to_vec()),
        params: Sampling {
            max_tokens: 0,
            prompt_logprobs: Some(1),
            ..Default::default()
        }
        .validate()
        .unwrap(),
    }
}
