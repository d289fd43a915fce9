//! Structured outputs on a random-weights model: whatever the model would
//! say, sampled output under a constraint parses and validates.

mod common;

use common::*;
use lorafleet_engine::constraint::Constraint;
use lorafleet_engine::{ConstraintKind, EngineSettings, Field, Prompt, Request, Sampling};
use serde_json::Value;

fn request(id: String, constraint: Constraint, seed: u64) -> Request {
    Request {
        id: id.into(),
        adapter: Some(aid(seed % 3 + 1)),
        prompt: Prompt::Text("The quick brown fox".into()),
        params: Sampling {
            max_tokens: 120,
            temperature: 1.0,
            seed: Some(seed),
            constraint: Some(constraint),
            ..Default::default()
        }
        .validate()
        .unwrap(),
    }
}

#[test]
fn sampled_output_matches_its_schema_regex_choice_or_grammar() {
    let mut e = fixture_engine("llama-gqa", EngineSettings::default());
    let schema = r#"{"type":"object","properties":{"name":{"type":"string","maxLength":6},
        "age":{"type":"integer","minimum":0,"maximum":150},"tags":{"type":"array","items":{"enum":["a","b"]},"maxItems":3}},
        "required":["name","age","tags"],"additionalProperties":false}"#;
    let kinds = [
        Constraint::JsonSchema(schema.into()),
        Constraint::JsonObject,
        Constraint::Regex("[0-9]{3}-[a-z]{2}".into()),
        Constraint::Choice(vec!["yes".into(), "no".into(), "maybe not".into()]),
        Constraint::Grammar("start: \"(\" NUM (\",\" NUM)* \")\"\nNUM: /[0-9]{1,2}/".into()),
        Constraint::ToolCall(lorafleet_domain::generation::ToolCall {
            functions: vec![lorafleet_domain::generation::ToolFunction {
                name: "pick".into(),
                parameters: r#"{"type":"object","properties":{"n":{"enum":[1,2,3]}},
                    "required":["n"],"additionalProperties":false}"#
                    .into(),
            }],
            parallel: false,
        }),
    ];
    // Any JSON object leaves string lengths open, and a random model
    // rarely picks the closing quote: a bias towards `"` and `}` ends its
    // strings and objects within max_tokens.
    let t =
        lorafleet_engine::model::tokenizer::Tokenizer::from_dir(&model_dir("llama-gqa")).unwrap();
    let bias: Vec<(u32, f32)> = ["\"", "}"]
        .iter()
        .map(|s| (t.encode(s, false).unwrap()[0], 6.0))
        .collect();
    let mut requests = Vec::new();
    for (k, c) in kinds.iter().enumerate() {
        for seed in 0..4u64 {
            let mut r = request(format!("k{k}s{seed}"), c.clone(), seed);
            if *c == Constraint::JsonObject {
                r = with(r, |p| p.logit_bias = bias.clone());
            }
            requests.push(r);
        }
    }
    // And an unconstrained request beside them, which stays free.
    let free = with(request("free".into(), Constraint::JsonObject, 9), |p| {
        p.constraint = None;
        p.max_tokens = 12;
    });
    requests.push(free);
    let out = e.run_to_completion(requests).unwrap();
    // Each kind compiled once; its other three requests cloned the
    // compiled matcher (and still match, below).
    let counters = e.constraint_compiler().counters();
    assert_eq!((counters.compiles, counters.hits), (6, 18));
    for (i, c) in out.iter().enumerate().take(kinds.len() * 4) {
        assert!(c.error.is_none(), "{}: {:?}", c.request_id, c.error);
        let finish = c.finish.as_ref().unwrap();
        assert_eq!(
            finish.reason,
            lorafleet_engine::FinishReason::Stop,
            "{}: ended by its grammar, not max_tokens: {:?}",
            c.request_id,
            c.text
        );
        let text = c.text.as_str();
        match &kinds[i / 4] {
            Constraint::JsonSchema(_) => {
                let v: Value =
                    serde_json::from_str(text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
                let o = v.as_object().unwrap();
                assert_eq!(o.len(), 3, "{text}");
                assert!(o["name"].as_str().unwrap().chars().count() <= 6, "{text}");
                assert!((0..=150).contains(&o["age"].as_i64().unwrap()), "{text}");
                let tags = o["tags"].as_array().unwrap();
                assert!(
                    tags.len() <= 3 && tags.iter().all(|t| t == "a" || t == "b"),
                    "{text}"
                );
            }
            Constraint::JsonObject => {
                let v: Value =
                    serde_json::from_str(text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
                assert!(v.is_object(), "{text}");
            }
            Constraint::Regex(_) => {
                let b = text.as_bytes();
                assert!(
                    b.len() == 6
                        && b[..3].iter().all(u8::is_ascii_digit)
                        && b[3] == b'-'
                        && b[4..].iter().all(u8::is_ascii_lowercase),
                    "{text:?}"
                );
            }
            Constraint::Choice(choices) => assert!(choices.contains(&text.to_owned()), "{text:?}"),
            Constraint::Grammar(_) => {
                let inner = text
                    .strip_prefix('(')
                    .and_then(|t| t.strip_suffix(')'))
                    .unwrap();
                assert!(
                    inner.split(',').all(
                        |n| (1..=2).contains(&n.len()) && n.bytes().all(|b| b.is_ascii_digit())
                    ),
                    "{text:?}"
                );
            }
            Constraint::ToolCall(_) => {
                // A call of `pick` with an allowed `n`.
                let c: Value =
                    serde_json::from_str(text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
                assert_eq!(c["name"], "pick", "{text}");
                assert!(
                    [1, 2, 3].contains(&c["arguments"]["n"].as_i64().unwrap()),
                    "{text}"
                );
            }
        }
    }
    let free = out.last().unwrap();
    assert_eq!(
        free.token_ids.len(),
        12,
        "the unconstrained request is not cut"
    );
}

#[test]
fn a_constraint_that_does_not_compile_is_refused_by_field() {
    let mut e = fixture_engine("llama-gqa", EngineSettings::default());
    for (c, field) in [
        (
            Constraint::JsonSchema("{not json".into()),
            "sampling.json_schema",
        ),
        (Constraint::Regex("(unclosed".into()), "sampling.regex"),
        (
            Constraint::Grammar("start: undefined_rule".into()),
            "sampling.grammar",
        ),
    ] {
        let err = e
            .submit(request("bad".into(), c.clone(), 1))
            .unwrap_err()
            .to_string();
        assert!(err.starts_with(field), "{c:?}: {err}");
    }
}

#[test]
fn a_model_vocabulary_larger_than_the_tokenizers_still_compiles_and_masks_the_rest() {
    // Qwen's config.json counts padding rows past the tokenizer's last id;
    // those ids have no bytes and are never allowed.
    let t = std::sync::Arc::new(
        lorafleet_engine::model::tokenizer::Tokenizer::from_dir(&model_dir("llama-gqa")).unwrap(),
    );
    let vocab = t.vocab_size() + 16;
    let compiler = lorafleet_engine::constraint::Compiler::new(t, vocab, 2, false);
    let mut g = compiler
        .compile(&Constraint::Regex("[0-9]+".into()))
        .unwrap();
    let mut logits = vec![0.0f32; vocab];
    g.allowed().unwrap().apply(&mut logits);
    let allowed: Vec<usize> = (0..vocab).filter(|&i| logits[i].is_finite()).collect();
    assert!(!allowed.is_empty());
    assert!(
        allowed.iter().all(|&i| i < vocab - 16),
        "padding ids stay masked: {allowed:?}"
    );
}

#[test]
fn an_unsupported_schema_feature_is_refused_at_its_place_in_the_schema() {
    let mut e = fixture_engine("llama-gqa", EngineSettings::default());
    for (schema, place) in [
        (
            r#"{"type":"object","properties":{"a":{"$ref":"http://example.com/x.json"}}}"#,
            "/properties/a",
        ),
        (
            r#"{"type":"object","properties":{"a":{"type":"array","items":{"type":"string","format":"no-such-format"}}}}"#,
            "/properties/a/items",
        ),
        (
            r#"{"type":"object","properties":{"b":{"type":"integer"},"a":{"not":{"type":"string"}}}}"#,
            "/properties/a",
        ),
    ] {
        let err = e
            .submit(request(
                "bad".into(),
                Constraint::JsonSchema(schema.into()),
                1,
            ))
            .unwrap_err()
            .to_string();
        assert!(
            err.starts_with(&format!("sampling.json_schema: at {place}: ")),
            "{schema}: {err}"
        );
    }
}

#[test]
fn a_constraint_compiled_once_is_cloned_and_distinct_ones_never_share() {
    let e = fixture_engine("llama-gqa", EngineSettings::default());
    let compiler = e.constraint_compiler();
    let split = |a: &str, b: &str| Constraint::Choice(vec![a.into(), b.into()]);
    compiler.compile(&split("ab", "c")).unwrap();
    compiler.compile(&split("a", "bc")).unwrap();
    compiler.compile(&Constraint::Regex("ab|c".into())).unwrap();
    compiler
        .compile(&Constraint::Grammar("start: \"ab\" | \"c\"".into()))
        .unwrap();
    let counters = compiler.counters();
    assert_eq!((counters.compiles, counters.hits), (4, 0));
    // The engine's clone of the compiler shares the cache.
    e.check_constraint(&split("a", "bc")).unwrap();
    assert_eq!(compiler.counters().hits, 1);
    // A constraint that does not compile is refused every time, and never
    // cached.
    for _ in 0..2 {
        let err = compiler
            .compile(&Constraint::Regex("(".into()))
            .unwrap_err()
            .to_string();
        assert!(err.starts_with("sampling.regex: "), "{err}");
    }
    assert_eq!(compiler.counters().compiles, 4);
}

/// A request's `n` choices arrive together, each asking for the same
/// constraint: one compiles it and the others wait for it and clone it,
/// rather than 16 compiles of one schema at once.
#[test]
fn the_same_constraint_asked_at_once_compiles_once() {
    let e = fixture_engine("llama-gqa", EngineSettings::default());
    let compiler = e.constraint_compiler();
    let properties: serde_json::Map<String, Value> = (0..60)
        .map(|i| (format!("p{i}"), serde_json::json!({"type": "integer"})))
        .collect();
    let required: Vec<String> = properties.keys().cloned().collect();
    let schema = serde_json::json!({"type": "object", "properties": properties,
                                    "required": required})
    .to_string();
    let barrier = std::sync::Barrier::new(16);
    std::thread::scope(|scope| {
        for _ in 0..16 {
            let (compiler, barrier, schema) = (compiler.clone(), &barrier, schema.clone());
            scope.spawn(move || {
                barrier.wait();
                compiler.compile(&Constraint::JsonSchema(schema)).unwrap();
            });
        }
    });
    let counters = compiler.counters();
    assert_eq!((counters.compiles, counters.hits), (1, 15));
}

/// A constrained row whose mask is later than its step's budget waits a
/// step; the rest of the batch does not. With every mask held back 300 ms
/// (far past any step of this model), the unconstrained request finishes
/// in as many steps as when the masks are prompt, while the constrained
/// one is drawn in later steps from the logits it kept: the same tokens
/// either way, still matching its regular expression.
#[test]
fn a_late_mask_delays_its_own_row_and_never_the_batch() {
    use lorafleet_engine::Event;
    let run = |delay_ms: u64| {
        let mut e = fixture_engine("llama-gqa", EngineSettings::default());
        e.delay_masks(std::time::Duration::from_millis(delay_ms));
        let mut constrained = with(
            request("c".into(), Constraint::Regex("[0-9]{3}-[a-z]{4}".into()), 7),
            |p| p.max_tokens = 40,
        );
        let mut free = with(request("f".into(), Constraint::JsonObject, 3), |p| {
            p.constraint = None;
            p.max_tokens = 12;
            p.ignore_eos = true;
        });
        // The base model: no adapter load to time the steps.
        constrained.adapter = None;
        free.adapter = None;
        e.submit(constrained).unwrap();
        e.submit(free).unwrap();
        let (mut steps, mut free_done_at) = (0, None);
        let mut tokens: std::collections::HashMap<String, Vec<u32>> = Default::default();
        while e.has_work() {
            steps += 1;
            assert!(steps < 2000, "no progress");
            for (id, event) in e.step().unwrap() {
                match event {
                    Event::Delta { token_ids, .. } => tokens
                        .entry(id.into_string())
                        .or_default()
                        .extend(token_ids),
                    Event::Finished(_) if id == "f" => free_done_at = Some(steps),
                    Event::Failed(err) => panic!("{id}: {err}"),
                    _ => {}
                }
            }
        }
        (free_done_at.unwrap(), tokens, e.stats().run.late_masks)
    };
    let (prompt_at, prompt_tokens, _) = run(0);
    let (late_at, late_tokens, late) = run(300);
    assert!(late > 0, "no mask was late");
    assert_eq!(
        late_at, prompt_at,
        "the unconstrained request waited for the late masks"
    );
    assert_eq!(late_tokens, prompt_tokens, "a late mask changed the tokens");
    let t =
        lorafleet_engine::model::tokenizer::Tokenizer::from_dir(&model_dir("llama-gqa")).unwrap();
    let text = t.decode(&late_tokens["c"]).unwrap();
    let re = regex::Regex::new("^[0-9]{3}-[a-z]{4}$").unwrap();
    assert!(re.is_match(&text), "{text:?}");
}

/// A schema the parser cannot follow (more alternatives at once than its
/// row limit once the object opens: here 1,800 optional properties) fails
/// its own request by field, with the parser's reason and not its state
/// dump; the request beside it completes.
#[test]
fn a_grammar_too_complex_to_follow_fails_its_request_by_field() {
    let mut e = fixture_engine("llama-gqa", EngineSettings::default());
    let properties: serde_json::Map<String, Value> = (0..1800)
        .map(|i| (format!("p{i}"), serde_json::json!({"type": "string"})))
        .collect();
    let schema = serde_json::json!({"type": "object", "properties": properties}).to_string();
    assert!(schema.len() < lorafleet_engine::constraint::MAX_CONSTRAINT_BYTES);
    let costly = request("costly".into(), Constraint::JsonSchema(schema), 1);
    let free = with(request("free".into(), Constraint::JsonObject, 2), |p| {
        p.constraint = None;
        p.max_tokens = 6;
    });
    let out = e.run_to_completion(vec![costly, free]).unwrap();
    let err = out[0].error.as_ref().expect("the costly request fails");
    assert!(
        matches!(err, lorafleet_engine::EngineError::InvalidRequest { field, .. } if *field == Field::Constraint(ConstraintKind::JsonSchema)),
        "{err:?}"
    );
    assert!(err.to_string().contains("cannot be followed"), "{err}");
    assert!(!err.to_string().contains("<state>"), "{err}");
    assert!(out[1].error.is_none(), "{:?}", out[1].error);
    assert_eq!(out[1].token_ids.len(), 6);
}
