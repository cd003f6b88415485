// ShmComm: the same-host all-reduce over a memfd segment, between fork()ed rank processes (each
// gets its own copy of the segment's descriptor, as a rank process does over its link). Sums
// bitwise equal to GlooComm's on the same inputs (and to rank order 0..T-1), over more than one
// slot; gather; a rank that never arrives is rank_failed within the timeout; the segment has no
// name anywhere and disconnect unmaps it; a descriptor that is not this user's sealed 0600 memfd
// of the right size and generation, or none, is refused; a peer that exits while another waits is
// noticed through its pidfd at once (one that arrives and then exits is not: test_all_gather.cpp).
#include "fd/comm/comm.h"
#include "fd/comm/tcp_store.h"
#include "fd/status.h"

#include "../../fork_ranks.h"

#include <doctest/doctest.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <functional>
#include <fstream>
#include <random>
#include <string>
#include <thread>
#include <vector>

using namespace fd;

namespace {

/// ShmCommConfig::segment_fd handing over a copy of `seg`'s descriptor (ShmComm closes it).
std::function<int(int64_t)> hand(const comm::ShmCommSegment & seg) {
    return [&seg](int64_t) { return ::dup(seg.fd()); };
}

/// Rank r's input: magnitudes spread over 2^-8..2^8, so the summation order shows in the bits.
std::vector<float> input(int r, int64_t n) {
    std::mt19937 g(1234 + r);
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    std::uniform_int_distribution<int> e(-8, 8);
    std::vector<float> x(static_cast<size_t>(n));
    for (auto & v : x) { v = std::ldexp(u(g), e(g)); }
    return x;
}

/// True while this process maps a tensor-parallel segment (a memfd's maps entry: "/memfd:fdrollout-tp (deleted)").
bool mapped() {
    std::ifstream f("/proc/self/maps");
    std::string line;
    while (std::getline(f, line)) {
        if (line.find("memfd:fdrollout-tp") != std::string::npos) { return true; }
    }
    return false;
}

/// connect(gen) must refuse; returns its message.
std::string refused(comm::Comm & c, int64_t gen) {
    try {
        c.connect(gen);
    } catch (const Error & e) {
        CHECK(e.code() == Errc::rank_failed);
        CHECK(!c.connected());
        return e.what();
    }
    FAIL("connect accepted the segment");
    return {};
}

bool bits_equal(const std::vector<float> & a, const std::vector<float> & b) {
    return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

}  // namespace

TEST_CASE("shm comm: all-reduce is bitwise Gloo's (rank order 0..T-1) at 2, 3 and 4 ranks, over two slots, rebuilt by generation") {
    for (const int world : {2, 3, 4}) {
        CAPTURE(world);
        const int64_t n = comm::kShmCommSlotFloats + 1237;  // two chunks
        comm::TcpStoreServer store("127.0.0.1", 0);
        int failed = 0;
        for (int64_t gen = 1; gen <= 2; ++gen) {
            comm::ShmCommSegment seg(world, gen);
            failed += fd::testing::run_forked_ranks(world, [&](int r) {
                auto shm = comm::make_shm_comm({.rank = r, .world_size = world, .segment_fd = hand(seg), .timeout_s = 20});
                auto gloo = comm::make_gloo_comm({.rank = r, .world_size = world, .store_port = store.port(), .timeout_s = 20});
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
                bad += !mapped();
                shm->disconnect();
                bad += shm->connected() || mapped();
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
    comm::ShmCommSegment seg(world, 1);
    CHECK(fd::testing::run_forked_ranks(world, [&](int r) {
              auto c = comm::make_shm_comm({.rank = r, .world_size = world, .segment_fd = hand(seg), .timeout_s = 20});
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
    comm::ShmCommSegment seg(3, 1);
    auto c = comm::make_shm_comm({.rank = 0, .world_size = 3, .segment_fd = hand(seg), .timeout_s = 0.3});
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

TEST_CASE("shm comm: a peer that exits while the others wait is noticed through its pidfd within ~10 ms, not at the timeout") {
    // Rank 0 (this process) waits in an all-reduce with a 3 s timeout; rank 1 (a fork) connects,
    // lets rank 0 settle into its futex wait, notes the time and exits without arriving. Rank 0
    // must fail naming its exit, one 10 ms futex slice later (the bound allows a loaded machine),
    // not "did not arrive" at 3 s (what it did with the pidfd check disabled).
    comm::ShmCommSegment seg(2, 1);
    auto c = comm::make_shm_comm({.rank = 0, .world_size = 2, .segment_fd = hand(seg), .timeout_s = 3.0});
    c->connect(1);
    int tp[2];
    REQUIRE(::pipe(tp) == 0);
    const pid_t child = ::fork();
    if (child == 0) {
        ::close(tp[0]);
        int rc = 1;
        try {
            auto peer = comm::make_shm_comm({.rank = 1, .world_size = 2, .segment_fd = hand(seg), .timeout_s = 3.0});
            peer->connect(1);
            std::this_thread::sleep_for(std::chrono::milliseconds(300));
            const double t = std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
            rc = ::write(tp[1], &t, sizeof t) == static_cast<ssize_t>(sizeof t) ? 0 : 1;
        } catch (...) {
        }
        _exit(rc);  // without arriving
    }
    ::close(tp[1]);
    std::vector<float> x(16, 1.0f);
    std::string what;
    try {
        c->all_reduce_sum(x.data(), 16);
    } catch (const Error & e) {
        CHECK(e.code() == Errc::rank_failed);
        what = e.what();
    }
    const double t_err = std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
    double t_exit = 0;
    REQUIRE(::read(tp[0], &t_exit, sizeof t_exit) == static_cast<ssize_t>(sizeof t_exit));
    ::close(tp[0]);
    int st = 0;
    ::waitpid(child, &st, 0);
    CHECK((WIFEXITED(st) && WEXITSTATUS(st) == 0));
    CAPTURE(what);
    CHECK(what.find(fmt::format("rank 1 (pid {}) exited before arriving", child)) != std::string::npos);
    const double took = t_err - t_exit;
    MESSAGE("peer exit noticed after ", took * 1e3, " ms");
    CHECK(took >= 0.0);
    CHECK(took < 0.25);  // ~10 ms (one futex slice) on a quiet machine; far under the 3 s timeout on a loaded one
}

TEST_CASE("shm comm: the segment is a nameless memfd; the daemon's descriptor can close; disconnect unmaps it") {
    auto c = comm::make_shm_comm({.rank = 0, .world_size = 1, .segment_fd = [](int64_t) { return -1; }, .timeout_s = 1});
    CHECK(refused(*c, 1).find("no tensor-parallel segment was handed over for generation 1") != std::string::npos);
    int handed = -1;
    auto d = comm::make_shm_comm({.rank = 0, .world_size = 1, .segment_fd = [&](int64_t) { return handed; }, .timeout_s = 1});
    {
        comm::ShmCommSegment seg(1, 7);
        // No path: the kernel names it "/memfd:fdrollout-tp (deleted)", outside any directory.
        const auto target = std::filesystem::read_symlink("/proc/self/fd/" + std::to_string(seg.fd())).string();
        CHECK(target.rfind("/memfd:fdrollout-tp", 0) == 0);
        struct stat st{};
        REQUIRE(::fstat(seg.fd(), &st) == 0);
        CHECK((st.st_mode & 0777) == 0600);
        CHECK(st.st_size == comm::shm_comm_segment_bytes(1));
        // Sealed: nobody holding it can shrink or grow it under a peer's mapping.
        CHECK(::ftruncate(seg.fd(), 4096) != 0);
        CHECK(::ftruncate(seg.fd(), st.st_size * 2) != 0);
        handed = ::dup(seg.fd());
        CHECK(refused(*d, 8).find("generation 8 (its generation: 7)") != std::string::npos);  // the descriptor was closed
        handed = ::dup(seg.fd());
        d->connect(7);
        CHECK(d->connected());
        CHECK(mapped());
    }  // the daemon's descriptor closes; the mapping stays usable
    float x[2] = {1.5f, 2.5f};
    d->all_reduce_sum(x, 2);
    CHECK(x[1] == 2.5f);
    d->disconnect();
    CHECK(!d->connected());
    CHECK(!mapped());
}

TEST_CASE("shm comm: a descriptor that is not this user's sealed 0600 memfd of the right size is refused") {
    const int64_t bytes = comm::shm_comm_segment_bytes(2);
    int handed = -1;
    auto c = comm::make_shm_comm({.rank = 0, .world_size = 2, .segment_fd = [&](int64_t) { return handed; }, .timeout_s = 1});
    // A memfd of the right size, but 0644 and unsealed.
    handed = ::memfd_create("fdrollout-tp", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    REQUIRE(handed >= 0);
    REQUIRE(::fchmod(handed, 0644) == 0);
    REQUIRE(::ftruncate(handed, bytes) == 0);
    CHECK(refused(*c, 1).find("sealed 0600") != std::string::npos);
    // 0600 and the right size, but unsealed (a peer could truncate it under the others).
    handed = ::memfd_create("fdrollout-tp", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    REQUIRE(::fchmod(handed, 0600) == 0);
    REQUIRE(::ftruncate(handed, bytes) == 0);
    CHECK(refused(*c, 1).find("seals 0x0") != std::string::npos);
    // A regular (unnamed) file: not sealable at all.
    handed = ::open("/tmp", O_TMPFILE | O_RDWR | O_CLOEXEC, 0600);
    REQUIRE(handed >= 0);
    REQUIRE(::ftruncate(handed, bytes) == 0);
    CHECK(refused(*c, 1).find("refusing it") != std::string::npos);
    // A real segment, for three ranks: the wrong size for two.
    {
        comm::ShmCommSegment three(3, 1);
        handed = ::dup(three.fd());
        CHECK(refused(*c, 1).find(std::to_string(bytes) + " bytes") != std::string::npos);
    }
    // The right one is accepted.
    comm::ShmCommSegment two(2, 1);
    handed = ::dup(two.fd());
    c->connect(1);
    CHECK(c->connected());
    c->disconnect();
}
