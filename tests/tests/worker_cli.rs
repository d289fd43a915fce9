//! The real `lorafleet-worker` binary's offline commands on the fixture
//! models: `base-hash` and `generate`.

use std::collections::BTreeMap;
use std::path::Path;

use lorafleet_tests::{engine_fixtures, run};
use serde_json::{Value, json};

fn stdout(out: &std::process::Output) -> String {
    assert!(
        out.status.success(),
        "failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout.clone()).unwrap()
}

#[test]
fn base_hash_matches_an_independent_implementation() {
    let fixtures = engine_fixtures();
    let expected: BTreeMap<String, String> =
        serde_json::from_str(&std::fs::read_to_string(fixtures.join("base_hashes.json")).unwrap())
            .unwrap();
    for (model, hash) in &expected {
        let dir = fixtures.join(model);
        let out = run(
            "lorafleet-worker",
            &["base-hash", "--model", dir.to_str().unwrap()],
            &[],
        );
        assert_eq!(stdout(&out).trim(), hash, "{model}");
    }
    assert_ne!(expected["llama-gqa"], expected["qwen2-tied"]);
    let out = run(
        "lorafleet-worker",
        &["base-hash", "--model", "/nonexistent-model-dir"],
        &[],
    );
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("model.safetensors"));
}

fn write_lines(path: &Path, lines: &[Value]) {
    let text: String = lines.iter().map(|l| format!("{l}\n")).collect();
    std::fs::write(path, text).unwrap();
}

fn generate(input: &Path, output: &Path, adapters: &[&str]) -> std::process::Output {
    generate_with(
        input,
        output,
        adapters,
        &["--max-loras", "2", "--max-cpu-loras", "3"],
    )
}

/// `generate` on the llama-gqa fixture with `adapters` and `flags`.
fn generate_with(
    input: &Path,
    output: &Path,
    adapters: &[&str],
    flags: &[&str],
) -> std::process::Output {
    let fixtures = engine_fixtures();
    let model = fixtures.join("llama-gqa");
    let mut args: Vec<String> = vec![
        "generate".into(),
        "--model".into(),
        model.to_str().unwrap().into(),
        "--input".into(),
        input.to_str().unwrap().into(),
        "--output".into(),
        output.to_str().unwrap().into(),
    ];
    args.extend(flags.iter().map(|f| (*f).to_owned()));
    for a in adapters {
        args.push("--lora".into());
        args.push(format!(
            "{a}={}",
            fixtures.join("adapters/llama-gqa").join(a).display()
        ));
    }
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    run("lorafleet-worker", &refs, &[])
}

