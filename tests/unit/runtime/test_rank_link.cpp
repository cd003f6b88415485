// The rank link (fd/runtime/rank_link.h): a step batch survives the shared region unchanged
// (block tables included) and the region grows only when a step needs it; over a real
// socketpair to a forked peer, replies arrive in order, a peer that dies is seen at once and a
// peer that is stopped runs into the deadline instead of hanging the caller; a descriptor passed
// with a record (the shm group's segment) arrives as a working copy of the same file, only once,
// and a stream (TCP) link refuses to carry one. A step asking for its routed experts (R3) gets
// rank 0's routes back beside the logits. A rank on a stream link refuses an inline length
// above kInlineMaxBytes before it allocates, and a step or swap whose header counts more than
// arrived.
#include "fd/runtime/rank_link.h"
#include "fd/status.h"

#include <doctest/doctest.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <csignal>
#include <thread>

using namespace fd;
using namespace fd::runtime;
using Clock = std::chrono::steady_clock;

namespace {

/// Two sequences: a 5-token prefill over blocks {7, 2} and a decode over blocks {3, 9, 4}.
struct TwoSeqs {
    int32_t table_a[2] = {7, 2};
    int32_t table_b[3] = {3, 9, 4};
    model::StepBatch b;
    TwoSeqs() {
        for (int32_t t = 0; t < 5; ++t) {
            b.tokens.push_back(10 + t);
            b.positions.push_back(t);
            b.slots.push_back(7 * 4 + t);
            b.queries.push_back({table_a, t + 1});
        }
        b.tokens.push_back(99);
        b.positions.push_back(9);
        b.slots.push_back(4 * 4 + 1);
        b.queries.push_back({table_b, 10});
        b.logits_rows = {4, 5};
    }
};

}  // namespace

