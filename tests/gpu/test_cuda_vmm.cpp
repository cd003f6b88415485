// The CUDA allocator (fd/memory/cuda_vmm_allocator.h) on a real device: release hands the tag's
// physical memory back to the driver (cudaMemGetInfo's free grows by >= 97% of it), reacquire
// maps zero-filled memory at the same addresses (pointers and a captured CUDA graph stay valid),
// swap exchanges regions, and 50 release/reacquire cycles leak nothing. Label gpu; skipped
// (exit 77) without a GPU.
#include "gpu_util.h"

#include "fd/memory/cuda_vmm_allocator.h"
#include "fd/status.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

using fd::memory::Tag;

namespace {

int64_t free_bytes() {
    FD_CUDA_REQUIRE(cudaDeviceSynchronize());
    size_t free = 0, total = 0;
    FD_CUDA_REQUIRE(cudaMemGetInfo(&free, &total));
    return static_cast<int64_t>(free);
}

/// True when the first and last 4 KiB of [p, p + n) all hold `byte`.
bool ends_hold(const void * p, int64_t n, unsigned char byte) {
    std::vector<unsigned char> h(4096);
    bool                       ok = true;
    for (const int64_t off : {int64_t{0}, n - 4096}) {
        FD_CUDA_REQUIRE(cudaMemcpy(h.data(), static_cast<const char *>(p) + off, h.size(), cudaMemcpyDeviceToHost));
        for (unsigned char c : h) { ok = ok && c == byte; }
    }
    return ok;
}

void fill(void * p, int64_t n, unsigned char byte) {
    FD_CUDA_REQUIRE(cudaMemset(p, byte, static_cast<size_t>(n)));
    FD_CUDA_REQUIRE(cudaDeviceSynchronize());
}

constexpr int64_t kGiB = int64_t{1} << 30;
constexpr int64_t kMiB = int64_t{1} << 20;

}  // namespace

TEST_CASE("release frees >= 97% of a tag's bytes; reacquire maps zeroed memory at the same addresses") {
    auto         alloc = fd::memory::make_cuda_vmm_allocator(0);
    const int64_t g    = fd::memory::cuda_vmm_granularity(0);
    CHECK(alloc->keeps_addresses());
    CHECK(alloc->device() == fd::kernels::DeviceKind::cuda);
    const int64_t free0 = free_bytes();
    std::byte *   kv    = alloc->map(Tag::kv_cache, 4 * kGiB + 12345, true);
    std::byte *   w     = alloc->map(Tag::weight, 1 * kGiB, true);
    const int64_t kv_bytes = alloc->capacity_bytes(Tag::kv_cache);
    CHECK(kv_bytes % g == 0);
    CHECK(kv_bytes >= 4 * kGiB + 12345);
    CHECK(free0 - free_bytes() >= kv_bytes + alloc->capacity_bytes(Tag::weight));
    CHECK(ends_hold(kv, kv_bytes, 0));  // map() zero-fills
    fill(kv, kv_bytes, 0x11);
    fill(w, alloc->capacity_bytes(Tag::weight), 0x22);

    const int64_t before = free_bytes();
    CHECK(alloc->release(Tag::kv_cache) == kv_bytes);
    CHECK_FALSE(alloc->resident(Tag::kv_cache));
    CHECK(alloc->held_bytes(Tag::kv_cache) == 0);
    const int64_t after = free_bytes();
    CHECK(static_cast<double>(after - before) >= 0.97 * static_cast<double>(kv_bytes));
    CHECK(alloc->release(Tag::kv_cache) == 0);  // already released: no-op
    CHECK(ends_hold(w, alloc->capacity_bytes(Tag::weight), 0x22));  // the other tag is untouched

    CHECK(alloc->reacquire(Tag::kv_cache, true) == kv);
    CHECK(alloc->resident(Tag::kv_cache));
    CHECK(alloc->data(Tag::kv_cache) == kv);
    CHECK(std::llabs(before - free_bytes()) <= 16 * kMiB);  // held again (16 MiB: driver bookkeeping)
    CHECK(ends_hold(kv, kv_bytes, 0));  // fresh memory, zero-filled
    fill(kv, kv_bytes, 0x33);
    CHECK(ends_hold(kv, kv_bytes, 0x33));

    // drop frees the region and forgets it.
    CHECK(alloc->drop(Tag::kv_cache) == kv_bytes);
    CHECK(alloc->data(Tag::kv_cache) == nullptr);
    CHECK(alloc->capacity_bytes(Tag::kv_cache) == 0);
}

