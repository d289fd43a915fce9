//! Adapters with rows of their own in the embedding layers, as PEFT makes
//! them (`scripts/make_saved_module_fixtures.py`): `modules_to_save` of
//! `lm_head` and `embed_tokens` (a whole trained copy) and
//! `trainable_token_indices` (some tokens' rows), on the CPU backend:
//! logits within 1e-4 of transformers + PEFT and greedy tokens equal (a
//! Llama, a Qwen2 whose lm_head is tied to its embeddings, a Mixtral),
//! each applied to its adapter's rows alone beside plain adapters and the
//! base in one step, counted in the adapter's bytes, and what cannot be
//! served refused by field or tensor.

mod common;

use common::*;
use lorafleet_engine::backend::cpu::CpuBackend;
use lorafleet_engine::backend::{Backend, BackendShape, StepBatch};
use lorafleet_engine::lora::{AdapterLimits, HostAdapter};
use lorafleet_engine::model::ModelConfig;

fn golden_saved() -> Golden {
    golden_named("golden_saved.json")
}

#[test]
fn saved_layers_and_trainable_tokens_match_peft() {
    let golden = golden_saved();
    let checked = check_golden_cases_on_cpu(&golden, "llama-gqa", "saved/llama-gqa")
        + check_golden_cases_on_cpu(&golden, "qwen2-tied", "saved/qwen2-tied")
        + check_golden_cases_on_cpu(&golden, "mixtral-moe", "saved/mixtral-moe");
    assert_eq!(checked, golden.cases.len());
    assert_eq!(checked, 21);
}

fn backend(model: &str, slots: usize) -> (CpuBackend, ModelConfig) {
    let dir = model_dir(model);
    let config = ModelConfig::from_dir(&dir).unwrap();
    let shape = BackendShape {
        slots,
        max_lora_rank: 16,
        kv_blocks: 128,
        block_size: 4,
        ring_len: 0,
        ring_blocks: 0,
    };
    (CpuBackend::load(&dir, &config, shape).unwrap(), config)
}

fn load(config: &ModelConfig, dir: &std::path::Path) -> Result<HostAdapter, String> {
    let limits = AdapterLimits {
        model: config,
        max_lora_rank: 16,
        base_hash_check: None,
    };
    HostAdapter::load("a", dir, limits).map_err(|e| e.to_string())
}

/// Every kind of adapter the engine serves, in one step on a Llama: each
/// row is its own golden (PEFT's), the base's too.
#[test]
fn each_adapter_s_rows_serve_its_own_tokens_beside_every_other_kind_and_the_base() {
    let (mut backend, _) = backend("llama-gqa", EVERY_KIND_SLOTS);
    every_adapter_kind_in_one_step(&mut backend, 1e-4);
}

#[test]
fn an_adapter_s_own_rows_count_in_its_bytes() {
    let (_, config) = backend("llama-gqa", 1);
    let (v, d) = (config.vocab_size, config.hidden_size);
    let whole = load(&config, &adapter_dir("saved/llama-gqa", "embed-head-o-r4")).unwrap();
    // Two f32 tables of [vocab, hidden], beside the LoRA factors.
    assert!(whole.bytes >= 2 * v * d * 4, "{}", whole.bytes);
    let rows = load(&config, &adapter_dir("saved/llama-gqa", "tokens-q-r4")).unwrap();
    assert!(
        rows.bytes >= 5 * d * 4 && rows.bytes < v * d * 4,
        "{}",
        rows.bytes
    );
}

/// A copy of a fixture adapter to edit.
fn copy(model: &str, name: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let src = adapter_dir(model, name);
    for f in ["adapter_config.json", "adapter_model.safetensors"] {
        std::fs::copy(src.join(f), dir.path().join(f)).unwrap();
    }
    dir
}

fn edit_config(dir: &std::path::Path, edit: impl FnOnce(&mut serde_json::Value)) {
    let path = dir.join("adapter_config.json");
    let mut c: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    edit(&mut c);
    std::fs::write(path, c.to_string()).unwrap();
}

