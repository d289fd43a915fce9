//! Targets as PEFT matches them (`scripts/make_target_fixtures.py`): a
//! regular expression `target_modules` over whole module paths,
//! `exclude_modules` as a list and as a pattern, and a saved list of full
//! paths. Each adapter adapts exactly the modules PEFT adapted, and its
//! logits are within 1e-4 of transformers + PEFT with the same greedy
//! tokens; a pattern that matches nothing, or an exclusion that leaves
//! nothing, is refused by its field.

mod common;

use common::*;
use lorafleet_engine::lora::{AdapterLimits, HostAdapter, Projection};
use lorafleet_engine::model::ModelConfig;

const MODEL: &str = "llama-gqa";
const DIR: &str = "targets/llama-gqa";

fn golden_targets() -> (Golden, serde_json::Value) {
    let text = std::fs::read_to_string(fixtures().join("golden_targets.json")).unwrap();
    (
        serde_json::from_str(&text).unwrap(),
        serde_json::from_str(&text).unwrap(),
    )
}

#[test]
fn adapters_targeted_by_pattern_and_exclusion_match_peft() {
    let (golden, raw) = golden_targets();
    assert_eq!(check_golden_cases_on_cpu(&golden, MODEL, DIR), 9);
    // The modules adapted are the ones PEFT adapted.
    let config = ModelConfig::from_dir(&model_dir(MODEL)).unwrap();
    let limits = AdapterLimits {
        model: &config,
        max_lora_rank: 16,
        base_hash_check: None,
    };
    for case in raw["cases"].as_array().unwrap() {
        let name = case["adapter"].as_str().unwrap();
        let adapter = HostAdapter::load(name, &adapter_dir(DIR, name), limits).unwrap();
        let mut ours: Vec<String> = Vec::new();
        for (layer, modules) in adapter.modules.iter().enumerate() {
            for p in Projection::ALL {
                if modules[p.index()].is_some() {
                    ours.push(format!(
                        "model.layers.{layer}.{}.{}",
                        p.parent(),
                        p.module_name()
                    ));
                }
            }
        }
        ours.sort();
        let peft: Vec<String> = case["targeted"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_str().unwrap().to_owned())
            .collect();
        assert_eq!(ours, peft, "{name}");
    }
}

#[test]
fn a_pattern_that_selects_nothing_is_refused_by_its_field() {
    let config = ModelConfig::from_dir(&model_dir(MODEL)).unwrap();
    let cases: [(serde_json::Value, &str, &str); 5] = [
        (
            serde_json::json!({"target_modules": r"model\.layers\.\d+\.attn\.q_proj"}),
            "target_modules",
            "matches no module",
        ),
        (
            serde_json::json!({"target_modules": r".*"}),
            "target_modules",
            "lm_head",
        ),
        (
            serde_json::json!({"target_modules": r"(?<=x)q_proj"}),
            "target_modules",
            "not a regular expression this reader takes",
        ),
        (
            serde_json::json!({"target_modules": ["q_proj", "v_proj"], "exclude_modules": r".*"}),
            "exclude_modules",
            "excludes every module",
        ),
        (
            serde_json::json!({"target_modules": r".*q_proj", "layers_to_transform": [0]}),
            "layers_to_transform",
            "regular expression",
        ),
    ];
    for (edit, field, said) in cases {
        let mut c = serde_json::json!({"peft_type": "LORA", "r": 4, "lora_alpha": 8});
        for (k, v) in edit.as_object().unwrap() {
            c[k] = v.clone();
        }
        let err = lorafleet_engine::lora::AdapterConfig::from_text(
            "a",
            &c.to_string(),
            Some(config.num_layers),
        )
        .and_then(|a| a.for_model("a", &config))
        .unwrap_err()
        .to_string();
        assert!(err.contains(field) && err.contains(said), "{field}: {err}");
    }
}

/// A pattern reads as the model's own modules: `.*_proj` is every
/// separate projection of a Llama and every fused module of a Phi-3, and
/// `.*(q_proj|v_proj)` is q and v on a Llama (not the `qkv_proj` it also
/// matches, which a Llama does not have).
#[test]
fn a_pattern_selects_the_modules_the_model_has() {
    let targets = |model: &str, pattern: &str| {
        let config = ModelConfig::from_dir(&model_dir(model)).unwrap();
        let c = serde_json::json!({"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": pattern});
        let a = lorafleet_engine::lora::AdapterConfig::from_text(
            "a",
            &c.to_string(),
            Some(config.num_layers),
        )
        .and_then(|a| a.for_model("a", &config))
        .unwrap_or_else(|e| panic!("{model} {pattern}: {e}"));
        a.targets_in_layer(0)
            .iter()
            .map(|t| t.module_name())
            .collect::<Vec<_>>()
    };
    assert_eq!(
        targets("llama-gqa", ".*_proj"),
        [
            "q_proj",
            "k_proj",
            "v_proj",
            "o_proj",
            "gate_proj",
            "up_proj",
            "down_proj"
        ]
    );
    assert_eq!(
        targets("phi35-mini", ".*_proj"),
        ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
    );
    assert_eq!(
        targets("llama-gqa", ".*(q_proj|v_proj)"),
        ["q_proj", "v_proj"]
    );
    assert_eq!(targets("phi35-mini", ".*(q_proj|v_proj)"), ["qkv_proj"]);
    assert_eq!(targets("llama-gqa", ".*up_proj"), ["up_proj"]);
}
