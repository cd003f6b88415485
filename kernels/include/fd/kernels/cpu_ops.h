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

/// Which instructions run linear_bf16's steps. All give the same bits (the unit tests check it).
enum class Bf16Isa : uint8_t {
    portable    = 0,  ///< lane by lane, std::fma with explicit DAZ/FTZ (any CPU)
    avx512_bf16 = 1,  ///< vcvtne2ps2bf16 + vdpbf16ps (chosen at run time when the CPU has AVX512_BF16)
    avx2        = 2,  ///< two f32 FMAs per pair step on widened bf16 under MXCSR.DAZ, the last lanes
                      ///< flushed, NaN outputs redone portably (chosen when the CPU has AVX2 + FMA
                      ///< but no AVX512_BF16; kernels/cpu/linear_bf16_avx2.cpp)
};
/// "portable" / "avx512_bf16" / "avx2".
const char * bf16_isa_name(Bf16Isa isa);
/// avx512_bf16 when this CPU has it (cpuid, checked once), else avx2 when it has AVX2 and FMA,
/// else portable.
Bf16Isa bf16_best_isa();

/// Round f32 to bf16 as vcvtne2ps2bf16 does: round to nearest even; a denormal becomes a zero of
/// its sign; NaN stays NaN (quiet).
/// Shapes   out [n] bf16 bits written;  x [n] f32.
/// Errors   fd::Error{invalid_argument} when `isa` is avx512_bf16 or avx2 and the CPU lacks it.
void round_to_bf16(uint16_t * out, const float * x, int64_t n, Bf16Isa isa);

/// One vdpbf16ps: for each lane l < 16,
///   acc[l] = FTZ(fma(DAZ(a[2l+1]), DAZ(b[2l+1]), DAZ(acc[l])));  acc[l] = FTZ(fma(DAZ(a[2l]), DAZ(b[2l]), acc[l]))
/// (DAZ / FTZ: a denormal input / result reads as zero of its sign; one RNE rounding per fma;
/// a NaN input gives the first NaN of a, b, acc made quiet; an invalid product or sum, inf * 0 or
/// inf - inf, the x86 default NaN 0xFFC00000).
/// Shapes   acc [16] f32 modified;  a, b [32] bf16 bits.
/// Errors   as round_to_bf16.
void dpbf16_step(float * acc, const uint16_t * a, const uint16_t * b, Bf16Isa isa);

/// out = x · Wᵀ (+ bias) in bf16 compute (--compute-dtype bfloat16): x rounded to bf16
/// (round_to_bf16), W bf16 (f32 weights rounded the same way as they are read: the numbers
/// of rounding them at load), products exact, sums in f32. Each output is one fixed chain:
/// steps of 32 k's ascending (the last zero-padded), each one dpbf16_step on 16 lanes (lane l
/// holds k = 32s + 2l and 32s + 2l + 1), then lanes.h's fixed reduction of the 16 lanes, then
/// the bias. So a row's result is bitwise the same for any n_rows, batch position, tiling,
/// thread count and either `isa` (batch-invariant, as linear).
/// Shapes   as linear: out [n_rows, n_out] f32 written;  x [n_rows, n_in] f32;
///          w [n_out, n_in] `wtype` (f32 or bf16);  bias [n_out] f32 or nullptr.
/// Threads  x rounded once per call (rows split over `pool`); outputs split over `pool` in
///          ranges of whole 24-output groups (one row: ~128 KiB of weights per task).
/// Paths    avx512_bf16: 1 x 8 register tiles for one row (weights streamed, prefetched), up to
///          4 x 6 for more (rows in blocks of ~256 KiB of bf16 x); the stored bf16 rows are the
///          instruction's operands (no packing, no widening). avx2: 1 x 4 tiles for one row, 2 x 2
///          for more; x rounded once per call and widened to f32 (odd / even k's apart), each
///          weight pair widened in registers (an AND and a shift).
/// Errors   as round_to_bf16.
void linear_bf16(float * out, const float * x, const void * w, WType wtype, const float * bias, int64_t n_rows,
                 int64_t n_out, int64_t n_in, ThreadPool * pool, Bf16Isa isa = bf16_best_isa());

/// Which instructions run attention_paged: its decode path (a tile of one query with block_size
/// and head_dim multiples of 16) and its prefill tiles' scores, softmax and P·V. Both give the
/// same bits (the unit tests check it).
enum class AttnIsa : uint8_t {
    generic = 0,  ///< 16-lane GCC vectors (AVX-512 intrinsics in places where the build has AVX-512BW)
    avx2    = 1,  ///< AVX2 + FMA intrinsics on 8-lane registers (built where the compiler targets AVX2
                  ///< and FMA): decode with one kv head's keys read from 4 blocks per call and
                  ///< the V run software-prefetched 2 blocks ahead in address order;
                  ///< prefill tiles as register tiles of 6 (query, head) pairs × 16 keys (scores)
                  ///< and × 16 dimensions (P·V), 12 ymm accumulators (the generic tiles' 32 spill)
};
/// "generic" / "avx2".
const char * attn_isa_name(AttnIsa isa);
/// Whether this build has the avx2 path (compiled for a CPU with AVX2 and FMA: -march=native).
bool attn_has_avx2();
/// avx2 where it is built and the build has no AVX-512BW (there the generic path's 512-bit code
/// stays the default), else generic.
AttnIsa attn_best_isa();

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
///          Decode queries (a tile of one) run the same chains laid out for one query. Both
///          paths run on `isa`'s instructions (AttnIsa; same bits either way).
/// Errors   fd::Error{invalid_argument} when `isa` is avx2 and !attn_has_avx2().
/// Source   Vaswani et al. 2017; paged layout after vLLM PagedAttention (Kwon et al. 2023).
void attention_paged(float * out, const float * q, const AttnQuery * queries, int64_t n_tokens,
                     int64_t n_heads, PagedKv kv, float scale, ThreadPool * pool, AttnIsa isa = attn_best_isa());

}  // namespace fd::kernels
