//! Hooks for the GPU tests and the kernel benchmark: single kernels on
//! host data, and the grouped LoRA pair on synthetic slots. Not part of
//! the engine's API.

use cudarc::driver::{CudaSlice, sys};

use super::Dtype;
pub use super::device::Arg;
use super::device::{Device, LoraLaunch, LoraSlice, cuda, push_segments};
use super::kernels::{KernelShapes, MAX_SHRINK_KC};
use crate::backend::Segment;
use crate::error::Result;
use crate::lora::Projection;

/// A device buffer of the harness.
#[derive(Debug)]
pub enum Buf {
    F32(CudaSlice<f32>),
    I32(CudaSlice<i32>),
}

/// The kernels compiled for `shapes` on device 0, run one at a time on
/// buffers the caller uploads.
pub struct KernelHarness {
    dev: Device,
}

impl std::fmt::Debug for KernelHarness {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KernelHarness")
            .field("device", &self.dev.name)
            .finish()
    }
}

impl KernelHarness {
    pub fn new(shapes: KernelShapes) -> Result<KernelHarness> {
        Ok(KernelHarness {
            dev: Device::open(0, shapes)?,
        })
    }

    pub fn device_name(&self) -> &str {
        &self.dev.name
    }

    pub fn f32(&self, v: &[f32]) -> Result<Buf> {
        Ok(Buf::F32(
            self.dev.stream.clone_htod(v).map_err(cuda("upload"))?,
        ))
    }

    pub fn i32(&self, v: &[i32]) -> Result<Buf> {
        Ok(Buf::I32(
            self.dev.stream.clone_htod(v).map_err(cuda("upload"))?,
        ))
    }

    /// A table of device addresses (as the kernels read `unsigned long
    /// long`), held as pairs of 32-bit halves.
    pub fn pointers(&self, v: &[u64]) -> Result<Buf> {
        let halves: Vec<i32> = v
            .iter()
            .flat_map(|p| [*p as u32 as i32, (*p >> 32) as u32 as i32])
            .collect();
        self.i32(&halves)
    }

    pub fn ptr(&self, b: &Buf) -> u64 {
        match b {
            Buf::F32(s) => self.dev.p(s),
            Buf::I32(s) => self.dev.p(s),
        }
    }

    pub fn launch(
        &self,
        name: &str,
        grid: (u32, u32, u32),
        block: u32,
        args: &[Arg],
    ) -> Result<()> {
        self.dev.launch(name, grid, block, args)
    }

    /// A step's LoRA segments uploaded as the grouped kernels read them:
    /// the buffer, the four section arguments (token indices, segment
    /// offsets, segment slots, tiles) and the number of tiles (the grid).
    pub fn segments(&self, segments: &[Segment]) -> Result<(Buf, [Arg; 4], usize)> {
        let mut buf = Vec::new();
        let (ptrs, tiles) = push_segments(&mut buf, segments, None);
        buf.push(0);
        let dev = self.i32(&buf)?;
        let p = ptrs.at(self.ptr(&dev));
        let args = [
            Arg::Ptr(p.token_idx),
            Arg::Ptr(p.seg_off),
            Arg::Ptr(p.seg_slot),
            Arg::Ptr(p.tiles),
        ];
        Ok((dev, args, tiles))
    }

    pub fn read(&self, b: &Buf) -> Result<Vec<f32>> {
        match b {
            Buf::F32(s) => self.dev.stream.clone_dtoh(s).map_err(cuda("download")),
            Buf::I32(_) => Err(crate::EngineError::Backend("not an f32 buffer".into())),
        }
    }

