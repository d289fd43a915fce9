//! bf16 projections on AMX tiles, to f32 accuracy.
//!
//! AMX multiplies bf16 by bf16 into f32 at about 16 times the AVX-512
//! multiply-add rate. Rounding the activations to bf16 would lose 16 bits
//! of each, so they are not rounded: each f32 `x` is split into three bf16
//! parts, `x = hi + mid + lo` exactly (8 significant bits each covers all
//! 24), and every weight is multiplied by all three. The weights of a bf16
//! checkpoint are exact in bf16, and a product of two bf16 values is exact
//! in f32, so each output is a sum of exact products of the true values,
//! rounded once per addition in f32: the same accuracy class as an f32
//! multiply-add chain, at three tile products per weight.
//!
//! The order of the additions is fixed by the weights' layout alone: for
//! each block of [`KB`] inputs, the `hi` tile product, then `mid`, then
//! `lo`, each adding its block's products in the hardware's own fixed
//! order. A tile computes each of its 16 rows independently of the
//! others, so a token's bits do not depend on the batch it runs in. They do differ from an f32 chain's bits (more
//! additions, in another order), by rounding only.
//!
//! Weights are packed for the tile's B operand: within a panel of
//! [`NR`] outputs, each pair of consecutive inputs `(2r, 2r + 1)` sits side
//! by side for every output, `[fan_in / 2][NR][2]`, with the inputs padded
//! with zeros to a multiple of [`KB`].

#![allow(unsafe_code)]

use super::panels::NR;

/// Inputs per tile product: 16 rows of 64 bytes of bf16 pairs.
pub const KB: usize = 32;
/// Tokens per tile.
pub const ROWS: usize = 16;
/// Panels per parallel task on AMX.
pub const GROUP: usize = 4;

/// Whether this CPU and OS run AMX bf16 tiles, and this process may use
/// them (Linux hands out the 8 KB of tile state only on request).
pub fn available() -> bool {
    static AMX: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *AMX.get_or_init(detect)
}

#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
fn detect() -> bool {
    // CPUID leaf 7 (every CPU with AVX2 has it): EDX bit 22 is AMX-BF16,
    // bit 24 AMX-TILE.
    if !std::arch::is_x86_feature_detected!("avx2") {
        return false;
    }
    #[allow(unused_unsafe)]
    // SAFETY: CPUID leaf 7 exists on this CPU (see above).
    let leaf = unsafe { std::arch::x86_64::__cpuid_count(7, 0) };
    if leaf.edx & (1 << 22) == 0 || leaf.edx & (1 << 24) == 0 {
        return false;
    }
    const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
    const XFEATURE_XTILEDATA: libc::c_long = 18;
    // SAFETY: arch_prctl with ARCH_REQ_XCOMP_PERM only changes which
    // register state this process may use; it takes no pointers.
    let granted = unsafe {
        libc::syscall(
            libc::SYS_arch_prctl,
            ARCH_REQ_XCOMP_PERM,
            XFEATURE_XTILEDATA,
        )
    };
    granted == 0
}

#[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
fn detect() -> bool {
    false
}

/// `fan_in` rounded up to whole tile products.
pub fn padded(fan_in: usize) -> usize {
    fan_in.next_multiple_of(KB)
}

/// The three bf16 parts of `v`, largest first: `hi + mid + lo == v`
/// exactly for every finite `v` whose parts are normal (|v| above about
/// 1e-31; smaller parts would be subnormal, which AMX reads as zero).
///
/// `hi` and `mid` are truncations, so each remainder is exact; the second
/// remainder has at most 8 significant bits left, so `lo` is exact too.
pub fn split(v: f32) -> [u16; 3] {
    let hi = v.to_bits() & 0xffff_0000;
    let rest = v - f32::from_bits(hi);
    let mid = rest.to_bits() & 0xffff_0000;
    let lo = (rest - f32::from_bits(mid)).to_bits();
    [(hi >> 16) as u16, (mid >> 16) as u16, (lo >> 16) as u16]
}

/// Activations split for the tiles, one contiguous 1 KB A tile after
/// another: for each block of [`ROWS`] rows and each block of [`KB`]
/// inputs, the `hi`, `mid` and `lo` tiles, each `[ROWS][KB]` bf16, with the
/// padding (rows past `n`, inputs past `fan_in`) zero.
#[derive(Debug)]
pub struct Split {
    parts: Vec<u16>,
    rows: usize,
    kpad: usize,
}

thread_local! {
    /// The last split's buffer, kept for the next call on this thread so
    /// a step does not map and fault in fresh pages for every projection.
    static SPARE: std::cell::Cell<Vec<u16>> = const { std::cell::Cell::new(Vec::new()) };
}

