// The CUDA backend's kernels, compiled with NVRTC when a backend starts.
//
// The backend prepends the model's shapes as defines, so loops over them
// have compile-time bounds:
//   WDTYPE     the base weights' type: 0 f32, 1 bf16, 2 f16
//   SDTYPE     the adapter slots' type, likewise (the weights' by default)
//   HEAD_DIM   attention head size (even)
//   MAX_RANK   the rank every adapter slot is sized for
//   SHRINK_KC  input features per split-K chunk of the LoRA shrink (a multiple of 32)
//   LORA_TT    tokens per tile of the LoRA kernels
//   PANEL      outputs per panel of the host tier's packed expert factors
//
// Activations, the residual stream and all LoRA math are f32; the base
// GEMMs (cuBLAS) read the weights' type, and the KV cache and the adapter
// slots are stored in it (keys and values are rounded once, when stored;
// an adapter once, when written into a slot, and not at all when its file
// holds that type). Every reduction in
// these kernels has a fixed order that depends on the token's own data,
// never on the batch. cuBLAS makes no such promise: it may pick another
// algorithm for another batch size.

// Programmatic dependent launch (compute 9.0 and newer): the first
// statement of every kernel. A kernel launched with programmatic stream
// serialization (`Device::set_pdl`) may be scheduled while the kernel
// before it drains; it waits here, before any load or store, until that
// kernel has finished and its writes are visible, then lets the next one
// be scheduled. So a kernel never sees another's partial output, and only
// the launch latency between the two overlaps. Without that launch
// attribute both instructions return at once.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define PDL_ENTER()                                         \
    do {                                                    \
        asm volatile("griddepcontrol.wait;" ::: "memory");  \
        asm volatile("griddepcontrol.launch_dependents;");  \
    } while (0)
#else
#define PDL_ENTER() \
    do {            \
    } while (0)
#endif

#if WDTYPE == 0
typedef float wt;
__device__ __forceinline__ float wload(wt v) { return v; }
__device__ __forceinline__ wt wstore(float v) { return v; }
#else
typedef unsigned short wt;
#if WDTYPE == 1
__device__ __forceinline__ float wload(wt v) { return __uint_as_float(((unsigned int)v) << 16); }
__device__ __forceinline__ wt wstore(float v) {
    unsigned short r;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(v));
    return r;
}
#else
__device__ __forceinline__ float wload(wt v) {
    float r;
    asm("cvt.f32.f16 %0, %1;" : "=f"(r) : "h"(v));
    return r;
}
__device__ __forceinline__ wt wstore(float v) {
    unsigned short r;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(v));
    return r;
}
#endif
#endif

// The adapter slots' values, read as f32.
#if SDTYPE == 0
typedef float st;
__device__ __forceinline__ float sload(st v) { return v; }
#elif SDTYPE == 1
typedef unsigned short st;
__device__ __forceinline__ float sload(st v) { return __uint_as_float(((unsigned int)v) << 16); }
#else
typedef unsigned short st;
__device__ __forceinline__ float sload(st v) {
    float r;
    asm("cvt.f32.f16 %0, %1;" : "=f"(r) : "h"(v));
    return r;
}
#endif

#define FULL_MASK 0xffffffffu
// NVRTC has no math.h.
#define INFINITY __int_as_float(0x7f800000)

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, o));
    return v;
}

// Sixteen sums across a warp at once: a reduce-scatter over the lane bits
// 16, 8, 4 and 2, then a final exchange over bit 1. Each value's partial
// sums pair up in the order of `warp_sum` (xor 16 first, then 8, 4, 2, 1)
// and IEEE addition commutes, so every value is bitwise what `warp_sum`
// gives it; lanes 2m and 2m + 1 both hold value m. 16 shuffles, not 80.
__device__ __forceinline__ float reduce16(float v[16], int lane) {
#pragma unroll
    for (int width = 8, bit = 16; width >= 1; width >>= 1, bit >>= 1) {
        bool upper = (lane & bit) != 0;
#pragma unroll
        for (int m = 0; m < width; m++) {
            float send = upper ? v[m] : v[m + width];
            float keep = upper ? v[m + width] : v[m];
            v[m] = keep + __shfl_xor_sync(FULL_MASK, send, bit);
        }
    }
    return v[0] + __shfl_xor_sync(FULL_MASK, v[0], 1);
}

// Block-wide reductions; blockDim.x is a multiple of 32. `scratch` holds 32
// floats. The leading barrier lets one scratch serve consecutive calls.
__device__ float block_sum(float v, float* scratch) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    if (warp == 0) {
        float r = warp_sum(lane < warps ? scratch[lane] : 0.0f);
        if (lane == 0) scratch[0] = r;
    }
    __syncthreads();
    return scratch[0];
}

__device__ float block_max(float v, float* scratch) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    if (warp == 0) {
        float r = warp_max(lane < warps ? scratch[lane] : -INFINITY);
        if (lane == 0) scratch[0] = r;
    }
    __syncthreads();
    return scratch[0];
}

// out[t] = table[tokens[t]] as f32, times `scale` (Gemma's √hidden; 1
// otherwise). Grid: one block per token.
extern "C" __global__ void embed(const wt* table, const int* tokens, float* out, int d, float scale, int vocab) {
    PDL_ENTER();
    int tok = tokens[blockIdx.x];
    float* o = out + (size_t)blockIdx.x * d;
    // A token past the base's vocabulary (an adapter's grown one, whose
    // own row `embed_saved` puts in next) reads nothing here.
    if (tok >= vocab) {
        for (int i = threadIdx.x; i < d; i += blockDim.x) o[i] = 0.0f;
        return;
    }
    const wt* row = table + (size_t)tok * d;
    for (int i = threadIdx.x; i < d; i += blockDim.x) o[i] = wload(row[i]) * scale;
}

// Embedding LoRA (PEFT's lora.Embedding) of one segment's tokens, added
// after the embedding, times the embedding's own scale as PEFT scales it
// (Gemma's, `embed_scale`; 1 for others):
//   hidden[t] += scale * B * A[:, tokens[t]] * embed_scale
// for t in [first, first + gridDim.x); a_t is [vocab, rank] (a token's
// column of A as a row), b [d, rank]. Grid: one block per token.
extern "C" __global__ void embed_lora(const int* tokens, int first, float* hidden, int d, const float* a_t,
                                      const float* b, int rank, float scale, float embed_scale, int vocab) {
    PDL_ENTER();
    __shared__ float as[MAX_RANK];
    int t = first + blockIdx.x;
    if (tokens[t] >= vocab) return;  // a grown vocabulary's row has no A
    const float* a = a_t + (size_t)tokens[t] * rank;
    for (int r = threadIdx.x; r < rank; r += blockDim.x) as[r] = a[r];
    __syncthreads();
    float* row = hidden + (size_t)t * d;
    for (int o = threadIdx.x; o < d; o += blockDim.x) {
        const float* bo = b + (size_t)o * rank;
        float acc = 0.0f;
        for (int r = 0; r < rank; r++) acc += as[r] * bo[r];
        row[o] += acc * scale * embed_scale;
    }
}

