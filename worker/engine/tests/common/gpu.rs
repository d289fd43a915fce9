//! Helpers for the tests that run on a GPU.

use lorafleet_engine::backend::cuda;
use lorafleet_engine::sampling::Rng;

use lorafleet_engine::backend::{Backend, StepBatch};
use lorafleet_engine::lora::{AdapterLimits, HostAdapter};
use lorafleet_engine::model::ModelConfig;
use lorafleet_engine::sampling;

use super::{GoldenCase, adapter_dir, relative_error};

/// Fails the test, saying why, unless a CUDA device is usable. The GPU
/// tests are `#[ignore]`d, so a machine without one reports them as
/// ignored; `deploy/gpu-check.sh` runs them with `--include-ignored`.
pub fn require_gpu() {
    if let Err(e) = cuda::probe() {
        panic!("this test needs a CUDA GPU: {e}");
    }
}

pub fn random(seed: u64, n: usize) -> Vec<f32> {
    let mut rng = Rng::new(seed);
    (0..n).map(|_| rng.next_f64() as f32 * 2.0 - 1.0).collect()
}

pub fn poison(n: usize) -> Vec<f32> {
    vec![f32::NAN; n]
}

/// Every value written (no NaN left from the poison) and within `tol`
/// relative error (max |a - b| / max |b|).
pub fn assert_close(got: &[f32], want: &[f32], tol: f32, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    if let Some(i) = got.iter().position(|v| !v.is_finite()) {
        panic!("{what}: element {i} is {} (not written?)", got[i]);
    }
    let err = relative_error(got, want);
    assert!(err <= tol, "{what}: relative error {err} above {tol}");
}

pub fn load_adapter(config: &ModelConfig, model: &str, name: &str) -> HostAdapter {
    let limits = AdapterLimits {
        model: config,
        max_lora_rank: 16,
        base_hash_check: None,
    };
    HostAdapter::load(name, &adapter_dir(model, name), limits).unwrap()
}

/// A golden case through one backend, one sequence at a time: the last
/// prompt position's logits and the greedy continuation, the case's
/// adapter (one of `model`'s fixture adapters) in slot 1.
pub fn run_golden(
    backend: &mut dyn Backend,
    model: &str,
    case: &GoldenCase,
) -> (Vec<f32>, Vec<u32>) {
    let config = backend.config().clone();
    let slot = case.adapter.as_ref().map(|name| {
        backend
            .write_slot(1, &load_adapter(&config, model, name))
            .unwrap();
        1
    });
    let table = super::scattered_table(super::golden_blocks(case));
    let mut batch = StepBatch::default();
    batch.push(&case.prompt_ids, 0, &table, slot, true);
    batch.finish();
    let first = backend.forward(&batch).unwrap();
    let mut tokens = vec![sampling::argmax(&first)];
    let mut pos = case.prompt_ids.len();
    while tokens.len() < case.greedy.len() && ![2, 4].contains(tokens.last().unwrap()) {
        let mut batch = StepBatch::default();
        batch.push(&[*tokens.last().unwrap()], pos, &table, slot, true);
        batch.finish();
        tokens.push(sampling::argmax(&backend.forward(&batch).unwrap()));
        pos += 1;
    }
    (first, tokens)
}
