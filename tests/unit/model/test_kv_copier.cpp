// The background KV copier (daemon/src/model/kv_copier.cpp) on the CPU backend: a batch started
// returns at once and lands later (its own thread), wait() is bounded and reports what is still in
// flight, batches land in order, and the bytes are the source's.
#include "fd/kernels/backend.h"
#include "fd/model/kv_copier.h"

#include <doctest/doctest.h>

#include <chrono>
#include <numeric>
#include <vector>

using fd::model::KvCopier;

namespace {
double since(std::chrono::steady_clock::time_point t0) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}
}  // namespace

TEST_SUITE("model::kv_copier") {

TEST_CASE("a batch returns at once, lands after the delay with the source's bytes; waits are bounded") {
    auto backend = fd::kernels::make_cpu_backend(1);
    REQUIRE_FALSE(backend->copy_queue());  // the CPU path: the copier's own thread
    std::vector<float> src(4096), dst(4096, -1.0f);
    std::iota(src.begin(), src.end(), 0.5f);
    KvCopier copier(backend.get(), /*test_delay_s=*/0.4);
    const auto t0 = std::chrono::steady_clock::now();
    copier.start_download({{dst.data(), src.data(), 2048 * 4}, {dst.data() + 2048, src.data() + 2048, 2048 * 4}});
    CHECK(since(t0) < 0.3);                     // started, not waited for
    CHECK(copier.n_in_flight() == 1);
    CHECK_FALSE(copier.idle());
    CHECK(dst[0] == -1.0f);                     // nothing copied before the delay
    CHECK_FALSE(copier.wait(0.05));             // bounded: reports the batch still in flight
    CHECK(copier.wait(10.0));
    CHECK(since(t0) >= 0.4);
    CHECK(dst == src);
    CHECK(copier.bytes_done() == 4096 * 4);
    CHECK(copier.idle());
}

TEST_CASE("batches land in the order they started (a later one overwrites an earlier one's bytes)") {
    auto backend = fd::kernels::make_cpu_backend(1);
    std::vector<float> a(256, 1.0f), b(256, 2.0f), dst(256, 0.0f);
    KvCopier copier(backend.get());
    for (int i = 0; i < 50; ++i) {
        copier.start_download({{dst.data(), (i % 2 ? b : a).data(), 256 * 4}});
    }
    CHECK(copier.wait(10.0));
    CHECK(dst == b);  // the last one started (i = 49: b) landed last
    copier.start_download({{dst.data(), a.data(), 256 * 4}});
    CHECK(copier.wait(10.0));
    CHECK(dst == a);
}

TEST_CASE("destruction waits for the batches in flight") {
    auto backend = fd::kernels::make_cpu_backend(1);
    std::vector<float> src(64, 3.0f), dst(64, 0.0f);
    {
        KvCopier copier(backend.get(), 0.2);
        copier.start_download({{dst.data(), src.data(), 64 * 4}});
    }
    CHECK(dst == src);
}

}
