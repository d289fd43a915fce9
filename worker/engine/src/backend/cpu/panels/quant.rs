//! Quantized panels: a projection whose checkpoint stores int8, 4-bit,
//! FP8 or FP4 (MXFP4) codes keeps them at their width, in the panel layout, with a scale
//! (and a zero point) per output and group of inputs. A projection widens
//! a block of panels to f32 just before its tiles read it (see
//! [`super::Kernel::group_widened`]), so a decode step reads a quarter
//! (4-bit) or half (8-bit) of the bf16 bytes.
//!
//! Widening computes each weight as [`QuantizedMatrix::weight`] does, the
//! same f32 operations in the same order, so a projection on quantized
//! panels gives the bits of the same projection on the dense f32 matrix
//! that [`QuantizedMatrix::to_f32`] returns (a test holds it).

use lorafleet_artifact::quantization::{Codes, FP4_E2M1, QuantizedMatrix};

use super::NR;

/// How one panel row of codes reads.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Kind {
    /// `NR` int8 bytes.
    Int8,
    /// `NR / 2` bytes of two 4-bit codes (output `2 i` in the low
    /// nibble of byte `i`), each minus `bias`.
    Nibbles { bias: f32 },
    /// `NR` FP8 e4m3 bytes.
    Fp8,
    /// `NR / 2` bytes of two FP4 E2M1 codes, laid out as `Nibbles`, each
    /// read through [`FP4_E2M1`].
    Fp4,
}

/// See the module docs.
#[derive(Debug, Clone, PartialEq)]
pub struct QuantPanels {
    kind: Kind,
    /// Panel `p`, input `k`: its row of codes at `(p * fan_in + k) *
    /// row_bytes`. The last panel is padded with code 0 and scale 0.
    codes: Vec<u8>,
    /// `[panels, groups, NR]`.
    scales: Vec<f32>,
    /// As `scales`; `None` where the format has no zero points.
    zeros: Option<Vec<f32>>,
    /// `[fan_in]`: each input's group.
    group: Vec<u32>,
    groups: usize,
    fan_in: usize,
}

impl QuantPanels {
    /// Packs quantized `[out_i, fan_in]` matrices stacked by rows, as
    /// [`super::PackedLinear::pack`] packs dense ones. `None` when they
    /// do not share one code kind, one group of each input and zero
    /// points alike (the caller then packs their f32 values).
    pub fn pack(stack: &[&QuantizedMatrix]) -> Option<QuantPanels> {
        let first = stack.first()?;
        let fan_in = first.fan_in;
        let kind = kind_of(&first.codes);
        let alike = stack.iter().all(|m| {
            m.fan_in == fan_in
                && kind_of(&m.codes) == kind
                && m.group == first.group
                && m.zeros.is_some() == first.zeros.is_some()
        });
        if !alike {
            return None;
        }
        let groups = first.groups();
        // Each output row of the stack: (its matrix, its row there).
        let rows: Vec<(&QuantizedMatrix, usize)> = stack
            .iter()
            .flat_map(|m| (0..m.out).map(move |o| (*m, o)))
            .collect();
        let panels = rows.len().div_ceil(NR);
        let row_bytes = row_bytes(kind);
        let mut codes = vec![0u8; panels * fan_in * row_bytes];
        let mut scales = vec![0f32; panels * groups * NR];
        let mut zeros = first
            .zeros
            .as_ref()
            .map(|_| vec![0f32; panels * groups * NR]);
        for (at, &(m, o)) in rows.iter().enumerate() {
            let (p, j) = (at / NR, at % NR);
            for k in 0..fan_in {
                let row = &mut codes[(p * fan_in + k) * row_bytes..][..row_bytes];
                let i = o * fan_in + k;
                match &m.codes {
                    Codes::Int8(c) => row[j] = c[i] as u8,
                    Codes::Fp8E4m3(c) => row[j] = c[i],
                    Codes::Int4(c) => row[j / 2] |= ((c[i] + 8) as u8) << (4 * (j % 2)),
                    Codes::Uint4(c) | Codes::Fp4E2m1(c) => row[j / 2] |= c[i] << (4 * (j % 2)),
                }
            }
            for g in 0..groups {
                scales[(p * groups + g) * NR + j] = m.scales[g * m.out + o];
                if let (Some(all), Some(z)) = (zeros.as_mut(), &m.zeros) {
                    all[(p * groups + g) * NR + j] = z[g * m.out + o];
                }
            }
        }
        Some(QuantPanels {
            kind,
            codes,
            scales,
            zeros,
            group: first.group.clone(),
            groups,
            fan_in,
        })
    }

