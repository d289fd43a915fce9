// The CUDA backend's kernels, compiled with NVRTC when a backend starts.
//
// The backend prepends the model's shapes as defines, so loops over them
// have compile-time bounds:
//   WDTYPE     the base weights' type: 0 f32, 1 bf16, 2 f16
//   HEAD_DIM   attention head size (even)
//   MAX_RANK   the rank every adapter slot is sized for
//   SHRINK_KC  input features per split-K chunk of the LoRA shrink (a multiple of 32)
//
// Activations, the residual stream and all LoRA math are f32; the base
// GEMMs (cuBLAS) read the weights' type, and the KV cache is stored in it
// (keys and values are rounded once, when stored). Every reduction in
// these kernels has a fixed order that depends on the token's own data,
// never on the batch. cuBLAS makes no such promise: it may pick another
// algorithm for another batch size.

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

// out[t] = table[tokens[t]] as f32. Grid: one block per token.
extern "C" __global__ void embed(const wt* table, const int* tokens, float* out, int d) {
    const wt* row = table + (size_t)tokens[blockIdx.x] * d;
    float* o = out + (size_t)blockIdx.x * d;
    for (int i = threadIdx.x; i < d; i += blockDim.x) o[i] = wload(row[i]);
}

// RMSNorm of rows of `x` (row `rows[b]`, or row b when `rows` is null) into
// `out` (f32) and, when `out_w` is not null, the same values in the
// weights' type for the next GEMM. Grid: one block per output row.
extern "C" __global__ void rms_norm(const float* x, const int* rows, const float* w, float* out,
                                    wt* out_w, int d, float eps) {
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
    for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x)
        y[i] = wstore(x[i]);
}

// y[r, c] += bias[c] for `rows` rows of `width`.
extern "C" __global__ void add_bias(float* y, const float* bias, int rows, int width) {
    long n = (long)rows * width;
    for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x)
        y[i] += bias[i % width];
}

// h += y, elementwise (the residual stream).
extern "C" __global__ void add_into(float* h, const float* y, long n) {
    for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x)
        h[i] += y[i];
}

// out[t, i] = silu(gate) * up for rows of `gu` laid out [gate | up], each
// `inter` wide; also in the weights' type when `out_w` is not null.
extern "C" __global__ void silu_mul(const float* gu, float* out, wt* out_w, int rows, int inter) {
    long n = (long)rows * inter;
    for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x) {
        long t = i / inter, c = i % inter;
        float g = gu[t * 2 * inter + c], u = gu[t * 2 * inter + inter + c];
        float v = g / (1.0f + expf(-g)) * u;
        out[i] = v;
        if (out_w) out_w[i] = wstore(v);
    }
}

// Rotates the query and key heads of each token's fused [q | k | v] row in
// place (rotate-half RoPE), then stores its key and value at its KV-cache
// row, in the weights' type. Grid: one block per token.
extern "C" __global__ void rope_store(float* qkv, int q_dim, int kv_dim, const int* pos,
                                      const int* kv_row, const float* inv_freq, wt* k_cache,
                                      wt* v_cache) {
    const int half = HEAD_DIM / 2;
    float* row = qkv + (size_t)blockIdx.x * (q_dim + 2 * kv_dim);
    float p = (float)pos[blockIdx.x];
    int nq = q_dim / HEAD_DIM, heads = nq + kv_dim / HEAD_DIM;
    for (int i = threadIdx.x; i < heads * half; i += blockDim.x) {
        int head = i / half, j = i % half;
        float* hp = head < nq ? row + head * HEAD_DIM : row + q_dim + (head - nq) * HEAD_DIM;
        float s, c;
        sincosf(p * inv_freq[j], &s, &c);
        float x1 = hp[j], x2 = hp[j + half];
        hp[j] = x1 * c - x2 * s;
        hp[j + half] = x2 * c + x1 * s;
    }
    __syncthreads();
    wt* kd = k_cache + (size_t)kv_row[blockIdx.x] * kv_dim;
    wt* vd = v_cache + (size_t)kv_row[blockIdx.x] * kv_dim;
    for (int i = threadIdx.x; i < kv_dim; i += blockDim.x) {
        kd[i] = wstore(row[q_dim + i]);
        vd[i] = wstore(row[q_dim + kv_dim + i]);
    }
}

#define ATTN_CHUNK 128

__device__ __forceinline__ float attn_score(const float* qs, const wt* k_cache, int kv_dim, int kvh,
                                            const int* bt, int block_size, int j, float scale) {
    size_t row = (size_t)bt[j / block_size] * block_size + j % block_size;
    const wt* kr = k_cache + row * kv_dim + kvh * HEAD_DIM;
    float acc = 0.0f;
#pragma unroll 8
    for (int i = 0; i < HEAD_DIM; i++) acc = fmaf(qs[i], wload(kr[i]), acc);
    return acc * scale;
}

