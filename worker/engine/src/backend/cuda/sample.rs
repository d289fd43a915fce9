//! Sampling on the device: one token per row of the last forward's logits.

use super::CudaBackend;
use super::device::{Arg, cuda};
use crate::error::{EngineError, Result};

use crate::backend::DeviceSample;

impl CudaBackend {
    /// Samples one token per row of the last forward's logits, on the
    /// device. Greedy rows take the highest logit (the lowest id among
    /// ties, as the CPU's `argmax`); the others draw with their own `u`.
    pub fn sample_last(&mut self, rows: &[DeviceSample]) -> Result<Vec<u32>> {
        let Some(n) = self.last_logits else {
            return Err(EngineError::Backend(
                "cuda: no logits to sample from".into(),
            ));
        };
        if rows.len() != n {
            return Err(EngineError::Backend(format!(
                "cuda: {} sampling rows for {n} rows of logits",
                rows.len()
            )));
        }
        let vocab = self.config.vocab_size as i32;
        let logits = self.dev.p(&self.ws.logits);
        let upload_f32 = |v: Vec<f32>| self.dev.stream.clone_htod(&v).map_err(cuda("sampling"));
        let greedy_out = self.ws.picked.slice(0..rows.len());
        self.dev.launch(
            "argmax_rows",
            (rows.len() as u32, 1, 1),
            256,
            &[
                Arg::Ptr(logits),
                Arg::I32(vocab),
                Arg::Ptr(self.dev.p(&self.ws.picked)),
            ],
        )?;
        let mut picked = self
            .dev
            .stream
            .clone_dtoh(&greedy_out)
            .map_err(cuda("sampling"))?;
        if rows.iter().any(|r| r.temperature > 0.0) {
            let temperature = upload_f32(
                rows.iter()
                    .map(|r| {
                        if r.temperature > 0.0 {
                            r.temperature
                        } else {
                            1.0
                        }
                    })
                    .collect(),
            )?;
            let top_k: Vec<i32> = rows.iter().map(|r| r.top_k as i32).collect();
            let top_k = self
                .dev
                .stream
                .clone_htod(&top_k)
                .map_err(cuda("sampling"))?;
            let top_p = upload_f32(rows.iter().map(|r| r.top_p).collect())?;
            let u = upload_f32(rows.iter().map(|r| r.u).collect())?;
            // A row the kernel leaves unwritten stays -1 and is refused.
            let out = self
                .dev
                .stream
                .clone_htod(&vec![-1i32; rows.len()])
                .map_err(cuda("sampling"))?;
            self.dev.launch(
                "sample_rows",
                (rows.len() as u32, 1, 1),
                1024,
                &[
                    Arg::Ptr(logits),
                    Arg::I32(vocab),
                    Arg::Ptr(self.dev.p(&temperature)),
                    Arg::Ptr(self.dev.p(&top_k)),
                    Arg::Ptr(self.dev.p(&top_p)),
                    Arg::Ptr(self.dev.p(&u)),
                    Arg::Ptr(self.dev.p(&out)),
                ],
            )?;
            let drawn = self.dev.stream.clone_dtoh(&out).map_err(cuda("sampling"))?;
            for (i, r) in rows.iter().enumerate() {
                if r.temperature > 0.0 {
                    picked[i] = drawn[i];
                }
            }
        }
        picked
            .into_iter()
            .map(|t| {
                u32::try_from(t)
                    .map_err(|_| EngineError::Backend(format!("cuda: sampling produced token {t}")))
            })
            .collect()
    }
}
