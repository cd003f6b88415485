// fd/arena.h — mmap-backed bump arenas for weights and the KV pool.
//
// Memory comes straight from the kernel (anonymous private mappings), never the malloc heap, so
// release() returns every byte to the OS at once (RSS drops) and reserve() can take it back
// later: this is what sleep/wakeup builds on. Not thread-safe; owned by one component.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace fd {

class Arena {
public:
    explicit Arena(std::string name) : name_(std::move(name)) {}
    ~Arena() { release(); }
    Arena(const Arena &) = delete;
    Arena & operator=(const Arena &) = delete;
    Arena(Arena && o) noexcept;
    Arena & operator=(Arena && o) noexcept;

    /// Map `capacity_bytes` (rounded up to pages) of zeroed memory, replacing any current mapping.
    /// `populate` pre-faults every page (the memory is resident, and RSS shows it, from here on).
    /// Errors  fd::Error{internal} if mmap fails (out of memory).
    void reserve(int64_t capacity_bytes, bool populate = false);

    /// Bump-allocate `n` floats, 64-byte aligned, zero-filled.
    /// Errors  fd::Error{internal} if the arena is not reserved or is full.
    float * alloc_floats(int64_t n);

    /// Bump-allocate `n` bytes, 64-byte aligned, zero-filled (until written).
    /// Errors  fd::Error{internal} if the arena is not reserved or is full.
    std::byte * alloc_bytes(int64_t n);

    /// Forget every allocation (the mapping and its contents stay): the arena can be refilled.
    void release_allocations() { used_bytes_ = 0; }

    /// Exchange mappings (not names) with `o`: how a filled staging arena goes live at once.
    void swap_mapping(Arena & o) noexcept;

    /// Unmap everything; returns the bytes released (0 if nothing was mapped).
    int64_t release();

    /// Hand every physical page back to the OS but keep the mapping (madvise MADV_DONTNEED): the
    /// address range stays valid, RSS drops, and the memory reads as zeros from here on (pages
    /// come back on first touch, or at once with populate()). Allocations are kept. Returns the
    /// bytes discarded (0 if nothing is mapped). Cannot fail.
    int64_t discard_pages() noexcept;

    /// Pre-fault every page of the mapping (resident, and RSS shows it). No-op if none.
    void populate();

    int64_t capacity_bytes() const { return capacity_bytes_; }
    int64_t used_bytes() const { return used_bytes_; }
    bool    mapped() const { return base_ != nullptr; }
    std::byte * data() const { return base_; }  ///< start of the mapping (nullptr if none)
    const std::string & name() const { return name_; }

    /// Arenas at least this big are aligned to it and use transparent huge pages.
    static constexpr int64_t kHugePageBytes = 2 << 20;

    /// Bytes an allocation of `n` floats takes in an arena (alignment included).
    static int64_t footprint_floats(int64_t n) { return (n * 4 + 63) / 64 * 64; }

private:
    std::string name_;
    std::byte * base_           = nullptr;
    int64_t     capacity_bytes_ = 0;
    int64_t     used_bytes_     = 0;
};

/// Resident set size of this process in bytes (VmRSS from /proc/self/status), 0 if unknown.
int64_t process_rss_bytes();

/// Memory the kernel could give this process now (MemAvailable from /proc/meminfo), 0 if unknown.
int64_t mem_available_bytes();

}  // namespace fd