// An adapter's own embedding rows (`modules_to_save`,
// `trainable_token_indices`) in place of the base's for one segment's
// tokens, times Gemma's scale as the base's are: every token's row when
// `ids` is null (the layer saved whole), else the rows of the tokens listed
// in ids[0, n_ids), row i for ids[i]; `values` in the weights' type, as
// the base's table. Grid: one block per token.
extern "C" __global__ void embed_saved(const int* tokens, int first, float* hidden, int d, const wt* values,
                                       const int* ids, int n_ids, float scale) {
    PDL_ENTER();
    int t = first + blockIdx.x;
    int tok = tokens[t];
    int row = ids == nullptr ? tok : -1;
    for (int i = 0; ids != nullptr && i < n_ids; i++) {
        if (ids[i] == tok) {
            row = i;
            break;
        }
    }
    if (row < 0) return;  // the base's row stands
    const wt* src = values + (size_t)row * d;
    float* dst = hidden + (size_t)t * d;
    for (int o = threadIdx.x; o < d; o += blockDim.x) dst[o] = wload(src[o]) * scale;
}

// An adapter's own lm_head rows of the tokens listed in ids[0, n_ids):
//   logits[row, ids[j]] = values[j] . h[row]
// for rows [first, first + gridDim.x) of the normed final hidden states h
// ([rows, d]), replacing the base's. One warp per listed token.
// Grid: (rows, ceil(n_ids / 8)); block: 256.
extern "C" __global__ void saved_logits(const float* h, int d, int first, float* logits, int vocab,
                                        const float* values, const int* ids, int n_ids) {
    PDL_ENTER();
    int row = first + blockIdx.x;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int j = blockIdx.y * (blockDim.x >> 5) + warp;
    if (j >= n_ids) return;
    const float* hr = h + (size_t)row * d;
    const float* v = values + (size_t)j * d;
    float acc = 0.0f;
    for (int k = lane; k < d; k += 32) acc = fmaf(v[k], hr[k], acc);
    acc = warp_sum(acc);
    if (lane == 0) logits[(size_t)row * vocab + ids[j]] = acc;
}

// RMSNorm of rows of `x` (row `rows[b]`, or row b when `rows` is null) into
// `out` (f32) and, when `out_w` is not null, the same values in the
// weights' type for the next GEMM. Grid: one block per output row.
extern "C" __global__ void rms_norm(const float* x, const int* rows, const float* w, float* out,
                                    wt* out_w, int d, float eps) {
    PDL_ENTER();
    __shared__ float scratch[32];
    int src = rows ? rows[blockIdx.x] : blockIdx.x;
    const float* xr = x + (size_t)src * d;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < d; i += blockDim.x) ss = fmaf(xr[i], xr[i], ss);
    ss = block_sum(ss, scratch);
    float inv = 1.0f / sqrtf(ss / (float)d + eps);
    float* o = out + (size_t)blockIdx.x * d;
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        float v = w[i] * (xr[i] * inv);
        o[i] = v;
        if (out_w) out_w[(size_t)blockIdx.x * d + i] = wstore(v);
    }
}

// y = x in the weights' type (the input of a base GEMM).
extern "C" __global__ void to_wt(const float* x, wt* y, long n) {
    PDL_ENTER();
    for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x)
        y[i] = wstore(x[i]);
}

// y[r, c] += bias[c] for `rows` rows of `width`.
extern "C" __global__ void add_bias(float* y, const float* bias, int rows, int width) {
    PDL_ENTER();
    long n = (long)rows * width;
    for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x)
        y[i] += bias[i % width];
}

// h += y, elementwise (the residual stream).
extern "C" __global__ void add_into(float* h, const float* y, long n) {
    PDL_ENTER();
    for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x)
        h[i] += y[i];
}

// out[t, i] = silu(gate) * up for rows of `gu` laid out [gate | up], each
// `inter` wide; also in the weights' type when `out_w` is not null.
extern "C" __global__ void silu_mul(const float* gu, float* out, wt* out_w, int rows, int inter) {
    PDL_ENTER();
    long n = (long)rows * inter;
    for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x) {
        long t = i / inter, c = i % inter;
        float g = gu[t * 2 * inter + c], u = gu[t * 2 * inter + inter + c];
        float v = g / (1.0f + expf(-g)) * u;
        out[i] = v;
        if (out_w) out_w[i] = wstore(v);
    }
}

// out[t, i] = gelu_tanh(gate) * up (Gemma's `gelu_pytorch_tanh` GeGLU), as
// silu_mul lays out its rows: 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))).
extern "C" __global__ void gelu_mul(const float* gu, float* out, wt* out_w, int rows, int inter) {
    PDL_ENTER();
    long n = (long)rows * inter;
    for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x) {
        long t = i / inter, c = i % inter;
        float g = gu[t * 2 * inter + c], u = gu[t * 2 * inter + inter + c];
        float inner = 0.7978845608028654f * (g + 0.044715f * g * g * g);
        float v = 0.5f * g * (1.0f + tanhf(inner)) * u;
        out[i] = v;
        if (out_w) out_w[i] = wstore(v);
    }
}

// x = tanh(x / cap) * cap, elementwise (Gemma 2's final-logit soft-capping).
extern "C" __global__ void softcap(float* x, long n, float cap) {
    PDL_ENTER();
    // -inf (a row's logits past its own vocabulary) stays -inf.
    for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x)
        if (x[i] != -INFINITY) x[i] = tanhf(x[i] / cap) * cap;
}

// A step's logits as wide as its widest row (an adapter's grown
// vocabulary): row r of `src` ([rows, vocab]) into row r of `dst`
// ([rows, width]), -inf past the base's vocabulary. Grid: elementwise over
// rows * width.
extern "C" __global__ void widen_logits(const float* src, int vocab, float* dst, int width, long n) {
    PDL_ENTER();
    for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x) {
        long r = i / width;
        int j = (int)(i % width);
        dst[i] = j < vocab ? src[r * vocab + j] : -INFINITY;
    }
}

