//! DoRA and `lora_bias` on the GPU: which base rows a DoRA module's scales
//! come from, and which base bias its rows keep out of the scaling. The
//! scales themselves are computed on the device as the slot is written
//! (`slots.rs`, the kernels' `dora_scales`); the expand applies them.

use super::slots::DoraBase;
use super::step::{GATE_UP, QKV};
use super::{CudaBackend, Linear, Mlp, Weights};
use crate::error::{EngineError, Result};
use crate::lora::{HostAdapter, Projection};

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

    /// The base rows of each of `adapter`'s DoRA modules. A DoRA module on
    /// a quantized projection, or on a Mixture-of-Experts MLP, is refused
    /// by `use_dora`.
    pub(super) fn dora_bases(&self, adapter: &HostAdapter) -> Result<Vec<DoraBase>> {
        let mut bases = Vec::new();
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
                    return Err(refuse(
                        "(a quantized projection) is not served by the CUDA backend yet \
                         (the CPU backend serves it)",
                    ));
                };
                bases.push(DoraBase {
                    key: layer * 7 + i,
                    w: self.dev.p(w) + (first * lin.fan_in * self.dtype.bytes()) as u64,
                    fan_in: lin.fan_in,
                });
            }
        }
        Ok(bases)
    }
}
