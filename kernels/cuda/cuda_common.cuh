// Shared helpers of the CUDA ops (kernels/cuda/*.cu): launch checking and small device helpers.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace fd::kernels::cuda {

/// Throws fd::Error{Errc::internal} naming `op` when the last launch failed (cudaGetLastError).
/// Defined in cuda_check.cpp (host compiler), so the .cu files need not include fmt.
void check_launch(const char * op);

/// Blocks of `threads` covering `n` elements, capped for grid-stride loops.
inline unsigned grid_for(int64_t n, int threads) {
    const int64_t b = (n + threads - 1) / threads;
    return static_cast<unsigned>(b < 65535 * 16 ? (b < 1 ? 1 : b) : 65535 * 16);
}

#ifdef __CUDACC__
/// bf16 (the upper half of an IEEE f32) → f32, exact.
__device__ __forceinline__ float bf16_bits_to_f32(uint16_t b) { return __uint_as_float(static_cast<uint32_t>(b) << 16); }
#endif

}  // namespace fd::kernels::cuda
