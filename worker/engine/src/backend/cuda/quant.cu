// Quantized base weights (appended to kernels.cu, whose types and helpers
// these use).
//
// A quantized part of a linear layer is `rows` outputs of `fan_in` inputs:
//   codes   one per weight, row-major: a byte each (int8, FP8 e4m3), or two
//           4-bit values to a byte (4-bit formats; column c of a row in the
//           low nibble when c is even), rows `row_bytes` apart;
//   scales  f32 [groups, rows]; for MXFP4, E8M0 bytes [groups, rows]
//           (the power of two 2^(e - 127), e = 0 the smallest);
//   zeros   f32 [groups, rows], or null: then `offset` is every zero point
//           (8 for signed 4-bit codes stored plus 8, else 0);
//   group   input k's group: k / gsize when gsize > 0, else gidx[k]
//           (GPTQ's act-order).
// A weight is (value(code) - zero) * scale in f32: the CPU reference's
// formula (QuantizedMatrix::weight), with the same roundings.

#define Q_INT8 0
#define Q_UINT4 1
#define Q_FP8 2
#define Q_FP4 3

// FP4 E2M1 (MXFP4's codes: sign, 2 exponent bits, 1 mantissa bit) to f32,
// exactly: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives.
__device__ __forceinline__ float fp4_e2m1_value(unsigned int c) {
    unsigned int e = (c >> 1) & 3, m = c & 1;
    float mag = e == 0 ? 0.5f * (float)m : (1.0f + 0.5f * (float)m) * (float)(1u << (e - 1));
    return (c & 8) ? -mag : mag;
}

// An E8M0 scale byte: 2^(e - 127); e = 0 is 2^-127, an f32 subnormal (255,
// E8M0's NaN, is refused when the checkpoint is read).
__device__ __forceinline__ float e8m0_value(unsigned int e) {
    return e == 0 ? __int_as_float(1 << 22) : __int_as_float((int)(e << 23));
}

// FP8 e4m3 ("fn": no infinities, S.1111.111 is NaN) to f32, exactly.
__device__ __forceinline__ float fp8_e4m3_value(unsigned int b) {
    unsigned int e = (b >> 3) & 0xf, m = b & 7;
    float mag;
    if (e == 0xf && m == 7) {
        mag = __int_as_float(0x7fc00000);
    } else if (e == 0) {
        mag = (float)m * 0.001953125f;  // m/8 * 2^-6
    } else {
        mag = __int_as_float((int)((e + 120) << 23 | m << 20));  // (1 + m/8) * 2^(e-7)
    }
    return (b & 0x80) ? -mag : mag;
}

// f32 to FP8 e4m3, rounding to nearest even and saturating at ±448.
__device__ __forceinline__ unsigned char fp8_e4m3_code(float f) {
    unsigned int sign = (__float_as_uint(f) >> 24) & 0x80;
    float a = fabsf(f);
    if (a != a) return (unsigned char)(sign | 0x7f);
    if (a >= 448.f) return (unsigned char)(sign | 0x7e);
    unsigned int code;
    if (a < 0.015625f) {
        // Subnormal: units of 2^-9; 8 units is the smallest normal's code.
        code = (unsigned int)rintf(a * 512.f);
    } else {
        int ex;
        float m = frexpf(a, &ex);  // a = m 2^ex, m in [0.5, 1)
        int e = ex - 1 + 7;
        unsigned int mant = (unsigned int)rintf((2.f * m - 1.f) * 8.f);
        if (mant == 8) {
            mant = 0;
            e += 1;
        }
        code = (unsigned int)(e << 3) | mant;
        if (code > 0x7e) code = 0x7e;
    }
    return (unsigned char)(sign | code);
}

__device__ __forceinline__ float q_value(const unsigned char* codes, long row_bytes, int format,
                                         int o, int k) {
    const unsigned char* row = codes + (long)o * row_bytes;
    if (format == Q_INT8) return (float)(signed char)row[k];
    if (format == Q_UINT4) return (float)((row[k >> 1] >> ((k & 1) * 4)) & 0xf);
    if (format == Q_FP4) return fp4_e2m1_value((row[k >> 1] >> ((k & 1) * 4)) & 0xf);
    return fp8_e4m3_value(row[k]);
}

__device__ __forceinline__ float q_weight(const unsigned char* codes, long row_bytes, int format,
                                          const float* scales, const float* zeros, float offset,
                                          int gsize, const int* gidx, int rows, int o, int k) {
    int g = gsize > 0 ? k / gsize : gidx[k];
    long s = (long)g * rows + o;
    if (format == Q_FP4)
        return q_value(codes, row_bytes, format, o, k) * e8m0_value(((const unsigned char*)scales)[s]);
    float z = zeros ? zeros[s] : offset;
    return (q_value(codes, row_bytes, format, o, k) - z) * scales[s];
}

#define QT 8

