use super::*;

fn write(dir: &Path, name: &str, value: Value) {
    std::fs::write(dir.join(name), value.to_string()).unwrap();
}

fn llama() -> Value {
    serde_json::json!({
        "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "vocab_size": 100, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu"
    })
}

#[test]
fn reads_gqa_and_merges_generation_eos() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "config.json", llama());
    write(
        dir.path(),
        "generation_config.json",
        serde_json::json!({"eos_token_id": [2, 7]}),
    );
    let c = ModelConfig::from_dir(dir.path()).unwrap();
    assert_eq!(
        (c.num_heads, c.num_kv_heads, c.head_dim, c.gqa_group()),
        (4, 2, 16, 2)
    );
    assert_eq!(c.eos_token_ids, vec![2, 7]);
    assert_eq!(c.rope.theta, 500000.0);

    // transformers 5 keeps theta in rope_parameters.
    let mut v5 = llama();
    v5.as_object_mut().unwrap().remove("rope_theta");
    v5["rope_parameters"] = serde_json::json!({"rope_type": "default", "rope_theta": 1234.0});
    write(dir.path(), "config.json", v5);
    assert_eq!(
        ModelConfig::from_dir(dir.path()).unwrap().rope.theta,
        1234.0
    );
    assert!(!c.tie_word_embeddings && !c.qkv_bias);
}

fn qwen3_moe() -> Value {
    serde_json::json!({
        "model_type": "qwen3_moe", "hidden_size": 64, "intermediate_size": 96,
        "moe_intermediate_size": 48, "num_experts": 4, "num_experts_per_tok": 2,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "vocab_size": 100, "decoder_sparse_step": 1, "mlp_only_layers": []
    })
}

#[test]
fn reads_the_experts_of_qwen3_moe_and_mixtral() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "config.json", qwen3_moe());
    let c = ModelConfig::from_dir(dir.path()).unwrap();
    assert_eq!(
        c.moe,
        Some(MoeConfig {
            num_experts: 4,
            top_k: 2,
            norm_topk_prob: false,
            gpt_oss: None,
        })
    );
    assert_eq!(c.intermediate_size, 48, "each expert's width");
    assert!(c.qk_norm);
    let mut mixtral = llama();
    mixtral["model_type"] = serde_json::json!("mixtral");
    mixtral["num_local_experts"] = serde_json::json!(8);
    mixtral["num_experts_per_tok"] = serde_json::json!(2);
    write(dir.path(), "config.json", mixtral);
    let c = ModelConfig::from_dir(dir.path()).unwrap();
    assert_eq!(
        c.moe.map(|m| (m.num_experts, m.norm_topk_prob)),
        Some((8, true))
    );
    assert_eq!(c.intermediate_size, 128);
    assert!(!c.qk_norm);
    write(dir.path(), "config.json", llama());
    assert_eq!(ModelConfig::from_dir(dir.path()).unwrap().moe, None);
}

#[test]
fn refuses_expert_layouts_it_does_not_run_naming_the_field() {
    for (field, value) in [
        ("num_experts_per_tok", serde_json::json!(5)),
        ("decoder_sparse_step", serde_json::json!(2)),
        ("mlp_only_layers", serde_json::json!([0])),
        ("shared_expert_intermediate_size", serde_json::json!(64)),
        ("moe_intermediate_size", serde_json::Value::Null),
        ("num_experts", serde_json::Value::Null),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let mut cfg = qwen3_moe();
        cfg[field] = value;
        write(dir.path(), "config.json", cfg);
        let err = ModelConfig::from_dir(dir.path()).unwrap_err().to_string();
        let named = if field == "num_experts" {
            "num_local_experts"
        } else {
            field
        };
        assert!(err.contains(&format!("`{named}`")), "{field}: {err}");
    }
}

#[test]
fn refuses_what_would_change_the_math_naming_the_field() {
    let cases = [
        ("model_type", serde_json::json!("gpt2"), "`model_type`"),
        (
            "num_key_value_heads",
            serde_json::json!(3),
            "`num_key_value_heads`",
        ),
        ("hidden_act", serde_json::json!("gelu"), "`hidden_act`"),
        (
            "rope_scaling",
            serde_json::json!({"rope_type": "yarn"}),
            "`rope_scaling.original_max_position_embeddings`: is required",
        ),
        (
            "rope_parameters",
            serde_json::json!({"rope_type": "llama3", "rope_theta": 1.0}),
            "`rope_parameters.low_freq_factor`: is required",
        ),
        (
            "eos_token_id",
            serde_json::json!(100),
            "`eos_token_id`: token id 100",
        ),
        (
            "hidden_size",
            serde_json::json!("64"),
            "`hidden_size`: must be a non-negative integer",
        ),
    ];
    for (field, value, expected) in cases {
        let dir = tempfile::tempdir().unwrap();
        let mut cfg = llama();
        cfg[field] = value;
        write(dir.path(), "config.json", cfg);
        let err = ModelConfig::from_dir(dir.path()).unwrap_err().to_string();
        assert!(err.contains(expected), "{field}: {err}");
        assert!(err.contains("config.json"), "{err}");
    }
}

