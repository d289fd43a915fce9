//! Shared helpers for the engine's tests: fixture paths and golden cases.

#![allow(dead_code)]

pub mod gpu;
pub mod logprob_golden;

#[allow(unused_imports)]
pub use logprob_golden::*;

use std::path::PathBuf;

/// The fixtures directory; `LORAFLEET_FIXTURES` overrides it for test
/// binaries run away from the checkout they were built in (the GPU check).
pub fn fixtures() -> PathBuf {
    std::env::var_os("LORAFLEET_FIXTURES").map_or_else(
        || PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures"),
        PathBuf::from,
    )
}

pub fn model_dir(model: &str) -> PathBuf {
    fixtures().join(model)
}

pub fn adapter_dir(model: &str, adapter: &str) -> PathBuf {
    fixtures().join("adapters").join(model).join(adapter)
}

/// Every adapter fixture of a model, by name.
pub fn adapter_names(model: &str) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(fixtures().join("adapters").join(model))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    names
}

#[derive(Debug, Clone, serde::Deserialize)]
pub struct GoldenCase {
    pub model: String,
    pub adapter: Option<String>,
    pub prompt: String,
    pub prompt_ids: Vec<u32>,
    pub greedy: Vec<u32>,
    pub logits: Vec<f32>,
}

#[derive(Debug, serde::Deserialize)]
pub struct Golden {
    pub max_new_tokens: usize,
    pub cases: Vec<GoldenCase>,
}

pub fn golden() -> Golden {
    golden_named("golden.json")
}

/// The Mixture-of-Experts models' golden cases.
pub fn golden_moe() -> Golden {
    golden_named("golden_moe.json")
}

/// The golden cases of one fixture file (`golden_*.json`).
pub fn golden_named(file: &str) -> Golden {
    let text = std::fs::read_to_string(fixtures().join(file)).unwrap();
    serde_json::from_str(&text).unwrap()
}

/// The schemes llama-gqa was quantized in by the tools
/// (`scripts/make_tool_quantized_fixtures.py`), as `llama-gqa-tool-<scheme>`.
pub const TOOL_SCHEMES: [&str; 10] = [
    "w8a16",
    "w8a16-asym",
    "w8a16-channel",
    "w4a16",
    "w4a16-asym",
    "w8a8",
    "fp8-dynamic",
    "fp8-block32",
    "fp8-block",
    "hf-fp8",
];

/// Runs a golden case on `backend`, one sequence alone in `slot`, and
/// checks it: logits at the last prompt position within 1e-4 relative
/// error, then greedy tokens (until EOS 2 or 4) equal.
pub fn check_golden_case(
    backend: &mut dyn lorafleet_engine::backend::Backend,
    case: &GoldenCase,
    slot: Option<usize>,
) {
    check_golden_case_within(backend, case, slot, 1e-4)
}

/// [`check_golden_case`] with the logits within `tolerance`.
pub fn check_golden_case_within(
    backend: &mut dyn lorafleet_engine::backend::Backend,
    case: &GoldenCase,
    slot: Option<usize>,
    tolerance: f32,
) {
    use lorafleet_engine::backend::StepBatch;
    let table = scattered_table(golden_blocks(case));
    let mut batch = StepBatch::default();
    batch.push(&case.prompt_ids, 0, &table, slot, true);
    batch.finish();
    let logits = backend.forward(&batch).unwrap();
    let err = relative_error(&logits, &case.logits);
    assert!(
        err <= tolerance,
        "{}/{:?} {:?}: logits relative error {err}",
        case.model,
        case.adapter,
        case.prompt
    );
    use lorafleet_engine::sampling::argmax;
    let mut tokens = vec![argmax(&logits)];
    let mut pos = case.prompt_ids.len();
    while tokens.len() < case.greedy.len() && ![2, 4].contains(tokens.last().unwrap()) {
        let mut batch = StepBatch::default();
        batch.push(&[*tokens.last().unwrap()], pos, &table, slot, true);
        batch.finish();
        tokens.push(argmax(&backend.forward(&batch).unwrap()));
        pos += 1;
    }
    assert_eq!(
        tokens, case.greedy,
        "{}/{:?} {:?}: greedy tokens",
        case.model, case.adapter, case.prompt
    );
}

