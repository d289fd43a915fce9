//! A STAND-IN model and adapters for benchmarks only: random weights in the
//! shape of a ~100M-parameter Llama ([`SMALL`]) or of Llama-3.2-1B
//! ([`LLAMA_1B`]), and random rank-16 PEFT adapters on the attention
//! projections. They are written once under `target/bench-standin` (or
//! `LORAFLEET_BENCH_STANDIN`) and reused. Nothing here is used by the
//! engine itself or by tests.

#![allow(dead_code)]

use std::path::{Path, PathBuf};

use lorafleet_engine::sampling::Rng;
use safetensors::Dtype;
use safetensors::tensor::TensorView;

mod gpt_oss;
mod quantized;
#[allow(unused_imports)]
pub use gpt_oss::{GPT_OSS_EXPERTS, GPT_OSS_TOP_K, gpt_oss_adapters, gpt_oss_model};
#[allow(unused_imports)]
pub use quantized::{model_quantized, quantize};

pub const HIDDEN: usize = 768;
pub const INTERMEDIATE: usize = 2048;
pub const LAYERS: usize = 12;
pub const HEADS: usize = 12;
pub const KV_HEADS: usize = 4;
pub const VOCAB: usize = 32000;
pub const RANK: usize = 16;

/// A stand-in model's shape.
#[derive(Debug, Clone, Copy)]
pub struct Shape {
    /// Its directory under [`root`]; empty for [`SMALL`].
    pub dir: &'static str,
    pub hidden: usize,
    pub intermediate: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub vocab: usize,
}

/// ~100M parameters: the CPU benchmarks' model.
pub const SMALL: Shape = Shape {
    dir: "",
    hidden: HIDDEN,
    intermediate: INTERMEDIATE,
    layers: LAYERS,
    heads: HEADS,
    kv_heads: KV_HEADS,
    vocab: VOCAB,
};

/// Llama-3.2-1B's shape: 1.24B parameters with the tied embedding.
pub const LLAMA_1B: Shape = Shape {
    dir: "llama-3.2-1b-shape",
    hidden: 2048,
    intermediate: 8192,
    layers: 16,
    heads: 32,
    kv_heads: 8,
    vocab: 128_256,
};

/// `target/bench-standin` of the workspace, whichever crate's bench asks,
/// or `LORAFLEET_BENCH_STANDIN` (where the benchmark runs from a copy of
/// the binaries, as on the GPU machine).
pub fn root() -> PathBuf {
    if let Some(dir) = std::env::var_os("LORAFLEET_BENCH_STANDIN") {
        return PathBuf::from(dir);
    }
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

/// Gives a stand-in model the fixture model's real tokenizer (the weights
/// are random; the vocabulary need not be).
fn copy_tokenizer(dir: &Path) {
    let fixtures = std::env::var_os("LORAFLEET_FIXTURES")
        .map_or_else(
            || root().join("../../worker/engine/tests/fixtures"),
            PathBuf::from,
        )
        .join("llama-gqa");
    for f in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(fixtures.join(f), dir.join(f)).unwrap();
    }
}

fn random(rng: &mut Rng, n: usize, scale: f32) -> Vec<f32> {
    (0..n)
        .map(|_| (rng.next_f64() as f32 * 2.0 - 1.0) * scale)
        .collect()
}

/// One decoder layer's seven projections under `prefix`, random, in the
/// order the stand-ins have always drawn them: q of width `q`, k and v of
/// width `kv`, o back to `hidden`, and the MLP of width `intermediate`.
fn projections(
    rng: &mut Rng,
    prefix: &str,
    q: usize,
    kv: usize,
    hidden: usize,
    intermediate: usize,
) -> Vec<(String, Vec<usize>, Vec<f32>)> {
    [
        ("self_attn.q_proj", q, hidden),
        ("self_attn.k_proj", kv, hidden),
        ("self_attn.v_proj", kv, hidden),
        ("self_attn.o_proj", hidden, q),
        ("mlp.gate_proj", intermediate, hidden),
        ("mlp.up_proj", intermediate, hidden),
        ("mlp.down_proj", hidden, intermediate),
    ]
    .into_iter()
    .map(|(name, out, inp)| {
        (
            format!("{prefix}.{name}.weight"),
            vec![out, inp],
            random(rng, out * inp, 0.04),
        )
    })
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
    model_shaped(&SMALL, dtype)
}

