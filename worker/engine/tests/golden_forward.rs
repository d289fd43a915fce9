//! The CPU backend's forward pass against transformers + PEFT, one sequence
//! at a time: logits at the last prompt position within 1e-4 relative
//! error, and greedy tokens exactly.

mod common;

use common::*;
use lorafleet_engine::backend::cpu::CpuBackend;
use lorafleet_engine::backend::{Backend, BackendShape, StepBatch};
use lorafleet_engine::lora::{AdapterLimits, HostAdapter};
use lorafleet_engine::model::ModelConfig;

fn argmax(v: &[f32]) -> u32 {
    let mut best = 0;
    for (i, x) in v.iter().enumerate() {
        if *x > v[best] {
            best = i;
        }
    }
    best as u32
}

#[test]
fn forward_matches_transformers_and_peft() {
    let golden = golden();
    let mut checked = 0;
    for model in ["llama-gqa", "qwen2-tied"] {
        let dir = model_dir(model);
        let config = ModelConfig::from_dir(&dir).unwrap();
        let shape = BackendShape {
            slots: 1,
            max_lora_rank: 16,
            kv_blocks: 8,
            block_size: 4,
        };
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
            // Blocks in a scattered order, to exercise the block table.
            let table: Vec<u32> = vec![5, 2, 7, 0, 3, 6, 1, 4];
            let mut batch = StepBatch::default();
            batch.push(&case.prompt_ids, 0, &table, slot, true);
            batch.finish();
            let logits = backend.forward(&batch).unwrap();
            let err = relative_error(&logits, &case.logits);
            assert!(
                err <= 1e-4,
                "{model}/{:?} {:?}: logits relative error {err}",
                case.adapter,
                case.prompt
            );

            let mut tokens = vec![argmax(&logits)];
            let mut pos = case.prompt_ids.len();
            while tokens.len() < case.greedy.len() && ![2, 4].contains(tokens.last().unwrap()) {
                let mut batch = StepBatch::default();
                batch.push(&[*tokens.last().unwrap()], pos, &table, slot, true);
                batch.finish();
                let logits = backend.forward(&batch).unwrap();
                tokens.push(argmax(&logits));
                pos += 1;
            }
            assert_eq!(
                tokens, case.greedy,
                "{model}/{:?} {:?}: greedy tokens",
                case.adapter, case.prompt
            );
            checked += 1;
        }
    }
    assert_eq!(checked, golden.cases.len());
}