/// One greedy request per golden case, `g0`, `g1`, …, each case's adapter
/// as its position in `names` (the ids `fixture_engine` registers them
/// under), up to the goldens' `max_new_tokens`.
pub fn golden_requests(
    cases: &[&GoldenCase],
    names: &[String],
    max_new_tokens: usize,
) -> Vec<lorafleet_engine::Request> {
    cases
        .iter()
        .enumerate()
        .map(|(i, c)| lorafleet_engine::Request {
            id: format!("g{i}").into(),
            adapter: c
                .adapter
                .as_ref()
                .map(|a| aid(names.iter().position(|n| n == a).unwrap() as u64 + 1)),
            prompt: lorafleet_engine::Prompt::TokenIds(c.prompt_ids.clone()),
            params: lorafleet_engine::Sampling {
                max_tokens: max_new_tokens,
                temperature: 0.0,
                ..Default::default()
            }
            .validate()
            .unwrap(),
        })
        .collect()
}

/// The 4-position KV blocks a golden case takes, at least 8.
pub fn golden_blocks(case: &GoldenCase) -> usize {
    (case.prompt_ids.len() + case.greedy.len())
        .div_ceil(4)
        .max(8)
}

/// A block table of `blocks` blocks in a scattered order, to exercise the
/// table: 5, 2, 7, 0, 3, 6, 1, 4 for eight.
pub fn scattered_table(blocks: usize) -> Vec<u32> {
    if blocks <= 8 {
        return vec![5, 2, 7, 0, 3, 6, 1, 4];
    }
    // A stride coprime to the count visits every block once.
    let stride = (3..).find(|s| gcd(*s, blocks) == 1).unwrap();
    (0..blocks)
        .map(|i| ((i * stride + 5) % blocks) as u32)
        .collect()
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 { a } else { gcd(b, a % b) }
}

/// max |a - b| / max |b|: the relative error of a logit vector.
pub fn relative_error(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    let scale = b.iter().fold(0f32, |m, x| m.max(x.abs()));
    a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs())) / scale
}

/// A fixture adapter as an engine source.
pub fn fixture_source(model: &str, name: &str) -> lorafleet_engine::AdapterSource {
    lorafleet_engine::AdapterSource {
        name: name.into(),
        dir: adapter_dir(model, name),
        declared_base_hash: None,
        digest: None,
    }
}

/// An engine on a fixture model with every fixture adapter registered, as
/// ids 1..=n in name order.
pub fn fixture_engine(
    model: &str,
    settings: lorafleet_engine::EngineSettings,
) -> lorafleet_engine::Engine {
    fixture_engine_on(model, settings, lorafleet_engine::BackendChoice::Cpu)
}

/// [`fixture_engine`] on the chosen backend.
pub fn fixture_engine_on(
    model: &str,
    settings: lorafleet_engine::EngineSettings,
    choice: lorafleet_engine::BackendChoice,
) -> lorafleet_engine::Engine {
    let mut e = lorafleet_engine::Engine::load(&model_dir(model), settings, choice).unwrap();
    for (i, name) in adapter_names(model).iter().enumerate() {
        e.register_adapter(aid(i as u64 + 1), fixture_source(model, name))
            .unwrap();
    }
    e
}