/// Rewrites the adapter's weights with `tensor` given one more row (or,
/// with `shrink`, one fewer).
fn resize(dir: &std::path::Path, tensor: &str, shrink: bool) {
    let path = dir.join("adapter_model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut owned: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
    for (name, view) in file.tensors() {
        let (mut shape, mut data) = (view.shape().to_vec(), view.data().to_vec());
        if name == tensor && shrink {
            data.truncate(data.len() - shape[1] * 4);
            shape[0] -= 1;
        } else if name == tensor {
            data.extend(std::iter::repeat_n(0u8, shape[1] * 4));
            shape[0] += 1;
        }
        owned.push((name, shape, data));
    }
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = owned
        .iter()
        .map(|(n, s, d)| {
            let view = safetensors::tensor::TensorView::new(safetensors::Dtype::F32, s.clone(), d)
                .unwrap();
            (n.clone(), view)
        })
        .collect();
    safetensors::serialize_to_file(views, None, &path).unwrap();
}

#[test]
fn what_cannot_be_served_is_refused_by_field_or_tensor() {
    let (_, config) = backend("llama-gqa", 1);
    // A vocabulary grown past the base's by a saved lm_head alone: a new
    // token could be written but never read back.
    let head = "base_model.model.lm_head.weight";
    let dir = copy("saved/llama-gqa", "head-qv-r4");
    resize(dir.path(), head, false);
    let err = load(&config, dir.path()).unwrap_err();
    assert!(
        err.contains("modules_to_save")
            && err.contains("385 rows")
            && err.contains("has 384")
            && err.contains("embed_tokens must be saved too"),
        "{err}"
    );
    // Saved layers that disagree on the vocabulary, and one shrunk below
    // the base's.
    let dir = copy("saved/llama-gqa", "embed-head-o-r4");
    resize(dir.path(), head, false);
    let err = load(&config, dir.path()).unwrap_err();
    assert!(
        err.contains(head) && err.contains("385 rows") && err.contains("disagree"),
        "{err}"
    );
    let dir = copy("saved/llama-gqa", "head-qv-r4");
    resize(dir.path(), head, true);
    let err = load(&config, dir.path()).unwrap_err();
    assert!(
        err.contains(head) && err.contains("383 rows") && err.contains("shrunk"),
        "{err}"
    );
    // A trainable token the base has no row for.
    let dir = copy("saved/llama-gqa", "tokens-q-r4");
    edit_config(dir.path(), |c| {
        c["trainable_token_indices"][4] = 384.into();
    });
    let err = load(&config, dir.path()).unwrap_err();
    assert!(
        err.contains("trainable_token_indices") && err.contains("384 is not below"),
        "{err}"
    );
    // Fewer rows than listed tokens.
    edit_config(dir.path(), |c| {
        c["trainable_token_indices"] = serde_json::json!([1, 2, 3, 4, 5, 6]);
    });
    let err = load(&config, dir.path()).unwrap_err();
    assert!(
        err.contains("has 5 rows") && err.contains("lists 6 tokens"),
        "{err}"
    );
    // On a model that ties its lm_head to its embeddings, the lm_head's
    // rows follow the embeddings'; rows of its own are refused.
    let (_, tied) = backend("qwen2-tied", 1);
    let dir = copy("saved/qwen2-tied", "tokens-tied-r4");
    edit_config(dir.path(), |c| {
        let list = c["trainable_token_indices"].clone();
        c["trainable_token_indices"] = serde_json::json!({ "lm_head": list });
    });
    let err = load(&tied, dir.path()).unwrap_err();
    assert!(err.contains("trainable_token_indices.lm_head"), "{err}");
    // An adapter's own tokenizer whose new tokens have no row.
    let dir = copy("saved/llama-gqa", "tokens-q-r4");
    let mut tok: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(model_dir("llama-gqa").join("tokenizer.json")).unwrap(),
    )
    .unwrap();
    let write = |tok: &serde_json::Value| {
        std::fs::write(dir.path().join("tokenizer.json"), tok.to_string()).unwrap();
    };
    write(&tok);
    load(&config, dir.path()).unwrap();
    tok["added_tokens"]
        .as_array_mut()
        .unwrap()
        .push(serde_json::json!({
            "id": 384, "content": "<|tool|>", "single_word": false, "lstrip": false,
            "rstrip": false, "normalized": false, "special": true
        }));
    write(&tok);
    let err = load(&config, dir.path()).unwrap_err();
    assert!(
        err.contains("tokenizer.json") && err.contains("385 tokens") && err.contains("384 rows"),
        "{err}"
    );
    // A saved module that is not an embedding layer.
    let dir = copy("saved/llama-gqa", "head-qv-r4");
    edit_config(dir.path(), |c| {
        c["modules_to_save"] = serde_json::json!(["lm_head", "score"]);
    });
    let err = load(&config, dir.path()).unwrap_err();
    assert!(
        err.contains("modules_to_save") && err.contains("\"score\""),
        "{err}"
    );
}

