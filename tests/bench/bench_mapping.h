// tests/bench/bench_mapping.h — the benches' anonymous memory: a private mapping of T, optionally
// 2 MiB-aligned with MADV_HUGEPAGE as fd::Arena maps the daemon's weights and KV cache. Bench code only.
#pragma once

#include <sys/mman.h>

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>

namespace fd::bench {

/// `bytes` of anonymous private memory (MAP_NORESERVE) seen as T[count()]; 4 KiB pages unless THP
/// is "always" or `huge` (2 MiB-aligned, MADV_HUGEPAGE: transparent huge pages under THP "madvise"
/// or "always"; advice only). Errors: std::runtime_error when mmap fails.
template <class T>
struct MappingOf {
    T *    p      = nullptr;
    size_t bytes  = 0;
    void * base   = nullptr;
    size_t mapped = 0;
    explicit MappingOf(size_t b, bool huge = false) : bytes(b) {
        const size_t align = huge ? (size_t{2} << 20) : 0;
        mapped = b + align;
        base = mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (base == MAP_FAILED) { throw std::runtime_error("mmap of " + std::to_string(b) + " bytes failed"); }
        auto a = reinterpret_cast<uintptr_t>(base);
        if (huge) { a = (a + align - 1) / align * align; }
        p = reinterpret_cast<T *>(a);
        if (huge) { madvise(p, bytes, MADV_HUGEPAGE); }
    }
    ~MappingOf() { unmap(); }
    MappingOf(const MappingOf &)             = delete;
    MappingOf & operator=(const MappingOf &) = delete;
    /// Gives the memory back now (the destructor then does nothing).
    void unmap() {
        if (base) { munmap(base, mapped); }
        base = nullptr;
        p    = nullptr;
    }
    size_t count() const { return bytes / sizeof(T); }
};

}  // namespace fd::bench
