// Graph-step buckets and padding (see fd/model/graph_plan.h).
#include "fd/model/graph_plan.h"

#include <algorithm>

namespace fd::model {

std::vector<int32_t> graph_buckets(int32_t max_batch) {
    std::vector<int32_t> out;
    for (int64_t b = 1; b < max_batch; b *= 2) { out.push_back(static_cast<int32_t>(b)); }
    if (max_batch >= 1) { out.push_back(max_batch); }
    return out;
}

int32_t graph_bucket_index(const std::vector<int32_t> & buckets, int64_t n) {
    if (n < 1) { return -1; }
    const auto it = std::lower_bound(buckets.begin(), buckets.end(), n);
    return it == buckets.end() ? -1 : static_cast<int32_t>(it - buckets.begin());
}

bool is_graph_step(const StepBatch & b, int64_t max_rows, int32_t max_ctx) {
    const int64_t n = b.n_tokens();
    if (n < 1 || n > max_rows || static_cast<int64_t>(b.logits_rows.size()) != n) { return false; }
    for (int64_t i = 0; i < n; ++i) {
        if (b.logits_rows[static_cast<size_t>(i)] != i) { return false; }
        const int32_t c = b.queries[static_cast<size_t>(i)].n_ctx;
        if (c < 1 || c > max_ctx) { return false; }
    }
    // One row per sequence: distinct block tables (n <= max_rows, a few hundred: a sorted copy).
    thread_local std::vector<const int32_t *> tables;
    tables.clear();
    for (const auto & q : b.queries) { tables.push_back(q.block_table); }
    std::sort(tables.begin(), tables.end());
    return std::adjacent_find(tables.begin(), tables.end()) == tables.end();
}

void pad_graph_step(const StepBatch & b, int32_t bucket, int64_t scratch_slot, const int32_t * scratch_table,
                    StepBatch * out) {
    out->tokens.assign(b.tokens.begin(), b.tokens.end());
    out->positions.assign(b.positions.begin(), b.positions.end());
    out->slots.assign(b.slots.begin(), b.slots.end());
    out->queries.assign(b.queries.begin(), b.queries.end());
    out->tokens.resize(static_cast<size_t>(bucket), 0);
    out->positions.resize(static_cast<size_t>(bucket), 0);
    out->slots.resize(static_cast<size_t>(bucket), scratch_slot);
    out->queries.resize(static_cast<size_t>(bucket), kernels::AttnQuery{scratch_table, 1});
    out->logits_rows.resize(static_cast<size_t>(bucket));
    for (int32_t i = 0; i < bucket; ++i) { out->logits_rows[static_cast<size_t>(i)] = i; }
}

}  // namespace fd::model
