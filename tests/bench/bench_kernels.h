// tests/bench/bench_kernels.h — fd_bench's kernel-level measurements: kernels::linear against
// OpenBLAS sgemm at several row counts, and decode steps at long contexts (the model's linear
// layers plus attention over a paged KV pool), each as ratios against references from the same
// run. Bench code only.
#pragma once

#include "fd/checkpoint/model_config.h"
#include "fd/kernels/backend.h"
#include "fd/kernels/ops.h"
#include "bench_mapping.h"

#include <nlohmann/json.hpp>

#include <chrono>
#include <ctime>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace fd::bench {

using Mapping = MappingOf<float>;  // weights, KV pools, read probes (float elements)

/// CPU seconds used by the whole process so far (all threads).
inline double process_cpu_seconds() {
    timespec t{};
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
    return static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec);
}

/// Runs of one measurement: count, total seconds, best run; best_cpu is the least process CPU
/// time of a run. On one thread, best_cpu is the run time without the time slices other
/// processes took (the machine is shared), so its ratios are steadier than wall time's.
struct Timing {
    int64_t runs     = 0;
    double  total    = 0.0;
    double  best     = 1e300;
    double  best_cpu = 1e300;
    double  mean() const { return total / static_cast<double>(runs); }
};

/// Run fn() until at least `min_s` seconds and `min_runs` runs have passed.
inline Timing time_repeated(double min_s, int64_t min_runs, const std::function<void()> & fn) {
    Timing t;
    while (t.runs < min_runs || t.total < min_s) {
        const auto   t0 = std::chrono::steady_clock::now();
        const double c0 = process_cpu_seconds();
        fn();
        const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        t.total += dt;
        t.best = std::min(t.best, dt);
        t.best_cpu = std::min(t.best_cpu, process_cpu_seconds() - c0);
        ++t.runs;
    }
    return t;
}

/// OpenBLAS sgemm (1 thread) against kernels::linear on 1 thread, out [M, N] = x [M, K] · Wᵀ,
/// W [N, K], for each M in `ms`: GFLOP/s of the best run, fd f32 ÷ OpenBLAS, fd bf16 ÷ fd f32
/// (same values rounded to bf16), largest |fd f32 - OpenBLAS|.
/// One linear layer of a decode step on synthetic f32 weights: w [n_out, n_in].
struct DecodeLinear {
    int64_t n_out = 0, n_in = 0;
    float * w     = nullptr;
};

/// Synthetic f32 weights of every linear layer of a decode step of `c` (per layer qkv, o,
/// gate_up, down; then lm_head when `with_lm_head`), each Arena-aligned in one mapping filled
/// with fixed pseudo-random values. weight_bytes: the f32 bytes the layers read per step.
struct DecodeLinears {
    std::vector<DecodeLinear> lins;
    int64_t                   weight_bytes = 0;
    std::unique_ptr<Mapping>  mem;
};
DecodeLinears make_decode_linears(const fd::model::ModelConfig & c, bool with_lm_head);

/// OpenBLAS's reference for kernels::linear: y[m, n] = a[m, k] · w[n, k]ᵀ (f32, row major; the
/// threads are whatever openblas_set_num_threads last set).
void openblas_linear(float * y, const float * a, const float * w, int64_t m, int64_t n, int64_t k);

nlohmann::ordered_json linear_vs_openblas(const std::vector<int64_t> & ms, int64_t n, int64_t k, double min_s);

/// 1 -> n_threads scaling of kernels::linear (ThreadPool of n_threads) next to OpenBLAS sgemm's
/// own (openblas_set_num_threads), same shapes as linear_vs_openblas, wall time of the best run:
/// per M, GFLOP/s of each at 1 and n threads, each one's scaling (t1 / tn), and fd ÷ OpenBLAS at
/// n threads. What OpenBLAS gains tells what the machine allows. OpenBLAS is left at 1 thread.
nlohmann::ordered_json linear_thread_scaling(const std::vector<int64_t> & ms, int64_t n, int64_t k, int n_threads,
                                             double min_s);

/// Decode steps of B tokens at context `ctx` on the model's shapes with f32 weights, for each
/// (B, ctx): every linear layer (LM head included) plus attention of every layer over a paged
/// KV pool of B sequences of ctx tokens (synthetic values). Bytes read per step = streamed
/// weight bytes + KV bytes (B * ctx * kv_dim * 2 * 4 * n_layers); reported as GB/s and as a
/// ratio to `read_bw_gbs`. Layers share one KV pool when distinct pools would pass
/// `kv_budget_bytes` (each pool is then still far larger than the caches). With
/// `read_bw_cpu_gbs` > 0 (the probe's best by thread CPU time) the same bytes per process CPU
/// second are reported against it too (`ratio_vs_read_bw_cpu`; meaningful at 1 thread).
/// Each (B, ctx) runs once per KV dtype of `kv_dtypes` (f32: 4 bytes per element, bf16: 2; the
/// KV bytes above scale with it). Per entry also: `kv_ratio_vs_read_bw` = (KV bytes / attention
/// time) ÷ read_bw_gbs, the attention's share of the bandwidth; and for bf16 after an f32 run of
/// the same (B, ctx): `step_vs_f32_kv` and `attention_vs_f32_kv`, the time ratios (issue 28).
/// `block_size`: tokens per KV block (the daemon's --block-size; a power of two >= 16), each
/// sequence's blocks interleaved with the others' as a busy KvCache hands them out.
/// `compute`: the linears' arithmetic (--compute-dtype): f32 on f32 weights (kernels::linear), or
/// bf16 on bf16 weights (kernels::linear_bf16; a bf16 model, or f32 weights rounded at load: half
/// the weight bytes). Each entry names its `compute_dtype`.
nlohmann::ordered_json decode_contexts(const fd::model::ModelConfig & c, const std::vector<int> & batches,
                                       const std::vector<int> & ctxs, int n_threads, double read_bw_gbs,
                                       double min_s, int64_t kv_budget_bytes, double read_bw_cpu_gbs = 0.0,
                                       const std::vector<fd::kernels::WType> & kv_dtypes = {fd::kernels::WType::f32},
                                       int32_t block_size = 16, fd::kernels::ComputeType compute = fd::kernels::ComputeType::f32);

}  // namespace fd::bench
