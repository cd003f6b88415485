// fd/engine/sampler.h — turning one row of logits into a token, reproducibly.
//
// Pure functions of (logits, params, rng state): the same inputs give the same token whatever
// else is batched, which makes per-request seeds reproducible.
#pragma once

#include "fd/engine/request.h"

#include <cstdint>
#include <vector>

namespace fd::engine {

/// Counter-based RNG stream for one sequence (SplitMix64, Steele et al. 2014).
struct SeqRng {
    uint64_t state = 0;
    /// Uniform double in [0, 1).
    double next();
    /// Stream for choice `choice` of a request seeded with `seed`.
    static SeqRng from_seed(uint64_t seed, int32_t choice);
};

/// Choose the next token.
///   temperature == 0: argmax (lowest id on ties).
///   else: softmax(logits / T) restricted to the top_k highest, then to the smallest set whose
///   probability reaches top_p (candidates ordered by logit desc, id asc), sampled by inverse CDF
///   with one draw from `rng`.
/// Shapes  logits [vocab]
int32_t sample_token(const float * logits, int32_t vocab, const SamplingParams & p, SeqRng & rng);

/// Log-probabilities of `id` and the top `k` tokens under log_softmax(logits).
/// Shapes  logits [vocab];  scratch [vocab] (overwritten)
TokenLogprob token_logprobs(const float * logits, int32_t vocab, int32_t id, int32_t k, std::vector<float> & scratch);

}  // namespace fd::engine
