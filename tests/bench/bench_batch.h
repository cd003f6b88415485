// tests/bench/bench_batch.h — synthetic step batches for the forward benches (fd_bench,
// fd_tp_bench, fd_executor_bench, fd_nnodes_bench, fd_gpu_bench) and the graph-step tests
// (tests/model/graph_test_util.h): deterministic token ids and the StepBatch rows Engine::step() would build.
// Header-only; bench code only.
#pragma once

#include "fd/kv/kv_cache.h"
#include "fd/model/worker.h"

#include <cstdint>
#include <vector>

namespace fd::bench {

/// A fixed pseudo-random token id in [0, vocab) for position `pos` of sequence `seq`.
inline int32_t token_id(int64_t seq, int64_t pos, int32_t vocab) {
    return static_cast<int32_t>((seq * 131 + pos * 7 + 3) % vocab);
}

/// Append the tokens [pos0, pos0 + n) of `seq` to `b` as Engine::step() does (slots and attention
/// context from `seq`'s block table in `kv`); with `want_logits`, the last one's logits are asked for.
inline void add_tokens(fd::model::StepBatch & b, const fd::kv::KvCache & kv, int64_t seq, int32_t pos0, int32_t n,
                       int32_t vocab, bool want_logits = true) {
    const int32_t bs    = kv.block_size();
    const auto &  table = kv.block_table(seq);
    for (int32_t j = 0; j < n; ++j) {
        const int32_t pos = pos0 + j;
        b.tokens.push_back(token_id(seq, pos, vocab));
        b.positions.push_back(pos);
        b.slots.push_back(static_cast<int64_t>(table[pos / bs]) * bs + pos % bs);
        b.queries.push_back({table.data(), pos + 1});
    }
    if (want_logits) { b.logits_rows.push_back(static_cast<int32_t>(b.tokens.size()) - 1); }
}

/// One decode step of `n_seqs` sequences at position `pos` (a graph-eligible step: one token per
/// sequence, every row's logits asked for). Sequence s owns blocks [s * blocks_per_seq,
/// (s + 1) * blocks_per_seq) of `table` and reads token (s * 7 + pos * 13 + 1) % vocab.
inline void add_decode_step(fd::model::StepBatch & b, const int32_t * table, int32_t n_seqs, int32_t blocks_per_seq,
                            int32_t block_size, int32_t pos, int32_t vocab) {
    for (int32_t s = 0; s < n_seqs; ++s) {
        const int32_t * t = table + static_cast<size_t>(s) * blocks_per_seq;
        b.tokens.push_back((s * 7 + pos * 13 + 1) % vocab);
        b.positions.push_back(pos);
        b.slots.push_back(int64_t{t[pos / block_size]} * block_size + pos % block_size);
        b.queries.push_back({t, pos + 1});
        b.logits_rows.push_back(s);
    }
}

/// `n_seqs` sequences of `ctx` tokens in blocks of 16: one decode token each (at position ctx-1).
struct DecodeBatch {
    std::vector<std::vector<int32_t>> tables;
    fd::model::StepBatch b;
    DecodeBatch(int32_t n_seqs, int32_t ctx) {
        const int32_t bs = 16, per = (ctx + bs - 1) / bs;
        tables.resize(n_seqs);
        for (int32_t s = 0; s < n_seqs; ++s) {
            for (int32_t k = 0; k < per; ++k) { tables[s].push_back(s * per + k); }
        }
        for (int32_t s = 0; s < n_seqs; ++s) {
            const int32_t pos = ctx - 1;
            b.tokens.push_back(1 + (s * 7) % 200);
            b.positions.push_back(pos);
            b.slots.push_back(static_cast<int64_t>(tables[s][pos / bs]) * bs + pos % bs);
            b.queries.push_back({tables[s].data(), ctx});
            b.logits_rows.push_back(s);
        }
    }
};

}  // namespace fd::bench
