//! A STAND-IN model and adapters for benchmarks only: random weights in the
//! shape of a ~100M-parameter Llama, and random rank-16 PEFT adapters on the
//! attention projections. They are written once under `target/bench-standin`
//! and reused. Nothing here is used by the engine itself or by tests.

#![allow(dead_code)]

use std::path::{Path, PathBuf};

use lorafleet_engine::sampling::Rng;
use safetensors::Dtype;
use safetensors::tensor::TensorView;

pub const HIDDEN: usize = 768;
pub const INTERMEDIATE: usize = 2048;
pub const LAYERS: usize = 12;
pub const HEADS: usize = 12;
pub const KV_HEADS: usize = 4;
pub const VOCAB: usize = 32000;
pub const RANK: usize = 16;

/// `target/bench-standin` of the workspace, whichever crate's bench asks.
pub fn root() -> PathBuf {
    let mut dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    while !dir.join("Cargo.lock").exists() {
        assert!(
            dir.pop(),
            "no Cargo.lock above {}",
            env!("CARGO_MANIFEST_DIR")
        );
    }
    dir.join("target/bench-standin")
}

fn random(rng: &mut Rng, n: usize, scale: f32) -> Vec<f32> {
    (0..n)
        .map(|_| (rng.next_f64() as f32 * 2.0 - 1.0) * scale)
        .collect()
}

fn write(path: &Path, tensors: Vec<(String, Vec<usize>, Vec<f32>)>, dtype: Dtype) {
    let bytes: Vec<(String, Vec<usize>, Vec<u8>)> = tensors
        .into_iter()
        .map(|(n, s, v)| {
            let b = match dtype {
                Dtype::BF16 => v
                    .iter()
                    .flat_map(|x| half::bf16::from_f32(*x).to_le_bytes())
                    .collect(),
                _ => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            };
            (n, s, b)
        })
        .collect();
    let views: Vec<(String, TensorView<'_>)> = bytes
        .iter()
        .map(|(n, s, b)| (n.clone(), TensorView::new(dtype, s.clone(), b).unwrap()))
        .collect();
    safetensors::serialize_to_file(views, None, path).unwrap();
}

/// The stand-in base model directory, stored in f32; created if missing.
pub fn model() -> PathBuf {
    model_in(Dtype::F32)
}

/// The stand-in base model stored as `dtype` (F32 or BF16): the same random
/// draws, rounded to bf16 for BF16. Created if missing.
pub fn model_in(dtype: Dtype) -> PathBuf {
    let dir = root().join(match dtype {
        Dtype::BF16 => "model-bf16",
        Dtype::F32 => "model-f32",
        other => panic!("no stand-in model in {other:?}"),
    });
    if dir.join("model.safetensors").exists() {
        return dir;
    }
    std::fs::create_dir_all(&dir).unwrap();
    let head_dim = HIDDEN / HEADS;
    let config = serde_json::json!({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": HIDDEN, "intermediate_size": INTERMEDIATE, "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "head_dim": head_dim,
        "vocab_size": VOCAB, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "tie_word_embeddings": true, "hidden_act": "silu",
        "bos_token_id": 1, "eos_token_id": 2,
        "torch_dtype": if dtype == Dtype::BF16 { "bfloat16" } else { "float32" }
    });
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    let fixtures = root().join("../../worker/engine/tests/fixtures/llama-gqa");
    for f in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(fixtures.join(f), dir.join(f)).unwrap();
    }
    let mut rng = Rng::new(42);
    let kv = KV_HEADS * head_dim;
    let mut t = vec![(
        "model.embed_tokens.weight".to_string(),
        vec![VOCAB, HIDDEN],
        random(&mut rng, VOCAB * HIDDEN, 0.05),
    )];
    for l in 0..LAYERS {
        let p = format!("model.layers.{l}");
        for (name, out, inp) in [
            ("self_attn.q_proj", HIDDEN, HIDDEN),
            ("self_attn.k_proj", kv, HIDDEN),
            ("self_attn.v_proj", kv, HIDDEN),
            ("self_attn.o_proj", HIDDEN, HIDDEN),
            ("mlp.gate_proj", INTERMEDIATE, HIDDEN),
            ("mlp.up_proj", INTERMEDIATE, HIDDEN),
            ("mlp.down_proj", HIDDEN, INTERMEDIATE),
        ] {
            t.push((
                format!("{p}.{name}.weight"),
                vec![out, inp],
                random(&mut rng, out * inp, 0.04),
            ));
        }
        t.push((
            format!("{p}.input_layernorm.weight"),
            vec![HIDDEN],
            vec![1.0; HIDDEN],
        ));
        t.push((
            format!("{p}.post_attention_layernorm.weight"),
            vec![HIDDEN],
            vec![1.0; HIDDEN],
        ));
    }
    t.push((
        "model.norm.weight".to_string(),
        vec![HIDDEN],
        vec![1.0; HIDDEN],
    ));
    write(&dir.join("model.safetensors"), t, dtype);
    dir
}

/// `n` stand-in adapters (rank 16 on q, k, v, o), created if missing.
pub fn adapters(n: usize) -> Vec<PathBuf> {
    let head_dim = HIDDEN / HEADS;
    let kv = KV_HEADS * head_dim;
    (0..n)
        .map(|i| {
            let dir = root().join("adapters").join(format!("a{i:04}"));
            if dir.join("adapter_model.safetensors").exists() {
                return dir;
            }
            std::fs::create_dir_all(&dir).unwrap();
            let config = serde_json::json!({
                "peft_type": "LORA", "r": RANK, "lora_alpha": 32, "bias": "none",
                "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"], "task_type": "CAUSAL_LM"
            });
            std::fs::write(dir.join("adapter_config.json"), config.to_string()).unwrap();
            let mut rng = Rng::new(1000 + i as u64);
            let mut t = Vec::new();
            for l in 0..LAYERS {
                for (name, out) in [
                    ("q_proj", HIDDEN),
                    ("k_proj", kv),
                    ("v_proj", kv),
                    ("o_proj", HIDDEN),
                ] {
                    let p = format!("base_model.model.model.layers.{l}.self_attn.{name}");
                    t.push((
                        format!("{p}.lora_A.weight"),
                        vec![RANK, HIDDEN],
                        random(&mut rng, RANK * HIDDEN, 0.05),
                    ));
                    t.push((
                        format!("{p}.lora_B.weight"),
                        vec![out, RANK],
                        random(&mut rng, out * RANK, 0.05),
                    ));
                }
            }
            write(&dir.join("adapter_model.safetensors"), t, Dtype::BF16);
            dir
        })
        .collect()
}

/// Registers `dirs` on `e` as adapters 1, 2, ... (named `a0`, `a1`, ...).
pub fn register(e: &mut lorafleet_engine::Engine, dirs: &[PathBuf]) {
    for (i, dir) in dirs.iter().enumerate() {
        e.register_adapter(
            id(i),
            lorafleet_engine::AdapterSource {
                name: format!("a{i}"),
                dir: dir.clone(),
                declared_base_hash: None,
                digest: None,
            },
        )
        .expect("a stand-in adapter");
    }
}

/// The id [`register`] gave the `i`-th adapter.
pub fn id(i: usize) -> lorafleet_engine::AdapterId {
    lorafleet_engine::AdapterId::new(i as u64 + 1).expect("ids start at 1")
}
