//! One CUDA device as the backend uses it: a context, its one stream and
//! the kernels compiled for a model's shapes, plus the launches that more
//! than one user shares (the grouped LoRA pair).

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use cudarc::driver::sys::{self, CUevent_flags};
use cudarc::driver::{
    CudaContext, CudaEvent, CudaFunction, CudaSlice, CudaStream, DevicePtr, LaunchConfig,
    PushKernelArg,
};

use super::kernels::{self, KERNELS, KernelShapes};
use crate::error::{EngineError, Result};

/// An error from a CUDA call, saying what was being done.
pub(super) fn cuda<E: std::fmt::Display>(what: &'static str) -> impl Fn(E) -> EngineError {
    move |e| EngineError::Backend(format!("cuda: {what}: {e}"))
}

/// One kernel argument. Device memory travels as raw addresses: all work
/// runs on one stream, so cudarc's per-buffer event tracking is off.
#[doc(hidden)]
#[derive(Debug, Clone, Copy)]
pub enum Arg {
    Ptr(u64),
    I32(i32),
    I64(i64),
    F32(f32),
}

/// A context, its stream and the compiled kernels. Field order is drop
/// order: the kernels' module goes before the streams and the context.
pub(super) struct Device {
    functions: HashMap<&'static str, CudaFunction>,
    pub shapes: KernelShapes,
    pub name: String,
    /// The compute capability (major, minor).
    pub cc: (i32, i32),
    /// Kernel launches and GEMM calls issued so far (a step's count is
    /// the difference across it).
    launches: AtomicU64,
    /// Kernels launched with programmatic dependent launch (compute 9.0
    /// and newer): each may be scheduled while the kernel before it in its
    /// stream finishes, and waits (`griddepcontrol.wait`, the first
    /// statement of every kernel) until that one's writes are visible. Off
    /// by default ([`Device::set_pdl`]).
    pdl: AtomicBool,
    /// Where a LoRA shrink runs beside the base GEMM that reads the same
    /// input: it forks from the compute stream at `fork` and joins it back
    /// at `join` ([`Device::lora_fork`], [`Device::lora_join`]). A CUDA
    /// graph captures the pair as two branches.
    fork: CudaEvent,
    join: CudaEvent,
    side: Arc<CudaStream>,
    pub stream: Arc<CudaStream>,
    pub ctx: Arc<CudaContext>,
}

impl Device {
    /// Opens device `ordinal` and compiles the kernels for `shapes`.
    pub fn open(ordinal: usize, shapes: KernelShapes) -> Result<Device> {
        super::probe()?;
        let ctx = CudaContext::new(ordinal).map_err(cuda("opening the device"))?;
        // SAFETY: one stream does all the work, in order, so cudarc's
        // cross-stream events would only add cost.
        unsafe { ctx.disable_event_tracking() };
        let (major, minor) = ctx
            .compute_capability()
            .map_err(cuda("reading the compute capability"))?;
        if major < 8 {
            return Err(EngineError::Backend(format!(
                "cuda: device {ordinal} has compute capability {major}.{minor}; 8.0 or newer is needed"
            )));
        }
        let name = format!(
            "{} (compute {major}.{minor}, {} MiB)",
            ctx.name().map_err(cuda("reading the device name"))?,
            ctx.total_mem().map_err(cuda("reading the memory size"))? >> 20
        );
        let ptx = kernels::compile(&shapes, kernels::arch_for(major, minor))?;
        let module = ctx.load_module(ptx).map_err(cuda("loading the kernels"))?;
        let mut functions = HashMap::new();
        for &kernel in KERNELS {
            let f = module
                .load_function(kernel)
                .map_err(|e| EngineError::Backend(format!("cuda: kernel {kernel}: {e}")))?;
            functions.insert(kernel, f);
        }
        // A stream of its own, not the legacy default stream, which CUDA
        // graphs cannot capture.
        let stream = ctx.new_stream().map_err(cuda("creating a stream"))?;
        let side = ctx.new_stream().map_err(cuda("creating a stream"))?;
        let event = || {
            ctx.new_event(Some(CUevent_flags::CU_EVENT_DISABLE_TIMING))
                .map_err(cuda("creating an event"))
        };
        Ok(Device {
            functions,
            shapes,
            name,
            cc: (major, minor),
            launches: AtomicU64::new(0),
            pdl: AtomicBool::new(false),
            fork: event()?,
            join: event()?,
            side,
            stream,
            ctx,
        })
    }

