//! The CPU backend's forward pass against transformers + PEFT, one sequence
//! at a time: logits at the last prompt position within 1e-4 relative
//! error, and greedy tokens exactly.

mod common;

use common::*;
use lorafleet_engine::backend::cpu::CpuBackend;
use lorafleet_engine::backend::{Backend, BackendShape, StepBatch};
use lorafleet_engine::lora::{AdapterLimits, HostAdapter};
use lorafleet_engine::model::ModelConfig;

/// The fixtures' backend shape: rank-16 slots and KV blocks of 4 positions.
fn shape(slots: usize, kv_blocks: usize) -> BackendShape {
    BackendShape {
        slots,
        max_lora_rank: 16,
        kv_blocks,
        block_size: 4,
        ring_len: 0,
        ring_blocks: 0,
    }
}

#[test]
fn forward_matches_transformers_and_peft() {
    let golden = golden();
    let mut checked = 0;
    for model in ["llama-gqa", "qwen2-tied"] {
        let dir = model_dir(model);
        let config = ModelConfig::from_dir(&dir).unwrap();
        let shape = shape(1, 8);
        let mut backend = CpuBackend::load(&dir, &config, shape).unwrap();
        for case in golden.cases.iter().filter(|c| c.model == model) {
            let slot = match &case.adapter {
                None => None,
                Some(name) => {
                    let limits = AdapterLimits {
                        model: &config,
                        max_lora_rank: 16,
                        base_hash_check: None,
                    };
                    let adapter =
                        HostAdapter::load(name, &adapter_dir(model, name), limits).unwrap();
                    backend.write_slot(0, &adapter).unwrap();
                    Some(0)
                }
            };
            check_golden_case(&mut backend, case, slot);
            checked += 1;
        }
    }
    assert_eq!(checked, golden.cases.len());
}

#[test]
fn a_prefill_gives_the_bits_of_its_tokens_fed_one_at_a_time() {
    // A prefill step runs its last layer on the rows that want logits
    // alone. Each row's sums do not depend on the rows around it, so the
    // logits must be the same bits as feeding the prompt one token per
    // step, with and without an adapter, beside a chunk that wants none.
    let golden = golden();
    for model in ["llama-gqa", "qwen2-tied"] {
        let dir = model_dir(model);
        let config = ModelConfig::from_dir(&dir).unwrap();
        let shape = shape(1, 24);
        let mut backend = CpuBackend::load(&dir, &config, shape).unwrap();
        let (whole, stepped, other): (Vec<u32>, Vec<u32>, Vec<u32>) =
            ((0..8).collect(), (8..16).collect(), (16..24).collect());
        for case in golden.cases.iter().filter(|c| c.model == model) {
            let slot = case.adapter.as_ref().map(|name| {
                let limits = AdapterLimits {
                    model: &config,
                    max_lora_rank: 16,
                    base_hash_check: None,
                };
                let adapter = HostAdapter::load(name, &adapter_dir(model, name), limits).unwrap();
                backend.write_slot(0, &adapter).unwrap();
                0
            });
            let prompt = &case.prompt_ids;
            let mut batch = StepBatch::default();
            batch.push(prompt, 0, &whole, slot, true);
            // A chunk of another prompt that wants no logits.
            batch.push(&prompt[..prompt.len().min(3)], 0, &other, slot, false);
            batch.finish();
            let at_once = backend.forward(&batch).unwrap();
            assert_eq!(at_once.len(), config.vocab_size, "one row of logits");
            let mut last = Vec::new();
            for (pos, &token) in prompt.iter().enumerate() {
                let mut batch = StepBatch::default();
                batch.push(&[token], pos, &stepped, slot, true);
                batch.finish();
                last = backend.forward(&batch).unwrap();
            }
            let bits = |v: &[f32]| v.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            assert!(
                bits(&at_once) == bits(&last),
                "{model}/{:?} {:?}: prefill and token-by-token logits differ",
                case.adapter,
                case.prompt
            );
            // The prompt in two chunks, the first wanting no logits (its
            // last layer stops at the keys and values), beside a base-model
            // sequence that wants its own: two logit rows, on two slots, at
            // two positions.
            let cut = prompt.len() / 2;
            let mut first = StepBatch::default();
            first.push(&prompt[..cut], 0, &whole, slot, false);
            first.finish();
            assert!(
                backend.forward(&first).unwrap().is_empty(),
                "no logits wanted"
            );
            let mut second = StepBatch::default();
            second.push(&prompt[cut..], cut, &whole, slot, true);
            second.push(&prompt[..2], 0, &other, None, true);
            second.finish();
            let both = backend.forward(&second).unwrap();
            let (chunked, base) = both.split_at(config.vocab_size);
            assert!(
                bits(chunked) == bits(&last),
                "{model}/{:?} {:?}: chunked prefill logits differ",
                case.adapter,
                case.prompt
            );
            let mut alone = StepBatch::default();
            alone.push(&prompt[..2], 0, &stepped, None, true);
            alone.finish();
            assert!(
                bits(base) == bits(&backend.forward(&alone).unwrap()),
                "{model}: the second logit row differs from its sequence alone"
            );
        }
    }
}

