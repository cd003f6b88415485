// fd/memory/allocator.h — the memory a rank holds, by what it is for, so that sleeping a tag is
// releasing it.
//
// Each tag owns at most one region (one contiguous range of backend memory). The Worker carves
// its tensors out of the regions:
//   weight    the live weights (fd/model/weights.h's layout)
//   kv_cache  the paged KV pool, all layers
//   staging   update_weights' second copy of the weights (swapped with `weight` on commit)
//   kv_swap   the host-side swap tier for preempted sequences' KV blocks (--swap-space)
//   ep_buffer expert parallelism's dispatch/combine buffers (model/moe_ep.cpp), mapped by the
//             first MoE step and grown with the largest; released with the weights (sleep tag
//             `weight`), mapped again (same size) by the wakeup that reloads them
// A region is either resident (physical memory behind it) or released (its size remembered;
// what the address range does is the implementation's, see keeps_addresses()).
//
// Implementations
//   HostAllocator  anonymous private mmap regions (fd::Arena): never the malloc heap, so a release
//                  returns every byte to the OS at once and RSS drops. release() keeps the address
//                  range (madvise(MADV_DONTNEED)): reacquire() gives zero-filled memory at the SAME
//                  addresses. Regions of 2 MiB or more use transparent huge pages.
//   CudaVmmAllocator (fd/memory/cuda_vmm_allocator.h) the driver's virtual-memory API:
//                  cuMemAddressReserve once, cuMemCreate + cuMemMap on reacquire, cuMemUnmap +
//                  cuMemRelease on release; same addresses. Its kv_swap region is pinned HOST
//                  memory (the swap tier's copies are upload / download).
// Not thread-safe: one owner (the Worker, on the engine thread or the rank's step loop).
#pragma once

#include "fd/kernels/backend.h"

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string_view>

namespace fd::memory {

/// mtp_cache: the MTP draft layers' KV pool (--speculative-config method "mtp"); the control
/// API's kv_cache tag covers it (sleep?tags=kv_cache frees both, wakeup maps both).
/// ep_buffer: the expert-parallel dispatch/combine buffers (--enable-expert-parallel); the
/// control API's weight tag covers it (reported as freed_bytes.ep_buffer).
enum class Tag : uint8_t { weight = 0, kv_cache = 1, staging = 2, kv_swap = 3, mtp_cache = 4, ep_buffer = 5 };
inline constexpr int kNumTags = 6;
inline constexpr std::array<Tag, kNumTags> kAllTags = {Tag::weight, Tag::kv_cache, Tag::staging, Tag::kv_swap, Tag::mtp_cache,
                                                       Tag::ep_buffer};

/// "weight", "kv_cache", "staging", "kv_swap", "mtp_cache", "ep_buffer".
const char * tag_name(Tag tag);
/// The tag named `name` (tag_name's spelling), nullopt otherwise.
std::optional<Tag> parse_tag(std::string_view name);

class Allocator {
public:
    virtual ~Allocator() = default;

    /// "host", "cuda_vmm" (for logs).
    virtual const char * name() const = 0;
    /// The device whose memory the regions are (a backend of that kind can use them).
    virtual kernels::DeviceKind device() const = 0;
    /// True when release() keeps the region's address range, so reacquire() returns the same
    /// base address and pointers into the region stay valid across release/reacquire.
    virtual bool keeps_addresses() const = 0;

    /// Give `tag` a fresh resident region of at least `bytes` (rounded up to the implementation's
    /// granularity: pages, 2 MiB huge pages, the device's granularity), zero-filled, replacing
    /// (and freeing) the tag's current region. `populate`: pre-fault every page now (resident
    /// and counted in RSS / device usage from here on); otherwise on first touch where the
    /// implementation can. Returns the region's base (64-byte aligned at least).
    /// Errors  fd::Error{internal} when out of memory (the tag then holds no region);
    ///         fd::Error{invalid_argument} when bytes <= 0.
    virtual std::byte * map(Tag tag, int64_t bytes, bool populate) = 0;

    /// Hand the physical memory of `tag`'s region back to the OS / device. The region's size is
    /// remembered for reacquire(). Returns the bytes released (0 when the tag holds no resident
    /// region). Contents are lost. Cannot fail.
    virtual int64_t release(Tag tag) noexcept = 0;

    /// Make a released region resident again, same size, zero-filled: at the same base address
    /// when keeps_addresses(). `populate` as in map(). Returns the base. No-op (returns the base)
    /// when already resident.
    /// Errors  fd::Error{internal} when the tag never had a region (nothing to reacquire) or out
    ///         of memory (the tag then stays released).
    virtual std::byte * reacquire(Tag tag, bool populate) = 0;

    /// Exchange the regions of `a` and `b` (residence, sizes and addresses travel with them): how
    /// a filled staging copy of the weights goes live at once. Pointers into either region now
    /// belong to the other tag.
    virtual void swap(Tag a, Tag b) noexcept = 0;

    /// Free the tag's region and forget it (release() + no reacquire possible). Returns the bytes
    /// released.
    virtual int64_t drop(Tag tag) noexcept = 0;

    /// Base of the tag's region (resident or released), nullptr if it has none.
    virtual std::byte * data(Tag tag) const = 0;
    /// Size of the tag's region in bytes (resident or released), 0 if none.
    virtual int64_t capacity_bytes(Tag tag) const = 0;
    /// True when the tag's region exists and is resident.
    virtual bool resident(Tag tag) const = 0;
    /// Bytes of physical memory the tag holds now (capacity when resident, else 0).
    int64_t held_bytes(Tag tag) const { return resident(tag) ? capacity_bytes(tag) : 0; }
    /// Sum of held_bytes over every tag.
    int64_t held_bytes_total() const;
};

/// The host allocator (see the header comment).
std::unique_ptr<Allocator> make_host_allocator();

/// The allocator for a backend of kind `device` (CUDA: on ordinal `device_id`; -1 = the calling
/// thread's current device).
/// Errors  fd::Error{invalid_argument} when that kind is not compiled into this build.
std::unique_ptr<Allocator> make_allocator(kernels::DeviceKind device, int32_t device_id = -1);

}  // namespace fd::memory
