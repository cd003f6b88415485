// weights::merge_weight_deltas (daemon/src/weights/weight_delta.cpp): applying the merged delta
// equals applying the older then the newer one, checked against a plain array the two deltas
// are applied to in turn, for every mix of sparse and dense sides; a dtype or shape change is
// refused.
#include "fd/status.h"
#include "fd/weights/weight_delta.h"

#include <doctest/doctest.h>

#include <cstring>
#include <vector>

using fd::weights::DeltaTensor;
using fd::weights::WeightDelta;

namespace {

constexpr int64_t kN = 12;

/// An F32 tensor "w" [kN]: sparse at `idx` with `vals`, or dense (idx empty, vals all kN).
DeltaTensor tensor(const std::vector<int64_t> & idx, const std::vector<float> & vals, bool dense = false) {
    DeltaTensor t;
    t.name    = "w";
    t.dtype   = fd::DType::f32;
    t.shape   = {kN};
    t.dense   = dense;
    t.indices = idx;
    t.values.resize(vals.size() * 4);
    std::memcpy(t.values.data(), vals.data(), t.values.size());
    return t;
}

/// `base` with `t` applied.
std::vector<float> apply(std::vector<float> base, const DeltaTensor & t) {
    for (int64_t k = 0; k < t.n_values(); ++k) {
        float v;
        std::memcpy(&v, t.values.data() + 4 * k, 4);
        base[static_cast<size_t>(t.dense ? k : t.indices[static_cast<size_t>(k)])] = v;
    }
    return base;
}

void check_merge(const DeltaTensor & older, const DeltaTensor & newer) {
    std::vector<float> base(kN);
    for (int64_t i = 0; i < kN; ++i) { base[static_cast<size_t>(i)] = -1.0f - static_cast<float>(i); }
    const WeightDelta m = fd::weights::merge_weight_deltas(WeightDelta{{older}}, WeightDelta{{newer}});
    REQUIRE(m.tensors.size() == 1);
    const DeltaTensor & t = m.tensors[0];
    if (!t.dense) {
        for (size_t i = 1; i < t.indices.size(); ++i) { CHECK(t.indices[i - 1] < t.indices[i]); }
    }
    CHECK(apply(base, t) == apply(apply(base, older), newer));
}

}  // namespace

TEST_SUITE("weight_delta") {

TEST_CASE("merge_weight_deltas: sparse on sparse, overlapping: the newer value wins, indices stay sorted and unique") {
    check_merge(tensor({0, 3, 5, 9}, {1, 2, 3, 4}), tensor({3, 4, 9, 11}, {10, 20, 30, 40}));
    check_merge(tensor({2}, {1}), tensor({0, 1, 7}, {5, 6, 7}));  // disjoint, newer around older
    check_merge(tensor({}, {}), tensor({6}, {9}));
}

TEST_CASE("merge_weight_deltas: dense sides") {
    std::vector<float> all(kN);
    for (int64_t i = 0; i < kN; ++i) { all[static_cast<size_t>(i)] = 100.0f + static_cast<float>(i); }
    check_merge(tensor({}, all, true), tensor({1, 8}, {7, 8}));   // older dense: newer written over it
    check_merge(tensor({1, 8}, {7, 8}), tensor({}, all, true));   // newer dense replaces
    const WeightDelta m = fd::weights::merge_weight_deltas(WeightDelta{{tensor({}, all, true)}}, WeightDelta{{tensor({1}, {7})}});
    CHECK(m.tensors[0].dense);
}

TEST_CASE("merge_weight_deltas: tensors of one side only are kept; a changed shape is refused") {
    DeltaTensor other = tensor({0}, {1});
    other.name = "v";
    const WeightDelta m = fd::weights::merge_weight_deltas(WeightDelta{{other}}, WeightDelta{{tensor({2}, {3})}});
    REQUIRE(m.tensors.size() == 2);
    CHECK(m.tensors[0].name == "v");
    CHECK(m.tensors[1].name == "w");
    DeltaTensor wide = tensor({2}, {3});
    wide.shape = {kN + 1};
    CHECK_THROWS_AS(fd::weights::merge_weight_deltas(WeightDelta{{tensor({1}, {1})}}, WeightDelta{{wide}}), fd::Error);
}

}  // TEST_SUITE
