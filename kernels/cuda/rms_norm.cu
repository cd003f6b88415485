// RMSNorm (see fd/kernels/cuda_ops.h): one 256-thread block per row, fixed reduction order.
#include "cuda_common.cuh"
#include "fd/kernels/cuda_ops.h"

namespace fd::kernels::cuda {

namespace {

constexpr int kThreads = 256;

__global__ void rms_norm_kernel(float * out, const float * x, const float * weight, int64_t n_embd, float eps) {
    __shared__ float part[kThreads];
    const int64_t    t  = blockIdx.x;
    const float *    xr = x + t * n_embd;
    float *          o  = out + t * n_embd;
    float            ss = 0.0f;
    for (int64_t j = threadIdx.x; j < n_embd; j += kThreads) { ss = fmaf(xr[j], xr[j], ss); }
    part[threadIdx.x] = ss;
    __syncthreads();
    for (int s = kThreads / 2; s > 0; s >>= 1) {  // fixed tree: part[i] += part[i + s]
        if (static_cast<int>(threadIdx.x) < s) { part[threadIdx.x] += part[threadIdx.x + s]; }
        __syncthreads();
    }
    const float inv = 1.0f / sqrtf(part[0] / static_cast<float>(n_embd) + eps);
    for (int64_t j = threadIdx.x; j < n_embd; j += kThreads) { o[j] = weight[j] * (inv * xr[j]); }
}

}  // namespace

void rms_norm(float * out, const float * x, const float * weight, int64_t n_rows, int64_t n_embd, float eps,
              cudaStream_t stream) {
    if (n_rows <= 0 || n_embd <= 0) { return; }
    rms_norm_kernel<<<static_cast<unsigned>(n_rows), kThreads, 0, stream>>>(out, x, weight, n_embd, eps);
    check_launch("rms_norm");
}

}  // namespace fd::kernels::cuda
