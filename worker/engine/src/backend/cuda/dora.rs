//! DoRA and `lora_bias` on the GPU: which base rows a DoRA module's scales
//! come from, and which base bias its rows keep out of the scaling. The
//! scales themselves are computed on the device as the slot is written
//! (`slots.rs`, the kernels' `dora_scales`): from a dense projection's own
//! rows on the copy stream, or from a quantized one's rows dequantized
//! as its GEMMs dequantize them (PEFT dequantizes too), on the compute
//! stream after the slot's copy. The expand applies them.

use super::quant::QuantLinear;
use super::slots::DoraBase;
use super::step::{GATE_UP, QKV};
use super::{CudaBackend, Linear, Mlp, Weights};
use crate::error::{EngineError, Result};
use crate::lora::{HostAdapter, Projection};

/// A DoRA module on a quantized projection: its (key, layer, projection).
pub(super) type QuantizedDora = (usize, usize, Projection);

impl CudaBackend {
    /// The base linear layer that holds `p` of `layer` and the first of its
    /// rows that are `p`'s; None for a Mixture-of-Experts layer's MLP.
    pub(super) fn base_linear(&self, layer: usize, p: Projection) -> Option<(&Linear, usize)> {
        let l = &self.layers[layer];
        let c = &self.config;
        let first = |parts: &[Projection]| -> usize {
            parts
                .iter()
                .take_while(|q| **q != p)
                .map(|q| q.shape(c).1)
                .sum()
        };
        match p {
            Projection::Q | Projection::K | Projection::V => Some((&l.qkv, first(&QKV))),
            Projection::O => Some((&l.o, 0)),
            Projection::Gate | Projection::Up | Projection::Down => match &l.mlp {
                Mlp::Dense { gate_up, down } => Some(if p == Projection::Down {
                    (down, 0)
                } else {
                    (gate_up, first(&GATE_UP))
                }),
                Mlp::Moe(_) => None,
            },
        }
    }

    /// The address of `p`'s part of its base projection's bias, or 0.
    pub(super) fn base_bias(&self, layer: usize, p: Projection) -> u64 {
        match self.base_linear(layer, p) {
            Some((Linear { bias: Some(b), .. }, first)) => self.dev.p(b) + (first * 4) as u64,
            _ => 0,
        }
    }

    /// The base rows of each of `adapter`'s DoRA modules on a dense
    /// projection, and the (key, layer, projection) of those on a quantized
    /// one. A DoRA module on a Mixture-of-Experts MLP is refused by
    /// `use_dora`.
    pub(super) fn dora_bases(
        &self,
        adapter: &HostAdapter,
    ) -> Result<(Vec<DoraBase>, Vec<QuantizedDora>)> {
        let (mut bases, mut quantized) = (Vec::new(), Vec::new());
        for (layer, modules) in adapter.modules.iter().enumerate() {
            for (i, m) in modules.iter().enumerate() {
                if m.as_ref().is_none_or(|m| m.magnitude.is_none()) {
                    continue;
                }
                let p = Projection::ALL[i];
                let refuse = |why: &str| {
                    EngineError::Adapter(lorafleet_artifact::adapter::AdapterError::Unsupported {
                        adapter: adapter.name.clone(),
                        field: "use_dora".into(),
                        reason: format!("DoRA on layer {layer}'s {} {why}", p.module_name()),
                    })
                };
                let Some((lin, first)) = self.base_linear(layer, p) else {
                    return Err(refuse("(a Mixture-of-Experts MLP) is not supported"));
                };
                let Weights::Dense(w) = &lin.w else {
                    quantized.push((layer * 7 + i, layer, p));
                    continue;
                };
                bases.push(DoraBase {
                    key: layer * 7 + i,
                    w: self.dev.p(w) + (first * lin.fan_in * self.dtype.bytes()) as u64,
                    fan_in: lin.fan_in,
                });
            }
        }
        Ok((bases, quantized))
    }

    /// DoRA's scales of `slot`'s modules on quantized projections
    /// (`quantized` from [`CudaBackend::dora_bases`]), on the compute
    /// stream after the slot's copy: each projection's parts dequantized
    /// in turn into a scratch in the weights' type, the module's rows read
    /// from the part that holds them.
    pub(super) fn quantized_dora_scales(
        &self,
        slot: usize,
        quantized: &[QuantizedDora],
    ) -> Result<()> {
        if quantized.is_empty() {
            return Ok(());
        }
        let dev = &self.dev;
        self.slots.wait_for_slot(dev, slot)?;
        let elem = self.dtype.bytes();
        for &(key, layer, p) in quantized {
            let Some((lin, first)) = self.base_linear(layer, p) else {
                continue;
            };
            let Weights::Quantized(q) = &lin.w else {
                continue;
            };
            let q: &QuantLinear = q;
            let (fan_in, width) = (lin.fan_in, p.shape(&self.config).1);
            let scratch = dev
                .stream
                .alloc_zeros::<u8>((q.largest_part() * fan_in * elem).max(1))
                .map_err(super::device::cuda("dequantizing a projection for DoRA"))?;
            let at = dev.p(&scratch);
            q.dequantized(dev, fan_in, at, |rows, offset| {
                if first < offset || first + width > offset + rows {
                    return Ok(());
                }
                let w = at + ((first - offset) * fan_in * elem) as u64;
                self.slots
                    .dora_scales(dev, &dev.stream, slot, &[DoraBase { key, w, fan_in }])
            })?;
        }
        Ok(())
    }
}
