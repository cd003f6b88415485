#include "fd/arena.h"

#include "fd/status.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cstring>
#include <fstream>
#include <string>
#include <string_view>
#include <utility>

namespace fd {

Arena::Arena(Arena && o) noexcept
    : name_(std::move(o.name_)), base_(std::exchange(o.base_, nullptr)),
      capacity_bytes_(std::exchange(o.capacity_bytes_, 0)), used_bytes_(std::exchange(o.used_bytes_, 0)) {}

Arena & Arena::operator=(Arena && o) noexcept {
    if (this != &o) {
        release();
        name_           = std::move(o.name_);
        base_           = std::exchange(o.base_, nullptr);
        capacity_bytes_ = std::exchange(o.capacity_bytes_, 0);
        used_bytes_     = std::exchange(o.used_bytes_, 0);
    }
    return *this;
}

void Arena::reserve(int64_t capacity_bytes, bool populate) {
    release();
    // Arenas of 2 MiB or more are 2 MiB-aligned and ask for transparent huge pages: a 4 GiB
    // weight arena is then ~2k pages instead of ~1M, which makes munmap (sleep) and first
    // touch (wakeup, update) an order of magnitude cheaper.
    const int64_t page  = sysconf(_SC_PAGESIZE);
    const bool    huge  = capacity_bytes >= kHugePageBytes;
    const int64_t align = huge ? kHugePageBytes : page;
    const int64_t size  = std::max<int64_t>(align, (capacity_bytes + align - 1) / align * align);
    const int64_t span  = size + (huge ? align : 0);
    void * p = mmap(nullptr, static_cast<size_t>(span), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    FD_CHECK(p != MAP_FAILED, "arena '{}': mmap of {} bytes failed: {}", name_, span, std::strerror(errno));
    auto * raw   = static_cast<std::byte *>(p);
    auto * start = reinterpret_cast<std::byte *>((reinterpret_cast<uintptr_t>(raw) + align - 1) / align * align);
    if (start > raw) { munmap(raw, static_cast<size_t>(start - raw)); }
    if (raw + span > start + size) { munmap(start + size, static_cast<size_t>(raw + span - (start + size))); }
    if (huge) { madvise(start, static_cast<size_t>(size), MADV_HUGEPAGE); }
    base_           = start;
    capacity_bytes_ = size;
    used_bytes_     = 0;
    if (populate) { this->populate(); }
}

void Arena::populate() {
    if (!base_) { return; }
    if (madvise(base_, static_cast<size_t>(capacity_bytes_), MADV_POPULATE_WRITE) != 0) {
        // Older kernels: touch every page, so the memory is resident (and RSS says so).
        const int64_t page = sysconf(_SC_PAGESIZE);
        for (int64_t off = 0; off < capacity_bytes_; off += page) { base_[off] = std::byte{0}; }
    }
}

int64_t Arena::discard_pages() noexcept {
    if (!base_) { return 0; }
    // Private anonymous memory: the pages are freed now and read back as zeros. Should madvise
    // refuse, a fresh mapping over the same range (MAP_FIXED) frees them just the same.
    if (madvise(base_, static_cast<size_t>(capacity_bytes_), MADV_DONTNEED) != 0) {
        mmap(base_, static_cast<size_t>(capacity_bytes_), PROT_READ | PROT_WRITE,
             MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
    }
    return capacity_bytes_;
}

std::byte * Arena::alloc_bytes(int64_t n) {
    const int64_t bytes = (n + 63) / 64 * 64;
    FD_CHECK(base_ != nullptr, "arena '{}' is not reserved", name_);
    FD_CHECK(used_bytes_ + bytes <= capacity_bytes_, "arena '{}' full: {} + {} > {} bytes", name_,
             used_bytes_, bytes, capacity_bytes_);
    std::byte * p = base_ + used_bytes_;
    used_bytes_ += bytes;
    return p;
}

float * Arena::alloc_floats(int64_t n) { return reinterpret_cast<float *>(alloc_bytes(n * 4)); }

void Arena::swap_mapping(Arena & o) noexcept {
    std::swap(base_, o.base_);
    std::swap(capacity_bytes_, o.capacity_bytes_);
    std::swap(used_bytes_, o.used_bytes_);
}

int64_t Arena::release() {
    if (!base_) { return 0; }
    munmap(base_, static_cast<size_t>(capacity_bytes_));
    const int64_t freed = capacity_bytes_;
    base_           = nullptr;
    capacity_bytes_ = 0;
    used_bytes_     = 0;
    return freed;
}

namespace {

/// `key` (e.g. "VmRSS:") of a /proc file whose lines read "key  <n> kB", in bytes; 0 if absent.
int64_t proc_kib_field(const char * file, std::string_view key) {
    std::ifstream in(file);
    std::string   line;
    while (std::getline(in, line)) {
        if (line.rfind(key, 0) == 0) { return std::stoll(line.substr(key.size())) * 1024; }
    }
    return 0;
}

}  // namespace

int64_t process_rss_bytes() { return proc_kib_field("/proc/self/status", "VmRSS:"); }

int64_t mem_available_bytes() { return proc_kib_field("/proc/meminfo", "MemAvailable:"); }

}  // namespace fd
