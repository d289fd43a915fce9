//! Model families from their checkpoints' own `config.json` (sizes shrunk;
//! `scripts/make_family_fixtures.py`): Llama 3.2 (RoPE `llama3` scaling,
//! tied embeddings, a list of end tokens), Qwen3 (q/k norms, an explicit
//! `head_dim`, YaRN) and Phi-4 (fused `qkv_proj` and `gate_up_proj`, and
//! adapters on them), against transformers + PEFT on the CPU backend: every
//! prompt position's log probability over a prompt of at least 96 tokens
//! (past each scaling's original context) and greedy tokens, within 1e-4,
//! all of a model's cases in one mixed batch; and a staggered batch of a
//! family's adapters equal to each request alone.

mod common;

use common::*;
use lorafleet_engine::lora::{AdapterLimits, HostAdapter, Projection};
use lorafleet_engine::model::ModelConfig;
use lorafleet_engine::model::rope::RopeScaling;

const FAMILIES: [&str; 10] = [
    "llama32-tied",
    "qwen3-yarn",
    "phi4",
    "phi35-mini",
    "phi4-mini",
    "gemma3-1b",
    "gemma3-4b",
    "gemma2-2b",
    "llama2-dynamic",
    "gemma3-4b-mm",
];

#[test]
fn families_match_transformers_and_peft_over_long_prompts() {
    let g = logprob_golden("golden_families.json");
    let mut checked = 0;
    for model in FAMILIES {
        checked += check_logprob_goldens(&g, model);
    }
    assert_eq!(checked, g.cases.len());
    let longest = g.cases.iter().map(|c| c.prompt_ids.len()).max().unwrap();
    assert!(longest >= 96, "a long prompt: {longest} tokens");
    // Every adapter of every family, the base too, on each prompt: a short
    // one, a long one, and one whose greedy tokens cross LongRoPE's
    // original context (64), where the sequence switches to the long
    // factors and is recomputed with them.
    let adapters: usize = FAMILIES.iter().map(|m| adapter_names(m).len() + 1).sum();
    assert_eq!(checked, 3 * adapters);
    assert!(
        g.cases
            .iter()
            .any(|c| c.prompt_ids.len() < 64 && c.prompt_ids.len() + c.completion.len() > 64)
    );
}