TEST_SUITE("runtime::rank_link") {
    TEST_CASE("a step batch round-trips through the shared region, block tables included") {
        TwoSeqs s;
        const int32_t bs = 4, vocab = 1024;  // logits alone outgrow the first page
        CHECK(step_tables(s.b, bs) == 2 + 3);  // ceil(5/4) + ceil(10/4)
        SharedRegion region;
        region.create(64);  // too small: encode says how much it needs and writes nothing
        const int64_t need = step_encode(region.data(), region.bytes(), s.b, bs, vocab);
        CHECK(need > region.bytes());
        CHECK(need == step_layout(6, 2, 5, vocab).total_bytes);
        region.resize(need);
        CHECK(step_encode(region.data(), region.bytes(), s.b, bs, vocab) == need);

        SharedRegion peer;  // the rank's mapping of the same memfd
        peer.attach(::dup(region.fd()));
        model::StepBatch got;
        step_decode(peer.data(), got);
        CHECK(got.tokens == s.b.tokens);
        CHECK(got.positions == s.b.positions);
        CHECK(got.slots == s.b.slots);
        CHECK(got.logits_rows == s.b.logits_rows);
        REQUIRE(got.queries.size() == 6);
        for (size_t t = 0; t < 6; ++t) {
            CHECK(got.queries[t].n_ctx == s.b.queries[t].n_ctx);
            const int32_t n_blocks = (got.queries[t].n_ctx + bs - 1) / bs;
            for (int32_t k = 0; k < n_blocks; ++k) { CHECK(got.queries[t].block_table[k] == s.b.queries[t].block_table[k]); }
        }
        // Logits the rank writes are what the daemon reads.
        step_logits(peer.data())[2 * vocab - 1] = 1.5f;
        CHECK(step_logits(region.data())[2 * vocab - 1] == 1.5f);

        // Growing remaps; the peer follows with remap() and sees the same bytes.
        const void * before = region.data();
        region.resize(need * 8);
        CHECK(region.bytes() >= need * 8);
        peer.remap();
        CHECK(peer.bytes() == region.bytes());
        step_decode(peer.data(), got);
        CHECK(got.tokens == s.b.tokens);
        (void)before;
    }

    TEST_CASE("a step that wants its routed experts (R3) carries rank 0's routes after the logits; one that does not, none") {
        TwoSeqs s;
        const int32_t bs = 4, vocab = 64, cols = 2 * 4;  // 2 sparse layers x top-4
        SharedRegion region;
        region.create(64);
        // Not asked: the layout is the one without routes, and the rank sees want_routes false.
        const int64_t plain = step_encode(region.data(), region.bytes(), s.b, bs, vocab, cols);
        CHECK(plain == step_layout(6, 2, 5, vocab).total_bytes);
        s.b.want_routes = true;
        const int64_t need = step_encode(region.data(), region.bytes(), s.b, bs, vocab, cols);
        CHECK(need == step_layout(6, 2, 5, vocab, cols).total_bytes);
        CHECK(need >= plain + 6 * cols * 4);
        region.resize(need);
        REQUIRE(step_encode(region.data(), region.bytes(), s.b, bs, vocab, cols) == need);
        SharedRegion peer;
        peer.attach(::dup(region.fd()));
        model::StepBatch got;
        step_decode(peer.data(), got);
        CHECK(got.want_routes);
        // Rank 0 writes [n_tokens, cols] ids past the logits; the daemon reads them, logits intact.
        step_logits(peer.data())[2 * vocab - 1] = 2.5f;
        int32_t * r = step_routes(peer.data());
        REQUIRE(r != nullptr);
        CHECK(reinterpret_cast<char *>(r) >= reinterpret_cast<char *>(step_logits(peer.data()) + 2 * vocab));
        for (int32_t i = 0; i < 6 * cols; ++i) { r[i] = 100 + i; }
        const int32_t * back = step_routes(region.data());
        REQUIRE(back != nullptr);
        for (int32_t i = 0; i < 6 * cols; ++i) { CHECK(back[i] == 100 + i); }
        CHECK(step_logits(region.data())[2 * vocab - 1] == 2.5f);
        // The next step without routes: none in the region, and the rank's batch says so.
        s.b.want_routes = false;
        REQUIRE(step_encode(region.data(), region.bytes(), s.b, bs, vocab, cols) == plain);
        step_decode(peer.data(), got);
        CHECK_FALSE(got.want_routes);
        CHECK(step_routes(region.data()) == nullptr);
    }

    TEST_CASE("replies come back in order; a dead peer is seen at once, a stopped one at the deadline") {
        auto [mine, theirs] = make_link_pair();
        const pid_t pid = fork();
        if (pid == 0) {  // an echo rank: answers each request with status = seq
            mine.close();
            for (;;) {
                LinkMsg m;
                if (theirs.recv(m, Clock::now() + std::chrono::seconds(30)) != LinkSocket::Recv::ok) { _exit(0); }
                m.status = static_cast<int32_t>(m.seq);
                if (m.op == static_cast<uint32_t>(LinkOp::shutdown)) { _exit(0); }
                theirs.send(m);
            }
        }
        theirs.close();
        for (uint64_t seq = 1; seq <= 100; ++seq) {
            LinkMsg m;
            m.op  = static_cast<uint32_t>(LinkOp::forward);
            m.seq = seq;
            REQUIRE(mine.send(m));
            LinkMsg r;
            REQUIRE(mine.recv(r, Clock::now() + std::chrono::seconds(10)) == LinkSocket::Recv::ok);
            CHECK(r.seq == seq);
            CHECK(r.status == static_cast<int32_t>(seq));
        }
        CHECK(!mine.peer_closed());

        // Stopped: the wait ends at its deadline (and the on_slice hook runs meanwhile).
        ::kill(pid, SIGSTOP);
        LinkMsg m;
        m.seq = 101;
        REQUIRE(mine.send(m));
        int slices = 0;
        const auto t0 = Clock::now();
        LinkMsg r;
        CHECK(mine.recv(r, t0 + std::chrono::milliseconds(300), std::chrono::milliseconds(10), [&] { ++slices; }) ==
              LinkSocket::Recv::timeout);
        CHECK(Clock::now() - t0 >= std::chrono::milliseconds(300));
        CHECK(slices >= 1);
        // Continued, it answers the pending request.
        ::kill(pid, SIGCONT);
        REQUIRE(mine.recv(r, Clock::now() + std::chrono::seconds(10)) == LinkSocket::Recv::ok);
        CHECK(r.seq == 101);

        // Killed: the link closes, the wait returns well before its deadline.
        ::kill(pid, SIGKILL);
        int st = 0;
        ::waitpid(pid, &st, 0);
        CHECK(mine.peer_closed());
        const auto t1 = Clock::now();
        CHECK(mine.recv(r, t1 + std::chrono::seconds(10)) == LinkSocket::Recv::closed);
        CHECK(Clock::now() - t1 < std::chrono::seconds(5));
        CHECK(!mine.send(m));
    }

    TEST_CASE("a descriptor passed with a record arrives as a copy of the same file, once; a stream link refuses one") {
        auto [a, b] = make_link_pair();
        const int mem = ::memfd_create("fdrollout-tp-test", MFD_CLOEXEC);
        REQUIRE(mem >= 0);
        REQUIRE(::ftruncate(mem, 4096) == 0);
        LinkMsg m;
        m.op = static_cast<uint32_t>(LinkOp::comm_connect);
        m.generation = 3;
        REQUIRE(a.send(m, mem));
        LinkMsg r;
        REQUIRE(b.recv(r, Clock::now() + std::chrono::seconds(10)) == LinkSocket::Recv::ok);
        CHECK(r.generation == 3);
        const int got = b.take_fd();
        REQUIRE(got >= 0);
        CHECK(got != mem);
        CHECK(b.take_fd() == -1);  // taken once
        struct stat s1{}, s2{};
        REQUIRE(::fstat(mem, &s1) == 0);
        REQUIRE(::fstat(got, &s2) == 0);
        CHECK((s1.st_dev == s2.st_dev && s1.st_ino == s2.st_ino));
        CHECK((::fcntl(got, F_GETFD) & FD_CLOEXEC) != 0);  // never leaks into an exec'd child
        ::close(got);
        // A record without one brings none; a blob can carry one too (the config at start-up).
        REQUIRE(a.send(m));
        REQUIRE(b.recv(r, Clock::now() + std::chrono::seconds(10)) == LinkSocket::Recv::ok);
        CHECK(b.take_fd() == -1);
        const char blob[] = "{\"rank\": 0}";
        REQUIRE(a.send_blob(blob, sizeof blob, mem));
        char buf[64] = {};
        CHECK(b.recv_bytes(buf, sizeof buf) == static_cast<int64_t>(sizeof blob));
        const int got2 = b.take_fd();
        CHECK(got2 >= 0);
        if (got2 >= 0) { ::close(got2); }
        // A TCP-like stream link never carries descriptors (a rank on another host cannot map them).
        int sv[2];
        REQUIRE(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) == 0);
        LinkSocket s(sv[0]), t(sv[1]);
        REQUIRE(s.stream());
        CHECK(!s.send(m, mem));
        CHECK(!s.send_blob(blob, sizeof blob, mem));
        ::close(mem);
    }
    TEST_CASE("a record waiting unread is no hang-up (hung_up), but breaks a link that must be silent (peer_closed); a close is both") {
        // The survivor's case: rank 0's late reply (or a beat) sits in its link after the call that
        // lost rank 1 gave up on it; the daemon must not name rank 0 failed for it.
        auto check = [](LinkSocket & daemon_end, LinkSocket & rank_end) {
            CHECK_FALSE(daemon_end.hung_up());
            CHECK_FALSE(daemon_end.peer_closed());
            LinkMsg late;
            late.seq    = 7;
            late.status = static_cast<int32_t>(Errc::rank_failed);
            REQUIRE(rank_end.send(late));
            CHECK_FALSE(daemon_end.hung_up());
            CHECK(daemon_end.peer_closed());
            rank_end.close();
            CHECK(daemon_end.hung_up());  // the unread record does not hide the close
            CHECK(daemon_end.peer_closed());
            LinkMsg got;
            CHECK(daemon_end.recv(got, Clock::now() + std::chrono::seconds(5)) == LinkSocket::Recv::ok);
            CHECK(got.seq == 7);
        };
        SUBCASE("seqpacket (a rank on this node)") {
            auto [a, b] = make_link_pair();
            REQUIRE_FALSE(a.stream());
            check(a, b);
        }
        SUBCASE("stream (a rank on another node)") {
            int sv[2];
            REQUIRE(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) == 0);
            LinkSocket a(sv[0]), b(sv[1]);
            REQUIRE(a.stream());
            check(a, b);
        }
    }
    TEST_CASE("a stream link's inline step: its length is bounded before allocation, its counts checked against it") {
        int sv[2];
        REQUIRE(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) == 0);
        LinkSocket daemon_end(sv[0]), rank_end(sv[1]);
        REQUIRE(rank_end.stream());
        std::vector<int64_t> buf;
        const auto soon = [] { return Clock::now() + std::chrono::milliseconds(500); };
        // An oversized (or negative) header: refused at once, nothing allocated, nothing read.
        for (int64_t bytes : {kInlineMaxBytes + 1, int64_t{1} << 62, int64_t{-8}}) {
            CAPTURE(bytes);
            LinkMsg m;
            m.op    = static_cast<uint32_t>(LinkOp::forward);
            m.bytes = bytes;
            const auto t0 = Clock::now();
            CHECK_THROWS_WITH_AS(recv_inline(rank_end, m, buf, soon()), doctest::Contains("at most 268435456 may follow"), fd::Error);
            CHECK(Clock::now() - t0 < std::chrono::milliseconds(400));  // no wait for bytes that would follow
            CHECK(buf.empty());
        }
        // A real step (TwoSeqs: 6 tokens, 2 logits rows, 5 table entries) sent inline as the
        // daemon does (everything before the logits): received whole, counts consistent.
        TwoSeqs s;
        const int32_t bs = 4, vocab = 1024;
        std::vector<int64_t> region(static_cast<size_t>(step_layout(6, 2, 5, vocab).total_bytes / 8 + 1));
        const int64_t region_bytes = static_cast<int64_t>(region.size() * 8);
        REQUIRE(step_encode(region.data(), region_bytes, s.b, bs, vocab) <= region_bytes);
        const int64_t n = step_layout(6, 2, 5, vocab).logits;
        LinkMsg m;
        m.op    = static_cast<uint32_t>(LinkOp::forward);
        m.bytes = n;
        REQUIRE(daemon_end.send_bytes(region.data(), static_cast<size_t>(n)));
        REQUIRE(recv_inline(rank_end, m, buf, soon()) == LinkSocket::Recv::ok);
        CHECK(static_cast<int64_t>(buf.size() * 8) >= n);
        CHECK_NOTHROW(check_inline_step(buf.data(), n));
        model::StepBatch got;
        step_decode(buf.data(), got);
        CHECK(got.tokens == s.b.tokens);
        // The same header with fewer bytes than its arrays need, or a negative count: refused.
        CHECK_THROWS_WITH_AS(check_inline_step(buf.data(), n - 1), doctest::Contains("shorter than the arrays"), fd::Error);
        CHECK_THROWS_WITH_AS(check_inline_step(buf.data(), 16), doctest::Contains("header"), fd::Error);
        RegionHeader h;
        std::memcpy(static_cast<void *>(&h), buf.data(), sizeof h);
        h.n_tables = -1;
        std::memcpy(static_cast<void *>(buf.data()), &h, sizeof h);
        CHECK_THROWS_WITH_AS(check_inline_step(buf.data(), n), doctest::Contains("negative"), fd::Error);
        // swap_kv's lists: 3 out + 2 in copies need exactly what swap_encode writes.
        const kv::BlockCopy copies[3] = {{1, 2}, {3, 4}, {5, 6}};
        const int64_t swap_n = swap_encode(region.data(), 0, copies, 3, copies, 2);  // writes nothing: sizes only
        CHECK_NOTHROW(check_inline_swap(swap_n, 3, 2));
        CHECK_THROWS_WITH_AS(check_inline_swap(swap_n - 1, 3, 2), doctest::Contains("need"), fd::Error);
        CHECK_THROWS_WITH_AS(check_inline_swap(swap_n, 3, int64_t{1} << 60), doctest::Contains("block copies"), fd::Error);
        CHECK_THROWS_WITH_AS(check_inline_swap(swap_n, -1, 2), doctest::Contains("block copies"), fd::Error);
    }
}