// y[t, y_off + o] = sum_k x[t, k] * W[o, k] for the part's rows o and the
// tokens t of this block's tile (QT tokens): one warp per output row, its
// lanes over the inputs, each weight dequantized once for the tile's
// tokens. x is [n, fan_in] in the weights' type; y f32 with rows y_stride
// apart. Grid: (ceil(rows / 8), ceil(n / QT)), 256 threads.
extern "C" __global__ void __launch_bounds__(256) qmatmul(
    const unsigned char* codes, long row_bytes, int format, const float* scales,
    const float* zeros, float offset, int gsize, const int* gidx, int rows, int fan_in,
    const wt* x, int n, float* y, int y_stride, int y_off) {
    PDL_ENTER();
    int o = blockIdx.x * 8 + (threadIdx.x >> 5);
    int lane = threadIdx.x & 31;
    int t0 = blockIdx.y * QT;
    if (o >= rows) return;
    int tn = min(QT, n - t0);
    float acc[QT];
#pragma unroll
    for (int i = 0; i < QT; ++i) acc[i] = 0.f;
    for (int k = lane; k < fan_in; k += 32) {
        float w = q_weight(codes, row_bytes, format, scales, zeros, offset, gsize, gidx, rows, o, k);
#pragma unroll
        for (int i = 0; i < QT; ++i) {
            if (i < tn) acc[i] = fmaf(w, wload(x[(long)(t0 + i) * fan_in + k]), acc[i]);
        }
    }
#pragma unroll
    for (int i = 0; i < QT; ++i) {
        float v = warp_sum(acc[i]);
        if (lane == 0 && i < tn) y[(long)(t0 + i) * y_stride + y_off + o] = v;
    }
}

// The part's weights dequantized into w ([rows, fan_in], the weights'
// type), for a cuBLAS GEMM over a step of many tokens.
extern "C" __global__ void qdequant(const unsigned char* codes, long row_bytes, int format,
                                    const float* scales, const float* zeros, float offset,
                                    int gsize, const int* gidx, int rows, int fan_in, wt* w) {
    PDL_ENTER();
    long n = (long)rows * fan_in;
    for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x) {
        int o = (int)(i / fan_in), k = (int)(i % fan_in);
        w[i] = wstore(q_weight(codes, row_bytes, format, scales, zeros, offset, gsize, gidx, rows, o, k));
    }
}

// Each token's row of x ([n, fan_in], the weights' type) as FP8 e4m3 with
// its own scale, max|x| / 448 (1 for a row of zeros): xq = x / scale.
// One block of 256 threads per row.
extern "C" __global__ void __launch_bounds__(256) fp8_rows(const wt* x, int fan_in,
                                                           unsigned char* xq, float* row_scale) {
    PDL_ENTER();
    __shared__ float part[8];
    int t = blockIdx.x;
    const wt* row = x + (long)t * fan_in;
    float m = 0.f;
    for (int k = threadIdx.x; k < fan_in; k += 256) m = fmaxf(m, fabsf(wload(row[k])));
    m = warp_max(m);
    if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = m;
    __syncthreads();
    if (threadIdx.x < 32) {
        float v = threadIdx.x < 8 ? part[threadIdx.x] : 0.f;
        v = warp_max(v);
        if (threadIdx.x == 0) part[0] = v > 0.f ? v / 448.f : 1.f;
    }
    __syncthreads();
    float s = part[0];
    if (threadIdx.x == 0) row_scale[t] = s;
    for (int k = threadIdx.x; k < fan_in; k += 256) {
        xq[(long)t * fan_in + k] = fp8_e4m3_code(wload(row[k]) / s);
    }
}

// A quantized layer's inputs as its checkpoint's dynamic input scheme
// quantizes them (compressed-tensors' forward; the CPU's
// InputQuantization::apply): for token t and span g of `span` inputs (the
// row, or a group), scale = max|x| / half (127.5 for int8, 448 for FP8; f32
// epsilon when 0), out = round(clamp(x / scale)) * scale, to an integer in
// [-128, 127] (ties to even) or the nearest e4m3 value in [-448, 448].
// Grid: (n, ceil(fan_in / span)), 256 threads.
extern "C" __global__ void __launch_bounds__(256) quant_inputs(const wt* x, int fan_in, int span,
                                                               int fp8, wt* out) {
    PDL_ENTER();
    __shared__ float part[8];
    int t = blockIdx.x;
    int lo = blockIdx.y * span, hi = min(fan_in, lo + span);
    const wt* row = x + (long)t * fan_in;
    float m = 0.f;
    for (int k = lo + threadIdx.x; k < hi; k += 256) m = fmaxf(m, fabsf(wload(row[k])));
    m = warp_max(m);
    if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = m;
    __syncthreads();
    if (threadIdx.x < 32) {
        float v = threadIdx.x < 8 ? part[threadIdx.x] : 0.f;
        v = warp_max(v);
        if (threadIdx.x == 0) {
            float s = __fdiv_rn(v, fp8 ? 448.f : 127.5f);
            part[0] = s == 0.f ? 1.1920929e-7f : s;
        }
    }
    __syncthreads();
    float s = part[0];
    for (int k = lo + threadIdx.x; k < hi; k += 256) {
        float v = __fdiv_rn(wload(row[k]), s);
        float q = fp8 ? fp8_e4m3_value(fp8_e4m3_code(fminf(fmaxf(v, -448.f), 448.f)))
                      : rintf(fminf(fmaxf(v, -128.f), 127.f));
        out[(long)t * fan_in + k] = wstore(q * s);
    }
}

// The FP8 GEMM's epilogue: y[t, o] *= row_scale[t] * col_scale[o].
extern "C" __global__ void fp8_scale(float* y, const float* row_scale, const float* col_scale,
                                     int n, int width) {
    PDL_ENTER();
    long total = (long)n * width;
    for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (long)gridDim.x * blockDim.x)
        y[i] = y[i] * (row_scale[i / width] * col_scale[i % width]);
}