    /// Bytes in memory: codes, scales, zero points and the group map.
    pub fn bytes(&self) -> usize {
        self.codes.len()
            + self.scales.len() * 4
            + self.zeros.as_ref().map_or(0, |z| z.len() * 4)
            + self.group.len() * 4
    }

    /// Output `j` of panel `p`, all `fan_in` weights, as [`Widen::widen`]
    /// computes them.
    pub fn column(&self, p: usize, j: usize, out: &mut [f32]) {
        let mut rows = vec![0f32; self.fan_in * NR];
        self.widen(p, 0, self.fan_in, &mut rows);
        for (v, row) in out.iter_mut().zip(rows.chunks_exact(NR)) {
            *v = row[j];
        }
    }

    /// The codes of panels `from..to`, for prefetching.
    pub fn codes_of(&self, from: usize, to: usize) -> &[u8] {
        let per = self.fan_in * row_bytes(self.kind);
        let end = (to * per).min(self.codes.len());
        &self.codes[(from * per).min(end)..end]
    }
}

fn kind_of(codes: &Codes) -> Kind {
    match codes {
        Codes::Int8(_) => Kind::Int8,
        Codes::Int4(_) => Kind::Nibbles { bias: 8.0 },
        Codes::Uint4(_) => Kind::Nibbles { bias: 0.0 },
        Codes::Fp8E4m3(_) => Kind::Fp8,
        Codes::Fp4E2m1(_) => Kind::Fp4,
    }
}

fn row_bytes(kind: Kind) -> usize {
    match kind {
        Kind::Int8 | Kind::Fp8 => NR,
        Kind::Nibbles { .. } | Kind::Fp4 => NR / 2,
    }
}

/// FP8 e4m3 to f32 without branches: the 7 magnitude bits placed at the
/// top of an f32's exponent and mantissa, then scaled by 2^120, which is
/// exact for normal and subnormal values alike (a subnormal f32 times a
/// power of two that makes it normal). Equal to
/// [`lorafleet_artifact::quantization::fp8_e4m3_to_f32`] for every code
/// but NaN, which loading refuses.
#[inline(always)]
pub fn fp8_e4m3(b: u8) -> f32 {
    let bits = (u32::from(b & 0x80) << 24) | (u32::from(b & 0x7f) << 20);
    f32::from_bits(bits) * f32::from_bits(0x7b80_0000) // 2^120
}

/// Panels that widen to f32 a block of inputs at a time.
pub trait Widen: Sync {
    /// Writes inputs `k0..k1` of panel `panel` as f32 panel rows into
    /// `dst` (`(k1 - k0) * NR` values, k-major).
    fn widen(&self, panel: usize, k0: usize, k1: usize, dst: &mut [f32]);
}

impl Widen for QuantPanels {
    #[inline(always)]
    fn widen(&self, panel: usize, k0: usize, k1: usize, dst: &mut [f32]) {
        #[cfg(target_arch = "x86_64")]
        if super::Kernel::detect() == super::Kernel::Avx512 {
            // SAFETY: `detect` chose AVX-512 only where the CPU has
            // AVX-512F.
            #[allow(unsafe_code)]
            return unsafe { self.widen_avx512(panel, k0, k1, dst) };
        }
        self.widen_portable(panel, k0, k1, dst)
    }
}

