// fd/spec/spec_config.h — --speculative-config: which drafts the engine verifies, and how many.
//
// vLLM's flag and field names (SpeculativeConfig): a JSON object
//   {"method": "ngram" | "mtp", "num_speculative_tokens": k,
//    "prompt_lookup_min": n_min, "prompt_lookup_max": n_max, "disable_by_batch_size": b}
// Absent flag (or empty string): no speculation. Speculation never changes what is generated
// (docs/speculative.md): the target verifies every draft token exactly, greedy and sampled.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace fd::spec {

enum class SpecMethod { none, ngram, mtp };

/// "none" | "ngram" | "mtp".
const char * to_string(SpecMethod m);

struct SpeculativeConfig {
    SpecMethod method                 = SpecMethod::none;
    int32_t    num_speculative_tokens = 0;  ///< k: draft tokens per sequence per step, in [1, kMaxSpeculativeTokens]
    int32_t    prompt_lookup_min      = 0;  ///< ngram: shortest suffix n-gram to match, >= 1
    int32_t    prompt_lookup_max      = 0;  ///< ngram: longest suffix n-gram tried first, >= prompt_lookup_min
    /// vLLM's speculative_disable_by_batch_size: a step with more running sequences than this
    /// verifies no drafts (large batches are compute-bound; drafts only add rows). 0 = never off.
    /// Absent from the JSON: kDefaultDisableByBatchSize (vLLM: never off).
    int32_t    disable_by_batch_size  = 0;

    bool enabled() const { return method != SpecMethod::none; }
};

/// Drafts per step above which a config is refused as absurd (each draft is a logits row of
/// vocab floats per sequence; acceptance decays geometrically with the draft position).
inline constexpr int32_t kMaxSpeculativeTokens = 32;
/// disable_by_batch_size when the config does not set it. Measured (docs/benchmarks.md,
/// "Speculative decoding"): on the CPU backend a 110M model gains 2.6-2.8x at B=1 but loses
/// 42 % at B=64 with k=3; above ~8 running sequences a CPU step is compute-bound. GPU
/// deployments, memory-bound to larger batches, should set it (or 0 = never off).
inline constexpr int32_t kDefaultDisableByBatchSize = 8;
/// vLLM's default n-gram window when neither bound is given.
inline constexpr int32_t kDefaultPromptLookup = 5;

/// Parse --speculative-config. An empty string (or "{}") is no speculation. Every problem is
/// appended to `problems`, each naming the field ("speculative_config.num_speculative_tokens ...");
/// the result is meaningful only when none was appended. Rules: unknown fields or methods are
/// refused; k in [1, 32]; ngram: prompt_lookup_min/max >= 1, min <= max (one given: the other
/// takes its value; none: both 5, as vLLM); disable_by_batch_size >= 0 (absent: 8); mtp needs a checkpoint with next-token-prediction
/// layers (`model_mtp_layers` = ModelConfig::n_mtp_layers, MiMo's num_nextn_predict_layers).
SpeculativeConfig parse_speculative_config(const std::string & json, int32_t model_mtp_layers, std::vector<std::string> & problems);

}  // namespace fd::spec
