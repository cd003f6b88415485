// A delta landing (daemon/src/stream/landing_delta.cpp, fd/stream/landing.h LandMode::delta): a row
// part takes the indices in its rows (made part-local), a column part keeps its columns of the
// whole tensor's delta (indices and values compacted), int32 and int64 indices, the end frame; and
// each refusal (unsorted, duplicated, outside the tensor or the part, non-finite, a part twice, a
// wrong frame count, a close before the end, a full frame, an empty or oversized frame, a frame past the
// rank's buffer) named.
#include "fd/stream/landing.h"

#include "fd/status.h"
#include "stream/landing_wire.h"

#include <doctest/doctest.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

using fd::stream::Landing;
using fd::stream::LandMode;
using fd::stream::LandPart;

namespace {

using Clock = std::chrono::steady_clock;

/// "r": rows [2, 4) of a [4, 3] f32 tensor (flat [6, 12)); "c": columns [2, 4) of a [3, 4] f32
/// tensor (a [3, 2] part).
std::vector<LandPart> parts() {
    return {LandPart{.hf_name = "r", .offset = 0, .nbytes = 24, .dtype = fd::DType::f32, .dim = 0, .src0 = 2, .n = 2, .hf_shape = {4, 3}},
            LandPart{.hf_name = "c", .offset = 64, .nbytes = 24, .dtype = fd::DType::f32, .dim = 1, .src0 = 2, .n = 2, .hf_shape = {3, 4}}};
}

void send_header(int fd, uint64_t a, uint64_t b) {
    unsigned char h[16];
    for (int i = 0; i < 8; ++i) {
        h[i]     = static_cast<unsigned char>(a >> (8 * i));
        h[8 + i] = static_cast<unsigned char>(b >> (8 * i));
    }
    ::send(fd, h, sizeof h, MSG_NOSIGNAL);
}

template <class Index>
void send_delta_frame(int fd, uint64_t off, const std::vector<Index> & idx, const std::vector<float> & vals) {
    const uint64_t flags = fd::stream::kDeltaFrame | (sizeof(Index) == 8 ? fd::stream::kDeltaIndices64 : 0);
    send_header(fd, off | flags, idx.size());
    ::send(fd, idx.data(), idx.size() * sizeof(Index), MSG_NOSIGNAL);
    ::send(fd, vals.data(), vals.size() * 4, MSG_NOSIGNAL);
}

struct Run {
    std::vector<std::byte> buf = std::vector<std::byte>(static_cast<size_t>(fd::stream::delta_buffer_bytes(parts())));
    Landing l{LandMode::delta, parts(), buf.data(), static_cast<int64_t>(buf.size()), "127.0.0.1", 10, true};
    int fd = connect_to(l.port(), l.token());
    ~Run() {
        l.stop();
        ::close(fd);
    }
    std::string error() {
        try {
            l.wait(Clock::now() + std::chrono::seconds(5));
        } catch (const fd::Error & e) {
            return e.what();
        }
        return "";
    }
};

template <class T>
std::vector<T> at(const fd::stream::LandedDelta & d, int64_t off, int64_t n) {
    std::vector<T> v(static_cast<size_t>(n));
    std::memcpy(v.data(), d.bytes + off, static_cast<size_t>(n) * sizeof(T));
    return v;
}

}  // namespace