impl QuantPanels {
    /// [`Widen::widen`] one scalar at a time.
    #[inline(always)]
    fn widen_portable(&self, panel: usize, k0: usize, k1: usize, dst: &mut [f32]) {
        match self.kind {
            Kind::Int8 => self.widen_rows(panel, k0, k1, dst, |c: &[u8; NR], v| {
                for j in 0..NR {
                    v[j] = f32::from(c[j] as i8);
                }
            }),
            Kind::Fp8 => self.widen_rows(panel, k0, k1, dst, |c: &[u8; NR], v| {
                for j in 0..NR {
                    v[j] = fp8_e4m3(c[j]);
                }
            }),
            Kind::Nibbles { bias } => self.widen_rows(panel, k0, k1, dst, |c: &[u8; NR / 2], v| {
                for i in 0..NR / 2 {
                    v[2 * i] = f32::from(c[i] & 0xf) - bias;
                    v[2 * i + 1] = f32::from(c[i] >> 4) - bias;
                }
            }),
            Kind::Fp4 => self.widen_rows(panel, k0, k1, dst, |c: &[u8; NR / 2], v| {
                for i in 0..NR / 2 {
                    v[2 * i] = FP4_E2M1[usize::from(c[i] & 0xf)];
                    v[2 * i + 1] = FP4_E2M1[usize::from(c[i] >> 4)];
                }
            }),
        }
    }