/// 2 requests per adapter (10 adapters) plus 4 base-model requests; half
/// greedy, half seeded sampling, with varied prompts and lengths.
pub fn mixed_workload() -> Vec<lorafleet_engine::Request> {
    let prompts = [
        "The quick brown fox",
        "Grüße aus München! 🚀",
        "SELECT * FROM adapters WHERE lora_int_id = 42;",
        "Once upon a time, there was a little model that served many adapters. Once upon a time",
        "def forward(self, x):",
    ];
    let mut out = Vec::new();
    for i in 0..24u64 {
        let adapter = if i < 20 { Some(aid(i % 10 + 1)) } else { None };
        let sampled = i % 2 == 1;
        out.push(lorafleet_engine::Request {
            id: format!("r{i}").into(),
            adapter,
            prompt: lorafleet_engine::Prompt::Text(prompts[i as usize % prompts.len()].into()),
            params: lorafleet_engine::Sampling {
                max_tokens: 6 + (i as usize % 7),
                temperature: if sampled { 0.9 } else { 0.0 },
                top_p: if sampled { 0.95 } else { 1.0 },
                top_k: if sampled { 50 } else { 0 },
                seed: Some(1000 + i),
                ..Default::default()
            }
            .validate()
            .unwrap(),
        });
    }
    out
}

/// An adapter pool and CPU backend on `model` with `slots` device slots
/// and `host` host slots, every fixture adapter of the model registered as
/// ids 1, 2, ... in name order. Returns them and the number of adapters.
#[allow(dead_code)]
pub fn fixture_pool(
    model: &str,
    slots: usize,
    host: usize,
) -> (
    lorafleet_engine::pool::AdapterPool,
    lorafleet_engine::backend::cpu::CpuBackend,
    u64,
) {
    use lorafleet_engine::backend::BackendShape;
    let dir = model_dir(model);
    let config = lorafleet_engine::model::ModelConfig::from_dir(&dir).unwrap();
    let backend = lorafleet_engine::backend::cpu::CpuBackend::load(
        &dir,
        &config,
        BackendShape {
            slots,
            max_lora_rank: 16,
            kv_blocks: 4,
            block_size: 4,
            ring_len: 0,
            ring_blocks: 0,
        },
    )
    .unwrap();
    let mut pool = lorafleet_engine::pool::AdapterPool::new(
        config,
        16,
        slots,
        host,
        lorafleet_engine::pool::BaseHash::parse(&"0".repeat(64)).unwrap(),
    );
    let names = adapter_names(model);
    for (i, name) in names.iter().enumerate() {
        pool.register(aid(i as u64 + 1), fixture_source(model, name))
            .unwrap();
    }
    (pool, backend, names.len() as u64)
}

/// The adapter id for a test's small number.
/// `r` with its sampling changed, and checked again.
pub fn with(
    mut r: lorafleet_engine::Request,
    change: impl FnOnce(&mut lorafleet_engine::Sampling),
) -> lorafleet_engine::Request {
    let mut params = r.params.into_inner();
    change(&mut params);
    r.params = params.validate().unwrap();
    r
}

pub fn aid(n: u64) -> lorafleet_engine::AdapterId {
    lorafleet_engine::AdapterId::new(n).expect("test ids start at 1")
}

/// For the Mixture-of-Experts models: three requests per adapter plus
/// three on the base model, half greedy, half seeded sampling.
pub fn moe_workload(adapters: usize) -> Vec<lorafleet_engine::Request> {
    let prompts = [
        "The quick brown fox",
        "Grüße aus München! 🚀",
        "SELECT * FROM adapters WHERE lora_int_id = 42;",
        "def forward(self, x):",
    ];
    let n = (adapters as u64 + 1) * 3;
    (0..n)
        .map(|i| {
            let which = i % (adapters as u64 + 1);
            let sampled = i % 2 == 1;
            lorafleet_engine::Request {
                id: format!("r{i}").into(),
                adapter: (which > 0).then(|| aid(which)),
                prompt: lorafleet_engine::Prompt::Text(prompts[i as usize % prompts.len()].into()),
                params: lorafleet_engine::Sampling {
                    max_tokens: 5 + (i as usize % 6),
                    temperature: if sampled { 0.9 } else { 0.0 },
                    top_p: if sampled { 0.95 } else { 1.0 },
                    top_k: if sampled { 50 } else { 0 },
                    seed: Some(500 + i),
                    ..Default::default()
                }
                .validate()
                .unwrap(),
            }
        })
        .collect()
}

