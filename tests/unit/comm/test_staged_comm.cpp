// The staged comm (fd/comm/comm.h make_staged_comm), between fork()ed rank processes over
// Gloo: on a backend whose memory is not host-visible (a fake "device" whose upload/download
// count their bytes) every all-reduce goes through exactly one download and one upload of the
// buffer and the sums are bitwise the unstaged Gloo comm's; gather lands rank r's part in row r of
// rank 0's buffer through one upload there; on the CPU backend it stages only when asked to
// (the FD_TEST_STAGED_FILL hook) and gives the same bits either way.
#include "fd/kernels/backend.h"
#include "fd/comm/comm.h"
#include "fd/comm/tcp_store.h"

#include "../../fork_ranks.h"
#include "../noop_backend.h"

#include <doctest/doctest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

using namespace fd;

namespace {

/// A backend whose memory the comm must not touch directly (host_visible false): upload and
/// download are memcpy and counted; it runs no ops.
class FakeDevice final : public test::NoOpsBackend {
public:
    int64_t n_down = 0, n_up = 0, bytes_down = 0, bytes_up = 0;

    const char * name() const override { return "fake"; }
    kernels::DeviceKind kind() const override { return kernels::DeviceKind::cuda; }
    bool host_visible() const override { return false; }
    kernels::ThreadPool * host_pool() override { return nullptr; }
    void * alloc(int64_t bytes) override { return std::malloc(static_cast<size_t>(bytes)); }
    void free(void * p) noexcept override { std::free(p); }
    void upload(void * dst, const void * src, int64_t bytes) override {
        ++n_up;
        bytes_up += bytes;
        std::memcpy(dst, src, static_cast<size_t>(bytes));
    }
    void download(void * dst, const void * src, int64_t bytes) override {
        ++n_down;
        bytes_down += bytes;
        std::memcpy(dst, src, static_cast<size_t>(bytes));
    }
    void copy(void * dst, const void * src, int64_t bytes) override { std::memcpy(dst, src, static_cast<size_t>(bytes)); }
    void synchronize() override {}
    kernels::MemInfo mem_info() override { return {}; }
};

/// Rank r's input: magnitudes over 2^-8..2^8, so a different summation order shows in the bits.
std::vector<float> input(int r, int64_t n) {
    std::mt19937 g(77 + r);
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    std::uniform_int_distribution<int> e(-8, 8);
    std::vector<float> x(static_cast<size_t>(n));
    for (auto & v : x) { v = std::ldexp(u(g), e(g)); }
    return x;
}

bool bits_equal(const std::vector<float> & a, const std::vector<float> & b) {
    return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

}  // namespace

TEST_CASE("staged comm on a device backend: one download + one upload per all-reduce, sums bitwise Gloo's; gather rows in rank order") {
    const int world = 3;
    const int64_t n = 5000;
    comm::TcpStoreServer store("127.0.0.1", 0);
    const int failed = fd::testing::run_forked_ranks(world, [&](int r) {
        const comm::GlooCommConfig g{.rank = r, .world_size = world, .store_port = store.port(), .timeout_s = 20};
        auto plain  = comm::make_gloo_comm(g);
        auto staged = comm::make_staged_comm(comm::make_gloo_comm(g));
        FakeDevice dev;
        staged->use_backend(&dev);
        plain->connect(1);
        staged->connect(2);
        int bad = std::strcmp(staged->name(), "gloo") != 0 || !staged->connected();
        for (int rep = 0; rep < 2; ++rep) {
            auto a = input(r + 10 * rep, n), b = a;
            plain->all_reduce_sum(a.data(), n);
            staged->all_reduce_sum(b.data(), n);
            bad += !bits_equal(a, b);
        }
        bad += dev.n_down != 2 || dev.n_up != 2 || dev.bytes_down != 2 * n * 4 || dev.bytes_up != 2 * n * 4;
        // gather: rank 0 gets [world, m] with rank q's part in row q, through one upload.
        const int64_t m = 333;
        std::vector<float> part(static_cast<size_t>(m));
        for (int64_t i = 0; i < m; ++i) { part[i] = static_cast<float>(r * 1000 + i); }
        std::vector<float> all(r == 0 ? static_cast<size_t>(world * m) : 0, -1.0f);
        staged->gather(part.data(), m, r == 0 ? all.data() : nullptr);
        if (r == 0) {
            for (int q = 0; q < world; ++q) {
                for (int64_t i = 0; i < m; ++i) { bad += all[q * m + i] != static_cast<float>(q * 1000 + i); }
            }
            bad += dev.n_up != 3 || dev.bytes_up != 2 * n * 4 + world * m * 4;
        } else {
            bad += dev.n_up != 2;  // only rank 0 receives
        }
        bad += dev.n_down != 3;
        staged->barrier();
        staged->disconnect();
        plain->disconnect();
        bad += staged->connected();
        return bad ? 1 : 0;
    });
    CHECK(failed == 0);
}

TEST_CASE("staged comm on the CPU backend: a pass-through unless always_stage (the test hook); same bits both ways") {
    const int world = 2;
    const int64_t n = 4096;
    comm::TcpStoreServer store("127.0.0.1", 0);
    const int failed = fd::testing::run_forked_ranks(world, [&](int r) {
        const comm::GlooCommConfig g{.rank = r, .world_size = world, .store_port = store.port(), .timeout_s = 20};
        auto be = kernels::make_cpu_backend(1);
        auto direct = comm::make_staged_comm(comm::make_gloo_comm(g));
        auto forced = comm::make_staged_comm(comm::make_gloo_comm(g), /*always_stage=*/true);
        direct->use_backend(be.get());
        forced->use_backend(be.get());
        direct->connect(1);
        forced->connect(2);
        auto a = input(r, n), b = a;
        direct->all_reduce_sum(a.data(), n);
        forced->all_reduce_sum(b.data(), n);
        int bad = !bits_equal(a, b);
        // The reference: rank order 0 + 1, as Gloo sums.
        const auto x0 = input(0, n), x1 = input(1, n);
        for (int64_t i = 0; i < n; ++i) { bad += a[i] != x0[i] + x1[i]; }
        return bad ? 1 : 0;
    });
    CHECK(failed == 0);
}
