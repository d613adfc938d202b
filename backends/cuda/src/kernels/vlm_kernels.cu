// The CUDA backend's own kernels (what candle has no kernel for). Compiled to PTX by build.rs
// with nvcc (sm_$CUDA_COMPUTE_CAP) and loaded through candle's custom-module cache.
//
// KV cache layout (vlm_model::text::kv_cache): per layer, K and V each
// (num_blocks + 1, kv_heads, block_len, head_dim); token t of a sequence with block table `tbl`
// sits at ((tbl[t / block_len] * kv_heads + kvh) * block_len + t % block_len) * head_dim.
#include <cuda_bf16.h>
#include <stdint.h>

__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ void from_f32(float x, float* dst) { *dst = x; }
__device__ __forceinline__ void from_f32(float x, __nv_bfloat16* dst) { *dst = __float2bfloat16(x); }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffff, v, o);
    return v;
}

// y (n, 2*inter) = [gate | up] -> out (n, inter) = silu(gate) * up (Qwen3VLTextMLP).
extern "C" __global__ void silu_mul_f32(const float* y, float* out, uint32_t n, uint32_t inter) {
    uint64_t i = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x;
    uint64_t total = (uint64_t)n * inter;
    if (i >= total) return;
    uint64_t r = i / inter, c = i % inter;
    float g = y[r * 2 * inter + c];
    float u = y[r * 2 * inter + inter + c];
    out[i] = g / (1.0f + __expf(-g)) * u;
}

// Writes src (n, kv_heads, head_dim) f32 into the cache at slots[i] = block * block_len + offset.
// One thread per value.
template <typename T>
__device__ void kv_write(const float* src, T* cache, const uint32_t* slots, uint32_t n,
                         uint32_t kv_heads, uint32_t block_len, uint32_t head_dim) {
    uint64_t i = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x;
    uint64_t per_token = (uint64_t)kv_heads * head_dim;
    if (i >= (uint64_t)n * per_token) return;
    uint64_t tok = i / per_token;
    uint32_t h = (i % per_token) / head_dim, d = i % head_dim;
    uint64_t slot = slots[tok];
    uint64_t block = slot / block_len, off = slot % block_len;
    from_f32(src[i], &cache[((block * kv_heads + h) * block_len + off) * head_dim + d]);
}
extern "C" __global__ void kv_write_bf16(const float* src, __nv_bfloat16* cache, const uint32_t* slots,
                                         uint32_t n, uint32_t kv_heads, uint32_t block_len, uint32_t head_dim) {
    kv_write(src, cache, slots, n, kv_heads, block_len, head_dim);
}
extern "C" __global__ void kv_write_f32(const float* src, float* cache, const uint32_t* slots,
                                        uint32_t n, uint32_t kv_heads, uint32_t block_len, uint32_t head_dim) {
    kv_write(src, cache, slots, n, kv_heads, block_len, head_dim);
}

// Paged decode attention, split over the context (flash-decoding): grid (heads, rows, splits),
// DECODE_WARPS warps per block, one instance per head_dim HD (a compile-time size keeps the
// per-lane query and accumulator in registers). Block (h, b, s) attends query head h of row b
// over the tokens [s * split_len, min(ctx, (s + 1) * split_len)) of that row, reading keys and
// values through the block table in place (no gather). Each warp takes every DECODE_WARPS-th
// token with an online softmax (running max m, sum l, accumulator: lane i holds elements
// i, i + 32, ...); the warps are merged in shared memory and the block writes its partial
// (acc[HD], m, l) to `partial` (rows, heads, splits, HD + 2). ctx_lens[b] == 0 marks a padding
// row (its partials say "no token": m = -inf, l = 0).
#define DECODE_WARPS 4

