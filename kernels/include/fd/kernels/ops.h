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
// - No signature here carries a thread pool or a device: these are the host (CPU) ops, the
//   oracle. The ops that run in parallel (linear, attention_paged) are declared with their
//   ThreadPool in fd/kernels/cpu_ops.h; the forward pass runs every op through a
//   fd::kernels::Backend (fd/kernels/backend.h), whose CPU implementation calls these.
// - CPU implementations live in kernels/cpu/<op>.cpp; CUDA twins go in kernels/cuda/<op>.cu and
//   are tested against these.
#pragma once

#include "fd/dtype.h"

#include <cstddef>
#include <cstdint>

namespace fd::kernels {

// ---------------------------------------------------------------------------------------------
// Linear layers
// ---------------------------------------------------------------------------------------------

/// How a linear weight is stored in memory: the checkpoint's own dtype, so loading and updating
/// weights is a copy (F16 checkpoints are widened to f32 at load, so the kernels see f32 or bf16).
/// Deprecated alias of the one fd::DType (fd/dtype.h), kept while the kernels and the branches
/// written before issue #22 spell it WType; new code writes fd::DType.
using WType = fd::DType;

/// out = x · Wᵀ (+ bias): the CPU kernel is declared in fd/kernels/cpu_ops.h (it runs on a
/// ThreadPool); the forward pass calls it through Backend::linear.

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

/// One layer's paged KV pool. K is stored transposed within each block, so attention reads
/// dimension d of consecutive keys as one contiguous run (no transpose per chunk); V is not:
///   k [n_blocks, n_kv_heads, head_dim, block_size]
///   v [n_blocks, block_size, n_kv_heads, head_dim]
/// Both are block_size * n_kv_heads * head_dim elements of `dtype` per block: whole-block copies
/// (swap, prefix reuse) do not depend on the layout. dtype f32 (--kv-cache-dtype auto|float32):
/// 4 bytes per element; bf16 (--kv-cache-dtype bfloat16): 2 bytes, the upper half of an IEEE f32,
/// written rounded to nearest even by kv_store and widened exactly to f32 by attention.
struct PagedKv {
    void *  k          = nullptr;  ///< `dtype` elements
    void *  v          = nullptr;  ///< `dtype` elements
    int32_t block_size = 0;  ///< tokens per block
    int32_t n_kv_heads = 0;
    int32_t head_dim   = 0;
    WType   dtype      = WType::f32;  ///< element type of k and v (f32 or bf16)
};

/// Bytes of one element of a KV pool of `dtype` (4 for f32, 2 for bf16).
constexpr int64_t kv_elem_bytes(WType dtype) { return dtype == WType::bf16 ? 2 : 4; }

/// f32 -> bf16 bits, round to nearest even (NaN stays a quiet NaN of the same sign; values past
/// the largest bf16 round to +-Inf, as PyTorch's .to(torch.bfloat16) does).
inline uint16_t f32_to_bf16_rne(float x) {
    uint32_t u;
    __builtin_memcpy(&u, &x, sizeof u);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) { return static_cast<uint16_t>((u >> 16) | 0x0040u); }
    return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

/// Store each token's K and V at its slot (slot = block_id * block_size + offset), in
/// PagedKv's layout: k[block_id, kvh, d, offset] = k_new[t, kvh, d], v[slot, :, :] = v_new[t, :, :]
/// (bf16 pools: each value rounded to nearest even, f32_to_bf16_rne).
/// Shapes   k_new, v_new [n_tokens, n_kv_heads, head_dim] f32;  slots [n_tokens]
void kv_store(PagedKv kv, const float * k_new, const float * v_new, const int64_t * slots,
              int64_t n_tokens);

/// What one query token attends to: positions [0, n_ctx) of its sequence, whose KV lives in
/// blocks block_table[0 .. ceil(n_ctx / block_size)).
struct AttnQuery {
    const int32_t * block_table = nullptr;
    int32_t         n_ctx       = 0;
};

/// Causal GQA attention over the paged pool: the CPU kernel is declared in fd/kernels/cpu_ops.h
/// (it runs on a ThreadPool); the forward pass calls it through Backend::attention_paged.

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
