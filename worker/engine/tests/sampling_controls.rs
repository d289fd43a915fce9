//! The sampling controls that change logits (`repetition_penalty`,
//! `frequency_penalty`, `presence_penalty`, `logit_bias`, `min_tokens`)
//! against reference code that is not ours: `golden_logprobs.json`'s
//! `controls`, made by `scripts/make_logprob_goldens.py` with transformers'
//! RepetitionPenaltyLogitsProcessor and OpenAI's formulas.

mod common;

use common::*;
use lorafleet_engine::{EngineSettings, Prompt, Request, Sampling};
use serde_json::Value;

fn goldens() -> Value {
    serde_json::from_str(&std::fs::read_to_string(fixtures().join("golden_logprobs.json")).unwrap())
        .unwrap()
}

fn params(control: &Value, max_tokens: usize) -> Sampling {
    let f = |k: &str, default: f32| control[k].as_f64().map_or(default, |v| v as f32);
    Sampling {
        max_tokens,
        temperature: 0.0,
        ignore_eos: true,
        repetition_penalty: f("repetition_penalty", 1.0),
        frequency_penalty: f("frequency_penalty", 0.0),
        presence_penalty: f("presence_penalty", 0.0),
        logit_bias: control["logit_bias"]
            .as_object()
            .map(|m| {
                m.iter()
                    .map(|(k, v)| (k.parse().unwrap(), v.as_f64().unwrap() as f32))
                    .collect()
            })
            .unwrap_or_default(),
        ..Default::default()
    }
}

#[test]
fn each_control_gives_the_reference_tokens_for_the_base_and_an_adapter() {
    let g = goldens();
    let names = adapter_names("llama-gqa");
    let mut e = fixture_engine("llama-gqa", EngineSettings::default());
    let cases = g["controls"].as_array().unwrap();
    assert!(cases.len() >= 10);
    let mut requests = Vec::new();
    for (i, c) in cases.iter().enumerate() {
        let adapter = c["adapter"]
            .as_str()
            .map(|a| aid(names.iter().position(|n| n == a).unwrap() as u64 + 1));
        let ids: Vec<u32> = serde_json::from_value(c["prompt_ids"].clone()).unwrap();
        let n = c["greedy"].as_array().unwrap().len();
        for (tag, control) in [("c", &c["control"]), ("p", &Value::Null)] {
            requests.push(Request {
                id: format!("{tag}{i}").into(),
                adapter,
                prompt: Prompt::TokenIds(ids.clone()),
                params: params(control, n).validate().unwrap(),
            });
        }
    }
    // All in one mixed batch: each request's controls are its own.
    let out = e.run_to_completion(requests).unwrap();
    for (i, c) in cases.iter().enumerate() {
        let want: Vec<u32> = serde_json::from_value(c["greedy"].clone()).unwrap();
        let plain: Vec<u32> = serde_json::from_value(c["plain"].clone()).unwrap();
        assert_eq!(out[2 * i].token_ids, want, "{}", c["control"]);
        assert_eq!(out[2 * i + 1].token_ids, plain, "without {}", c["control"]);
        assert_ne!(want, plain, "the control changes the tokens");
    }
}

#[test]
fn min_tokens_holds_back_the_end_and_logprobs_come_before_the_controls() {
    let mut e = fixture_engine("llama-gqa", EngineSettings::default());
    let prompt: Vec<u32> = vec![1, 50, 60, 70];
    let eos = 2;
    let forced = |id: &str, min_tokens| Request {
        id: id.into(),
        adapter: None,
        prompt: Prompt::TokenIds(prompt.clone()),
        params: Sampling {
            max_tokens: 8,
            temperature: 0.0,
            min_tokens,
            logit_bias: vec![(eos, 100.0)],
            logprobs: Some(0),
            ..Default::default()
        }
        .validate()
        .unwrap(),
    };
    // The prompt followed by EOS, scored: EOS's own log probability there.
    let scored = Request {
        id: "scored".into(),
        adapter: None,
        prompt: Prompt::TokenIds([prompt.as_slice(), &[eos]].concat()),
        params: Sampling {
            max_tokens: 0,
            prompt_logprobs: Some(0),
            ..Default::default()
        }
        .validate()
        .unwrap(),
    };
    let out = e
        .run_to_completion(vec![forced("now", 0), forced("later", 3), scored])
        .unwrap();
    assert_eq!(out[0].token_ids, [eos], "the bias ends it at once");
    assert_eq!(out[1].token_ids.len(), 4, "three tokens, then EOS");
    assert_eq!(out[1].token_ids[3], eos);
    assert!(!out[1].token_ids[..3].contains(&eos));
    // The biased EOS's log probability is the model's own, not the biased one.
    let model_own = out[2].prompt_logprobs.last().unwrap().logprob.unwrap();
    let reported = out[0].logprobs[0].logprob.unwrap();
    assert_eq!(reported, model_own);
    assert!(
        reported < -1.0,
        "the model alone does not favour EOS: {reported}"
    );
}
