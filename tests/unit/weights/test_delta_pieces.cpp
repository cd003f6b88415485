// weights::plan_delta_pieces / write_piece / restore_piece (daemon/src/weights/delta_pieces.cpp):
// a rank splitting the mapped HF delta file itself must write exactly the elements and values of
// the share split_delta makes for it (the daemon-side split, the reference), for row parts with a
// shift (q|k stacked), column parts (one window per HF row), an F16 part widened to f32, a dense
// part and a tensor the delta does not touch; restore_piece puts every old byte back; and an
// index out of order in the file is refused before anything of its piece is written.
#include "delta_fixtures.h"
#include "fd/status.h"
#include "fd/weights/delta_pieces.h"
#include "fd/weights/rank_delta.h"

#include <doctest/doctest.h>

#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

namespace fs = std::filesystem;
using fd::weights::DeltaTensor;
using fd::weights::WeightDelta;

namespace {

using fd::test::delta;
using fd::test::part;
using fd::test::tensor;

/// Every tensor of `l` as f32, element e of tensor i = -(1000 i + e) (no delta value is negative).
std::vector<std::vector<float>> shards_of(const fd::model::WeightLayout & l) {
    std::vector<std::vector<float>> s;
    for (size_t i = 0; i < l.tensors.size(); ++i) {
        s.emplace_back(static_cast<size_t>(l.tensors[i].bytes / 4));
        for (size_t e = 0; e < s.back().size(); ++e) { s.back()[e] = -static_cast<float>(1000 * i + e); }
    }
    return s;
}

struct TmpDir {
    fs::path d;
    TmpDir() {
        char tmpl[] = "/tmp/fd-delta-pieces-XXXXXX";
        REQUIRE(::mkdtemp(tmpl) != nullptr);
        d = tmpl;
    }
    ~TmpDir() {
        std::error_code ec;
        fs::remove_all(d, ec);
    }
};

fd::model::WeightLayout layout() {
    fd::model::WeightLayout l;
    l.tp = {1, 2, 1};
    // q|k rows: this rank holds q rows [2, 4) as shard rows [0, 2) and k rows [0, 2) as [2, 4); 4 columns
    l.tensors.push_back(tensor("qk", {4, 4}, {part("q", {4, 4}, 0, 0, 2, 2), part("k", {4, 4}, 0, 2, 2, 0)}));
    // o: HF [3, 5], this rank holds columns [2, 4) of every row
    l.tensors.push_back(tensor("o", {3, 2}, {part("o", {3, 5}, 1, 0, 3, 2)}));
    l.tensors.push_back(tensor("norm", {5}, {part("n", {5}, 0, 0, 5, 0)}));
    l.tensors.push_back(tensor("dense", {2, 3}, {part("d", {2, 3}, 0, 0, 2, 0)}));
    l.tensors.push_back(tensor("untouched", {2}, {part("u", {2}, 0, 0, 2, 0)}));
    return l;
}

WeightDelta the_delta() {
    WeightDelta d;
    d.tensors.push_back(delta("q", {4, 4}, {0, 9, 10, 15}, 10));   // 0 is on the other rank
    d.tensors.push_back(delta("k", {4, 4}, {1, 5, 14}, 20));       // 14 (row 3) is on the other rank
    d.tensors.push_back(delta("o", {3, 5}, {1, 2, 3, 4, 7, 12, 14}, 30));
    d.tensors.push_back(delta("n", {5}, {0, 4}, 0, false, fd::DType::f16));
    d.tensors.push_back(delta("d", {2, 3}, {}, 40, true));
    return d;
}

}  // namespace

TEST_CASE("a rank's pieces of the mapped HF delta write split_delta's share, and restore_piece puts the old bytes back") {
    const fd::model::WeightLayout l = layout();
    const WeightDelta d = the_delta();
    TmpDir tmp;
    fd::weights::write_weight_delta(tmp.d / "weights.fddelta", d);
    const auto m = fd::weights::map_weight_delta(tmp.d / "weights.fddelta");

    // The reference: the daemon-side split applied run by run.
    std::vector<std::vector<float>> want = shards_of(l);
    const fd::weights::RankDelta share = fd::weights::split_delta(d, l);
    int64_t n_ref = 0;
    for (const auto & rt : share.tensors) {
        size_t ti = 0;
        while (l.tensors[ti].name != rt.name) { ++ti; }
        int64_t at = 0;
        for (int64_t r = 0; r < rt.n_runs(); ++r) {
            const int64_t len = rt.run_len(r);
            std::memcpy(want[ti].data() + rt.starts[static_cast<size_t>(r)], rt.values.data() + at * 4, static_cast<size_t>(len * 4));
            at += len;
        }
        n_ref += rt.n_values();
    }

    const fd::weights::DeltaPlan plan = fd::weights::plan_delta_pieces(*m, l);
    CHECK(plan.n_values == n_ref);
    const std::vector<std::vector<float>> before = shards_of(l);
    std::vector<std::vector<float>> got = before;
    std::vector<std::byte> old(static_cast<size_t>(plan.old_bytes));
    for (const auto & p : plan.pieces) {
        fd::weights::write_piece(p, *m, l.tensors[static_cast<size_t>(p.tensor)], reinterpret_cast<std::byte *>(got[static_cast<size_t>(p.tensor)].data()),
                                 old.data());
    }
    CHECK(got == want);
    // By hand: q 9 = (2, 1) → shard 1 takes 11; k 5 = (1, 1) → shard 13 takes 21; o 12 = (2, 2) → shard 4 takes 35;
    // the F16 norm 1 + 1/1024 at element 4; the dense tensor every element; untouched untouched.
    CHECK(got[0][1] == 11.0f);
    CHECK(got[0][13] == 21.0f);
    CHECK(got[1][4] == 35.0f);
    CHECK(got[2][4] == 1.0f + 1.0f / 1024);
    CHECK(got[3] == std::vector<float>{40, 41, 42, 43, 44, 45});
    CHECK(got[4] == before[4]);

    for (size_t i = plan.pieces.size(); i-- > 0;) {
        const auto & p = plan.pieces[i];
        fd::weights::restore_piece(p, *m, l.tensors[static_cast<size_t>(p.tensor)], reinterpret_cast<std::byte *>(got[static_cast<size_t>(p.tensor)].data()),
                                   old.data());
    }
    CHECK(got == before);
}