#[test]
fn an_adapter_gives_back_its_files_a_and_b_transposed() {
    // The host tier holds Aᵀ (input-major, the slots' order); `a_f32` and
    // `b_t_f32` (what the CUDA slots are written from) must give back the
    // file's A `[rank, in]` and Bᵀ, stored in f32 and in bf16 alike.
    use safetensors::{Dtype, SafeTensors};
    let model = "llama-gqa";
    let config = ModelConfig::from_dir(&model_dir(model)).unwrap();
    let limits = AdapterLimits {
        model: &config,
        max_lora_rank: 16,
        base_hash_check: None,
    };
    let name = "k-r16";
    for dtype in [Dtype::F32, Dtype::BF16] {
        let copy = bf16_copy_of(&adapter_dir(model, name), &|_| dtype);
        let adapter = HostAdapter::load(name, copy.path(), limits).unwrap();
        let bytes = std::fs::read(copy.path().join("adapter_model.safetensors")).unwrap();
        let file = SafeTensors::deserialize(&bytes).unwrap();
        let read = |tensor: &str| -> (Vec<f32>, Vec<usize>) {
            let view = file.tensor(tensor).unwrap();
            let values = match view.dtype() {
                Dtype::F32 => view
                    .data()
                    .chunks_exact(4)
                    .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                    .collect(),
                _ => view
                    .data()
                    .chunks_exact(2)
                    .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
                    .collect(),
            };
            (values, view.shape().to_vec())
        };
        let prefix = "base_model.model.model.layers.0.self_attn.k_proj";
        let (a, a_shape) = read(&format!("{prefix}.lora_A.weight"));
        let (b, b_shape) = read(&format!("{prefix}.lora_B.weight"));
        let (rank, fan_out) = (a_shape[0], b_shape[0]);
        let b_t: Vec<f32> = (0..rank * fan_out)
            .map(|i| b[(i % fan_out) * rank + i / fan_out])
            .collect();
        let k = adapter.modules[0][lorafleet_engine::lora::Projection::K.index()]
            .as_ref()
            .expect("layer 0 k_proj");
        assert_eq!(k.rank, rank);
        assert_eq!(k.a_f32(), a, "{dtype:?}: A");
        assert_eq!(&k.b_t_f32()[..], &b_t[..], "{dtype:?}: Bᵀ");
    }
}

/// Copies a fixture model with every weight rounded to bf16, stored as
/// `dtype` (BF16, or F32 holding the same values), sharded as the fixture is.
fn bf16_copy(model: &str, dtype: safetensors::Dtype) -> tempfile::TempDir {
    bf16_copy_of(&model_dir(model), &|_| dtype)
}