    /// Counts a launch that does not go through [`Device::launch_on`] (a
    /// GEMM call).
    pub fn count_launch(&self) {
        self.launches.fetch_add(1, Ordering::Relaxed);
    }

    /// Turns programmatic dependent launch on or off for the kernels
    /// launched from now on; it stays off on a device older than compute
    /// 9.0, which has no `griddepcontrol`. Returns whether it is on.
    pub fn set_pdl(&self, enabled: bool) -> bool {
        let on = enabled && self.cc.0 >= 9;
        self.pdl.store(on, Ordering::Relaxed);
        on
    }

    pub fn pdl(&self) -> bool {
        self.pdl.load(Ordering::Relaxed)
    }

    /// Kernel launches and GEMM calls issued so far.
    pub fn launches(&self) -> u64 {
        self.launches.load(Ordering::Relaxed)
    }

    /// A device buffer's address.
    pub fn p<T>(&self, slice: &CudaSlice<T>) -> u64 {
        let (p, _sync) = slice.device_ptr(&self.stream);
        p
    }

    /// Launches kernel `name` on the stream with a 1-D block of `block`.
    pub fn launch(
        &self,
        name: &str,
        grid: (u32, u32, u32),
        block: u32,
        args: &[Arg],
    ) -> Result<()> {
        self.launch_on(&self.stream, name, grid, block, args)
    }