#[derive(serde::Deserialize)]
struct ToolCase {
    prompt: String,
    prompt_ids: Vec<u32>,
    base_prompt_ids: Vec<u32>,
    greedy: Vec<u32>,
    text: String,
    logits: Vec<f32>,
}

#[derive(serde::Deserialize)]
struct ToolGolden {
    adapter: String,
    id: u32,
    cases: Vec<ToolCase>,
}

/// An adapter that ships its own tokenizer (a row given to a new token,
/// `<tool>`, trained in the embeddings and the lm_head): its requests are
/// tokenized and detokenized with it, the base's and a plain adapter's
/// with the base's, in one batch.
#[test]
fn an_adapter_s_own_tokenizer_reads_and_writes_its_requests() {
    use lorafleet_engine::{BackendChoice, Engine, EngineSettings, Prompt, Request, Sampling};
    let golden: ToolGolden = serde_json::from_str(
        &std::fs::read_to_string(fixtures().join("golden_adapter_tokenizer.json")).unwrap(),
    )
    .unwrap();
    let model = "llama-gqa";
    // The backend gives PEFT's logits on the adapter's ids.
    let (mut backend, config) = backend(model, 1);
    let adapter = load(&config, &adapter_dir("saved/llama-gqa", &golden.adapter)).unwrap();
    backend.write_slot(0, &adapter).unwrap();
    for (i, case) in golden.cases.iter().enumerate() {
        let mut batch = StepBatch::default();
        let table: Vec<u32> = (0..16).collect();
        batch.push(&case.prompt_ids, 0, &table, Some(0), true);
        batch.finish();
        let err = relative_error(&backend.forward(&batch).unwrap(), &case.logits);
        assert!(err <= 1e-4, "case {i}: {err}");
    }
    let mut e = Engine::load(
        &model_dir(model),
        EngineSettings {
            max_loras: 2,
            max_cpu_loras: 2,
            ..Default::default()
        },
        BackendChoice::Cpu,
    )
    .unwrap();
    e.register_adapter(aid(1), fixture_source("saved/llama-gqa", &golden.adapter))
        .unwrap();
    e.register_adapter(aid(2), fixture_source(model, "qv-r8"))
        .unwrap();
    let request = |i: usize, adapter: Option<u64>, prompt: &str| Request {
        id: format!("r{i}").into(),
        adapter: adapter.map(aid),
        prompt: Prompt::Text(prompt.into()),
        params: Sampling {
            max_tokens: golden.cases[0].greedy.len(),
            temperature: 0.0,
            ..Default::default()
        }
        .validate()
        .unwrap(),
    };
    let mut requests = Vec::new();
    for case in &golden.cases {
        let n = requests.len();
        requests.push(request(n, Some(1), &case.prompt));
        requests.push(request(n + 1, None, &case.prompt));
        requests.push(request(n + 2, Some(2), &case.prompt));
    }
    let done = e.run_to_completion(requests).unwrap();
    for (case, c) in golden.cases.iter().zip(done.chunks(3)) {
        let (own, base, plain) = (&c[0], &c[1], &c[2]);
        assert!(own.error.is_none(), "{:?}", own.error);
        assert_eq!(own.prompt_ids, case.prompt_ids, "{:?}", case.prompt);
        assert_eq!(own.token_ids, case.greedy, "{:?}", case.prompt);
        assert_eq!(own.text, case.text, "{:?}", case.prompt);
        assert_eq!(base.prompt_ids, case.base_prompt_ids, "{:?}", case.prompt);
        assert_eq!(plain.prompt_ids, case.base_prompt_ids, "{:?}", case.prompt);
    }
    // The new token is read as one token, which the base's splits.
    assert!(golden.cases[0].prompt_ids.contains(&golden.id));
    assert!(golden.cases[0].base_prompt_ids.len() > golden.cases[0].prompt_ids.len());
    assert!(done[0].text.contains("<tool>"), "{:?}", done[0].text);
}

