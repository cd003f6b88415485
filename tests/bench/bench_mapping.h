// tests/bench/bench_mapping.h — the benches' anonymous memory, seen as T[count()]: either an
// fd::Arena (huge: exactly how the daemon maps its weights and KV cache) or a plain private
// mapping on 4 KiB pages (the references that must not get huge pages). Bench code only.
#pragma once

#include "fd/arena.h"

#include <sys/mman.h>

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>

namespace fd::bench {

/// `bytes` of zeroed anonymous memory. huge: an fd::Arena (2 MiB-aligned, MADV_HUGEPAGE from
/// 2 MiB up, as the daemon's arenas); otherwise mmap(MAP_PRIVATE | MAP_NORESERVE), 4 KiB pages
/// unless THP is "always". Errors: fd::Error (arena) or std::runtime_error (mmap) when mapping fails.
template <class T>
struct MappingOf {
    T *    p     = nullptr;
    size_t bytes = 0;
    explicit MappingOf(size_t b, bool huge = false) : bytes(b) {
        if (huge) {
            arena_.reserve(static_cast<int64_t>(b));
            p = reinterpret_cast<T *>(arena_.data());
            return;
        }
        base_ = mmap(nullptr, b, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (base_ == MAP_FAILED) {
            base_ = nullptr;
            throw std::runtime_error("mmap of " + std::to_string(b) + " bytes failed");
        }
        p = static_cast<T *>(base_);
    }
    ~MappingOf() { unmap(); }
    MappingOf(const MappingOf &)             = delete;
    MappingOf & operator=(const MappingOf &) = delete;
    /// Gives the memory back now (the destructor then does nothing).
    void unmap() {
        arena_.release();
        if (base_) { munmap(base_, bytes); }
        base_ = nullptr;
        p     = nullptr;
    }
    size_t count() const { return bytes / sizeof(T); }

private:
    fd::Arena arena_{"bench"};
    void *    base_ = nullptr;
};

}  // namespace fd::bench
