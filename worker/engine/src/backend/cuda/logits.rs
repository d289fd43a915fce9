//! A step's logits: the base lm_head, then what the rows' adapters change
//! there (an own whole lm_head, lm_head LoRA, own token rows; `outer.rs`),
//! Gemma's final soft-cap, and for a step wider than the base's vocabulary
//! (an adapter's grown one) the rows as wide as the widest, -inf past each
//! row's own, the grown heads' GEMMs writing theirs.

use super::CudaBackend;
use super::device::{Arg, Device};
use crate::error::Result;

impl CudaBackend {
    /// The logits of the step's `rows` normed final hidden states
    /// (`normed` f32, `cast` the same rows in the weights' type where they
    /// are not f32) into the workspace's `[rows, vocab]`, and into the
    /// outer slots' wide ones where the step is wider.
    pub(super) fn logits(&self, normed: u64, cast: Option<u64>, rows: usize) -> Result<()> {
        let c = &self.config;
        let (d, vocab) = (c.hidden_size, c.vocab_size);
        let logits = self.dev.p(&self.ws.logits);
        let x = cast.unwrap_or(normed);
        let elem = if cast.is_some() {
            self.dtype.bytes()
        } else {
            4
        };
        self.linear(&self.lm_head, x, logits, rows)?;
        // An own whole lm_head's logits for its rows, the lm_head LoRA, an
        // own token rows' logits: in that order, as on the CPU backend.
        let step = &self.outer_step;
        let ty = self.dtype.cuda_type();
        for (w, _, lo, hi) in self.outer.whole_heads(step, false) {
            let y = logits + (lo * vocab * 4) as u64;
            self.gemm(w, ty, d, vocab, x + (lo * d * elem) as u64, y, hi - lo)?;
        }
        let h_rows = (normed, d);
        let h_part = self.dev.p(&self.ws.h_part);
        self.outer
            .head_lora(&self.dev, step, h_rows, (logits, vocab), h_part)?;
        self.outer
            .saved_logits(&self.dev, step, h_rows, (logits, vocab))?;
        let cap = c.gemma.as_ref().and_then(|g| g.final_logit_softcapping);
        self.softcap(cap, logits, rows * vocab)?;
        // A grown vocabulary's rows: as wide as the step, their own heads'
        // logits soft-capped as the base's were (-inf past them stays).
        let Some((width, wide)) = step.wide() else {
            return Ok(());
        };
        self.outer.widen(&self.dev, step, logits, rows)?;
        for (w, own, lo, hi) in self.outer.whole_heads(step, true) {
            let y = wide + (lo * width * 4) as u64;
            let x = x + (lo * d * elem) as u64;
            self.gemm_ld(w, ty, d, own, x, y, hi - lo, width)?;
            self.softcap(cap, y, (hi - lo) * width)?;
        }
        Ok(())
    }

    /// Gemma's soft-cap of `n` logits at `x`, in place (nothing without a
    /// cap).
    fn softcap(&self, cap: Option<f32>, x: u64, n: usize) -> Result<()> {
        let Some(cap) = cap else { return Ok(()) };
        self.dev.launch(
            "softcap",
            Device::elementwise_grid(n),
            256,
            &[Arg::Ptr(x), Arg::I64(n as i64), Arg::F32(cap)],
        )
    }
}
