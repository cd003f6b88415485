// fd/kernels/cpu_ops.h — the CPU ops that run on a thread pool: the CPU backend's kernels for
// the linear layers and paged attention, and the oracle the tests call directly.
//
// Conventions as in fd/kernels/ops.h (shapes outermost first, f32 compute, batch invariance).
// Everything else calls these through fd::kernels::Backend (fd/kernels/backend.h).
#pragma once

#include "fd/kernels/ops.h"
#include "fd/kernels/thread_pool.h"

#include <cstdint>

namespace fd::kernels {

/// out = x · Wᵀ (+ bias), W in the PyTorch / safetensors layout and stored dtype.
///   out[t, o] = sum_k x[t, k] * W[o, k]   (+ bias[o])
/// Each output is computed the same way whatever the batch: 16 lane-wise FMA chains over
/// k = lane, lane + 16, ... (ascending; the last partial block zero-padded), one fixed pairwise
/// reduction of the lanes, then the bias. A row's result therefore does not depend on n_rows,
/// its position, the tiling or the thread count (batch-invariant, unlike BLAS sgemm, whose
/// k-split depends on the problem size). bf16 weights are widened to f32; never rewritten.
/// Shapes   out  [n_rows, n_out]  f32, written
///          x    [n_rows, n_in]   f32
///          w    [n_out, n_in]    `wtype` (row-major, rows contiguous)
///          bias [n_out] f32 or nullptr
/// Threads  outputs are split over `pool` (may be nullptr = caller only); for many rows each
///          thread owns a range of outputs for every row (and packs x tiles of its share first).
/// Paths    1 row, and 2-8 rows of f32 weights: the weight rows stream past x in register tiles.
///          More rows (or bf16): x packed once per call into 4-row tiles in the weights' lane
///          order (k-chunk major); each task takes its outputs in chunks whose packed weights fit
///          1 MiB (L3) and, per chunk, the rows in blocks of <= 512 KiB of packed x (L2): each
///          6-output strip's k-chunk of 1024 (<= 24 KiB, L1) meets every 4-row tile of the block,
///          lane sums parked exactly between k-chunks. The first block packs each strip (bf16
///          widened) into the chunk's buffer; later blocks reuse it, so the weights are read and
///          packed once per call; with a single block of rows and k <= 1024 (a multiple of 32)
///          the strips are read from the weight rows instead (bf16 widened in registers). The
///          packed buffers live in 2 MiB transparent huge pages. Every path runs the same FMA
///          chain per output (the tests check bitwise equality, 1..4096 rows, 0-4 threads).
/// Errors   std::bad_alloc when the per-thread scratch cannot be mapped.
/// Source   register-tiled dot-product micro-kernel (4 x 6; 1 x 8 for one row), GotoBLAS packing;
///          the fixed-reduction-order idea follows "Defeating Nondeterminism in LLM Inference"
///          (He et al., Thinking Machines 2025) and SGLang's batch-invariant ops.
void linear(float * out, const float * x, const void * w, WType wtype, const float * bias, int64_t n_rows,
            int64_t n_out, int64_t n_in, ThreadPool * pool);

/// Causal GQA attention over the paged pool, one softmax per (token, head):
///   s[t]   = scale * <q[i, h, :], K[t, h / (n_heads / n_kv_heads), :]>   for t < n_ctx(i)
///   out[i, h, :] = sum_t softmax(s)[t] * V[t, kv(h), :]
/// Per (token, head) the arithmetic is fixed: each score is one FMA chain over d ascending (from
/// 0, any head_dim), then times scale; softmax with a polynomial exp (within ~2 ulp of expf) and
/// a 16-lane sum over t (lane = t mod 16) then one fixed lane reduction; V accumulated with one
/// FMA per element, t ascending. Results are therefore batch-invariant: a query's output is
/// bitwise the same alone (decode) or inside a prefill of any length, at any thread count.
/// Shapes   out [n_tokens, n_heads, head_dim] f32 written;  q [n_tokens, n_heads, head_dim] f32
///          queries [n_tokens];  kv as PagedKv, f32 or bf16 (kv.dtype)
/// KV dtype a bf16 pool is read with every K and V value widened exactly to f32 and the same FMA
///          chains in the same order: the output is bitwise that of an f32 pool holding the
///          bf16-rounded values, at half the bytes read.
/// Paths    scores for 32 keys at a time with the keys along the 16 lanes, read straight from
///          the blocks' transposed K (PagedKv: dimension d of 16 keys is one 64-byte load; a
///          32-key chunk spans two blocks of 16) when block_size % 16 == 0, else gathered into
///          a [head_dim, 32] scratch; up to 8 (query, head) pairs run as a small GEMM against
///          it (q broadcast, 16 chains). V: up to 8 pairs share each V
///          load (8 x 32 dims of accumulators); tiles of > 4 queries read a packed copy of the
///          chunk's V. The next chunk's K/V slice is prefetched while one computes.
/// Threads  tiles of up to 64 consecutive tokens sharing a block table (a prefill) are attended
///          together, each K/V row read once for the tile; tiles (and, when there are fewer
///          than 2 per thread, ranges of kv heads) are split over `pool`, largest tiles (by the
///          sum of their queries' contexts) claimed first so the threads finish together.
/// Source   Vaswani et al. 2017; paged layout after vLLM PagedAttention (Kwon et al. 2023).
void attention_paged(float * out, const float * q, const AttnQuery * queries, int64_t n_tokens,
                     int64_t n_heads, PagedKv kv, float scale, ThreadPool * pool);

}  // namespace fd::kernels
