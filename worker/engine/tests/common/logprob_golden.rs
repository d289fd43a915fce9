//! Log-probability goldens (`golden_logprobs.json`, `golden_families.json`):
//! every prompt token's log probability with its top alternatives, and
//! greedy completion tokens with theirs, from transformers + PEFT.

use super::{adapter_names, aid, fixture_engine_on, fixtures};
use lorafleet_engine::logprobs::TokenLogprob;
use lorafleet_engine::{Completion, EngineSettings, Prompt, Request, Sampling};

#[derive(Debug, serde::Deserialize)]
pub struct Entry {
    pub token: u32,
    pub logprob: f32,
    pub top: Vec<(u32, f32)>,
}

#[derive(Debug, serde::Deserialize)]
pub struct LogprobCase {
    pub model: String,
    pub adapter: Option<String>,
    pub prompt_ids: Vec<u32>,
    pub prompt: Vec<Entry>,
    pub completion: Vec<Entry>,
}

#[derive(Debug, serde::Deserialize)]
pub struct LogprobGolden {
    pub top: usize,
    pub new_tokens: usize,
    pub cases: Vec<LogprobCase>,
}

pub fn logprob_golden(file: &str) -> LogprobGolden {
    let text = std::fs::read_to_string(fixtures().join(file)).unwrap();
    serde_json::from_str(&text).unwrap()
}

pub const LOGPROB_TOLERANCE: f32 = 1e-4;

fn check(what: &str, got: &TokenLogprob, want: &Entry) {
    check_within(what, got, want, LOGPROB_TOLERANCE)
}

fn check_within(what: &str, got: &TokenLogprob, want: &Entry, tolerance: f32) {
    assert_eq!(got.token, want.token, "{what}: token");
    let lp = got
        .logprob
        .expect("a scored position has a log probability");
    assert!(
        (lp - want.logprob).abs() <= tolerance,
        "{what}: logprob {lp} against {}",
        want.logprob
    );
    assert_eq!(got.top.len(), want.top.len(), "{what}: top entries");
    for (i, (g, w)) in got.top.iter().zip(&want.top).enumerate() {
        assert_eq!(g.0, w.0, "{what}: top[{i}] token");
        assert!(
            (g.1 - w.1).abs() <= tolerance,
            "{what}: top[{i}] logprob {} against {}",
            g.1,
            w.1
        );
    }
}

pub fn logprob_request(
    id: String,
    case: &LogprobCase,
    adapter: Option<u64>,
    g: &LogprobGolden,
) -> Request {
    Request {
        id: id.into(),
        adapter: adapter.map(aid),
        prompt: Prompt::TokenIds(case.prompt_ids.clone()),
        params: Sampling {
            max_tokens: g.new_tokens,
            temperature: 0.0,
            logprobs: Some(g.top),
            prompt_logprobs: Some(g.top),
            ..Default::default()
        }
        .validate()
        .unwrap(),
    }
}

pub fn check_logprob_case(case: &LogprobCase, c: &Completion) {
    check_logprob_case_within(case, c, LOGPROB_TOLERANCE)
}

/// [`check_logprob_case`] within `tolerance`.
pub fn check_logprob_case_within(case: &LogprobCase, c: &Completion, tolerance: f32) {
    let what = format!("{} {:?}", case.model, case.adapter);
    assert!(c.error.is_none(), "{what}: {:?}", c.error);
    // Every prompt token, the first with no log probability.
    assert_eq!(c.prompt_logprobs.len(), case.prompt_ids.len(), "{what}");
    assert_eq!(c.prompt_logprobs[0].token, case.prompt_ids[0]);
    assert_eq!(c.prompt_logprobs[0].logprob, None);
    for (i, (got, want)) in c.prompt_logprobs[1..].iter().zip(&case.prompt).enumerate() {
        check_within(&format!("{what} prompt[{}]", i + 1), got, want, tolerance);
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
        check_within(&format!("{what} completion[{i}]"), got, want, tolerance);
    }
}

/// Runs every case of `model` in `g` in one mixed batch (small prefill
/// chunks, so a prompt is scored over several steps) and checks each
/// against its golden; returns how many cases ran.
pub fn check_logprob_goldens(g: &LogprobGolden, model: &str) -> usize {
    check_logprob_goldens_on(
        g,
        model,
        lorafleet_engine::BackendChoice::Cpu,
        LOGPROB_TOLERANCE,
    )
}

/// [`check_logprob_goldens`] on `choice`, within `tolerance`.
pub fn check_logprob_goldens_on(
    g: &LogprobGolden,
    model: &str,
    choice: lorafleet_engine::BackendChoice,
    tolerance: f32,
) -> usize {
    let names = adapter_names(model);
    let mut e = fixture_engine_on(
        model,
        EngineSettings {
            max_batched_tokens: 8,
            ..Default::default()
        },
        choice,
    );
    let cases: Vec<&LogprobCase> = g.cases.iter().filter(|c| c.model == model).collect();
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
            logprob_request(format!("r{i}"), case, adapter, g)
        })
        .collect();
    let out = e.run_to_completion(requests).unwrap();
    for (case, c) in cases.iter().zip(&out) {
        check_logprob_case_within(case, c, tolerance);
    }
    cases.len()
}
