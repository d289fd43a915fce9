//! The adapter slots on the device and how adapters reach them.
//!
//! A slot write is off the step's critical path: the adapter is staged in
//! page-locked host memory and copied on a stream of its own, with an event
//! per slot. A step waits only for the slots its segments use, so a load
//! overlaps the steps that do not need it. The staging buffers are used in
//! turn; one is refilled only after its last copy finished.

use std::sync::Arc;

use cudarc::driver::{CudaEvent, CudaSlice, CudaStream, PinnedHostSlice};
use rayon::prelude::*;

use super::device::{Device, cuda};
use crate::backend::{BackendShape, Segment};
use crate::error::Result;
use crate::lora::{HostAdapter, Projection};
use crate::model::ModelConfig;

/// Staging buffers in turn: two, so one fills while the other is copied.
const STAGING: usize = 2;

/// Adapter slots of every (layer, projection): key `layer * 7 + proj`.
pub(super) struct Slots {
    pub max_rank: usize,
    slots: usize,
    /// A `[slots, max_rank, in]` and Bᵀ `[slots, max_rank, out]`, f32.
    pub a: Vec<CudaSlice<f32>>,
    pub b: Vec<CudaSlice<f32>>,
    /// `[key][slot]` on the device, mirrored on the host.
    pub rank: CudaSlice<i32>,
    pub scale: CudaSlice<f32>,
    rank_host: Vec<i32>,
    scale_host: Vec<f32>,
    /// The copy of each slot's last write still in flight, if any.
    ready: Vec<Option<CudaEvent>>,
    staging: [Option<Staged>; STAGING],
    next: usize,
    copy: Arc<CudaStream>,
}

/// A page-locked staging buffer and the end of its last copy.
struct Staged {
    host: PinnedHostSlice<f32>,
    done: Option<CudaEvent>,
}

impl Slots {
    pub fn new(dev: &Device, config: &ModelConfig, shape: &BackendShape) -> Result<Slots> {
        let c = config;
        let zeros = |n: usize| {
            dev.stream
                .alloc_zeros::<f32>(n)
                .map_err(cuda("allocating adapter slots"))
        };
        let max_rank = dev.shapes.max_rank;
        let mut a = Vec::with_capacity(c.num_layers * 7);
        let mut b = Vec::with_capacity(c.num_layers * 7);
        for _ in 0..c.num_layers {
            for p in Projection::ALL {
                let (fan_in, fan_out) = p.shape(c);
                a.push(zeros(shape.slots * max_rank * fan_in)?);
                b.push(zeros(shape.slots * max_rank * fan_out)?);
            }
        }
        let keys = c.num_layers * 7 * shape.slots;
        Ok(Slots {
            max_rank,
            slots: shape.slots,
            a,
            b,
            rank: dev
                .stream
                .alloc_zeros::<i32>(keys)
                .map_err(cuda("allocating adapter slots"))?,
            scale: zeros(keys)?,
            rank_host: vec![0; keys],
            scale_host: vec![0.0; keys],
            ready: (0..shape.slots).map(|_| None).collect(),
            staging: [None, None],
            next: 0,
            copy: dev
                .ctx
                .new_stream()
                .map_err(cuda("creating the copy stream"))?,
        })
    }