TEST_SUITE("stream::landing_delta") {
    TEST_CASE("a row part's indices made part-local, a column part's columns kept; int32 and int64; the end frame") {
        Run r;
        send_delta_frame<int64_t>(r.fd, 64, {1, 2, 3, 6, 11}, {10, 20, 30, 40, 50});  // col 1 of row 0 is not this part's
        send_delta_frame<int32_t>(r.fd, 0, {6, 8, 11}, {1, 2, 3});
        send_header(r.fd, fd::stream::kDeltaEnd, 2);
        REQUIRE(r.error() == "");
        const auto d = r.l.delta();
        REQUIRE(d.frames.size() == 2);
        CHECK(d.n_values() == 7);
        const auto & c = d.frames[0];
        CHECK((c.part == 1 && c.n == 4));
        CHECK(at<uint32_t>(d, c.idx_at, 4) == std::vector<uint32_t>{0, 1, 2, 5});  // (row, col - 2) -> row * 2 + col - 2
        CHECK(at<float>(d, c.val_at, 4) == std::vector<float>{20, 30, 40, 50});
        const auto & w = d.frames[1];
        CHECK((w.part == 0 && w.n == 3));
        CHECK(at<uint32_t>(d, w.idx_at, 3) == std::vector<uint32_t>{0, 2, 5});
        CHECK(at<float>(d, w.val_at, 3) == std::vector<float>{1, 2, 3});
    }

    TEST_CASE("each refusal names the tensor and what is wrong") {
        auto refused = [](auto && trainer) {
            Run r;
            trainer(r.fd);
            return r.error();
        };
        auto has = [](const std::string & e, const std::string & what) {
            INFO(e);
            CHECK(e.find(what) != std::string::npos);
        };
        has(refused([](int fd) { send_delta_frame<int32_t>(fd, 0, {8, 7}, {1, 2}); }), "tensor 'r': delta index 7 at position 1 is not greater");
        has(refused([](int fd) { send_delta_frame<int32_t>(fd, 0, {8, 8}, {1, 2}); }), "sorted and unique");
        has(refused([](int fd) { send_delta_frame<int64_t>(fd, 0, {6, 12}, {1, 2}); }), "delta index 12 at position 1 is outside its 12 elements");
        has(refused([](int fd) { send_delta_frame<int32_t>(fd, 0, {-1}, {1}); }), "delta index -1 at position 0 is outside its 12 elements");
        has(refused([](int fd) { send_delta_frame<int32_t>(fd, 0, {0, 7}, {1, 2}); }), "outside this part's elements [6, 12)");
        has(refused([](int fd) { send_delta_frame<int32_t>(fd, 0, {6, 7}, {1, NAN}); }), "tensor 'r' holds a non-finite value at delta position 1 (index 7)");
        has(refused([](int fd) {
                send_delta_frame<int32_t>(fd, 0, {6}, {1});
                send_delta_frame<int32_t>(fd, 0, {7}, {1});
            }), "tensor 'r': a second delta frame");
        has(refused([](int fd) {
                send_delta_frame<int32_t>(fd, 0, {6}, {1});
                send_header(fd, fd::stream::kDeltaEnd, 2);
            }), "the delta's end frame counts 2 frame(s) for this rank, 1 arrived");
        has(refused([](int fd) {
                send_delta_frame<int32_t>(fd, 0, {6}, {1});
                ::shutdown(fd, SHUT_WR);
            }), "closed its landing connection before the delta's end frame (1 frame(s) arrived)");
        has(refused([](int fd) { send_frame(fd, 0, std::vector<float>(6).data(), 24); }), "a full part frame (offset 0) on a delta landing");
        has(refused([](int fd) { send_header(fd, fd::stream::kDeltaFrame | 0, 0); }), "a delta frame of 0 elements for a part that takes 1 to 6");
        has(refused([](int fd) { send_header(fd, fd::stream::kDeltaFrame | 64, 13); }), "tensor 'c': a delta frame of 13 elements");
        has(refused([](int fd) { send_delta_frame<int32_t>(fd, 32, {6}, {1}); }), "a delta frame at offset 32 is no part");
        {  // a rank's buffer smaller than every frame at its largest (Worker caps it): a frame past it is refused, naming it
            std::vector<std::byte> small(40);
            Landing l{LandMode::delta, parts(), small.data(), static_cast<int64_t>(small.size()), "127.0.0.1", 10, true};
            const int fd = connect_to(l.port(), l.token());
            send_delta_frame<int32_t>(fd, 0, {6, 7, 8, 9, 10, 11}, {1, 2, 3, 4, 5, 6});
            std::string e;
            try {
                l.wait(Clock::now() + std::chrono::seconds(5));
            } catch (const fd::Error & x) {
                e = x.what();
            }
            has(e, "tensor 'r': a delta frame of 6 elements overflows this rank's delta buffer");
            l.stop();
            ::close(fd);
        }
    }
}
