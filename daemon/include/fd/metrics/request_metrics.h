// fd/metrics/request_metrics.h — per-request latency histograms and counters for /metrics.
//
// Owned by the Engine; observed on the engine thread (one observation per choice: a request
// with n = 4 counts 4, as vLLM counts its child requests), read by /metrics on HTTP threads.
// Buckets are vLLM's (vllm/v1/metrics/loggers.py) with a few finer bounds below their first
// one, since a CPU engine on a small model answers in milliseconds.
//   time to first token   arrival (Engine::submit) → the choice's first token is sampled
//   inter-token latency   between two consecutive tokens of one choice
//   e2e latency           arrival → the choice's finishing event (stop, length, abort, error)
//   queue time            arrival → the choice is first scheduled
//   prompt tokens         the choice's prompt length, at its finishing event (tokens)
//   generation tokens     tokens the choice generated, at its finishing event (tokens)
#pragma once

#include "fd/metrics/histogram.h"

#include <array>
#include <atomic>
#include <cstdint>

namespace fd::metrics {

/// Seconds. vLLM's TTFT buckets.
inline constexpr std::array<double, 22> kTtftBuckets = {0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
                                                        1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0};
/// Seconds. vLLM's inter-token buckets, with 0.001, 0.0025, 0.005 added below them.
inline constexpr std::array<double, 22> kItlBuckets = {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
                                                       0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0};
/// Seconds. vLLM's request latency buckets (e2e, queue), with 0.001 … 0.1 added below them.
inline constexpr std::array<double, 26> kRequestLatencyBuckets = {0.001, 0.005, 0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0,
                                                                  1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                                                                  50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0};

/// Tokens. vLLM's 1-2-5 token-count buckets (build_1_2_5_buckets), to 500000 instead of up to
/// --max-model-len (the buckets above it stay empty).
inline constexpr std::array<double, 17> kTokenCountBuckets = {1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000,
                                                              10000, 20000, 50000, 100000, 200000};

/// Finish reasons counted by fdrollout_requests_finished_total (FinishReason without `none`).
inline constexpr std::array<const char *, 4> kFinishReasonNames = {"stop", "length", "abort", "error"};

struct RequestMetrics {
    Histogram ttft_s{kTtftBuckets};
    Histogram itl_s{kItlBuckets};
    Histogram e2e_s{kRequestLatencyBuckets};
    Histogram queue_s{kRequestLatencyBuckets};
    Histogram prompt_tokens{kTokenCountBuckets};      ///< per finished choice
    Histogram generation_tokens{kTokenCountBuckets};  ///< per finished choice
    /// Finished choices per reason, indexed like kFinishReasonNames.
    std::array<std::atomic<int64_t>, kFinishReasonNames.size()> n_finished{};
};

}  // namespace fd::metrics
