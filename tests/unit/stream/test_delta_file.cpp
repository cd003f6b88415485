// A delta update's bytes as the stream keeps them (daemon/src/stream/delta.cpp, staging_dir.cpp):
// check_delta_bytes checks a delta where it lies (int32 or int64 indices, at any alignment) with
// the refusals apply_delta makes, and stream::DeltaFile — the received bytes appended as they came,
// the header written into its reserved room at the seal — is a weights.fddelta file that
// weights::read_weight_delta, map_weight_delta and read_weight_delta_into (the ranks' copy into a
// kept buffer) read back tensor for tensor.
#include "../../../daemon/src/stream/stream_io.h"
#include "fd/arena.h"
#include "fd/weights/weight_delta.h"

#include <doctest/doctest.h>

#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <limits>
#include <vector>

using fd::model::DType;
using fd::stream::TensorSpec;
namespace fs = std::filesystem;

namespace {

template <class Index, class Elem>
std::vector<std::byte> payload(const std::vector<Index> & idx, const std::vector<Elem> & vals, size_t shift) {
    std::vector<std::byte> out(shift + idx.size() * sizeof(Index) + vals.size() * sizeof(Elem));
    std::memcpy(out.data() + shift, idx.data(), idx.size() * sizeof(Index));
    std::memcpy(out.data() + shift + idx.size() * sizeof(Index), vals.data(), vals.size() * sizeof(Elem));
    return out;
}

TensorSpec spec(const std::string & name, DType dt, std::vector<int64_t> shape, int64_t n, int32_t index_bytes) {
    TensorSpec s{.name = name, .dtype = dt, .shape = std::move(shape)};
    s.n_indices   = n;
    s.index_bytes = index_bytes;
    s.nbytes      = n * (index_bytes + fd::model::dtype_size(dt));
    return s;
}

template <class Index>
std::string error_of(const std::vector<Index> & idx, const std::vector<float> & vals, size_t shift) {
    const auto p = payload<Index, float>(idx, vals, shift);
    try {
        fd::stream::check_delta_bytes(spec("w", DType::f32, {64}, static_cast<int64_t>(idx.size()), sizeof(Index)), p.data() + shift);
    } catch (const fd::Error & e) {
        return e.what();
    }
    return "";
}

/// A fresh directory under /tmp, removed with everything in it at the end of the test.
struct TempDir {
    fs::path path;
    TempDir() {
        char tmpl[] = "/tmp/fd-delta-file-XXXXXX";
        REQUIRE(::mkdtemp(tmpl) != nullptr);
        path = tmpl;
    }
    ~TempDir() {
        std::error_code ec;
        fs::remove_all(path, ec);
    }
};

}  // namespace

TEST_CASE("check_delta_bytes refuses what apply_delta refuses, for int32 and int64 indices at any alignment") {
    const float inf = std::numeric_limits<float>::infinity();
    std::vector<int64_t> ok(40);
    for (int64_t k = 0; k < 40; ++k) { ok[static_cast<size_t>(k)] = k + 1; }
    std::vector<float> vals(40, 1.0f);
    std::vector<float> nan_at_37 = vals;
    nan_at_37[37] = std::nanf("");
    for (size_t shift : {0, 1, 3}) {
        CAPTURE(shift);
        CHECK(error_of<int64_t>(ok, vals, shift) == "");
        CHECK(error_of<int32_t>(std::vector<int32_t>(ok.begin(), ok.end()), vals, shift) == "");
        CHECK(error_of<int64_t>(ok, nan_at_37, shift).find("delta value 37 (of 40) is non-finite") != std::string::npos);
        CHECK(error_of<int32_t>({0, 64}, {1, 1}, shift).find("delta index 64 (at position 1) is outside [0, 64)") != std::string::npos);
        CHECK(error_of<int32_t>({-1, 2}, {1, 1}, shift).find("delta index -1 (at position 0)") != std::string::npos);
        CHECK(error_of<int64_t>({3, 2}, {1, 1}, shift).find("index 2 at position 1 follows 3") != std::string::npos);
        CHECK(error_of<int32_t>({2, 2}, {1, 1}, shift).find("index 2 at position 1 follows 2") != std::string::npos);
        CHECK(error_of<int32_t>({1, 2}, {inf, 1}, shift).find("delta value 0 (of 2) is non-finite") != std::string::npos);
    }
}