    /// One W8A8 projection as an FP8 layer runs it, on an f32 harness:
    /// `fp8_rows` (each token's row of `x` `[n, k]` as e4m3 codes and a
    /// scale), cuBLASLt's FP8 GEMM with `w` `[m, k]` e4m3 codes, then
    /// `fp8_scale` (token scale × each output's weight scale). Returns y
    /// `[n, m]`, the codes and the token scales.
    pub fn fp8_linear(
        &self,
        x: &[f32],
        w: &[u8],
        w_scale: &[f32],
        (n, m, k): (usize, usize, usize),
    ) -> Result<(Vec<f32>, Vec<u8>, Vec<f32>)> {
        assert_eq!(self.dev.shapes.dtype, Dtype::F32, "an f32 harness");
        let st = &self.dev.stream;
        let gemm = super::fp8::Fp8Gemm::new(&self.dev)?;
        let x = st.clone_htod(x).map_err(cuda("upload"))?;
        let w = st.clone_htod(w).map_err(cuda("upload"))?;
        let w_scale = st.clone_htod(w_scale).map_err(cuda("upload"))?;
        let xq = st.alloc_zeros::<u8>(n * k).map_err(cuda("alloc"))?;
        let rs = st.alloc_zeros::<f32>(n).map_err(cuda("alloc"))?;
        let y = st.alloc_zeros::<f32>(n * m).map_err(cuda("alloc"))?;
        let p = |b: u64| Arg::Ptr(b);
        self.dev.launch(
            "fp8_rows",
            (n as u32, 1, 1),
            256,
            &[
                p(self.dev.p(&x)),
                Arg::I32(k as i32),
                p(self.dev.p(&xq)),
                p(self.dev.p(&rs)),
            ],
        )?;
        gemm.matmul(
            &self.dev,
            self.dev.p(&w),
            self.dev.p(&xq),
            self.dev.p(&y),
            m,
            (m, n, k),
        )?;
        self.dev.launch(
            "fp8_scale",
            Device::elementwise_grid(n * m),
            256,
            &[
                p(self.dev.p(&y)),
                p(self.dev.p(&rs)),
                p(self.dev.p(&w_scale)),
                Arg::I32(n as i32),
                Arg::I32(m as i32),
            ],
        )?;
        let down = "download";
        Ok((
            st.clone_dtoh(&y).map_err(cuda(down))?,
            st.clone_dtoh(&xq).map_err(cuda(down))?,
            st.clone_dtoh(&rs).map_err(cuda(down))?,
        ))
    }

    pub fn read_i32(&self, b: &Buf) -> Result<Vec<i32>> {
        match b {
            Buf::I32(s) => self.dev.stream.clone_dtoh(s).map_err(cuda("download")),
            Buf::F32(_) => Err(crate::EngineError::Backend("not an i32 buffer".into())),
        }
    }
}

impl super::CudaBackend {
    /// Holds the slot copy stream for about `cycles` GPU clock cycles, so
    /// the next slot write stays in flight that long.
    pub fn stall_slot_copies(&self, cycles: i64) -> Result<()> {
        self.dev.launch_on(
            self.slots.copy_stream(),
            "spin",
            (1, 1, 1),
            1,
            &[Arg::I64(cycles)],
        )
    }

    /// Whether the copy of `slot`'s last write is still in flight.
    pub fn slot_copy_in_flight(&self, slot: usize) -> bool {
        self.slots.copy_in_flight(slot)
    }
}

/// One projection's grouped LoRA pair on synthetic slots (f32, every slot
/// of rank `rank`), for the kernel benchmark.
pub struct LoraBench {
    pub fan_in: usize,
    pub fan_out: usize,
    pub max_rank: usize,
    pub slots: usize,
    x: CudaSlice<f32>,
    out: CudaSlice<f32>,
    h_part: CudaSlice<f32>,
    a: CudaSlice<f32>,
    b: CudaSlice<f32>,
    rank: CudaSlice<i32>,
    scale: CudaSlice<f32>,
    /// Every slot plain: no DoRA, no `lora_bias`.
    flags: CudaSlice<i32>,
    max_tokens: usize,
    dev: Device,
}

impl std::fmt::Debug for LoraBench {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LoraBench")
            .field("device", &self.dev.name)
            .field("fan_in", &self.fan_in)
            .field("fan_out", &self.fan_out)
            .finish_non_exhaustive()
    }
}

impl LoraBench {
    pub fn new(
        fan_in: usize,
        fan_out: usize,
        slots: usize,
        max_rank: usize,
        rank: usize,
        max_tokens: usize,
    ) -> Result<LoraBench> {
        let shapes = KernelShapes {
            dtype: Dtype::F32,
            slot_dtype: Dtype::F32,
            head_dim: 2,
            max_rank,
            shrink_kc: fan_in.next_multiple_of(32).min(MAX_SHRINK_KC),
        };
        let dev = Device::open(0, shapes)?;
        let fill = |n: usize, seed: usize| -> Result<CudaSlice<f32>> {
            let v: Vec<f32> = (0..n)
                .map(|i| (((i + seed) * 2_654_435_761) % 2001) as f32 / 1000.0 - 1.0)
                .collect();
            dev.stream.clone_htod(&v).map_err(cuda("upload"))
        };
        let splits = shapes.splits(fan_in);
        Ok(LoraBench {
            x: fill(max_tokens * fan_in, 1)?,
            out: fill(max_tokens * fan_out, 2)?,
            h_part: fill(splits * max_tokens * max_rank, 3)?,
            a: fill(slots * max_rank * fan_in, 4)?,
            b: fill(slots * max_rank * fan_out, 5)?,
            rank: dev
                .stream
                .clone_htod(&vec![rank as i32; slots])
                .map_err(cuda("upload"))?,
            scale: dev
                .stream
                .clone_htod(&vec![0.5f32; slots])
                .map_err(cuda("upload"))?,
            flags: dev
                .stream
                .alloc_zeros::<i32>(slots)
                .map_err(cuda("upload"))?,
            fan_in,
            fan_out,
            max_rank,
            slots,
            max_tokens,
            dev,
        })
    }

