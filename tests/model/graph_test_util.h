// Helpers of the graph-step tests (tests/model/test_worker_graphs.cpp on the CPU,
// tests/gpu/test_cuda_graph.cpp on CUDA): a decode driver and a copy of the live KV blocks.
#pragma once

#include "../bench/bench_batch.h"
#include "fd/arena.h"
#include "fd/model/worker.h"

#include <doctest/doctest.h>

#include <cstdint>
#include <vector>

namespace fd::test {

/// `n_seqs` sequences decoded together for `steps` steps from position `pos0` (a fresh start at
/// 0: every step is one token per sequence, logits for every row: a graph step). Sequence s owns
/// blocks [s * blocks_per_seq, (s + 1) * blocks_per_seq) and reads teacher-forced tokens
/// (s * 7 + p * 13 + 1) % vocab. Returns every step's logits, concatenated [steps, n_seqs, vocab].
inline std::vector<float> decode_steps(model::Worker & w, int32_t n_seqs, int32_t steps, int32_t block_size,
                                       int32_t blocks_per_seq, int32_t pos0 = 0) {
    const int32_t        vocab = w.config().vocab_size;
    std::vector<int32_t> table(static_cast<size_t>(n_seqs) * blocks_per_seq);
    for (size_t i = 0; i < table.size(); ++i) { table[i] = static_cast<int32_t>(i); }
    std::vector<float> out, logits(static_cast<size_t>(n_seqs) * vocab);
    for (int32_t p = pos0; p < pos0 + steps; ++p) {
        model::StepBatch b;
        bench::add_decode_step(b, table.data(), n_seqs, blocks_per_seq, block_size, p, vocab);
        REQUIRE(w.forward(b, logits.data()));
        out.insert(out.end(), logits.begin(), logits.end());
    }
    return out;
}

/// Every layer's K then V of blocks [0, n_live) (downloaded), from a pool of n_total blocks per
/// layer (n_blocks, plus 1 with graph steps: the scratch block).
inline std::vector<float> live_kv(model::Worker & w, int64_t n_live, int64_t n_total, int32_t block_size) {
    const int64_t kv_dim = w.config().kv_dim(), per = n_live * block_size * kv_dim;
    const int64_t stride = Arena::footprint_floats(n_total * block_size * kv_dim);  // bytes per layer's K (or V)
    const std::byte * base = w.allocator().data(memory::Tag::kv_cache);
    std::vector<float> out(static_cast<size_t>(2 * w.config().n_layers * per));
    for (int64_t i = 0; i < 2 * w.config().n_layers; ++i) {
        w.backend().download(out.data() + i * per, base + i * stride, per * static_cast<int64_t>(sizeof(float)));
    }
    return out;
}

}  // namespace fd::test
