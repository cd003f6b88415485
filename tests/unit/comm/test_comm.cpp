// Comm: Gloo all-reduce between real rank processes rendezvousing through the TcpStore on
// loopback; a rank that never joins is named; disconnect closes the group's sockets; a taken
// master port is refused; the store answers only its token's holders and no client stalls it.
// NullComm is the identity.
#include "fd/comm/comm.h"
#include "fd/comm/tcp_store.h"
#include "fd/status.h"

#include "../fork_ranks.h"

#include <arpa/inet.h>
#include <doctest/doctest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
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

namespace {

/// A raw loopback connection to `port` (another local user's client), or -1.
int raw_connect(int port) {
    const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in a{};
    a.sin_family      = AF_INET;
    a.sin_port        = htons(static_cast<uint16_t>(port));
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (::connect(fd, reinterpret_cast<sockaddr *>(&a), sizeof a) != 0) {
        ::close(fd);
        return -1;
    }
    return fd;
}

/// Whether the server closed `fd` within `ms` (EOF) without answering a byte.
bool closed_unanswered(int fd, int ms) {
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, ms) <= 0) { return false; }
    char b = 0;
    return ::recv(fd, &b, 1, 0) == 0;
}

}  // namespace

TEST_CASE("comm: the store answers only clients with its token, and no client can stall it") {
    // A probe: another local user connected to the store's loopback port, sent one byte and
    // stopped; the store (one thread, blocking reads) answered no rank again, so no rank group
    // could be rebuilt (a wakeup failed rank_failed); that user could also read and replace
    // every rank's address.
    const std::string token = comm::new_store_token();
    CHECK(token.size() == 32);
    CHECK(comm::new_store_token() != token);
    comm::TcpStoreServer store("127.0.0.1", 0, token);
    const int stall = raw_connect(store.port());
    REQUIRE(stall >= 0);
    REQUIRE(::send(stall, "S", 1, MSG_NOSIGNAL) == 1);  // half a request, then silence
    comm::TcpStoreClient good("127.0.0.1", store.port(), std::chrono::milliseconds(1000), token);
    good.set("gen1/addr/0", {'a', 'b'});
    CHECK(good.get("gen1/addr/0") == std::vector<char>{'a', 'b'});
    // a wrong token, or a request before the token: refused, nothing read or written
    CHECK_THROWS_AS(comm::TcpStoreClient("127.0.0.1", store.port(), std::chrono::milliseconds(500), "0123456789abcdef0123456789abcdef"),
                    Error);
    CHECK_THROWS_AS(comm::TcpStoreClient("127.0.0.1", store.port(), std::chrono::milliseconds(500)).get("gen1/addr/0"), Error);
    const int peek = raw_connect(store.port());
    REQUIRE(peek >= 0);
    const char get[] = {'G', 11, 0, 0, 0, 'g', 'e', 'n', '1', '/', 'a', 'd', 'd', 'r', '/', '0'};
    REQUIRE(::send(peek, get, sizeof get, MSG_NOSIGNAL) == static_cast<ssize_t>(sizeof get));
    CHECK(closed_unanswered(peek, 2000));
    // the silent one is dropped once its 2 s to authenticate are over; the store still answers
    CHECK(closed_unanswered(stall, 4000));
    CHECK(good.get("gen1/addr/0") == std::vector<char>{'a', 'b'});
    ::close(stall);
    ::close(peek);
}