/// [`model_in`] for a model of `shape`.
pub fn model_shaped(shape: &Shape, dtype: Dtype) -> PathBuf {
    let Shape {
        hidden,
        intermediate,
        layers,
        heads,
        kv_heads,
        vocab,
        ..
    } = *shape;
    let dir = root().join(shape.dir).join(match dtype {
        Dtype::BF16 => "model-bf16",
        Dtype::F32 => "model-f32",
        other => panic!("no stand-in model in {other:?}"),
    });
    if dir.join("model.safetensors").exists() {
        return dir;
    }
    std::fs::create_dir_all(&dir).unwrap();
    let head_dim = hidden / heads;
    let config = serde_json::json!({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": hidden, "intermediate_size": intermediate, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
        "vocab_size": vocab, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "tie_word_embeddings": true, "hidden_act": "silu",
        "bos_token_id": 1, "eos_token_id": 2,
        "torch_dtype": if dtype == Dtype::BF16 { "bfloat16" } else { "float32" }
    });
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    copy_tokenizer(&dir);
    let mut rng = Rng::new(42);
    let kv = kv_heads * head_dim;
    let mut t = vec![(
        "model.embed_tokens.weight".to_string(),
        vec![vocab, hidden],
        random(&mut rng, vocab * hidden, 0.05),
    )];
    for l in 0..layers {
        let p = format!("model.layers.{l}");
        t.extend(projections(&mut rng, &p, hidden, kv, hidden, intermediate));
        t.push((
            format!("{p}.input_layernorm.weight"),
            vec![hidden],
            vec![1.0; hidden],
        ));
        t.push((
            format!("{p}.post_attention_layernorm.weight"),
            vec![hidden],
            vec![1.0; hidden],
        ));
    }
    t.push((
        "model.norm.weight".to_string(),
        vec![hidden],
        vec![1.0; hidden],
    ));
    write(&dir.join("model.safetensors"), t, dtype);
    dir
}

/// `n` stand-in adapters (rank 16 on q, k, v, o), created if missing.
pub fn adapters(n: usize) -> Vec<PathBuf> {
    adapters_shaped(&SMALL, n)
}

/// [`adapters`] for a model of `shape`.
pub fn adapters_shaped(shape: &Shape, n: usize) -> Vec<PathBuf> {
    adapters_ranked(shape, n, RANK)
}

/// [`adapters_shaped`] of rank `rank` (their own directory unless
/// [`RANK`]).
pub fn adapters_ranked(shape: &Shape, n: usize, rank: usize) -> Vec<PathBuf> {
    adapters_of_kind(shape, n, rank, Kind::Plain)
}

/// What a stand-in adapter carries beside its q, k, v, o LoRA.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Plain,
    /// DoRA (`use_dora`, a magnitude vector per module near 1).
    Dora,
    /// Its own lm_head (`modules_to_save: ["lm_head"]`, bf16).
    SavedHead,
}

