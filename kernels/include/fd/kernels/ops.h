// fd/kernels/ops.h — every compute op of fdrollout, once.
//
// Conventions
// - Shapes are written [d0, d1, ...] OUTERMOST FIRST (row-major), with named dimensions.
// - Strides are in elements. Tensors are contiguous unless a stride argument says otherwise.
// - Mutated arguments come first.
// - All ops compute in f32 with f32 accumulation (linear reads bf16 weights too). Inputs are validated by the callers (the model
//   runner), never in inner loops.
// - Batch invariance: every op computes each output row with the same sequence of floating-
//   point operations whatever the number of rows, the other rows' contents or the thread
//   count. A sequence's logits are therefore bitwise independent of what else is batched.
// - CPU implementations live in kernels/cpu/<op>.cpp; CUDA twins go in kernels/cuda/<op>.cu and
//   are tested against these.
#pragma once

#include "fd/kernels/thread_pool.h"

#include <cstddef>
#include <cstdint>

namespace fd::kernels {

// ---------------------------------------------------------------------------------------------
// Linear layers
// ---------------------------------------------------------------------------------------------

/// How a linear weight is stored in memory: the checkpoint's own dtype, so loading and updating
/// weights is a copy (F16 checkpoints are widened to f32 at load).
enum class WType : uint8_t { f32 = 0, bf16 = 1 };

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
/// Threads  outputs (and, for many rows, blocks of rows) are split over `pool` (may be nullptr =
///          caller only).
/// Paths    1 row, and 2-8 rows of f32 weights: the weight rows stream past x in register tiles.
///          More rows (or bf16): x packed once per call into 4-row tiles in the weights' lane order;
///          tasks of (rows of <= 768 KiB of x) x (<= 48 outputs: packed weights <= 192 KiB, bf16
///          widened) pack their weights once and meet panels of <= 128 KiB of x: a 6-output strip
///          (k-chunks of 1024, lane sums parked exactly between chunks) against every 4-row tile.
///          Every path runs the same FMA chain per output (the tests check bitwise equality).
/// Source   register-tiled dot-product micro-kernel (4 x 6; 1 x 8 for one row), GotoBLAS packing;
///          the fixed-reduction-order idea follows "Defeating Nondeterminism in LLM Inference"
///          (He et al., Thinking Machines 2025) and SGLang's batch-invariant ops.
void linear(float * out, const float * x, const void * w, WType wtype, const float * bias, int64_t n_rows,
            int64_t n_out, int64_t n_in, ThreadPool * pool);

// ---------------------------------------------------------------------------------------------
// Normalization, activation, elementwise
// ---------------------------------------------------------------------------------------------

/// RMS-normalize each row and scale by `weight`.
///   out[t, :] = x[t, :] / sqrt(mean(x[t, :]^2) + eps) * weight[:]
/// Shapes   out [n_rows, n_embd] written, may alias x;  x [n_rows, n_embd];  weight [n_embd]
/// Source   Zhang & Sennrich 2019; llama2.c rmsnorm.
void rms_norm(float * out, const float * x, const float * weight, int64_t n_rows, int64_t n_embd,
              float eps);

/// SwiGLU gate: out = silu(gate) * up, silu(g) = g / (1 + exp(-g)).
/// Shapes   out, gate, up [n_elems]; out may alias gate.
/// Source   Shazeer 2020, "GLU Variants Improve Transformer".
void silu_mul(float * out, const float * gate, const float * up, int64_t n_elems);

/// Residual add: out[i] += x[i].   Shapes  out, x [n_elems].
void add_inplace(float * out, const float * x, int64_t n_elems);

// ---------------------------------------------------------------------------------------------
// Rotary position embedding
// ---------------------------------------------------------------------------------------------

/// Precompute the RoPE table (HF Llama: inv_freq[j] = theta^(-2j / head_dim)).
///   cos_sin[pos, j]            = cos(pos * inv_freq[j]),
///   cos_sin[pos, head_dim/2+j] = sin(pos * inv_freq[j])        for j in [0, head_dim/2)
/// Shapes   cos_sin [n_pos, head_dim] written.
void rope_table(float * cos_sin, int64_t n_pos, int64_t head_dim, float theta);

/// The same table from given inverse frequencies (rope_scaling: fd::model::rope_inv_freq):
///   cos_sin[pos, j] = cos(pos * inv_freq[j]),  cos_sin[pos, head_dim/2+j] = sin(pos * inv_freq[j])
/// with the angle pos * inv_freq[j] taken in f32 (as transformers does).
/// Shapes   cos_sin [n_pos, head_dim] written;  inv_freq [head_dim / 2].
void rope_table_inv_freq(float * cos_sin, int64_t n_pos, int64_t head_dim, const float * inv_freq);

/// Rotate every head of every token in place, HF `rotate_half` convention: element j pairs with
/// j + head_dim/2.  x1' = x1*cos - x2*sin,  x2' = x2*cos + x1*sin.
/// Shapes   x         [n_tokens, n_heads, head_dim]  modified in place
///          positions [n_tokens]  (each < n_pos of the table)
///          cos_sin   [n_pos, head_dim] from rope_table
/// Source   Su et al. 2021 (RoFormer); transformers modeling_llama.apply_rotary_pos_emb.
void rope_rotate_half(float * x, const int32_t * positions, const float * cos_sin,
                      int64_t n_tokens, int64_t n_heads, int64_t head_dim);

// ---------------------------------------------------------------------------------------------
// Paged KV cache and attention
// ---------------------------------------------------------------------------------------------

/// One layer's paged KV pool.
///   k, v [n_blocks, block_size, n_kv_heads, head_dim]
struct PagedKv {
    float * k          = nullptr;
    float * v          = nullptr;
    int32_t block_size = 0;  ///< tokens per block
    int32_t n_kv_heads = 0;
    int32_t head_dim   = 0;
};

/// Store each token's K and V at its slot (slot = block_id * block_size + offset).
/// Shapes   k_new, v_new [n_tokens, n_kv_heads, head_dim];  slots [n_tokens]
void kv_store(PagedKv kv, const float * k_new, const float * v_new, const int64_t * slots,
              int64_t n_tokens);

/// What one query token attends to: positions [0, n_ctx) of its sequence, whose KV lives in
/// blocks block_table[0 .. ceil(n_ctx / block_size)).
struct AttnQuery {
    const int32_t * block_table = nullptr;
    int32_t         n_ctx       = 0;
};

/// Causal GQA attention over the paged pool, one softmax per (token, head):
///   s[t]   = scale * <q[i, h, :], K[t, h / (n_heads / n_kv_heads), :]>   for t < n_ctx(i)
///   out[i, h, :] = sum_t softmax(s)[t] * V[t, kv(h), :]
/// Per (token, head) the arithmetic is fixed: s[t] = 16 lane-wise FMA chains over head_dim and
/// one fixed lane reduction (head_dim % 16 == 0; else one sequential chain); softmax with a
/// polynomial exp (within ~2 ulp of expf) and a 16-lane sum over t; V accumulated with one FMA
/// per element, t ascending. Results are therefore batch-invariant.
/// Shapes   out [n_tokens, n_heads, head_dim] written;  q [n_tokens, n_heads, head_dim]
///          queries [n_tokens]
/// Threads  tiles of up to 64 consecutive tokens sharing a block table (a prefill) are attended
///          together, each K/V row read once for the tile; tiles (and, when there are fewer
///          than 2 per thread, ranges of kv heads) are split over `pool`.
/// Source   Vaswani et al. 2017; paged layout after vLLM PagedAttention (Kwon et al. 2023).
void attention_paged(float * out, const float * q, const AttnQuery * queries, int64_t n_tokens,
                     int64_t n_heads, PagedKv kv, float scale, ThreadPool * pool);

// ---------------------------------------------------------------------------------------------
// Logits
// ---------------------------------------------------------------------------------------------

/// Numerically stable log-softmax of one row:  out[i] = x[i] - max - log(sum exp(x - max)).
/// Shapes   out [n] written (may alias x);  x [n]
void log_softmax(float * out, const float * x, int64_t n);

/// Index of the largest element (lowest index on ties).   Shapes  x [n], n >= 1.
int64_t argmax(const float * x, int64_t n);

// ---------------------------------------------------------------------------------------------
// Dtype conversion (checkpoint loading)
// ---------------------------------------------------------------------------------------------

/// bf16 (upper half of an IEEE f32) → f32.   Shapes  out, in [n].
void bf16_to_f32(float * out, const uint16_t * in, int64_t n);
/// IEEE half → f32 (subnormals, inf and NaN preserved).   Shapes  out, in [n].
void f16_to_f32(float * out, const uint16_t * in, int64_t n);

/// Index of the first non-finite value (NaN, +Inf, -Inf) among `n` values, or -1 if all are
/// finite. Reads the exponent bits only (all ones = Inf or NaN): no FP exceptions, no
/// dependence on -ffast-math. Vectorized OR-reduction over blocks of 1024, then a scalar scan of
/// the flagged block; runs at memory bandwidth, so loaders call it on data still in cache.
/// Shapes   x [n]   as IEEE f32 / bf16 (upper half of an f32) / IEEE f16 bits.
int64_t find_nonfinite_f32(const float * x, int64_t n);
int64_t find_nonfinite_bf16(const uint16_t * x, int64_t n);
int64_t find_nonfinite_f16(const uint16_t * x, int64_t n);

}  // namespace fd::kernels
