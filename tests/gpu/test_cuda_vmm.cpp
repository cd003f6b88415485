// CudaVmmAllocator (fd/kernels/cuda_vmm_allocator.h) on a real device: release hands the tag's
// physical memory back to the driver (cudaMemGetInfo's free grows by >= 97% of it), reacquire
// maps fresh memory at the same addresses (pointers and a captured CUDA graph stay valid), and
// 50 release/reacquire cycles leak nothing. Label gpu; skipped (exit 77) without a GPU.
#include "gpu_util.h"

#include "fd/kernels/cuda_vmm_allocator.h"
#include "fd/status.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

using fd::kernels::cuda::CudaVmmAllocator;
using fd::kernels::cuda::MemTag;

namespace {

size_t free_bytes() {
    FD_CUDA_REQUIRE(cudaDeviceSynchronize());
    size_t free = 0, total = 0;
    FD_CUDA_REQUIRE(cudaMemGetInfo(&free, &total));
    return free;
}

/// Fills [p, p + n) with `byte` and checks a few KiB at both ends read back.
void fill_and_check(void * p, size_t n, unsigned char byte) {
    FD_CUDA_REQUIRE(cudaMemset(p, byte, n));
    std::vector<unsigned char> h(4096);
    FD_CUDA_REQUIRE(cudaMemcpy(h.data(), p, h.size(), cudaMemcpyDeviceToHost));
    bool ok = true;
    for (unsigned char c : h) { ok = ok && c == byte; }
    FD_CUDA_REQUIRE(cudaMemcpy(h.data(), static_cast<char *>(p) + n - h.size(), h.size(), cudaMemcpyDeviceToHost));
    for (unsigned char c : h) { ok = ok && c == byte; }
    CHECK(ok);
}

constexpr size_t kGiB = size_t{1} << 30;

}  // namespace

TEST_CASE("release frees >= 97% of a tag's bytes and reacquire maps memory at the same addresses") {
    CudaVmmAllocator alloc(0);
    const size_t     free0 = free_bytes();
    void * const     kv    = alloc.create(MemTag::kv_cache, 4 * kGiB + 12345);
    void * const     w     = alloc.create(MemTag::weight, 1 * kGiB);
    const size_t     kv_bytes = alloc.bytes(MemTag::kv_cache);
    CHECK(kv_bytes % alloc.granularity() == 0);
    CHECK(kv_bytes >= 4 * kGiB + 12345);
    CHECK(free0 - free_bytes() >= alloc.bytes(MemTag::kv_cache) + alloc.bytes(MemTag::weight));
    fill_and_check(kv, kv_bytes, 0x11);
    fill_and_check(w, alloc.bytes(MemTag::weight), 0x22);

    const size_t before = free_bytes();
    CHECK(alloc.release(MemTag::kv_cache) == kv_bytes);
    CHECK_FALSE(alloc.resident(MemTag::kv_cache));
    const size_t after = free_bytes();
    CHECK(after > before);
    CHECK(static_cast<double>(after - before) >= 0.97 * static_cast<double>(kv_bytes));
    CHECK(alloc.release(MemTag::kv_cache) == 0);  // already released: no-op
    fill_and_check(w, alloc.bytes(MemTag::weight), 0x23);  // the other tag is untouched

    alloc.reacquire(MemTag::kv_cache);
    CHECK(alloc.resident(MemTag::kv_cache));
    CHECK(alloc.base(MemTag::kv_cache) == kv);
    const double held_again = static_cast<double>(before) - static_cast<double>(free_bytes());
    CHECK(std::abs(held_again) <= 16.0 * (1 << 20));  // the memory is held again (16 MiB: driver bookkeeping)
    fill_and_check(kv, kv_bytes, 0x33);
}

TEST_CASE("a CUDA graph captured on a tag's memory replays after release and reacquire") {
    CudaVmmAllocator alloc(0);
    const size_t     n = 256u << 20;
    void * const     p = alloc.create(MemTag::kv_cache, n);
    cudaStream_t     s = nullptr;
    FD_CUDA_REQUIRE(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    cudaGraph_t     g  = nullptr;
    cudaGraphExec_t ge = nullptr;
    FD_CUDA_REQUIRE(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    FD_CUDA_REQUIRE(cudaMemsetAsync(p, 0x5a, n, s));
    FD_CUDA_REQUIRE(cudaStreamEndCapture(s, &g));
    FD_CUDA_REQUIRE(cudaGraphInstantiate(&ge, g, 0));
    alloc.release(MemTag::kv_cache);
    alloc.reacquire(MemTag::kv_cache);
    FD_CUDA_REQUIRE(cudaGraphLaunch(ge, s));
    FD_CUDA_REQUIRE(cudaStreamSynchronize(s));
    std::vector<unsigned char> h(n);
    FD_CUDA_REQUIRE(cudaMemcpy(h.data(), p, n, cudaMemcpyDeviceToHost));
    size_t wrong = 0;
    for (unsigned char c : h) { wrong += c != 0x5a; }
    CHECK(wrong == 0);
    cudaGraphExecDestroy(ge);
    cudaGraphDestroy(g);
    cudaStreamDestroy(s);
}

TEST_CASE("50 release/reacquire cycles of two tags leak no device memory") {
    CudaVmmAllocator alloc(0);
    void * const     kv = alloc.create(MemTag::kv_cache, 2 * kGiB);
    void * const     w  = alloc.create(MemTag::weight, 1 * kGiB + 3);
    const size_t     held = free_bytes();
    size_t           released_min = SIZE_MAX;
    for (int cycle = 0; cycle < 50; ++cycle) {
        alloc.release(MemTag::kv_cache);  // the kv_cache-before-weight order of sleep
        alloc.release(MemTag::weight);
        released_min = std::min(released_min, free_bytes());
        alloc.reacquire(MemTag::weight);
        alloc.reacquire(MemTag::kv_cache);
        REQUIRE(alloc.base(MemTag::kv_cache) == kv);
        REQUIRE(alloc.base(MemTag::weight) == w);
    }
    fill_and_check(kv, alloc.bytes(MemTag::kv_cache), 0x44);
    const size_t end = free_bytes();
    CHECK(end + (16u << 20) >= held);  // no leak beyond 16 MiB of driver bookkeeping
    CHECK(static_cast<double>(released_min - held) >=
          0.97 * static_cast<double>(alloc.bytes(MemTag::kv_cache) + alloc.bytes(MemTag::weight)));
}

TEST_CASE("bad tag use is refused with invalid_argument and changes nothing") {
    CudaVmmAllocator alloc(0);
    CHECK_THROWS_AS(alloc.release(MemTag::staging), fd::Error);
    CHECK_THROWS_AS(alloc.reacquire(MemTag::staging), fd::Error);
    CHECK_THROWS_AS(alloc.create(MemTag::staging, 0), fd::Error);
    void * p = alloc.create(MemTag::staging, 1);
    CHECK(alloc.bytes(MemTag::staging) == alloc.granularity());
    try {
        alloc.create(MemTag::staging, 1);
        FAIL("creating a tag twice must throw");
    } catch (const fd::Error & e) {
        CHECK(e.code() == fd::Errc::invalid_argument);
    }
    CHECK(alloc.base(MemTag::staging) == p);
    CHECK(alloc.resident(MemTag::staging));
}
