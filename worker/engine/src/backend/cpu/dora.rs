//! DoRA's scale of each output row, `m / ‖W + s·B·A‖`, from the base
//! weights as this backend holds them, computed once when a slot is
//! written: `‖W_o‖²` (kept per projection, the base's own), plus `2s ·
//! Σ_r B[o, r] (A·Wᵀ)[r, o]` (one projection of the rank's rows of A
//! through the base weights' own kernel) plus `s² · B_oᵀ (A·Aᵀ) B_o`, in
//! f64. The same value as [`LoraModule::dora_scales`]'s direct sum over
//! `W + s·B·A` (unit test), at the cost of `rank` tokens through the
//! projection instead of `rank` multiply-adds per weight.

use std::collections::VecDeque;
use std::sync::Arc;

use super::panels::PackedLinear;
use crate::backend::StepBatch;
use crate::error::{EngineError, Result};
use crate::lora::{HostAdapter, LoraModule, Projection};

/// One adapter's DoRA scales: `(layer * 7 + projection, scale of each row)`.
pub(super) type Scales = Arc<Vec<(usize, Vec<f32>)>>;

/// The DoRA scales of the adapters written to slots most recently, by
/// artifact digest: they depend only on the adapter and this backend's
/// base, so an adapter evicted and written again takes them from here.
#[derive(Debug, Default)]
pub(super) struct ScaleCache {
    entries: VecDeque<(String, Scales)>,
    capacity: usize,
    /// Adapters whose scales were computed (not taken from the cache).
    pub computed: u64,
}

impl ScaleCache {
    pub fn new(capacity: usize) -> ScaleCache {
        ScaleCache {
            capacity: capacity.max(1),
            ..Default::default()
        }
    }

    /// The scales cached for `digest`, now the most recent.
    pub fn get(&mut self, digest: &str) -> Option<Scales> {
        let at = self.entries.iter().position(|(d, _)| d == digest)?;
        let entry = self.entries.remove(at)?;
        let scales = entry.1.clone();
        self.entries.push_back(entry);
        Some(scales)
    }

    /// Keeps `scales` for `digest`, giving up the least recent past the
    /// capacity.
    pub fn put(&mut self, digest: String, scales: Scales) {
        self.entries.retain(|(d, _)| *d != digest);
        self.entries.push_back((digest, scales));
        while self.entries.len() > self.capacity {
            self.entries.pop_front();
        }
    }
}

/// `‖W_o‖²` of rows `first..first + out` of `lin`.
pub(super) fn row_norms(lin: &PackedLinear, first: usize, out: usize) -> Vec<f64> {
    let mut row = vec![0f32; lin.fan_in()];
    (0..out)
        .map(|o| {
            lin.row(first + o, &mut row);
            row.iter().map(|&w| f64::from(w) * f64::from(w)).sum()
        })
        .collect()
}

/// The scales of `m`'s rows, its part's rows starting at `first` of `lin`
/// with `w_sq` their [`row_norms`]; `None` for a plain LoRA module.
pub(super) fn scales(
    m: &LoraModule,
    lin: &PackedLinear,
    first: usize,
    w_sq: &[f64],
) -> Option<Vec<f32>> {
    let magnitude = m.magnitude.as_ref()?;
    let (out, fan_in, rank) = (magnitude.len(), lin.fan_in(), m.rank.max(1));
    let a = m.a_f32();
    let b_t = m.b_t_f32();
    let products = lin.products(&a, rank);
    let row = |r: usize| &a[r * fan_in..(r + 1) * fan_in];
    let gram: Vec<f64> = (0..rank * rank)
        .map(|i| {
            row(i / rank)
                .iter()
                .zip(row(i % rank))
                .map(|(&x, &y)| f64::from(x) * f64::from(y))
                .sum()
        })
        .collect();
    let s = f64::from(m.scale);
    Some(
        (0..out)
            .map(|o| {
                let b = |r: usize| f64::from(b_t[r * out + o]);
                let cross: f64 = (0..rank)
                    .map(|r| b(r) * f64::from(products[r * lin.fan_out() + first + o]))
                    .sum();
                let lora: f64 = (0..rank)
                    .map(|r| {
                        (0..rank)
                            .map(|q| b(r) * gram[r * rank + q] * b(q))
                            .sum::<f64>()
                    })
                    .sum();
                let squared = w_sq[o] + 2.0 * s * cross + s * s * lora;
                magnitude[o] / squared.max(0.0).sqrt() as f32
            })
            .collect(),
    )
}

