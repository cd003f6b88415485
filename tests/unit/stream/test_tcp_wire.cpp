// The CPU weight-stream transport's receive side (daemon/src/stream/tcp_wire.cpp) and where its
// bytes land (staging_dir.cpp's BucketFile): a tensor arrives as pieces of at most kPieceBytes,
// in order, each a whole number of elements, whether framed one by one or packed; the pieces
// written with BucketFile::write make a safetensors file whose header and bytes are the
// tensors' (read back here by hand from the format's definition: u64 LE header length, JSON,
// data at data_offsets after the header).
#include "../../../daemon/src/stream/stream_io.h"

#include <doctest/doctest.h>

#include <sys/socket.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <thread>
#include <vector>

using fd::model::DType;
using fd::stream::TensorSpec;
namespace fs = std::filesystem;

namespace {

TensorSpec spec(const std::string & name, DType dt, std::vector<int64_t> shape) {
    TensorSpec s{.name = name, .dtype = dt, .shape = std::move(shape)};
    s.nbytes = s.numel() * fd::model::dtype_size(dt);
    return s;
}

std::vector<std::byte> pattern(int64_t n, unsigned seed) {
    std::vector<std::byte> v(static_cast<size_t>(n));
    for (size_t i = 0; i < v.size(); ++i) { v[i] = static_cast<std::byte>((i * 2654435761u + seed) >> 13); }
    return v;
}

std::string frame(const nlohmann::json & h) {
    const std::string body = h.dump();
    std::string f(fd::stream::kFrameMagic, 4);
    for (int i = 0; i < 4; ++i) { f += static_cast<char>((body.size() >> (8 * i)) & 0xff); }
    return f + body;
}

void send_all(int fd, const void * p, size_t n) {
    const auto * c = static_cast<const char *>(p);
    while (n > 0) {
        const ssize_t w = ::send(fd, c, n, MSG_NOSIGNAL);
        REQUIRE(w > 0);
        c += w;
        n -= static_cast<size_t>(w);
    }
}

struct Piece {
    size_t  i;
    int64_t off;
    size_t  n;
};

/// Send `data` for `specs` over a socket pair as the Python client does (framed or packed) and
/// receive it; returns the pieces the sink saw and fills `got` with the bytes reassembled.
std::vector<Piece> round_trip(const std::vector<TensorSpec> & specs, const std::vector<std::vector<std::byte>> & data, bool packed,
                              std::vector<std::vector<std::byte>> & got) {
    int sv[2];
    REQUIRE(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) == 0);
    auto rx = fd::stream::make_tcp_receiver(fd::UniqueFd(sv[0]));
    std::thread writer([&] {
        if (packed) {
            int64_t total = 0;
            for (const auto & s : specs) { total += s.nbytes; }
            const std::string f = frame({{"packed", true}, {"nbytes", total}});
            send_all(sv[1], f.data(), f.size());
        }
        for (size_t i = 0; i < specs.size(); ++i) {
            if (!packed) {
                const std::string f = frame({{"name", specs[i].name}, {"dtype", fd::model::dtype_name(specs[i].dtype)},
                                             {"shape", specs[i].shape}, {"nbytes", specs[i].nbytes}});
                send_all(sv[1], f.data(), f.size());
            }
            send_all(sv[1], data[i].data(), data[i].size());
        }
    });
    std::vector<Piece> pieces;
    got.assign(specs.size(), {});
    rx->receive(specs, packed, [&](size_t i, int64_t off, const std::byte * p, size_t n) {
        pieces.push_back({i, off, n});
        got[i].insert(got[i].end(), p, p + n);
    }, fd::stream::Clock::now() + std::chrono::seconds(20));
    writer.join();
    ::close(sv[1]);
    return pieces;
}

}  // namespace

