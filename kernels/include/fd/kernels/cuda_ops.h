// fd/kernels/cuda_ops.h — the CUDA twins of the ops in fd/kernels/ops.h (built with FD_WITH_CUDA).
//
// Conventions (as ops.h, plus):
// - Every pointer is DEVICE memory unless its comment says host. Shapes are written outermost
//   dimension first, with names; tensors are contiguous, row-major; dtypes f32 unless stated.
// - Every op is enqueued on `stream` and returns without synchronizing; launch errors are thrown
//   as fd::Error{Errc::internal} naming the op (cudaGetLastError after the launch). Arguments are
//   validated by the callers (the model runner), as on the CPU; shapes with a zero dimension
//   enqueue nothing.
// - Batch invariance: each output row is computed by the same sequence of floating-point
//   operations whatever the number of rows or the other rows' contents. Reductions have a fixed
//   order that depends on the row's own sizes only (n_embd, n_in, head_dim, n_ctx), never on
//   the launch's grid size; tests/gpu/test_cuda_ops.cpp checks row r bitwise for n_rows 1..64.
// - Numerics: f32 with f32 accumulation (expf/logf/sqrtf, no fast-math intrinsics). Results
//   match the CPU ops within f32 rounding (the reduction orders differ from the CPU's lanes), not
//   bitwise.
// - Implementation: kernels/cuda/<op>.cu, one per op, sm_90 only (CMAKE_CUDA_ARCHITECTURES 90).
#pragma once

#include "fd/kernels/ops.h"  // WType

#include <cuda_runtime_api.h>

#include <cstdint>