TEST_CASE("a DeltaFile of appended wire bytes, sealed, reads back as the weights.fddelta it names") {
    const TempDir tmp;
    const fs::path file = tmp.path / "weights.fddelta";
    // a: int32 delta of f32; b: a dense bf16 tensor of 3 elements (6 bytes: c starts at an odd
    // multiple of 2); c: int64 delta of f32.
    const auto a = payload<int32_t, float>({1, 5, 9}, {1.5f, -2.0f, 3.25f}, 0);
    const std::vector<uint16_t> b_vals = {0x3f80, 0xc000, 0x4040};
    std::vector<std::byte> b(6);
    std::memcpy(b.data(), b_vals.data(), 6);
    const auto c = payload<int64_t, float>({0, 7}, {4.0f, 5.0f}, 0);
    nlohmann::json entries = nlohmann::json::array();
    entries.push_back({{"name", "a"}, {"dtype", "F32"}, {"shape", {2, 5}}, {"dense", false}, {"n", 3}, {"index_bytes", 4}});
    entries.push_back({{"name", "b"}, {"dtype", "BF16"}, {"shape", {3}}, {"dense", true}, {"n", 3}, {"index_bytes", 4}});
    entries.push_back({{"name", "c"}, {"dtype", "F32"}, {"shape", {8}}, {"dense", false}, {"n", 2}, {"index_bytes", 8}});
    {
        fd::stream::DeltaFile f(file, 4096);
        f.append(a.data(), static_cast<int64_t>(a.size()));
        std::vector<std::byte> bc = b;  // two tensors in one append (one bucket)
        bc.insert(bc.end(), c.begin(), c.end());
        f.append(bc.data(), static_cast<int64_t>(bc.size()));
        CHECK_THROWS_AS(f.seal(std::string(4097, ' ')), fd::Error);  // a header larger than its room
        f.seal(nlohmann::json{{"tensors", entries}}.dump());
    }
    const fd::weights::WeightDelta d = fd::weights::read_weight_delta(file);
    REQUIRE(d.tensors.size() == 3);
    CHECK(d.tensors[0].name == "a");
    CHECK(d.tensors[0].indices == std::vector<int64_t>{1, 5, 9});
    std::vector<float> av(3);
    std::memcpy(av.data(), d.tensors[0].values.data(), 12);
    CHECK(av == std::vector<float>{1.5f, -2.0f, 3.25f});
    CHECK(d.tensors[1].dense);
    CHECK(std::memcmp(d.tensors[1].values.data(), b_vals.data(), 6) == 0);
    CHECK(d.tensors[2].indices == std::vector<int64_t>{0, 7});
    std::vector<float> cv(2);
    std::memcpy(cv.data(), d.tensors[2].values.data(), 8);
    CHECK(cv == std::vector<float>{4.0f, 5.0f});
    const auto m = fd::weights::map_weight_delta(file);
    REQUIRE(m->find("c") != nullptr);
    CHECK(m->find("c")->index(1) == 7);
    CHECK(m->find("a")->index(2) == 9);
    fd::Arena buf("delta file");
    const auto r = fd::weights::read_weight_delta_into(file, buf);
    REQUIRE(r->tensors.size() == m->tensors.size());
    for (size_t i = 0; i < m->tensors.size(); ++i) {  // the same views, over the copy
        const auto & x = r->tensors[i];
        const auto & y = m->tensors[i];
        CAPTURE(y.name);
        CHECK(x.name == y.name);
        CHECK(x.dtype == y.dtype);
        CHECK(x.shape == y.shape);
        CHECK(x.dense == y.dense);
        CHECK(x.n == y.n);
        CHECK(x.index_bytes == y.index_bytes);
        for (int64_t k = 0; !x.dense && k < x.n; ++k) { CHECK(x.index(k) == y.index(k)); }
        CHECK(std::memcmp(x.values, y.values, static_cast<size_t>(x.n * fd::model::dtype_size(x.dtype))) == 0);
        CHECK(x.values >= buf.data());
        CHECK(x.values < buf.data() + buf.capacity_bytes());
    }
}

