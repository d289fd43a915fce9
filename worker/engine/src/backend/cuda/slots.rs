//! The adapter slots on the device and how adapters reach them.
//!
//! Every slot is one contiguous image holding the A and Bᵀ of every (layer,
//! projection), each sized for the slot rank, in the base weights' type.
//! A slot write is off the step's critical path and is one copy: the
//! adapter is laid out as that image in page-locked host memory and copied
//! on a stream of its own, with an event per slot. A step waits only for
//! the slots its segments use, so a load overlaps the steps that do not
//! need it. The staging buffers are used in turn; one is refilled only
//! after its last copy finished.
//!
//! Beside the images, each slot has f32 vectors of every (layer,
//! projection), `[g | c]` of its width: DoRA's scale of each output row
//! (`g`, computed on the device as the slot is written, from its magnitude
//! and the base's rows) and `lora_bias`'s `s·b_B` (`c`), read by the expand
//! where the slot's flags of that key say so. An adapter with neither
//! copies none of them.

use std::sync::Arc;

use cudarc::driver::{CudaEvent, CudaSlice, CudaStream, PinnedHostSlice};
use rayon::prelude::*;

use super::Dtype;
use super::device::{Device, cuda};
use crate::backend::{BackendShape, Segment};
use crate::error::Result;
use crate::lora::{HostAdapter, LoraModule, Projection};

/// A slot's flag of one (layer, projection): its rows are scaled by DoRA's
/// `g` (see the kernels' `lora_expand`).
pub(super) const FLAG_DORA: i32 = 1;
/// Its rows get `lora_bias`'s `c`.
pub(super) const FLAG_BIAS: i32 = 2;

/// The base rows one DoRA module's scales are computed from: the
/// projection's rows of a dense weight, `[width, fan_in]` in the weights'
/// type at `w`.
#[derive(Debug, Clone, Copy)]
pub(super) struct DoraBase {
    pub key: usize,
    pub w: u64,
    pub fan_in: usize,
}
use crate::model::ModelConfig;

/// Staging buffers in turn: two, so one fills while the other is copied.
const STAGING: usize = 2;

/// Adapter slots of every (layer, projection): key `layer * 7 + proj`.
pub(super) struct Slots {
    pub max_rank: usize,
    slots: usize,
    /// The type the slots hold: the base weights' (the kernels widen it to
    /// f32 as they read). bf16 halves the bytes a write copies against f32.
    dtype: Dtype,
    /// `slots` images of `stride` values each.
    data: CudaSlice<u8>,
    /// Values in one slot's image.
    pub stride: usize,
    /// Where each key's A `[max_rank, in]` and Bᵀ `[max_rank, out]` start
    /// in an image, in values.
    a_at: Vec<usize>,
    b_at: Vec<usize>,
    /// `[key][slot]` on the device, mirrored on the host.
    pub rank: CudaSlice<i32>,
    pub scale: CudaSlice<f32>,
    rank_host: Vec<i32>,
    scale_host: Vec<f32>,
    /// `[key][slot]` flags ([`FLAG_DORA`], [`FLAG_BIAS`]), mirrored.
    flags: CudaSlice<i32>,
    flags_host: Vec<i32>,
    /// `slots` vector images of `v_stride` f32 each; key k's `[g | c]`
    /// start at `v_at[k]`.
    vectors: CudaSlice<f32>,
    pub v_stride: usize,
    v_at: Vec<usize>,
    widths: Vec<usize>,
    /// Each slot's projections (bit `Projection::index`) that some layer
    /// of its adapter has: a step launches LoRA work for the projections
    /// its slots have, and no other.
    kinds: Vec<u8>,
    /// The copy of each slot's last write still in flight, if any.
    ready: Vec<Option<CudaEvent>>,
    staging: [Option<Staged>; STAGING],
    next: usize,
    copy: Arc<CudaStream>,
}

/// A page-locked staging buffer and the end of its last copy.
struct Staged {
    host: PinnedHostSlice<u8>,
    done: Option<CudaEvent>,
}

