// Elementwise ops (see fd/kernels/cuda_ops.h): silu_mul, silu_mul_rows, add_inplace, gather_rows;
// grid-stride loops.
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

__global__ void silu_mul_rows_kernel(float * out, const float * gate_up, int64_t n_rows, int64_t n_ff) {
    const int64_t n = n_rows * n_ff;
    for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
         i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
        const int64_t t = i / n_ff, j = i % n_ff;
        const float   g = gate_up[t * 2 * n_ff + j];
        out[i] = g / (1.0f + expf(-g)) * gate_up[t * 2 * n_ff + n_ff + j];
    }
}

__global__ void gather_rows_kernel(float * out, const float * x, const int32_t * rows, int64_t n_out_rows, int64_t n_cols) {
    const int64_t n = n_out_rows * n_cols;
    for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
         i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
        out[i] = x[static_cast<int64_t>(rows[i / n_cols]) * n_cols + i % n_cols];
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

void silu_mul_rows(float * out, const float * gate_up, int64_t n_rows, int64_t n_ff, cudaStream_t stream) {
    if (n_rows <= 0 || n_ff <= 0) { return; }
    silu_mul_rows_kernel<<<grid_for(n_rows * n_ff, kThreads), kThreads, 0, stream>>>(out, gate_up, n_rows, n_ff);
    check_launch("silu_mul_rows");
}

void gather_rows(float * out, const float * x, const int32_t * rows, int64_t n_out_rows, int64_t n_cols,
                 cudaStream_t stream) {
    if (n_out_rows <= 0 || n_cols <= 0) { return; }
    gather_rows_kernel<<<grid_for(n_out_rows * n_cols, kThreads), kThreads, 0, stream>>>(out, x, rows, n_out_rows, n_cols);
    check_launch("gather_rows");
}

void add_inplace(float * out, const float * x, int64_t n_elems, cudaStream_t stream) {
    if (n_elems <= 0) { return; }
    add_kernel<<<grid_for(n_elems, kThreads), kThreads, 0, stream>>>(out, x, n_elems);
    check_launch("add_inplace");
}

}  // namespace fd::kernels::cuda
