// fd/kernels/cuda_vmm_allocator.h — device memory by tag through the CUDA driver's virtual-memory
// API, so a tag's physical memory can be handed back (sleep) and taken again (wakeup) while every
// device pointer into it, and every CUDA graph that captured one, stays valid.
//
// Per tag: one reserved virtual address range (cuMemAddressReserve), backed by physical chunks
// (cuMemCreate, pinned device memory of the allocator's device) mapped in order (cuMemMap) and
// made read-write for that device (cuMemSetAccess).
//   release(tag)    cuMemUnmap + cuMemRelease of every chunk: the physical memory goes back to
//                   the driver (cudaMemGetInfo's free grows), the address range stays reserved.
//   reacquire(tag)  fresh chunks mapped at the SAME addresses. Their contents are undefined:
//                   the caller reloads weights / treats the KV cache as empty.
// The same idea as vLLM's CuMemAllocator and SGLang's torch_memory_saver.
//
// Errors: every failure throws fd::Error. Errc::invalid_argument for a bad tag use (creating a
// tag twice, a zero size, releasing / reacquiring a tag never created); Errc::internal for a
// CUDA driver failure (the message names the call and the driver's error string, e.g. out of
// memory). A failed create or reacquire unmaps and frees what it had mapped: state unchanged.
// Not thread-safe: one owner (the rank's backend) calls it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>
#include <vector>

namespace fd::kernels::cuda {

/// What a device allocation holds (the tagged-allocator tags of ARCHITECTURE.md).
enum class MemTag : uint8_t { weight = 0, kv_cache = 1, staging = 2, kv_swap = 3 };
inline constexpr int kMemTagCount = 4;
std::string_view mem_tag_name(MemTag tag);

class CudaVmmAllocator {
public:
    /// Binds to `device` (cudaSetDevice + the runtime's primary context, so pointers work with
    /// the CUDA runtime and cuBLAS too). `chunk_bytes`: physical allocation unit, rounded up to
    /// the device's allocation granularity (2 MiB on H100/H200).
    explicit CudaVmmAllocator(int device = 0, size_t chunk_bytes = size_t{512} << 20);
    ~CudaVmmAllocator();
    CudaVmmAllocator(const CudaVmmAllocator &)             = delete;
    CudaVmmAllocator & operator=(const CudaVmmAllocator &) = delete;

    /// Reserve `bytes` (rounded up to the granularity) of address space for `tag` and map physical
    /// memory there. Returns the device base pointer, valid until this allocator is destroyed.
    void * create(MemTag tag, size_t bytes);

    /// Unmap and free the tag's physical memory; the addresses stay reserved. No-op when the tag
    /// is already released. Returns the bytes handed back (0 when already released).
    size_t release(MemTag tag);

    /// Map fresh physical memory at the tag's addresses (contents undefined). No-op when resident.
    void reacquire(MemTag tag);

    bool   has(MemTag tag) const { return tags_[index(tag)].base != 0; }
    bool   resident(MemTag tag) const { return !tags_[index(tag)].handles.empty(); }
    void * base(MemTag tag) const { return reinterpret_cast<void *>(tags_[index(tag)].base); }
    /// Bytes reserved for the tag (a multiple of the granularity), 0 when never created.
    size_t bytes(MemTag tag) const { return tags_[index(tag)].size; }
    size_t granularity() const { return granularity_; }
    int    device() const { return device_; }

private:
    struct Tag {
        unsigned long long         base = 0;  // CUdeviceptr
        size_t                     size = 0;
        std::vector<size_t>        chunk_sizes;
        std::vector<unsigned long long> handles;  // CUmemGenericAllocationHandle, empty = released
    };
    static int index(MemTag tag) { return static_cast<int>(tag); }
    /// Create + map + set access for every chunk of `t`; on failure undoes its own work and throws.
    void map_all(Tag & t, MemTag tag);
    void unmap_all(Tag & t);

    int    device_      = 0;
    int    cu_device_   = 0;
    size_t granularity_ = 0;
    size_t chunk_bytes_ = 0;
    Tag    tags_[kMemTagCount];
};

}  // namespace fd::kernels::cuda