/// [`bf16_copy`] of any directory of safetensors files (a model or an
/// adapter), its other files copied as they are.
fn bf16_copy_of(
    src: &std::path::Path,
    dtype_of: &dyn Fn(&str) -> safetensors::Dtype,
) -> tempfile::TempDir {
    use safetensors::SafeTensors;
    use safetensors::tensor::TensorView;
    let dst = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(src).unwrap() {
        let path = entry.unwrap().path();
        let to = dst.path().join(path.file_name().unwrap());
        if path.extension().is_none_or(|e| e != "safetensors") {
            std::fs::copy(&path, &to).unwrap();
            continue;
        }
        let bytes = std::fs::read(&path).unwrap();
        let st = SafeTensors::deserialize(&bytes).unwrap();
        let tensors: Vec<(String, Vec<usize>, Vec<u8>)> = st
            .tensors()
            .into_iter()
            .map(|(name, view)| {
                let values: Vec<f32> = match view.dtype() {
                    safetensors::Dtype::F32 => view
                        .data()
                        .chunks_exact(4)
                        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                        .collect(),
                    safetensors::Dtype::F16 => view
                        .data()
                        .chunks_exact(2)
                        .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
                        .collect(),
                    safetensors::Dtype::BF16 => view
                        .data()
                        .chunks_exact(2)
                        .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
                        .collect(),
                    other => panic!("fixture tensor {name} is {other:?}"),
                };
                let rounded = values.into_iter().map(half::bf16::from_f32);
                let data = match dtype_of(&name) {
                    safetensors::Dtype::BF16 => rounded.flat_map(|h| h.to_le_bytes()).collect(),
                    _ => rounded.flat_map(|h| h.to_f32().to_le_bytes()).collect(),
                };
                (name, view.shape().to_vec(), data)
            })
            .collect();
        let views: Vec<(String, TensorView<'_>)> = tensors
            .iter()
            .map(|(n, s, d)| {
                (
                    n.clone(),
                    TensorView::new(dtype_of(n), s.clone(), d).unwrap(),
                )
            })
            .collect();
        safetensors::serialize_to_file(views, None, &to).unwrap();
    }
    dst
}

#[test]
fn a_bf16_checkpoint_matches_its_f32_widening() {
    // bf16 weights stay bf16 in memory. Where they are widened just before
    // use, widening is exact, so every logit must equal the f32 model's;
    // on AMX tiles the products are exact and only the additions round
    // differently, so the logits agree to f32 rounding. With and without
    // an adapter, for the sharded GQA model and the tied one (whose
    // lm_head comes from the bf16 embeddings).
    let tiles = lorafleet_engine::backend::cpu::amx::available();
    let golden = golden();
    for model in ["llama-gqa", "qwen2-tied"] {
        let narrow = bf16_copy(model, safetensors::Dtype::BF16);
        let wide = bf16_copy(model, safetensors::Dtype::F32);
        let config = ModelConfig::from_dir(narrow.path()).unwrap();
        let shape = shape(1, 8);
        let mut backends =
            [narrow.path(), wide.path()].map(|dir| CpuBackend::load(dir, &config, shape).unwrap());
        let case = golden
            .cases
            .iter()
            .find(|c| c.model == model && c.adapter.is_some())
            .unwrap();
        let limits = AdapterLimits {
            model: &config,
            max_lora_rank: 16,
            base_hash_check: None,
        };
        let name = case.adapter.as_ref().unwrap();
        let adapter = HostAdapter::load(name, &adapter_dir(model, name), limits).unwrap();
        let table: Vec<u32> = (0..8).collect();
        let mut seen = Vec::new();
        for backend in &mut backends {
            backend.write_slot(0, &adapter).unwrap();
            let mut logits = Vec::new();
            for slot in [None, Some(0)] {
                let mut batch = StepBatch::default();
                batch.push(&case.prompt_ids, 0, &table, slot, true);
                batch.finish();
                logits.push(backend.forward(&batch).unwrap());
            }
            seen.push(logits);
        }
        for (which, (a, b)) in ["base", "adapter"].iter().zip(seen[0].iter().zip(&seen[1])) {
            if !tiles {
                let bits = |v: &[f32]| v.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                assert!(
                    bits(a) == bits(b),
                    "{model} {which}: bf16 and f32 logits differ"
                );
                continue;
            }
            let scale = b.iter().fold(0f32, |m, v| m.max(v.abs()));
            for (i, (x, y)) in a.iter().zip(b).enumerate() {
                assert!(
                    (x - y).abs() <= 1e-5 * scale,
                    "{model} {which} logit {i}: tiles {x}, f32 {y}"
                );
            }
            let argmax = |v: &[f32]| (0..v.len()).max_by(|&i, &j| v[i].total_cmp(&v[j])).unwrap();
            assert_eq!(argmax(a), argmax(b), "{model} {which}: greedy token");
        }
        // The bf16 checkpoint must really be held in bf16, or the equality
        // above would hold trivially: every projection and the lm_head
        // take half the bytes.
        let [narrow_bytes, wide_bytes] = backends.each_ref().map(|b| b.projection_bytes());
        assert_eq!(
            narrow_bytes * 2,
            wide_bytes,
            "{model}: bf16 weights held in bf16"
        );
    }
}

#[test]
fn a_bf16_adapter_matches_its_f32_widening() {
    // An adapter stored in bf16 stays bf16 in the host tier and in its
    // device slot; widening is exact, so every logit must equal that of the
    // same values stored in f32, in the same batch, through shared tiles
    // (prefill) and gathers (decode) alike. An adapter whose A is bf16 and
    // whose B is f32 is held in f32. Every fixture adapter, both models.
    use lorafleet_engine::lora::Factors;
    use safetensors::Dtype;
    for model in ["llama-gqa", "qwen2-tied"] {
        let dir = model_dir(model);
        let config = ModelConfig::from_dir(&dir).unwrap();
        let shape = shape(6, 12);
        let mut backend = CpuBackend::load(&dir, &config, shape).unwrap();
        let limits = AdapterLimits {
            model: &config,
            max_lora_rank: 16,
            base_hash_check: None,
        };
        let prompts: [Vec<u32>; 2] = [
            (0..6).map(|i| 5 + 7 * i).collect(),
            (0..6).map(|i| 40 - 3 * i).collect(),
        ];
        for name in adapter_names(model) {
            let src = adapter_dir(model, &name);
            let dtypes: [&dyn Fn(&str) -> Dtype; 3] = [&|_| Dtype::BF16, &|_| Dtype::F32, &|t| {
                if t.contains("lora_A") {
                    Dtype::BF16
                } else {
                    Dtype::F32
                }
            }];
            let [narrow, wide, mixed] = dtypes
                .map(|dtype_of| bf16_copy_of(&src, dtype_of))
                .map(|copy| HostAdapter::load(&name, copy.path(), limits).unwrap());
            let held_bf16 = |a: &HostAdapter| {
                a.modules
                    .iter()
                    .flatten()
                    .flatten()
                    .map(|m| matches!(m.factors, Factors::Bf16 { .. }))
                    .collect::<Vec<_>>()
            };
            assert!(
                held_bf16(&narrow).iter().all(|&b| b) && !held_bf16(&narrow).is_empty(),
                "{model}/{name}: held in bf16"
            );
            for f32_held in [&wide, &mixed] {
                assert!(held_bf16(f32_held).iter().all(|&b| !b), "{model}/{name}");
                assert_eq!(
                    narrow.bytes * 2,
                    f32_held.bytes,
                    "{model}/{name}: bytes held"
                );
            }
            // Slots 0 and 1 bf16, 2 to 5 f32; sequence i runs prompt i % 2
            // on slot i. The decode step's six one-token segments make two
            // gathers: slots 0-1 in bf16, slots 2-5 in f32 (a gather never
            // mixes them).
            for (slot, adapter) in [&narrow, &narrow, &wide, &wide, &mixed, &mixed]
                .into_iter()
                .enumerate()
            {
                backend.write_slot(slot, adapter).unwrap();
            }
            let tables: Vec<Vec<u32>> = (0..6u32).map(|i| vec![2 * i, 2 * i + 1]).collect();
            for step in 0..2 {
                let mut batch = StepBatch::default();
                for (slot, table) in tables.iter().enumerate() {
                    let prompt = &prompts[slot % 2];
                    match step {
                        0 => batch.push(prompt, 0, table, Some(slot), true),
                        _ => batch.push(&prompt[..1], prompt.len(), table, Some(slot), true),
                    }
                }
                batch.finish();
                let logits = backend.forward(&batch).unwrap();
                let rows: Vec<&[f32]> = logits.chunks(config.vocab_size).collect();
                let bits = |v: &[f32]| v.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                for (i, j) in [(0, 2), (1, 3), (4, 2), (5, 3)] {
                    assert!(
                        bits(rows[i]) == bits(rows[j]),
                        "{model}/{name} step {step}: slot {i} and slot {j} logits differ"
                    );
                }
                assert!(bits(rows[0]) != bits(rows[1]), "the two prompts differ");
            }
        }
    }
}
