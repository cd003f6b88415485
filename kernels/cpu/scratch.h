// kernels/cpu/scratch.h — a CPU kernel's per-thread scratch in 2 MiB transparent huge pages.
// Internal to kernels/cpu.
//
// linear's packed operands (x packed once per call, the weight strips of a chunk of outputs) are
// re-read for every strip and every block of rows. In 4 KiB pages a 480 KiB x block spans 120
// pages, more than the L1 DTLB holds, and the hardware prefetchers stop at every 4 KiB boundary;
// in 2 MiB pages the same block is one page. Measured on the 2-core AVX-512 guest
// (docs/benchmarks.md, stop 20): linear at M=2048, N=2048, K=768 went from 0.92 to 0.96-0.97 of
// OpenBLAS sgemm, and the K=2048 `down` shape from 0.71-0.80 to 0.83-0.85, from this alone.
// The daemon's weight and KV arenas already ask for huge pages (fd::Arena); this is the same
// request for the kernels' own buffers, which were plain std::vectors.
#pragma once

#include <sys/mman.h>

#include <cstddef>
#include <cstdint>
#include <new>

#include <vector>

namespace fd::kernels {
namespace detail {

/// A kernel's per-thread scratch buffer that release_thread_scratch() can free on its thread.
/// Every thread_local buffer in kernels/cpu derives from it (ScratchVec, HugeScratch): they
/// link themselves into their thread's list when constructed, so a weight sleep hands their
/// memory back (CpuBackend::release_scratch) instead of keeping the largest step's scratch
/// mapped until the thread ends. The next kernel call grows them again.
class ThreadScratch {
public:
    ThreadScratch() : next_(head()) { head() = this; }
    ThreadScratch(const ThreadScratch &) = delete;
    ThreadScratch & operator=(const ThreadScratch &) = delete;

    /// Frees the memory (contents lost); returns the bytes it held.
    virtual int64_t release() noexcept = 0;

    /// release() of every scratch buffer of the calling thread; returns the bytes they held.
    static int64_t release_all() noexcept {
        int64_t bytes = 0;
        for (ThreadScratch * s = head(); s != nullptr; s = s->next_) { bytes += s->release(); }
        return bytes;
    }

protected:
    ~ThreadScratch() {
        for (ThreadScratch ** p = &head(); *p != nullptr; p = &(*p)->next_) {
            if (*p == this) {
                *p = next_;
                break;
            }
        }
    }

private:
    static ThreadScratch *& head() noexcept {
        thread_local ThreadScratch * h = nullptr;  // (one per thread across every translation unit: an inline function's static)
        return h;
    }
    ThreadScratch * next_;
};

/// A std::vector that is a ThreadScratch (release(): capacity back to 0). Declare it thread_local.
template <class T> class ScratchVec final : public std::vector<T>, public ThreadScratch {
public:
    ScratchVec() = default;
    int64_t release() noexcept override {
        const auto bytes = static_cast<int64_t>(this->capacity() * sizeof(T));
        std::vector<T>().swap(*this);
        return bytes;
    }
};

constexpr size_t kHugePage = size_t{2} << 20;  ///< a transparent huge page (x86-64)

/// A fresh anonymous mapping of `bytes` (a multiple of 4 KiB) whose start is 2 MiB-aligned,
/// advised MADV_HUGEPAGE (so its whole 2 MiB stretches get huge pages under THP "madvise" or
/// "always"; the advice is only that). Over-maps by one huge page and trims both ends; munmap
/// (p, bytes) frees it. nullptr when the mapping fails.
inline void * map_huge_aligned(size_t bytes) {
    void * raw = mmap(nullptr, bytes + kHugePage, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (raw == MAP_FAILED) { return nullptr; }
    auto * r     = static_cast<char *>(raw);
    auto * start = reinterpret_cast<char *>((reinterpret_cast<uintptr_t>(r) + kHugePage - 1) / kHugePage * kHugePage);
    if (start > r) { munmap(r, static_cast<size_t>(start - r)); }
    munmap(start + bytes, static_cast<size_t>(r + kHugePage - start));  // the tail past `bytes` (never empty: start < r + kHugePage)
    madvise(start, bytes, MADV_HUGEPAGE);
    return start;
}

}  // namespace detail

namespace {

/// Scratch of T (trivially copyable) that grows on demand and is never shrunk; growing discards
/// the contents (every user rewrites what it reads). Memory is 2 MiB-aligned and madvised
/// MADV_HUGEPAGE, so under THP "madvise" (or "always") it is backed by huge pages. Meant to be
/// thread_local: one buffer per thread, freed when the thread ends or by release() (a ThreadScratch).
/// Errors: std::bad_alloc when the mapping fails (as a std::vector would throw).
template <class T> class HugeScratch final : public detail::ThreadScratch {
  public:
    static constexpr size_t kHuge = detail::kHugePage;

    HugeScratch() = default;
    HugeScratch(const HugeScratch &) = delete;
    HugeScratch & operator=(const HugeScratch &) = delete;
    ~HugeScratch() { unmap(); }

    int64_t release() noexcept override {
        const auto bytes = static_cast<int64_t>(bytes_);
        unmap();
        return bytes;
    }

    /// At least n elements (n may be 0). The pointer stays valid until a larger get().
    T * get(size_t n) {
        const size_t need = (n * sizeof(T) + kHuge - 1) / kHuge * kHuge;
        if (need > bytes_) {
            unmap();
            void * start = detail::map_huge_aligned(need);
            if (start == nullptr) { throw std::bad_alloc(); }
            p_     = static_cast<T *>(start);
            bytes_ = need;
        }
        return p_;
    }

  private:
    void unmap() {
        if (p_) { munmap(p_, bytes_); }
        p_     = nullptr;
        bytes_ = 0;
    }

    T *    p_     = nullptr;
    size_t bytes_ = 0;
};

}  // namespace
}  // namespace fd::kernels
