// Decode tok/s with and without CUDA graphs (see gpu_decode_bench.h).
#include "gpu_decode_bench.h"

#include "bench_batch.h"

#include "fd/checkpoint/model_config.h"
#include "fd/checkpoint/safetensors.h"
#include "fd/model/worker.h"

#include <chrono>
#include <map>
#include <memory>
#include <vector>

namespace fd::bench {
namespace {

using Clock = std::chrono::steady_clock;

constexpr int32_t kBlock = 16, kBlocksPerSeq = 8, kMaxBatch = 256;  // contexts up to 128 tokens

/// Decode steps of `n` sequences for about `seconds` (after 3 warm-up steps); seconds per step.
double time_decode(model::Worker & w, int32_t n, double seconds) {
    const int32_t        vocab = w.config().vocab_size, max_pos = kBlock * kBlocksPerSeq;
    std::vector<int32_t> table(static_cast<size_t>(n) * kBlocksPerSeq);
    for (size_t i = 0; i < table.size(); ++i) { table[i] = static_cast<int32_t>(i); }
    std::vector<float> logits(static_cast<size_t>(n) * vocab);
    model::StepBatch   b;
    int32_t            pos = 0;
    auto step = [&] {
        b.clear();
        add_decode_step(b, table.data(), n, kBlocksPerSeq, kBlock, pos, vocab);
        w.forward(b, logits.data());
        pos = (pos + 1) % max_pos;
    };
    for (int i = 0; i < 3; ++i) { step(); }
    const auto t0    = Clock::now();
    int64_t    steps = 0;
    while (steps < 5 || std::chrono::duration<double>(Clock::now() - t0).count() < seconds) {
        step();
        ++steps;
    }
    return std::chrono::duration<double>(Clock::now() - t0).count() / static_cast<double>(steps);
}

}  // namespace

nlohmann::json decode_bench(const std::filesystem::path & model_dir, double memcpy_rw_bytes_per_s, double seconds) {
    const auto cfg = model::load_model_config(model_dir);
    const auto idx = model::read_tensor_index(model_dir);
    nlohmann::json points = nlohmann::json::array(), modes;
    std::map<int32_t, double> eager_tps;
    for (const bool graphs : {false, true}) {
        const auto t0 = Clock::now();
        auto w = std::make_unique<model::Worker>(cfg, idx,
                                                 model::WorkerConfig{.device = kernels::DeviceKind::cuda, .reserve_tokens = kMaxBatch,
                                                                     .graph_max_batch = graphs ? kMaxBatch : 0, .n_threads = 4,
                                                                     .block_size = kBlock, .n_blocks = int64_t{kMaxBatch} * kBlocksPerSeq,
                                                                     .max_model_len = kBlock * kBlocksPerSeq});
        modes[graphs ? "graphs" : "eager"] = {{"construct_seconds", std::chrono::duration<double>(Clock::now() - t0).count()},
                                              {"graphs_captured", w->graph_captures()}};
        for (const int32_t n : {1, 64, 256}) {
            const double   s   = time_decode(*w, n, seconds);
            const double   tps = n / s;
            nlohmann::json p   = {{"batch", n}, {"graphs", graphs}, {"tok_per_s", tps}, {"step_seconds", s}};
            if (n == 1) { p["weight_bw_over_memcpy"] = static_cast<double>(w->weight_bytes()) / s / memcpy_rw_bytes_per_s; }
            if (graphs) {
                p["graph_over_eager"] = tps / eager_tps[n];
            } else {
                eager_tps[n] = tps;
            }
            points.push_back(p);
        }
        if (graphs) { modes["graphs"]["graph_steps"] = w->graph_steps(); }
    }
    return {{"model", model_dir.filename().string()}, {"contexts", "1..128 tokens, block 16"}, {"modes", modes}, {"points", points}};
}

}  // namespace fd::bench