/// [`adapters_ranked`] of `kind`, in their own directory.
pub fn adapters_of_kind(shape: &Shape, n: usize, rank: usize, kind: Kind) -> Vec<PathBuf> {
    let dora = kind == Kind::Dora;
    let saved_head = kind == Kind::SavedHead;
    let Shape {
        hidden,
        layers,
        heads,
        kv_heads,
        ..
    } = *shape;
    let head_dim = hidden / heads;
    let kv = kv_heads * head_dim;
    (0..n)
        .map(|i| {
            let set = match (rank, kind) {
                (RANK, Kind::Plain) => "adapters".to_owned(),
                (r, Kind::Plain) => format!("adapters-r{r}"),
                (r, Kind::Dora) => format!("adapters-dora-r{r}"),
                (r, Kind::SavedHead) => format!("adapters-head-r{r}"),
            };
            let dir = root().join(shape.dir).join(set).join(format!("a{i:04}"));
            if dir.join("adapter_model.safetensors").exists() {
                return dir;
            }
            std::fs::create_dir_all(&dir).unwrap();
            let saved = if saved_head {
                serde_json::json!(["lm_head"])
            } else {
                serde_json::Value::Null
            };
            let config = serde_json::json!({
                "peft_type": "LORA", "r": rank, "lora_alpha": 32, "bias": "none", "use_dora": dora,
                "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"], "task_type": "CAUSAL_LM",
                "modules_to_save": saved,
            });
            std::fs::write(dir.join("adapter_config.json"), config.to_string()).unwrap();
            let mut rng = Rng::new(1000 + i as u64);
            let mut t = Vec::new();
            for l in 0..layers {
                for (name, out) in [
                    ("q_proj", hidden),
                    ("k_proj", kv),
                    ("v_proj", kv),
                    ("o_proj", hidden),
                ] {
                    let p = format!("base_model.model.model.layers.{l}.self_attn.{name}");
                    t.push((
                        format!("{p}.lora_A.weight"),
                        vec![rank, hidden],
                        random(&mut rng, rank * hidden, 0.05),
                    ));
                    t.push((
                        format!("{p}.lora_B.weight"),
                        vec![out, rank],
                        random(&mut rng, out * rank, 0.05),
                    ));
                    if dora {
                        let m = random(&mut rng, out, 0.05)
                            .iter()
                            .map(|v| 1.0 + v)
                            .collect();
                        t.push((format!("{p}.lora_magnitude_vector"), vec![out], m));
                    }
                }
            }
            if saved_head {
                t.push((
                    "base_model.model.lm_head.weight".into(),
                    vec![shape.vocab, hidden],
                    random(&mut rng, shape.vocab * hidden, 0.05),
                ));
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

/// Request `r` of the decode workload (`decode_throughput`, `cuda_decode`):
/// `prompt` token ids drawn from `r`, `new` tokens generated greedily past
/// any EOS.
pub fn decode_request(
    r: usize,
    adapter: Option<lorafleet_engine::AdapterId>,
    prompt: usize,
    new: usize,
) -> lorafleet_engine::Request {
    lorafleet_engine::Request {
        id: format!("r{r}").into(),
        adapter,
        prompt: lorafleet_engine::Prompt::TokenIds(
            (0..prompt)
                .map(|k| ((r * 31 + k * 7) % 380 + 3) as u32)
                .collect(),
        ),
        params: lorafleet_engine::Sampling {
            max_tokens: new,
            temperature: 0.0,
            ignore_eos: true,
            ..Default::default()
        }
        .validate()
        .unwrap(),
    }
}

/// The id [`register`] gave the `i`-th adapter.
pub fn id(i: usize) -> lorafleet_engine::AdapterId {
    lorafleet_engine::AdapterId::new(i as u64 + 1).expect("ids start at 1")
}

/// The Mixture-of-Experts STAND-IN: a Qwen3-MoE shape of ~100M active
/// parameters (hidden 768, 12 layers, 12 heads of 64, 4 KV heads, 8 experts
/// of width 1024, top 2, q/k norms, tied 32000-token embedding; ~270M in
/// all), stored in bf16.
pub const MOE_EXPERTS: usize = 8;
pub const MOE_TOP_K: usize = 2;
pub const MOE_INTERMEDIATE: usize = 1024;

/// The MoE stand-in's directory; created if missing.
pub fn moe_model() -> PathBuf {
    let (hidden, layers, heads, kv_heads, vocab) = (HIDDEN, LAYERS, HEADS, KV_HEADS, VOCAB);
    let (experts, inter) = (MOE_EXPERTS, MOE_INTERMEDIATE);
    let dir = root().join("qwen3-moe-shape").join("model-bf16");
    if dir.join("model.safetensors").exists() {
        return dir;
    }
    std::fs::create_dir_all(&dir).unwrap();
    let head_dim = hidden / heads;
    let config = serde_json::json!({
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
        "hidden_size": hidden, "intermediate_size": 3072, "moe_intermediate_size": inter,
        "num_experts": experts, "num_experts_per_tok": MOE_TOP_K, "norm_topk_prob": true,
        "decoder_sparse_step": 1, "mlp_only_layers": [],
        "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": head_dim, "vocab_size": vocab,
        "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "tie_word_embeddings": true, "hidden_act": "silu", "attention_bias": false,
        "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16"
    });
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    copy_tokenizer(&dir);
    let mut rng = Rng::new(43);
    let kv = kv_heads * head_dim;
    let mut t = vec![(
        "model.embed_tokens.weight".to_string(),
        vec![vocab, hidden],
        random(&mut rng, vocab * hidden, 0.05),
    )];
    for l in 0..layers {
        let p = format!("model.layers.{l}");
        let mut shapes: Vec<(String, usize, usize)> = vec![
            ("self_attn.q_proj".into(), hidden, hidden),
            ("self_attn.k_proj".into(), kv, hidden),
            ("self_attn.v_proj".into(), kv, hidden),
            ("self_attn.o_proj".into(), hidden, hidden),
            ("mlp.gate".into(), experts, hidden),
        ];
        for e in 0..experts {
            shapes.push((format!("mlp.experts.{e}.gate_proj"), inter, hidden));
            shapes.push((format!("mlp.experts.{e}.up_proj"), inter, hidden));
            shapes.push((format!("mlp.experts.{e}.down_proj"), hidden, inter));
        }
        for (name, out, inp) in shapes {
            t.push((
                format!("{p}.{name}.weight"),
                vec![out, inp],
                random(&mut rng, out * inp, 0.04),
            ));
        }
        for norm in [
            ("input_layernorm", hidden),
            ("post_attention_layernorm", hidden),
            ("self_attn.q_norm", head_dim),
            ("self_attn.k_norm", head_dim),
        ] {
            t.push((
                format!("{p}.{}.weight", norm.0),
                vec![norm.1],
                vec![1.0; norm.1],
            ));
        }
    }
    t.push((
        "model.norm.weight".to_string(),
        vec![hidden],
        vec![1.0; hidden],
    ));
    write(&dir.join("model.safetensors"), t, Dtype::BF16);
    dir
}

/// `n` MoE stand-in adapters, created if missing: rank 16 on q, k, v and o
/// and on every expert's gate_up and down (PEFT's `target_parameters`
/// form), bf16.
pub fn moe_adapters(n: usize) -> Vec<PathBuf> {
    let kv = KV_HEADS * (HIDDEN / HEADS);
    expert_adapters(
        "qwen3-moe-shape",
        (HIDDEN, kv, MOE_INTERMEDIATE, MOE_EXPERTS),
        n,
    )
}

/// `n` adapters of a Mixture-of-Experts stand-in under `model`, of shape
/// (hidden, KV width, expert width, experts): rank 16 on q, k, v and o and
/// on every expert's gate_up and down, bf16; created if missing.
pub fn expert_adapters(
    model: &str,
    (hidden, kv, inter, experts): (usize, usize, usize, usize),
    n: usize,
) -> Vec<PathBuf> {
    let layers = LAYERS;
    (0..n)
        .map(|i| {
            let dir = root().join(model).join("adapters").join(format!("a{i:04}"));
            if dir.join("adapter_model.safetensors").exists() {
                return dir;
            }
            std::fs::create_dir_all(&dir).unwrap();
            let config = serde_json::json!({
                "peft_type": "LORA", "r": RANK, "lora_alpha": 32, "bias": "none",
                "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"],
                "target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
                "task_type": "CAUSAL_LM"
            });
            std::fs::write(dir.join("adapter_config.json"), config.to_string()).unwrap();
            let mut rng = Rng::new(5000 + i as u64);
            let mut t = Vec::new();
            for l in 0..layers {
                let base = format!("base_model.model.model.layers.{l}");
                let mut parts: Vec<(String, usize, usize, usize)> = [
                    ("q_proj", hidden),
                    ("k_proj", kv),
                    ("v_proj", kv),
                    ("o_proj", hidden),
                ]
                .map(|(m, out)| (format!("{base}.self_attn.{m}"), hidden, out, RANK))
                .to_vec();
                // (module, fan_in, fan_out, rank rows): every expert's
                // factors stacked along the rank, as PEFT stores them.
                parts.push((
                    format!("{base}.mlp.experts.base_layer"),
                    hidden,
                    2 * inter,
                    RANK * experts,
                ));
                parts.push((format!("{base}.mlp.experts"), inter, hidden, RANK * experts));
                for (p, fan_in, fan_out, r) in parts {
                    t.push((
                        format!("{p}.lora_A.weight"),
                        vec![r, fan_in],
                        random(&mut rng, r * fan_in, 0.05),
                    ));
                    t.push((
                        format!("{p}.lora_B.weight"),
                        vec![fan_out, r],
                        random(&mut rng, fan_out * r, 0.05),
                    ));
                }
            }
            write(&dir.join("adapter_model.safetensors"), t, Dtype::BF16);
            dir
        })
        .collect()
}

/// Gemma-3-1B's shape (`gemma3_text`: 26 layers, every sixth global, the
/// rest sliding over 512 positions; 4 query heads of 256, one KV head;
/// vocabulary 262,144), random weights in bf16. With `all_global`, the
/// same files with every layer global (`layer_types`). Created if missing.
pub fn gemma3_1b(all_global: bool) -> PathBuf {
    let (hidden, intermediate, layers, heads, head_dim, vocab) = (1152, 6912, 26, 4, 256, 262_144);
    let dir = root().join("gemma-3-1b-shape").join("model-bf16");
    let config = |global: bool| {
        let mut c = serde_json::json!({
            "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
            "hidden_size": hidden, "intermediate_size": intermediate,
            "num_hidden_layers": layers, "num_attention_heads": heads,
            "num_key_value_heads": 1, "head_dim": head_dim, "vocab_size": vocab,
            "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
            "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": 256,
            "rope_theta": 1_000_000, "rope_local_base_freq": 10000,
            "sliding_window": 512, "sliding_window_pattern": 6,
            "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16"
        });
        if global {
            c["layer_types"] = serde_json::json!(vec!["full_attention"; layers]);
        }
        c
    };
    if !dir.join("model.safetensors").exists() {
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("config.json"), config(false).to_string()).unwrap();
        copy_tokenizer(&dir);
        let mut rng = Rng::new(7);
        let (q, kv) = (heads * head_dim, head_dim);
        let mut t = vec![(
            "model.embed_tokens.weight".to_string(),
            vec![vocab, hidden],
            random(&mut rng, vocab * hidden, 0.05),
        )];
        for l in 0..layers {
            let p = format!("model.layers.{l}");
            t.extend(projections(&mut rng, &p, q, kv, hidden, intermediate));
            // Gemma's norms scale by (1 + w).
            for norm in [
                "input_layernorm",
                "post_attention_layernorm",
                "pre_feedforward_layernorm",
                "post_feedforward_layernorm",
            ] {
                t.push((
                    format!("{p}.{norm}.weight"),
                    vec![hidden],
                    vec![0.0; hidden],
                ));
            }
            for norm in ["self_attn.q_norm", "self_attn.k_norm"] {
                t.push((
                    format!("{p}.{norm}.weight"),
                    vec![head_dim],
                    vec![0.0; head_dim],
                ));
            }
        }
        t.push((
            "model.norm.weight".to_string(),
            vec![hidden],
            vec![0.0; hidden],
        ));
        write(&dir.join("model.safetensors"), t, Dtype::BF16);
    }
    if !all_global {
        return dir;
    }
    let global = dir.with_file_name("model-bf16-all-global");
    std::fs::create_dir_all(&global).unwrap();
    for entry in std::fs::read_dir(&dir).unwrap() {
        let entry = entry.unwrap();
        let to = global.join(entry.file_name());
        if entry.file_name() != "config.json" && !to.exists() {
            std::os::unix::fs::symlink(entry.path(), &to).unwrap();
        }
    }
    std::fs::write(global.join("config.json"), config(true).to_string()).unwrap();
    global
}