namespace fd::kernels::cuda {

/// Embedding gather over this rank's vocab rows [vocab_begin, vocab_begin + vocab_rows):
///   out[t, :] = table[ids[t] - vocab_begin, :] widened to f32, or zeros when ids[t] is outside
///   that range (another tensor-parallel rank owns that vocab row).
/// Shapes   out [n_tokens, n_embd] written;  ids [n_tokens] int32;  table [vocab_rows, n_embd] `wtype`.
void embedding(float * out, const int32_t * ids, const void * table, WType wtype, int64_t n_tokens, int64_t n_embd,
               int64_t vocab_begin, int64_t vocab_rows, cudaStream_t stream);

/// RMSNorm: out[t, :] = weight[:] * (x[t, :] / sqrt(mean(x[t, :]^2) + eps)).
/// One 256-thread block per row; thread i sums x[t, j]^2 for j = i, i + 256, ... ascending, then
/// a fixed tree over the 256 partial sums.
/// Shapes   out [n_rows, n_embd] written, may alias x;  x [n_rows, n_embd];  weight [n_embd].
void rms_norm(float * out, const float * x, const float * weight, int64_t n_rows, int64_t n_embd, float eps,
              cudaStream_t stream);

/// SwiGLU gate: out[i] = gate[i] / (1 + expf(-gate[i])) * up[i].
/// Shapes   out, gate, up [n_elems]; out may alias gate.
void silu_mul(float * out, const float * gate, const float * up, int64_t n_elems, cudaStream_t stream);

/// SwiGLU over rows holding gate | up:  out[t, j] = silu(gate_up[t, j]) * gate_up[t, n_ff + j].
/// Shapes   out [n_rows, n_ff] written;  gate_up [n_rows, 2 * n_ff] (no aliasing).
void silu_mul_rows(float * out, const float * gate_up, int64_t n_rows, int64_t n_ff, cudaStream_t stream);

/// Row gather: out[i, :] = x[rows[i], :].
/// Shapes   out [n_out_rows, n_cols] written;  x [n_rows_x, n_cols];  rows [n_out_rows] int32.
void gather_rows(float * out, const float * x, const int32_t * rows, int64_t n_out_rows, int64_t n_cols,
                 cudaStream_t stream);

/// Residual add: out[i] += x[i].   Shapes  out, x [n_elems].
void add_inplace(float * out, const float * x, int64_t n_elems, cudaStream_t stream);

/// RoPE, HF rotate_half (element j pairs with j + head_dim/2), in place:
///   x1' = x1*cos - x2*sin,  x2' = x2*cos + x1*sin   with cos/sin from the table row positions[t].
/// The table is the CPU's (fd::kernels::rope_table / rope_table_inv_freq, Llama/Qwen theta or
/// rope_scaling), copied to the device once.
/// Shapes   x [n_tokens, n_heads, head_dim] modified;  positions [n_tokens] int32 (< n_pos);
///          cos_sin [n_pos, head_dim];  head_dim even.
void rope_rotate_half(float * x, const int32_t * positions, const float * cos_sin, int64_t n_tokens, int64_t n_heads,
                      int64_t head_dim, cudaStream_t stream);

/// Store each token's K and V in the paged pool at its slot (slot = block_id * block_size + offset):
/// the layout of fd::kernels::PagedKv, k/v pointing to device memory.
/// Shapes   kv.k [n_blocks, n_kv_heads, head_dim, block_size] (K transposed within each block);
///          kv.v [n_blocks, block_size, n_kv_heads, head_dim];  kv.dtype f32, or bf16 (each value
///          rounded to nearest even, f32_to_bf16_rne's rule);
///          k_new, v_new [n_tokens, n_kv_heads, head_dim] f32;  slots [n_tokens] int64.
void kv_store(PagedKv kv, const float * k_new, const float * v_new, const int64_t * slots, int64_t n_tokens,
              cudaStream_t stream);

/// What each query token attends to, as device arrays (the CUDA form of AttnQuery): positions
/// [0, n_ctx[i]) of the sequence whose block table is row table_row[i] of block_tables.
struct AttnBatch {
    const int32_t * block_tables = nullptr;  ///< [n_tables, max_blocks] int32 block ids
    int32_t         max_blocks   = 0;        ///< row stride of block_tables
    const int32_t * table_row    = nullptr;  ///< [n_tokens] int32
    const int32_t * n_ctx        = nullptr;  ///< [n_tokens] int32, >= 1
};

/// Causal GQA attention over the paged pool (prefill and decode alike: each query token has its
/// own n_ctx), one 128-thread block per (token, head):
///   s[t] = scale * <q[i, h, :], K[t, h / (n_heads / n_kv_heads), :]>   for t < n_ctx(i)
///   out[i, h, :] = sum_t exp(s[t] - max s) * V[t, kv(h), :]  /  sum_t exp(s[t] - max s)
/// Fixed order per (token, head): each score is one thread's FMA chain over d ascending, then
/// times scale (the CPU's order; consecutive lanes take consecutive keys, so the transposed K is
/// read coalesced); the exp-sum and the V accumulation run over t ascending (one FMA per t).
/// n_ctx is read from device memory and the grid is (n_heads, n_tokens) only, so a captured
/// graph replays correctly for any lengths up to the block tables' max_blocks.
/// Shapes   out [n_tokens, n_heads, head_dim] written;  q [n_tokens, n_heads, head_dim];
///          head_dim <= 512, n_heads a multiple of kv.n_kv_heads;  kv.dtype f32 or bf16 (each K/V
///          element widened exactly to f32 when read: the f32 kernel's result over rounded values).
void attention_paged(float * out, const float * q, AttnBatch batch, int64_t n_tokens, int64_t n_heads, PagedKv kv,
                     float scale, cudaStream_t stream);

/// Per row: out[r, :] = log_softmax(x[r, :]) (max, then a double-precision sum of exp over a
/// fixed 256-way split and tree) and best[r] = argmax (lowest index on ties).
/// Shapes   out [n_rows, n] written (may alias x, or nullptr to skip);  x [n_rows, n];
///          best [n_rows] int64 written (or nullptr to skip).
void log_softmax_argmax(float * out, int64_t * best, const float * x, int64_t n_rows, int64_t n,
                        cudaStream_t stream);

/// out = x · Wᵀ (+ bias), W in the checkpoint's layout and dtype (as fd::kernels::linear):
///   out[r, o] = sum_k x[r, k] * W[o, k]  (+ bias[o])
/// A tiled kernel of our own (64 rows x 64 outputs per 256-thread block, k in tiles of 32 staged
/// in shared memory, bf16 widened when staged): every output is ONE FMA chain over k ascending
/// (then + bias), so a row's result is bitwise independent of n_rows (batch-invariant).
/// Shapes   out [n_rows, n_out] written;  x [n_rows, n_in];  w [n_out, n_in] `wtype`;
///          bias [n_out] or nullptr.
void linear(float * out, const float * x, const void * w, WType wtype, const float * bias, int64_t n_rows,
            int64_t n_out, int64_t n_in, cudaStream_t stream);

/// The NaN/Inf check on stored bits: *first = min(*first, i) for every element i of x whose
/// exponent bits are all ones. `bits_kind` 0 = f32, 1 = bf16, 2 = f16. The caller sets *first
/// to ULLONG_MAX before and reads it after the stream finished.
/// Shapes   x [n] of that type;  first [1] device.
void first_nonfinite(unsigned long long * first, const void * x, int bits_kind, int64_t n, cudaStream_t stream);

}  // namespace fd::kernels::cuda
