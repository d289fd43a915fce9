//! Quantized base models — the tiny Llama and Qwen2 fixtures in the
//! `compressed-tensors` layout (int8 per channel, FP8 e4m3 per channel,
//! 4-bit packed per group of 32, symmetric and asymmetric), GPTQ's (4-bit, groups of 32, AutoGPTQ's
//! zero points) and AWQ's (4-bit, groups of 32, AutoAWQ's GEMM layout) — on
//! the CPU backend: logits within 1e-4 of transformers + PEFT run on the
//! same weights dequantized in f32 (`scripts/make_quantized_fixtures.py`)
//! and greedy tokens equal, for the base model and every adapter of the
//! dense goldens; and
//! what is not read is refused by the field that names it.

mod common;

use common::*;
use lorafleet_engine::backend::BackendShape;
use lorafleet_engine::backend::cpu::CpuBackend;
use lorafleet_engine::model::{ModelConfig, WeightFiles};

/// The dense fixtures, each quantized in every format.
const SOURCES: [&str; 2] = ["llama-gqa", "qwen2-tied"];
const FORMATS: [&str; 6] = ["int8", "fp8", "int4", "int4-asym", "gptq", "awq"];

/// (quantized model, the dense model its adapters were made for).
fn variants() -> Vec<(String, &'static str)> {
    SOURCES
        .iter()
        .flat_map(|s| FORMATS.iter().map(move |f| (format!("{s}-{f}"), *s)))
        .collect()
}

