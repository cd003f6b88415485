// RoPE, HF rotate_half (see fd/kernels/cuda_ops.h): one thread per (token, head, pair).
#include "cuda_common.cuh"
#include "fd/kernels/cuda_ops.h"

namespace fd::kernels::cuda {

namespace {

constexpr int kThreads = 256;

__global__ void rope_kernel(float * x, const int32_t * positions, const float * cos_sin, int64_t n_tokens,
                            int64_t n_heads, int64_t head_dim) {
    const int64_t half = head_dim / 2, n = n_tokens * n_heads * half;
    for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
         i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
        const int64_t j  = i % half;
        const int64_t th = i / half;          // token * n_heads + head
        const int64_t t  = th / n_heads;
        const float * cs = cos_sin + static_cast<int64_t>(positions[t]) * head_dim;
        float *       v  = x + th * head_dim;
        const float   x1 = v[j], x2 = v[j + half], c = cs[j], s = cs[half + j];
        v[j]        = x1 * c - x2 * s;
        v[j + half] = x2 * c + x1 * s;
    }
}

}  // namespace

void rope_rotate_half(float * x, const int32_t * positions, const float * cos_sin, int64_t n_tokens, int64_t n_heads,
                      int64_t head_dim, cudaStream_t stream) {
    const int64_t n = n_tokens * n_heads * (head_dim / 2);
    if (n <= 0) { return; }
    rope_kernel<<<grid_for(n, kThreads), kThreads, 0, stream>>>(x, positions, cos_sin, n_tokens, n_heads, head_dim);
    check_launch("rope_rotate_half");
}

}  // namespace fd::kernels::cuda
