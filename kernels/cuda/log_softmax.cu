// Per-row log-softmax and argmax of the logits (see fd/kernels/cuda_ops.h): one 256-thread block
// per row; thread i reads x[j] for j = i, i + 256, ... ascending, then fixed trees over threads.
#include "cuda_common.cuh"
#include "fd/kernels/cuda_ops.h"

namespace fd::kernels::cuda {

namespace {

constexpr int kThreads = 256;

__global__ void log_softmax_argmax_kernel(float * out, int64_t * best, const float * x, int64_t n) {
    __shared__ float   smax[kThreads];
    __shared__ double  ssum[kThreads];
    __shared__ int64_t sidx[kThreads];
    const int64_t r   = blockIdx.x;
    const int     tid = threadIdx.x;
    const float * xr  = x + r * n;
    // Max and argmax (lowest index among equal maxima: each thread scans ascending with a
    // strict >, the tree prefers the lower index on ties).
    float   bv = -INFINITY;
    int64_t bi = INT64_MAX;
    for (int64_t j = tid; j < n; j += kThreads) {
        if (bi == INT64_MAX || xr[j] > bv) { bv = xr[j]; bi = j; }
    }
    smax[tid] = bv;
    sidx[tid] = bi;
    __syncthreads();
    for (int s = kThreads / 2; s > 0; s >>= 1) {
        if (tid < s) {
            const float   v2 = smax[tid + s];
            const int64_t i2 = sidx[tid + s];
            if (i2 != INT64_MAX && (sidx[tid] == INT64_MAX || v2 > smax[tid] || (v2 == smax[tid] && i2 < sidx[tid]))) {
                smax[tid] = v2;
                sidx[tid] = i2;
            }
        }
        __syncthreads();
    }
    const float mx = smax[0];
    if (best != nullptr && tid == 0) { best[r] = sidx[0]; }
    if (out == nullptr) { return; }
    double ds = 0.0;
    for (int64_t j = tid; j < n; j += kThreads) { ds += exp(static_cast<double>(xr[j] - mx)); }
    ssum[tid] = ds;
    __syncthreads();
    for (int s = kThreads / 2; s > 0; s >>= 1) {
        if (tid < s) { ssum[tid] += ssum[tid + s]; }
        __syncthreads();
    }
    const float lse = static_cast<float>(log(ssum[0]));
    float *     o   = out + r * n;
    for (int64_t j = tid; j < n; j += kThreads) { o[j] = xr[j] - mx - lse; }
}

}  // namespace

void log_softmax_argmax(float * out, int64_t * best, const float * x, int64_t n_rows, int64_t n, cudaStream_t stream) {
    if (n_rows <= 0 || n <= 0 || (out == nullptr && best == nullptr)) { return; }
    log_softmax_argmax_kernel<<<static_cast<unsigned>(n_rows), kThreads, 0, stream>>>(out, best, x, n);
    check_launch("log_softmax_argmax");
}

}  // namespace fd::kernels::cuda