/// An adapter whose own tokenizer has fewer ids than the model has rows
/// never draws a token past them: the same adapter as above with its
/// tokenizer cut at id 380 (and its `<tool>` gone) answers as PEFT does
/// until PEFT draws `<tool>`, then draws a token its tokenizer has.
#[test]
fn an_adapter_draws_no_token_its_tokenizer_lacks() {
    use lorafleet_engine::{BackendChoice, Engine, EngineSettings, Prompt, Request, Sampling};
    let golden: ToolGolden = serde_json::from_str(
        &std::fs::read_to_string(fixtures().join("golden_adapter_tokenizer.json")).unwrap(),
    )
    .unwrap();
    let cut = 380u32;
    let dir = copy("saved/llama-gqa", &golden.adapter);
    let mut tok: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(
            adapter_dir("saved/llama-gqa", &golden.adapter).join("tokenizer.json"),
        )
        .unwrap(),
    )
    .unwrap();
    let vocab = tok["model"]["vocab"].as_object_mut().unwrap();
    let gone: Vec<String> = vocab
        .iter()
        .filter(|(_, id)| id.as_u64().unwrap() >= u64::from(cut))
        .map(|(piece, _)| piece.clone())
        .collect();
    vocab.retain(|_, id| id.as_u64().unwrap() < u64::from(cut));
    let parts = |m: &serde_json::Value| -> Vec<String> {
        match m {
            serde_json::Value::String(s) => s.split(' ').map(str::to_owned).collect(),
            other => other
                .as_array()
                .unwrap()
                .iter()
                .map(|p| p.as_str().unwrap().to_owned())
                .collect(),
        }
    };
    tok["model"]["merges"].as_array_mut().unwrap().retain(|m| {
        let p = parts(m);
        !p.iter().any(|x| gone.contains(x)) && !gone.contains(&p.concat())
    });
    tok["added_tokens"]
        .as_array_mut()
        .unwrap()
        .retain(|t| t["id"].as_u64().unwrap() < u64::from(cut));
    std::fs::write(dir.path().join("tokenizer.json"), tok.to_string()).unwrap();
    let mut e = Engine::load(
        &model_dir("llama-gqa"),
        EngineSettings::default(),
        BackendChoice::Cpu,
    )
    .unwrap();
    let source = lorafleet_engine::AdapterSource {
        name: "cut".into(),
        dir: dir.path().to_path_buf(),
        declared_base_hash: None,
        digest: None,
    };
    e.register_adapter(aid(1), source).unwrap();
    let case = &golden.cases[1];
    assert!(case.greedy.contains(&golden.id), "PEFT draws <tool> here");
    let request = Request {
        id: "cut".into(),
        adapter: Some(aid(1)),
        prompt: Prompt::TokenIds(case.prompt_ids.clone()),
        params: Sampling {
            max_tokens: case.greedy.len(),
            temperature: 0.0,
            ..Default::default()
        }
        .validate()
        .unwrap(),
    };
    let done = &e.run_to_completion(vec![request]).unwrap()[0];
    assert!(done.error.is_none(), "{:?}", done.error);
    let first = case.greedy.iter().position(|&t| t >= cut).unwrap();
    assert_eq!(done.token_ids[..first], case.greedy[..first]);
    assert!(done.token_ids[first] < cut, "{:?}", done.token_ids);
    assert!(
        done.token_ids.iter().all(|&t| t < cut),
        "{:?}",
        done.token_ids
    );
}

