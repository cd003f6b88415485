// Joining node 0 from another host (fd/runtime/node_join.h), over real loopback TCP: the token
// file's ownership/mode rules, the model fingerprint, the handshake accepting the right token and
// refusing a wrong one, another tensor-parallel size, another model config or a rank outside the
// node, a master that never answers, and the stream framing of the joined link (records, blobs and
// inline payloads arrive whole however TCP splits them).
#include "fd/runtime/node_join.h"

#include "fd/status.h"

#include <doctest/doctest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <thread>

using namespace fd;
using namespace fd::runtime;
using Clock = std::chrono::steady_clock;
namespace fs = std::filesystem;

namespace {

struct TempDir {
    fs::path path;
    TempDir() {
        char tmpl[] = "/tmp/fd-node-join-XXXXXX";
        REQUIRE(::mkdtemp(tmpl) != nullptr);
        path = tmpl;
    }
    ~TempDir() { fs::remove_all(path); }
    fs::path write(const std::string & name, const std::string & text, mode_t mode) const {
        const auto p = path / name;
        std::ofstream(p) << text;
        ::chmod(p.c_str(), mode);
        return p;
    }
};

const std::string kToken = "0123456789abcdef0123456789abcdef";

Errc code_of(const std::function<void()> & f, std::string * what = nullptr) {
    try {
        f();
    } catch (const Error & e) {
        if (what) { *what = e.what(); }
        return e.code();
    }
    return Errc::ok;
}

JoinRequest request(int port, const std::string & token = kToken) {
    return JoinRequest{.nnodes = 2, .node_rank = 1, .tp = 2, .rank = 1, .master_addr = "127.0.0.1", .bind_addr = "127.0.0.2",
                       .model_dir = "/models/m", .token = token, .master_port = port, .fingerprint = 42};
}

Clock::time_point in_s(double s) { return Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(s)); }

}  // namespace

TEST_CASE("the join token file must be the user's own, mode 0600, and long enough") {
    TempDir d;
    CHECK(load_dist_token(d.write("ok", "  " + kToken + "\n", 0600).string()) == kToken);
    std::string what;
    CHECK(code_of([&] { load_dist_token(d.write("loose", kToken, 0644).string()); }, &what) == Errc::forbidden);
    CHECK(what.find("chmod 600") != std::string::npos);
    CHECK(code_of([&] { load_dist_token(d.write("group", kToken, 0640).string()); }) == Errc::forbidden);
    CHECK(code_of([&] { load_dist_token(d.write("short", "abc", 0600).string()); }) == Errc::invalid_argument);
    CHECK(code_of([&] { load_dist_token((d.path / "missing").string()); }) == Errc::invalid_argument);
    CHECK(code_of([&] { load_dist_token(d.path.string()); }) == Errc::forbidden);  // a directory
}

TEST_CASE("the model fingerprint follows config.json's bytes") {
    TempDir a, b, c;
    a.write("config.json", R"({"hidden_size": 64})", 0644);
    b.write("config.json", R"({"hidden_size": 64})", 0644);
    c.write("config.json", R"({"hidden_size": 65})", 0644);
    CHECK(model_fingerprint(a.path) == model_fingerprint(b.path));
    CHECK(model_fingerprint(a.path) != model_fingerprint(c.path));
    CHECK(code_of([&] { model_fingerprint(a.path / "nothing"); }) == Errc::invalid_checkpoint);
}

