//! One token's attention over its cached positions, in a fixed order.

use super::panels::Kernel;

/// A dot product with a fixed order: eight interleaved partial sums, then
/// the tail. The order depends only on the length.
#[inline(always)]
pub(super) fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let chunks = a.len() / 8;
    for i in 0..chunks {
        let (x, y) = (&a[i * 8..i * 8 + 8], &b[i * 8..i * 8 + 8]);
        for j in 0..8 {
            acc[j] += x[j] * y[j];
        }
    }
    let mut tail = 0f32;
    for i in chunks * 8..a.len() {
        tail += a[i] * b[i];
    }
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + tail
}

/// One token's attention over its cached positions, every head.
pub(super) struct AttentionRow<'a> {
    /// The token's query, `[heads * head_dim]`.
    pub(super) q: &'a [f32],
    pub(super) k_cache: &'a [f32],
    pub(super) v_cache: &'a [f32],
    /// Where each attended position's keys and values start, in position
    /// order.
    pub(super) offsets: &'a [usize],
    pub(super) heads: usize,
    /// Query heads per key-value head.
    pub(super) group: usize,
    pub(super) head_dim: usize,
    pub(super) scale: f32,
    /// `tanh(s / cap) · cap` on each scaled score (Gemma 2).
    pub(super) softcap: Option<f32>,
    /// Each head's sink logit (GPT-OSS): it joins the softmax's maximum
    /// and sum, after the keys, and weighs no value.
    pub(super) sinks: Option<&'a [f32]>,
}

impl AttentionRow<'_> {
    /// Writes the attention output into `out` (`[heads * head_dim]`, zeroed).
    pub(super) fn attend(&self, kernel: Kernel, out: &mut [f32]) {
        match kernel {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `detect` chose an x86 kernel only where the CPU has AVX2.
            #[allow(unsafe_code)]
            Kernel::Avx2 | Kernel::Avx512 => unsafe { self.attend_avx2(out) },
            _ => self.attend_with(out),
        }
    }

    /// The same code compiled for AVX2: `dot`'s eight partial sums become
    /// one vector, and the weighted sum of values runs eight lanes at a
    /// time. Rust never fuses a multiply and an add on its own, so every
    /// value is the same bits as in the baseline build.
    ///
    /// # Safety
    /// The CPU has AVX2.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    #[allow(unsafe_code)]
    unsafe fn attend_avx2(&self, out: &mut [f32]) {
        self.attend_with(out)
    }

    #[inline(always)]
    pub(super) fn attend_with(&self, out: &mut [f32]) {
        debug_assert!(out.iter().all(|&v| v == 0.0), "the output starts at zero");
        let hd = self.head_dim;
        let mut scores = vec![0f32; self.offsets.len()];
        for h in 0..self.heads {
            let kv = (h / self.group) * hd;
            let qh = &self.q[h * hd..(h + 1) * hd];
            let mut max = f32::NEG_INFINITY;
            for (sc, &at) in scores.iter_mut().zip(self.offsets) {
                *sc = dot(qh, &self.k_cache[at + kv..at + kv + hd]) * self.scale;
                if let Some(cap) = self.softcap {
                    *sc = (*sc / cap).tanh() * cap;
                }
                max = max.max(*sc);
            }
            let sink = self.sinks.map(|s| s[h]);
            if let Some(s) = sink {
                max = max.max(s);
            }
            let mut sum = 0f32;
            for sc in scores.iter_mut() {
                *sc = (*sc - max).exp();
                sum += *sc;
            }
            if let Some(s) = sink {
                sum += (s - max).exp();
            }
            let oh = &mut out[h * hd..(h + 1) * hd];
            for (&sc, &at) in scores.iter().zip(self.offsets) {
                let w = sc / sum;
                for (o, &v) in oh.iter_mut().zip(&self.v_cache[at + kv..at + kv + hd]) {
                    *o += w * v;
                }
            }
        }
    }
}