/// A staggered mixed batch of a Mixture-of-Experts model's adapters (two
/// requests submitted every other step) gives each request the tokens and
/// text it gets alone, on `choice`.
pub fn assert_staggered_batch_equals_alone(model: &str, choice: lorafleet_engine::BackendChoice) {
    let adapters = adapter_names(model).len();
    let requests = moe_workload(adapters);
    let mut solo = fixture_engine_on(
        model,
        lorafleet_engine::EngineSettings {
            max_loras: 1,
            max_cpu_loras: 1,
            ..Default::default()
        },
        choice,
    );
    let expected: Vec<(Vec<u32>, String)> = requests
        .iter()
        .map(|r| {
            let c = solo
                .run_to_completion(vec![r.clone()])
                .unwrap()
                .pop()
                .unwrap();
            assert!(c.error.is_none(), "{:?}", c.error);
            (c.token_ids, c.text)
        })
        .collect();

    let mut e = fixture_engine_on(
        model,
        lorafleet_engine::EngineSettings {
            max_loras: 2,
            max_cpu_loras: 3,
            max_batched_tokens: 16,
            max_num_seqs: 8,
            ..Default::default()
        },
        choice,
    );
    // Every adapter in the host tier first (the device's two slots still
    // change hands), so steps mix adapters however fast they run: an
    // optimized build otherwise finishes requests while the next adapter
    // is still being read.
    for id in 1..=adapters as u64 {
        e.prefetch(aid(id));
    }
    while e.pool().loads_in_flight() > 0 {
        e.pool().poll_loads(Some(std::time::Duration::from_secs(5)));
    }
    let mut outputs: Vec<(Vec<u32>, String)> = vec![Default::default(); requests.len()];
    let (mut finished, mut step, mut max_distinct, mut max_tokens) = (0, 0, 0, 0);
    let mut pending = requests.iter();
    while finished < requests.len() {
        if step % 2 == 0 {
            for r in pending.by_ref().take(2) {
                e.submit(r.clone()).unwrap();
            }
        }
        for (id, event) in e.step().unwrap() {
            let i: usize = id[1..].parse().unwrap();
            match event {
                lorafleet_engine::Event::Delta {
                    token_ids, text, ..
                } => {
                    outputs[i].0.extend(token_ids);
                    outputs[i].1.push_str(&text);
                }
                lorafleet_engine::Event::Finished(_) => finished += 1,
                lorafleet_engine::Event::Failed(err) => panic!("{model} {id}: {err}"),
                lorafleet_engine::Event::PromptLogprobs(_) => {}
            }
        }
        max_distinct = max_distinct.max(e.last_step().distinct_adapters);
        max_tokens = max_tokens.max(e.last_step().tokens);
        step += 1;
        assert!(step < 10_000, "the batch never drained");
    }
    for (i, (got, want)) in outputs.iter().zip(&expected).enumerate() {
        assert_eq!(got, want, "{model}: r{i} differs between batched and alone");
    }
    assert!(
        max_distinct >= 2,
        "{model}: steps mixed adapters ({max_distinct})"
    );
    assert!(max_tokens > 1, "{model}: steps batched several tokens");
}

/// Runs every golden case of `model` on its CPU backend (one slot), each
/// case's adapter loaded from `adapter_model`'s fixture adapters into the
/// slot first; returns how many cases ran.
pub fn check_golden_cases_on_cpu(golden: &Golden, model: &str, adapter_model: &str) -> usize {
    check_golden_cases_on_cpu_within(golden, model, adapter_model, 1e-4)
}