template <typename T, int HD>
__device__ void paged_decode(const float* q, const T* k_cache, const T* v_cache,
                             const uint32_t* tables, const uint32_t* ctx_lens, float* partial,
                             uint32_t heads, uint32_t kv_heads, uint32_t block_len,
                             uint32_t max_blocks, uint32_t split_len, float scale) {
    constexpr int PER_LANE = (HD + 31) / 32;
    const uint32_t h = blockIdx.x, b = blockIdx.y, s = blockIdx.z, splits = gridDim.z;
    const uint32_t warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const uint32_t ctx = ctx_lens[b];
    const uint32_t kvh = h / (heads / kv_heads);
    const uint32_t t0 = s * split_len;
    const uint32_t t1 = min(ctx, t0 + split_len);
    const float* qh = q + ((uint64_t)b * heads + h) * HD;
    const uint32_t* tbl = tables + (uint64_t)b * max_blocks;

    float qv[PER_LANE], acc[PER_LANE];
#pragma unroll
    for (int i = 0; i < PER_LANE; i++) {
        const uint32_t d = lane + 32 * i;
        qv[i] = d < HD ? qh[d] * scale : 0.f;
        acc[i] = 0.f;
    }
    float m = -INFINITY, l = 0.f;
    for (uint32_t t = t0 + warp; t < t1; t += DECODE_WARPS) {
        const uint64_t base =
            (((uint64_t)tbl[t / block_len] * kv_heads + kvh) * block_len + t % block_len) * HD;
        float dot = 0.f;
#pragma unroll
        for (int i = 0; i < PER_LANE; i++) {
            const uint32_t d = lane + 32 * i;
            if (d < HD) dot += qv[i] * to_f32(k_cache[base + d]);
        }
        dot = warp_sum(dot);
        const float m_new = fmaxf(m, dot);
        const float corr = __expf(m - m_new);
        const float p = __expf(dot - m_new);
        l = l * corr + p;
#pragma unroll
        for (int i = 0; i < PER_LANE; i++) {
            const uint32_t d = lane + 32 * i;
            acc[i] = acc[i] * corr + (d < HD ? p * to_f32(v_cache[base + d]) : 0.f);
        }
        m = m_new;
    }

    // Merge the warps: each warp's acc rescaled to the block's max.
    __shared__ float sm_m[DECODE_WARPS], sm_l[DECODE_WARPS];
    __shared__ float sm_acc[DECODE_WARPS][32 * PER_LANE];
    if (lane == 0) {
        sm_m[warp] = m;
        sm_l[warp] = l;
    }
#pragma unroll
    for (int i = 0; i < PER_LANE; i++) sm_acc[warp][lane + 32 * i] = acc[i];
    __syncthreads();
    if (warp != 0) return;
    float bm = -INFINITY;
#pragma unroll
    for (int w = 0; w < DECODE_WARPS; w++) bm = fmaxf(bm, sm_m[w]);
    float bl = 0.f, ba[PER_LANE];
#pragma unroll
    for (int i = 0; i < PER_LANE; i++) ba[i] = 0.f;
#pragma unroll
    for (int w = 0; w < DECODE_WARPS; w++) {
        const float c = sm_m[w] == -INFINITY ? 0.f : __expf(sm_m[w] - bm);
        bl += sm_l[w] * c;
#pragma unroll
        for (int i = 0; i < PER_LANE; i++) ba[i] += sm_acc[w][lane + 32 * i] * c;
    }
    float* out = partial + (((uint64_t)b * heads + h) * splits + s) * (HD + 2);
#pragma unroll
    for (int i = 0; i < PER_LANE; i++) {
        const uint32_t d = lane + 32 * i;
        if (d < HD) out[d] = ba[i];
    }
    if (lane == 0) {
        out[HD] = bm;
        out[HD + 1] = bl;
    }
}

#define PAGED_DECODE(NAME, T, HD)                                                                  \
    extern "C" __global__ void NAME(const float* q, const T* k, const T* v, const uint32_t* tables, \
                                    const uint32_t* ctx_lens, float* partial, uint32_t heads,       \
                                    uint32_t kv_heads, uint32_t block_len, uint32_t max_blocks,     \
                                    uint32_t split_len, float scale) {                              \
        paged_decode<T, HD>(q, k, v, tables, ctx_lens, partial, heads, kv_heads, block_len,         \
                            max_blocks, split_len, scale);                                          \
    }
// The head sizes with a decode kernel (`select::DECODE_HEAD_DIMS` lists the same).
PAGED_DECODE(paged_decode_bf16_hd16, __nv_bfloat16, 16)
PAGED_DECODE(paged_decode_bf16_hd32, __nv_bfloat16, 32)
PAGED_DECODE(paged_decode_bf16_hd64, __nv_bfloat16, 64)
PAGED_DECODE(paged_decode_bf16_hd128, __nv_bfloat16, 128)
PAGED_DECODE(paged_decode_bf16_hd256, __nv_bfloat16, 256)
PAGED_DECODE(paged_decode_f32_hd16, float, 16)
PAGED_DECODE(paged_decode_f32_hd32, float, 32)
PAGED_DECODE(paged_decode_f32_hd64, float, 64)
PAGED_DECODE(paged_decode_f32_hd128, float, 128)
PAGED_DECODE(paged_decode_f32_hd256, float, 256)

// Combines the splits of paged_decode: grid (heads, rows), head_dim threads. out (rows, heads,
// head_dim) = sum_s acc_s * exp(m_s - M) / sum_s l_s * exp(m_s - M); a padding row (no token in
// any split) gets zeros.
extern "C" __global__ void paged_decode_combine(const float* partial, float* out, uint32_t heads,
                                                uint32_t head_dim, uint32_t splits) {
    const uint32_t h = blockIdx.x, b = blockIdx.y, d = threadIdx.x;
    if (d >= head_dim) return;
    const float* p = partial + ((uint64_t)b * heads + h) * splits * (head_dim + 2);
    float M = -INFINITY;
    for (uint32_t s = 0; s < splits; s++) M = fmaxf(M, p[s * (head_dim + 2) + head_dim]);
    float num = 0.f, den = 0.f;
    if (M != -INFINITY) {
        for (uint32_t s = 0; s < splits; s++) {
            const float* ps = p + s * (head_dim + 2);
            float c = ps[head_dim] == -INFINITY ? 0.f : __expf(ps[head_dim] - M);
            num += ps[d] * c;
            den += ps[head_dim + 1] * c;
        }
    }
    out[((uint64_t)b * heads + h) * head_dim + d] = den > 0.f ? num / den : 0.f;
}
