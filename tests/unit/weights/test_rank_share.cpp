// weights::write_rank_share (daemon/src/weights/rank_delta.cpp): one rank's share written straight
// from the delta into the file must be the bytes write_rank_delta(split_delta(...)) writes, for
// row-range parts with a shift (q|k stacked), column-range parts (one window per HF row), an F16
// part widened to f32, a dense part (runs) and a tensor the delta does not touch; and its starts
// are the HF indices mapped by hand below (row r, column c of the HF tensor → the shard's).
#include "delta_fixtures.h"
#include "fd/status.h"
#include "fd/weights/rank_delta.h"

#include <doctest/doctest.h>

#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

namespace fs = std::filesystem;
using fd::weights::DeltaTensor;
using fd::weights::WeightDelta;

namespace {

using fd::test::delta;
using fd::test::part;
using fd::test::tensor;

std::string slurp(const fs::path & p) {
    std::ifstream f(p, std::ios::binary);
    return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}

}  // namespace

TEST_CASE("write_rank_share writes split_delta's share byte for byte, its starts mapped from the HF indices") {
    fd::model::WeightLayout l;
    l.tp = {1, 2, 1};
    // q|k rows: this rank holds q rows [2, 4) as shard rows [0, 2) and k rows [0, 2) as [2, 4); 4 columns
    l.tensors.push_back(tensor("qk", {4, 4}, {part("q", {4, 4}, 0, 0, 2, 2), part("k", {4, 4}, 0, 2, 2, 0)}));
    // o: HF [3, 5], this rank holds columns [2, 4) of every row
    l.tensors.push_back(tensor("o", {3, 2}, {part("o", {3, 5}, 1, 0, 3, 2)}));
    l.tensors.push_back(tensor("norm", {5}, {part("n", {5}, 0, 0, 5, 0, fd::DType::f16)}));
    l.tensors.push_back(tensor("dense", {2, 3}, {part("d", {2, 3}, 0, 0, 2, 0)}));
    l.tensors.push_back(tensor("untouched", {2}, {part("u", {2}, 0, 0, 2, 0)}));
    WeightDelta d;
    d.tensors.push_back(delta("q", {4, 4}, {0, 9, 10, 15}, 10));   // 0 is on the other rank
    d.tensors.push_back(delta("k", {4, 4}, {1, 5, 14}, 20));       // 14 (row 3) is on the other rank
    d.tensors.push_back(delta("o", {3, 5}, {1, 2, 3, 4, 7, 12, 14}, 30));
    d.tensors.push_back(delta("n", {5}, {0, 4}, 0, false, fd::DType::f16));
    d.tensors.push_back(delta("d", {2, 3}, {}, 40, true));

    char tmpl[] = "/tmp/fd-rank-share-XXXXXX";
    REQUIRE(::mkdtemp(tmpl) != nullptr);
    const fs::path dir = tmpl;
    struct Cleanup {
        fs::path d;
        ~Cleanup() {
            std::error_code ec;
            fs::remove_all(d, ec);
        }
    } cleanup{dir};  // also when a call below throws
    fd::weights::write_rank_share(dir / "direct", d, l);
    fd::weights::write_rank_delta(dir / "reference", fd::weights::split_delta(d, l));
    CHECK(slurp(dir / "direct") == slurp(dir / "reference"));

    const fd::weights::RankDelta got = fd::weights::read_rank_delta(dir / "direct");
    REQUIRE(got.tensors.size() == 4);
    // q 9 = (2, 1) → shard (0, 1) = 1; q 10 → 2; q 15 = (3, 3) → 7; k 1 = (0, 1) → shard (2, 1) = 9; k 5 = (1, 1) → 13
    CHECK(got.tensors[0].name == "qk");
    CHECK(got.tensors[0].starts == std::vector<int64_t>{1, 2, 7, 9, 13});
    CHECK(got.tensors[0].lens.empty());
    std::vector<float> v(5);
    std::memcpy(v.data(), got.tensors[0].values.data(), 20);
    CHECK(v == std::vector<float>{11, 12, 13, 20, 21});
    // o: 2 = (0, 2) → 0; 3 → 1; 7 = (1, 2) → 2; 12 = (2, 2) → 4; 1, 4, 14 are other columns
    CHECK(got.tensors[1].starts == std::vector<int64_t>{0, 1, 2, 4});
    // norm: F16 widened to f32
    std::vector<float> n(2);
    std::memcpy(n.data(), got.tensors[2].values.data(), 8);
    CHECK(got.tensors[2].dtype == fd::DType::f32);
    CHECK(n == std::vector<float>{1.0f, 1.0f + 1.0f / 1024});
    // dense: one run of 6
    CHECK(got.tensors[3].starts == std::vector<int64_t>{0});
    CHECK(got.tensors[3].lens == std::vector<int64_t>{6});
}
