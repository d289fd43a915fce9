//! Hooks for the GPU tests and the kernel benchmark: single kernels on
//! host data, and the grouped LoRA pair on synthetic slots. Not part of
//! the engine's API.

use std::time::Instant;

use cudarc::driver::CudaSlice;

use super::Dtype;
pub use super::device::Arg;
use super::device::{Device, LoraLaunch, LoraSlice, cuda, push_segments};
use super::kernels::{KernelShapes, MAX_SHRINK_KC};
use crate::backend::Segment;
use crate::error::Result;

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

    pub fn read(&self, b: &Buf) -> Result<Vec<f32>> {
        match b {
            Buf::F32(s) => self.dev.stream.clone_dtoh(s).map_err(cuda("download")),
            Buf::I32(_) => Err(crate::EngineError::Backend("not an f32 buffer".into())),
        }
    }

    pub fn read_i32(&self, b: &Buf) -> Result<Vec<i32>> {
        match b {
            Buf::I32(s) => self.dev.stream.clone_dtoh(s).map_err(cuda("download")),
            Buf::F32(_) => Err(crate::EngineError::Backend("not an i32 buffer".into())),
        }
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

    /// Milliseconds per shrink + expand over `segments` (tokens
    /// `0..n`, at most `max_tokens`), averaged over `iters` runs; with
    /// `per_segment`, each segment is its own pair of launches, as a loop
    /// over adapters would run them.
    pub fn time(&self, segments: &[Segment], iters: usize, per_segment: bool) -> Result<f64> {
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
            let (token_idx, seg_off, seg_slot) = push_segments(&mut buf, group);
            let dev_buf = self.dev.stream.clone_htod(&buf).map_err(cuda("upload"))?;
            let base = self.dev.p(&dev_buf);
            let at = |i: usize| base + (i * 4) as u64;
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
                    width: self.fan_out,
                    offset: 0,
                }],
                token_idx: at(token_idx),
                seg_off: at(seg_off),
                seg_slot: at(seg_slot),
                segments: group.len(),
                h_part: self.dev.p(&self.h_part),
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
        self.dev.stream.synchronize().map_err(cuda("sync"))?;
        let start = Instant::now();
        for _ in 0..iters {
            run()?;
        }
        self.dev.stream.synchronize().map_err(cuda("sync"))?;
        drop(held);
        Ok(start.elapsed().as_secs_f64() * 1e3 / iters as f64)
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
        self.dev.stream.synchronize().map_err(cuda("sync"))?;
        let start = Instant::now();
        for _ in 0..iters {
            self.dev
                .stream
                .memcpy_dtod(&src, &mut dst)
                .map_err(cuda("copy"))?;
        }
        self.dev.stream.synchronize().map_err(cuda("sync"))?;
        let secs = start.elapsed().as_secs_f64() / iters as f64;
        Ok(2.0 * (n * 4) as f64 / secs / 1e9)
    }
}
