// fd/memory/cuda_vmm_allocator.h — the CUDA fd::memory::Allocator: device memory by tag through the
// driver's virtual-memory API, so a tag's physical memory can be handed back (sleep) and taken
// again (wakeup) while every device pointer into it, and every CUDA graph that captured one,
// stays valid (keeps_addresses() is true).
//
// Per tag: one reserved virtual address range (cuMemAddressReserve), backed by physical chunks
// (cuMemCreate: pinned memory of the allocator's device) mapped in order (cuMemMap) and made
// read-write for that device (cuMemSetAccess).
//   release(tag)    waits for the device, then cuMemUnmap + cuMemRelease of every chunk: the
//                   physical memory goes back to the driver (cudaMemGetInfo's free grows), the
//                   address range stays reserved.
//   reacquire(tag)  fresh chunks mapped at the SAME addresses, zero-filled.
//   drop(tag)       release + cuMemAddressFree.
// The same idea as vLLM's CuMemAllocator and SGLang's torch_memory_saver.
// Except kv_swap: the host swap tier is HOST memory (the inner host allocator's mmap region,
// same addresses across release / reacquire) page-locked with cudaHostRegister while resident,
// so swap copies run at DMA speed. swap() never exchanges kv_swap with a device tag.
//
// The driver is reached through the CUDA runtime (cudaGetDriverEntryPointByVersion): nothing
// links libcuda.so.1, so binaries still load on a machine without the NVIDIA driver.
// Errors as fd::memory::Allocator; a CUDA driver failure is fd::Error{internal} naming the call
// and the driver's error string (e.g. CUDA_ERROR_OUT_OF_MEMORY). Built only with FD_WITH_CUDA.
#pragma once

#include "fd/memory/allocator.h"

#include <memory>

namespace fd::memory {

/// The CUDA virtual-memory allocator on device `device` (-1: the calling thread's current device;
/// make_allocator(DeviceKind::cuda) uses that) (cudaSetDevice + the runtime's primary
/// context, so its pointers work with the CUDA runtime, cuBLAS and NCCL). `chunk_bytes`: the
/// physical allocation unit, rounded up to the device's granularity (2 MiB on H100/H200).
/// Errors  fd::Error{internal} when the device is absent or lacks virtual memory management.
std::unique_ptr<Allocator> make_cuda_vmm_allocator(int device = 0, int64_t chunk_bytes = int64_t{512} << 20);

/// The device's allocation granularity in bytes (regions are multiples of it).
int64_t cuda_vmm_granularity(int device = 0);

}  // namespace fd::memory