/// The output lines of a `generate` run.
fn results(output: &Path) -> Vec<Value> {
    std::fs::read_to_string(output)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

#[test]
fn generate_runs_a_mixed_batch_and_matches_the_goldens() {
    let fixtures = engine_fixtures();
    let golden: Value =
        serde_json::from_str(&std::fs::read_to_string(fixtures.join("golden.json")).unwrap())
            .unwrap();
    let max_new = golden["max_new_tokens"].as_u64().unwrap();
    let cases: Vec<&Value> = golden["cases"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| c["model"] == "llama-gqa")
        .collect();
    let adapters = ["qv-r8", "patterns", "layer1-mlp", "all-linear-rslora"];
    let chosen: Vec<&&Value> = cases
        .iter()
        .filter(|c| c["adapter"].is_null() || adapters.contains(&c["adapter"].as_str().unwrap()))
        .collect();
    assert!(chosen.len() >= 12);
    let dir = tempfile::tempdir().unwrap();
    let (input, output) = (dir.path().join("in.jsonl"), dir.path().join("out.jsonl"));
    let lines: Vec<Value> = chosen
        .iter()
        .map(|c| json!({"prompt": c["prompt"], "lora": c["adapter"], "max_tokens": max_new, "temperature": 0}))
        .collect();
    write_lines(&input, &lines);
    stdout(&generate(&input, &output, &adapters));
    let results: Vec<Value> = results(&output);
    assert_eq!(results.len(), chosen.len());
    for (i, (r, c)) in results.iter().zip(&chosen).enumerate() {
        assert_eq!(r["index"], i);
        assert_eq!(r["lora"], c["adapter"]);
        assert_eq!(r["prompt_token_ids"], c["prompt_ids"], "line {i}");
        assert_eq!(
            r["token_ids"], c["greedy"],
            "line {i}: {} / {}",
            c["adapter"], c["prompt"]
        );
        let reason = r["finish_reason"].as_str().unwrap();
        assert!(reason == "length" || reason == "stop");
    }
}

/// Token-id prompts and log probabilities, as vLLM's `LLM.generate` takes
/// them, equal to transformers + PEFT.
#[test]
fn generate_takes_token_ids_and_returns_log_probabilities() {
    let fixtures = engine_fixtures();
    let golden: Value = serde_json::from_str(
        &std::fs::read_to_string(fixtures.join("golden_logprobs.json")).unwrap(),
    )
    .unwrap();
    let case = golden["cases"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["model"] == "llama-gqa" && c["adapter"] == "qv-r8")
        .unwrap();
    let n = case["completion"].as_array().unwrap().len();
    let dir = tempfile::tempdir().unwrap();
    let (input, output) = (dir.path().join("in.jsonl"), dir.path().join("out.jsonl"));
    write_lines(
        &input,
        &[
            json!({"prompt_token_ids": case["prompt_ids"], "lora": "qv-r8", "max_tokens": n,
                   "temperature": 0, "logprobs": 5, "prompt_logprobs": 5}),
            json!({"prompt_token_ids": case["prompt_ids"], "max_tokens": 0, "prompt_logprobs": 0}),
            json!({"prompt": "hi", "max_tokens": 2}),
            json!({"prompt": "hi", "max_tokens": 12, "temperature": 1.0, "seed": 3, "regex": "[0-9]{3}-[a-z]"}),
            json!({"prompt": "hi", "max_tokens": 12, "temperature": 1.0, "seed": 4, "choice": ["red", "green"]}),
        ],
    );
    stdout(&generate(&input, &output, &["qv-r8"]));
    let results: Vec<Value> = results(&output);
    let close = |got: &Value, want: &Value, what: String| {
        let (g, w) = (got.as_f64().unwrap(), want.as_f64().unwrap());
        assert!((g - w).abs() <= 1e-4, "{what}: {g} against {w}");
    };
    let r = &results[0];
    assert_eq!(r["prompt_token_ids"], case["prompt_ids"]);
    assert_eq!(r["prompt_logprobs"][0]["logprob"], Value::Null);
    for (i, want) in case["prompt"].as_array().unwrap().iter().enumerate() {
        let got = &r["prompt_logprobs"][i + 1];
        assert_eq!(got["token_id"], want["token"]);
        close(
            &got["logprob"],
            &want["logprob"],
            format!("prompt[{}]", i + 1),
        );
        assert_eq!(got["top"][0][0], want["top"][0][0]);
    }
    for (i, want) in case["completion"].as_array().unwrap().iter().enumerate() {
        assert_eq!(r["token_ids"][i], want["token"]);
        close(
            &r["logprobs"][i]["logprob"],
            &want["logprob"],
            format!("completion[{i}]"),
        );
    }
    // The prompt scored alone, and a line that asked for nothing.
    assert_eq!(results[1]["token_ids"], json!([]));
    assert_eq!(
        results[1]["prompt_logprobs"].as_array().unwrap().len(),
        case["prompt_ids"].as_array().unwrap().len()
    );
    assert!(results[2].get("logprobs").is_none() && results[2].get("prompt_logprobs").is_none());
    // Structured outputs: the text matches its constraint.
    let text = results[3]["text"].as_str().unwrap().as_bytes();
    assert!(
        text.len() == 5 && text[..3].iter().all(u8::is_ascii_digit) && text[3] == b'-',
        "{:?}",
        results[3]["text"]
    );
    assert!(["red", "green"].contains(&results[4]["text"].as_str().unwrap()));
}

#[test]
fn a_bad_input_line_fails_the_run_before_any_work() {
    let dir = tempfile::tempdir().unwrap();
    let (input, output) = (dir.path().join("in.jsonl"), dir.path().join("out.jsonl"));
    let good = json!({"prompt": "hi", "max_tokens": 2});
    let cases = [
        (
            json!({"prompt": "hi", "lora": "nope"}),
            "line 3: lora: \"nope\" is not one of the --lora names",
        ),
        (
            json!({"prompt": "hi", "max_tokens": 0}),
            "line 3: max_tokens: must be at least 1",
        ),
        (
            json!({"prompt": "hi", "temperature": 9}),
            "line 3: temperature: 9 is not in [0, 2]",
        ),
        (
            json!({"prompt": "hi", "colour": "red"}),
            "line 3: unknown field `colour`",
        ),
        (
            json!({"lora": "qv-r8"}),
            "line 3: exactly one of prompt and prompt_token_ids is required",
        ),
        (
            json!({"prompt": "hi", "prompt_token_ids": [1, 2]}),
            "line 3: exactly one of prompt and prompt_token_ids is required",
        ),
        (
            json!({"prompt_token_ids": [1, 99999]}),
            "line 3: prompt_token_ids: 99999 is not below vocab_size",
        ),
        (
            json!({"prompt": "hi", "logprobs": 21}),
            "line 3: logprobs: 21 is above the limit of 20",
        ),
        (
            json!({"prompt": "hi", "regex": "(unclosed"}),
            "line 3: regex: ",
        ),
        (
            json!({"prompt": "hi", "regex": "a", "choice": ["b"]}),
            "line 3: at most one of json_schema, json_object, regex, choice and grammar",
        ),
        (
            json!({"prompt": "hi", "max_tokens": 100000}),
            "line 3: max_tokens: the prompt",
        ),
    ];
    for (bad, expected) in cases {
        write_lines(&input, &[good.clone(), good.clone(), bad]);
        let out = generate(&input, &output, &["qv-r8"]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success());
        assert!(
            stderr.contains(expected),
            "expected {expected:?} in {stderr}"
        );
        assert!(
            !output.exists(),
            "no output is written when the input is bad"
        );
    }
    let out = run(
        "lorafleet-worker",
        &[
            "generate", "--model", "x", "--input", "y", "--output", "z", "--lora", "noequals",
        ],
        &[],
    );
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("--lora \"noequals\": expected NAME=DIR")
    );
}