impl Slots {
    pub fn new(dev: &Device, config: &ModelConfig, shape: &BackendShape) -> Result<Slots> {
        let c = config;
        let max_rank = dev.shapes.max_rank;
        let dtype = dev.shapes.slot_dtype;
        let (mut a_at, mut b_at) = (Vec::new(), Vec::new());
        let mut stride = 0;
        for _ in 0..c.num_layers {
            for p in Projection::ALL {
                let (fan_in, fan_out) = p.shape(c);
                a_at.push(stride);
                stride += max_rank * fan_in;
                b_at.push(stride);
                stride += max_rank * fan_out;
            }
        }
        let (v_at, widths, v_stride) = vector_layout(c);
        let keys = c.num_layers * 7 * shape.slots;
        let alloc = "allocating adapter slots";
        Ok(Slots {
            max_rank,
            slots: shape.slots,
            dtype,
            data: dev
                .stream
                .alloc_zeros::<u8>((shape.slots * stride * dtype.bytes()).max(1))
                .map_err(cuda(alloc))?,
            stride,
            a_at,
            b_at,
            rank: dev.stream.alloc_zeros::<i32>(keys).map_err(cuda(alloc))?,
            scale: dev.stream.alloc_zeros::<f32>(keys).map_err(cuda(alloc))?,
            rank_host: vec![0; keys],
            scale_host: vec![0.0; keys],
            flags: dev.stream.alloc_zeros::<i32>(keys).map_err(cuda(alloc))?,
            flags_host: vec![0; keys],
            vectors: dev
                .stream
                .alloc_zeros::<f32>((shape.slots * v_stride).max(1))
                .map_err(cuda(alloc))?,
            v_stride,
            v_at,
            widths,
            kinds: vec![0; shape.slots],
            ready: (0..shape.slots).map(|_| None).collect(),
            staging: [None, None],
            next: 0,
            copy: dev
                .ctx
                .new_stream()
                .map_err(cuda("creating the copy stream"))?,
        })
    }

    /// Slot 0's A of `key`, as an address the kernels read.
    pub fn a_of(&self, dev: &Device, key: usize) -> u64 {
        dev.p(&self.data) + (self.a_at[key] * self.dtype.bytes()) as u64
    }

    /// Slot 0's Bᵀ of `key`.
    pub fn b_of(&self, dev: &Device, key: usize) -> u64 {
        dev.p(&self.data) + (self.b_at[key] * self.dtype.bytes()) as u64
    }

