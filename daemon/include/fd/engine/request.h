// fd/engine/request.h — what a client asks for and how results travel back.
//
// A completion request becomes one Sequence per choice (prompt x n). All choices of a request
// share one ResultChannel: the engine thread pushes ChoiceEvents, the HTTP layer pops them
// (woken by the channel's notify callback, or waiting in pop_all).
// Per-request failures travel as data (ChoiceEvent::error), never as exceptions across threads.
#pragma once

#include "fd/status.h"

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

namespace fd::engine {

struct SamplingParams {
    int32_t                  max_tokens     = 16;     ///< 0 = score the prompt only (needs prompt_logprobs >= 0)
    float                    temperature    = 1.0f;   ///< 0 = greedy
    float                    top_p          = 1.0f;   ///< (0, 1]
    int32_t                  top_k          = 0;      ///< 0 or -1 = off
    float                    min_p          = 0.0f;   ///< [0, 1]; 0 = off: drop tokens less likely than min_p x the most likely
    std::optional<uint64_t>  seed;                    ///< per-request; choice i uses a stream derived from (seed, i)
    std::vector<std::string> stop;                    ///< stop strings (excluded from the text)
    std::vector<int32_t>     stop_token_ids;          ///< extra stop ids (included in token_ids)
    bool                     ignore_eos     = false;
    int32_t                  logprobs       = -1;     ///< -1 = none; k >= 0 = chosen token + top k
    bool                     skip_special_tokens           = true;  ///< drop special tokens from the text
    bool                     spaces_between_special_tokens = true;  ///< see fd::tokenizer::DecodeOptions
    // vLLM's fields; applied to the logits before sampling, in vLLM's order (sampler.h).
    int32_t                  prompt_logprobs = -1;    ///< -1 = none; k >= 0 = each prompt token + top k
    int32_t                  min_tokens      = 0;     ///< stop ids/EOS masked and stops ignored before this many tokens
    float                    repetition_penalty = 1.0f;  ///< > 0; 1 = off; prompt and generated tokens
    float                    presence_penalty   = 0.0f;  ///< [-2, 2]; generated tokens
    float                    frequency_penalty  = 0.0f;  ///< [-2, 2]; generated tokens, per occurrence
    std::vector<std::pair<int32_t, float>> logit_bias;   ///< (token id, bias in [-100, 100]) added to the logits
    bool                     include_stop_str_in_output = false;  ///< keep the matched stop string in the text
    bool                     detokenize = true;  ///< false: no text is decoded (vLLM's SamplingParams.detokenize):
                                                 ///< events carry token ids with empty text; needs `stop` empty
    /// R3 (--enable-return-routed-experts; vLLM's / SGLang's return_routed_experts): the finishing
    /// event carries the choice's routed experts. Such a choice skips the prefix cache: every
    /// prompt row is computed, so its routes come from this request's own forward.
    bool                     return_routed_experts = false;