/// An adapter trained on a vocabulary grown past the base's (three chat
/// tokens added, `resize_token_embeddings`, embed_tokens and lm_head in
/// `modules_to_save`, its tokenizer beside it): in one step with the base
/// and an adapter with its own lm_head of the base's rows, each row has
/// PEFT's logits over its own vocabulary and -inf past it.
#[test]
fn a_grown_vocabulary_s_rows_have_their_own_logits_beside_the_base_s() {
    let golden = golden_grown();
    let model = "llama-gqa";
    let (mut backend, config) = backend(model, 2);
    let v = config.vocab_size;
    assert!(golden.rows > v);
    let grown = load(&config, &adapter_dir("saved/llama-gqa", &golden.adapter)).unwrap();
    assert_eq!(grown.outer.saved.vocab(), Some(golden.rows));
    // What its slot packs beside it (the memory budget's count) is what
    // packing its lm_head takes: 387 rows in panels of 16.
    let d = config.hidden_size;
    let packed = lorafleet_engine::backend::cpu::panels::PackedLinear::pack(
        &vec![0f32; golden.rows * d],
        None,
        d,
        golden.rows,
    );
    assert_eq!(grown.slot_extra_bytes(), packed.weight_bytes() as u64);
    assert_eq!(grown.slot_extra_bytes(), (400 * d * 4) as u64);
    grown_vocabulary_beside_the_base_in_one_step(&mut backend, &golden);
}

/// Through the engine: the grown adapter's requests are tokenized with
/// its tokenizer (a new token is one id past the base's), answer as PEFT
/// does (writing new tokens), and the base's requests beside them score
/// over the base's vocabulary alone.
#[test]
fn an_adapter_with_a_grown_vocabulary_reads_and_writes_its_new_tokens() {
    use lorafleet_engine::{BackendChoice, Engine, EngineSettings, Prompt, Request, Sampling};
    let golden = golden_grown();
    let model = "llama-gqa";
    let mut e = Engine::load(
        &model_dir(model),
        EngineSettings {
            max_loras: 2,
            max_cpu_loras: 2,
            ..Default::default()
        },
        BackendChoice::Cpu,
    )
    .unwrap();
    let v = e.config().vocab_size;
    e.register_adapter(aid(1), fixture_source("saved/llama-gqa", &golden.adapter))
        .unwrap();
    e.register_adapter(aid(2), fixture_source(model, "qv-r8"))
        .unwrap();
    let request = |i: usize, adapter: Option<u64>, prompt: &str, logprobs: bool| Request {
        id: format!("r{i}").into(),
        adapter: adapter.map(aid),
        prompt: Prompt::Text(prompt.into()),
        params: Sampling {
            max_tokens: golden.cases[0].greedy.len(),
            temperature: 0.0,
            logprobs: logprobs.then_some(2),
            prompt_logprobs: logprobs.then_some(2),
            ..Default::default()
        }
        .validate()
        .unwrap(),
    };
    let base_prompt = "The quick brown fox";
    // The base's log probabilities with nothing else in its steps.
    let alone = e
        .run_to_completion(vec![request(100, None, base_prompt, true)])
        .unwrap()
        .remove(0);
    let mut requests = Vec::new();
    for case in &golden.cases {
        let n = requests.len();
        requests.push(request(n, Some(1), &case.prompt, true));
        requests.push(request(n + 1, None, base_prompt, true));
        requests.push(request(n + 2, Some(2), &case.prompt, false));
    }
    let done = e.run_to_completion(requests).unwrap();
    let mut wrote_new = false;
    for (case, c) in golden.cases.iter().zip(done.chunks(3)) {
        let (own, base, plain) = (&c[0], &c[1], &c[2]);
        for r in c {
            assert!(r.error.is_none(), "{:?}", r.error);
        }
        assert_eq!(own.prompt_ids, case.prompt_ids, "{:?}", case.prompt);
        assert_eq!(own.token_ids, case.greedy, "{:?}", case.prompt);
        assert_eq!(own.text, case.text, "{:?}", case.prompt);
        wrote_new |= own.token_ids.iter().any(|&t| t as usize >= v);
        // The first token's log probability is over the grown vocabulary
        // (PEFT's last-position logits, normalized here).
        let max = case.logits.iter().fold(f32::MIN, |m, &x| m.max(x));
        let sum: f64 = case.logits.iter().map(|&x| f64::from(x - max).exp()).sum();
        let want = f64::from(case.logits[case.greedy[0] as usize] - max) - sum.ln();
        let got = f64::from(own.logprobs[0].logprob.unwrap());
        assert!((got - want).abs() <= 1e-4, "{got} against {want}");
        // The base beside the grown rows scores as alone.
        assert_eq!(base.token_ids, alone.token_ids);
        for (a, b) in base.logprobs.iter().zip(&alone.logprobs) {
            assert_eq!(a.logprob, b.logprob);
        }
        for (a, b) in base.prompt_logprobs.iter().zip(&alone.prompt_logprobs) {
            assert_eq!(a.logprob, b.logprob);
        }
        // A plain adapter reads the new tokens' text with the base's
        // tokenizer: as several of the base's tokens.
        assert!(plain.prompt_ids.iter().all(|&t| (t as usize) < v));
    }
    assert!(
        golden.cases[0].prompt_ids.iter().any(|&t| t as usize >= v),
        "a new token is read"
    );
    assert!(wrote_new, "a new token is written");
}