#[test]
fn each_family_reads_its_config_as_shipped() {
    let llama = ModelConfig::from_dir(&model_dir("llama32-tied")).unwrap();
    assert!(matches!(
        llama.rope.scaling,
        RopeScaling::Llama3 {
            original_max_position_embeddings: 64,
            ..
        }
    ));
    assert!(llama.tie_word_embeddings);
    assert_eq!(llama.eos_token_ids, vec![2, 3, 4], "every end token");

    let qwen3 = ModelConfig::from_dir(&model_dir("qwen3-yarn")).unwrap();
    assert!(qwen3.qk_norm && !qwen3.qkv_bias);
    assert_eq!(
        (qwen3.head_dim, qwen3.q_dim(), qwen3.hidden_size),
        (32, 128, 64),
        "head_dim as given, not hidden / heads"
    );
    assert!(matches!(qwen3.rope.scaling, RopeScaling::Yarn { factor, .. } if factor == 4.0));
    assert!(qwen3.rope.attention_factor() > 1.0);

    let phi = ModelConfig::from_dir(&model_dir("phi4")).unwrap();
    assert!(phi.architecture.fused_projections());
    assert_eq!(phi.rope.scaling, RopeScaling::Default);

    let phi35 = ModelConfig::from_dir(&model_dir("phi35-mini")).unwrap();
    assert_eq!(
        phi35.rope.long_after(),
        Some(64),
        "the top-level original context"
    );
    assert_eq!((phi35.sliding_window, phi35.num_kv_heads), (Some(48), 4));
    // sqrt(1 + ln(2048 / 64) / ln(64)), from the contexts' ratio.
    let expected = (1.0 + (32f32).ln() / (64f32).ln()).sqrt();
    assert!((phi35.rope.attention_factor() - expected).abs() < 1e-6);

    let mini = ModelConfig::from_dir(&model_dir("phi4-mini")).unwrap();
    assert_eq!(
        (mini.head_dim, mini.rope.rotary_dim),
        (16, 12),
        "partial_rotary_factor"
    );
    assert_eq!(mini.rope.long_inv_freq().unwrap().len(), 6);
    assert!(mini.tie_word_embeddings);

    // Gemma 3 as the Hub ships it (sliding_window_pattern 6) and as
    // transformers 5 writes it (layer_types, rope_parameters by layer type).
    use lorafleet_engine::model::config::Architecture;
    use lorafleet_engine::model::layers::{Activation, LayerKind};
    // And the multimodal checkpoint's language model: its text_config over
    // transformers' defaults.
    for (model, window, global) in [
        ("gemma3-1b", 16, RopeScaling::Default),
        ("gemma3-4b", 24, RopeScaling::Linear { factor: 8.0 }),
        ("gemma3-4b-mm", 16, RopeScaling::Linear { factor: 8.0 }),
    ] {
        let g = ModelConfig::from_dir(&model_dir(model)).unwrap();
        assert_eq!(g.architecture, Architecture::Gemma3);
        let kinds: Vec<LayerKind> = (0..6)
            .map(|l| match l {
                5 => LayerKind::Full,
                _ => LayerKind::Sliding,
            })
            .collect();
        assert_eq!(g.layer_kinds, kinds, "{model}: every sixth layer global");
        assert_eq!((g.window(0), g.window(5)), (Some(window), None));
        assert_eq!(
            (g.rope_of(5).theta, g.rope_of(0).theta),
            (1e6, 1e4),
            "{model}"
        );
        assert_eq!(g.rope_of(5).scaling, global, "{model}");
        assert_eq!(g.rope_of(0).scaling, RopeScaling::Default, "{model}");
        assert_eq!(g.activation, Activation::GeluTanh);
        assert!(g.qk_norm && g.tie_word_embeddings);
        assert_eq!(g.attention_scale(), 1.0 / 16.0, "query_pre_attn_scalar 256");
        assert_eq!(g.gemma.as_ref().unwrap().embed_scale, 8.0, "√64");
    }
    let g2 = ModelConfig::from_dir(&model_dir("gemma2-2b")).unwrap();
    let gemma = g2.gemma.as_ref().unwrap();
    assert_eq!(
        (gemma.attn_logit_softcapping, gemma.final_logit_softcapping),
        (Some(50.0), Some(30.0))
    );
    assert_eq!(
        g2.layer_kinds,
        [
            LayerKind::Sliding,
            LayerKind::Full,
            LayerKind::Sliding,
            LayerKind::Full
        ],
        "Gemma 2 alternates"
    );
    assert!(!g2.qk_norm && gemma.local_rope.is_none());
}

#[test]
fn a_multimodal_gemma3_adapter_serves_its_language_models_factors() {
    // PEFT applied the adapter's q_proj and v_proj targets to the vision
    // tower too: those factors act on images alone (refused), so they are
    // left out; the language model's load under the text model's names.
    let config = ModelConfig::from_dir(&model_dir("gemma3-4b-mm")).unwrap();
    let limits = AdapterLimits {
        model: &config,
        max_lora_rank: 16,
        base_hash_check: None,
    };
    let a = HostAdapter::load("qv-r8", &adapter_dir("gemma3-4b-mm", "qv-r8"), limits).unwrap();
    for layer in &a.modules {
        assert!(layer[Projection::Q.index()].is_some() && layer[Projection::V.index()].is_some());
        assert!(layer[Projection::K.index()].is_none());
    }
    assert_eq!(a.modules.len(), 6);
}

