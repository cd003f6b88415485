// Embedding gather (see fd/kernels/cuda_ops.h): one block per token, rows widened to f32.
#include "cuda_common.cuh"
#include "fd/kernels/cuda_ops.h"

namespace fd::kernels::cuda {

namespace {

__global__ void embedding_kernel(float * out, const int32_t * ids, const void * table, bool bf16, int64_t n_embd,
                                 int64_t vocab_begin, int64_t vocab_rows) {
    const int64_t t  = blockIdx.x;
    const int64_t id = static_cast<int64_t>(ids[t]) - vocab_begin;
    float *       o  = out + t * n_embd;
    if (id < 0 || id >= vocab_rows) {
        for (int64_t j = threadIdx.x; j < n_embd; j += blockDim.x) { o[j] = 0.0f; }
        return;
    }
    if (bf16) {
        const uint16_t * r = static_cast<const uint16_t *>(table) + id * n_embd;
        for (int64_t j = threadIdx.x; j < n_embd; j += blockDim.x) { o[j] = bf16_bits_to_f32(r[j]); }
    } else {
        const float * r = static_cast<const float *>(table) + id * n_embd;
        for (int64_t j = threadIdx.x; j < n_embd; j += blockDim.x) { o[j] = r[j]; }
    }
}

}  // namespace

void embedding(float * out, const int32_t * ids, const void * table, WType wtype, int64_t n_tokens, int64_t n_embd,
               int64_t vocab_begin, int64_t vocab_rows, cudaStream_t stream) {
    if (n_tokens <= 0 || n_embd <= 0) { return; }
    embedding_kernel<<<static_cast<unsigned>(n_tokens), 256, 0, stream>>>(out, ids, table, wtype == WType::bf16, n_embd,
                                                                            vocab_begin, vocab_rows);
    check_launch("embedding");
}

}  // namespace fd::kernels::cuda