fn golden_quantized() -> Golden {
    let text = std::fs::read_to_string(fixtures().join("golden_quantized.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

#[test]
fn quantized_bases_match_transformers_and_peft_on_their_dequantized_weights() {
    let golden = golden_quantized();
    let mut checked = 0;
    for (model, dense) in variants() {
        let files = WeightFiles::open_model_dir(&model_dir(&model)).unwrap();
        assert!(files.quantization().is_some(), "{model} is quantized");
        // The adapters were trained on (made for) the dense model.
        checked += check_golden_cases_on_cpu(&golden, &model, dense);
    }
    assert_eq!(checked, golden.cases.len());
    assert_eq!(
        checked,
        6 * 3 * ((1 + 10) + (1 + 2)),
        "6 formats x 3 prompts x (llama-gqa: base + 10 adapters, qwen2-tied: base + 2)"
    );
}

/// The checkpoints llm-compressor's `oneshot` and transformers' own FP8
/// quantizer wrote (`scripts/make_tool_quantized_fixtures.py`: W8A16 per
/// group, asymmetric and per channel, W4A16 and its asymmetric form, W8A8
/// int8, FP8_DYNAMIC, FP8_BLOCK in blocks of 32 and 128, transformers'
/// `fp8`), each against transformers + PEFT on the checkpoint as
/// transformers itself loads it (compressed-tensors decompressing it,
/// inputs quantized on the fly where the scheme says): logits within 1e-4,
/// greedy tokens equal, for the base model and two adapters.
///
/// Inputs quantized to int8 per token are the one exception, with logits
/// within 1e-2: a token's largest input is exactly 127.5 steps of its
/// scale (`max / (255 / 2)`), a tie, so where it is negative the last bit
/// of the reference's own division picks -128 or -127, and an input that
/// differs from torch's by one rounding of the sum before it can take the
/// other side (measured: 7 of 9 cases within 5e-7, two at 3.4e-3). The
/// greedy tokens are still equal.
#[test]
fn checkpoints_the_tools_wrote_match_the_tools_own_readers() {
    let text = std::fs::read_to_string(fixtures().join("golden_tool_quantized.json")).unwrap();
    let golden: Golden = serde_json::from_str(&text).unwrap();
    let mut checked = 0;
    for (model, dense) in tool_checkpoints() {
        let files = WeightFiles::open_model_dir(&model_dir(&model)).unwrap();
        let q = files.quantization().expect("quantized");
        eprintln!("{model}: {}", q.label());
        let tolerance = if model.ends_with("-w8a8") { 1e-2 } else { 1e-4 };
        let n = check_golden_cases_on_cpu_within(&golden, &model, dense, tolerance);
        assert_eq!(n, 3 * 3, "{model}: 3 prompts x (base + 2 adapters)");
        checked += n;
    }
    assert_eq!(checked, golden.cases.len());
}

/// The tool-written checkpoints (model, the dense model its adapters were
/// made for): every scheme of the f32 llama-gqa, and the new formats of
/// the bf16 qwen2-tied (bf16 scales, q/k/v biases, a tied lm_head).
fn tool_checkpoints() -> Vec<(String, &'static str)> {
    let llama = TOOL_SCHEMES
        .iter()
        .map(|s| (format!("llama-gqa-tool-{s}"), "llama-gqa"));
    let qwen = ["w8a16", "w8a16-asym", "fp8-block32", "hf-fp8"]
        .iter()
        .map(|s| (format!("qwen2-tied-tool-{s}"), "qwen2-tied"));
    llama.chain(qwen).collect()
}

/// Quantized projections stay at their width in memory (codes, scales and
/// zero points), and a tied embedding is held once, in the lm_head.
#[test]
fn quantized_weights_stay_at_their_width_in_memory() {
    let load = |model: &str| {
        let dir = model_dir(model);
        let config = ModelConfig::from_dir(&dir).unwrap();
        let shape = BackendShape {
            slots: 1,
            max_lora_rank: 16,
            kv_blocks: 8,
            block_size: 4,
            ring_len: 0,
            ring_blocks: 0,
        };
        CpuBackend::load(&dir, &config, shape).unwrap()
    };
    for dense in SOURCES {
        let f32_model = load(dense);
        // Bytes per weight of the dense model (qwen2-tied is stored in
        // bf16, and its projections stay bf16).
        let width = match WeightFiles::open_model_dir(&model_dir(dense))
            .unwrap()
            .raw("model.layers.0.self_attn.o_proj.weight")
            .unwrap()
            .dtype
        {
            safetensors::Dtype::BF16 => 2.0,
            _ => 4.0,
        };
        let f32_bytes = f32_model.layer_projection_bytes() as f64 * 4.0 / width;
        for format in FORMATS {
            let q = load(&format!("{dense}-{format}"));
            let ratio = q.layer_projection_bytes() as f64 / f32_bytes;
            // 8-bit: a quarter of f32, plus a scale per output; 4-bit: an
            // eighth, plus a scale (and a zero point) per 32 inputs. At
            // the fixtures' 64-wide layers the scales and the map of
            // inputs to groups add about a tenth of the codes.
            let most = if matches!(format, "int8" | "fp8") {
                0.3
            } else {
                0.25
            };
            eprintln!("{dense}-{format}: layer projections at {:.3} of f32", ratio);
            assert!(ratio < most, "{dense}-{format}: {ratio}");
            // The embeddings and norms are stored as in the dense model.
            assert_eq!(
                q.weight_bytes() - q.layer_projection_bytes(),
                f32_model.weight_bytes() - f32_model.layer_projection_bytes(),
                "{dense}-{format}"
            );
        }
        // qwen2-tied's embeddings are its lm_head: held once.
        let embed_and_head = f32_model.weight_bytes() - f32_model.projection_bytes();
        let config = ModelConfig::from_dir(&model_dir(dense)).unwrap();
        let table = config.vocab_size * config.hidden_size * width as usize;
        let norms = (config.num_layers * 2 + 1) * config.hidden_size * 4;
        let tied = dense == "qwen2-tied";
        assert_eq!(
            embed_and_head,
            norms + if tied { 0 } else { table },
            "{dense}"
        );
    }
}

/// The base hash covers the stored (quantized) bytes: each quantization of
/// a base is a different base model, so an adapter's declared base hash
/// tells them apart.
#[test]
fn each_quantization_of_a_base_has_its_own_base_hash() {
    let mut hashes: Vec<String> = SOURCES
        .iter()
        .map(|s| s.to_string())
        .chain(variants().into_iter().map(|(m, _)| m))
        .map(|m| {
            WeightFiles::open_model_dir(&model_dir(&m))
                .unwrap()
                .base_hash(&mut |_, _| {})
                .unwrap()
                .to_string()
        })
        .collect();
    hashes.sort();
    hashes.dedup();
    assert_eq!(hashes.len(), 2 + 2 * FORMATS.len());
    // The config is covered too, by what it means: the same GPTQ bytes
    // under the other zero-point convention are another base.
    let hash = |dir: &std::path::Path| {
        WeightFiles::open_model_dir(dir)
            .unwrap()
            .base_hash(&mut |_, _| {})
            .unwrap()
    };
    let gptq = hash(&model_dir("llama-gqa-gptq"));
    let v2 = edited("llama-gqa-gptq", |c| {
        c["quantization_config"]["checkpoint_format"] = "gptq_v2".into()
    });
    assert_ne!(hash(v2.path()), gptq);
    // How it was made (not how it reads) is not part of it.
    let annotated = edited("llama-gqa-gptq", |c| {
        c["quantization_config"]["damp_percent"] = 0.01.into();
        c["quantization_config"]["true_sequential"] = true.into();
    });
    assert_eq!(hash(annotated.path()), gptq);
}

/// Copies a quantized fixture with its `config.json` edited.
fn edited(model: &str, edit: impl Fn(&mut serde_json::Value)) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(model_dir(model)).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), dir.path().join(entry.file_name())).unwrap();
    }
    let path = dir.path().join("config.json");
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    edit(&mut config);
    std::fs::write(&path, config.to_string()).unwrap();
    dir
}

