// out = x · Wᵀ (+ bias), batch-invariant tiled GEMM (see fd/kernels/cuda_ops.h).
//
// Block: 64 rows x 64 outputs, 256 threads; thread (tx, ty) = (tid % 16, tid / 16) owns rows
// r0 + ty + 16a and outputs o0 + tx + 16c (a, c < 4). k is walked in tiles of 32 staged in
// shared memory (x as f32, W widened to f32; positions past n_rows / n_out / n_in staged as 0).
// Every output is ONE accumulator: acc = fmaf(x[r, k], W[o, k], acc) for k = 0, 1, ... n_in - 1,
// then acc + bias[o]. Tiling only decides who computes an output, never how, so the result of a
// row is bitwise independent of n_rows and of the other rows (the tests check rows 1..64).
#include "cuda_common.cuh"
#include "fd/kernels/cuda_ops.h"

namespace fd::kernels::cuda {

namespace {

constexpr int kBm = 64, kBn = 64, kBk = 32, kThreads = 256, kPer = 4;

template <bool Bf16>
__global__ void __launch_bounds__(kThreads) linear_kernel(float * out, const float * x, const void * w,
                                                          const float * bias, int64_t n_rows, int64_t n_out,
                                                          int64_t n_in) {
    __shared__ float xs[kBm][kBk + 1];
    __shared__ float ws[kBn][kBk + 1];
    const int     tid = threadIdx.x, tx = tid % 16, ty = tid / 16;
    const int64_t r0 = static_cast<int64_t>(blockIdx.y) * kBm, o0 = static_cast<int64_t>(blockIdx.x) * kBn;
    float         acc[kPer][kPer] = {};
    for (int64_t k0 = 0; k0 < n_in; k0 += kBk) {
        for (int idx = tid; idx < kBm * kBk; idx += kThreads) {
            const int     rr = idx / kBk, kk = idx % kBk;
            const int64_t r = r0 + rr, k = k0 + kk;
            xs[rr][kk] = (r < n_rows && k < n_in) ? x[r * n_in + k] : 0.0f;
        }
        for (int idx = tid; idx < kBn * kBk; idx += kThreads) {
            const int     oo = idx / kBk, kk = idx % kBk;
            const int64_t o = o0 + oo, k = k0 + kk;
            float         v = 0.0f;
            if (o < n_out && k < n_in) {
                if constexpr (Bf16) {
                    v = bf16_bits_to_f32(static_cast<const uint16_t *>(w)[o * n_in + k]);
                } else {
                    v = static_cast<const float *>(w)[o * n_in + k];
                }
            }
            ws[oo][kk] = v;
        }
        __syncthreads();
        // k past n_in is staged as 0 in both operands: fmaf(0, 0, acc) == acc, and which k
        // are padded depends on n_in only.
#pragma unroll 8
        for (int kk = 0; kk < kBk; ++kk) {
            float xv[kPer], wv[kPer];
#pragma unroll
            for (int a = 0; a < kPer; ++a) { xv[a] = xs[ty + 16 * a][kk]; }
#pragma unroll
            for (int c = 0; c < kPer; ++c) { wv[c] = ws[tx + 16 * c][kk]; }
#pragma unroll
            for (int a = 0; a < kPer; ++a) {
#pragma unroll
                for (int c = 0; c < kPer; ++c) { acc[a][c] = fmaf(xv[a], wv[c], acc[a][c]); }
            }
        }
        __syncthreads();
    }
#pragma unroll
    for (int a = 0; a < kPer; ++a) {
        const int64_t r = r0 + ty + 16 * a;
        if (r >= n_rows) { continue; }
#pragma unroll
        for (int c = 0; c < kPer; ++c) {
            const int64_t o = o0 + tx + 16 * c;
            if (o < n_out) { out[r * n_out + o] = bias != nullptr ? acc[a][c] + bias[o] : acc[a][c]; }
        }
    }
}

}  // namespace

void linear(float * out, const float * x, const void * w, WType wtype, const float * bias, int64_t n_rows,
            int64_t n_out, int64_t n_in, cudaStream_t stream) {
    if (n_rows <= 0 || n_out <= 0) { return; }
    const dim3 grid(static_cast<unsigned>((n_out + kBn - 1) / kBn), static_cast<unsigned>((n_rows + kBm - 1) / kBm));
    if (wtype == WType::bf16) {
        linear_kernel<true><<<grid, kThreads, 0, stream>>>(out, x, w, bias, n_rows, n_out, n_in);
    } else {
        linear_kernel<false><<<grid, kThreads, 0, stream>>>(out, x, w, bias, n_rows, n_out, n_in);
    }
    check_launch("linear");
}

}  // namespace fd::kernels::cuda