// Rotates the query and key heads of each token's fused [q | k | v] row in
// place (rotate-half RoPE over each head's first 2 * rot_half dimensions;
// the rest pass through), with cos and sin times `factor` (YaRN's and
// LongRoPE's attention factor, 1 otherwise) as transformers scales them,
// then stores its key and value at its KV-cache row, in the weights' type.
// The frequencies are one row shared by every token (`freq_stride` 0), or
// each token's own row `freq_stride` apart (LongRoPE's short or long
// factors, dynamic NTK's by context length: the host writes them per
// step). Grid: one block per token.
extern "C" __global__ void rope_store(float* qkv, int q_dim, int kv_dim, const int* pos,
                                      const int* kv_row, const float* inv_freq, int freq_stride,
                                      int rot_half, float factor, wt* k_cache, wt* v_cache) {
    PDL_ENTER();
    float* row = qkv + (size_t)blockIdx.x * (q_dim + 2 * kv_dim);
    float p = (float)pos[blockIdx.x];
    inv_freq += (size_t)blockIdx.x * freq_stride;
    int nq = q_dim / HEAD_DIM, heads = nq + kv_dim / HEAD_DIM;
    for (int i = threadIdx.x; i < heads * rot_half; i += blockDim.x) {
        int head = i / rot_half, j = i % rot_half;
        float* hp = head < nq ? row + head * HEAD_DIM : row + q_dim + (head - nq) * HEAD_DIM;
        float s, c;
        sincosf(p * inv_freq[j], &s, &c);
        c *= factor;
        s *= factor;
        float x1 = hp[j], x2 = hp[j + rot_half];
        hp[j] = x1 * c - x2 * s;
        hp[j + rot_half] = x2 * c + x1 * s;
    }
    __syncthreads();
    wt* kd = k_cache + (size_t)kv_row[blockIdx.x] * kv_dim;
    wt* vd = v_cache + (size_t)kv_row[blockIdx.x] * kv_dim;
    for (int i = threadIdx.x; i < kv_dim; i += blockDim.x) {
        kd[i] = wstore(row[q_dim + i]);
        vd[i] = wstore(row[q_dim + kv_dim + i]);
    }
}

// Per-head RMSNorm of the query and key heads of each token's fused
// [q | k | v] row, in place, before RoPE (Qwen3's q_norm and k_norm, each
// HEAD_DIM weights): the CPU backend's rms_norm over each head. Grid: one
// block per token; each warp takes heads in turn.
extern "C" __global__ void head_norm(float* qkv, int q_dim, int kv_dim, const float* q_w,
                                     const float* k_w, float eps) {
    PDL_ENTER();
    float* row = qkv + (size_t)blockIdx.x * (q_dim + 2 * kv_dim);
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    int nq = q_dim / HEAD_DIM, heads = nq + kv_dim / HEAD_DIM;
    for (int head = warp; head < heads; head += warps) {
        // The key heads follow the query heads in the row.
        float* hp = row + (size_t)head * HEAD_DIM;
        const float* w = head < nq ? q_w : k_w;
        float ss = 0.0f;
        for (int i = lane; i < HEAD_DIM; i += 32) ss = fmaf(hp[i], hp[i], ss);
        ss = warp_sum(ss);
        float inv = 1.0f / sqrtf(ss / (float)HEAD_DIM + eps);
        for (int i = lane; i < HEAD_DIM; i += 32) hp[i] = w[i] * (hp[i] * inv);
    }
}

#define ATTN_CHUNK 128

// The KV-cache row of position j: through the sequence's block table, or
// (ring_len > 0) its ring of ring_len blocks reused as the window moves.
__device__ __forceinline__ size_t kv_row_of(const int* bt, int block_size, int ring_len, int j) {
    int b = j / block_size;
    if (ring_len > 0) b %= ring_len;
    return (size_t)bt[b] * block_size + j % block_size;
}

// A scaled attention score, soft-capped (tanh(s / cap) * cap) when cap > 0.
__device__ __forceinline__ float attn_score(const float* qs, const wt* k_cache, int kv_dim, int kvh,
                                            const int* bt, int block_size, int ring_len, int j,
                                            float scale, float cap) {
    size_t row = kv_row_of(bt, block_size, ring_len, j);
    const wt* kr = k_cache + row * kv_dim + kvh * HEAD_DIM;
    float acc = 0.0f;
#pragma unroll 8
    for (int i = 0; i < HEAD_DIM; i++) acc = fmaf(qs[i], wload(kr[i]), acc);
    float s = acc * scale;
    return cap > 0.0f ? tanhf(s / cap) * cap : s;
}

// The most warps an attention block may have (its shared accumulators).
#define ATTN_MAX_WARPS 8
// Output dimensions per lane in the value pass.
#define ATTN_DPL ((HEAD_DIM + 31) / 32)

