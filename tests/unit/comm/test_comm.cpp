// Comm: Gloo all-reduce between real rank processes rendezvousing through the TcpStore on
// loopback; a rank that never joins is named; disconnect closes the group's sockets; a taken
// master port is refused. NullComm is the identity.
#include "fd/comm/comm.h"
#include "fd/comm/tcp_store.h"
#include "fd/status.h"

#include "../fork_ranks.h"

#include <doctest/doctest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <vector>

using namespace fd;

namespace {

/// Socket fds open in this process.
int count_sockets() {
    int n = 0;
    for (const auto & e : std::filesystem::directory_iterator("/proc/self/fd")) {
        std::error_code ec;
        const auto target = std::filesystem::read_symlink(e.path(), ec);
        if (!ec && target.string().rfind("socket:", 0) == 0) { ++n; }
    }
    return n;
}

/// Rank `rank`'s input: distinct per rank and element, exact in f32.
float input(int rank, int64_t i) { return static_cast<float>((rank + 1) * 1000 + i % 997) * 0.25f; }

/// Run `world` rank processes that all-reduce `n` floats twice (generation 1, then a rebuilt
/// generation 2) and check the sums. Returns how many ranks failed.
int run_ranks(int world, int port, int64_t n) {
    return fd::testing::run_forked_ranks(world, [&](int r) {
        int bad = 0;
        try {
            auto comm = comm::make_gloo_comm({.rank = r, .world_size = world, .store_port = port, .timeout_s = 20});
            for (int gen = 1; gen <= 2; ++gen) {
                comm->connect(gen);
                std::vector<float> x(static_cast<size_t>(n));
                for (int64_t i = 0; i < n; ++i) { x[i] = input(r, i); }
                comm->all_reduce_sum(x.data(), n);
                for (int64_t i = 0; i < n; ++i) {
                    float want = 0.0f;
                    for (int q = 0; q < world; ++q) { want += input(q, i); }
                    if (x[i] != want) { ++bad; }
                }
                comm->barrier();
                const int before = count_sockets();
                comm->disconnect();
                if (!(count_sockets() < before) || comm->connected()) { ++bad; }
            }
        } catch (const std::exception &) {
            bad = 1;
        }
        return bad ? 1 : 0;
    });
}

}  // namespace

TEST_CASE("comm: null comm is rank 0 of 1 and leaves data alone") {
    auto c = comm::make_null_comm();
    float x[3] = {1.0f, 2.0f, 3.0f};
    c->connect(1);
    c->all_reduce_sum(x, 3);
    CHECK(c->world_size() == 1);
    CHECK(x[2] == 3.0f);
}

TEST_CASE("fork_ranks: a rank still running at the deadline is killed and counted, the others' results kept") {
    // (without the deadline this test would hang until CTest's timeout: that is its failure)
    const int failed = fd::testing::run_forked_ranks(
        3, [](int r) {
            if (r == 1) { ::pause(); }  // stuck (as in a collective whose peer died)
            return r == 2 ? 1 : 0;
        },
        0.5);
    CHECK(failed == 2);  // rank 1 killed, rank 2 failed, rank 0 passed
}

TEST_CASE("comm: gloo all-reduce over 2 and 4 rank processes, rebuilt after disconnect") {
    comm::TcpStoreServer store("127.0.0.1", 0);
    CHECK(run_ranks(2, store.port(), 4099) == 0);
    comm::TcpStoreServer store4("127.0.0.1", 0);
    CHECK(run_ranks(4, store4.port(), 1 << 16) == 0);
}

TEST_CASE("comm: a rank that never joins is named within the timeout") {
    comm::TcpStoreServer store("127.0.0.1", 0);
    auto comm = comm::make_gloo_comm({.rank = 0, .world_size = 3, .store_port = store.port(), .timeout_s = 0.5});
    try {
        comm->connect(1);
        FAIL("connect returned without ranks 1 and 2");
    } catch (const Error & e) {
        CHECK(e.code() == Errc::rank_failed);
        CHECK(std::string(e.what()).find("rank(s) 1, 2 never joined") != std::string::npos);
    }
    CHECK(!comm->connected());
}

TEST_CASE("comm: a master port in use is refused naming it; no store there is rank_failed") {
    comm::TcpStoreServer store("127.0.0.1", 0);
    try {
        comm::TcpStoreServer again("127.0.0.1", store.port());
        FAIL("a second store bound the same port");
    } catch (const Error & e) {
        CHECK(e.code() == Errc::invalid_argument);
        CHECK(std::string(e.what()).find(std::to_string(store.port())) != std::string::npos);
    }
    const int dead_port = store.port();
    int free_port = 0;
    {
        comm::TcpStoreServer tmp("127.0.0.1", 0);
        free_port = tmp.port();
    }
    CHECK(free_port != dead_port);
    CHECK_THROWS_AS(comm::TcpStoreClient("127.0.0.1", free_port, std::chrono::milliseconds(200)), Error);
}
