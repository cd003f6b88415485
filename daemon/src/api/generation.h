// Internal to fd::api: what /v1/completions and /v1/chat/completions share — request-field
// checks, the sampling fields, the context-length check, and running a GenerateRequest to a
// JSON body or an SSE stream. Each route only parses its own prompt form and formats its own
// choices.
#pragma once

#include "handlers.h"

#include "fd/engine/request.h"
#include "fd/tokenizer/tokenizer.h"

#include <functional>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <vector>

namespace fd::api {

/// "<prefix>-<32 hex>": 128 random bits (vLLM's random_uuid width), so ids stay unique across a
/// fleet and a restart (POST /v1/abort and fdctl --fleet abort find requests by them).
std::string new_id(const std::string & prefix);

/// Throw fd::Error{invalid_argument, msg} naming request field `param`.
[[noreturn]] void bad(const std::string & param, const std::string & msg);

/// Parse the body as a JSON object. Errors: 400 when it is not one.
nlohmann::json parse_body(const std::string & body);

/// vLLM's request fields both routes accept besides their own (what RL stacks send through the
/// OpenAI client's extra_body): return_token_ids, add_special_tokens, truncate_prompt_tokens,
/// detokenize, priority, cache_salt, response_format. Read by parse_vllm_fields (and
/// add_special_tokens by each route's prompt encoding).
extern const std::set<std::string> kVllmExtraFields;

/// A field a peer's API (OpenAI, vLLM, SGLang) defines that fdrollout does not act on: accepted
/// at the values that change nothing (null always; client libraries send some by default), else a
/// 400 naming it. `chat_only`: only on /v1/chat/completions.
struct NeutralField {
    const char * key;
    bool         chat_only;
    bool (*neutral)(const nlohmann::json &);
    const char * what;  ///< the neutral values, for the message
};

/// NeutralField predicates.
namespace neutral {
bool is_false(const nlohmann::json & v);
bool is_true(const nlohmann::json & v);
bool is_one(const nlohmann::json & v);             ///< a number equal to 1
bool is_zero(const nlohmann::json & v);            ///< an integer 0
bool is_positive(const nlohmann::json & v);        ///< an integer >= 1
bool is_empty(const nlohmann::json & v);           ///< [], {} or ""
bool is_empty_list(const nlohmann::json & v);
bool is_empty_object(const nlohmann::json & v);
bool only_null(const nlohmann::json & v);          ///< nothing but null
bool any(const nlohmann::json & v);                ///< bookkeeping that never changes the output
}  // namespace neutral

/// The entry of `table` for `key` (chat_only entries only when `chat`): false when there is none;
/// true when `v` is null or neutral; else a 400 naming `param` and the neutral values.
bool check_neutral(std::span<const NeutralField> table, const std::string & key, const nlohmann::json & v, const std::string & param,
                   bool chat = false);

/// Every field of `j` must be in `known` or kVllmExtraFields; the fields fdrollout does not
/// implement but OpenAI or vLLM define (best_of, suffix, use_beam_search, ...; chat: echo,
/// parallel_tool_calls, ...) pass only at their neutral value (null, best_of 1, suffix "", ...).
/// Errors: 400 naming the field.
void check_fields(const nlohmann::json & j, const std::set<std::string> & known, bool chat = false);

/// kVllmExtraFields into `gen`, after the prompts are encoded; returns whether any prompt was
/// truncated. Each value fdrollout cannot honour is a 400 naming the field:
///   return_token_ids   bool; token ids are always returned (prompt_token_ids, token_ids)
///   truncate_prompt_tokens  null | -1 | k >= 1: keep each prompt's last k tokens (-1: the last
///                      --max-model-len); k > --max-model-len is 400 (vLLM's rule)
///   detokenize         bool (vLLM's SamplingParams.detokenize, default true); false: no text is
///                      decoded — `text` / `message.content` are "" (echo included), logprob
///                      tokens read "token_id:N", prompt_logprobs' decoded_token is null; token
///                      ids as always; `stop` strings are then a 400 (parse_sampling)
///   priority           0 only (scheduling is FIFO)
///   cache_salt         a non-empty string: prefix-cache hits only between requests with the same
///                      salt (vLLM's meaning; gen.prefix_salt)
///   response_format    {"type": "text"} only (no guided decoding)
///   return_routed_experts  bool (R3); true needs a MoE model and --enable-return-routed-experts:
///                      each choice then carries `routed_experts` [n_rows][n_moe_layers][top_k]
///                      (run_generation; streamed on the choice's finishing chunk)
/// add_special_tokens is read by the routes when they encode.
bool parse_vllm_fields(const ApiContext & ctx, const nlohmann::json & j, engine::GenerateRequest & gen);

/// `model`, when given, must name the served model. Errors: 404 naming it.
void check_model(const ApiContext & ctx, const nlohmann::json & j);

/// A token-id prompt: integers in [0, vocab). Errors: 400 naming `param`.
std::vector<int32_t> token_prompt(const nlohmann::json & arr, int32_t vocab, size_t i_prompt, const char * param);

/// Options both routes read besides the sampling parameters.
struct StreamOptions {
    bool stream        = false;
    bool include_usage = false;  ///< stream_options.include_usage (true when stream_options omits it, as vLLM's StreamOptions)
    /// stream_options.continuous_usage_stats (with include_usage): every chunk carries its own
    /// choice's usage so far (vLLM's previous_num_tokens[i])
    bool continuous_usage = false;
    bool tokens_as_ids = false;  ///< return_tokens_as_token_ids: logprob tokens as "token_id:N"
    /// vLLM's `request_id` (1..128 printable ASCII): the response id is "<id_prefix>-<request_id>"
    /// and POST /v1/abort finds the request by either; empty: a random id.
    std::string request_id;
    /// The max-tokens field the request sent (one of parse_sampling's `max_tokens_keys`), for
    /// messages; empty when it sent none.
    std::string max_tokens_field;
};

/// The sampling fields into gen.params / gen.n: the max-tokens field (the first of
/// `max_tokens_keys` present: chat takes max_completion_tokens then max_tokens), temperature,
/// top_p, top_k, n, seed, stop, stop_token_ids, ignore_eos, skip_special_tokens,
/// spaces_between_special_tokens, min_tokens, repetition_penalty, presence_penalty,
/// frequency_penalty, logit_bias, include_stop_str_in_output, prompt_logprobs,
/// return_tokens_as_token_ids (also on with detokenize false), stream, stream_options (vLLM's
/// ranges); stop strings with detokenize false are a 400. `logprobs` is the
/// route's own. The max-tokens field may be 0 here; routes refuse it where it means nothing.
/// None of `max_tokens_keys` given (absent or null): `default_max_tokens` (completions: 16 when
/// absent, the rest of the context when null, as vLLM's CompletionRequest; chat: the rest of the
/// context, max_model_len - prompt tokens, as vLLM). temperature, top_p, top_k, min_p and
/// repetition_penalty a request leaves out take ctx.cfg.sampling_defaults (--generation-config)
/// when `model_defaults` (the OpenAI routes; SGLang's /generate passes false: its native route
/// keeps the neutral defaults).
/// best_of (1 or null by check_fields) below n is vLLM's 400; prompt_logprobs > 0 with stream is
/// a 400 (0 passes and streams none); stream_options other than {} without stream is a 400.
/// Errors: 400 naming the field.
StreamOptions parse_sampling(const ApiContext & ctx, const nlohmann::json & j, engine::GenerateRequest & gen,
                             std::initializer_list<const char *> max_tokens_keys, int32_t default_max_tokens = 16,
                             bool model_defaults = true);

/// The text /v1/completions echoes for each prompt ([n_prompts]), decoded only when `echo` asks
/// for it: `texts` are the prompts as given in text (the first ones; none for token-id prompts),
/// `prompts` the ids that run ([n_prompts][n_tokens]). A text prompt echoes its own text unless
/// `truncated` (then the decode of what ran); a token-id prompt echoes its decode. Without
/// `echo`: empty, and the tokenizer is never called. Errors: none.
std::vector<std::string> echo_prompt_texts(const tokenizer::Tokenizer & tok, const std::vector<std::vector<int32_t>> & prompts,
                                           std::vector<std::string> texts, bool truncated, bool echo);

/// The prompt ids of a chat request (chat_completions.cpp): `messages` rendered with the model's
/// chat template with add_generation_prompt (default true), continue_final_message, tools,
/// documents and chat_template_kwargs; `oj` is the body with its key order kept. The
/// template's own BOS string becomes the tokenizer's BOS id once; `add_special_tokens` (vLLM's
/// /tokenize field) encodes the rendered text with the tokenizer's special tokens added on top.
/// Errors: 400 naming the field (no template, messages of the wrong shape, raise_exception).
std::vector<int32_t> chat_prompt_ids(ApiContext & ctx, const nlohmann::json & j, const nlohmann::ordered_json & oj,
                                     bool add_special_tokens);

/// A chat body (`param` "") or a tool call's arguments string (`param` its name) for the
/// template: parsed with its key order kept (templates print tools with tojson), refusing an
/// integer literal outside the signed 64-bit range the template engine holds (anywhere in the
/// arguments; in a body, under messages, tools, documents or chat_template_kwargs), which would
/// otherwise render wrapped or as a float where Python's json keeps it exact (a probe:
/// 18446744073709551615 rendered as -1).
/// Errors: 400 naming `param` and the number; parse_ordered_json's.
nlohmann::ordered_json parse_chat_json(const std::string & text, const std::string & param);

/// vLLM's stop_reason: the stop string, the stop token id, or null.
nlohmann::json stop_reason_json(const engine::StopReason & r);

/// A logprob token as returned: its decoded text as OpenAI and vLLM return it (" the", not the
/// vocabulary piece "▁the"; a byte that is not UTF-8 on its own reads as U+FFFD), or "token_id:N"
/// with return_tokens_as_token_ids (the exact token, as vLLM spells it).
std::string token_string(const tokenizer::Tokenizer & tok, int32_t id, bool as_ids);

/// vLLM's prompt_logprobs: [null, {"<id>": {logprob, rank, decoded_token}} per later prompt
/// token], each dict holding the prompt token and the top `k` alternatives (ranks 1..k; every
/// one computed at the default). decoded_token is null when `decode` is false (detokenize: false, as vLLM's engine leaves it).
nlohmann::json prompt_logprobs_json(const tokenizer::Tokenizer & tok, const std::vector<engine::TokenLogprob> & lps, bool decode = true,
                                    int32_t k = INT32_MAX);

/// Each prompt plus max_tokens must fit --max-model-len. Errors: 400 naming `prompt_param` or
/// `max_tokens_param` (the field the request sent: chat's max_completion_tokens or max_tokens).
void check_lengths(const ApiContext & ctx, const engine::GenerateRequest & gen, const char * prompt_param,
                   const std::string & max_tokens_param = "max_tokens");

/// vLLM's get_max_tokens: the model's max_new_tokens (--generation-config, ServerConfig::
/// sampling_defaults) caps sp.max_tokens, asked for or defaulted; called after check_lengths,
/// which judges what the request asked (vLLM validates the request's own value).
/// Errors: 400 when min_tokens then exceeds max_tokens (vLLM's SamplingParams check).
void cap_max_tokens(const ApiContext & ctx, engine::SamplingParams & sp);

/// Accumulated state of one choice.
struct ChoiceAcc {
    std::string                       text;
    std::vector<int32_t>              token_ids;
    std::vector<engine::TokenLogprob> logprobs;
    std::vector<int32_t>              text_offsets;     ///< per generated token, code points into `text`
    std::vector<engine::TokenLogprob> prompt_logprobs;  ///< prompt tokens 1.. when asked
    engine::StopReason                stop_reason;
    engine::FinishReason              finish   = engine::FinishReason::none;
    std::vector<engine::VersionSpan>  weight_versions;  ///< set when the tokens came from more than one version
    std::optional<engine::RoutedExperts> routed_experts;  ///< return_routed_experts: from the finishing event
    std::string                       weight_version;   ///< the version of its last event (its tokens' when it has any)
    int32_t                           n_prompt = 0, n_cached = 0, n_host_cached = -1;  ///< n_host_cached: -1 = no host KV tier
    engine::SpecCounts                spec;             ///< speculative decoding: the latest event's totals that had any

