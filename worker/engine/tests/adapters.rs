//! Bad adapters are refused with an error that names the field; nothing
//! that would change the math is silently ignored.

mod common;

use std::path::Path;

use common::*;
use lorafleet_engine::lora::{AdapterError, AdapterLimits, HostAdapter};
use lorafleet_engine::model::ModelConfig;
use lorafleet_engine::pool::BaseHash;
use safetensors::Dtype;
use safetensors::tensor::TensorView;
use serde_json::{Value, json};

const MODEL: &str = "llama-gqa";

fn config(model: &str) -> ModelConfig {
    ModelConfig::from_dir(&model_dir(model)).unwrap()
}

/// A writable copy of an adapter fixture.
fn copy_adapter(name: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for f in ["adapter_config.json", "adapter_model.safetensors"] {
        std::fs::copy(adapter_dir(MODEL, name).join(f), dir.path().join(f)).unwrap();
    }
    dir
}

fn edit_config(dir: &Path, edit: impl FnOnce(&mut Value)) {
    let path = dir.join("adapter_config.json");
    let mut v: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    edit(&mut v);
    std::fs::write(path, v.to_string()).unwrap();
}

/// Rewrites the adapter's tensors through `edit(name, values) -> Option<values>`;
/// None drops the tensor. `extra` adds tensors.
fn edit_tensors(
    dir: &Path,
    edit: impl Fn(&str, Vec<f32>) -> Option<Vec<f32>>,
    extra: &[(&str, Vec<usize>)],
) {
    let path = dir.join("adapter_model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut out: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
    for (name, view) in st.tensors() {
        let values: Vec<f32> = view
            .data()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
            .collect();
        if let Some(v) = edit(&name, values) {
            out.push((
                name,
                view.shape().to_vec(),
                v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            ));
        }
    }
    for (name, shape) in extra {
        let n: usize = shape.iter().product();
        out.push((name.to_string(), shape.clone(), vec![0u8; n * 4]));
    }
    let views: Vec<(String, TensorView<'_>)> = out
        .iter()
        .map(|(n, s, b)| {
            (
                n.clone(),
                TensorView::new(Dtype::F32, s.clone(), b).unwrap(),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, None, &path).unwrap();
}

fn load(
    dir: &Path,
    model: &ModelConfig,
    max_rank: usize,
    hashes: Option<(&str, &str)>,
) -> Result<HostAdapter, AdapterError> {
    HostAdapter::load(
        "test-adapter",
        dir,
        AdapterLimits {
            model,
            max_lora_rank: max_rank,
            base_hash_check: hashes,
        },
    )
}

#[track_caller]
fn assert_refused(
    result: Result<HostAdapter, AdapterError>,
    field: &str,
    reason_part: &str,
) -> AdapterError {
    let err = result.expect_err("the adapter should be refused");
    let msg = err.to_string();
    assert!(
        msg.contains(&format!("`{field}`")),
        "expected field {field:?} in: {msg}"
    );
    assert!(
        msg.contains(reason_part),
        "expected {reason_part:?} in: {msg}"
    );
    assert!(msg.contains("test-adapter"), "the adapter is named: {msg}");
    err
}

#[test]
fn every_fixture_adapter_loads() {
    let c = config(MODEL);
    for name in adapter_names(MODEL) {
        let a = load(&adapter_dir(MODEL, &name), &c, 16, None).unwrap();
        assert!(a.rank > 0 && a.bytes > 0, "{name}");
    }
    // rank_pattern and alpha_pattern land on the right modules.
    let p = load(&adapter_dir(MODEL, "patterns"), &c, 16, None).unwrap();
    let k = p.modules[0][1].as_ref().unwrap();
    let q = p.modules[0][0].as_ref().unwrap();
    let down = p.modules[1][6].as_ref().unwrap();
    assert_eq!((q.rank, q.scale), (8, 2.0));
    assert_eq!(
        (k.rank, k.scale),
        (2, 8.0),
        "k_proj: rank 2 from rank_pattern, alpha 16"
    );
    assert_eq!(
        (down.rank, down.scale),
        (8, 0.5),
        "down_proj: alpha 4 from alpha_pattern"
    );
    // use_rslora scales by alpha / sqrt(r); layers_to_transform skips layers.
    let rs = load(&adapter_dir(MODEL, "all-linear-rslora"), &c, 16, None).unwrap();
    assert_eq!(rs.modules[0][0].as_ref().unwrap().scale, 8.0 / 2.0);
    assert!(
        rs.modules.iter().all(|m| m.iter().all(Option::is_some)),
        "all-linear covers all seven projections"
    );
    let l1 = load(&adapter_dir(MODEL, "layer1-mlp"), &c, 16, None).unwrap();
    assert!(l1.modules[0].iter().all(Option::is_none) && l1.modules[1][4].is_some());
}

#[test]
fn features_that_change_the_math_are_refused_by_name() {
    let c = config(MODEL);
    let cases: Vec<(&str, Value, &str)> = vec![
        (
            "modules_to_save",
            json!(["model.norm"]),
            "only embed_tokens and lm_head",
        ),
        ("bias", json!("all"), "only \"none\""),
        ("fan_in_fan_out", json!(true), "fan_in_fan_out"),
        (
            "trainable_token_indices",
            json!([1, 1]),
            "lists token 1 twice",
        ),
        ("peft_type", json!("IA3"), "only LORA"),
        (
            "init_lora_weights",
            json!("pissa"),
            "modifies the base weights",
        ),
        (
            "init_lora_weights",
            json!("olora"),
            "modifies the base weights",
        ),
        (
            "some_future_switch",
            json!(0.5),
            "not a field lorafleet knows",
        ),
        (
            "target_modules",
            json!(r"model\.layers\.\d+\.attn\.q_proj"),
            "matches no module",
        ),
        ("target_modules", json!(".*lm_head"), "by name"),
        (
            "target_modules",
            json!(["c_attn"]),
            "not a module of this model",
        ),
        ("r", json!(0), "positive integer"),
        ("lora_alpha", json!("sixteen"), "finite non-zero"),
        ("layers_to_transform", json!([5]), "below num_hidden_layers"),
    ];
    for (field, value, reason) in cases {
        let dir = copy_adapter("qv-r8");
        edit_config(dir.path(), |v| v[field] = value.clone());
        assert_refused(load(dir.path(), &c, 16, None), field, reason);
    }
    // DoRA is served, but a DoRA config over a plain adapter's tensors
    // (no magnitudes) is refused by the missing tensor.
    let dir = copy_adapter("qv-r8");
    edit_config(dir.path(), |v| v["use_dora"] = json!(true));
    let err = load(dir.path(), &c, 16, None).unwrap_err().to_string();
    assert!(
        err.contains("lora_magnitude_vector") && err.contains("use_dora"),
        "{err}"
    );
    // So is lora_bias over tensors without lora_B's bias.
    let dir = copy_adapter("qv-r8");
    edit_config(dir.path(), |v| v["lora_bias"] = json!(true));
    let err = load(dir.path(), &c, 16, None).unwrap_err().to_string();
    assert!(
        err.contains("lora_B.bias") && err.contains("lora_bias"),
        "{err}"
    );
    // A layer saved whole over a plain adapter's tensors is refused by
    // the missing tensor.
    let dir = copy_adapter("qv-r8");
    edit_config(dir.path(), |v| v["modules_to_save"] = json!(["lm_head"]));
    let err = load(dir.path(), &c, 16, None).unwrap_err().to_string();
    assert!(
        err.contains("base_model.model.lm_head.weight") && err.contains("modules_to_save"),
        "{err}"
    );
    // Harmless keys may be set: they do not change inference.
    let dir = copy_adapter("qv-r8");
    edit_config(dir.path(), |v| {
        v["lora_dropout"] = json!(0.3);
        v["task_type"] = json!("CAUSAL_LM");
        v["init_lora_weights"] = json!("gaussian");
    });
    load(dir.path(), &c, 16, None).unwrap();
}

#[test]
fn rank_shape_weights_and_base_hash_are_checked() {
    let c = config(MODEL);
    // Rank above max_lora_rank.
    let err = assert_refused(
        load(&adapter_dir(MODEL, "qv-r8"), &c, 4, None),
        "r",
        "rank 8 is above max_lora_rank 4",
    );
    assert!(matches!(err, AdapterError::RankTooLarge { .. }));
    // A rank_pattern entry above the max names the pattern.
    let dir = copy_adapter("qv-r8");
    edit_config(dir.path(), |v| v["rank_pattern"] = json!({"q_proj": 32}));
    assert_refused(
        load(dir.path(), &c, 16, None),
        "rank_pattern (model.layers.0.self_attn.q_proj)",
        "above max_lora_rank",
    );

    // Shapes that do not match the base: a Llama adapter on the Qwen2 fixture.
    let err = assert_refused(
        load(
            &adapter_dir(MODEL, "qv-r8"),
            &config("qwen2-tied"),
            16,
            None,
        ),
        "base_model.model.model.layers.0.self_attn.v_proj.lora_B.weight",
        "has shape [32, 8], expected [16, 8]",
    );
    assert!(matches!(err, AdapterError::InvalidTensor { .. }));

    // NaN and infinite weights.
    for bad in [f32::NAN, f32::INFINITY] {
        let dir = copy_adapter("qv-r8");
        edit_tensors(
            dir.path(),
            |name, mut v| {
                if name.ends_with("layers.1.self_attn.q_proj.lora_B.weight") {
                    v[3] = bad;
                }
                Some(v)
            },
            &[],
        );
        assert_refused(
            load(dir.path(), &c, 16, None),
            "base_model.model.model.layers.1.self_attn.q_proj.lora_B.weight",
            "non-finite",
        );
    }

    // An unknown tensor name, and an embedding tensor.
    let dir = copy_adapter("qv-r8");
    edit_tensors(
        dir.path(),
        |_, v| Some(v),
        &[(
            "base_model.model.model.layers.0.self_attn.rotary.lora_A.weight",
            vec![8, 64],
        )],
    );
    assert_refused(
        load(dir.path(), &c, 16, None),
        "base_model.model.model.layers.0.self_attn.rotary.lora_A.weight",
        "is not a lora_A/lora_B weight",
    );
    let dir = copy_adapter("qv-r8");
    edit_tensors(
        dir.path(),
        |_, v| Some(v),
        &[(
            "base_model.model.model.embed_tokens.lora_embedding_A",
            vec![8, 384],
        )],
    );
    assert_refused(
        load(dir.path(), &c, 16, None),
        "base_model.model.model.embed_tokens.lora_embedding_A",
        "does not list embed_tokens",
    );

    // A targeted module with no weights.
    let dir = copy_adapter("qv-r8");
    edit_tensors(
        dir.path(),
        |name, v| (!name.contains("layers.1.self_attn.v_proj.lora_A")).then_some(v),
        &[],
    );
    assert_refused(
        load(dir.path(), &c, 16, None),
        "base_model.model.model.layers.1.self_attn.v_proj.lora_A.weight",
        "missing",
    );

    // A base hash other than the served one.
    let (served, declared) = ("a".repeat(64), "b".repeat(64));
    let err = load(
        &adapter_dir(MODEL, "qv-r8"),
        &c,
        16,
        Some((&served, &declared)),
    )
    .unwrap_err();
    assert!(
        matches!(err, AdapterError::BaseHashMismatch { .. }),
        "{err}"
    );
    assert!(err.to_string().contains(&declared) && err.to_string().contains(&served));
    load(
        &adapter_dir(MODEL, "qv-r8"),
        &c,
        16,
        Some((&served, &served)),
    )
    .unwrap();

    // Missing and unreadable files.
    let empty = tempfile::tempdir().unwrap();
    assert!(matches!(
        load(empty.path(), &c, 16, None).unwrap_err(),
        AdapterError::Io { .. }
    ));
    let dir = copy_adapter("qv-r8");
    std::fs::write(dir.path().join("adapter_config.json"), "{not json").unwrap();
    assert_refused(
        load(dir.path(), &c, 16, None),
        "adapter_config.json",
        "not valid JSON",
    );
}

#[test]
fn artifact_digests_match_an_independent_implementation() {
    let expected: std::collections::BTreeMap<String, String> = serde_json::from_str(
        &std::fs::read_to_string(fixtures().join("artifact_digests.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(
        expected.len(),
        46,
        "12 dense, 10 Mixture-of-Experts, 21 model-family and 3 GPT-OSS adapters"
    );
    let roots =
        lorafleet_engine::artifact::ArtifactRoots::new(&[fixtures().join("adapters")]).unwrap();
    for (uri, digest) in &expected {
        let dir = roots
            .resolve_verified(uri, digest)
            .unwrap_or_else(|e| panic!("{uri}: {e}"));
        assert!(dir.join("adapter_config.json").exists());
    }
}

/// ARCHITECTURE.md's invariant, by name: a request for an adapter that
/// cannot be applied — its files gone, its weights corrupt, made for
/// another base model, or of a rank above the engine's — is refused or
/// fails; it never gets a token, so it is never served by the base model.
#[test]
fn an_adapter_request_is_never_served_by_the_base_model() {
    use lorafleet_engine::{AdapterSource, EngineSettings, Event, Prompt, Request, Sampling};
    let corrupt = copy_adapter("qv-r8");
    let weights = corrupt.path().join("adapter_model.safetensors");
    let bytes = std::fs::read(&weights).unwrap();
    std::fs::write(&weights, &bytes[..bytes.len() / 2]).unwrap();
    let source = |name: &str, dir: &Path, base: Option<BaseHash>| AdapterSource {
        name: name.into(),
        dir: dir.to_path_buf(),
        declared_base_hash: base,
        digest: None,
    };
    let cases = [
        (
            "gone",
            source("gone", Path::new("/nonexistent/adapter"), None),
        ),
        ("corrupt", source("corrupt", corrupt.path(), None)),
        (
            "other base",
            source(
                "other",
                &adapter_dir(MODEL, "qv-r8"),
                BaseHash::parse(&"f".repeat(64)),
            ),
        ),
        (
            "rank 16 > 8",
            source("wide", &adapter_dir(MODEL, "k-r16"), None),
        ),
    ];
    let settings = EngineSettings {
        max_lora_rank: 8,
        ..Default::default()
    };
    let mut e = lorafleet_engine::Engine::load_cpu(&model_dir(MODEL), settings).unwrap();
    let mut outcomes = Vec::new();
    for (i, (what, src)) in cases.into_iter().enumerate() {
        let id = aid(100 + i as u64);
        if e.register_adapter(id, src).is_err() {
            // Refused at registration: nothing can ask for it.
            outcomes.push((what, "registration"));
            continue;
        }
        let request = Request {
            id: format!("r{i}").into(),
            adapter: Some(id),
            prompt: Prompt::Text("The quick brown fox".into()),
            params: Sampling {
                max_tokens: 4,
                ..Default::default()
            }
            .validate()
            .unwrap(),
        };
        if e.submit(request).is_err() {
            outcomes.push((what, "submission"));
            continue;
        }
        let (mut tokens, mut failed) = (0, false);
        let mut steps = 0;
        while e.has_work() {
            steps += 1;
            assert!(steps < 1000, "{what}: no progress");
            for (_, event) in e.step().unwrap() {
                match event {
                    Event::Delta { token_ids, .. } => tokens += token_ids.len(),
                    Event::Failed(_) => failed = true,
                    Event::Finished(_) => panic!("{what}: finished as if served"),
                    Event::PromptLogprobs(_) => {}
                }
            }
        }
        assert!(failed, "{what}: the request did not fail");
        assert_eq!(tokens, 0, "{what}: tokens were served");
        outcomes.push((what, "load"));
    }
    // Each case was refused somewhere, and the adapter loads that fail
    // after the request is queued are among them.
    assert_eq!(outcomes.len(), 4, "{outcomes:?}");
    assert!(outcomes.iter().any(|(_, at)| *at == "load"), "{outcomes:?}");
}