TEST_CASE("write_piece refuses an index out of order in the file, writing nothing of its piece") {
    fd::model::WeightLayout l;
    l.tp = {0, 1, 1};
    l.tensors.push_back(tensor("w", {4, 4}, {part("w", {4, 4}, 0, 0, 4, 0)}));
    WeightDelta d;
    d.tensors.push_back(delta("w", {4, 4}, {1, 3, 7}, 10));
    TmpDir tmp;
    fd::weights::write_weight_delta(tmp.d / "weights.fddelta", d);
    // Swap the last two indices in the file (3, 7 → 7, 3): its int32 indices follow the header.
    {
        std::fstream f(tmp.d / "weights.fddelta", std::ios::in | std::ios::out | std::ios::binary);
        uint64_t hlen = 0;
        f.seekg(8);
        f.read(reinterpret_cast<char *>(&hlen), 8);
        const int32_t swapped[2] = {7, 3};
        f.seekp(static_cast<std::streamoff>(16 + hlen + 4));
        f.write(reinterpret_cast<const char *>(swapped), sizeof swapped);
    }
    const auto m = fd::weights::map_weight_delta(tmp.d / "weights.fddelta");
    const fd::weights::DeltaPlan plan = fd::weights::plan_delta_pieces(*m, l);
    REQUIRE(plan.pieces.size() == 1);
    std::vector<float> w(16, -1.0f);
    std::vector<std::byte> old(static_cast<size_t>(plan.old_bytes));
    CHECK_THROWS_AS(fd::weights::write_piece(plan.pieces[0], *m, l.tensors[0], reinterpret_cast<std::byte *>(w.data()), old.data()),
                    fd::Error);
    CHECK(w == std::vector<float>(16, -1.0f));
}

TEST_CASE("map_weight_delta refuses a tensor whose values pass the end of the file") {
    WeightDelta d;
    d.tensors.push_back(delta("w", {4, 4}, {1, 3, 7}, 10));
    TmpDir tmp;
    fd::weights::write_weight_delta(tmp.d / "weights.fddelta", d);
    fs::resize_file(tmp.d / "weights.fddelta", fs::file_size(tmp.d / "weights.fddelta") - 4);
    CHECK_THROWS_AS(fd::weights::map_weight_delta(tmp.d / "weights.fddelta"), fd::Error);
}

TEST_CASE("a plan reusing the last plan's storage is the same plan in the same memory, and prefetch_piece changes nothing") {
    const fd::model::WeightLayout l = layout();
    TmpDir tmp;
    fd::weights::write_weight_delta(tmp.d / "big.fddelta", the_delta());
    WeightDelta small;
    small.tensors.push_back(delta("q", {4, 4}, {9}, 50));
    fd::weights::write_weight_delta(tmp.d / "small.fddelta", small);
    std::vector<fd::weights::DeltaPiece> storage;
    for (const char * name : {"big.fddelta", "small.fddelta", "big.fddelta"}) {
        const auto m = fd::weights::map_weight_delta(tmp.d / name);
        const fd::weights::DeltaPlan fresh = fd::weights::plan_delta_pieces(*m, l);
        const size_t cap = storage.capacity();
        const fd::weights::DeltaPiece * at = storage.data();
        fd::weights::DeltaPlan reused = fd::weights::plan_delta_pieces(*m, l, std::move(storage));
        if (cap >= fresh.pieces.size() && cap > 0) { CHECK(reused.pieces.data() == at); }  // the capacity was reused
        REQUIRE(reused.pieces.size() == fresh.pieces.size());
        CHECK(reused.old_bytes == fresh.old_bytes);
        CHECK(reused.n_values == fresh.n_values);
        for (size_t i = 0; i < fresh.pieces.size(); ++i) {
            CHECK(reused.pieces[i].tensor == fresh.pieces[i].tensor);
            CHECK(reused.pieces[i].k0 == fresh.pieces[i].k0);
            CHECK(reused.pieces[i].k1 == fresh.pieces[i].k1);
            CHECK(reused.pieces[i].shift == fresh.pieces[i].shift);
            CHECK(reused.pieces[i].old_at == fresh.pieces[i].old_at);
        }
        std::vector<std::vector<float>> shards = shards_of(l);  // prefetch_piece is a hint only
        for (const auto & p : reused.pieces) {
            fd::weights::prefetch_piece(p, *m, l.tensors[static_cast<size_t>(p.tensor)],
                                        reinterpret_cast<std::byte *>(shards[static_cast<size_t>(p.tensor)].data()));
        }
        CHECK(shards == shards_of(l));
        storage = std::move(reused.pieces);
    }
}
