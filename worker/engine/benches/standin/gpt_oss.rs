//! The GPT-OSS STAND-IN: GPT-OSS-20B's architecture (`gpt_oss`: biases on
//! q/k/v/o, a sink logit per head, sliding (128) and full layers in turn,
//! YaRN, a biased router choosing 4 of 32 experts, biased experts stored
//! as `[experts, in, out]` with gate and up interleaved, the clamped
//! SwiGLU) at the other stand-ins' width (hidden 768, 12 layers, 12 heads
//! of 64, 4 KV heads, experts of width 768, vocabulary 32000; ~110M active
//! parameters, ~700M in all), its experts in bf16 or as MXFP4 as released.

use std::path::{Path, PathBuf};

use lorafleet_engine::sampling::Rng;
use safetensors::Dtype;
use safetensors::tensor::TensorView;

use super::{HEADS, HIDDEN, KV_HEADS, LAYERS, VOCAB, copy_tokenizer, random, root};

pub const GPT_OSS_EXPERTS: usize = 32;
pub const GPT_OSS_TOP_K: usize = 4;
/// Each expert's width (GPT-OSS's equals its hidden size).
pub const GPT_OSS_INTERMEDIATE: usize = HIDDEN;

/// One tensor as its safetensors bytes.
type Raw = (String, Vec<usize>, Dtype, Vec<u8>);

fn bf16(name: String, shape: Vec<usize>, values: Vec<f32>) -> Raw {
    let bytes = values
        .iter()
        .flat_map(|x| half::bf16::from_f32(*x).to_le_bytes())
        .collect();
    (name, shape, Dtype::BF16, bytes)
}

/// The stand-in's directory (`mxfp4`: its experts as MXFP4 blocks and
/// scales); created if missing.
pub fn gpt_oss_model(mxfp4: bool) -> PathBuf {
    let (hidden, layers, heads, kv_heads, vocab) = (HIDDEN, LAYERS, HEADS, KV_HEADS, VOCAB);
    let (experts, inter) = (GPT_OSS_EXPERTS, GPT_OSS_INTERMEDIATE);
    let dir =
        root()
            .join("gpt-oss-20b-shape")
            .join(if mxfp4 { "model-mxfp4" } else { "model-bf16" });
    if dir.join("model.safetensors").exists() {
        return dir;
    }
    std::fs::create_dir_all(&dir).unwrap();
    let head_dim = hidden / heads;
    let mut config = serde_json::json!({
        "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss",
        "attention_bias": true, "head_dim": head_dim, "hidden_act": "silu",
        "hidden_size": hidden, "intermediate_size": inter,
        "initial_context_length": 4096, "max_position_embeddings": 131072,
        "layer_types": (0..layers)
            .map(|l| if l % 2 == 0 { "sliding_attention" } else { "full_attention" })
            .collect::<Vec<_>>(),
        "num_attention_heads": heads, "num_key_value_heads": kv_heads,
        "num_hidden_layers": layers, "num_local_experts": experts,
        "num_experts_per_tok": GPT_OSS_TOP_K, "experts_per_token": GPT_OSS_TOP_K,
        "rms_norm_eps": 1e-5, "rope_theta": 150000, "sliding_window": 128,
        "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "original_max_position_embeddings": 4096,
                         "truncate": false},
        "swiglu_limit": 7.0, "tie_word_embeddings": false, "vocab_size": vocab,
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "torch_dtype": "bfloat16"
    });
    if mxfp4 {
        config["quantization_config"] = serde_json::json!({
            "quant_method": "mxfp4",
            "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                       "model.embed_tokens", "lm_head"],
        });
    }
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    copy_tokenizer(&dir);
    let mut rng = Rng::new(47);
    let q = heads * head_dim;
    let kv = kv_heads * head_dim;
    let mut t = vec![bf16(
        "model.embed_tokens.weight".into(),
        vec![vocab, hidden],
        random(&mut rng, vocab * hidden, 0.05),
    )];
    for l in 0..layers {
        let p = format!("model.layers.{l}");
        for (name, out, inp) in [
            ("self_attn.q_proj", q, hidden),
            ("self_attn.k_proj", kv, hidden),
            ("self_attn.v_proj", kv, hidden),
            ("self_attn.o_proj", hidden, q),
            ("mlp.router", experts, hidden),
        ] {
            let weight = random(&mut rng, out * inp, 0.04);
            t.push(bf16(format!("{p}.{name}.weight"), vec![out, inp], weight));
            t.push(bf16(
                format!("{p}.{name}.bias"),
                vec![out],
                random(&mut rng, out, 0.02),
            ));
        }
        t.push(bf16(
            format!("{p}.self_attn.sinks"),
            vec![heads],
            random(&mut rng, heads, 1.0),
        ));
        for (name, fan_in, fan_out) in [
            ("gate_up_proj", hidden, 2 * inter),
            ("down_proj", inter, hidden),
        ] {
            let at = format!("{p}.mlp.experts.{name}");
            if mxfp4 {
                // Any nibble is an E2M1 value; exponents 2^-7 and 2^-6
                // keep the weights near the bf16 ones' size.
                let groups = fan_in / 32;
                let blocks = (0..experts * fan_out * groups * 16)
                    .map(|_| (rng.next_u64() & 0xff) as u8)
                    .collect();
                let scales = (0..experts * fan_out * groups)
                    .map(|_| 120 + (rng.next_u64() & 1) as u8)
                    .collect();
                t.push((
                    format!("{at}_blocks"),
                    vec![experts, fan_out, groups, 16],
                    Dtype::U8,
                    blocks,
                ));
                t.push((
                    format!("{at}_scales"),
                    vec![experts, fan_out, groups],
                    Dtype::U8,
                    scales,
                ));
            } else {
                let weight = random(&mut rng, experts * fan_in * fan_out, 0.04);
                t.push(bf16(at.clone(), vec![experts, fan_in, fan_out], weight));
            }
            let bias = random(&mut rng, experts * fan_out, 0.02);
            t.push(bf16(format!("{at}_bias"), vec![experts, fan_out], bias));
        }
        for norm in ["input_layernorm", "post_attention_layernorm"] {
            t.push(bf16(
                format!("{p}.{norm}.weight"),
                vec![hidden],
                vec![1.0; hidden],
            ));
        }
    }
    t.push(bf16(
        "model.norm.weight".into(),
        vec![hidden],
        vec![1.0; hidden],
    ));
    let head = random(&mut rng, vocab * hidden, 0.05);
    t.push(bf16("lm_head.weight".into(), vec![vocab, hidden], head));
    write_raw(&dir.join("model.safetensors"), &t);
    dir
}

/// `n` GPT-OSS stand-in adapters as PEFT writes them for GPT-OSS: rank 16
/// on q, k, v and o and, through `target_parameters`, on every expert's
/// gate_up and down; created if missing.
pub fn gpt_oss_adapters(n: usize) -> Vec<PathBuf> {
    let kv = KV_HEADS * (HIDDEN / HEADS);
    super::expert_adapters(
        "gpt-oss-20b-shape",
        (HIDDEN, kv, GPT_OSS_INTERMEDIATE, GPT_OSS_EXPERTS),
        n,
    )
}

fn write_raw(path: &Path, tensors: &[Raw]) {
    let views: Vec<(String, TensorView<'_>)> = tensors
        .iter()
        .map(|(n, s, d, b)| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap()))
        .collect();
    safetensors::serialize_to_file(views, None, path).unwrap();
}