    /// Stages `adapter` and queues its copy into `slot` on the copy stream;
    /// returns before the copy is done. The slot's ranks and scales go on
    /// the compute stream at once: a step that does not use the slot never
    /// reads them, and one that does waits for the copy ([`Slots::wait_for`]).
    pub fn write(
        &mut self,
        dev: &Device,
        config: &ModelConfig,
        slot: usize,
        adapter: &HostAdapter,
    ) -> Result<()> {
        self.reset(slot);
        let max_rank = self.max_rank;
        // (key, projection, module) of every module present.
        let mut modules = Vec::new();
        for (layer, projs) in adapter.modules.iter().enumerate() {
            for p in Projection::ALL {
                if let Some(m) = &projs[p.index()] {
                    modules.push((layer * 7 + p.index(), p, m));
                }
            }
        }
        let floats: usize = modules
            .iter()
            .map(|(_, _, m)| {
                let (a, b) = m.factor_lens();
                a + b
            })
            .sum();
        let i = self.next;
        self.next = (self.next + 1) % STAGING;
        let mut staged = match self.staging[i].take() {
            Some(s) if s.host.len() >= floats => s,
            old => {
                // Too small (or none yet): a new one, once the old one's
                // copy no longer reads it.
                if let Some(Staged { done: Some(e), .. }) = &old {
                    e.synchronize().map_err(cuda("staging an adapter"))?;
                }
                drop(old);
                // SAFETY: every element read is written below first.
                let host = unsafe { dev.ctx.alloc_pinned::<f32>(floats.max(1)) }
                    .map_err(cuda("allocating page-locked staging memory"))?;
                Staged { host, done: None }
            }
        };
        if let Some(e) = staged.done.take() {
            e.synchronize().map_err(cuda("staging an adapter"))?;
        }
        let host = staged
            .host
            .as_mut_slice()
            .map_err(cuda("staging an adapter"))?;
        // Each module's A rows then Bᵀ rows, widened to f32 straight into
        // the page-locked buffer, modules in parallel.
        let mut copies = Vec::with_capacity(2 * modules.len());
        let mut parts = Vec::with_capacity(2 * modules.len());
        let mut rest = &mut host[..floats];
        let mut at = 0;
        for &(key, p, m) in &modules {
            let (fan_in, fan_out) = p.shape(config);
            let (a_len, b_len) = m.factor_lens();
            let (a, tail) = rest.split_at_mut(a_len);
            let (b, tail) = tail.split_at_mut(b_len);
            rest = tail;
            // Rows past the module's rank are never read.
            let a_dst = dev.p(&self.a[key]) + (slot * max_rank * fan_in * 4) as u64;
            copies.push((a_dst, at, a_len));
            let b_dst = dev.p(&self.b[key]) + (slot * max_rank * fan_out * 4) as u64;
            copies.push((b_dst, at + a_len, b_len));
            at += a_len + b_len;
            parts.push((m, a, b));
            self.rank_host[key * self.slots + slot] = m.rank as i32;
            self.scale_host[key * self.slots + slot] = m.scale;
        }
        parts.into_par_iter().for_each(|(m, a, b)| {
            m.write_a_f32(a);
            m.write_b_t_f32(b);
        });
        let host = &host[..at];
        for (dst, from, len) in copies {
            // SAFETY: the source is page-locked and stays untouched until
            // `done` completes; the destination lies inside the slot's
            // region of its buffer.
            unsafe {
                cudarc::driver::result::memcpy_htod_async(
                    dst,
                    &host[from..from + len],
                    self.copy.cu_stream(),
                )
            }
            .map_err(cuda("copying an adapter into its slot"))?;
        }
        let done = |s: &CudaStream| s.record_event(None).map_err(cuda("copying an adapter"));
        staged.done = Some(done(&self.copy)?);
        self.ready[slot] = Some(done(&self.copy)?);
        self.staging[i] = Some(staged);
        self.upload_ranks(dev)
    }

    pub fn clear(&mut self, dev: &Device, slot: usize) -> Result<()> {
        self.reset(slot);
        self.upload_ranks(dev)
    }

    /// Makes the compute stream wait for the copies into the slots that
    /// `segments` use, and only those.
    pub fn wait_for(&mut self, dev: &Device, segments: &[Segment]) -> Result<()> {
        for s in segments {
            if let Some(e) = &self.ready[s.slot] {
                if e.is_complete() {
                    self.ready[s.slot] = None;
                } else {
                    dev.stream
                        .wait(e)
                        .map_err(cuda("waiting for an adapter copy"))?;
                }
            }
        }
        Ok(())
    }

    /// Whether the copy of `slot`'s last write is still in flight.
    pub fn copy_in_flight(&self, slot: usize) -> bool {
        self.ready[slot].as_ref().is_some_and(|e| !e.is_complete())
    }

    /// The copy stream, for the tests' hooks.
    pub fn copy_stream(&self) -> &Arc<CudaStream> {
        &self.copy
    }

    /// The ranks of slice `key`, as an address the kernels read.
    pub fn rank_of(&self, dev: &Device, key: usize) -> u64 {
        dev.p(&self.rank) + (key * self.slots * 4) as u64
    }

    pub fn scale_of(&self, dev: &Device, key: usize) -> u64 {
        dev.p(&self.scale) + (key * self.slots * 4) as u64
    }

    /// Marks every module of `slot` absent on the host side. Rank 0 is what
    /// makes a module absent: the kernels read a slot only up to its rank,
    /// so its weights need not be zeroed.
    fn reset(&mut self, slot: usize) {
        for key in 0..self.rank_host.len() / self.slots {
            self.rank_host[key * self.slots + slot] = 0;
            self.scale_host[key * self.slots + slot] = 0.0;
        }
    }

    fn upload_ranks(&mut self, dev: &Device) -> Result<()> {
        dev.stream
            .memcpy_htod(&self.rank_host, &mut self.rank)
            .map_err(cuda("writing slot ranks"))?;
        dev.stream
            .memcpy_htod(&self.scale_host, &mut self.scale)
            .map_err(cuda("writing slot scales"))
    }
}
