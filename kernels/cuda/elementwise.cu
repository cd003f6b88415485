// Elementwise ops (see fd/kernels/cuda_ops.h): silu_mul and add_inplace, grid-stride loops.
#include "cuda_common.cuh"
#include "fd/kernels/cuda_ops.h"

namespace fd::kernels::cuda {

namespace {

constexpr int kThreads = 256;

__global__ void silu_mul_kernel(float * out, const float * gate, const float * up, int64_t n) {
    for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
         i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
        const float g = gate[i];
        out[i] = g / (1.0f + expf(-g)) * up[i];
    }
}

__global__ void add_kernel(float * out, const float * x, int64_t n) {
    for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
         i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
        out[i] += x[i];
    }
}

}  // namespace

void silu_mul(float * out, const float * gate, const float * up, int64_t n_elems, cudaStream_t stream) {
    if (n_elems <= 0) { return; }
    silu_mul_kernel<<<grid_for(n_elems, kThreads), kThreads, 0, stream>>>(out, gate, up, n_elems);
    check_launch("silu_mul");
}

void add_inplace(float * out, const float * x, int64_t n_elems, cudaStream_t stream) {
    if (n_elems <= 0) { return; }
    add_kernel<<<grid_for(n_elems, kThreads), kThreads, 0, stream>>>(out, x, n_elems);
    check_launch("add_inplace");
}

}  // namespace fd::kernels::cuda