#[test]
fn a_gemma_config_that_contradicts_itself_is_refused_by_field() {
    let src: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(model_dir("gemma3-4b").join("config.json")).unwrap(),
    )
    .unwrap();
    for (edit, needle) in [
        (
            serde_json::json!({"sliding_window": 0}),
            "`sliding_window`: must be positive",
        ),
        (
            serde_json::json!({"layer_types": ["full_attention"]}),
            "`layer_types`: has 1 entries for num_hidden_layers 6",
        ),
        (
            serde_json::json!({"hidden_activation": "relu"}),
            "`hidden_activation`: \"relu\" is not supported",
        ),
        (
            serde_json::json!({"final_logit_softcapping": -1.0}),
            "`final_logit_softcapping`: -1 must be positive",
        ),
        (
            serde_json::json!({"rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 0.0}}}),
            "`rope_parameters.full_attention.factor`: 0 must be a positive number",
        ),
        (
            serde_json::json!({"use_bidirectional_attention": true}),
            "`use_bidirectional_attention`",
        ),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let mut cfg = src.clone();
        for (k, v) in edit.as_object().unwrap() {
            cfg[k] = v.clone();
        }
        std::fs::write(dir.path().join("config.json"), cfg.to_string()).unwrap();
        let err = ModelConfig::from_dir(dir.path()).unwrap_err().to_string();
        assert!(err.contains(needle), "{needle}: {err}");
    }
}

#[test]
fn a_fused_module_adapter_splits_into_its_projections() {
    // Phi-4's qkv_proj adapter: one A shared by q, k and v, and B's rows
    // split as the fused weight's are.
    let config = ModelConfig::from_dir(&model_dir("phi4")).unwrap();
    let limits = AdapterLimits {
        model: &config,
        max_lora_rank: 16,
        base_hash_check: None,
    };
    let a = HostAdapter::load("qkv-o-r8", &adapter_dir("phi4", "qkv-o-r8"), limits).unwrap();
    let layer = &a.modules[0];
    let [q, k, v, o] = [Projection::Q, Projection::K, Projection::V, Projection::O]
        .map(|p| layer[p.index()].as_ref().expect("targeted"));
    assert_eq!(q.a_f32(), k.a_f32());
    assert_eq!(k.a_f32(), v.a_f32());
    assert_eq!(q.b_t_f32().len(), 8 * config.q_dim());
    assert_eq!(k.b_t_f32().len(), 8 * config.kv_dim());
    assert_eq!(o.rank, 8);
    assert!(layer[Projection::Gate.index()].is_none());
}

#[test]
fn adapters_for_the_other_layout_are_refused_by_name() {
    // q_proj on Phi-4 (which fuses it) and qkv_proj on Llama (which does
    // not) are modules those models lack: refused, never ignored.
    for (model, donor, adapter, needle) in [
        (
            "phi4",
            "llama32-tied",
            "qkvo-r8",
            "\"q_proj\" is not a module of a phi3 model",
        ),
        (
            "llama32-tied",
            "phi4",
            "qkv-o-r8",
            "\"qkv_proj\" is not a module of a llama model",
        ),
    ] {
        let config = ModelConfig::from_dir(&model_dir(model)).unwrap();
        let limits = AdapterLimits {
            model: &config,
            max_lora_rank: 16,
            base_hash_check: None,
        };
        let err = HostAdapter::load(adapter, &adapter_dir(donor, adapter), limits)
            .unwrap_err()
            .to_string();
        assert!(err.contains(needle), "{model}: {err}");
        assert!(err.contains("`target_modules`"), "{err}");
    }
}

#[test]
fn a_staggered_mixed_batch_of_each_familys_adapters_equals_one_at_a_time() {
    for model in FAMILIES {
        assert_staggered_batch_equals_alone(model, lorafleet_engine::BackendChoice::Cpu);
    }
}

#[test]
fn gemmas_sliding_layers_keep_only_their_window_in_rings() {
    // Blocks of 4 positions and chunks of at most 8: a ring of
    // ceil((16 + 8 - 1) / 4) + 1 = 7 blocks a sequence, which the 170-token
    // prompt goes round many times; the global layers keep every position
    // in the block table. The goldens hold, in one mixed batch.
    use lorafleet_engine::backend::cpu::CpuBackend;
    use lorafleet_engine::{EngineSettings, Request};
    let g = logprob_golden("golden_families.json");
    for (model, table_layers) in [("gemma3-1b", 1), ("gemma2-2b", 2)] {
        let config = ModelConfig::from_dir(&model_dir(model)).unwrap();
        assert!(config.mixed_layers());
        assert_eq!(config.table_layers(), table_layers);
        // A block holds the global layers' keys and values alone.
        let block = CpuBackend::memory_units(&config, 4, 16).block_bytes;
        assert_eq!(block, (2 * table_layers * 4 * config.kv_dim() * 4) as u64);

        let names = adapter_names(model);
        let settings = EngineSettings {
            max_batched_tokens: 8,
            block_size: 4,
            kv_blocks: 1024,
            ..Default::default()
        };
        let mut e = fixture_engine(model, settings);
        let cases: Vec<&LogprobCase> = g.cases.iter().filter(|c| c.model == model).collect();
        let requests: Vec<Request> = cases
            .iter()
            .enumerate()
            .map(|(i, case)| {
                let adapter = case
                    .adapter
                    .as_ref()
                    .map(|a| names.iter().position(|n| n == a).unwrap() as u64 + 1);
                logprob_request(format!("r{i}"), case, adapter, &g)
            })
            .collect();
        let out = e.run_to_completion(requests).unwrap();
        for (case, c) in cases.iter().zip(&out) {
            check_logprob_case(case, c);
        }
        // Every block came back; the rings too (a second run fits again).
        assert_eq!(e.stats().kv_blocks_used, 0, "{model}");
    }
}

#[test]
fn a_uniform_windows_blocks_behind_it_go_back_as_the_sequence_moves() {
    // Phi-3.5-mini's stand-in slides every layer by 48 positions. With
    // blocks of 4 and chunks of 8 a sequence holds at most
    // ceil(56 / 4) + 1 = 15 blocks, so each golden (prompts of 96 tokens
    // and more) runs alone in a cache of 16 blocks that could not hold
    // its whole length, and all of them in one batch in 9 × 16.
    use lorafleet_engine::{EngineSettings, Request};
    let model = "phi35-mini";
    let config = ModelConfig::from_dir(&model_dir(model)).unwrap();
    assert_eq!(config.uniform_window(), Some(48));
    let g = logprob_golden("golden_families.json");
    let names = adapter_names(model);
    let cases: Vec<&LogprobCase> = g.cases.iter().filter(|c| c.model == model).collect();
    let request = |i: usize, case: &LogprobCase| -> Request {
        let adapter = case
            .adapter
            .as_ref()
            .map(|a| names.iter().position(|n| n == a).unwrap() as u64 + 1);
        logprob_request(format!("r{i}"), case, adapter, &g)
    };
    let settings = |kv_blocks: usize| EngineSettings {
        max_batched_tokens: 8,
        block_size: 4,
        kv_blocks,
        ..Default::default()
    };
    let longest = cases
        .iter()
        .map(|c| c.prompt_ids.len() + g.new_tokens)
        .max()
        .unwrap();
    assert!(
        longest.div_ceil(4) > 16,
        "{longest} positions fit 16 blocks"
    );
    let mut e = fixture_engine(model, settings(16));
    // Stepped by hand with room to spare: after every step the sequence
    // holds 15 blocks at most, wherever it is.
    let mut e_step = fixture_engine(model, settings(1024));
    let long = cases.iter().max_by_key(|c| c.prompt_ids.len()).unwrap();
    e_step.submit(request(0, long)).unwrap();
    let mut steps = 0;
    while e_step.has_work() {
        e_step.step().unwrap();
        steps += 1;
        let used = e_step.stats().kv_blocks_used;
        assert!(used <= 15, "step {steps}: {used} blocks held");
        assert!(steps < 1000, "no progress");
    }
    for (i, case) in cases.iter().enumerate() {
        let out = e.run_to_completion(vec![request(i, case)]).unwrap();
        check_logprob_case(case, &out[0]);
        assert_eq!(e.stats().kv_blocks_used, 0);
    }
    let mut e = fixture_engine(model, settings(9 * 16));
    let requests = cases.iter().enumerate().map(|(i, c)| request(i, c));
    let out = e.run_to_completion(requests.collect()).unwrap();
    for (case, c) in cases.iter().zip(&out) {
        check_logprob_case(case, c);
    }
    assert_eq!(e.stats().kv_blocks_used, 0);
}

#[test]
fn a_multimodal_gemma3_config_names_its_text_config_fields() {
    let src: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(model_dir("gemma3-4b-mm").join("config.json")).unwrap(),
    )
    .unwrap();
    for (edit, needle) in [
        (
            serde_json::json!({"sliding_window": 0}),
            "`text_config.sliding_window`: must be positive",
        ),
        (
            serde_json::json!({"rope_scaling": {"rope_type": "linear", "factor": -1.0}}),
            "`text_config.rope_scaling.factor`",
        ),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let mut cfg = src.clone();
        for (k, v) in edit.as_object().unwrap() {
            cfg["text_config"][k] = v.clone();
        }
        std::fs::write(dir.path().join("config.json"), cfg.to_string()).unwrap();
        let err = ModelConfig::from_dir(dir.path()).unwrap_err().to_string();
        assert!(err.contains(needle), "{needle}: {err}");
    }
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = src.clone();
    cfg.as_object_mut().unwrap().remove("text_config");
    std::fs::write(dir.path().join("config.json"), cfg.to_string()).unwrap();
    let err = ModelConfig::from_dir(dir.path()).unwrap_err().to_string();
    assert!(err.contains("`text_config`: is required"), "{err}");
}