    /// Fold one of the choice's events in (its error, if any, is the caller's).
    void add(engine::ChoiceEvent && ev);
};

/// How a route formats its answer.
struct ResponseFormat {
    std::string object;        ///< "text_completion" | "chat.completion"
    std::string chunk_object;  ///< "text_completion" | "chat.completion.chunk"
    std::string id_prefix;     ///< "cmpl" | "chatcmpl"
    /// Non-streaming: choice `c` from its accumulated state.
    std::function<nlohmann::json(int32_t c, const ChoiceAcc & acc)> choice;
    /// Non-streaming, optional: add route-specific top-level fields to the body.
    std::function<void(const std::vector<ChoiceAcc> & acc, nlohmann::json & body)> body;
    /// Streaming: the choice object of one event; `first` for the choice's first event.
    std::function<nlohmann::json(const engine::ChoiceEvent & ev, bool first)> chunk_choice;
    /// Streaming, optional: the whole SSE chunk of one event, replacing the {id, object, created,
    /// model, weight_version, choices: [chunk_choice]} envelope (a peer's native stream, e.g.
    /// SGLang's /generate); the route carries the weight version itself, no usage chunk is sent.
    std::function<nlohmann::json(const engine::ChoiceEvent & ev, bool first)> chunk;
};

/// Submit `gen` and set `res` to answer it as the engine's events arrive (an AsyncBody: no
/// thread waits): one JSON body {id, object, created, model, weight_version, choices, usage},
/// or SSE chunks {id, object, created, model, weight_version, choices: [one]} then an optional
/// usage chunk and `data: [DONE]`. A choice whose tokens came from more than one weight version
/// (kept across an update) also carries `weight_versions: [{version, first_token, last_token}]`
/// (generated-token indices, inclusive), streamed on its finishing chunk; with return_routed_experts
/// each choice carries `routed_experts` ([n_rows][n_moe_layers][top_k], the finishing chunk). At most
/// --request-timeout-s (504 before the headers, an in-band error after). The request is
/// cancelled when the client goes. POST /v1/abort finds it by its `id` or by the client's
/// `X-Request-Id` header (`http_req`) or its body `request_id` (`opts.request_id`, which also names the `id`),
/// or by any id the route put in `gen.request_ids` (SGLang's per-prompt `rid` list).
/// Errors  (thrown, before anything is sent) what Engine::submit throws: paused, draining.
void run_generation(ApiContext & ctx, const Request & http_req, engine::GenerateRequest gen, StreamOptions opts,
                    const ResponseFormat & fmt, Response & res);

}  // namespace fd::api