TEST_CASE("read_weight_delta_into reuses its buffer for a file that fits and grows it for one that does not") {
    const TempDir tmp;
    auto write = [&](const fs::path & file, const std::vector<int32_t> & idx, const std::vector<float> & vals, int64_t numel) {
        const auto bytes = payload<int32_t, float>(idx, vals, 0);
        fd::stream::DeltaFile f(file, 4096);
        f.append(bytes.data(), static_cast<int64_t>(bytes.size()));
        f.seal(nlohmann::json{{"tensors", nlohmann::json::array({nlohmann::json{{"name", "w"}, {"dtype", "F32"}, {"shape", {numel}},
                                                                               {"dense", false}, {"n", static_cast<int64_t>(idx.size())},
                                                                               {"index_bytes", 4}}})}}
                   .dump());
    };
    std::vector<int32_t> big_idx(1 << 20);
    std::vector<float>   big_vals(big_idx.size());
    for (size_t i = 0; i < big_idx.size(); ++i) {
        big_idx[i]  = static_cast<int32_t>(2 * i);
        big_vals[i] = static_cast<float>(i) * 0.5f;
    }
    write(tmp.path / "small.fddelta", {3, 4}, {1.0f, 2.0f}, 8);
    write(tmp.path / "big.fddelta", big_idx, big_vals, int64_t{2} << 20);
    fd::Arena buf("delta file");
    const auto small = fd::weights::read_weight_delta_into(tmp.path / "small.fddelta", buf);
    CHECK(small->find("w")->index(1) == 4);
    const int64_t small_cap = buf.capacity_bytes();
    CHECK(small_cap >= static_cast<int64_t>(fs::file_size(tmp.path / "small.fddelta")));
    {
        const auto big = fd::weights::read_weight_delta_into(tmp.path / "big.fddelta", buf);  // grows (8 MiB of payload)
        CHECK(buf.capacity_bytes() > small_cap);
        CHECK(buf.capacity_bytes() >= static_cast<int64_t>(fs::file_size(tmp.path / "big.fddelta")));
        const auto * w = big->find("w");
        REQUIRE(w != nullptr);
        CHECK(w->n == static_cast<int64_t>(big_idx.size()));
        CHECK(w->index(12345) == 2 * 12345);
        float v = 0;
        std::memcpy(&v, w->values + 4 * 777, 4);
        CHECK(v == 388.5f);
    }
    std::byte * const at = buf.data();
    const int64_t cap    = buf.capacity_bytes();
    const auto again = fd::weights::read_weight_delta_into(tmp.path / "small.fddelta", buf);  // fits: same memory, new bytes
    CHECK(buf.data() == at);
    CHECK(buf.capacity_bytes() == cap);
    CHECK(again->find("w")->index(0) == 3);
    float v = 0;
    std::memcpy(&v, again->find("w")->values + 4, 4);
    CHECK(v == 2.0f);
}

TEST_CASE("read_weight_delta and map_weight_delta refuse a header whose counts do not fit, even where a product would overflow") {
    const TempDir tmp;
    const fs::path file = tmp.path / "weights.fddelta";
    const auto a        = payload<int32_t, float>({1, 5, 9}, {1.5f, -2.0f, 3.25f}, 0);
    const int64_t big   = int64_t{1} << 61;  // big * (8 + 4) wraps to a small number
    const std::vector<nlohmann::json> bad = {
        {{"name", "a"}, {"dtype", "F32"}, {"shape", {big, 4}}, {"dense", false}, {"n", big}, {"index_bytes", 8}},
        {{"name", "a"}, {"dtype", "F32"}, {"shape", {10}}, {"dense", false}, {"n", 4}, {"index_bytes", 4}},   // past the file
        {{"name", "a"}, {"dtype", "F32"}, {"shape", {-2, -5}}, {"dense", false}, {"n", 3}, {"index_bytes", 4}},  // negative dims
        {{"name", "a"}, {"dtype", "F32"}, {"shape", {10}}, {"dense", false}, {"n", 3}, {"index_bytes", 2}},
        {{"name", "a"}, {"dtype", "F32"}, {"shape", {10}}, {"dense", true}, {"n", 3}, {"index_bytes", 4}},
        {{"name", "a"}, {"dtype", "X9"}, {"shape", {10}}, {"dense", false}, {"n", 3}, {"index_bytes", 4}},
    };
    for (const auto & e : bad) {
        fs::remove(file);  // a DeltaFile is created, never reopened
        {
            fd::stream::DeltaFile f(file, 4096);
            f.append(a.data(), static_cast<int64_t>(a.size()));
            f.seal(nlohmann::json{{"tensors", nlohmann::json::array({e})}}.dump());
        }
        CAPTURE(e.dump());
        CHECK_THROWS_AS(fd::weights::read_weight_delta(file), fd::Error);
        CHECK_THROWS_AS(fd::weights::map_weight_delta(file), fd::Error);
        fd::Arena buf("delta file");
        CHECK_THROWS_AS(fd::weights::read_weight_delta_into(file, buf), fd::Error);
    }
    fs::remove(file);
    {  // the same file with a fitting entry reads
        fd::stream::DeltaFile f(file, 4096);
        f.append(a.data(), static_cast<int64_t>(a.size()));
        f.seal(nlohmann::json{{"tensors", nlohmann::json::array({nlohmann::json{
                                              {"name", "a"}, {"dtype", "F32"}, {"shape", {10}}, {"dense", false}, {"n", 3}, {"index_bytes", 4}}})}}
                   .dump());
    }
    CHECK(fd::weights::read_weight_delta(file).tensors.at(0).indices == std::vector<int64_t>{1, 5, 9});
    CHECK(fd::weights::map_weight_delta(file)->find("a")->index(2) == 9);
}