// Paged attention for decode and prefill alike: token t (position pos[t],
// of sequence tok_seq[t]) attends to its sequence's keys at positions
// lo..=pos[t] through the block table, which the same step's rope_store
// has already filled. Grid: (tokens, query heads); block: 32 to
// 32 * ATTN_MAX_WARPS threads, a multiple of 32 and at least HEAD_DIM / 2.
// A query head reads KV head h / group (grouped-query attention). `window`
// > 0 is a sliding window. With ring_len > 0 (a sliding layer of a model
// with both kinds), `block_tables` holds each sequence's ring, ring_len
// entries apart, and `bt_off` is not read. `cap` > 0 soft-caps the scores
// (Gemma 2).
//
// The value pass spreads positions over the warps (warp w takes positions
// w, w + warps, ...) with each lane owning output dimensions lane + 32 i,
// so a warp reads whole value rows at once and the warps' loads overlap;
// the warps' partial sums are then added in warp order. Every order
// depends on the token's position alone, never on the batch.
extern "C" __global__ void attention(const float* qkv, int q_dim, int kv_dim, const wt* k_cache,
                                     const wt* v_cache, const int* pos, const int* tok_seq,
                                     const int* bt_off, const int* block_tables, int block_size,
                                     int ring_len, int window, float scale, float cap,
                                     const float* sinks, float* out) {
    PDL_ENTER();
    __shared__ float qs[HEAD_DIM];
    __shared__ float sc[ATTN_CHUNK];
    __shared__ float scratch[32];
    __shared__ float part[ATTN_MAX_WARPS][HEAD_DIM];
    __shared__ float part_l[ATTN_MAX_WARPS];
    int t = blockIdx.x, h = blockIdx.y;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    int group = (q_dim / HEAD_DIM) / (kv_dim / HEAD_DIM);
    int kvh = h / group;
    const float* q = qkv + (size_t)t * (q_dim + 2 * kv_dim) + h * HEAD_DIM;
    for (int i = threadIdx.x; i < HEAD_DIM; i += blockDim.x) qs[i] = q[i];
    __syncthreads();
    int p = pos[t];
    int lo = window > 0 ? max(0, p + 1 - window) : 0;
    const int* bt = ring_len > 0 ? block_tables + (size_t)tok_seq[t] * ring_len
                                 : block_tables + bt_off[tok_seq[t]];
    float m = -INFINITY;
    for (int j = lo + threadIdx.x; j <= p; j += blockDim.x)
        m = fmaxf(m, attn_score(qs, k_cache, kv_dim, kvh, bt, block_size, ring_len, j, scale, cap));
    m = block_max(m, scratch);
    // GPT-OSS's sink logit joins the maximum and, below, the sum; it weighs
    // no value.
    if (sinks) m = fmaxf(m, sinks[h]);
    float acc[ATTN_DPL];
#pragma unroll
    for (int i = 0; i < ATTN_DPL; i++) acc[i] = 0.0f;
    float l = 0.0f;
    for (int c0 = lo; c0 <= p; c0 += ATTN_CHUNK) {
        int cn = min(ATTN_CHUNK, p + 1 - c0);
        __syncthreads();
        for (int j = threadIdx.x; j < cn; j += blockDim.x)
            sc[j] = expf(attn_score(qs, k_cache, kv_dim, kvh, bt, block_size, ring_len, c0 + j,
                                    scale, cap) - m);
        __syncthreads();
#pragma unroll 4
        for (int j = warp; j < cn; j += warps) {
            int jj = c0 + j;
            size_t row = kv_row_of(bt, block_size, ring_len, jj);
            const wt* vr = v_cache + row * kv_dim + kvh * HEAD_DIM;
            float w = sc[j];
            l += w;
#pragma unroll
            for (int i = 0; i < ATTN_DPL; i++) {
                int d = lane + 32 * i;
                if (d < HEAD_DIM) acc[i] = fmaf(w, wload(vr[d]), acc[i]);
            }
        }
    }
#pragma unroll
    for (int i = 0; i < ATTN_DPL; i++) {
        int d = lane + 32 * i;
        if (d < HEAD_DIM) part[warp][d] = acc[i];
    }
    if (lane == 0) part_l[warp] = l;
    __syncthreads();
    float* o = out + (size_t)t * q_dim + h * HEAD_DIM;
    for (int d = threadIdx.x; d < HEAD_DIM; d += blockDim.x) {
        float a = 0.0f, total = 0.0f;
        for (int w = 0; w < warps; w++) {
            a += part[w][d];
            total += part_l[w];
        }
        if (sinks) total += expf(sinks[h] - m);
        o[d] = a / total;
    }
}

// Threads per block of the LoRA kernels (the launches use this many).
#define LORA_THREADS 256

// LORA_TT, tokens per tile in the LoRA kernels: a segment of many tokens
// (one adapter with a long prefill, or a large batch on few adapters) is
// cut into tiles, each its own block, so the grid fills the device
// whatever the adapter mix; a tile's A and B rows are shared by its
// tokens through registers and shared memory.

// The step's LoRA work: `tiles[0]` is the number of tiles, and tile i is
// `tiles[1 + 3 * i ..]`: its slot, and its tokens' first and end indices
// into token_idx (at most LORA_TT tokens of one segment). The count is
// device data, so a grid captured in a CUDA graph for the most tiles a
// batch size can have serves any adapter mix: blocks past the count
// return at once. The section holds an entry (real or padding) for every
// block of the grid, so the count and the entry are read in one round
// trip.
__device__ __forceinline__ bool lora_tile(const int* tiles, int i, int* slot, int* lo, int* hi) {
    int count = tiles[0];
    const int* t = tiles + 1 + 3 * i;
    *slot = t[0];
    *lo = t[1];
    *hi = t[2];
    return i < count;
}

// Grouped LoRA shrink (SGMV), one launch for every adapter in the step and
// for up to three projections that share the input (q/k/v, gate/up):
//   h_part[slice][split][tok][r] = sum over this split's k of x[tok, k] * A[slot, r, k]
// for each tile's tokens (all of one segment, so one slot) and r below the
// slot's rank for that projection; rows past the rank are never computed
// or read. A slice's A holds each slot's [MAX_RANK, fan_in] rows `a_stride`
// values apart (every slot's adapter in one image, in the backend), and its
// ranks are [slots].
// Split-K: block y covers input features [y * SHRINK_KC, (y + 1) *
// SHRINK_KC); the expand sums the splits in order, so no atomics and a
// fixed order.
// Grid: (tiles, splits, slices); block: 256 threads (8 warps).
extern "C" __global__ void __launch_bounds__(LORA_THREADS) lora_shrink(const float* x, int fan_in, int n, const int* token_idx,
                                       const int* seg_off, const int* seg_slot, const int* tiles,
                                       const st* a0, const st* a1, const st* a2,
                                       const int* rank0, const int* rank1, const int* rank2,
                                       float* h_part, long long a_stride) {
    PDL_ENTER();
    __shared__ float xs[LORA_TT * SHRINK_KC];
    const st* a = blockIdx.z == 0 ? a0 : (blockIdx.z == 1 ? a1 : a2);
    const int* ranks = blockIdx.z == 0 ? rank0 : (blockIdx.z == 1 ? rank1 : rank2);
    int slot, lo, hi;
    if (!lora_tile(tiles, blockIdx.x, &slot, &lo, &hi)) return;  // the whole block
    int rank = ranks[slot];
    if (rank == 0) return;  // the adapter has no such module
    int k0 = blockIdx.y * SHRINK_KC, kn = min(SHRINK_KC, fan_in - k0);
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    float* part = h_part + ((size_t)blockIdx.z * gridDim.y + blockIdx.y) * n * MAX_RANK;
    int tt = hi - lo;
    __shared__ int toks[LORA_TT];
    if (threadIdx.x < LORA_TT) toks[threadIdx.x] = threadIdx.x < tt ? token_idx[lo + threadIdx.x] : 0;
    __syncthreads();
    // The tile's inputs, rows past the tile zero: every load issued before
    // the first store, so their latencies overlap.
    float xv[LORA_TT * SHRINK_KC / LORA_THREADS];
#pragma unroll
    for (int it = 0; it < LORA_TT * SHRINK_KC / LORA_THREADS; it++) {
        int i = threadIdx.x + it * LORA_THREADS, j = i / SHRINK_KC, k = i % SHRINK_KC;
        xv[it] = j < tt && k < kn ? x[(size_t)toks[j] * fan_in + k0 + k] : 0.0f;
    }
#pragma unroll
    for (int it = 0; it < LORA_TT * SHRINK_KC / LORA_THREADS; it++) xs[threadIdx.x + it * LORA_THREADS] = xv[it];
    __syncthreads();
    // Each warp takes four rank rows at a time, their chunks of A in
    // registers, and four tokens at a time: every x value read from
    // shared memory feeds four rows. The sixteen dot products then reduce
    // across the warp together (`reduce16`), in the same tree as
    // `warp_sum`, so a token's sum never depends on its place in a tile.
    const st* abase = a + (size_t)slot * a_stride + k0;
    for (int r0 = 4 * warp; r0 < rank; r0 += 4 * warps) {
        float av[4][SHRINK_KC / 32];
#pragma unroll
        for (int q = 0; q < 4; q++) {
#pragma unroll
            for (int i = 0; i < SHRINK_KC / 32; i++) {
                int k = lane + 32 * i;
                av[q][i] = r0 + q < rank && k < kn ? sload(abase[(size_t)(r0 + q) * fan_in + k]) : 0.0f;
            }
        }
        for (int j0 = 0; j0 < tt; j0 += 4) {
            float acc[16];
#pragma unroll
            for (int v = 0; v < 16; v++) acc[v] = 0.0f;
#pragma unroll
            for (int i = 0; i < SHRINK_KC / 32; i++) {
                float xv[4];
#pragma unroll
                for (int u = 0; u < 4; u++) xv[u] = xs[(j0 + u) * SHRINK_KC + lane + 32 * i];
#pragma unroll
                for (int q = 0; q < 4; q++) {
#pragma unroll
                    for (int u = 0; u < 4; u++) acc[q * 4 + u] = fmaf(av[q][i], xv[u], acc[q * 4 + u]);
                }
            }
            // Lane L ends with value (L >> 1) & 15: row r0 + that / 4,
            // token j0 + that % 4. Even lanes write it.
            float sum = reduce16(acc, lane);
            int v = (lane >> 1) & 15, q = v >> 2, u = v & 3;
            if ((lane & 1) == 0 && r0 + q < rank && j0 + u < tt)
                part[(size_t)token_idx[lo + j0 + u] * MAX_RANK + r0 + q] = sum;
        }
    }
}