/// [`check_golden_cases_on_cpu`] with the logits within `tolerance`.
pub fn check_golden_cases_on_cpu_within(
    golden: &Golden,
    model: &str,
    adapter_model: &str,
    tolerance: f32,
) -> usize {
    use lorafleet_engine::backend::Backend;
    let dir = model_dir(model);
    let config = lorafleet_engine::model::ModelConfig::from_dir(&dir).unwrap();
    let cases = golden.cases.iter().filter(|c| c.model == model);
    let shape = lorafleet_engine::backend::BackendShape {
        slots: 1,
        max_lora_rank: 16,
        kv_blocks: cases.clone().map(golden_blocks).max().unwrap_or(8),
        block_size: 4,
        ring_len: 0,
        ring_blocks: 0,
    };
    let mut backend =
        lorafleet_engine::backend::cpu::CpuBackend::load(&dir, &config, shape).unwrap();
    let mut checked = 0;
    for case in cases {
        let slot = case.adapter.as_ref().map(|name| {
            let limits = lorafleet_engine::lora::AdapterLimits {
                model: &config,
                max_lora_rank: 16,
                base_hash_check: None,
            };
            let adapter = lorafleet_engine::lora::HostAdapter::load(
                name,
                &adapter_dir(adapter_model, name),
                limits,
            )
            .unwrap();
            backend.write_slot(0, &adapter).unwrap();
            0
        });
        check_golden_case_within(&mut backend, case, slot, tolerance);
        checked += 1;
    }
    checked
}

/// Every GPT-OSS golden case (`golden_gpt_oss.json`) of `model` (`gpt-oss`
/// or `gpt-oss-mxfp4`) in one batch through the engine on `choice` (rings
/// for the sliding layers, prefill chunks of 24, the pool), greedy: the
/// goldens' tokens, the prompt longer than six windows included. The
/// adapters are the bf16 base's fixtures; they serve both.
pub fn gpt_oss_engine_matches_the_goldens(model: &str, choice: lorafleet_engine::BackendChoice) {
    let golden = golden_named("golden_gpt_oss.json");
    let names = adapter_names("gpt-oss");
    let mut e = lorafleet_engine::Engine::load(
        &model_dir(model),
        lorafleet_engine::EngineSettings {
            max_loras: 2,
            max_cpu_loras: 3,
            max_batched_tokens: 24,
            ..Default::default()
        },
        choice,
    )
    .unwrap();
    for (i, name) in names.iter().enumerate() {
        e.register_adapter(aid(i as u64 + 1), fixture_source("gpt-oss", name))
            .unwrap();
    }
    let cases: Vec<_> = golden.cases.iter().filter(|c| c.model == model).collect();
    assert!(cases.iter().any(|c| c.prompt_ids.len() > 6 * 8));
    let requests = golden_requests(&cases, &names, golden.max_new_tokens);
    for (c, case) in e.run_to_completion(requests).unwrap().iter().zip(&cases) {
        assert!(c.error.is_none(), "{:?}", c.error);
        assert_eq!(
            c.token_ids, case.greedy,
            "{model}/{:?} {:?}: engine batch on {choice:?}",
            case.adapter, case.prompt
        );
    }
}

/// The golden case of `model` with `adapter` (None: the base) on `prompt`.
pub fn golden_case(g: &Golden, model: &str, adapter: Option<&str>, prompt: &str) -> GoldenCase {
    g.cases
        .iter()
        .find(|c| c.model == model && c.adapter.as_deref() == adapter && c.prompt == prompt)
        .unwrap_or_else(|| panic!("no golden case of {model}/{adapter:?} on {prompt:?}"))
        .clone()
}

/// The slots [`every_adapter_kind_in_one_step`] fills.
pub const EVERY_KIND_SLOTS: usize = 9;