    /// True when any logits processor (min_tokens, logit_bias, penalties) is active.
    bool processes_logits() const {
        return min_tokens > 0 || !logit_bias.empty() || repetition_penalty != 1.0f || presence_penalty != 0.0f || frequency_penalty != 0.0f;
    }
};

/// One sampled token's log-probabilities (natural log, from the raw logits' log_softmax).
struct TokenLogprob {
    int32_t                                id      = 0;
    float                                  logprob = 0.0f;
    int32_t                                rank    = 0;   ///< vLLM's rank: tokens whose logprob is >= this one's (1 = best)
    std::vector<std::pair<int32_t, float>> top;    ///< [k] (id, logprob), best first, ties by id
};

/// What ended a choice with finish_reason "stop" (vLLM's stop_reason): the stop string or the
/// stop token id (stop_token_ids, or a model EOS id other than the tokenizer's); empty for the
/// tokenizer's EOS and for every other finish.
struct StopReason {
    std::optional<std::string> str;
    std::optional<int32_t>     token_id;
};

enum class FinishReason { none, stop, length, abort, error };

/// A choice's routed experts (R3): row t = the token at position t of prompt + generated (the
/// rows the model ran a forward on: the prompt, then every generated token but the last), one run
/// of top_k logical expert ids per sparse MoE layer in layer order, each run in the router's order
/// (descending routing probability; the lower id first among equals).
struct RoutedExperts {
    int32_t              n_layers = 0;  ///< sparse MoE layers
    int32_t              top_k    = 0;  ///< num_experts_per_tok
    std::vector<int32_t> ids;           ///< [n_rows, n_layers, top_k]
    int64_t n_rows() const { return n_layers * top_k > 0 ? static_cast<int64_t>(ids.size()) / (n_layers * top_k) : 0; }
};

/// A run of a choice's generated tokens produced by one weight version (vLLM's idea for
/// requests kept across a weight update). Token indices count generated tokens from 0.
struct VersionSpan {
    std::string version;
    int32_t     first_token = 0;  ///< inclusive
    int32_t     last_token  = 0;  ///< inclusive
};

/// One choice's speculative decoding so far (SGLang's per-request meta_info spec_* counters).
/// A decode step is every target forward that gave the choice tokens after its first (the
/// prefill's): each verifies the drafts proposed for it, none when the proposer had none.
/// SGLang counts a step's accepted drafts as the tokens it gave minus one, so generated tokens
/// = 1 + n_verify + n_accepted (a draft that was the stop token is its step's own token here;
/// vLLM's spec::DraftCounters counts it as accepted).
struct SpecCounts {
    int32_t n_verify       = 0;  ///< decode steps (SGLang's spec_verify_ct)
    int32_t n_draft_tokens = 0;  ///< draft tokens those steps verified (the ones proposed, up to k per step)
    int32_t n_accepted     = 0;  ///< tokens the steps gave past their first each (SGLang's spec_accept_token_num)
};

/// "stop" | "length" | "abort" | "error" | null-equivalent "".
const char * to_string(FinishReason r);

/// One step's output for one choice.
struct ChoiceEvent {
    int32_t                   choice = 0;       ///< index in the response's choices
    std::vector<int32_t>      token_ids;        ///< ids generated this step
    std::vector<TokenLogprob> logprobs;         ///< [token_ids.size()] when requested
    std::vector<int32_t>      text_offsets;     ///< [token_ids.size()] characters (code points) of the
                                                ///< choice's generated text before each token's text
    std::vector<TokenLogprob> prompt_logprobs;  ///< [n_prompt - 1] tokens 1.. of the prompt, on the
                                                ///< choice's first event when prompt_logprobs >= 0
    std::string               text;             ///< newly completed text
    FinishReason              finish = FinishReason::none;
    StopReason                stop_reason;      ///< on the finishing event
    int32_t                   n_prompt_tokens = 0;
    int32_t                   n_cached_tokens = 0;  ///< prompt tokens served from the prefix cache
    int32_t                   n_host_cached_tokens = -1;  ///< of those, from the host KV tier (-1 = no host tier)
    std::string               weight_version;
    std::vector<VersionSpan>  weight_versions;  ///< on the finishing event, only when the choice's tokens
                                                ///< came from more than one version (a keep pause + update)
    std::optional<RoutedExperts> routed_experts;  ///< on the finishing event, when return_routed_experts
    SpecCounts                spec;             ///< the choice's totals so far; all 0 without --speculative-config
    std::optional<Error>      error;
};

/// Single-producer (engine), single-consumer (HTTP handler) queue of events for one request.
class ResultChannel {
public:
    /// `wake_each_event`: wake the reader on every event (streaming); otherwise only on a
    /// choice's finishing event, so non-streaming handlers do not compete for the CPU per token.
    ResultChannel(int32_t n_choices, bool wake_each_event) : n_open_(n_choices), wake_each_(wake_each_event) {}

    void push(ChoiceEvent ev);

    /// Event-driven readers: `fn` runs after each push that would wake a pop_all waiter (every
    /// event when `wake_each_event`, else finishing events), on the pushing thread, outside the
    /// channel's lock; it must not block. Replaces the previous one; empty = none. Events pushed
    /// before it was set do not call it: pop once after setting it.
    void set_notify(std::function<void()> fn);

    /// Pop everything queued, waiting up to `wait` for at least one event.
    std::vector<ChoiceEvent> pop_all(std::chrono::milliseconds wait);

    /// True once every choice has sent its finishing event and all were popped.
    bool done() const;

    /// The answer ended early: the engine drops the sequences at its next step and counts them in
    /// /metrics as finished with `why` (abort: the client went away; error: the client got an
    /// error answer, a timeout or another choice's error). The first call's reason stands.
    void cancel(FinishReason why = FinishReason::abort) {
        int open = kOpen;
        cancel_reason_.compare_exchange_strong(open, static_cast<int>(why));
    }
    bool cancelled() const { return cancel_reason_.load() != kOpen; }
    /// Meaningful once cancelled().
    FinishReason cancel_reason() const { return static_cast<FinishReason>(cancel_reason_.load()); }

private:
    mutable std::mutex       mu_;
    std::condition_variable  cv_;
    std::deque<ChoiceEvent>  q_;
    int32_t                  n_open_;
    bool                     wake_each_;
    static constexpr int     kOpen = -1;
    std::atomic<int>         cancel_reason_{kOpen};  ///< kOpen, or the FinishReason of cancel()
    std::function<void()>    notify_;
};

}  // namespace fd::engine