/// An adapter registered with the base's vocabulary whose files, by the
/// time it first loads, grow it (replaced after registration) is refused
/// by `modules_to_save`, asking for it to be registered again: its
/// requests fail and none is served with rows its registration did not
/// count; a request for another adapter beside it is served.
#[test]
fn an_adapter_whose_vocabulary_changed_since_registration_is_refused_at_load() {
    use lorafleet_engine::{AdapterSource, BackendChoice, Engine, EngineSettings, Prompt, Request};
    let golden = golden_grown();
    let model = "llama-gqa";
    let mut e = Engine::load(
        &model_dir(model),
        EngineSettings {
            max_loras: 2,
            max_cpu_loras: 2,
            ..Default::default()
        },
        BackendChoice::Cpu,
    )
    .unwrap();
    let dir = copy(model, "qv-r8");
    e.register_adapter(
        aid(1),
        AdapterSource {
            name: "swapped".into(),
            dir: dir.path().to_path_buf(),
            declared_base_hash: None,
            digest: None,
        },
    )
    .unwrap();
    e.register_adapter(aid(2), fixture_source(model, "qv-r8"))
        .unwrap();
    let grown = adapter_dir("saved/llama-gqa", &golden.adapter);
    for f in std::fs::read_dir(&grown).unwrap() {
        let f = f.unwrap();
        std::fs::copy(f.path(), dir.path().join(f.file_name())).unwrap();
    }
    let request = |i: u64| Request {
        id: format!("r{i}").into(),
        adapter: Some(aid(i)),
        prompt: Prompt::TokenIds(vec![3, 4, 5]),
        params: lorafleet_engine::Sampling {
            max_tokens: 4,
            temperature: 0.0,
            ..Default::default()
        }
        .validate()
        .unwrap(),
    };
    let done = e.run_to_completion(vec![request(1), request(2)]).unwrap();
    let err = done[0]
        .error
        .as_ref()
        .expect("the swapped adapter is refused")
        .to_string();
    assert!(
        err.contains("modules_to_save") && err.contains("register it again"),
        "{err}"
    );
    assert!(done[0].token_ids.is_empty(), "{:?}", done[0].token_ids);
    assert!(done[1].error.is_none(), "{:?}", done[1].error);
    assert_eq!(done[1].token_ids.len(), 4);
}