/// Every kind of adapter the engine serves (own rows of the lm_head and
/// the embeddings, whole and by token; a plain one, DoRA, `lora_bias`,
/// embedding and lm_head LoRA, regex targets) in one step on `backend`, a
/// `llama-gqa` one of [`EVERY_KIND_SLOTS`] slots and at least 80 KV blocks
/// of 4: each row within `tolerance` of its golden (PEFT's), the base's
/// too; then a cleared slot is the base again.
pub fn every_adapter_kind_in_one_step(
    backend: &mut dyn lorafleet_engine::backend::Backend,
    tolerance: f32,
) {
    use lorafleet_engine::backend::StepBatch;
    let model = "llama-gqa";
    let config = backend.config().clone();
    // (fixture directory, adapter, its goldens' file).
    let others = [
        (model, "qv-r8", "golden.json"),
        ("dora/llama-gqa", "dora-qv-r8", "golden_dora.json"),
        ("bias/llama-gqa", "bias-qv-r8", "golden_bias.json"),
        (
            "embedding/llama-gqa",
            "embed-head-rslora",
            "golden_embedding.json",
        ),
        (
            "targets/llama-gqa",
            "regex-layer1-attn",
            "golden_targets.json",
        ),
    ];
    assert_eq!(backend.shape().slots, 4 + others.len());
    let names = [
        "head-qv-r4",
        "tokens-q-r4",
        "embed-head-o-r4",
        "tokens-dict-r2",
    ];
    for (slot, name) in names.iter().enumerate() {
        let adapter = gpu::load_adapter(&config, "saved/llama-gqa", name);
        assert!(adapter.has_outer(), "{name}");
        backend.write_slot(slot, &adapter).unwrap();
    }
    for (i, (dir, name, _)) in others.iter().enumerate() {
        let adapter = gpu::load_adapter(&config, dir, name);
        backend.write_slot(4 + i, &adapter).unwrap();
    }
    let prompt = "The quick brown fox";
    let pick = |g: &Golden, adapter: Option<&str>| golden_case(g, model, adapter, prompt);
    let (plain_golden, golden) = (
        golden_named("golden.json"),
        golden_named("golden_saved.json"),
    );
    let mut cases: Vec<(GoldenCase, Option<usize>)> = names
        .iter()
        .enumerate()
        .map(|(slot, n)| (pick(&golden, Some(n)), Some(slot)))
        .collect();
    cases.insert(2, (pick(&plain_golden, None), None));
    for (i, (_, name, file)) in others.iter().enumerate() {
        cases.push((pick(&golden_named(file), Some(name)), Some(4 + i)));
    }
    let mut batch = StepBatch::default();
    let tables: Vec<Vec<u32>> = (0..cases.len() as u32)
        .map(|s| (s * 8..s * 8 + 8).collect())
        .collect();
    for ((case, slot), table) in cases.iter().zip(&tables) {
        batch.push(&case.prompt_ids, 0, table, *slot, true);
    }
    batch.finish();
    let logits = backend.forward(&batch).unwrap();
    let v = config.vocab_size;
    for (i, (case, _)) in cases.iter().enumerate() {
        let err = relative_error(&logits[i * v..(i + 1) * v], &case.logits);
        assert!(err <= tolerance, "{:?}: {err}", case.adapter);
    }
    // A cleared slot is the base again.
    backend.clear_slot(0).unwrap();
    let mut batch = StepBatch::default();
    batch.push(&cases[0].0.prompt_ids, 0, &tables[0], Some(0), true);
    batch.finish();
    let base = pick(&plain_golden, None);
    assert!(relative_error(&backend.forward(&batch).unwrap(), &base.logits) <= tolerance);
}

/// `golden_grown_vocab.json`: PEFT's goldens of the adapter with a grown
/// vocabulary (its rows, and each prompt's case).
#[derive(serde::Deserialize)]
pub struct GrownGolden {
    pub adapter: String,
    pub rows: usize,
    pub cases: Vec<GrownCase>,
}

#[derive(serde::Deserialize)]
pub struct GrownCase {
    pub prompt: String,
    pub prompt_ids: Vec<u32>,
    pub greedy: Vec<u32>,
    pub text: String,
    pub logits: Vec<f32>,
}

pub fn golden_grown() -> GrownGolden {
    serde_json::from_str(
        &std::fs::read_to_string(fixtures().join("golden_grown_vocab.json")).unwrap(),
    )
    .unwrap()
}