// Grouped LoRA expand, the shrink's partner:
//   out[tok, off + o] += scale[slot] * sum_r h[tok, r] * B[slot, r, o]
// with h the shrink's splits summed in order. Each slice has its own B
// (each slot's [MAX_RANK, width] Bᵀ rows, `b_stride` values apart), width
// and column offset into the
// fused output row of `out_stride` (q/k/v into [q | k | v], gate/up into
// [gate | up]). A slot's flags of the slice (`flags[slot]`) add what PEFT
// adds beside the product: bit 1 (`lora_bias`) the slot's `c = s·b_B`
// (`vec + width`), bit 0 (DoRA) then turns the row into
// `β + g ⊙ (y + δ − β)`, g the slot's `m / ‖W + s·B·A‖` (`vec`) and β the
// base projection's bias (`bias`, or none). A slot's vectors start
// `v_stride` values after the previous slot's. Grid: (tiles, ceil(max
// width / 256), slices); block: 256.
extern "C" __global__ void __launch_bounds__(LORA_THREADS) lora_expand(const float* h_part, int splits, int n, const int* token_idx,
                                       const int* seg_off, const int* seg_slot, const int* tiles,
                                       const st* b0, const st* b1, const st* b2,
                                       const int* rank0, const int* rank1, const int* rank2,
                                       const float* scale0, const float* scale1,
                                       const float* scale2, int width0, int width1, int width2,
                                       int off0, int off1, int off2, float* out, int out_stride,
                                       long long b_stride0, long long b_stride1, long long b_stride2,
                                       const int* flags0, const int* flags1, const int* flags2,
                                       const float* vec0, const float* vec1, const float* vec2,
                                       const float* bias0, const float* bias1, const float* bias2,
                                       long long v_stride) {
    PDL_ENTER();
    __shared__ float hs[LORA_TT * MAX_RANK];
    int z = blockIdx.z;
    const st* b = z == 0 ? b0 : (z == 1 ? b1 : b2);
    const int* ranks = z == 0 ? rank0 : (z == 1 ? rank1 : rank2);
    const float* scales = z == 0 ? scale0 : (z == 1 ? scale1 : scale2);
    int width = z == 0 ? width0 : (z == 1 ? width1 : width2);
    int off = z == 0 ? off0 : (z == 1 ? off1 : off2);
    long long b_stride = z == 0 ? b_stride0 : (z == 1 ? b_stride1 : b_stride2);
    int slot, lo, hi;
    if (!lora_tile(tiles, blockIdx.x, &slot, &lo, &hi)) return;  // the whole block
    int rank = ranks[slot];
    if (rank == 0 || blockIdx.y * blockDim.x >= width) return;  // whole block exits together
    float scale = scales[slot];
    int o = blockIdx.y * blockDim.x + threadIdx.x;
    const float* part = h_part + (size_t)z * splits * n * MAX_RANK;
    int tt = hi - lo;
    __shared__ int toks[LORA_TT];
    if (threadIdx.x < LORA_TT) toks[threadIdx.x] = threadIdx.x < tt ? token_idx[lo + threadIdx.x] : 0;
    __syncthreads();
    // h for the tile, rows past the tile and ranks past the slot's zero;
    // the splits are summed in order, four loads in flight at a time.
    size_t split_stride = (size_t)n * MAX_RANK;
#pragma unroll
    for (int it = 0; it < (LORA_TT * MAX_RANK + LORA_THREADS - 1) / LORA_THREADS; it++) {
        int i = threadIdx.x + it * LORA_THREADS;
        if (i < LORA_TT * MAX_RANK) {
            int j = i / MAX_RANK, r = i % MAX_RANK;
            float h = 0.0f;
            if (r < rank && j < tt) {
                const float* pp = part + (size_t)toks[j] * MAX_RANK + r;
                int p = 0;
                for (; p + 4 <= splits; p += 4) {
                    float v0 = pp[p * split_stride], v1 = pp[(p + 1) * split_stride];
                    float v2 = pp[(p + 2) * split_stride], v3 = pp[(p + 3) * split_stride];
                    h += v0;
                    h += v1;
                    h += v2;
                    h += v3;
                }
                for (; p < splits; p++) h += pp[p * split_stride];
            }
            hs[i] = h;
        }
    }
    __syncthreads();
    if (o >= width) return;
    float acc[LORA_TT];
#pragma unroll
    for (int j = 0; j < LORA_TT; j++) acc[j] = 0.0f;
    const st* bcol = b + (size_t)slot * b_stride + o;
    // Sixteen rows of B loaded before any is used, so their latencies
    // overlap; rows past the rank add h = 0 and leave the sums exact.
    for (int r0 = 0; r0 < rank; r0 += 16) {
        float bv[16];
#pragma unroll
        for (int u = 0; u < 16; u++) bv[u] = r0 + u < rank ? sload(bcol[(size_t)(r0 + u) * width]) : 0.0f;
#pragma unroll
        for (int u = 0; u < 16; u++) {
            if (r0 + u < MAX_RANK) {
                // Four tokens at a time, as far as the tile goes.
#pragma unroll
                for (int c = 0; c < LORA_TT; c += 4) {
                    if (c < tt) {
#pragma unroll
                        for (int j = c; j < c + 4; j++)
                            acc[j] = fmaf(hs[j * MAX_RANK + r0 + u], bv[u], acc[j]);
                    }
                }
            }
        }
    }
    const int* fl = z == 0 ? flags0 : (z == 1 ? flags1 : flags2);
    int f = fl[slot];
    if (f == 0) {
#pragma unroll
        for (int j = 0; j < LORA_TT; j++) {
            if (j < tt) {
                float* y = out + (size_t)token_idx[lo + j] * out_stride + off + o;
                *y += scale * acc[j];
            }
        }
        return;
    }
    const float* v = (z == 0 ? vec0 : (z == 1 ? vec1 : vec2)) + (size_t)slot * v_stride;
    const float* bias = z == 0 ? bias0 : (z == 1 ? bias1 : bias2);
    float c = (f & 2) ? v[width + o] : 0.0f;
    float g = v[o];
    float beta = bias != nullptr ? bias[o] : 0.0f;
#pragma unroll
    for (int j = 0; j < LORA_TT; j++) {
        if (j < tt) {
            float* y = out + (size_t)token_idx[lo + j] * out_stride + off + o;
            float r = *y + scale * acc[j] + c;
            *y = (f & 1) ? beta + g * (r - beta) : r;
        }
    }
}

