//! Helpers for the tests that run on a GPU.

use lorafleet_engine::backend::cuda;
use lorafleet_engine::sampling::Rng;

use super::relative_error;

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