    /// Lays `adapter` out as a slot image in page-locked memory and queues
    /// its copy into `slot` on the copy stream, as one copy; returns before
    /// the copy is done. The slot's ranks and scales go on the compute
    /// stream at once: a step that does not use the slot never reads them,
    /// and one that does waits for the copy ([`Slots::wait_for`]). Rows
    /// past a module's rank, and modules the adapter lacks, are copied as
    /// whatever the staging buffer held: their rank keeps them unread.
    ///
    /// An adapter with DoRA or `lora_bias` modules also copies the slot's
    /// vectors (magnitudes and `s·b_B`), after the image on the same
    /// stream, and each DoRA module's scales are then computed in place
    /// from `dora`'s base rows (one for each of its DoRA modules), before
    /// the slot's ready event.
    pub fn write(
        &mut self,
        dev: &Device,
        slot: usize,
        adapter: &HostAdapter,
        dora: &[DoraBase],
    ) -> Result<()> {
        self.reset(slot);
        let elem = self.dtype.bytes();
        let image = self.stride * elem;
        // The vectors after the image, 16-byte aligned.
        let v_from = image.next_multiple_of(16);
        let has_vectors = adapter.is_dora() || adapter.has_lora_bias();
        let len = if has_vectors {
            v_from + self.v_stride * 4
        } else {
            image
        };
        let i = self.next;
        self.next = (self.next + 1) % STAGING;
        let mut staged = match self.staging[i].take() {
            Some(s) if s.host.len() >= len => s,
            old => {
                // Too small (or none yet): a new one, once the old one's
                // copy no longer reads it.
                if let Some(Staged { done: Some(e), .. }) = &old {
                    e.synchronize().map_err(cuda("staging an adapter"))?;
                }
                drop(old);
                // SAFETY: bytes are plain data; what is never written is
                // never read (see above).
                let host = unsafe { dev.ctx.alloc_pinned::<u8>(len.max(4)) }
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
        // Each present module's A rows and Bᵀ rows, in the slots' type, at
        // their places in the image, modules in parallel. Keys ascend with
        // the image's offsets, so the image splits into disjoint pieces.
        // The vectors' part starts at `v_from` (the image's end with no
        // vectors): what `put_vectors` writes at its offsets is what the
        // second copy sends.
        let (host, vectors) = host[..len].split_at_mut(v_from.min(len));
        let mut parts = Vec::new();
        let mut rest = host;
        let mut at = 0;
        for (layer, projs) in adapter.modules.iter().enumerate() {
            for p in Projection::ALL {
                let Some(m) = &projs[p.index()] else {
                    continue;
                };
                let key = layer * 7 + p.index();
                let (a_len, b_len) = m.factor_lens();
                let (_, tail) = rest.split_at_mut((self.a_at[key] - at) * elem);
                let (a, tail) = tail.split_at_mut(a_len * elem);
                let (_, tail) = tail.split_at_mut((self.b_at[key] - self.a_at[key] - a_len) * elem);
                let (b, tail) = tail.split_at_mut(b_len * elem);
                rest = tail;
                at = self.b_at[key] + b_len;
                parts.push((m, a, b));
                self.rank_host[key * self.slots + slot] = m.rank as i32;
                self.scale_host[key * self.slots + slot] = m.scale;
                if m.rank > 0 {
                    self.kinds[slot] |= 1 << p.index();
                }
                if has_vectors {
                    self.flags_host[key * self.slots + slot] =
                        put_vectors(self.v_at[key], self.widths[key], m, vectors);
                }
            }
        }
        let dtype = self.dtype;
        parts
            .into_par_iter()
            .for_each(|(m, a, b)| encode_module(m, dtype, a, b));
        let dst = dev.p(&self.data) + (slot * image) as u64;
        let host = staged
            .host
            .as_mut_slice()
            .map_err(cuda("staging an adapter"))?;
        // SAFETY: the source is page-locked and stays untouched until
        // `done` completes; the destination is the slot's image.
        unsafe {
            cudarc::driver::result::memcpy_htod_async(dst, &host[..image], self.copy.cu_stream())
        }
        .map_err(cuda("copying an adapter into its slot"))?;
        if has_vectors {
            let dst = self.vectors_of(dev, slot);
            // SAFETY: as the image's copy; the destination is the slot's
            // vectors.
            unsafe {
                cudarc::driver::result::memcpy_htod_async(
                    dst,
                    &host[v_from..len],
                    self.copy.cu_stream(),
                )
            }
            .map_err(cuda("copying an adapter's vectors into its slot"))?;
            let copy = Arc::clone(&self.copy);
            self.dora_scales(dev, &copy, slot, dora)?;
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

    /// The projections (bit `Projection::index`) that the adapters in
    /// the slots `segments` use have in some layer.
    pub fn kinds(&self, segments: &[Segment]) -> u8 {
        segments.iter().fold(0, |k, s| k | self.kinds[s.slot])
    }

    /// Makes the compute stream wait for the copy of `slot`'s last write.
    pub fn wait_for_slot(&self, dev: &Device, slot: usize) -> Result<()> {
        match &self.ready[slot] {
            Some(e) => dev
                .stream
                .wait(e)
                .map_err(cuda("waiting for an adapter copy")),
            None => Ok(()),
        }
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
        self.kinds[slot] = 0;
        for key in 0..self.rank_host.len() / self.slots {
            self.rank_host[key * self.slots + slot] = 0;
            self.scale_host[key * self.slots + slot] = 0.0;
            self.flags_host[key * self.slots + slot] = 0;
        }
    }

    fn upload_ranks(&mut self, dev: &Device) -> Result<()> {
        dev.stream
            .memcpy_htod(&self.rank_host, &mut self.rank)
            .map_err(cuda("writing slot ranks"))?;
        dev.stream
            .memcpy_htod(&self.flags_host, &mut self.flags)
            .map_err(cuda("writing slot flags"))?;
        dev.stream
            .memcpy_htod(&self.scale_host, &mut self.scale)
            .map_err(cuda("writing slot scales"))
    }

    /// The flags of slice `key`, `[slots]` i32, as an address.
    pub fn flags_of(&self, dev: &Device, key: usize) -> u64 {
        dev.p(&self.flags) + (key * self.slots * 4) as u64
    }

    /// Slot 0's vectors `[g | c]` of `key`; slot s's are `v_stride` values
    /// further.
    pub fn vectors_at(&self, dev: &Device, key: usize) -> u64 {
        dev.p(&self.vectors) + (self.v_at[key] * 4) as u64
    }

    /// Where `slot`'s vector image starts.
    fn vectors_of(&self, dev: &Device, slot: usize) -> u64 {
        dev.p(&self.vectors) + (slot * self.v_stride * 4) as u64
    }

    /// Turns each DoRA module's magnitude in `slot`'s vectors into its
    /// scales, on `stream`: the copy stream after the copies, or the
    /// compute stream once it has waited for them ([`Slots::wait_for_slot`]).
    pub fn dora_scales(
        &self,
        dev: &Device,
        stream: &Arc<CudaStream>,
        slot: usize,
        dora: &[DoraBase],
    ) -> Result<()> {
        use super::device::Arg;
        for d in dora {
            let rank = self.rank_host[d.key * self.slots + slot];
            if self.flags_host[d.key * self.slots + slot] & FLAG_DORA == 0 || rank == 0 {
                continue;
            }
            let width = self.widths[d.key];
            let at = |base: u64, values: usize| base + (values * self.dtype.bytes()) as u64;
            let image = dev.p(&self.data) + (slot * self.stride * self.dtype.bytes()) as u64;
            dev.launch_on(
                stream,
                "dora_scales",
                (width as u32, 1, 1),
                256,
                &[
                    Arg::Ptr(d.w),
                    Arg::I32(d.fan_in as i32),
                    Arg::Ptr(at(image, self.a_at[d.key])),
                    Arg::Ptr(at(image, self.b_at[d.key])),
                    Arg::I32(width as i32),
                    Arg::I32(rank),
                    Arg::F32(self.scale_host[d.key * self.slots + slot]),
                    Arg::Ptr(self.vectors_of(dev, slot) + (self.v_at[d.key] * 4) as u64),
                ],
            )?;
        }
        Ok(())
    }
}

/// Writes `m`'s magnitude (where its scales will be) and `s·b_B` into a
/// staged vector image as native f32 bytes, its `[g | c]` of `width` values
/// each starting at value `at`; returns its flags.
fn put_vectors(at: usize, width: usize, m: &LoraModule, vectors: &mut [u8]) -> i32 {
    let mut put = |from: usize, values: &mut dyn Iterator<Item = f32>| {
        for (i, v) in values.enumerate().take(width) {
            let b = (from + i) * 4;
            vectors[b..b + 4].copy_from_slice(&v.to_ne_bytes());
        }
    };
    let mut flags = 0;
    if let Some(mag) = &m.magnitude {
        put(at, &mut mag.iter().copied());
        flags |= FLAG_DORA;
    }
    if let Some(bias) = &m.bias {
        put(at + width, &mut bias.iter().map(|b| m.scale * b));
        flags |= FLAG_BIAS;
    }
    flags
}

/// Where each (layer, projection)'s `[g | c]` starts in a slot's vector
/// image, each one's width, and the image's length, in f32 values.
pub(super) fn vector_layout(c: &ModelConfig) -> (Vec<usize>, Vec<usize>, usize) {
    let (mut at, mut widths, mut len) = (Vec::new(), Vec::new(), 0);
    for _ in 0..c.num_layers {
        for p in Projection::ALL {
            let width = p.shape(c).1;
            at.push(len);
            widths.push(width);
            len += 2 * width;
        }
    }
    (at, widths, len)
}

/// Writes a module's A and Bᵀ into `a` and `b` (bytes, in order) as `dtype`
/// values: f32 as the host holds it, bf16 as the file's own bits when it
/// stored bf16 (else rounded to nearest even), f16 rounded from f32.
fn encode_module(m: &LoraModule, dtype: Dtype, a: &mut [u8], b: &mut [u8]) {
    fn view<T>(bytes: &mut [u8]) -> &mut [T] {
        // SAFETY: the page-locked buffer is page-aligned and every module
        // starts at a multiple of the element size; any bit pattern is a
        // valid f32 or u16.
        let (head, values, tail) = unsafe { bytes.align_to_mut::<T>() };
        assert!(
            head.is_empty() && tail.is_empty(),
            "a misaligned slot staging buffer"
        );
        values
    }
    let bf16_bits = |v: f32| half::bf16::from_f32(v).to_bits();
    let f16_bits = |v: f32| half::f16::from_f32(v).to_bits();
    let widen = crate::backend::cpu::panels::bf16_to_f32;
    match dtype {
        Dtype::F32 => {
            m.write_a_f32(view(a));
            m.write_b_t_f32(view(b));
        }
        Dtype::Bf16 => {
            m.write_a_as(view(a), bf16_bits, |bits| bits);
            m.write_b_t_as(view(b), bf16_bits, |bits| bits);
        }
        Dtype::F16 => {
            m.write_a_as(view(a), f16_bits, |bits| f16_bits(widen(bits)));
            m.write_b_t_as(view(b), f16_bits, |bits| f16_bits(widen(bits)));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lora::Factors;

    #[test]
    fn each_projection_s_vectors_have_their_own_place_and_flags() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/llama-gqa");
        let c = ModelConfig::from_dir(&dir).unwrap();
        let (at, widths, len) = vector_layout(&c);
        assert_eq!(at.len(), c.num_layers * 7);
        // Back to back, two of each projection's width.
        let mut next = 0;
        for (key, (&a, &w)) in at.iter().zip(&widths).enumerate() {
            assert_eq!(a, next, "key {key}");
            assert_eq!(w, Projection::ALL[key % 7].shape(&c).1);
            next += 2 * w;
        }
        assert_eq!(next, len);

        let module = |magnitude: Option<Vec<f32>>, bias: Option<Vec<f32>>| LoraModule {
            rank: 1,
            scale: 0.5,
            factors: Factors::F32 {
                a_t: vec![0.0; 4],
                b_t: vec![0.0; 3],
            },
            magnitude,
            bias,
        };
        let read = |bytes: &[u8]| -> Vec<f32> {
            bytes
                .chunks_exact(4)
                .map(|b| f32::from_ne_bytes(b.try_into().unwrap()))
                .collect()
        };
        let mut image = vec![0u8; 4 * 12];
        let both = module(Some(vec![1.0, 2.0, 3.0]), Some(vec![4.0, 6.0, 8.0]));
        assert_eq!(put_vectors(3, 3, &both, &mut image), FLAG_DORA | FLAG_BIAS);
        assert_eq!(
            read(&image),
            [0.0, 0.0, 0.0, 1.0, 2.0, 3.0, 2.0, 3.0, 4.0, 0.0, 0.0, 0.0]
        );
        let mut image = vec![0u8; 4 * 6];
        assert_eq!(
            put_vectors(0, 3, &module(None, Some(vec![2.0; 3])), &mut image),
            FLAG_BIAS
        );
        assert_eq!(read(&image), [0.0, 0.0, 0.0, 1.0, 1.0, 1.0]);
        assert_eq!(put_vectors(0, 3, &module(None, None), &mut image), 0);
    }
}