#[test]
fn qwen2_has_qkv_bias_and_mistral_a_window() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = llama();
    cfg["model_type"] = "qwen2".into();
    cfg["tie_word_embeddings"] = true.into();
    write(dir.path(), "config.json", cfg.clone());
    let c = ModelConfig::from_dir(dir.path()).unwrap();
    assert!(c.qkv_bias && !c.o_bias && c.tie_word_embeddings);

    cfg["model_type"] = "mistral".into();
    cfg["sliding_window"] = 4096.into();
    write(dir.path(), "config.json", cfg);
    assert_eq!(
        ModelConfig::from_dir(dir.path()).unwrap().sliding_window,
        Some(4096)
    );
}

/// GPT-OSS's config with only what transformers' `GptOssConfig` cannot
/// default.
fn gpt_oss_minimal() -> Value {
    serde_json::json!({
        "model_type": "gpt_oss", "hidden_size": 64, "intermediate_size": 64,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "vocab_size": 100, "num_local_experts": 8
    })
}

#[test]
fn gpt_oss_takes_transformers_defaults_where_its_config_is_silent() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "config.json", gpt_oss_minimal());
    let c = ModelConfig::from_dir(dir.path()).unwrap();
    assert_eq!(c.architecture, Architecture::GptOss);
    // Sliding first, then alternating, through a window of 128.
    assert_eq!(
        c.layer_kinds,
        [
            LayerKind::Sliding,
            LayerKind::Full,
            LayerKind::Sliding,
            LayerKind::Full
        ]
    );
    assert_eq!(c.sliding_window, Some(128));
    assert!(c.mixed_layers() && c.attention_sinks && c.qkv_bias && c.o_bias && !c.mlp_bias);
    // YaRN by 32 over 4,096 positions, base 150,000.
    assert_eq!(c.rope.theta, 150_000.0);
    assert!(
        matches!(c.rope.scaling, crate::rope::RopeScaling::Yarn { factor, .. } if factor == 32.0),
        "{:?}",
        c.rope.scaling
    );
    let moe = c.moe.unwrap();
    assert_eq!((moe.num_experts, moe.top_k), (8, 4));
    assert_eq!(
        moe.gpt_oss,
        Some(GptOssExperts {
            swiglu_limit: 7.0,
            swiglu_alpha: 1.702
        })
    );
    // What the config gives wins.
    let mut given = gpt_oss_minimal();
    given["attention_bias"] = false.into();
    given["swiglu_limit"] = 5.5.into();
    given["num_experts_per_tok"] = 2.into();
    given["layer_types"] = serde_json::json!([
        "full_attention",
        "full_attention",
        "full_attention",
        "full_attention"
    ]);
    write(dir.path(), "config.json", given);
    let c = ModelConfig::from_dir(dir.path()).unwrap();
    assert!(!c.qkv_bias && !c.mixed_layers());
    assert_eq!(c.moe.unwrap().top_k, 2);
    assert_eq!(c.moe.unwrap().gpt_oss.unwrap().swiglu_limit, 5.5);
}

#[test]
fn gpt_oss_refuses_what_it_cannot_read_by_field() {
    for (field, value, named) in [
        (
            "experts_per_token",
            serde_json::json!(2),
            "`experts_per_token`",
        ),
        ("swiglu_limit", serde_json::json!(-1.0), "`swiglu_limit`"),
        ("sliding_window", serde_json::json!(0), "`sliding_window`"),
        (
            "layer_types",
            serde_json::json!(["sliding_attention"]),
            "`layer_types`",
        ),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let mut cfg = gpt_oss_minimal();
        cfg[field] = value;
        write(dir.path(), "config.json", cfg);
        let err = ModelConfig::from_dir(dir.path()).unwrap_err().to_string();
        assert!(err.contains(named), "{field}: {err}");
    }
}