// Paged attention for decode and prefill alike: token t (position pos[t],
// of sequence tok_seq[t]) attends to its sequence's keys at positions
// lo..=pos[t] through the block table, which the same step's rope_store
// has already filled. Grid: (tokens, query heads); block: a multiple of 32
// threads, at least HEAD_DIM / 2. A query head reads KV head h / group
// (grouped-query attention). `window` > 0 is a sliding window.
extern "C" __global__ void attention(const float* qkv, int q_dim, int kv_dim, const wt* k_cache,
                                     const wt* v_cache, const int* pos, const int* tok_seq,
                                     const int* bt_off, const int* block_tables, int block_size,
                                     int window, float scale, float* out) {
    __shared__ float qs[HEAD_DIM];
    __shared__ float sc[ATTN_CHUNK];
    __shared__ float scratch[32];
    int t = blockIdx.x, h = blockIdx.y;
    int group = (q_dim / HEAD_DIM) / (kv_dim / HEAD_DIM);
    int kvh = h / group;
    const float* q = qkv + (size_t)t * (q_dim + 2 * kv_dim) + h * HEAD_DIM;
    for (int i = threadIdx.x; i < HEAD_DIM; i += blockDim.x) qs[i] = q[i];
    __syncthreads();
    int p = pos[t];
    int lo = window > 0 ? max(0, p + 1 - window) : 0;
    const int* bt = block_tables + bt_off[tok_seq[t]];
    float m = -INFINITY;
    for (int j = lo + threadIdx.x; j <= p; j += blockDim.x)
        m = fmaxf(m, attn_score(qs, k_cache, kv_dim, kvh, bt, block_size, j, scale));
    m = block_max(m, scratch);
    // Each thread owns output dims d0 and d0 + blockDim.x (if below HEAD_DIM).
    int d0 = threadIdx.x, d1 = threadIdx.x + blockDim.x;
    float acc0 = 0.0f, acc1 = 0.0f, l = 0.0f;
    for (int c0 = lo; c0 <= p; c0 += ATTN_CHUNK) {
        int cn = min(ATTN_CHUNK, p + 1 - c0);
        __syncthreads();
        for (int j = threadIdx.x; j < cn; j += blockDim.x)
            sc[j] = expf(attn_score(qs, k_cache, kv_dim, kvh, bt, block_size, c0 + j, scale) - m);
        __syncthreads();
        for (int j = 0; j < cn; j++) {
            int jj = c0 + j;
            size_t row = (size_t)bt[jj / block_size] * block_size + jj % block_size;
            const wt* vr = v_cache + row * kv_dim + kvh * HEAD_DIM;
            float w = sc[j];
            l += w;
            if (d0 < HEAD_DIM) acc0 = fmaf(w, wload(vr[d0]), acc0);
            if (d1 < HEAD_DIM) acc1 = fmaf(w, wload(vr[d1]), acc1);
        }
    }
    float* o = out + (size_t)t * q_dim + h * HEAD_DIM;
    if (d0 < HEAD_DIM) o[d0] = acc0 / l;
    if (d1 < HEAD_DIM) o[d1] = acc1 / l;
}

// Tokens per tile in the LoRA kernels.
#define LORA_TT 8

// Grouped LoRA shrink (SGMV), one launch for every adapter in the step and
// for up to three projections that share the input (q/k/v, gate/up):
//   h_part[slice][split][tok][r] = sum over this split's k of x[tok, k] * A[slot, r, k]
// for each segment's tokens (token_idx[seg_off[s]..seg_off[s+1]], all using
// slot seg_slot[s]) and r below the slot's rank for that projection; rows
// past the rank are never computed or read. A slice's A is
// [slots, MAX_RANK, fan_in] and its ranks [slots]. Split-K: block y covers
// input features [y * SHRINK_KC, (y + 1) * SHRINK_KC); the expand sums the
// splits in order, so no atomics and a fixed order.
// Grid: (segments, splits, slices); block: 256 threads (8 warps).
extern "C" __global__ void lora_shrink(const float* x, int fan_in, int n, const int* token_idx,
                                       const int* seg_off, const int* seg_slot, const float* a0,
                                       const float* a1, const float* a2, const int* rank0,
                                       const int* rank1, const int* rank2, float* h_part) {
    __shared__ float xs[LORA_TT * SHRINK_KC];
    const float* a = blockIdx.z == 0 ? a0 : (blockIdx.z == 1 ? a1 : a2);
    const int* ranks = blockIdx.z == 0 ? rank0 : (blockIdx.z == 1 ? rank1 : rank2);
    int s = blockIdx.x, slot = seg_slot[s];
    int rank = ranks[slot];
    if (rank == 0) return;  // the adapter has no such module
    int k0 = blockIdx.y * SHRINK_KC, kn = min(SHRINK_KC, fan_in - k0);
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    float* part = h_part + ((size_t)blockIdx.z * gridDim.y + blockIdx.y) * n * MAX_RANK;
    int lo = seg_off[s], hi = seg_off[s + 1];
    for (int t0 = lo; t0 < hi; t0 += LORA_TT) {
        int tt = min(LORA_TT, hi - t0);
        __syncthreads();
        for (int i = threadIdx.x; i < tt * SHRINK_KC; i += blockDim.x) {
            int j = i / SHRINK_KC, k = i % SHRINK_KC;
            xs[i] = k < kn ? x[(size_t)token_idx[t0 + j] * fan_in + k0 + k] : 0.0f;
        }
        __syncthreads();
        for (int r = warp; r < rank; r += warps) {
            const float* arow = a + ((size_t)slot * MAX_RANK + r) * fan_in + k0;
            float av[SHRINK_KC / 32];
#pragma unroll
            for (int i = 0; i < SHRINK_KC / 32; i++) {
                int k = lane + 32 * i;
                av[i] = k < kn ? arow[k] : 0.0f;
            }
            for (int j = 0; j < tt; j++) {
                float acc = 0.0f;
#pragma unroll
                for (int i = 0; i < SHRINK_KC / 32; i++) acc = fmaf(av[i], xs[j * SHRINK_KC + lane + 32 * i], acc);
                acc = warp_sum(acc);
                if (lane == 0) part[(size_t)token_idx[t0 + j] * MAX_RANK + r] = acc;
            }
        }
    }
}