    /// [`Device::launch`] on another stream of the same context.
    pub fn launch_on(
        &self,
        stream: &Arc<CudaStream>,
        name: &str,
        grid: (u32, u32, u32),
        block: u32,
        args: &[Arg],
    ) -> Result<()> {
        let f = self
            .functions
            .get(name)
            .ok_or_else(|| EngineError::Backend(format!("cuda: no kernel {name}")))?;
        self.count_launch();
        if self.pdl() {
            return self.launch_programmatic(stream, f, name, grid, block, args);
        }
        let mut builder = stream.launch_builder(f);
        for arg in args {
            match arg {
                Arg::Ptr(v) => builder.arg(v),
                Arg::I32(v) => builder.arg(v),
                Arg::I64(v) => builder.arg(v),
                Arg::F32(v) => builder.arg(v),
            };
        }
        let cfg = LaunchConfig {
            grid_dim: grid,
            block_dim: (block, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: each call site passes the arguments its kernel declares in
        // kernels.cu, with buffers sized for the grid it launches.
        unsafe { builder.launch(cfg) }
            .map(|_| ())
            .map_err(|e| EngineError::Backend(format!("cuda: launching {name}: {e}")))
    }

    /// A launch through `cuLaunchKernelEx` with programmatic stream
    /// serialization allowed: the kernel may start while the one before
    /// it in the stream (or in a captured graph) drains, and its first
    /// statement waits for that one's writes (`PDL_ENTER` in kernels.cu).
    fn launch_programmatic(
        &self,
        stream: &Arc<CudaStream>,
        f: &CudaFunction,
        name: &str,
        grid: (u32, u32, u32),
        block: u32,
        args: &[Arg],
    ) -> Result<()> {
        // Every argument in an 8-byte cell of its own: the driver copies
        // each parameter's size from its cell's start (little-endian, so a
        // 4-byte value is the cell's low half).
        let mut cells: Vec<u64> = args
            .iter()
            .map(|a| match *a {
                Arg::Ptr(v) => v,
                Arg::I32(v) => v as u32 as u64,
                Arg::I64(v) => v as u64,
                Arg::F32(v) => v.to_bits() as u64,
            })
            .collect();
        let mut params: Vec<*mut std::ffi::c_void> = cells
            .iter_mut()
            .map(|c| (c as *mut u64).cast::<std::ffi::c_void>())
            .collect();
        // SAFETY: a plain C struct and union of integers; zero is a valid
        // value of each, and the two fields that matter are set below.
        let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
        attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
        attr.value.programmaticStreamSerializationAllowed = 1;
        let config = sys::CUlaunchConfig {
            gridDimX: grid.0,
            gridDimY: grid.1,
            gridDimZ: grid.2,
            blockDimX: block,
            blockDimY: 1,
            blockDimZ: 1,
            sharedMemBytes: 0,
            hStream: stream.cu_stream(),
            attrs: &mut attr,
            numAttrs: 1,
        };
        let failed = |e: cudarc::driver::DriverError| {
            EngineError::Backend(format!("cuda: launching {name} (programmatic): {e}"))
        };
        self.ctx.bind_to_thread().map_err(failed)?;
        // SAFETY: as in `launch_on`: each call site passes the arguments
        // its kernel declares, and `params` points at `cells`, which
        // outlive the call; the driver copies the values at launch.
        unsafe {
            sys::cuLaunchKernelEx(
                &config,
                f.cu_function(),
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        }
        .result()
        .map_err(failed)
    }

    /// Blocks of 256 threads for an elementwise kernel over `n` items.
    pub fn elementwise_grid(n: usize) -> (u32, u32, u32) {
        (n.div_ceil(256).clamp(1, 65_535) as u32, 1, 1)
    }

    /// Adds the LoRA deltas of one to three projections that share their
    /// input: one shrink and one expand launch for every adapter in the
    /// step, in turn on the compute stream.
    pub fn lora(&self, l: &LoraLaunch) -> Result<()> {
        if l.tiles == 0 {
            return Ok(());
        }
        self.lora_shrink(l, &self.stream)?;
        self.lora_expand(l)
    }

    /// Starts `l`'s shrink on the side stream, after everything queued on
    /// the compute stream so far, so that it runs beside what the compute
    /// stream does next (the base GEMM that reads the same input). The
    /// expand waits for both in [`Device::lora_join`], which must follow
    /// before the compute stream writes the shrink's input or reads its
    /// output. Nothing for None.
    pub fn lora_fork(&self, l: Option<&LoraLaunch>) -> Result<()> {
        let Some(l) = l.filter(|l| l.tiles > 0) else {
            return Ok(());
        };
        let what = "forking the LoRA shrink";
        self.fork.record(&self.stream).map_err(cuda(what))?;
        self.side.wait(&self.fork).map_err(cuda(what))?;
        self.lora_shrink(l, &self.side)?;
        self.join.record(&self.side).map_err(cuda(what))
    }

    /// The compute stream waits for the shrink [`Device::lora_fork`]
    /// started, then adds the expand into the output.
    pub fn lora_join(&self, l: Option<&LoraLaunch>) -> Result<()> {
        let Some(l) = l.filter(|l| l.tiles > 0) else {
            return Ok(());
        };
        self.stream
            .wait(&self.join)
            .map_err(cuda("joining the LoRA shrink"))?;
        self.lora_expand(l)
    }

    fn segment_args(l: &LoraLaunch) -> [Arg; 4] {
        [
            Arg::Ptr(l.segments.token_idx),
            Arg::Ptr(l.segments.seg_off),
            Arg::Ptr(l.segments.seg_slot),
            Arg::Ptr(l.segments.tiles),
        ]
    }

    /// Unused slice arguments repeat the last slice; the grid never
    /// reaches them.
    fn slice(l: &LoraLaunch, i: usize) -> &LoraSlice {
        &l.slices[i.min(l.slices.len() - 1)]
    }

    fn lora_shrink(&self, l: &LoraLaunch, stream: &Arc<CudaStream>) -> Result<()> {
        assert!((1..=3).contains(&l.slices.len()));
        let splits = self.shapes.splits(l.fan_in);
        let slice = |i| Self::slice(l, i);
        let mut args = vec![
            Arg::Ptr(l.x),
            Arg::I32(l.fan_in as i32),
            Arg::I32(l.n as i32),
        ];
        args.extend(Self::segment_args(l));
        args.extend((0..3).map(|i| Arg::Ptr(slice(i).a)));
        args.extend((0..3).map(|i| Arg::Ptr(slice(i).rank)));
        args.push(Arg::Ptr(l.h_part));
        args.push(Arg::I64(l.a_stride as i64));
        self.launch_on(
            stream,
            "lora_shrink",
            (l.tiles as u32, splits as u32, l.slices.len() as u32),
            256,
            &args,
        )
    }

    fn lora_expand(&self, l: &LoraLaunch) -> Result<()> {
        let splits = self.shapes.splits(l.fan_in);
        let slice = |i| Self::slice(l, i);
        let mut args = vec![
            Arg::Ptr(l.h_part),
            Arg::I32(splits as i32),
            Arg::I32(l.n as i32),
        ];
        args.extend(Self::segment_args(l));
        args.extend((0..3).map(|i| Arg::Ptr(slice(i).b)));
        args.extend((0..3).map(|i| Arg::Ptr(slice(i).rank)));
        args.extend((0..3).map(|i| Arg::Ptr(slice(i).scale)));
        args.extend((0..3).map(|i| Arg::I32(slice(i).width as i32)));
        args.extend((0..3).map(|i| Arg::I32(slice(i).offset as i32)));
        args.push(Arg::Ptr(l.out));
        args.push(Arg::I32(l.out_stride as i32));
        args.extend((0..3).map(|i| Arg::I64(slice(i).b_stride as i64)));
        args.extend((0..3).map(|i| Arg::Ptr(slice(i).flags)));
        args.extend((0..3).map(|i| Arg::Ptr(slice(i).vectors)));
        args.extend((0..3).map(|i| Arg::Ptr(slice(i).bias)));
        args.push(Arg::I64(l.v_stride as i64));
        let widest = l.slices.iter().map(|s| s.width).max().unwrap_or(0);
        self.launch(
            "lora_expand",
            (
                l.tiles as u32,
                widest.div_ceil(256) as u32,
                l.slices.len() as u32,
            ),
            256,
            &args,
        )
    }
}

/// One projection of a grouped LoRA launch.
#[derive(Debug, Clone, Copy)]
pub(super) struct LoraSlice {
    /// Slot 0's A, `[max_rank, fan_in]` in the weights' type; slot s's
    /// starts `LoraLaunch::a_stride` values further.
    pub a: u64,
    /// Slot 0's Bᵀ, `[max_rank, width]`; slot s's starts `b_stride`
    /// values further.
    pub b: u64,
    pub b_stride: usize,
    /// `[slots]` i32 and f32.
    pub rank: u64,
    pub scale: u64,
    /// `[slots]` i32: each slot's DoRA and `lora_bias` flags of this
    /// projection (all 0 for plain LoRA).
    pub flags: u64,
    /// Slot 0's f32 `[g | c]` of this projection (DoRA's scales, `s·b_B`);
    /// slot s's start `LoraLaunch::v_stride` values further.
    pub vectors: u64,
    /// The base projection's own f32 bias (its part of a fused one), or 0.
    pub bias: u64,
    pub width: usize,
    /// Where this projection's columns start in the output row.
    pub offset: usize,
}

/// A grouped LoRA launch over explicit device buffers.
#[derive(Debug, Clone)]
pub(super) struct LoraLaunch {
    /// `[n, fan_in]` f32.
    pub x: u64,
    pub fan_in: usize,
    pub n: usize,
    /// `[n, out_stride]` f32, added into.
    pub out: u64,
    pub out_stride: usize,
    pub slices: Vec<LoraSlice>,
    /// Values from one slot's A to the next's (the same for every slice).
    pub a_stride: usize,
    pub segments: SegmentPtrs,
    /// The launches' grid: at least the tiles `segments.tiles` lists
    /// (blocks past its count return at once).
    pub tiles: usize,
    /// `[slices, splits, n, max_rank]` f32 scratch.
    pub h_part: u64,
    /// Values from one slot's vectors to the next's.
    pub v_stride: usize,
}

/// Where a step's segment sections start, as element indices into the
/// i32 metadata buffer, or as device addresses once uploaded.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct SegmentPtrs {
    /// Each segment's tokens in segment order (SGMV's sorted indices).
    pub token_idx: u64,
    /// `segments + 1` offsets into `token_idx`.
    pub seg_off: u64,
    /// Each segment's slot.
    pub seg_slot: u64,
    /// The number of tiles, then (slot, first index into `token_idx`,
    /// end index) of each tile of at most [`kernels::LORA_TT`] tokens of
    /// one segment. The section holds an entry, real or padding, for every
    /// block of the grid, so a kernel reads the count and its entry at
    /// once.
    pub tiles: u64,
}

impl SegmentPtrs {
    /// The sections as addresses in a buffer uploaded at `base`.
    pub fn at(self, base: u64) -> SegmentPtrs {
        let at = |i: u64| base + i * 4;
        SegmentPtrs {
            token_idx: at(self.token_idx),
            seg_off: at(self.seg_off),
            seg_slot: at(self.seg_slot),
            tiles: at(self.tiles),
        }
    }
}

/// Appends the segment sections of a step's metadata to `buf`: each
/// segment's token indices, the offsets into them, each segment's slot and
/// the tiles (their count first). Returns where each section starts and the
/// number of tiles.
///
/// With `capacity` (a step's token count), every section is padded to the
/// most that many tokens can need, so where each section starts depends on
/// the token count alone: a CUDA graph captured for that count reads any
/// later step's segments at the same addresses.
pub(super) fn push_segments(
    buf: &mut Vec<i32>,
    segments: &[super::super::Segment],
    capacity: Option<usize>,
) -> (SegmentPtrs, usize) {
    let pad = |buf: &mut Vec<i32>, from: usize, len: usize| {
        if let Some(len) = len.checked_sub(buf.len() - from) {
            buf.resize(buf.len() + len, 0);
        }
    };
    let cap = |extra: usize, per_token: usize| capacity.map(|n| extra + per_token * n);
    let token_idx = buf.len();
    buf.extend(
        segments
            .iter()
            .flat_map(|s| (s.start..s.end).map(|t| t as i32)),
    );
    if let Some(len) = cap(0, 1) {
        pad(buf, token_idx, len);
    }
    let seg_off = buf.len();
    let mut acc = 0;
    buf.push(0);
    for s in segments {
        acc += (s.end - s.start) as i32;
        buf.push(acc);
    }
    if let Some(len) = cap(1, 1) {
        pad(buf, seg_off, len);
    }
    let seg_slot = buf.len();
    buf.extend(segments.iter().map(|s| s.slot as i32));
    if let Some(len) = cap(0, 1) {
        pad(buf, seg_slot, len);
    }
    let tiles = buf.len();
    buf.push(0);
    let mut first = 0;
    for s in segments {
        let len = s.end - s.start;
        for t in (0..len).step_by(kernels::LORA_TT) {
            let lo = first + t;
            let hi = (lo + kernels::LORA_TT).min(first + len);
            buf.extend([s.slot as i32, lo as i32, hi as i32]);
        }
        first += len;
    }
    let count = (buf.len() - tiles - 1) / 3;
    buf[tiles] = count as i32;
    if let Some(len) = cap(1, 3) {
        pad(buf, tiles, len);
    }
    let ptrs = SegmentPtrs {
        token_idx: token_idx as u64,
        seg_off: seg_off as u64,
        seg_slot: seg_slot as u64,
        tiles: tiles as u64,
    };
    (ptrs, count)
}