TEST_CASE("a CUDA graph captured on a tag's memory replays after release and reacquire") {
    auto          alloc = fd::memory::make_cuda_vmm_allocator(0);
    const int64_t n     = 256 * kMiB;
    std::byte *   p     = alloc->map(Tag::kv_cache, n, true);
    cudaStream_t  s     = nullptr;
    FD_CUDA_REQUIRE(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    cudaGraph_t     g  = nullptr;
    cudaGraphExec_t ge = nullptr;
    FD_CUDA_REQUIRE(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    FD_CUDA_REQUIRE(cudaMemsetAsync(p, 0x5a, static_cast<size_t>(n), s));
    FD_CUDA_REQUIRE(cudaStreamEndCapture(s, &g));
    FD_CUDA_REQUIRE(cudaGraphInstantiate(&ge, g, 0));
    alloc->release(Tag::kv_cache);
    alloc->reacquire(Tag::kv_cache, true);
    FD_CUDA_REQUIRE(cudaGraphLaunch(ge, s));
    FD_CUDA_REQUIRE(cudaStreamSynchronize(s));
    std::vector<unsigned char> h(static_cast<size_t>(n));
    FD_CUDA_REQUIRE(cudaMemcpy(h.data(), p, h.size(), cudaMemcpyDeviceToHost));
    CHECK(std::count(h.begin(), h.end(), static_cast<unsigned char>(0x5a)) == n);
    cudaGraphExecDestroy(ge);
    cudaGraphDestroy(g);
    cudaStreamDestroy(s);
}

TEST_CASE("swap exchanges two tags' regions (staging goes live as weight)") {
    auto        alloc = fd::memory::make_cuda_vmm_allocator(0);
    std::byte * w     = alloc->map(Tag::weight, 64 * kMiB, true);
    std::byte * st    = alloc->map(Tag::staging, 64 * kMiB, true);
    fill(st, 64 * kMiB, 0x77);
    alloc->swap(Tag::weight, Tag::staging);
    CHECK(alloc->data(Tag::weight) == st);
    CHECK(alloc->data(Tag::staging) == w);
    CHECK(ends_hold(alloc->data(Tag::weight), 64 * kMiB, 0x77));
    CHECK(alloc->release(Tag::staging) == alloc->capacity_bytes(Tag::staging));
    CHECK(alloc->resident(Tag::weight));
}

TEST_CASE("50 release/reacquire cycles of two tags leak no device memory") {
    auto          alloc = fd::memory::make_cuda_vmm_allocator(0);
    std::byte *   kv    = alloc->map(Tag::kv_cache, 2 * kGiB, true);
    std::byte *   w     = alloc->map(Tag::weight, 1 * kGiB + 3, true);
    const int64_t held  = free_bytes();
    const int64_t bytes = alloc->capacity_bytes(Tag::kv_cache) + alloc->capacity_bytes(Tag::weight);
    int64_t       freed_min = INT64_MAX;
    for (int cycle = 0; cycle < 50; ++cycle) {
        alloc->release(Tag::kv_cache);  // sleep: kv_cache before weight
        alloc->release(Tag::weight);
        freed_min = std::min(freed_min, free_bytes() - held);
        REQUIRE(alloc->reacquire(Tag::weight, true) == w);
        REQUIRE(alloc->reacquire(Tag::kv_cache, true) == kv);
    }
    fill(kv, alloc->capacity_bytes(Tag::kv_cache), 0x44);
    CHECK(ends_hold(kv, alloc->capacity_bytes(Tag::kv_cache), 0x44));
    CHECK(free_bytes() + 16 * kMiB >= held);  // no leak beyond 16 MiB of driver bookkeeping
    CHECK(static_cast<double>(freed_min) >= 0.97 * static_cast<double>(bytes));
}

TEST_CASE("bad tag use is refused and changes nothing") {
    auto alloc = fd::memory::make_cuda_vmm_allocator(0);
    CHECK(alloc->release(Tag::staging) == 0);
    try {
        alloc->reacquire(Tag::staging, true);
        FAIL("reacquiring a tag without a region must throw");
    } catch (const fd::Error & e) {
        CHECK(e.code() == fd::Errc::internal);
    }
    try {
        alloc->map(Tag::staging, 0, true);
        FAIL("mapping 0 bytes must throw");
    } catch (const fd::Error & e) {
        CHECK(e.code() == fd::Errc::invalid_argument);
    }
    CHECK(alloc->data(Tag::staging) == nullptr);
    std::byte * p = alloc->map(Tag::staging, 1, true);
    CHECK(alloc->capacity_bytes(Tag::staging) == fd::memory::cuda_vmm_granularity(0));
    CHECK(p != nullptr);
}
