// engine_sequence.h — the engine's Sequence (private to daemon/src/engine): one choice of one
// request, as engine.cpp (steps), engine_choices.cpp (admission, events), engine_spec.cpp (drafts) see it.
#pragma once

#include "fd/engine/engine.h"
#include "fd/engine/sampler.h"
#include "fd/tokenizer/incremental_decoder.h"

#include <chrono>
#include <memory>
#include <string>
#include <vector>

namespace fd::engine {

/// One choice of one request, from admission to its finishing event.
struct Engine::Sequence : SchedSeq {
    int32_t                        choice = 0;
    std::shared_ptr<ResultChannel> channel;
    SamplingParams                 params;
    int32_t                        n_prompt = 0;
    SeqRng                         rng;
    tokenizer::IncrementalDecoder  detok;
    std::string                    text;            ///< generated text so far (stop strings cut off)
    size_t                         n_text_sent = 0; ///< bytes of `text` already sent
    size_t                         stop_holdback = 0;
    int64_t                        n_chars = 0;     ///< code points in `text` (for text_offsets)
    std::vector<TokenLogprob>      prompt_lps;      ///< prompt_logprobs, until the first event carries them
    int32_t                        n_prompt_scored = 0;  ///< prompt rows whose logprobs were taken (prompt token i+1 per row i)
    bool                           prompt_lps_sent = false;
    std::shared_ptr<const std::vector<std::string>> request_ids;  ///< the request's ids (POST /v1/abort)
    std::vector<VersionSpan>       spans;           ///< which weight version produced which generated tokens
    std::vector<int32_t>           routes;          ///< return_routed_experts: [positions computed, route_cols] by position
    /// routes' rows of positions computed before the weights changed under a kept choice: kept
    /// as they are when the recompute prefill runs those positions again with the new weights
    /// (each row names the weights that computed its token's step).
    int64_t                        routes_final = 0;
    std::vector<int32_t>           draft;           ///< this step's draft tokens (n_draft of them granted; never in `tokens`)
    std::vector<int32_t>           layer_drafts;    ///< MTP: the draft layer's tokens after the last step (-1 ends them early)
    SpecCounts                     spec;            ///< with a proposer: decode steps, drafts verified, accepted (events carry it)
    std::chrono::steady_clock::time_point t_arrival{}, t_scheduled{}, t_last_token{};  ///< request metrics

    Sequence(const tokenizer::Tokenizer & tok, const std::vector<int32_t> & prompt, const SamplingParams & p)
        : detok(tok, prompt, {.skip_special_tokens = p.skip_special_tokens,
                              .spaces_between_special_tokens = p.spaces_between_special_tokens}) {}
};

}  // namespace fd::engine