// Grouped LoRA expand, the shrink's partner:
//   out[tok, off + o] += scale[slot] * sum_r h[tok, r] * B[slot, r, o]
// with h the shrink's splits summed in order. Each slice has its own B
// ([slots, MAX_RANK, width], Bᵀ rows), width and column offset into the
// fused output row of `out_stride` (q/k/v into [q | k | v], gate/up into
// [gate | up]). Grid: (segments, ceil(max width / 256), slices); block: 256.
extern "C" __global__ void lora_expand(const float* h_part, int splits, int n, const int* token_idx,
                                       const int* seg_off, const int* seg_slot, const float* b0,
                                       const float* b1, const float* b2, const int* rank0,
                                       const int* rank1, const int* rank2, const float* scale0,
                                       const float* scale1, const float* scale2, int width0,
                                       int width1, int width2, int off0, int off1, int off2,
                                       float* out, int out_stride) {
    __shared__ float hs[LORA_TT * MAX_RANK];
    int z = blockIdx.z;
    const float* b = z == 0 ? b0 : (z == 1 ? b1 : b2);
    const int* ranks = z == 0 ? rank0 : (z == 1 ? rank1 : rank2);
    const float* scales = z == 0 ? scale0 : (z == 1 ? scale1 : scale2);
    int width = z == 0 ? width0 : (z == 1 ? width1 : width2);
    int off = z == 0 ? off0 : (z == 1 ? off1 : off2);
    int s = blockIdx.x, slot = seg_slot[s];
    int rank = ranks[slot];
    if (rank == 0 || blockIdx.y * blockDim.x >= width) return;  // whole block exits together
    float scale = scales[slot];
    int o = blockIdx.y * blockDim.x + threadIdx.x;
    const float* part = h_part + (size_t)z * splits * n * MAX_RANK;
    int lo = seg_off[s], hi = seg_off[s + 1];
    for (int t0 = lo; t0 < hi; t0 += LORA_TT) {
        int tt = min(LORA_TT, hi - t0);
        __syncthreads();
        for (int i = threadIdx.x; i < tt * MAX_RANK; i += blockDim.x) {
            int j = i / MAX_RANK, r = i % MAX_RANK;
            float h = 0.0f;
            if (r < rank) {
                size_t at = (size_t)token_idx[t0 + j] * MAX_RANK + r;
                for (int p = 0; p < splits; p++) h += part[(size_t)p * n * MAX_RANK + at];
            }
            hs[i] = h;
        }
        __syncthreads();
        if (o < width) {
            float acc[LORA_TT];
#pragma unroll
            for (int j = 0; j < LORA_TT; j++) acc[j] = 0.0f;
            const float* bcol = b + (size_t)slot * MAX_RANK * width + o;
            for (int r = 0; r < rank; r++) {
                float bv = bcol[(size_t)r * width];
#pragma unroll
                for (int j = 0; j < LORA_TT; j++) acc[j] = fmaf(hs[j * MAX_RANK + r], bv, acc[j]);
            }
            for (int j = 0; j < tt; j++) {
                float* y = out + (size_t)token_idx[t0 + j] * out_stride + off + o;
                *y += scale * acc[j];
            }
        }
    }
}

// Greedy: the highest logit of each row, the lowest id among ties (as the
// CPU's argmax). Grid: one block per row.
extern "C" __global__ void argmax_rows(const float* logits, int vocab, int* out) {
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
