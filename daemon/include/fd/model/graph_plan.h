// fd/model/graph_plan.h — which forward steps the Worker runs as captured CUDA graphs
// (--use-cudagraph on cuda), and how such a step is padded to its batch-size bucket.
//
// Buckets (after vLLM's cudagraph_capture_sizes, coarser): 1, 2, 4, 8, 16, ... (powers of two)
// below the largest, then the largest itself = --max-num-seqs. E.g. max 64: 1 2 4 8 16 32 64;
// max 100: 1 2 4 8 16 32 64 100. A graph step of n rows runs the graph of the smallest bucket
// >= n; rows n..bucket-1 are PADDING rows: token 0 at position 0, writing their K/V to the
// Worker's scratch slot (a KV block the block manager never hands out) and attending to it
// alone; their logits are computed and ignored. Every op is batch-invariant, so a padded row
// changes no real row's result (bitwise).
//
// A graph step is a decode step: every row asks for logits, in row order (logits_rows = 0..n-1),
// each row is one sequence (pairwise distinct block tables), 1 <= n <= the largest bucket.
// Prefill and mixed steps (several tokens of one sequence, or rows without logits) run eagerly,
// as vLLM does.
#pragma once

#include "fd/model/worker.h"

#include <cstdint>
#include <vector>

namespace fd::model {

/// The buckets for a largest batch of `max_batch` rows (see above), ascending; empty when
/// max_batch < 1.
std::vector<int32_t> graph_buckets(int32_t max_batch);

/// Index in `buckets` (ascending) of the smallest bucket >= n, or -1 when n < 1 or n exceeds
/// the largest.
int32_t graph_bucket_index(const std::vector<int32_t> & buckets, int64_t n);

/// True when `b` is a decode step as defined above with at most `max_rows` rows whose contexts
/// each fit in `max_ctx` tokens (n_ctx in [1, max_ctx]).
bool is_graph_step(const StepBatch & b, int64_t max_rows, int32_t max_ctx);

/// `out` = `b` padded to `bucket` rows (bucket >= b.n_tokens(); b may be empty): the real rows
/// first, unchanged, then padding rows (token 0, position 0, slot `scratch_slot`, query
/// {scratch_table, 1}); logits_rows = 0..bucket-1. `out`'s vectors are reused (no allocation
/// once grown). `scratch_table` must outlive `out`'s use.
void pad_graph_step(const StepBatch & b, int32_t bucket, int64_t scratch_slot, const int32_t * scratch_table,
                    StepBatch * out);

}  // namespace fd::model