    /// [`Widen::widen`] a panel row at a time on AVX-512 vectors: the same
    /// operations as [`QuantPanels::widen_portable`] (a subtraction, then
    /// a multiplication, never fused), so the same bits.
    ///
    /// # Safety
    /// The CPU has AVX-512F.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f")]
    #[allow(unsafe_code)]
    unsafe fn widen_avx512(&self, panel: usize, k0: usize, k1: usize, dst: &mut [f32]) {
        use std::arch::x86_64::*;
        let (groups, fan_in, rb) = (self.groups, self.fan_in, row_bytes(self.kind));
        assert!(k0 <= k1 && k1 <= fan_in && dst.len() >= (k1 - k0) * NR);
        let codes = &self.codes[panel * fan_in * rb..][..fan_in * rb];
        let scales = &self.scales[panel * groups * NR..][..groups * NR];
        let zeros = self
            .zeros
            .as_ref()
            .map(|z| &z[panel * groups * NR..][..groups * NR]);
        // Lane j of a nibble row is byte j / 2 shifted by 4 (j % 2).
        let shifts = _mm512_set_epi32(4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0);
        let (low, sign, magnitude) = (
            _mm512_set1_epi32(0xf),
            _mm512_set1_epi32(0x80),
            _mm512_set1_epi32(0x7f),
        );
        let pow120 = _mm512_set1_ps(f32::from_bits(0x7b80_0000));
        // SAFETY: FP4_E2M1 is 16 f32s.
        let fp4 = unsafe { _mm512_loadu_ps(FP4_E2M1.as_ptr()) };
        for (k, out) in (k0..k1).zip(dst.chunks_exact_mut(NR)) {
            let g = self.group[k] as usize;
            // SAFETY: row k of the panel is `rb` bytes inside `codes`
            // (16 for 8-bit codes, 8 for nibbles, each load reads that
            // many); scales and zeros hold NR values at g * NR; `out` is
            // NR values.
            unsafe {
                let c = codes.as_ptr().add(k * rb);
                let v = match self.kind {
                    Kind::Int8 => {
                        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(c.cast())))
                    }
                    Kind::Fp8 => {
                        let b = _mm512_cvtepu8_epi32(_mm_loadu_si128(c.cast()));
                        let bits = _mm512_or_si512(
                            _mm512_slli_epi32::<24>(_mm512_and_si512(b, sign)),
                            _mm512_slli_epi32::<20>(_mm512_and_si512(b, magnitude)),
                        );
                        _mm512_mul_ps(_mm512_castsi512_ps(bits), pow120)
                    }
                    Kind::Nibbles { bias } => {
                        let b = _mm_loadl_epi64(c.cast());
                        let pairs = _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(b, b));
                        let n = _mm512_and_si512(_mm512_srlv_epi32(pairs, shifts), low);
                        _mm512_sub_ps(_mm512_cvtepi32_ps(n), _mm512_set1_ps(bias))
                    }
                    Kind::Fp4 => {
                        let b = _mm_loadl_epi64(c.cast());
                        let pairs = _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(b, b));
                        let n = _mm512_and_si512(_mm512_srlv_epi32(pairs, shifts), low);
                        _mm512_permutexvar_ps(n, fp4)
                    }
                };
                let s = _mm512_loadu_ps(scales.as_ptr().add(g * NR));
                let w = match zeros {
                    Some(z) => {
                        _mm512_mul_ps(_mm512_sub_ps(v, _mm512_loadu_ps(z.as_ptr().add(g * NR))), s)
                    }
                    None => _mm512_mul_ps(v, s),
                };
                _mm512_storeu_ps(out.as_mut_ptr(), w);
            }
        }
    }

    /// [`Widen::widen`] with `decode` turning one panel row of codes into
    /// their values; then `(value - zero) · scale` or `value · scale`.
    #[inline(always)]
    fn widen_rows<const B: usize>(
        &self,
        panel: usize,
        k0: usize,
        k1: usize,
        dst: &mut [f32],
        decode: impl Fn(&[u8; B], &mut [f32; NR]),
    ) {
        let (groups, fan_in) = (self.groups, self.fan_in);
        let scales = &self.scales[panel * groups * NR..][..groups * NR];
        let zeros = self
            .zeros
            .as_ref()
            .map(|z| &z[panel * groups * NR..][..groups * NR]);
        let codes = &self.codes[panel * fan_in * B..][..fan_in * B];
        for (k, out) in (k0..k1).zip(dst.chunks_exact_mut(NR)) {
            let g = self.group[k] as usize;
            let s: &[f32; NR] = scales[g * NR..][..NR].try_into().expect("NR scales");
            let c: &[u8; B] = codes[k * B..][..B].try_into().expect("a row of codes");
            let out: &mut [f32; NR] = out.try_into().expect("NR outputs");
            let mut v = [0f32; NR];
            decode(c, &mut v);
            match zeros {
                Some(z) => {
                    let z: &[f32; NR] = z[g * NR..][..NR].try_into().expect("NR zeros");
                    for j in 0..NR {
                        out[j] = (v[j] - z[j]) * s[j];
                    }
                }
                None => {
                    for j in 0..NR {
                        out[j] = v[j] * s[j];
                    }
                }
            }
        }
    }
}