    pub fn device_name(&self) -> &str {
        &self.dev.name
    }

    /// Sets every slot's rank; rank 0 makes both kernels return at once,
    /// which measures the fixed cost of the launch pair.
    pub fn set_rank(&mut self, rank: usize) -> Result<()> {
        assert!(rank <= self.max_rank);
        self.dev
            .stream
            .memcpy_htod(&vec![rank as i32; self.slots], &mut self.rank)
            .map_err(cuda("upload"))
    }

    /// Microseconds per shrink + expand over `segments` (tokens `0..n`, at
    /// most `max_tokens`): the median of several timed replays of a CUDA
    /// graph holding the launches, timed with device events, so launch
    /// gaps are what a captured decode step would see. With
    /// `per_segment`, each segment is its own pair of launches, as a loop
    /// over adapters would run them.
    pub fn time(&self, segments: &[Segment], per_segment: bool) -> Result<f64> {
        const REPS: usize = 10;
        const REPLAYS: usize = 20;
        const TRIALS: usize = 7;
        let n = segments.iter().map(|s| s.end).max().unwrap_or(0);
        assert!(n <= self.max_tokens);
        let groups: Vec<&[Segment]> = if per_segment {
            segments.chunks(1).collect()
        } else {
            vec![segments]
        };
        let mut held = Vec::new();
        let mut launches = Vec::new();
        for group in groups {
            let mut buf = Vec::new();
            let (ptrs, tiles) = push_segments(&mut buf, group, None);
            buf.push(0);
            let dev_buf = self.dev.stream.clone_htod(&buf).map_err(cuda("upload"))?;
            launches.push(LoraLaunch {
                x: self.dev.p(&self.x),
                fan_in: self.fan_in,
                n,
                out: self.dev.p(&self.out),
                out_stride: self.fan_out,
                slices: vec![LoraSlice {
                    a: self.dev.p(&self.a),
                    b: self.dev.p(&self.b),
                    rank: self.dev.p(&self.rank),
                    scale: self.dev.p(&self.scale),
                    flags: self.dev.p(&self.flags),
                    vectors: 0,
                    bias: 0,
                    b_stride: self.max_rank * self.fan_out,
                    width: self.fan_out,
                    offset: 0,
                }],
                a_stride: self.max_rank * self.fan_in,
                segments: ptrs.at(self.dev.p(&dev_buf)),
                tiles,
                h_part: self.dev.p(&self.h_part),
                v_stride: 0,
            });
            held.push(dev_buf);
        }
        let run = || -> Result<()> {
            for l in &launches {
                self.dev.lora(l)?;
            }
            Ok(())
        };
        run()?;
        let stream = &self.dev.stream;
        stream.synchronize().map_err(cuda("sync"))?;
        stream
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(cuda("capture"))?;
        for _ in 0..REPS {
            run()?;
        }
        let graph = stream
            .end_capture(sys::CUgraphInstantiate_flags(0))
            .map_err(cuda("capture"))?
            .ok_or_else(|| crate::EngineError::Backend("cuda: an empty graph".into()))?;
        graph.upload().map_err(cuda("graph upload"))?;
        graph.launch().map_err(cuda("graph launch"))?;
        let mut trials = Vec::with_capacity(TRIALS);
        for _ in 0..TRIALS {
            let timed = Some(sys::CUevent_flags::CU_EVENT_DEFAULT);
            let start = stream.record_event(timed).map_err(cuda("event"))?;
            for _ in 0..REPLAYS {
                graph.launch().map_err(cuda("graph launch"))?;
            }
            let end = stream.record_event(timed).map_err(cuda("event"))?;
            let ms = start.elapsed_ms(&end).map_err(cuda("event"))?;
            trials.push(f64::from(ms) * 1e3 / (REPS * REPLAYS) as f64);
        }
        stream.synchronize().map_err(cuda("sync"))?;
        drop(graph);
        drop(held);
        trials.sort_by(f64::total_cmp);
        Ok(trials[TRIALS / 2])
    }

