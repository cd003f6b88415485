// Causal GQA paged attention, prefill and decode alike (see fd/kernels/cuda_ops.h).
//
// One 128-thread block (4 warps) per (query token, head); nothing depends on the grid, so a
// row's output is the same whatever else is batched (and a captured graph step's padding rows
// change nothing). Per (token, head), with n = n_ctx read from device memory (a graph replays
// with each step's own lengths):
//   pass 1  max of the scores: thread j scores keys t = j, j + 128, ... (max is exact in any order);
//   pass 2  keys in chunks of 128, t ascending: thread j scores key t0 + j again, e[j] =
//           expf(s - max) into shared memory, then every thread adds e[t] to the running sum and
//           e[t] * V[t, d] to its output dims d = tid, tid + 128, ... in t order (one FMA per t);
//   out     acc[d] / sum.
// A score is ONE thread's FMA chain over d ascending from 0, then times scale: the CPU twin's
// order (cpu_ops.h). K is stored transposed within each block (PagedKv: [n_kv_heads, head_dim,
// block_size]), so for one d the 32 lanes of a warp read 32 consecutive keys: coalesced
// (block_size floats per block contiguous), while q[d] is one shared-memory broadcast.
// bf16 pools (PagedKv::dtype): each K and V element is widened exactly to f32 when read
// (ld()), the same chains follow, so the output is the f32 kernel's over the rounded values.
#include "cuda_common.cuh"
#include "fd/kernels/cuda_ops.h"

namespace fd::kernels::cuda {

namespace {

constexpr int kThreads = 128;
constexpr int kWarps   = kThreads / 32;
constexpr int kChunk   = kThreads;  // keys per pass-2 chunk (one per thread)
constexpr int kMaxDimsPerThread = 4;  // head_dim <= 512

/// One pool element widened to f32 (bf16: the upper half of an f32, exact).
__device__ __forceinline__ float ld(const float * p) { return *p; }
__device__ __forceinline__ float ld(const uint16_t * p) { return __uint_as_float(static_cast<uint32_t>(*p) << 16); }

template <typename T>
__device__ __forceinline__ const T * kv_row(const T * pool, const int32_t * table, int64_t t, int64_t bs,
                                                int64_t row) {
    return pool + (static_cast<int64_t>(table[t / bs]) * bs + t % bs) * row;
}

/// Key t of kv head kvh in the K pool (transposed per block): its dimension d is at [d * bs].
template <typename T>
__device__ __forceinline__ const T * k_col(const T * pool, const int32_t * table, int64_t t, int64_t bs,
                                               int64_t row, int kvh, int hd) {
    return pool + static_cast<int64_t>(table[t / bs]) * bs * row + static_cast<int64_t>(kvh) * hd * bs + t % bs;
}

/// scale * <qs, K[t, kvh, :]> (k = k_col, dimension d at k[d * bs]): one FMA chain over d
/// ascending, then times scale (the CPU's order).
template <typename T>
__device__ __forceinline__ float score(const float * qs, const T * k, int64_t bs, int hd, float scale) {
    float a = 0.0f;
    for (int d = 0; d < hd; ++d) { a = fmaf(qs[d], ld(k + d * bs), a); }
    return a * scale;
}

template <typename T>
__global__ void attention_kernel(float * out, const float * q, AttnBatch b, int n_heads, PagedKv kv, float scale) {
    extern __shared__ float smem[];
    const T * kpool = static_cast<const T *>(kv.k);
    const T * vpool = static_cast<const T *>(kv.v);
    __shared__ float        wmax[kWarps];
    const int     h = blockIdx.x;
    const int64_t i = blockIdx.y;
    const int     hd = kv.head_dim, group = n_heads / kv.n_kv_heads, kvh = h / group;
    const int64_t row = static_cast<int64_t>(kv.n_kv_heads) * hd, bs = kv.block_size;
    const int32_t * table = b.block_tables + static_cast<int64_t>(b.table_row[i]) * b.max_blocks;
    const int64_t n = b.n_ctx[i];
    const int     tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    float * qs = smem;       // [hd]
    float * e  = smem + hd;  // [kChunk]
    for (int d = tid; d < hd; d += kThreads) { qs[d] = q[(i * n_heads + h) * hd + d]; }
    __syncthreads();

    float mx = -INFINITY;
    for (int64_t t = tid; t < n; t += kThreads) {
        mx = fmaxf(mx, score(qs, k_col(kpool, table, t, bs, row, kvh, hd), bs, hd, scale));
    }
    for (int off = 16; off > 0; off >>= 1) { mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off)); }
    if (lane == 0) { wmax[warp] = mx; }
    __syncthreads();
    mx = wmax[0];
    for (int w = 1; w < kWarps; ++w) { mx = fmaxf(mx, wmax[w]); }

    float acc[kMaxDimsPerThread] = {};
    float sum = 0.0f;
    for (int64_t t0 = 0; t0 < n; t0 += kChunk) {
        const int nc = static_cast<int>(n - t0 < kChunk ? n - t0 : kChunk);
        if (tid < nc) { e[tid] = expf(score(qs, k_col(kpool, table, t0 + tid, bs, row, kvh, hd), bs, hd, scale) - mx); }
        __syncthreads();
        for (int j = 0; j < nc; ++j) {
            const float   p = e[j];
            const T *   v = kv_row(vpool, table, t0 + j, bs, row) + static_cast<int64_t>(kvh) * hd;
            sum += p;
#pragma unroll
            for (int r = 0; r < kMaxDimsPerThread; ++r) {
                const int d = tid + r * kThreads;
                if (d < hd) { acc[r] = fmaf(p, ld(v + d), acc[r]); }
            }
        }
        __syncthreads();  // e[] is rewritten by the next chunk
    }
    const float inv = 1.0f / sum;
    float *     o   = out + (i * n_heads + h) * hd;
#pragma unroll
    for (int r = 0; r < kMaxDimsPerThread; ++r) {
        const int d = tid + r * kThreads;
        if (d < hd) { o[d] = acc[r] * inv; }
    }
}

}  // namespace

void attention_paged(float * out, const float * q, AttnBatch batch, int64_t n_tokens, int64_t n_heads, PagedKv kv,
                     float scale, cudaStream_t stream) {
    if (n_tokens <= 0 || n_heads <= 0) { return; }
    const dim3   grid(static_cast<unsigned>(n_heads), static_cast<unsigned>(n_tokens));
    const size_t smem = sizeof(float) * (static_cast<size_t>(kv.head_dim) + kChunk);
    if (kv.dtype == WType::bf16) {
        attention_kernel<uint16_t><<<grid, kThreads, smem, stream>>>(out, q, batch, static_cast<int>(n_heads), kv, scale);
    } else {
        attention_kernel<float><<<grid, kThreads, smem, stream>>>(out, q, batch, static_cast<int>(n_heads), kv, scale);
    }
    check_launch("attention_paged");
}

}  // namespace fd::kernels::cuda