impl super::Kernel {
    /// [`super::Kernel::group`] on `count` (1 to [`super::GROUP`]) panels
    /// from `first` of `src`, widened to f32 on the way: the bits of the
    /// same call on the widened values. The AVX-512 kernel widens one
    /// block of [`super::KC`] inputs at a time into `scratch` (in L1);
    /// the others widen whole panels first. `scratch` is the caller's to
    /// reuse from call to call.
    #[allow(clippy::too_many_arguments)]
    pub fn group_widened<S: Widen>(
        self,
        x: &[f32],
        fan_in: usize,
        n: usize,
        first: usize,
        count: usize,
        src: &S,
        scratch: &mut Vec<f32>,
        ahead: super::Prefetch,
        out: &mut [f32],
    ) {
        assert!(
            (1..=super::GROUP).contains(&count),
            "1 to {} panels",
            super::GROUP
        );
        assert!(x.len() >= n * fan_in && out.len() == n * count * NR);
        match self {
            #[cfg(target_arch = "x86_64")]
            super::Kernel::Avx512 => {
                scratch.resize(count * super::KC * NR, 0.0);
                // SAFETY: the CPU has AVX-512F, checked by
                // `detect`/`available`; sizes asserted above.
                #[allow(unsafe_code)]
                unsafe {
                    super::x86::group_widened_avx512(
                        x, fan_in, n, first, count, src, scratch, ahead, out,
                    )
                }
            }
            _ => {
                scratch.resize(count * fan_in * NR, 0.0);
                for (q, wide) in scratch.chunks_exact_mut(fan_in * NR).enumerate() {
                    src.widen(first + q, 0, fan_in, wide);
                }
                let wide: Vec<&[f32]> = scratch.chunks_exact(fan_in * NR).collect();
                self.group(x, fan_in, n, &wide, ahead, out);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::{Kernel, PackedLinear};
    use super::*;
    use lorafleet_artifact::quantization::fp8_e4m3_to_f32;

    #[test]
    fn fp8_widening_equals_the_reference_for_every_code() {
        for b in (0..=255u8).filter(|b| b & 0x7f != 0x7f) {
            assert_eq!(
                fp8_e4m3(b).to_bits(),
                fp8_e4m3_to_f32(b).to_bits(),
                "{b:#04x}"
            );
        }
    }

    /// A random `[out, fan_in]` matrix of `kind` codes with `groups`
    /// groups, inputs assigned to them by `group`.
    fn matrix(seed: u64, out: usize, fan_in: usize, kind: &str, group: &[u32]) -> QuantizedMatrix {
        let mut rng = crate::sampling::Rng::new(seed);
        let mut draw = |n: u32| (rng.next_f64() * f64::from(n)) as u32;
        let len = out * fan_in;
        let codes = match kind {
            "int8" | "int8-asym" => {
                Codes::Int8((0..len).map(|_| (draw(256) as i32 - 128) as i8).collect())
            }
            "int4" => Codes::Int4((0..len).map(|_| draw(16) as i8 - 8).collect()),
            "uint4" => Codes::Uint4((0..len).map(|_| draw(16) as u8).collect()),
            "fp4" => Codes::Fp4E2m1((0..len).map(|_| draw(16) as u8).collect()),
            // Every finite code, NaN left out.
            _ => Codes::Fp8E4m3(
                (0..len)
                    .map(|_| draw(256) as u8)
                    .map(|b| if b & 0x7f == 0x7f { b - 1 } else { b })
                    .collect(),
            ),
        };
        let groups = group.iter().max().map_or(1, |g| *g as usize + 1);
        let mut scale = || (draw(1000) as f32 + 1.0) / 7919.0;
        let scales = (0..groups * out).map(|_| scale()).collect();
        let zeros = matches!(kind, "uint4" | "int8-asym")
            .then(|| (0..groups * out).map(|_| draw(16) as f32 - 3.0).collect());
        QuantizedMatrix {
            out,
            fan_in,
            codes,
            scales,
            zeros,
            group: group.to_vec(),
        }
    }

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|f| f.to_bits()).collect()
    }

    #[test]
    fn quantized_panels_give_the_bits_of_their_dequantized_matrix() {
        // (20, 301, ..): tiles of 8, 8 and 4 rows, two blocks of KC inputs
        // and a tail; stacks whose parts end inside a panel; per-tensor,
        // per-group and act-order (permuted) groups.
        for kind in ["int8", "int8-asym", "int4", "uint4", "fp8", "fp4"] {
            let cases: [(usize, usize, Vec<usize>, usize, bool); 5] = [
                (1, 200, vec![20, 13], 64, false),
                (7, 45, vec![9], 32, true),
                (32, 300, vec![48, 16, 16], 300, false),
                (20, 301, vec![80], 128, true),
                (3, 130, vec![7, 7, 7], 32, false),
            ];
            for (n, fan_in, outs, group_size, permuted) in cases {
                let groups = fan_in.div_ceil(group_size);
                let group: Vec<u32> = (0..fan_in)
                    .map(|k| {
                        if permuted {
                            (k * 7 % groups) as u32
                        } else {
                            (k / group_size) as u32
                        }
                    })
                    .collect();
                let stack: Vec<QuantizedMatrix> = outs
                    .iter()
                    .enumerate()
                    .map(|(i, &out)| matrix(i as u64 + 1, out, fan_in, kind, &group))
                    .collect();
                let fan_out: usize = outs.iter().sum();
                let dense: Vec<f32> = stack.iter().flat_map(|m| m.to_f32()).collect();
                let bias: Vec<f32> = (0..fan_out).map(|o| o as f32 / 64.0 - 0.25).collect();
                let x: Vec<f32> = (0..n * fan_in)
                    .map(|i| ((i * 37 % 101) as f32 - 50.0) / 64.0)
                    .collect();
                let refs: Vec<&QuantizedMatrix> = stack.iter().collect();
                let narrow =
                    PackedLinear::pack_quantized(&refs, Some(bias.clone())).expect("one kind");
                let wide = PackedLinear::pack(&dense, Some(bias), fan_in, fan_out);
                let per_weight =
                    narrow.weight_bytes() as f64 / (fan_in * fan_out.next_multiple_of(NR)) as f64;
                let most = if kind.contains('4') { 0.5 } else { 1.0 }
                    + 8.0 * groups as f64 / fan_in as f64
                    + 4.0 / NR as f64;
                assert!(per_weight <= most, "{kind}: {per_weight} bytes a weight");
                for &kernel in &Kernel::available() {
                    let (mut a, mut b) = (vec![0f32; n * fan_out], vec![0f32; n * fan_out]);
                    narrow.forward_with(kernel, false, &x, n, &mut [&mut a]);
                    wide.forward_with(kernel, false, &x, n, &mut [&mut b]);
                    assert_eq!(
                        bits(&a),
                        bits(&b),
                        "{kind} {kernel:?} n={n} fan_in={fan_in} outs={outs:?}"
                    );
                }
            }
        }
    }

    /// The AVX-512 widening gives the portable one's bits, every code of
    /// every kind (the projections above run whichever the CPU has).
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn vector_widening_gives_the_portable_bits() {
        if Kernel::detect() != Kernel::Avx512 {
            eprintln!("no AVX-512 here: only the portable widening runs");
            return;
        }
        let group: Vec<u32> = (0..256).map(|k| (k * 5 % 3) as u32).collect();
        for kind in ["int8", "int8-asym", "int4", "uint4", "fp8", "fp4"] {
            let m = matrix(9, 40, 256, kind, &group);
            let q = QuantPanels::pack(&[&m]).unwrap();
            for p in 0..3 {
                let (mut a, mut b) = (vec![0f32; 200 * NR], vec![1f32; 200 * NR]);
                q.widen_portable(p, 40, 240, &mut a);
                // SAFETY: the CPU has AVX-512F (checked above).
                #[allow(unsafe_code)]
                unsafe {
                    q.widen_avx512(p, 40, 240, &mut b)
                };
                assert_eq!(bits(&a), bits(&b), "{kind} panel {p}");
            }
        }
    }

    #[test]
    fn matrices_that_cannot_share_panels_are_not_packed_together() {
        let group: Vec<u32> = (0..64).map(|k| k / 32).collect();
        let a = matrix(1, 16, 64, "uint4", &group);
        let other_groups = matrix(2, 16, 64, "uint4", &vec![0; 64]);
        let other_kind = matrix(3, 16, 64, "int4", &group);
        assert!(PackedLinear::pack_quantized(&[&a, &other_groups], None).is_none());
        assert!(PackedLinear::pack_quantized(&[&a, &other_kind], None).is_none());
        let both = PackedLinear::pack_quantized(&[&a, &a], None).expect("alike");
        // A row reads back the weights the projection uses.
        let dense = a.to_f32();
        let mut row = vec![0f32; 64];
        for o in [0, 5, 16, 31] {
            both.row(o, &mut row);
            assert_eq!(row, dense[(o % 16) * 64..][..64]);
        }
    }
}