    /// Device-to-device copy bandwidth in GB/s (bytes read plus written),
    /// over a buffer of `bytes`: the practical memory-bandwidth ceiling.
    pub fn copy_bandwidth(&self, bytes: usize, iters: usize) -> Result<f64> {
        let n = bytes / 4;
        let src = self
            .dev
            .stream
            .alloc_zeros::<f32>(n)
            .map_err(cuda("alloc"))?;
        let mut dst = self
            .dev
            .stream
            .alloc_zeros::<f32>(n)
            .map_err(cuda("alloc"))?;
        self.dev
            .stream
            .memcpy_dtod(&src, &mut dst)
            .map_err(cuda("copy"))?;
        let timed = Some(sys::CUevent_flags::CU_EVENT_DEFAULT);
        let start = self.dev.stream.record_event(timed).map_err(cuda("event"))?;
        for _ in 0..iters {
            self.dev
                .stream
                .memcpy_dtod(&src, &mut dst)
                .map_err(cuda("copy"))?;
        }
        let end = self.dev.stream.record_event(timed).map_err(cuda("event"))?;
        let secs = f64::from(start.elapsed_ms(&end).map_err(cuda("event"))?) / 1e3 / iters as f64;
        Ok(2.0 * (n * 4) as f64 / secs / 1e9)
    }
}

impl super::CudaBackend {
    /// Kernel launches and GEMM calls this backend has issued (a step's
    /// count is the difference across a step that runs without a graph).
    pub fn launches_issued(&self) -> u64 {
        self.dev.launches()
    }

    /// Where the last step's device time goes: the step's launches, the
    /// base GEMMs alone, the LoRA launches alone, the attention kernels
    /// alone and the rest (norms, RoPE and the KV store, casts, residual
    /// adds), each captured in a graph
    /// and replayed `iters` times between device events. Milliseconds per
    /// replay, in that order; the buffers hold the last step's data.
    pub fn profile_last_step(&self, iters: usize) -> Result<Vec<(&'static str, f64)>> {
        let (meta, n, rows) = self
            .graphs
            .last_step
            .ok_or_else(|| crate::EngineError::Backend("cuda: no step has run yet".into()))?;
        // The widest buffers serve every projection's input and output.
        let x = self.dev.p(&self.ws.act);
        let y = self.dev.p(&self.ws.gu);
        let input = self.ws.cast.as_ref().map_or(x, |c| self.dev.p(c));
        let gemms = || -> Result<()> {
            for layer in &self.layers {
                let super::Mlp::Dense { gate_up, down } = &layer.mlp else {
                    return Err(crate::EngineError::Backend(
                        "cuda: the step profile covers dense models only".into(),
                    ));
                };
                for lin in [&layer.qkv, &layer.o, gate_up, down] {
                    self.linear(lin, input, y, n)?;
                }
            }
            if rows > 0 {
                self.linear(&self.lm_head, input, self.dev.p(&self.ws.logits), rows)?;
            }
            Ok(())
        };
        let loras = || -> Result<()> {
            for l in 0..self.layers.len() {
                for projs in [
                    &[Projection::Q, Projection::K, Projection::V][..],
                    &[Projection::O],
                    &[Projection::Gate, Projection::Up],
                    &[Projection::Down],
                ] {
                    self.lora(l, projs, x, n, y, &meta)?;
                }
            }
            Ok(())
        };
        let attention = || -> Result<()> {
            let (qkv, attn) = (self.dev.p(&self.ws.qkv), self.dev.p(&self.ws.attn));
            for l in 0..self.layers.len() {
                self.attention(l, &meta, n, qkv, attn)?;
            }
            Ok(())
        };
        let step = self.time_replays(|| self.launch_forward(&meta, n, rows), iters)?;
        let gemm = self.time_replays(gemms, iters)?;
        // A step with no adapter has no LoRA launches to time.
        let lora = if meta.tiles == 0 {
            0.0
        } else {
            self.time_replays(loras, iters)?
        };
        let attention = self.time_replays(attention, iters)?;
        Ok(vec![
            ("whole step", step),
            ("base GEMMs", gemm),
            ("LoRA launches", lora),
            ("attention", attention),
            ("the rest", step - gemm - lora - attention),
        ])
    }

    fn time_replays(&self, launch: impl FnOnce() -> Result<()>, iters: usize) -> Result<f64> {
        let graph = self.capture_with(launch)?;
        let st = &self.dev.stream;
        for _ in 0..3 {
            graph.launch().map_err(cuda("replaying"))?;
        }
        let timing = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
        let start = st.record_event(timing).map_err(cuda("timing"))?;
        for _ in 0..iters {
            graph.launch().map_err(cuda("replaying"))?;
        }
        let end = st.record_event(timing).map_err(cuda("timing"))?;
        Ok(start.elapsed_ms(&end).map_err(cuda("timing"))? as f64 / iters.max(1) as f64)
    }
}