#[cfg(target_arch = "x86_64")]
thread_local! {
    /// Whether this thread has loaded [`CONFIG`]. The configuration stays
    /// loaded: releasing the tiles after each call and loading them again
    /// costs more than a small call's products.
    static CONFIGURED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// bf16 values per A tile.
const TILE: usize = ROWS * KB;

impl Split {
    /// Splits `n` rows of `fan_in` values.
    pub fn new(x: &[f32], n: usize, fan_in: usize) -> Split {
        assert_eq!(x.len(), n * fan_in, "x holds {n} rows of {fan_in}");
        let (rows, kpad) = (n.next_multiple_of(ROWS), padded(fan_in));
        let mut parts = SPARE.take();
        parts.clear();
        parts.resize(3 * rows * kpad, 0);
        let blocks = kpad / KB;
        for (t, row) in x.chunks_exact(fan_in.max(1)).take(n).enumerate() {
            for (kb, chunk) in row.chunks(KB).enumerate() {
                let at = ((t / ROWS * blocks + kb) * 3) * TILE + (t % ROWS) * KB;
                let (hi, rest) = parts[at..].split_at_mut(TILE);
                let (mid, lo) = rest.split_at_mut(TILE);
                split_run(chunk, &mut hi[..KB], &mut mid[..KB], &mut lo[..KB]);
            }
        }
        Split { parts, rows, kpad }
    }

    /// Rows, padded to a multiple of [`ROWS`].
    pub fn rows(&self) -> usize {
        self.rows
    }
}

impl Drop for Split {
    fn drop(&mut self) {
        SPARE.set(std::mem::take(&mut self.parts));
    }
}

/// [`split`] over a run of values; written as plain lanes so it vectorizes.
fn split_run(x: &[f32], hi: &mut [u16], mid: &mut [u16], lo: &mut [u16]) {
    for (((&v, h), m), l) in x.iter().zip(hi).zip(mid).zip(lo) {
        [*h, *m, *l] = split(v);
    }
}

/// One tile configuration for every call: all eight tiles 16 rows of 64
/// bytes (C: 16 tokens x 16 f32 outputs; A: 16 tokens x 32 bf16 inputs;
/// B: 16 input pairs x 16 outputs x 2 bf16).
#[cfg(target_arch = "x86_64")]
#[repr(C, align(64))]
struct TileConfig([u8; 64]);

#[cfg(target_arch = "x86_64")]
const CONFIG: TileConfig = {
    let mut c = [0u8; 64];
    c[0] = 1; // palette 1
    let mut t = 0;
    while t < 8 {
        c[16 + 2 * t] = 64; // bytes per row (u16 little-endian)
        c[48 + t] = ROWS as u8;
        t += 1;
    }
    TileConfig(c)
};

/// Loads A tiles and runs products, as listed, with `a0` (and `a1`) the A
/// tiles of the row blocks and `as` their row stride.
macro_rules! part {
    ($a0:expr, $as:expr, $($op:literal),*) => {
        std::arch::asm!(
            $($op,)*
            a0 = in(reg) $a0,
            as = in(reg) $as,
            options(nostack, readonly),
        )
    };
    ($a0:expr, $a1:expr, $as:expr, $($op:literal),*) => {
        std::arch::asm!(
            $($op,)*
            a0 = in(reg) $a0,
            a1 = in(reg) $a1,
            as = in(reg) $as,
            options(nostack, readonly),
        )
    };
}

/// Stores C tile `tmm<c>` to 16 rows of `stride` bytes from `at`.
macro_rules! store_c {
    ($c:literal, $at:expr, $stride:expr) => {
        std::arch::asm!(
            concat!("tilestored [{c} + {cs}*1], tmm", $c),
            c = in(reg) $at,
            cs = in(reg) $stride,
            options(nostack),
        )
    };
}

/// `out[t, q*NR + j] = x[t]·W[q*NR + j]` for every padded row `t` of
/// `split` and the `count` (1 to [`GROUP`]) panels in `panels` (`count *
/// kpad * NR` bf16 in the pair layout); `out` is `[split.rows(), count *
/// NR]`.
///
/// Two row blocks by two panels at a time keep four C tiles
/// (`tmm0`..`tmm3`); per block of [`KB`] inputs each panel's weight tile is
/// loaded once and used for all three parts of both row blocks.
///
/// # Safety
/// [`available`] returned true.
#[cfg(target_arch = "x86_64")]
pub unsafe fn group(split: &Split, panels: &[u16], count: usize, out: &mut [f32]) {
    let kpad = split.kpad;
    let width = count * NR;
    assert!((1..=GROUP).contains(&count), "1 to {GROUP} panels");
    assert_eq!(panels.len(), count * kpad * NR, "{count} panels of {kpad}");
    assert!(
        out.len() >= split.rows * width,
        "out holds every padded row"
    );
    let a_stride = KB * 2;
    let c_stride = width * 4;
    let blocks = kpad / KB;
    let b_stride = 2 * NR * 2;
    let row_blocks = split.rows / ROWS;
    // SAFETY (whole body): `available` says the CPU has AMX and the OS gave
    // this process the tile state. Every tile load reads 16 rows of 64
    // bytes: A tiles of row blocks `rb`, `rb + 1 < row_blocks` and input
    // block `kb`, inside `split.parts` (rows and kpad are padded); B rows
    // are the 16 input pairs of block `kb` of panels `q`, `q + 1 < count`,
    // inside `panels`. C stores touch rows of those row blocks
    // (< split.rows) and columns of those panels (< width) of `out`. The
    // tile configuration is loaded once per thread and nothing else in
    // the process uses tiles, so it is the one loaded here.
    unsafe {
        if !CONFIGURED.get() {
            std::arch::asm!("ldtilecfg [{}]", in(reg) CONFIG.0.as_ptr(), options(nostack, readonly));
            CONFIGURED.set(true);
        }
        let (a_all, b_all, c_all) = (split.parts.as_ptr(), panels.as_ptr(), out.as_mut_ptr());
        for rb in (0..row_blocks).step_by(2) {
            let two = rb + 1 < row_blocks;
            for q in (0..count).step_by(2) {
                let pair = q + 1 < count;
                let c = |r: usize, p: usize| c_all.add((rb + r) * ROWS * width + (q + p) * NR);
                // Tiles of a missing row block or panel are never stored.
                std::arch::asm!(
                    "tilezero tmm0",
                    "tilezero tmm1",
                    "tilezero tmm2",
                    "tilezero tmm3",
                    options(nostack, nomem)
                );
                for kb in 0..blocks {
                    let b = b_all.add(q * kpad * NR + kb * KB * NR);
                    std::arch::asm!(
                        "tileloadd tmm4, [{b} + {bs}*1]",
                        b = in(reg) b,
                        bs = in(reg) b_stride,
                        options(nostack, readonly),
                    );
                    if pair {
                        std::arch::asm!(
                            "tileloadd tmm5, [{b} + {bs}*1]",
                            b = in(reg) b.add(kpad * NR),
                            bs = in(reg) b_stride,
                            options(nostack, readonly),
                        );
                    }
                    let a = a_all.add((rb * blocks + kb) * 3 * TILE);
                    // The second row block's tiles, if there is one.
                    let a1 = a.wrapping_add(blocks * 3 * TILE);
                    for part in 0..3 {
                        let (a0, a1) = (a.add(part * TILE), a1.wrapping_add(part * TILE));
                        match (two, pair) {
                            (true, true) => part!(
                                a0,
                                a1,
                                a_stride,
                                "tileloadd tmm6, [{a0} + {as}*1]",
                                "tileloadd tmm7, [{a1} + {as}*1]",
                                "tdpbf16ps tmm0, tmm6, tmm4",
                                "tdpbf16ps tmm1, tmm6, tmm5",
                                "tdpbf16ps tmm2, tmm7, tmm4",
                                "tdpbf16ps tmm3, tmm7, tmm5"
                            ),
                            (true, false) => part!(
                                a0,
                                a1,
                                a_stride,
                                "tileloadd tmm6, [{a0} + {as}*1]",
                                "tileloadd tmm7, [{a1} + {as}*1]",
                                "tdpbf16ps tmm0, tmm6, tmm4",
                                "tdpbf16ps tmm2, tmm7, tmm4"
                            ),
                            (false, true) => part!(
                                a0,
                                a_stride,
                                "tileloadd tmm6, [{a0} + {as}*1]",
                                "tdpbf16ps tmm0, tmm6, tmm4",
                                "tdpbf16ps tmm1, tmm6, tmm5"
                            ),
                            (false, false) => part!(
                                a0,
                                a_stride,
                                "tileloadd tmm6, [{a0} + {as}*1]",
                                "tdpbf16ps tmm0, tmm6, tmm4"
                            ),
                        }
                    }
                }
                store_c!("0", c(0, 0), c_stride);
                if pair {
                    store_c!("1", c(0, 1), c_stride);
                }
                if two {
                    store_c!("2", c(1, 0), c_stride);
                }
                if two && pair {
                    store_c!("3", c(1, 1), c_stride);
                }
            }
        }
    }
}
