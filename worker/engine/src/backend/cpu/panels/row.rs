//! One output's weights read back out of the panels, exactly as the
//! projection uses them: a model whose lm_head is tied to its token
//! embeddings looks its embedding rows up here, so the table is held once.
//! And the weights' products with vectors that are not activations (a
//! DoRA adapter's A, for the norms of `W + s·B·A`).

use super::{Kernel, NR, PackedLinear, Panels, SharedOut, amx, bf16_to_f32};

impl PackedLinear {
    /// Writes the `fan_in` weights of output `o` to `out`.
    pub fn row(&self, o: usize, out: &mut [f32]) {
        assert!(o < self.fan_out, "output {o} of {}", self.fan_out);
        assert_eq!(out.len(), self.fan_in, "a row of fan_in");
        let (p, j) = (o / NR, o % NR);
        match &self.panels {
            Panels::F32(all) => {
                let panel = &all[p * self.fan_in * NR..][..self.fan_in * NR];
                for (k, v) in out.iter_mut().enumerate() {
                    *v = panel[k * NR + j];
                }
            }
            Panels::Bf16(all) => {
                let kpad = amx::padded(self.fan_in);
                let panel = &all[p * kpad * NR..][..kpad * NR];
                for (k, v) in out.iter_mut().enumerate() {
                    *v = bf16_to_f32(panel[(k / 2) * 2 * NR + 2 * j + k % 2]);
                }
            }
            Panels::Quant(q) => q.column(p, j, out),
        }
    }

    /// `x·Wᵀ` for the `n` rows of `x`, `[n, fan_out]`: the weights as the
    /// projection holds them, with neither the bias nor the inputs'
    /// quantization.
    pub fn products(&self, x: &[f32], n: usize) -> Vec<f32> {
        let mut y: Vec<f32> = Vec::with_capacity(n * self.fan_out);
        let parts = [(self.fan_out, SharedOut(y.as_mut_ptr()))];
        self.fill(Kernel::detect(), amx::available(), x, n, &parts, true, true);
        // SAFETY: the capacity is n * fan_out, and `fill` returned, so it
        // wrote every row of every column.
        #[allow(unsafe_code)]
        unsafe {
            y.set_len(n * self.fan_out)
        };
        y
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_row_reads_back_the_weights_it_was_packed_from() {
        let (fan_in, fan_out) = (37, 21);
        let w: Vec<f32> = (0..fan_in * fan_out)
            .map(|i| i as f32 / 8.0 - 40.0)
            .collect();
        let bits: Vec<u16> = w
            .iter()
            .map(|v| half::bf16::from_f32(*v).to_bits())
            .collect();
        let f32_lin = PackedLinear::pack(&w, None, fan_in, fan_out);
        let bf16_lin = PackedLinear::pack_bf16(&bits, None, fan_in, fan_out);
        let mut row = vec![0f32; fan_in];
        for o in 0..fan_out {
            f32_lin.row(o, &mut row);
            assert_eq!(row, w[o * fan_in..][..fan_in]);
            bf16_lin.row(o, &mut row);
            let want: Vec<f32> = bits[o * fan_in..][..fan_in]
                .iter()
                .map(|&b| bf16_to_f32(b))
                .collect();
            assert_eq!(row, want);
        }
    }
}