#[test]
fn a_quantization_that_is_not_read_is_refused_by_its_field() {
    // At the configuration: another method, format or width.
    for (edit, field) in [
        (
            &(|c: &mut serde_json::Value| {
                c["quantization_config"]["quant_method"] = "bitsandbytes".into()
            }) as &dyn Fn(&mut serde_json::Value),
            "quantization_config.quant_method",
        ),
        (
            &|c: &mut serde_json::Value| c["quantization_config"]["format"] = "marlin-24".into(),
            "quantization_config.format",
        ),
        (
            &|c: &mut serde_json::Value| {
                c["quantization_config"]["config_groups"]["group_0"]["weights"]["num_bits"] =
                    2.into()
            },
            "quantization_config.config_groups.group_0.weights",
        ),
    ] {
        let dir = edited("llama-gqa-int8", edit);
        let err = ModelConfig::from_dir(dir.path()).unwrap_err().to_string();
        assert!(err.contains(field), "{field}: {err}");
        let err = WeightFiles::open_model_dir(dir.path())
            .unwrap_err()
            .to_string();
        assert!(err.contains(field), "{field}: {err}");
    }
    // At the weights: int8 tensors under an FP8 configuration are refused
    // by the tensor's name and dtype, not read as something else.
    let dir = edited("llama-gqa-int8", |c| {
        let q = &mut c["quantization_config"];
        q["format"] = "float-quantized".into();
        q["config_groups"]["group_0"]["weights"]["type"] = "float".into();
    });
    let config = ModelConfig::from_dir(dir.path()).unwrap();
    let shape = BackendShape {
        slots: 1,
        max_lora_rank: 16,
        kv_blocks: 8,
        block_size: 4,
        ring_len: 0,
        ring_blocks: 0,
    };
    let err = CpuBackend::load(dir.path(), &config, shape)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("model.layers.0.self_attn.q_proj.weight"),
        "{err}"
    );
    assert!(err.contains("F8_E4M3") && err.contains("I8"), "{err}");
}