TEST_CASE("a node with the token joins; its link carries records, blobs and inline payloads whole") {
    JoinListener l("127.0.0.1", 0, {.nnodes = 2, .tp = 2, .fingerprint = 42, .token = kToken});
    JoinedLink node = join_master(request(l.port()), in_s(10));
    CHECK(node.bind_addr == "127.0.0.2");
    auto got = l.take(1, in_s(10));
    REQUIRE(got.has_value());
    CHECK(got->node_rank == 1);
    CHECK(got->model_dir == "/models/m");
    CHECK(got->bind_addr == "127.0.0.2");
    CHECK(got->peer.rfind("127.0.0.2:", 0) == 0);
    CHECK(got->link.stream());
    CHECK_FALSE(got->link.peer_closed());

    // Daemon → rank: a config blob, then a forward record followed by 1 MB of step arrays.
    const std::string cfg = R"({"rank": 1})";
    REQUIRE(got->link.send_blob(cfg.data(), cfg.size()));
    std::vector<char> buf(4096);
    const int64_t n = node.link.recv_bytes(buf.data(), buf.size());
    CHECK(std::string(buf.data(), static_cast<size_t>(n)) == cfg);
    std::vector<int32_t> payload(1 << 18);
    for (size_t i = 0; i < payload.size(); ++i) { payload[i] = static_cast<int32_t>(i * 7); }
    LinkMsg req;
    req.op    = static_cast<uint32_t>(LinkOp::forward);
    req.seq   = 9;
    req.bytes = static_cast<int64_t>(payload.size() * 4);
    std::thread sender([&] { CHECK((got->link.send(req) && got->link.send_bytes(payload.data(), payload.size() * 4))); });
    LinkMsg m;
    REQUIRE(node.link.recv(m, in_s(10)) == LinkSocket::Recv::ok);
    CHECK(m.seq == 9);
    std::vector<int32_t> back(payload.size());
    REQUIRE(node.link.recv_exact(back.data(), static_cast<size_t>(m.bytes), in_s(10)) == LinkSocket::Recv::ok);
    sender.join();
    CHECK(back == payload);

    // The rank side closes: the daemon side sees it at once.
    node.link.close();
    const auto until = in_s(5);
    while (!got->link.peer_closed() && Clock::now() < until) { std::this_thread::sleep_for(std::chrono::milliseconds(5)); }
    CHECK(got->link.peer_closed());
}

TEST_CASE("joins with a wrong token, another tp or model, or a rank outside the node are refused") {
    JoinListener l("127.0.0.1", 0, {.nnodes = 2, .tp = 2, .fingerprint = 42, .token = kToken});
    std::string what;
    CHECK(code_of([&] { join_master(request(l.port(), "another-token-of-enough-length"), in_s(10)); }, &what) == Errc::forbidden);
    CHECK(what.find("authentication failed") != std::string::npos);

    auto r = request(l.port());
    r.tp = 4;
    CHECK(code_of([&] { join_master(r, in_s(10)); }, &what) == Errc::invalid_argument);
    CHECK(what.find("node 0 runs --nnodes 2 --tensor-parallel-size 2") != std::string::npos);

    r = request(l.port());
    r.fingerprint = 43;
    CHECK(code_of([&] { join_master(r, in_s(10)); }, &what) == Errc::invalid_argument);
    CHECK(what.find("differs from node 0's") != std::string::npos);

    r = request(l.port());
    r.rank = 0;  // rank 0 lives on node 0
    CHECK(code_of([&] { join_master(r, in_s(10)); }, &what) == Errc::invalid_argument);
    CHECK(what.find("outside") != std::string::npos);

    // Nothing refused was parked.
    CHECK_FALSE(l.take(0, in_s(0.2)).has_value());
    CHECK_FALSE(l.take(1, in_s(0.2)).has_value());
}

TEST_CASE("a master that never answers fails the join at the deadline, naming it") {
    int port = 0;
    {
        JoinListener probe("127.0.0.1", 0, {.nnodes = 2, .tp = 2, .token = kToken});
        port = probe.port();
    }  // closed: nothing listens there now
    std::string what;
    const auto t0 = Clock::now();
    CHECK(code_of([&] { join_master(request(port), in_s(0.5)); }, &what) == Errc::rank_failed);
    CHECK(Clock::now() - t0 < std::chrono::seconds(5));
    CHECK(what.find(fmt::format("127.0.0.1:{}", port)) != std::string::npos);
}

TEST_CASE("the join port in use is refused by name") {
    JoinListener first("127.0.0.1", 0, {.nnodes = 2, .tp = 2, .token = kToken});
    std::string what;
    CHECK(code_of([&] { JoinListener second("127.0.0.1", first.port(), {.nnodes = 2, .tp = 2, .token = kToken}); }, &what) ==
          Errc::invalid_argument);
    CHECK(what.find(std::to_string(first.port())) != std::string::npos);
}