// DoRA's scale of each output row of one (layer, projection) of a slot,
// once, as the slot is written: `g[o] = m[o] / ‖W_o + s·Σ_r B[o, r]·A[r]‖`,
// W the base's rows `[rows, fan_in]` (dense, the weights' type), A
// `[rank, fan_in]` and Bᵀ `[rank, width]` the slot's own (its type), `g`
// holding the magnitude m on entry. The squares are summed in double, as
// the CPU backend does. Grid: one block per row; block: 256.
extern "C" __global__ void dora_scales(const wt* w, int fan_in, const st* a, const st* b_t, int width, int rank,
                                       float scale, float* g) {
    PDL_ENTER();
    __shared__ float bs[MAX_RANK];
    __shared__ double part[32];
    int o = blockIdx.x;
    for (int r = threadIdx.x; r < rank; r += blockDim.x) bs[r] = scale * sload(b_t[(size_t)r * width + o]);
    __syncthreads();
    const wt* row = w + (size_t)o * fan_in;
    double acc = 0.0;
    for (int i = threadIdx.x; i < fan_in; i += blockDim.x) {
        float v = wload(row[i]);
        for (int r = 0; r < rank; r++) v = fmaf(bs[r], sload(a[(size_t)r * fan_in + i]), v);
        acc += (double)v * (double)v;
    }
    for (int off = 16; off > 0; off >>= 1) acc += __shfl_down_sync(FULL_MASK, acc, off);
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) part[warp] = acc;
    __syncthreads();
    if (threadIdx.x == 0) {
        double sum = 0.0;
        for (int i = 0; i < (int)(blockDim.x >> 5); i++) sum += part[i];
        g[o] = (float)((double)g[o] / sqrt(sum));
    }
}

// Greedy: the highest logit of each row, the lowest id among ties (as the
// CPU's argmax). Grid: one block per row.
extern "C" __global__ void argmax_rows(const float* logits, int vocab, int* out) {
    PDL_ENTER();
    __shared__ float vals[32];
    __shared__ int idxs[32];
    const float* row = logits + (size_t)blockIdx.x * vocab;
    float best = -INFINITY;
    int best_i = 0x7fffffff;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
        if (row[i] > best || best_i == 0x7fffffff) {
            best = row[i];
            best_i = i;
        }
    }
    for (int o = 16; o > 0; o >>= 1) {
        float v = __shfl_xor_sync(FULL_MASK, best, o);
        int vi = __shfl_xor_sync(FULL_MASK, best_i, o);
        if (v > best || (v == best && vi < best_i)) {
            best = v;
            best_i = vi;
        }
    }
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    if (lane == 0) {
        vals[warp] = best;
        idxs[warp] = best_i;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < warps; w++) {
            if (vals[w] > best || (vals[w] == best && idxs[w] < best_i)) {
                best = vals[w];
                best_i = idxs[w];
            }
        }
        out[blockIdx.x] = best_i;
    }
}

// A float's order as an unsigned key: a < b exactly when key(a) < key(b).
__device__ __forceinline__ unsigned int order_key(float f) {
    unsigned int b = __float_as_uint(f);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// The largest key K with `count or mass of {key >= K}` at least `need`:
// a bisection over the 32 key bits, each step one pass over the row.
__device__ unsigned int cutoff_key(const float* row, int vocab, float m, float inv_t,
                                   unsigned int floor_key, bool by_mass, float need,
                                   float* scratch) {
    unsigned int lo = floor_key, hi = 0xffffffffu;  // answer in [lo, hi]
    while (lo < hi) {
        // The upper middle, without overflow when the range is all 2^32 keys.
        unsigned int mid = hi - (hi - lo) / 2;
        float acc = 0.0f;
        for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
            unsigned int k = order_key(row[i]);
            if (k >= mid && k >= floor_key) acc += by_mass ? expf((row[i] - m) * inv_t) : 1.0f;
        }
        acc = block_sum(acc, scratch);
        if (acc >= need) lo = mid; else hi = mid - 1;
    }
    return lo;
}

