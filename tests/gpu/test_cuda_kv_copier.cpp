// The CUDA backend's copy queue under the background KV copier (issue #27's CUDA bullet): copies
// run on a stream of their own, after the ops issued before them (an event on the op stream),
// into pinned host memory, and a fence says when they landed; ops_after_copies orders later ops
// after them. Exits 77 (Skipped) where no GPU is visible (gpu_test_main.cpp).
#include "fd/kernels/backend.h"
#include "fd/model/kv_copier.h"
#include "gpu_util.h"

#include <doctest/doctest.h>

#include <cstring>
#include <numeric>
#include <vector>

using fd::model::KvCopier;

TEST_CASE("CUDA copy queue: background downloads land after the ops before them, in pinned memory") {
    auto be = fd::kernels::make_backend({.kind = fd::kernels::DeviceKind::cuda});
    REQUIRE(be->copy_queue());
    const int64_t n = 1 << 20, bytes = n * 4;
    std::vector<float> h(static_cast<size_t>(n));
    std::iota(h.begin(), h.end(), 1.0f);
    float * a = static_cast<float *>(be->alloc(bytes));
    float * b = static_cast<float *>(be->alloc(bytes));
    be->upload(a, h.data(), bytes);
    auto * pinned = static_cast<float *>(be->alloc_pinned_host(bytes));
    REQUIRE(pinned != nullptr);
    std::memset(pinned, 0, static_cast<size_t>(bytes));
    be->copy(b, a, bytes);  // an op on the op stream: the copy below must see its result
    {
        KvCopier copier(be.get());
        copier.start_download({{pinned, b, bytes / 2}, {pinned + n / 2, b + n / 2, bytes / 2}});
        REQUIRE(copier.wait(30.0));
        CHECK(std::memcmp(pinned, h.data(), static_cast<size_t>(bytes)) == 0);
        CHECK(copier.bytes_done() == bytes);
    }
    // upload_async + ops_after_copies: an op issued after the fence reads the uploaded bytes.
    std::vector<float> h2(static_cast<size_t>(n), 7.0f);
    std::memcpy(pinned, h2.data(), static_cast<size_t>(bytes));
    be->copy_queue_after_ops();
    be->upload_async(a, pinned, bytes);
    const uint64_t f = be->copy_queue_fence();
    be->ops_after_copies(f);
    be->copy(b, a, bytes);
    std::vector<float> got(static_cast<size_t>(n));
    be->download(got.data(), b, bytes);
    CHECK(got == h2);
    CHECK(be->copy_queue_done(f));
    be->free_pinned_host(pinned);
    be->free(a);
    be->free(b);
}

TEST_CASE("CUDA KvCopier: a test delay keeps a batch in flight; waits are bounded") {
    auto be = fd::kernels::make_backend({.kind = fd::kernels::DeviceKind::cuda});
    float * d = static_cast<float *>(be->alloc(4096));
    auto * pinned = static_cast<float *>(be->alloc_pinned_host(4096));
    KvCopier copier(be.get(), 0.3);
    copier.start_download({{pinned, d, 4096}});
    CHECK_FALSE(copier.wait(0.01));
    CHECK(copier.n_in_flight() == 1);
    CHECK(copier.wait(10.0));
    be->free_pinned_host(pinned);
    be->free(d);
}