TEST_CASE("a tensor arrives as ordered pieces of whole elements, at most kPieceBytes each, framed or packed") {
    const size_t P = fd::stream::kPieceBytes;
    // 2.7 pieces of f32, one small f16, exactly one piece of bf16, one f32 element.
    const std::vector<TensorSpec> specs = {spec("a", DType::f32, {int64_t(P) * 27 / 160, 4}), spec("b", DType::f16, {3, 5}),
                                           spec("c", DType::bf16, {int64_t(P) / 2}), spec("d", DType::f32, {1})};
    std::vector<std::vector<std::byte>> data;
    for (size_t i = 0; i < specs.size(); ++i) { data.push_back(pattern(specs[i].nbytes, static_cast<unsigned>(i))); }
    for (const bool packed : {false, true}) {
        CAPTURE(packed);
        std::vector<std::vector<std::byte>> got;
        const auto pieces = round_trip(specs, data, packed, got);
        size_t i = 0;
        int64_t next = 0;
        for (const Piece & p : pieces) {
            if (p.i != i) {  // the previous tensor is complete before the next one starts
                CHECK(next == specs[i].nbytes);
                CHECK(p.i == i + 1);
                i = p.i;
                next = 0;
            }
            CHECK(p.off == next);
            CHECK(p.n <= P);
            CHECK(p.n % static_cast<size_t>(fd::model::dtype_size(specs[i].dtype)) == 0);
            next += static_cast<int64_t>(p.n);
        }
        CHECK(i == specs.size() - 1);
        CHECK(next == specs.back().nbytes);
        CHECK(pieces.size() == 3 + 1 + 1 + 1);
        for (size_t k = 0; k < specs.size(); ++k) { CHECK(got[k] == data[k]); }
    }
}

TEST_CASE("a frame unlike its announcement is refused before its bytes are handed on") {
    const std::vector<TensorSpec> specs = {spec("a", DType::f32, {4})};
    int sv[2];
    REQUIRE(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) == 0);
    auto rx = fd::stream::make_tcp_receiver(fd::UniqueFd(sv[0]));
    const std::string f = frame({{"name", "a"}, {"dtype", "F32"}, {"shape", {5}}, {"nbytes", 20}});
    send_all(sv[1], f.data(), f.size());
    int calls = 0;
    CHECK_THROWS_WITH_AS(rx->receive(specs, false, [&](size_t, int64_t, const std::byte *, size_t) { ++calls; },
                                     fd::stream::Clock::now() + std::chrono::seconds(5)),
                         doctest::Contains("was announced"), fd::Error);
    CHECK(calls == 0);
    ::close(sv[1]);
}

TEST_CASE("BucketFile: pieces written where they belong make a safetensors file of the tensors") {
    const fs::path dir = fs::temp_directory_path() / ("fd-bucketfile-" + std::to_string(::getpid()));
    fs::remove_all(dir);
    fs::create_directories(dir);
    const std::vector<TensorSpec> specs = {spec("model.x", DType::f32, {3, 70000}), spec("model.y", DType::bf16, {7})};
    std::vector<std::vector<std::byte>> data = {pattern(specs[0].nbytes, 1), pattern(specs[1].nbytes, 2)};
    {
        fd::stream::BucketFile out(dir / "b.safetensors", specs);
        for (size_t i = 0; i < specs.size(); ++i) {
            for (int64_t off = 0; off < specs[i].nbytes; off += fd::stream::kPieceBytes) {
                const size_t n = static_cast<size_t>(std::min<int64_t>(specs[i].nbytes - off, fd::stream::kPieceBytes));
                out.write(i, off, data[i].data() + off, n);
            }
        }
        CHECK_THROWS_AS(fd::stream::BucketFile(dir / "b.safetensors", specs), fd::Error);  // O_EXCL: never another's file
    }
    std::ifstream in(dir / "b.safetensors", std::ios::binary);
    const std::string file((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    REQUIRE(file.size() >= 8);
    uint64_t hl = 0;
    for (int i = 0; i < 8; ++i) { hl |= uint64_t(static_cast<unsigned char>(file[i])) << (8 * i); }
    CHECK(hl % 8 == 0);
    const auto h = nlohmann::json::parse(file.substr(8, hl));
    CHECK(fs::status(dir / "b.safetensors").permissions() == (fs::perms::owner_read | fs::perms::owner_write));
    for (size_t i = 0; i < specs.size(); ++i) {
        const auto & e = h.at(specs[i].name);
        CHECK(e.at("dtype") == fd::model::dtype_name(specs[i].dtype));
        CHECK(e.at("shape") == nlohmann::json(specs[i].shape));
        const int64_t b = e.at("data_offsets")[0], end = e.at("data_offsets")[1];
        CHECK(end - b == specs[i].nbytes);
        CHECK(std::memcmp(file.data() + 8 + hl + b, data[i].data(), data[i].size()) == 0);
    }
    CHECK(file.size() == 8 + hl + static_cast<size_t>(specs[0].nbytes + specs[1].nbytes));
    fs::remove_all(dir);
}