#[test]
fn generate_refuses_bad_engine_flags_by_name() {
    let fixtures = engine_fixtures();
    let model = fixtures.join("llama-gqa");
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("in.jsonl");
    std::fs::write(&input, "{\"prompt\": \"hi\"}\n").unwrap();
    let cases: &[(&[&str], &str)] = &[
        (&["--max-loras", "0"], "--max-loras: must be at least 1"),
        (
            &["--max-cpu-lora-bytes", "0"],
            "--max-cpu-lora-bytes: must be at least 1 when given",
        ),
        (
            &["--max-loras", "8", "--max-cpu-loras", "4"],
            "--max-cpu-loras: 4 must be at least max-loras (8)",
        ),
        (&["--kv-blocks", "0"], "--kv-blocks: must be at least 1"),
        (
            &["--max-lora-rank", "1000"],
            "--max-lora-rank: 1000 is above 512",
        ),
    ];
    for (flags, expected) in cases {
        let mut args = vec![
            "generate",
            "--model",
            model.to_str().unwrap(),
            "--input",
            input.to_str().unwrap(),
        ];
        args.extend(["--output", "/dev/null"]);
        args.extend(flags.iter().copied());
        let out = run("lorafleet-worker", &args, &[]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{flags:?}");
        assert!(
            stderr.contains(expected),
            "{flags:?}: expected {expected:?} in {stderr}"
        );
    }
}

/// `generate --stats` writes what the run did: 24 requests over 4 adapters
/// on 2 slots load each adapter a few times at most, every token is
/// counted, and the steps and waits are those of a real schedule.
#[test]
fn generate_writes_run_statistics() {
    let dir = tempfile::tempdir().unwrap();
    let (input, output) = (dir.path().join("in.jsonl"), dir.path().join("out.jsonl"));
    let stats = dir.path().join("stats.json");
    let adapters = ["qv-r8", "patterns", "layer1-mlp", "all-linear-rslora"];
    let lines: Vec<Value> = (0..24)
        .map(|i| {
            json!({"prompt": format!("request {i} of the run"), "lora": adapters[i % 4],
                   "max_tokens": 3, "temperature": 0})
        })
        .collect();
    write_lines(&input, &lines);
    stdout(&generate_with(
        &input,
        &output,
        &adapters,
        &[
            "--stats",
            stats.to_str().unwrap(),
            "--max-loras",
            "2",
            "--max-cpu-loras",
            "4",
            "--max-num-seqs",
            "4",
        ],
    ));
    let s: Value = serde_json::from_str(&std::fs::read_to_string(&stats).unwrap()).unwrap();
    let results: Vec<Value> = results(&output);
    let generated: usize = results
        .iter()
        .map(|r| r["token_ids"].as_array().unwrap().len())
        .sum();
    let prompt: usize = results
        .iter()
        .map(|r| r["prompt_token_ids"].as_array().unwrap().len())
        .sum();
    assert_eq!(s["generated_tokens"], generated, "{s}");
    assert_eq!(s["prompt_tokens"], prompt, "{s}");
    assert_eq!(generated, 24 * 3);
    let (device, host) = (
        s["device_loads"].as_u64().unwrap(),
        s["host_loads"].as_u64().unwrap(),
    );
    assert!((4..=12).contains(&device), "{s}");
    assert!(host >= 4, "each adapter read once at least: {s}");
    // At most 4 sequences a step: at least 24 × 3 / 4 decode steps.
    let steps = s["steps"].as_u64().unwrap();
    assert!(steps >= 18, "{s}");
    let mean = s["mean_distinct_adapters_per_step"].as_f64().unwrap();
    assert!((1.0..=2.0).contains(&mean), "2 slots: {s}");
    // 4 at a time: later requests waited for earlier ones' steps.
    let waited = s["max_wait_steps"].as_u64().unwrap();
    assert!(waited > 0 && waited < steps, "{s}");
    assert!(s["wall_secs"].as_f64().unwrap() > 0.0);
    // Every request named an adapter; with 4 adapters on 2 slots some
    // found theirs not ready and waited for a load.
    let wait = &s["adapter_wait"];
    assert_eq!(wait["requests"], 24, "{s}");
    let waited_for_adapter = wait["waited"].as_u64().unwrap();
    assert!((1..=24).contains(&waited_for_adapter), "{s}");
    let (p50, p99, max) = (
        wait["p50_ms"].as_f64().unwrap(),
        wait["p99_ms"].as_f64().unwrap(),
        wait["max_ms"].as_f64().unwrap(),
    );
    assert!(0.0 <= p50 && p50 <= p99 && p99 <= max && max > 0.0, "{s}");
    assert!(
        s["device_evictions"].as_u64().unwrap() >= 2,
        "4 adapters through 2 slots: {s}"
    );
    for field in ["prefetches", "prefetch_hits", "preemptions"] {
        assert!(s[field].is_u64(), "{field}: {s}");
    }
}

/// A `--stats` path that cannot be written is refused by name before any
/// work: before the model is even read (the model path here does not
/// exist either, and the refusal names `--stats`), and no output is written.
#[test]
fn generate_refuses_a_stats_path_it_cannot_write_before_any_work() {
    let dir = tempfile::tempdir().unwrap();
    let (input, output) = (dir.path().join("in.jsonl"), dir.path().join("out.jsonl"));
    write_lines(&input, &[json!({"prompt": "hi", "max_tokens": 2})]);
    let stats = dir.path().join("no-such-dir/stats.json");
    let model = dir.path().join("no-such-model");
    let out = run(
        "lorafleet-worker",
        &[
            "generate",
            "--model",
            model.to_str().unwrap(),
            "--input",
            input.to_str().unwrap(),
            "--output",
            output.to_str().unwrap(),
            "--stats",
            stats.to_str().unwrap(),
        ],
        &[],
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains(&format!("--stats {}", stats.display())),
        "{stderr}"
    );
    assert!(!output.exists(), "no work was done");
}

/// With one memory budget for KV blocks and adapter slots, the split
/// follows the work through the real binary: many adapters with short
/// requests fill slots with most of it, one adapter with long requests
/// fills KV with most of it; neither passes it, and the tokens are those
/// of a run with fixed sizes.
#[test]
fn generate_under_a_memory_budget_gives_it_to_whichever_side_the_work_needs() {
    // Four slots of the tiny Llama at rank 16 (118,784 bytes each) and 20
    // KV blocks of 16 positions (8,192 bytes each).
    const BUDGET: u64 = 4 * 118_784 + 20 * 8_192;
    let dir = tempfile::tempdir().unwrap();
    let adapters = [
        "qv-r8",
        "patterns",
        "layer1-mlp",
        "all-linear-rslora",
        "k-r16",
        "o-r2",
        "down-r12",
        "gate-up-r8",
    ];
    let many: Vec<Value> = (0..24)
        .map(|i| {
            json!({"prompt": format!("short {i}"), "lora": adapters[i % 8],
                   "max_tokens": 4, "temperature": 0})
        })
        .collect();
    let long: Vec<Value> = (0..8u32)
        .map(|i| {
            let ids: Vec<u32> = (0..70).map(|t| 3 + (t * 7 + i) % 380).collect();
            json!({"prompt_token_ids": ids, "lora": "qv-r8", "max_tokens": 60,
                   "temperature": 0, "ignore_eos": true})
        })
        .collect();
    let budget = BUDGET.to_string();
    for (name, lines, kv_side) in [("many", &many, false), ("long", &long, true)] {
        let input = dir.path().join(format!("{name}.jsonl"));
        write_lines(&input, lines);
        let (shared, fixed) = (
            dir.path().join(format!("{name}-shared.jsonl")),
            dir.path().join(format!("{name}-fixed.jsonl")),
        );
        let stats = dir.path().join(format!("{name}-stats.json"));
        let flags = [
            "--memory-budget-bytes",
            &budget,
            "--max-loras",
            "8",
            "--max-cpu-loras",
            "8",
            "--max-num-seqs",
            "16",
            "--stats",
            stats.to_str().unwrap(),
        ];
        stdout(&generate_with(&input, &shared, &adapters, &flags));
        stdout(&generate_with(
            &input,
            &fixed,
            &adapters,
            &["--max-loras", "2"],
        ));
        let tokens = |path: &Path| -> Vec<Value> {
            results(path)
                .iter()
                .map(|r| r["token_ids"].clone())
                .collect()
        };
        assert_eq!(tokens(&shared), tokens(&fixed), "{name}: the same tokens");
        let s: Value = serde_json::from_str(&std::fs::read_to_string(&stats).unwrap()).unwrap();
        let m = &s["memory"];
        assert_eq!(m["budget_bytes"], BUDGET, "{s}");
        let (kv, slots) = (
            m["peak_kv_bytes"].as_u64().unwrap(),
            m["peak_adapter_bytes"].as_u64().unwrap(),
        );
        assert!(kv <= BUDGET && slots <= BUDGET, "{name}: {s}");
        let (this, other) = if kv_side { (kv, slots) } else { (slots, kv) };
        assert!(
            this > BUDGET / 2 && other < BUDGET / 2,
            "{name}: the work's side took most of the budget: {s}"
        );
    }
}
