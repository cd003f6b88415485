// ShmComm: the same-host all-reduce over a shared-memory segment, between fork()ed rank
// processes. Sums bitwise equal to GlooComm's on the same inputs (and to rank order 0..T-1),
// over more than one slot; gather; a rank that never arrives is rank_failed within the timeout;
// disconnect unmaps the segment and the daemon's holder unlinks it; a segment that is not the
// user's 0600 one, or missing, is refused.
#include "fd/runtime/comm.h"
#include "fd/runtime/tcp_store.h"
#include "fd/status.h"

#include "../../fork_ranks.h"

#include <doctest/doctest.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

using namespace fd;

namespace {

std::string prefix(const char * what) { return "/fdrollout-test-" + std::to_string(::getpid()) + "-" + what; }

/// Rank r's input: magnitudes spread over 2^-8..2^8, so the summation order shows in the bits.
std::vector<float> input(int r, int64_t n) {
    std::mt19937 g(1234 + r);
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    std::uniform_int_distribution<int> e(-8, 8);
    std::vector<float> x(static_cast<size_t>(n));
    for (auto & v : x) { v = std::ldexp(u(g), e(g)); }
    return x;
}

/// True while this process maps a file whose path contains `name`.
bool mapped(const std::string & name) {
    std::ifstream f("/proc/self/maps");
    std::string line;
    while (std::getline(f, line)) {
        if (line.find(name.substr(1)) != std::string::npos) { return true; }
    }
    return false;
}

bool bits_equal(const std::vector<float> & a, const std::vector<float> & b) {
    return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

}  // namespace

TEST_CASE("shm comm: all-reduce is bitwise Gloo's (rank order 0..T-1) at 2, 3 and 4 ranks, over two slots, rebuilt by generation") {
    for (const int world : {2, 3, 4}) {
        CAPTURE(world);
        const int64_t n = runtime::kShmCommSlotFloats + 1237;  // two chunks
        const std::string pre = prefix("sum");
        runtime::TcpStoreServer store("127.0.0.1", 0);
        int failed = 0;
        for (int64_t gen = 1; gen <= 2; ++gen) {
            runtime::ShmCommSegment seg(runtime::shm_comm_name(pre, gen), world);
            failed += fd::testing::run_forked_ranks(world, [&](int r) {
                auto shm = runtime::make_shm_comm({.rank = r, .world_size = world, .name_prefix = pre, .timeout_s = 20});
                auto gloo = runtime::make_gloo_comm({.rank = r, .world_size = world, .store_port = store.port(), .timeout_s = 20});
                shm->connect(gen);
                gloo->connect(gen);
                int bad = 0;
                for (int rep = 0; rep < 3; ++rep) {  // consecutive calls alternate the slot sets
                    auto a = input(r + rep * 10, n), b = a;
                    shm->all_reduce_sum(a.data(), n);
                    gloo->all_reduce_sum(b.data(), n);
                    bad += !bits_equal(a, b);
                    // The reference order, and a negative control: the reverse order differs somewhere.
                    std::vector<float> want = input(0 + rep * 10, n), rev = input(world - 1 + rep * 10, n);
                    for (int q = 1; q < world; ++q) {
                        const auto x = input(q + rep * 10, n), y = input(world - 1 - q + rep * 10, n);
                        for (int64_t i = 0; i < n; ++i) {
                            want[i] += x[i];
                            rev[i] += y[i];
                        }
                    }
                    bad += !bits_equal(a, want);
                    bad += world > 2 && bits_equal(a, rev);  // (two ranks: a + b == b + a)
                }
                shm->barrier();
                shm->disconnect();
                bad += shm->connected() || mapped(runtime::shm_comm_name(pre, gen));
                gloo->disconnect();
                return bad ? 1 : 0;
            });
        }
        CHECK(failed == 0);
    }
}

TEST_CASE("shm comm: gather stacks every rank's buffer on rank 0") {
    const int world = 3;
    const int64_t n = 1000;
    const std::string pre = prefix("gather");
    runtime::ShmCommSegment seg(runtime::shm_comm_name(pre, 1), world);
    CHECK(fd::testing::run_forked_ranks(world, [&](int r) {
              auto c = runtime::make_shm_comm({.rank = r, .world_size = world, .name_prefix = pre, .timeout_s = 20});
              c->connect(1);
              const auto x = input(r, n);
              std::vector<float> all(static_cast<size_t>(world * n), -1.0f);
              c->gather(x.data(), n, r == 0 ? all.data() : nullptr);
              c->barrier();
              if (r != 0) { return 0; }
              for (int q = 0; q < world; ++q) {
                  if (!bits_equal(std::vector<float>(all.begin() + q * n, all.begin() + (q + 1) * n), input(q, n))) { return 1; }
              }
              return 0;
          }) == 0);
}

TEST_CASE("shm comm: a rank that never arrives is rank_failed naming it within the timeout") {
    const std::string pre = prefix("timeout");
    runtime::ShmCommSegment seg(runtime::shm_comm_name(pre, 1), 3);
    auto c = runtime::make_shm_comm({.rank = 0, .world_size = 3, .name_prefix = pre, .timeout_s = 0.3});
    c->connect(1);
    std::vector<float> x(16, 1.0f);
    const auto t0 = std::chrono::steady_clock::now();
    try {
        c->all_reduce_sum(x.data(), 16);
        FAIL("all_reduce_sum returned without ranks 1 and 2");
    } catch (const Error & e) {
        CHECK(e.code() == Errc::rank_failed);
        CHECK(std::string(e.what()).find("rank 1 did not arrive within 0.3 s") != std::string::npos);
    }
    const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    CHECK(took >= 0.3);
    CHECK(took < 10.0);  // bounded (generous: the machine may be loaded)
}

TEST_CASE("shm comm: disconnect unmaps the segment; the daemon's holder unlinks it") {
    const std::string pre = prefix("teardown");
    const std::string name = runtime::shm_comm_name(pre, 7);
    const std::filesystem::path dev = "/dev/shm" + name;
    auto c = runtime::make_shm_comm({.rank = 0, .world_size = 1, .name_prefix = pre, .timeout_s = 1});
    {
        runtime::ShmCommSegment seg(name, 1);
        CHECK(std::filesystem::exists(dev));
        CHECK((std::filesystem::status(dev).permissions() & std::filesystem::perms::all) ==
              (std::filesystem::perms::owner_read | std::filesystem::perms::owner_write));
        c->connect(7);
        CHECK(c->connected());
        CHECK(mapped(name));
    }
    CHECK(!std::filesystem::exists(dev));  // unlinked; the mapping stays usable
    float x[2] = {1.5f, 2.5f};
    c->all_reduce_sum(x, 2);
    CHECK(x[1] == 2.5f);
    c->disconnect();
    CHECK(!c->connected());
    CHECK(!mapped(name));
    // A generation whose segment is gone cannot be joined.
    try {
        c->connect(7);
        FAIL("connected to an unlinked segment");
    } catch (const Error & e) {
        CHECK(e.code() == Errc::rank_failed);
    }
}

TEST_CASE("shm comm: a segment that is not this user's 0600 one of the right size is refused") {
    const std::string pre = prefix("mode");
    const std::string name = runtime::shm_comm_name(pre, 1);
    const int fd = ::shm_open(name.c_str(), O_RDWR | O_CREAT | O_EXCL, 0644);
    REQUIRE(fd >= 0);
    REQUIRE(::fchmod(fd, 0644) == 0);
    REQUIRE(::ftruncate(fd, runtime::shm_comm_segment_bytes(2)) == 0);
    ::close(fd);
    auto c = runtime::make_shm_comm({.rank = 0, .world_size = 2, .name_prefix = pre, .timeout_s = 1});
    try {
        c->connect(1);
        FAIL("accepted a 0644 segment");
    } catch (const Error & e) {
        CHECK(e.code() == Errc::rank_failed);
        CHECK(std::string(e.what()).find("0600") != std::string::npos);
    }
    CHECK(!c->connected());
    ::shm_unlink(name.c_str());
    // Two holders cannot create one name (O_EXCL): a stale or foreign segment is never reused.
    runtime::ShmCommSegment a(name, 2);
    CHECK_THROWS_AS(runtime::ShmCommSegment(name, 2), Error);
}
