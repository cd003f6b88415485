// fd_gpu_bench's decode section (scripts/gpu_check.sh): decode tok/s of a Worker on cuda at
// B = 1, 64, 256, with CUDA graphs (WorkerConfig::graph_max_batch = 256) and without.
#pragma once

#include <nlohmann/json.hpp>

#include <filesystem>

namespace fd::bench {

/// Loads the checkpoint at `model_dir` twice on CUDA device 0 (eager Worker, then a graph Worker
/// capturing buckets up to 256), and times decode steps (one token per sequence, contexts of
/// 1..128 tokens, logits downloaded every step as the engine does) for `seconds` per point.
/// JSON: per point batch, graphs, tok_per_s, step_seconds; per mode construction seconds; at
/// B = 1 the weight bytes/s ÷ `memcpy_rw_bytes_per_s` (the same run's device memcpy); the
/// graph ÷ eager tok/s ratio per batch.
/// Errors  std::exception from loading or a CUDA failure (the caller prints {"error": ...}).
nlohmann::json decode_bench(const std::filesystem::path & model_dir, double memcpy_rw_bytes_per_s, double seconds);

}  // namespace fd::bench