impl super::CpuBackend {
    /// DoRA: each DoRA segment's rows of `out` (the base output with its
    /// LoRA delta added) become `b + scale ⊙ (out - b)`, PEFT's `base +
    /// (scale - 1)·(base - b) + scale·s·B·A·x`.
    pub(super) fn apply_dora(
        &self,
        batch: &StepBatch<'_>,
        layer: usize,
        p: Projection,
        bias: Option<&[f32]>,
        out: &mut [f32],
    ) {
        let key = layer * 7 + p.index();
        let width = p.shape(&self.config).1;
        for seg in &batch.segments {
            let Some(scales) = &self.slots.dora[seg.slot][key] else {
                continue;
            };
            for row in out[seg.start * width..seg.end * width].chunks_exact_mut(width) {
                for (o, v) in row.iter_mut().enumerate() {
                    let b = bias.map_or(0.0, |b| b[o]);
                    *v = b + scales[o] * (*v - b);
                }
            }
        }
    }

    /// Every DoRA module's scales of `adapter` (see the module docs).
    pub(super) fn dora_scales(&self, adapter: &HostAdapter) -> Result<Scales> {
        let mut all = Vec::new();
        for (layer, modules) in adapter.modules.iter().enumerate() {
            for (i, m) in modules.iter().enumerate() {
                let Some(m) = m.as_ref().filter(|m| m.magnitude.is_some()) else {
                    continue;
                };
                let p = Projection::ALL[i];
                let Some((lin, first)) = self.base_linear(layer, p) else {
                    return Err(EngineError::Adapter(
                        lorafleet_artifact::adapter::AdapterError::Unsupported {
                            adapter: adapter.name.clone(),
                            field: "use_dora".into(),
                            reason: format!(
                                "DoRA on layer {layer}'s {} (a Mixture-of-Experts MLP) is not supported",
                                p.module_name()
                            ),
                        },
                    ));
                };
                let out = p.shape(&self.config).1;
                let w_sq =
                    self.base_row_norms[layer * 7 + i].get_or_init(|| row_norms(lin, first, out));
                if let Some(s) = scales(m, lin, first, w_sq) {
                    all.push((layer * 7 + i, s));
                }
            }
        }
        Ok(std::sync::Arc::new(all))
    }

    /// Adapters whose DoRA scales were computed rather than taken from the
    /// cache, since the backend was made.
    pub fn dora_scales_computed(&self) -> u64 {
        self.dora_cache.computed
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lora::Factors;

    #[test]
    fn the_expanded_norm_is_the_direct_sum_over_the_adapted_weight() {
        let (fan_in, fan_out, rank, first, out) = (40, 24, 3, 8, 10);
        let mut seed = 7u64;
        let mut draw = || {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((seed >> 33) as f32 / (1u64 << 31) as f32) - 0.5
        };
        let w: Vec<f32> = (0..fan_in * fan_out).map(|_| draw()).collect();
        let lin = PackedLinear::pack(&w, None, fan_in, fan_out);
        let a_t: Vec<f32> = (0..fan_in * rank).map(|_| draw()).collect();
        let b_t: Vec<f32> = (0..rank * out).map(|_| draw()).collect();
        let m = LoraModule {
            rank,
            scale: 1.5,
            factors: Factors::F32 { a_t, b_t },
            magnitude: Some((0..out).map(|i| 1.0 + i as f32 / 10.0).collect()),
            bias: None,
        };
        let direct = m
            .dora_scales(fan_in, |o, row| lin.row(first + o, row))
            .unwrap();
        let fast = scales(&m, &lin, first, &row_norms(&lin, first, out)).unwrap();
        for (d, f) in direct.iter().zip(&fast) {
            assert!((d - f).abs() <= 1e-5 * d.abs(), "{direct:?} {fast:?}");
        }
        // A plain module has none.
        let plain = LoraModule {
            magnitude: None,
            ..m.clone()
        };
        assert!(scales(&plain, &lin, first, &[]).is_none());
    }
}
