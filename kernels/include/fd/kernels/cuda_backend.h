// fd/kernels/cuda_backend.h — the CUDA fd::kernels::Backend (built with FD_WITH_CUDA): one
// non-blocking stream on one device, the ops of fd/kernels/cuda_ops.h, device memory from
// cudaMalloc (scratch) or an fd::memory CUDA allocator region (weights, KV pool).
//
// Host index arrays (tokens, positions, KV slots, attention queries and their block tables, row
// ids) are copied to the device through pinned staging buffers on the stream; the ones handed to
// begin_step() are copied once per step and reused by every layer's ops (the attention batch is
// flattened once per step too). Results are batch-invariant like the CPU backend's; they match
// it within f32 rounding (tests/gpu/test_cuda_backend.cpp), not bitwise.
// linear is our own fixed-order tiled kernel (no cuBLAS: its heuristics choose a split of k by
// problem size, which would break batch invariance); --no-batch-invariant adds cuBLAS SGEMM.
#pragma once

#include "fd/kernels/backend.h"

#include <memory>
#include <string>

namespace fd::kernels {

/// The CUDA backend on device `device_id`, with `n_host_threads` (>= 1) host threads for
/// host_pool(). `batch_invariant` false (--no-batch-invariant): linear with f32 weights and no
/// bias runs cuBLAS's heuristic SGEMM (libcublas dlopen'ed on first use; absent: the fixed-order
/// kernel); BF16 weights and biased layers keep the fixed-order kernel.
/// Errors  fd::Error{invalid_argument} when no such CUDA device is visible (the message says
/// "no CUDA device visible" and why); fd::Error{internal} when the stream cannot be created.
std::unique_ptr<Backend> make_cuda_backend(int32_t device_id, int32_t n_host_threads, bool batch_invariant = true);

/// True when CUDA device `device_id` is usable; otherwise false and `why` says why ("no CUDA
/// device visible (...)" when the runtime finds none).
bool cuda_device_available(int32_t device_id, std::string * why);

/// cudaGetDeviceCount (0 on any error: no driver, no device).
int32_t cuda_device_count();

/// cudaMemGetInfo on device `device_id` (made current on the calling thread).
/// Errors  fd::Error{internal} when the runtime call fails.
MemInfo cuda_mem_info(int32_t device_id);

}  // namespace fd::kernels
