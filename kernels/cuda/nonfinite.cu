// first_nonfinite (see fd/kernels/cuda_ops.h): the NaN/Inf check of weights copied
// device-to-device (CUDA IPC), on their stored bits: exponent all ones.
#include "cuda_common.cuh"
#include "fd/kernels/cuda_ops.h"

namespace fd::kernels::cuda {

namespace {

constexpr int kThreads = 256;

/// *first = min(*first, i) over the elements i whose exponent bits (mask) are all ones.
template <typename T>
__global__ void first_nonfinite_kernel(const T * x, int64_t n, T mask, unsigned long long * first) {
    for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
         i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
        if ((x[i] & mask) == mask) { atomicMin(first, static_cast<unsigned long long>(i)); }
    }
}

}  // namespace

void first_nonfinite(unsigned long long * first, const void * x, int bits_kind, int64_t n, cudaStream_t stream) {
    if (n <= 0) { return; }
    const unsigned grid = grid_for(n, kThreads);
    if (bits_kind == 0) {
        first_nonfinite_kernel<uint32_t><<<grid, kThreads, 0, stream>>>(static_cast<const uint32_t *>(x), n, 0x7f800000u, first);
    } else {
        const uint16_t mask = bits_kind == 1 ? uint16_t{0x7f80} : uint16_t{0x7c00};
        first_nonfinite_kernel<uint16_t><<<grid, kThreads, 0, stream>>>(static_cast<const uint16_t *>(x), n, mask, first);
    }
    check_launch("first_nonfinite");
}

}  // namespace fd::kernels::cuda
