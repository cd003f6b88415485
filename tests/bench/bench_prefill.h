// tests/bench/bench_prefill.h — fd_bench's prefill profile (issue #14, 1 → 2 thread scaling):
// where a prefill's time goes per op class at each thread count, and what two threads give a
// well-tuned sgemm on the same machine (the hardware reference). Bench code only.
#pragma once

#include "fd/checkpoint/model_config.h"

#include <nlohmann/json.hpp>

#include <cstdint>
#include <vector>

namespace fd::bench {

/// One prefill of L tokens (one sequence, logits for the last token only) for each L of `lens`,
/// on the model's shapes with synthetic f32 weights, run through a CPU backend of each thread
/// count of `threads`: the very op calls of Worker::forward (daemon/src/model/forward.cpp, tp 1)
/// in the same order, each timed. Per (L, thread count): the median over runs (>= 3, >= min_s
/// seconds) of each op class's milliseconds — embedding, rms_norm, qkv_split (copy_rows), rope,
/// kv_store, attention, linear_{qkv,o,gate_up,down}, silu_mul, residual_add, lm_head (gather,
/// final norm, head) — and of the whole forward; the pool's parallel_for count and the caller's
/// wait at its barriers (ThreadPool::Stats), and the process CPU time of the forward (its
/// ÷ threads estimates the forward's wall time on an otherwise idle machine, since the pool's
/// threads spin while they wait; cpu_time_scaling_estimate). Per op class: its share of the forward at each
/// thread count and its scaling (ms at the first count ÷ ms at each other). Also the pool's
/// hand-off cost: an empty parallel_for of n_threads tasks back to back ("hot") and after 2 ms
/// idle ("cold"), median microseconds.
nlohmann::ordered_json prefill_profile(const fd::model::ModelConfig & c, const std::vector<int> & lens,
                                       const std::vector<int> & threads, double min_s);

/// The hardware reference for thread scaling: OpenBLAS sgemm (pthreads build,
/// openblas_set_num_threads) on the model's four per-layer linear shapes at M = `m` rows
/// (qkv, o, gate_up, down: out [m, N] = x [m, K] · Wᵀ), at each count of `threads`, against
/// kernels::linear on a ThreadPool of the same count. Per count: best seconds of each shape
/// (>= 3 runs), their sum as GFLOP/s, and the scaling vs the first count for both; fd's scaling
/// ÷ OpenBLAS's. Leaves OpenBLAS at 1 thread (and waits out its threads' spin) on return.
nlohmann::ordered_json sgemm_thread_scaling(const fd::model::ModelConfig & c, int64_t m, const std::vector<int> & threads,
                                            double min_s);

}  // namespace fd::bench