/// The grown-vocabulary adapter in slot 0 and an adapter with its own
/// lm_head of the base's rows in slot 1 of `backend` (a `llama-gqa` one of
/// two slots and at least 48 KV blocks of 4), in one step with the base:
/// each row within 1e-4 of PEFT's logits over its own vocabulary and -inf
/// past it; a step as wide as the base's refused for the grown rows, and a
/// new token refused where its slot has no row for it.
pub fn grown_vocabulary_beside_the_base_in_one_step(
    backend: &mut dyn lorafleet_engine::backend::Backend,
    golden: &GrownGolden,
) {
    use lorafleet_engine::backend::StepBatch;
    let model = "llama-gqa";
    let config = backend.config().clone();
    let v = config.vocab_size;
    let grown = gpu::load_adapter(&config, "saved/llama-gqa", &golden.adapter);
    let golden_saved = || golden_named("golden_saved.json");
    backend.write_slot(0, &grown).unwrap();
    let head = gpu::load_adapter(&config, "saved/llama-gqa", "head-qv-r4");
    backend.write_slot(1, &head).unwrap();
    let prompt = "The quick brown fox";
    let pick = |g: &Golden, adapter: Option<&str>| golden_case(g, model, adapter, prompt);
    let base = pick(&golden_named("golden.json"), None);
    let own_head = pick(&golden_saved(), Some("head-qv-r4"));
    // (prompt ids, slot, golden logits).
    let mut rows: Vec<(&[u32], Option<usize>, &[f32])> =
        vec![(&base.prompt_ids, None, &base.logits)];
    for case in &golden.cases {
        rows.push((&case.prompt_ids, Some(0), &case.logits));
    }
    rows.push((&own_head.prompt_ids, Some(1), &own_head.logits));
    let tables: Vec<Vec<u32>> = (0..rows.len() as u32)
        .map(|s| (s * 8..s * 8 + 8).collect())
        .collect();
    let mut batch = StepBatch::default();
    for ((ids, slot, _), table) in rows.iter().zip(&tables) {
        batch.push(ids, 0, table, *slot, true);
    }
    batch.width = golden.rows;
    batch.finish();
    let w = golden.rows;
    let logits = backend.forward(&batch).unwrap();
    assert_eq!(logits.len(), rows.len() * w);
    for (i, (_, slot, want)) in rows.iter().enumerate() {
        let row = &logits[i * w..(i + 1) * w];
        let own = want.len();
        let err = relative_error(&row[..own], want);
        assert!(err <= 1e-4, "row {i} (slot {slot:?}): {err}");
        assert!(
            row[own..].iter().all(|&l| l == f32::NEG_INFINITY),
            "row {i} past its {own} logits: {:?}",
            &row[own..]
        );
    }
    // A step as wide as the base's cannot hold the grown rows (a prompt
    // of old tokens: new ones are refused before), nor its new tokens.
    let old_ids = &golden.cases[2].prompt_ids;
    assert!(old_ids.iter().all(|&t| (t as usize) < v));
    let mut narrow = StepBatch::default();
    narrow.push(old_ids, 0, &tables[1], Some(0), true);
    narrow.finish();
    let err = backend.forward(&narrow).unwrap_err().to_string();
    assert!(
        err.contains("387 logits") && err.contains("384 wide"),
        "{err}"
    );
    let mut narrow = StepBatch::default();
    narrow.push(&golden.cases[0].prompt_ids, 0, &tables[1], Some(0), true);
    narrow.finish();
    let err = backend.forward(&narrow).unwrap_err().to_string();
    assert!(err.contains("not below vocab_size 384"), "{err}");
    // A new token is embedded only by the adapter that has its row.
    let mut base_new = StepBatch::default();
    base_new.push(&golden.cases[0].prompt_ids, 0, &tables[1], Some(1), true);
    base_new.width = golden.rows;
    base_new.finish();
    let err = backend.forward(&base_new).unwrap_err().to_string();
    assert!(err.contains("not below vocab_size 384"), "{err}");
}
