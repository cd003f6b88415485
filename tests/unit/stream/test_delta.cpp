// Delta tensors of a weight stream (daemon/src/stream/delta.cpp): the scatter of (indices,
// values) into the base's copy for both index widths and both element sizes, from a payload at
// any alignment; every refusal (out of range, negative, unsorted, duplicated, non-finite) names
// the tensor and position and leaves the destination untouched.
#include "../../../daemon/src/stream/stream_io.h"

#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

using fd::model::DType;
using fd::stream::TensorSpec;

namespace {

/// The wire payload of a delta: indices (Index) then values (Elem), starting `shift` bytes into
/// the returned buffer (a frame's bytes may sit at any alignment).
template <class Index, class Elem>
std::vector<std::byte> payload(const std::vector<Index> & idx, const std::vector<Elem> & vals, size_t shift) {
    std::vector<std::byte> out(shift + idx.size() * sizeof(Index) + vals.size() * sizeof(Elem));
    std::memcpy(out.data() + shift, idx.data(), idx.size() * sizeof(Index));
    std::memcpy(out.data() + shift + idx.size() * sizeof(Index), vals.data(), vals.size() * sizeof(Elem));
    return out;
}

TensorSpec spec(DType dt, std::vector<int64_t> shape, int64_t n, int32_t index_bytes) {
    TensorSpec s{.name = "model.layers.0.mlp.down_proj.weight", .dtype = dt, .shape = std::move(shape)};
    s.n_indices   = n;
    s.index_bytes = index_bytes;
    s.nbytes      = n * (index_bytes + fd::model::dtype_size(dt));
    return s;
}

std::string error_of(const TensorSpec & s, const std::vector<std::byte> & p, size_t shift, std::byte * dst) {
    try {
        fd::stream::apply_delta(s, p.data() + shift, dst);
    } catch (const fd::Error & e) {
        return e.what();
    }
    return "";
}

}  // namespace

TEST_SUITE("stream::delta") {
    TEST_CASE("int64 indices scatter f32 values into the base copy, at any alignment") {
        for (size_t shift : {0, 1, 3}) {
            std::vector<float> dst = {0, 1, 2, 3, 4, 5};  // [2, 3]
            const auto p = payload<int64_t, float>({0, 4, 5}, {10.f, -4.5f, 7.f}, shift);
            fd::stream::apply_delta(spec(DType::f32, {2, 3}, 3, 8), p.data() + shift, reinterpret_cast<std::byte *>(dst.data()));
            CHECK(dst == std::vector<float>{10, 1, 2, 3, -4.5f, 7});
        }
    }

    TEST_CASE("int32 indices scatter 2-byte (bf16) values") {
        std::vector<uint16_t> dst = {1, 2, 3, 4};
        const auto p = payload<int32_t, uint16_t>({1, 3}, {0x3f80, 0xc000}, 1);  // bf16 1.0, -2.0
        fd::stream::apply_delta(spec(DType::bf16, {4}, 2, 4), p.data() + 1, reinterpret_cast<std::byte *>(dst.data()));
        CHECK(dst == std::vector<uint16_t>{1, 0x3f80, 3, 0xc000});
    }

    TEST_CASE("an empty delta changes nothing") {
        std::vector<float> dst = {1, 2};
        const std::vector<std::byte> p;
        fd::stream::apply_delta(spec(DType::f32, {2}, 0, 8), p.data(), reinterpret_cast<std::byte *>(dst.data()));
        CHECK(dst == std::vector<float>{1, 2});
    }

    TEST_CASE("bad indices and values are refused naming the tensor and position; the destination is untouched") {
        const std::vector<float> base = {0, 1, 2, 3, 4, 5};
        struct Case { std::vector<int64_t> idx; std::vector<float> vals; const char * words; };
        const float inf = std::numeric_limits<float>::infinity();
        for (const Case & c : {Case{{0, 6}, {1, 1}, "delta index 6 (at position 1) is outside [0, 6)"},
                               Case{{-1, 2}, {1, 1}, "delta index -1 (at position 0) is outside [0, 6)"},
                               Case{{3, 2}, {1, 1}, "index 2 at position 1 follows 3"},
                               Case{{2, 2}, {1, 1}, "index 2 at position 1 follows 2"},
                               Case{{1, 2}, {1, std::nanf("")}, "delta value 1 (of 2) is non-finite"},
                               Case{{1, 2}, {inf, 1}, "delta value 0 (of 2) is non-finite"}}) {
            std::vector<float> dst = base;
            const auto p = payload<int64_t, float>(c.idx, c.vals, 0);
            const std::string msg = error_of(spec(DType::f32, {2, 3}, 2, 8), p, 0, reinterpret_cast<std::byte *>(dst.data()));
            CAPTURE(msg);
            CHECK(msg.find("model.layers.0.mlp.down_proj.weight") != std::string::npos);
            CHECK(msg.find(c.words) != std::string::npos);
            CHECK(dst == base);
        }
    }

    TEST_CASE("spec sizes and index dtype names") {
        const TensorSpec s = spec(DType::bf16, {4, 8}, 3, 4);
        CHECK(s.numel() == 32);
        CHECK(s.full_nbytes() == 64);
        CHECK(s.nbytes == 3 * (4 + 2));
        CHECK(fd::stream::parse_index_dtype_name("I64", "t") == 8);
        CHECK(fd::stream::parse_index_dtype_name("torch.int32", "t") == 4);
        CHECK_THROWS_AS(fd::stream::parse_index_dtype_name("int16", "t"), fd::Error);
    }
}
