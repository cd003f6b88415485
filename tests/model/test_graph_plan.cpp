// The graph-step plan (daemon/src/model/graph_plan.cpp): the bucket list for --max-num-seqs, the
// bucket a step of n rows pads to, which steps qualify (decode: one row per sequence, every row's
// logits in order), and the padded step's rows.
#include "fd/model/graph_plan.h"

#include <doctest/doctest.h>

#include <vector>

using namespace fd;
using fd::model::StepBatch;

namespace {

/// n decode rows, sequence i at position 5 + i with its own table.
StepBatch decode_rows(int32_t n, const std::vector<std::vector<int32_t>> & tables) {
    StepBatch b;
    for (int32_t i = 0; i < n; ++i) {
        b.tokens.push_back(10 + i);
        b.positions.push_back(5 + i);
        b.slots.push_back(100 + i);
        b.queries.push_back({tables[static_cast<size_t>(i)].data(), 6 + i});
        b.logits_rows.push_back(i);
    }
    return b;
}

}  // namespace

TEST_CASE("graph_buckets: powers of two below --max-num-seqs, then --max-num-seqs itself") {
    CHECK(model::graph_buckets(64) == std::vector<int32_t>{1, 2, 4, 8, 16, 32, 64});
    CHECK(model::graph_buckets(100) == std::vector<int32_t>{1, 2, 4, 8, 16, 32, 64, 100});
    CHECK(model::graph_buckets(256) == std::vector<int32_t>{1, 2, 4, 8, 16, 32, 64, 128, 256});
    CHECK(model::graph_buckets(3) == std::vector<int32_t>{1, 2, 3});
    CHECK(model::graph_buckets(1) == std::vector<int32_t>{1});
    CHECK(model::graph_buckets(0).empty());
}

TEST_CASE("graph_bucket_index: the smallest bucket that holds n rows, -1 outside") {
    const auto b = model::graph_buckets(100);
    CHECK(model::graph_bucket_index(b, 0) == -1);
    CHECK(model::graph_bucket_index(b, 1) == 0);
    CHECK(model::graph_bucket_index(b, 2) == 1);
    CHECK(model::graph_bucket_index(b, 3) == 2);   // -> 4
    CHECK(model::graph_bucket_index(b, 8) == 3);
    CHECK(model::graph_bucket_index(b, 65) == 7);  // -> 100
    CHECK(model::graph_bucket_index(b, 100) == 7);
    CHECK(model::graph_bucket_index(b, 101) == -1);
}

TEST_CASE("is_graph_step: decode steps only (one row per sequence, every row's logits in order)") {
    const std::vector<std::vector<int32_t>> tables(8, std::vector<int32_t>{0, 1, 2, 3});
    StepBatch b = decode_rows(3, tables);
    CHECK(model::is_graph_step(b, 8, 64));
    CHECK_FALSE(model::is_graph_step(b, 2, 64));  // more rows than the largest bucket
    CHECK_FALSE(model::is_graph_step(b, 8, 7));   // a context longer than the fixed tables
    CHECK_FALSE(model::is_graph_step(StepBatch{}, 8, 64));
    StepBatch missing = b;  // a row without logits (a prefill's inner token)
    missing.logits_rows.pop_back();
    CHECK_FALSE(model::is_graph_step(missing, 8, 64));
    StepBatch swapped = b;  // rows out of order
    std::swap(swapped.logits_rows[0], swapped.logits_rows[1]);
    CHECK_FALSE(model::is_graph_step(swapped, 8, 64));
    StepBatch prefill = b;  // two rows of one sequence (a 2-token prefill chunk with prompt logprobs)
    prefill.queries[2].block_table = prefill.queries[1].block_table;
    CHECK_FALSE(model::is_graph_step(prefill, 8, 64));
}

TEST_CASE("pad_graph_step: real rows first and unchanged, padding rows on the scratch slot, all logits") {
    const std::vector<std::vector<int32_t>> tables(8, std::vector<int32_t>{0, 1, 2, 3});
    const int32_t scratch_table[1] = {64};
    const StepBatch b = decode_rows(3, tables);
    StepBatch p;
    model::pad_graph_step(b, 8, 64 * 16, scratch_table, &p);
    REQUIRE(p.n_tokens() == 8);
    for (size_t i = 0; i < 3; ++i) {
        CHECK(p.tokens[i] == b.tokens[i]);
        CHECK(p.positions[i] == b.positions[i]);
        CHECK(p.slots[i] == b.slots[i]);
        CHECK(p.queries[i].block_table == b.queries[i].block_table);
        CHECK(p.queries[i].n_ctx == b.queries[i].n_ctx);
    }
    for (size_t i = 3; i < 8; ++i) {
        CHECK(p.tokens[i] == 0);
        CHECK(p.positions[i] == 0);
        CHECK(p.slots[i] == 64 * 16);
        CHECK(p.queries[i].block_table == scratch_table);
        CHECK(p.queries[i].n_ctx == 1);
    }
    CHECK(p.logits_rows == std::vector<int32_t>{0, 1, 2, 3, 4, 5, 6, 7});
    // Reused for a smaller step: nothing of the previous one is left.
    model::pad_graph_step(decode_rows(1, tables), 2, 64 * 16, scratch_table, &p);
    CHECK(p.n_tokens() == 2);
    CHECK(p.tokens == std::vector<int32_t>{10, 0});
    CHECK(p.slots == std::vector<int64_t>{100, 64 * 16});
    CHECK(p.logits_rows == std::vector<int32_t>{0, 1});
    // An all-padding step (what the Worker captures).
    model::pad_graph_step(StepBatch{}, 4, 7, scratch_table, &p);
    CHECK(p.slots == std::vector<int64_t>{7, 7, 7, 7});
}
