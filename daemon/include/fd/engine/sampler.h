// fd/engine/sampler.h — turning one row of logits into a token, reproducibly.
//
// Pure functions of (logits, params, rng state): the same inputs give the same token whatever
// else is batched, which makes per-request seeds reproducible.
#pragma once

#include "fd/engine/request.h"

#include <cstdint>
#include <span>
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

/// vLLM's logits processors (v1 sampler, same order), in place on one row of raw logits, in
/// float32 like vLLM:
///   1. min_tokens: while generated.size() < min_tokens, logits of stop_token_ids and of every
///      `eos_ids` entry (vLLM's all_stop_token_ids: EOS even with ignore_eos) become -inf.
///   2. logit_bias: logits[id] += bias.
///   3. repetition_penalty r, for ids in prompt or generated: logit > 0 ? logit / r : logit * r.
///   4. frequency_penalty f: logits[id] -= f * (occurrences of id in generated).
///   5. presence_penalty p: logits[id] -= p for ids in generated.
/// Logprobs stay those of the raw logits (vLLM's default logprobs mode, raw_logprobs).
/// Shapes  logits [vocab];  prompt [n_prompt];  generated [n_generated];  eos_ids [n_eos]
/// Requires  every id in prompt/generated/logit_bias/stop_token_ids/eos_ids in [0, vocab)
///           (ids outside it are ignored).
void apply_logits_processors(float * logits, int32_t vocab, const SamplingParams & p, std::span<const int32_t> prompt,
                             std::span<const int32_t> generated, std::span<const int32_t> eos_ids);

/// Choose the next token.
///   temperature == 0: argmax (lowest id on ties).
///   else: softmax(logits / T) restricted to the tokens whose probability is at least min_p
///   times the most likely one's (vLLM's min_p, applied first as vLLM's sampler does), then to
///   the top_k highest, then to the smallest set whose probability reaches top_p of what is left
///   (candidates ordered by logit desc, id asc), sampled by inverse CDF with one draw from `rng`.
/// Shapes  logits [vocab]
int32_t sample_token(const float * logits, int32_t vocab, const SamplingParams & p, SeqRng & rng);

/// Verify one draft token at a drafted position: the rejection sampler for a deterministic draft
/// (q = delta(draft)), coupled with the plain sampler. The target's token t = sample_token(logits,
/// vocab, p, rng) is drawn exactly as a run without speculation draws it (one rng draw when
/// temperature > 0, none when greedy); the draft is accepted iff t == draft. So the draft is
/// accepted with probability p(draft) under every sampling filter (temperature, min_p, top-k,
/// top-p; `logits` already processed: penalties, logit_bias, min_tokens), and on a rejection
/// t is distributed as p with the draft removed and renormalised (the inverse-CDF draw,
/// conditioned on missing the draft's interval) — the target distribution exactly. With the
/// same rng state the token equals the one a run without speculation samples: a seeded request
/// gives the same tokens with and without --speculative-config.
/// Shapes  logits [vocab]
struct DraftVerdict {
    int32_t token    = 0;      ///< the target's token at this position (= draft when accepted)
    bool    accepted = false;
};
DraftVerdict verify_draft_token(const float * logits, int32_t vocab, const SamplingParams & p, SeqRng & rng, int32_t draft);

/// Log-probabilities of `id` and the top `k` tokens under log_softmax(logits); rank of `id` =
/// number of tokens whose logprob is >= its own (vLLM's rank: 1 = the most likely).
/// Shapes  logits [vocab];  scratch [vocab] (overwritten)
TokenLogprob token_logprobs(const float * logits, int32_t vocab, int32_t id, int32_t k, std::vector<float> & scratch);

}  // namespace fd::engine
