// Landing (daemon/src/stream/landing.cpp): a layout's parts as byte ranges that tile each tensor,
// and the receiver that writes a trainer's frames into a region — every part once, in any order,
// each refusal (a frame at no part, a part twice, a non-finite value, parts missing at the
// trainer's close, the deadline) named, and a stop that ends a receiver waiting for a trainer.
#include "fd/stream/landing.h"

#include "fd/status.h"
#include "stream/landing_wire.h"

#include <doctest/doctest.h>

#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

using fd::stream::Landing;
using fd::stream::LandPart;

namespace {

using Clock = std::chrono::steady_clock;

/// Two f32 parts: 1 MiB + 16 bytes at 0 (more than one 256 KiB piece) and 64 bytes at offset 2 MiB.
std::vector<LandPart> two_parts() {
    return {LandPart{.hf_name = "a", .offset = 0, .nbytes = (1 << 20) + 16, .dtype = fd::DType::f32},
            LandPart{.hf_name = "b", .offset = 2 << 20, .nbytes = 64, .dtype = fd::DType::f32}};
}

std::string wait_error(Landing & l, double s = 5) {
    try {
        l.wait(Clock::now() + std::chrono::milliseconds(static_cast<int>(s * 1000)));
    } catch (const fd::Error & e) {
        return e.what();
    }
    return "";
}

}  // namespace

TEST_SUITE("stream::landing") {
    TEST_CASE("land_parts: each part one byte range, the parts tiling their tensor (rows and columns)") {
        fd::model::WeightLayout L;
        fd::model::InferenceTensor qkv{.name = "qkv", .shape = {6, 4}, .shard = fd::model::Shard::rows, .dtype = fd::DType::bf16, .offset = 128,
                                       .bytes = 6 * 4 * 2};
        qkv.parts = {{"q", 0, 4, fd::DType::bf16, 0, 4, {8, 4}}, {"k", 4, 2, fd::DType::bf16, 0, 2, {4, 4}}};
        fd::model::InferenceTensor o{.name = "o", .shape = {3, 2}, .shard = fd::model::Shard::cols, .dtype = fd::DType::f32, .offset = 256,
                                     .bytes = 3 * 2 * 4};
        o.parts = {{"o", 0, 3, fd::DType::f32, 1, 2, {3, 4}}};
        L.tensors = {qkv, o};
        const auto p = fd::stream::land_parts(L);
        REQUIRE(p.size() == 3);
        CHECK((p[0].offset == 128 && p[0].nbytes == 32 && p[0].dim == 0 && p[0].src0 == 4 && p[0].n == 4));
        CHECK((p[1].offset == 128 + 32 && p[1].nbytes == 16 && p[1].src0 == 2 && p[1].n == 2));
        CHECK((p[2].offset == 256 && p[2].nbytes == 24 && p[2].dim == 1 && p[2].src0 == 2 && p[2].n == 2));
        L.tensors[1].bytes += 4;  // parts that do not tile their tensor: refused, naming it
        try {
            (void)fd::stream::land_parts(L);
            FAIL("expected an error");
        } catch (const fd::Error & e) {
            CHECK(e.code() == fd::Errc::wrong_state);
            CHECK(std::string(e.what()).find("'o'") != std::string::npos);
        }
    }

    TEST_CASE("every part lands where the layout says, in any order, checked finite") {
        std::vector<float> region((3 << 20) / 4, -1.0f);
        Landing l(two_parts(), reinterpret_cast<std::byte *>(region.data()), "127.0.0.1", 10, true);
        const int fd = connect_to(l.port(), l.token());
        std::vector<float> a(((1 << 20) + 16) / 4), b(16);
        for (size_t i = 0; i < a.size(); ++i) { a[i] = static_cast<float>(i) * 0.5f; }
        for (size_t i = 0; i < b.size(); ++i) { b[i] = 100.0f + static_cast<float>(i); }
        send_frame(fd, 2 << 20, b.data(), 64);  // the second part first
        send_frame(fd, 0, a.data(), a.size() * 4);
        ::shutdown(fd, SHUT_WR);
        CHECK(wait_error(l) == "");
        CHECK(std::memcmp(region.data(), a.data(), a.size() * 4) == 0);
        CHECK(std::memcmp(region.data() + (2 << 20) / 4, b.data(), 64) == 0);
        CHECK(region[a.size()] == -1.0f);  // nothing between the parts written
        l.stop();
        ::close(fd);
    }

    TEST_CASE("a frame at no part, a part twice, a NaN, missing parts: each refused, naming it") {
        std::vector<float> region((3 << 20) / 4, 0.0f);
        std::vector<float> a(((1 << 20) + 16) / 4, 1.0f), b(16, 2.0f);
        auto run = [&](auto && trainer) {
            Landing l(two_parts(), reinterpret_cast<std::byte *>(region.data()), "127.0.0.1", 10, true);
            const int fd = connect_to(l.port(), l.token());
            trainer(fd);
            ::shutdown(fd, SHUT_WR);
            const std::string e = wait_error(l);
            l.stop();
            ::close(fd);
            return e;
        };
        CHECK(run([&](int fd) { send_frame(fd, 4, b.data(), 64); }).find("no part this rank expects") != std::string::npos);
        CHECK(run([&](int fd) { send_frame(fd, 2 << 20, b.data(), 60); }).find("no part this rank expects") != std::string::npos);
        CHECK(run([&](int fd) {
                  send_frame(fd, 2 << 20, b.data(), 64);
                  send_frame(fd, 2 << 20, b.data(), 64);
              }).find("'b' at offset 2097152 arrived twice") != std::string::npos);
        std::vector<float> nan = a;
        nan[70000] = std::nanf("");
        const std::string e = run([&](int fd) { send_frame(fd, 0, nan.data(), nan.size() * 4); });
        CHECK(e.find("tensor 'a' holds a non-finite value at element 70000") != std::string::npos);
        CHECK(run([&](int fd) { send_frame(fd, 0, a.data(), a.size() * 4); }).find("missing 1 of this rank's 2 parts (the first: tensor 'b')") !=
              std::string::npos);
    }

    TEST_CASE("the deadline, and a stop while the receiver waits for a trainer") {
        std::vector<float> region((3 << 20) / 4, 0.0f);
        {
            Landing l(two_parts(), reinterpret_cast<std::byte *>(region.data()), "127.0.0.1", 10, true);
            const auto t0 = Clock::now();
            CHECK(wait_error(l, 0.2).find("2 of 2 parts missing") != std::string::npos);
            CHECK(Clock::now() - t0 < std::chrono::seconds(2));
            l.stop();  // no trainer ever connected: the accept ends at once
        }
        Landing l(two_parts(), reinterpret_cast<std::byte *>(region.data()), "127.0.0.1", 0.3, true);  // the receiver's own bound
        CHECK(wait_error(l, 5).find("trainer connected") != std::string::npos);
    }
}