// Temperature, top-k and top-p sampling, one block (of SAMPLE_THREADS) per
// row, with the uniform draw `u[row]` taken from the request's own seeded
// stream on the host, so a request's draws do not depend on its batch. The
// kept set is every token whose logit is at least the k-th largest (top-k)
// and inside the smallest high-probability set holding top_p of the mass
// (top-p); ties at a cutoff are all kept. The draw walks the kept tokens in
// id order.
#define SAMPLE_THREADS 1024
extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS) sample_rows(const float* logits, int vocab, const float* temperature,
                                       const int* top_k, const float* top_p, const float* u,
                                       int* out) {
    PDL_ENTER();
    __shared__ float scratch[32];
    __shared__ float part[SAMPLE_THREADS];
    __shared__ int chosen_chunk;
    __shared__ float chosen_rest;
    const float* row = logits + (size_t)blockIdx.x * vocab;
    float m = -INFINITY;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) m = fmaxf(m, row[i]);
    m = block_max(m, scratch);
    float inv_t = 1.0f / temperature[blockIdx.x];
    unsigned int keep = 0;
    int k = top_k[blockIdx.x];
    if (k > 0 && k < vocab) keep = cutoff_key(row, vocab, m, inv_t, 0, false, (float)k, scratch);
    float total = 0.0f;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x)
        if (order_key(row[i]) >= keep) total += expf((row[i] - m) * inv_t);
    total = block_sum(total, scratch);
    float p = top_p[blockIdx.x];
    if (p < 1.0f) {
        keep = cutoff_key(row, vocab, m, inv_t, keep, true, p * total, scratch);
        total = 0.0f;
        for (int i = threadIdx.x; i < vocab; i += blockDim.x)
            if (order_key(row[i]) >= keep) total += expf((row[i] - m) * inv_t);
        total = block_sum(total, scratch);
    }
    // Each thread owns one contiguous chunk of ids; thread 0 finds the
    // chunk where the cumulative mass passes u * total, its owner the id.
    int chunk = (vocab + blockDim.x - 1) / blockDim.x;
    int c0 = threadIdx.x * chunk, c1 = min(vocab, c0 + chunk);
    float mine = 0.0f;
    for (int i = c0; i < c1; i++)
        if (order_key(row[i]) >= keep) mine += expf((row[i] - m) * inv_t);
    part[threadIdx.x] = mine;
    __syncthreads();
    if (threadIdx.x == 0) {
        float target = u[blockIdx.x] * total, cum = 0.0f;
        int c = -1;
        for (int t = 0; t < (int)blockDim.x; t++) {
            if (part[t] > 0.0f) c = t;  // the last chunk with mass, if rounding runs past the end
            if (part[t] > 0.0f && target < cum + part[t]) {
                c = t;
                break;
            }
            cum += part[t];
        }
        chosen_chunk = c;
        chosen_rest = target - cum;
    }
    __syncthreads();
    // No mass anywhere (NaN or infinite logits): -1, which the host refuses.
    if (chosen_chunk < 0 && threadIdx.x == 0) out[blockIdx.x] = -1;
    if (threadIdx.x == chosen_chunk) {
        float cum = 0.0f;
        int last = -1;
        for (int i = c0; i < c1; i++) {
            if (order_key(row[i]) < keep) continue;
            last = i;
            cum += expf((row[i] - m) * inv_t);
            if (chosen_rest < cum) break;
        }
        out[blockIdx.x] = last;
    }
}

// Grouped expert-LoRA shrink for Mixture-of-Experts layers, one launch for
// every (expert, adapter slot) group of the step, all slots together:
//   t[row][r] = sum over k of x[row, k] * A_slot[expert][r, k]
// for the rows of each group (the tokens routed to that expert whose
// adapter is in that slot; rows of adapters without expert weights are in
// no group and never reach this path) and r below the slot's rank.
// groups[4 g .. 4 g + 4] is (first row, end row, slot, expert); ranks is
// [slots]. Each slot's factors are their own allocation, in the host
// tier's panel layout copied as it is (PANEL outputs per panel, input-major
// within a panel): a_ptrs[slot] points at expert 0's A, whose panels hold
// the rank rows (ceil(rank / PANEL) panels of fan_in x PANEL), the experts
// one after another. One warp per (row, r), the sum over k in a fixed
// order (lane-strided, then a fixed shuffle tree).
// Grid: (the longest group's rows, groups); block: 256 threads (8 warps).
extern "C" __global__ void __launch_bounds__(LORA_THREADS) moe_lora_shrink(const float* x, int fan_in,
                                       const int* groups, const unsigned long long* a_ptrs,
                                       const int* ranks, float* t) {
    PDL_ENTER();
    const int* g = groups + 4 * blockIdx.y;
    int row = g[0] + blockIdx.x;
    if (row >= g[1]) return;
    int slot = g[2], expert = g[3];
    int rank = ranks[slot];
    size_t a_len = (size_t)((rank + PANEL - 1) / PANEL) * PANEL * fan_in;
    const float* a = (const float*)a_ptrs[slot] + (size_t)expert * a_len;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    const float* xr = x + (size_t)row * fan_in;
    for (int r = warp; r < rank; r += warps) {
        const float* ar = a + (size_t)(r / PANEL) * fan_in * PANEL + r % PANEL;
        float acc = 0.0f;
        for (int k = lane; k < fan_in; k += 32) acc += xr[k] * ar[(size_t)k * PANEL];
        for (int off = 16; off > 0; off >>= 1) acc += __shfl_down_sync(0xffffffffu, acc, off);
        if (lane == 0) t[(size_t)row * MAX_RANK + r] = acc;
    }
}

// The matching expand: out[row, o] += scale[slot] * sum over r of
// t[row][r] * B_slot[expert][o, r]; b_ptrs[slot] points at expert 0's B in
// the panel layout (ceil(fan_out / PANEL) panels of rank x PANEL a
// expert). Each output is written by one thread, so no atomics.
// Grid: (the longest group's rows, groups); block: 256 threads.
extern "C" __global__ void __launch_bounds__(LORA_THREADS) moe_lora_expand(const float* t, int fan_out,
                                       const int* groups, const unsigned long long* b_ptrs,
                                       const int* ranks, const float* scales, float* out) {
    PDL_ENTER();
    const int* g = groups + 4 * blockIdx.y;
    int row = g[0] + blockIdx.x;
    if (row >= g[1]) return;
    int slot = g[2], expert = g[3];
    int rank = ranks[slot];
    float scale = scales[slot];
    size_t b_len = (size_t)((fan_out + PANEL - 1) / PANEL) * PANEL * rank;
    const float* b = (const float*)b_ptrs[slot] + (size_t)expert * b_len;
    const float* tr = t + (size_t)row * MAX_RANK;
    for (int o = threadIdx.x; o < fan_out; o += blockDim.x) {
        const float* bo = b + (size_t)(o / PANEL) * rank * PANEL + o % PANEL;
        float acc = 0.0f;
        for (int r = 0; r < rank; r++) acc += tr[r] * bo[(size_t)r * PANEL];
        out[(size_t)row * fan_out + o] += scale * acc;
    }
}