/// The CUDA backend's device layout of every quantized fixture's weights
/// (`backend::cuda::quant::HostPart`, what `quant.cu` reads) gives back
/// each weight bit for bit, and the memory plan made from the
/// configuration alone counts the bytes that layout takes (GPTQ's group
/// index counted whether or not it is needed). Runs on any machine: the
/// kernels' indexing is this layout's.
#[test]
fn the_cuda_layout_of_every_quantized_weight_reads_back_bit_for_bit() {
    use lorafleet_artifact::quantization::Strategy;
    use lorafleet_engine::backend::cuda::Dtype;
    use lorafleet_engine::backend::cuda::quant::{HostPart, QuantPlan, fp8_ready};
    use lorafleet_engine::lora::Projection;
    let mut matrices = 0;
    let mut expected = 0;
    let tools = tool_checkpoints().into_iter().map(|(m, _)| m);
    for model in variants().into_iter().map(|(m, _)| m).chain(tools) {
        let dir = model_dir(&model);
        let config = ModelConfig::from_dir(&dir).unwrap();
        let files = WeightFiles::open_model_dir(&dir).unwrap();
        let q = files.quantization().unwrap().clone();
        // A scale per row when no group or block splits a row.
        let row_scaled_fp8 = |fan_in: usize| {
            q.format.is_fp8()
                && match q.strategy {
                    Strategy::Tensor | Strategy::Channel => true,
                    Strategy::Block { cols, .. } => cols >= fan_in,
                    Strategy::Group(_) => false,
                }
        };
        let gptq = model.ends_with("gptq");
        expected += config.num_layers * 7;
        let mut bytes = 0;
        for l in 0..config.num_layers {
            // The device reads a fused group (q, k and v; gate and up)
            // quantized only when every part of it is.
            let stored = |p: Projection| {
                files.stored_quantized(&format!(
                    "model.layers.{l}.{}.{}.weight",
                    p.parent(),
                    p.module_name()
                ))
            };
            let group_quantized = |p: Projection| {
                let group: &[Projection] = match p {
                    Projection::Q | Projection::K | Projection::V => {
                        &[Projection::Q, Projection::K, Projection::V]
                    }
                    Projection::Gate | Projection::Up => &[Projection::Gate, Projection::Up],
                    Projection::O => &[Projection::O],
                    Projection::Down => &[Projection::Down],
                };
                group.iter().all(|&p| stored(p))
            };
            for p in Projection::ALL {
                let (fan_in, out) = p.shape(&config);
                let name = format!("model.layers.{l}.{}.{}.weight", p.parent(), p.module_name());
                let Some(m) = files.quantized_matrix(&name, &[out, fan_in]).unwrap() else {
                    // transformers' FP8 quantizer leaves a matrix its
                    // blocks do not divide as it was: qwen2-tied's k and v
                    // (16 outputs, blocks of 32).
                    assert!(
                        model == "qwen2-tied-tool-hf-fp8"
                            && matches!(p, Projection::K | Projection::V),
                        "{model}: {name} is quantized"
                    );
                    expected -= 1;
                    continue;
                };
                let part = HostPart::new(&m);
                for o in 0..out {
                    for k in 0..fan_in {
                        assert_eq!(
                            part.weight(o, k).to_bits(),
                            m.weight(o, k).to_bits(),
                            "{model}: {name} ({o}, {k})"
                        );
                    }
                }
                // Only an FP8 weight scaled per row can run as one FP8 GEMM.
                assert_eq!(
                    fp8_ready(std::slice::from_ref(&part)),
                    row_scaled_fp8(fan_in),
                    "{model}: {name}"
                );
                matrices += 1;
                if !group_quantized(p) {
                    continue;
                }
                // FP8 GEMMs keep a scale per row beside the codes.
                if row_scaled_fp8(fan_in) && q.fp8_inputs_per_token() {
                    bytes += 4 * out as u64;
                }
                bytes += part.bytes() as u64
                    + if gptq && part.gidx.is_none() {
                        4 * fan_in as u64
                    } else {
                        0
                    };
            }
        }
        let plan = QuantPlan::new(&files, &config, Dtype::Bf16, 64, false).unwrap();
        assert_eq!(plan.quantized, bytes, "{model}: planned device bytes");
        assert!(plan.quantized < plan.replaced, "{model}: smaller than bf16");
    }
    assert_eq!(matrices, expected);
    assert_eq!(
        expected,
        (12 + 14) * 2 * 7 - 4,
        "every fixture's every projection but the 4 transformers left"
    );
}

/// An FP8 checkpoint that quantizes its activations too
/// (`input_activations`, as llm-compressor writes W8A8) says so, which is
/// what makes the CPU backend quantize the projections' inputs and the
/// CUDA backend run it as FP8 GEMMs; the same stored bytes then compute
/// another model, so its base hash is another.
#[test]
fn an_fp8_checkpoint_that_quantizes_its_activations_says_so() {
    let hash = |dir: &std::path::Path| {
        let files = WeightFiles::open_model_dir(dir).unwrap();
        let q = files.quantization().unwrap();
        (
            q.activations(),
            q.fp8_inputs_per_token(),
            files.base_hash(&mut |_, _| {}).unwrap(),
        )
    };
    let (plain, _, plain_hash) = hash(&model_dir("llama-gqa-fp8"));
    let w8a8 = edited("llama-gqa-fp8", |c| {
        c["quantization_config"]["config_groups"]["group_0"]["input_activations"] = serde_json::json!({
            "num_bits": 8, "type": "float", "symmetric": true, "strategy": "token", "dynamic": true
        });
    });
    let (quantized, per_token, w8a8_hash) = hash(w8a8.path());
    assert!(!plain && quantized && per_token);
    assert_ne!(plain_hash, w8a8_hash);
}