#[test]
fn a_memory_budget_sets_the_rings_aside_before_it_divides_the_rest() {
    use lorafleet_engine::backend::BackendShape;
    use lorafleet_engine::backend::cpu::CpuBackend;
    use lorafleet_engine::{BackendChoice, Engine, EngineSettings};
    let dir = model_dir("gemma3-1b");
    let config = ModelConfig::from_dir(&dir).unwrap();
    let base = EngineSettings {
        max_batched_tokens: 8,
        block_size: 4,
        max_num_seqs: 4,
        ..Default::default()
    };
    // Rings of ceil((16 + 8 - 1) / 4) + 1 = 7 blocks for each of 4 sequences.
    let shape = BackendShape {
        slots: base.max_loras,
        max_lora_rank: base.max_lora_rank,
        kv_blocks: 0,
        block_size: 4,
        ring_len: 7,
        ring_blocks: 28,
    };
    let rings = CpuBackend::ring_bytes(&config, &shape);
    assert_eq!(
        rings,
        (28 * 5 * 2 * 4 * config.kv_dim() * 4) as u64,
        "5 sliding layers"
    );
    let units = CpuBackend::memory_units(&config, 4, base.max_lora_rank);
    let bytes = rings + units.slot_bytes + 100 * units.block_bytes;
    let e = Engine::load(
        &dir,
        EngineSettings {
            memory_budget_bytes: Some(bytes),
            ..base
        },
        BackendChoice::Cpu,
    )
    .unwrap();
    assert_eq!(e.stats().kv_blocks_total, 100, "the rings came off first");
    let err = match Engine::load(
        &dir,
        EngineSettings {
            memory_budget_bytes: Some(rings - 1),
            ..base
        },
        BackendChoice::Cpu,
    ) {
        Ok(_) => panic!("a budget smaller than the rings"),
        Err(e) => e.to_string(),
    };
    assert!(
        err.contains("memory_budget_bytes") && err.contains("rings"),
        "{err}"
    );
}