// The expert not among oe[0, j) with the largest logit (`by_logit`) or
// softmax numerator exp(logit - m), the lower expert first on a tie; its
// value in *value.
__device__ __forceinline__ int route_pick(const float* l, int experts, const int* oe, int j,
                                          float m, int by_logit, float* value) {
    int best = -1;
    float bv = 0.0f;
    for (int e = 0; e < experts; e++) {
        bool taken = false;
        for (int i = 0; i < j; i++) taken = taken || oe[i] == e;
        if (taken) continue;
        float v = by_logit ? l[e] : expf(l[e] - m);
        if (best < 0 || v > bv) {
            best = e;
            bv = v;
        }
    }
    *value = bv;
    return best;
}

// The Mixture-of-Experts router's choice for each of `n` tokens, as the
// CPU backend's `choose`: the softmax of the token's `experts` logits, its
// `top_k` largest probabilities (the lower expert first on a tie),
// renormalized to sum to one when `normalize`, written in expert order to
// out_e / out_w[t * top_k ..]. The sums run in expert order, as on the
// CPU. With `chosen_softmax` (GPT-OSS) the top_k largest logits are chosen
// and weighed by the softmax over them alone. One thread per token.
extern "C" __global__ void moe_route(const float* logits, int n, int experts, int top_k,
                                     int normalize, int chosen_softmax, int* out_e, float* out_w) {
    PDL_ENTER();
    int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= n) return;
    const float* l = logits + (size_t)t * experts;
    int* oe = out_e + (size_t)t * top_k;
    float* ow = out_w + (size_t)t * top_k;
    if (chosen_softmax) {
        // GPT-OSS: the top_k largest logits, weighed by the softmax over
        // those alone, summed from the largest down, as the CPU's
        // `choose_logits`.
        for (int j = 0; j < top_k; j++) {
            float v;
            oe[j] = route_pick(l, experts, oe, j, 0.0f, 1, &v);
            ow[j] = expf(v - l[oe[0]]);
        }
        float total = 0.0f;
        for (int j = 0; j < top_k; j++) total += ow[j];
        for (int j = 0; j < top_k; j++) ow[j] = ow[j] / total;
    } else {
        float m = -INFINITY;
        for (int e = 0; e < experts; e++) m = fmaxf(m, l[e]);
        float sum = 0.0f;
        for (int e = 0; e < experts; e++) sum += expf(l[e] - m);
        // The top_k by repeated scans, largest first.
        float chosen_sum = 0.0f;
        for (int j = 0; j < top_k; j++) {
            float v;
            oe[j] = route_pick(l, experts, oe, j, m, 0, &v);
            ow[j] = v / sum;
            chosen_sum += ow[j];
        }
        if (normalize)
            for (int j = 0; j < top_k; j++) ow[j] = ow[j] / chosen_sum;
    }
    // Expert order (insertion sort of top_k entries).
    for (int j = 1; j < top_k; j++) {
        int e = oe[j];
        float w = ow[j];
        int i = j - 1;
        while (i >= 0 && oe[i] > e) {
            oe[i + 1] = oe[i];
            ow[i + 1] = ow[i];
            i--;
        }
        oe[i + 1] = e;
        ow[i + 1] = w;
    }
}

// out[r] = x[order[r]] for the rows of every expert's group (each expert's
// tokens, experts in order), in f32 and, when out_w is not null, in the
// weights' type for the experts' GEMMs. Grid: one block per row.
extern "C" __global__ void moe_gather(const float* x, const int* order, int d, float* out,
                                      wt* out_w) {
    PDL_ENTER();
    const float* src = x + (size_t)order[blockIdx.x] * d;
    float* o = out + (size_t)blockIdx.x * d;
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        float v = src[i];
        o[i] = v;
        if (out_w) out_w[(size_t)blockIdx.x * d + i] = wstore(v);
    }
}

// hidden[t] += sum over j of y[row_of[t, j]] * w[t, j]: each token's
// experts' outputs weighed and summed from zero in expert order, then added
// to the residual stream, as on the CPU. Grid: one block per token.
extern "C" __global__ void moe_combine(float* hidden, const float* y, const int* row_of,
                                       const float* w, int top_k, int d) {
    PDL_ENTER();
    int t = blockIdx.x;
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        float acc = 0.0f;
        for (int j = 0; j < top_k; j++)
            acc += y[(size_t)row_of[t * top_k + j] * d + i] * w[t * top_k + j];
        hidden[(size_t)t * d + i] += acc;
    }
}

// y[r, c] += bias[row_expert[r], c]: each expert row's own bias (GPT-OSS's
// experts), for `rows` rows of `width`.
extern "C" __global__ void moe_bias(float* y, const float* bias, const int* row_expert, int rows,
                                    int width) {
    PDL_ENTER();
    long n = (long)rows * width;
    for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x)
        y[i] += bias[(size_t)row_expert[i / width] * width + i % width];
}

// GPT-OSS's clamped SwiGLU over rows laid out as silu_mul's [gate | up]:
// g = min(gate, limit), u = clamp(up, -limit, limit),
// out = (u + 1) * g * sigmoid(alpha * g), as transformers' GptOssExperts
// and the CPU's `clamped_swiglu`.
extern "C" __global__ void swiglu_clamped(const float* gu, float* out, wt* out_w, int rows,
                                          int inter, float alpha, float limit) {
    PDL_ENTER();
    long n = (long)rows * inter;
    for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x) {
        long t = i / inter, c = i % inter;
        float g = fminf(gu[t * 2 * inter + c], limit);
        float u = fminf(fmaxf(gu[t * 2 * inter + inter + c], -limit), limit);
        float glu = g * (1.0f / (1.0f + expf(-(g * alpha))));
        float v = (u + 1.0f) * glu;
        out[i] = v;
        if (out_w) out_w[i] = wstore(v);
    }
}

// Holds a stream for `cycles` clock cycles: the tests use it to keep a slot
// copy in flight while steps run on the compute stream. Grid: one block of
// one thread.
extern "C" __global__ void spin(long long cycles) {
    PDL_ENTER();
    long long start = clock64();
    while (clock64() - start < cycles) {
    }
}
