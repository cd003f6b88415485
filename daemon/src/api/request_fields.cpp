// Request parsing shared by /v1/completions and /v1/chat/completions: the body, the field checks
// (OpenAI's, vLLM's extra_body and neutral-only fields), the sampling fields and the length checks.
#include "generation.h"

#include "fd/shm/names.h"

#include <limits>

namespace fd::api {

using nlohmann::json;

void bad(const std::string & param, const std::string & msg) { throw Error(Errc::invalid_argument, msg, param); }

json parse_body(const std::string & body) {
    json j;
    try {
        j = parse_json(body);
    } catch (const json::parse_error & e) {
        // nlohmann: "invalid string: surrogate U+D800..U+DBFF must be followed by U+DC00..U+DFFF".
        if (std::string_view(e.what()).find("surrogate U+") != std::string_view::npos) {
            bad("", fmt::format("request body is not valid JSON: a lone surrogate at byte {} (a UTF-16 escape \\uD800-\\uDFFF "
                                "without its pair; escape characters above U+FFFF as a high + low surrogate pair, or send "
                                "them as UTF-8)", e.byte));
        }
        bad("", body.empty() ? std::string("request body is empty; send a JSON object")
                             : fmt::format("request body is not valid JSON (syntax error at byte {}; UTF-8 only, no NaN/Infinity, "
                                           "numbers within double range)", e.byte));
    } catch (const json::exception &) {
        bad("", "request body is not valid JSON");
    }
    if (!j.is_object()) { bad("", "request body must be a JSON object"); }
    return j;
}

const std::set<std::string> kVllmExtraFields = {"return_token_ids", "add_special_tokens", "truncate_prompt_tokens", "detokenize",
                                                 "priority", "cache_salt", "response_format", "return_routed_experts",
                                                 "request_id"};

namespace {

using namespace neutral;

const NeutralField kNeutralFields[] = {
    {"best_of", false, is_one, "1"},
    {"suffix", false, [](const json & v) { return v.is_string() && v.get<std::string>().empty(); }, "\"\""},
    {"use_beam_search", false, is_false, "false"},
    {"length_penalty", false, is_one, "1.0"},
    {"bad_words", false, is_empty_list, "[]"},
    {"allowed_token_ids", false, only_null, "null"},
    {"structured_outputs", false, only_null, "null"},
    {"guided_json", false, only_null, "null"},
    {"guided_regex", false, only_null, "null"},
    {"guided_choice", false, only_null, "null"},
    {"guided_grammar", false, only_null, "null"},
    {"guided_decoding_backend", false, only_null, "null"},  // vLLM's other guided_* fields (protocol.py)
    {"guided_whitespace_pattern", false, only_null, "null"},
    {"logits_processors", false, is_empty_list, "[]"},
    {"vllm_xargs", false, is_empty_object, "{}"},
    {"kv_transfer_params", false, only_null, "null"},
    {"store", false, is_false, "false"},
    {"service_tier", false, [](const json & v) { return v == "auto" || v == "default"; }, "\"auto\" or \"default\""},
    {"metadata", false, is_empty_object, "{}"},
    {"echo", true, is_false, "false"},
    {"parallel_tool_calls", true, is_true, "true"},
    {"include_reasoning", true, is_true, "true"},
    {"reasoning_effort", true, only_null, "null (pass it in chat_template_kwargs if the template reads it)"},
    // OpenAI's and vLLM's fields with no effect on a text rollout at these values (a probe: null
    // or ["text"] was a 400 "unknown field").
    {"prompt_embeds", false, only_null, "null"},
    {"mm_processor_kwargs", false, only_null, "null"},
    {"prompt_cache_key", false, only_null, "null"},
    {"safety_identifier", false, only_null, "null"},
    {"modalities", true, [](const json & v) { return v == json::array({"text"}); }, "[\"text\"]"},
    {"audio", true, only_null, "null"},
    {"prediction", true, only_null, "null"},
    {"web_search_options", true, only_null, "null"},
    {"function_call", true, only_null, "null (use tool_choice)"},
    {"functions", true, only_null, "null (use tools)"},
};

}  // namespace

void check_fields(const json & j, const std::set<std::string> & known, bool chat) {
    // Unknown or unsupported fields are errors, not silently different sampling (OpenAI also
    // rejects unrecognized arguments). Unsupported ones pass only at their no-op value.
    for (const auto & [key, v] : j.items()) {
        if (known.count(key) != 0 || kVllmExtraFields.count(key) != 0) { continue; }
        if (!check_neutral(kNeutralFields, key, v, key, chat)) { bad(key, fmt::format("unknown field '{}'", key)); }
    }
}

namespace neutral {
bool is_false(const json & v) { return v.is_boolean() && !v.get<bool>(); }
bool is_true(const json & v) { return v.is_boolean() && v.get<bool>(); }
bool is_one(const json & v) { return v.is_number() && v.get<double>() == 1.0; }
bool is_zero(const json & v) { return v.is_number_integer() && v.get<int64_t>() == 0; }
bool is_positive(const json & v) { return v.is_number_integer() && v.get<int64_t>() >= 1; }
bool is_empty(const json & v) { return (v.is_array() || v.is_object() || v.is_string()) && v.empty(); }
bool is_empty_list(const json & v) { return v.is_array() && v.empty(); }
bool is_empty_object(const json & v) { return v.is_object() && v.empty(); }
bool only_null(const json &) { return false; }
bool any(const json &) { return true; }
}  // namespace neutral

bool check_neutral(std::span<const NeutralField> table, const std::string & key, const json & v, const std::string & param, bool chat) {
    const auto n = std::find_if(table.begin(), table.end(), [&](const NeutralField & f) { return key == f.key && (chat || !f.chat_only); });
    if (n == table.end()) { return false; }
    if (!v.is_null() && !n->neutral(v)) {
        bad(param, fmt::format("'{}' is not supported by fdrollout yet; remove it or send its neutral value {}, got {}", param, n->what,
                               brief(v)));
    }
    return true;
}

void check_model(const ApiContext & ctx, const json & j) {
    if (!j.contains("model") || j["model"].is_null()) { return; }
    if (!j["model"].is_string()) { bad("model", "'model' must be a string"); }
    const auto name = j["model"].get<std::string>();
    if (!ctx.cfg.serves(name) && name != ctx.cfg.model_dir) {
        throw Error(Errc::not_found, fmt::format("model '{}' does not exist; this server serves '{}'", name, ctx.cfg.served_model_name), "model");
    }
}

std::vector<int32_t> token_prompt(const json & arr, int32_t vocab, size_t i_prompt, const char * param) {
    std::vector<int32_t> ids;
    for (const auto & v : arr) {
        if (!v.is_number_integer()) { bad(param, "token-id prompts must hold integers only"); }
        const int64_t id = v.get<int64_t>();
        if (id < 0 || id >= vocab) {
            bad(param, fmt::format("prompt {} has token id {} outside the vocabulary [0, {})", i_prompt, id, vocab));
        }
        ids.push_back(static_cast<int32_t>(id));
    }
    return ids;
}

namespace {

template <typename T>
T get_number(const json & j, const char * key, T dflt, bool integer) {
    auto it = j.find(key);
    if (it == j.end() || it->is_null()) { return dflt; }
    if (integer ? !it->is_number_integer() : !it->is_number()) {
        bad(key, fmt::format("'{}' must be {}, got {}", key, integer ? "an integer" : "a number", brief(*it)));
    }
    if (integer) {  // no silent wrap-around of out-of-range integers
        const bool fits = it->is_number_unsigned() ? it->template get<uint64_t>() <= static_cast<uint64_t>(std::numeric_limits<T>::max())
                                                   : it->template get<int64_t>() >= static_cast<int64_t>(std::numeric_limits<T>::min()) &&
                                                         it->template get<int64_t>() <= static_cast<int64_t>(std::numeric_limits<T>::max());
        if (!fits) { bad(key, fmt::format("'{}' is out of range, got {}", key, brief(*it))); }
    }
    return it->template get<T>();
}

/// min_tokens, the penalties and logit_bias (vLLM's ranges); repetition_penalty left out is `d`'s.
/// Errors: 400 naming the field.
void parse_logits_fields(const ApiContext & ctx, const json & j, engine::SamplingParams & sp, const model::GenerationDefaults & d) {
    sp.min_tokens         = get_number<int32_t>(j, "min_tokens", 0, true);
    sp.repetition_penalty = get_number<float>(j, "repetition_penalty", d.repetition_penalty.value_or(1.0f), false);
    sp.presence_penalty   = get_number<float>(j, "presence_penalty", 0.0f, false);
    sp.frequency_penalty  = get_number<float>(j, "frequency_penalty", 0.0f, false);
    if (sp.min_tokens < 0) { bad("min_tokens", fmt::format("'min_tokens' must be >= 0, got {}", sp.min_tokens)); }
    if (sp.min_tokens > sp.max_tokens) {
        bad("min_tokens", fmt::format("'min_tokens' ({}) must be <= max_tokens ({})", sp.min_tokens, sp.max_tokens));
    }
    if (!(sp.repetition_penalty > 0.0f) || sp.repetition_penalty > 100.0f) {
        bad("repetition_penalty", "'repetition_penalty' must be in (0, 100] (1 = off)");
    }
    if (!(sp.presence_penalty >= -2.0f && sp.presence_penalty <= 2.0f)) { bad("presence_penalty", "'presence_penalty' must be in [-2, 2]"); }
    if (!(sp.frequency_penalty >= -2.0f && sp.frequency_penalty <= 2.0f)) { bad("frequency_penalty", "'frequency_penalty' must be in [-2, 2]"); }
    sp.logit_bias.clear();
    if (j.contains("logit_bias") && !j["logit_bias"].is_null()) {
        const json & lb = j["logit_bias"];
        if (!lb.is_object()) { bad("logit_bias", "'logit_bias' must be an object {\"<token id>\": bias}"); }
        const int32_t vocab = ctx.engine->model_config().vocab_size;
        for (const auto & [key, v] : lb.items()) {
            int64_t id = -1;
            size_t  used = 0;
            try {
                id = std::stoll(key, &used);
            } catch (const std::exception &) {
                used = 0;
            }
            if (used == 0 || used != key.size() || id < 0 || id >= vocab) {
                bad("logit_bias", fmt::format("'logit_bias' key '{}' is not a token id in [0, {})", key, vocab));
            }
            if (!v.is_number() || !(v.get<double>() >= -100.0 && v.get<double>() <= 100.0)) {
                bad("logit_bias", fmt::format("'logit_bias[\"{}\"]' must be a number in [-100, 100], got {}", key, brief(v)));
            }
            sp.logit_bias.emplace_back(static_cast<int32_t>(id), v.get<float>());
        }
    }
}

}  // namespace

StreamOptions parse_sampling(const ApiContext & ctx, const json & j, engine::GenerateRequest & gen,
                             std::initializer_list<const char *> max_tokens_keys, int32_t default_max_tokens, bool model_defaults) {
    auto &      sp      = gen.params;
    const char * mt_key = *max_tokens_keys.begin();
    StreamOptions o;
    sp.max_tokens       = default_max_tokens;
    for (const char * k : max_tokens_keys) {
        if (j.contains(k) && !j[k].is_null()) {
            mt_key             = k;
            o.max_tokens_field = k;
            sp.max_tokens      = get_number<int32_t>(j, k, 16, true);
            break;
        }
    }
    // --generation-config: the model's defaults for the fields the request leaves out (vLLM's
    // default_sampling_params, read by its OpenAI routes)
    static const model::GenerationDefaults kNone;
    const auto & d = model_defaults ? ctx.cfg.sampling_defaults : kNone;
    sp.temperature = get_number<float>(j, "temperature", d.temperature.value_or(1.0f), false);
    sp.top_p       = get_number<float>(j, "top_p", d.top_p.value_or(1.0f), false);
    sp.top_k       = get_number<int32_t>(j, "top_k", d.top_k.value_or(0), true);
    gen.n          = get_number<int32_t>(j, "n", 1, true);
    if (sp.max_tokens < 0) {
        // several keys = chat, where 0 is refused too; completions' 0 scores an echoed prompt
        bad(mt_key, max_tokens_keys.size() > 1 ? fmt::format("'{}' must be >= 1, got {}", mt_key, sp.max_tokens)
                                               : fmt::format("'{}' must be >= 1 (0 only to score an echoed prompt), got {}", mt_key, sp.max_tokens));
    }
    if (!(sp.temperature >= 0.0f) || sp.temperature > 100.0f) { bad("temperature", "'temperature' must be in [0, 100]"); }
    if (!(sp.top_p > 0.0f) || sp.top_p > 1.0f) { bad("top_p", "'top_p' must be in (0, 1]"); }
    if (sp.top_k < -1) { bad("top_k", "'top_k' must be -1, 0 (off) or a positive integer"); }
    sp.min_p = get_number<float>(j, "min_p", d.min_p.value_or(0.0f), false);
    if (!(sp.min_p >= 0.0f && sp.min_p <= 1.0f)) { bad("min_p", "'min_p' must be in [0, 1] (0 = off)"); }
    if (gen.n < 1 || gen.n > ctx.cfg.max_n) { bad("n", fmt::format("'n' must be in [1, {}], got {}", ctx.cfg.max_n, gen.n)); }
    // best_of passes check_fields only at 1 (or null); vLLM: "best_of must be greater than or equal to n"
    if (j.contains("best_of") && j["best_of"].is_number() && j["best_of"].get<double>() < gen.n) {
        bad("best_of", fmt::format("best_of must be greater than or equal to n, got n={} and best_of={}.", gen.n, brief(j["best_of"])));
    }
    if (j.contains("seed") && !j["seed"].is_null()) {
        if (!j["seed"].is_number_integer()) { bad("seed", "'seed' must be an integer"); }
        // vLLM's range (a signed 64-bit integer): beyond it 2^64 - 1 would draw exactly what -1 draws.
        if (j["seed"].is_number_unsigned() && j["seed"].get<uint64_t>() > static_cast<uint64_t>(INT64_MAX)) {
            bad("seed", fmt::format("'seed' must be a signed 64-bit integer (vLLM's range), got {}", brief(j["seed"])));
        }
        sp.seed = static_cast<uint64_t>(j["seed"].get<int64_t>());
    }
    if (j.contains("stop") && !j["stop"].is_null()) {
        const json & s = j["stop"];
        if (s.is_string()) {
            sp.stop.push_back(s.get<std::string>());
        } else if (s.is_array()) {
            for (const auto & e : s) {
                if (!e.is_string()) { bad("stop", "'stop' must be a string or a list of strings"); }
                sp.stop.push_back(e.get<std::string>());
            }
        } else {
            bad("stop", "'stop' must be a string or a list of strings");
        }
        for (const auto & e : sp.stop) {
            if (e.empty()) { bad("stop", "stop strings must not be empty"); }
        }
    }
    if (j.contains("stop_token_ids") && !j["stop_token_ids"].is_null()) {
        if (!j["stop_token_ids"].is_array()) { bad("stop_token_ids", "'stop_token_ids' must be a list of token ids"); }
        for (const auto & e : j["stop_token_ids"]) {
            if (!e.is_number_integer()) { bad("stop_token_ids", "'stop_token_ids' must be a list of token ids"); }
            const int32_t vocab    = ctx.engine->model_config().vocab_size;
            const bool    in_vocab = e.is_number_unsigned() ? e.get<uint64_t>() < static_cast<uint64_t>(vocab)
                                                            : e.get<int64_t>() >= 0 && e.get<int64_t>() < vocab;
            if (!in_vocab) {
                bad("stop_token_ids", fmt::format("'stop_token_ids' holds {}, outside the vocabulary [0, {})", brief(e), vocab));
            }
            sp.stop_token_ids.push_back(e.get<int32_t>());
        }
    }
    auto get_bool = [&](const char * key) {
        if (!j.contains(key) || j[key].is_null()) { return false; }
        if (!j[key].is_boolean()) { bad(key, fmt::format("'{}' must be a boolean", key)); }
        return j[key].get<bool>();
    };
    sp.ignore_eos = get_bool("ignore_eos");
    sp.skip_special_tokens           = !j.contains("skip_special_tokens") || j["skip_special_tokens"].is_null() || get_bool("skip_special_tokens");
    sp.spaces_between_special_tokens = !j.contains("spaces_between_special_tokens") || j["spaces_between_special_tokens"].is_null() ||
                                       get_bool("spaces_between_special_tokens");
    parse_logits_fields(ctx, j, sp, d);
    sp.include_stop_str_in_output = get_bool("include_stop_str_in_output");
    o.stream         = get_bool("stream");
    if (j.contains("request_id") && !j["request_id"].is_null()) {  // vLLM: the response id becomes "<cmpl|chatcmpl>-<request_id>"
        const json & id = j["request_id"];
        if (!id.is_string() || !shm::is_valid_request_id(id.get<std::string>())) {
            bad("request_id", fmt::format("'request_id' must be 1..128 printable ASCII characters without spaces, got {}", brief(id)));
        }
        o.request_id = id.get<std::string>();
    }
    // detokenize false: no text, so logprob tokens are their ids too (vLLM's tokens-only answer)
    o.tokens_as_ids  = get_bool("return_tokens_as_token_ids") || !sp.detokenize;
    if (!sp.detokenize && !sp.stop.empty()) {
        bad("stop", "stop strings are only supported when detokenize is true (vLLM's rule): with \"detokenize\": false no text is "
                    "decoded to match them; use stop_token_ids");
    }
    sp.prompt_logprobs = -1;
    if (j.contains("prompt_logprobs") && !j["prompt_logprobs"].is_null()) {
        sp.prompt_logprobs = get_number<int32_t>(j, "prompt_logprobs", -1, true);
        if (sp.prompt_logprobs < 0 || sp.prompt_logprobs > ctx.cfg.max_logprobs) {
            bad("prompt_logprobs", fmt::format("'prompt_logprobs' must be an integer in [0, {}], got {}", ctx.cfg.max_logprobs, sp.prompt_logprobs));
        }
        // vLLM refuses only k > 0 on a stream; 0 passes, and a stream carries no prompt_logprobs
        if (o.stream && sp.prompt_logprobs > 0) {
            bad("prompt_logprobs", "'prompt_logprobs' > 0 is not available when \"stream\": true (as in vLLM)");
        }
        if (o.stream) { sp.prompt_logprobs = -1; }
    }
    if (j.contains("stream_options") && !j["stream_options"].is_null()) {
        const json & so = j["stream_options"];
        if (!so.is_object()) {
            bad("stream_options", fmt::format("'stream_options' must be an object {{\"include_usage\": bool, \"continuous_usage_stats\": bool}}, "
                                              "got {}", brief(so)));
        }
        // vLLM refuses only a truthy stream_options without stream ({} passes)
        if (!o.stream && !so.empty()) { bad("stream_options", "'stream_options' is only allowed with \"stream\": true"); }
        o.include_usage = true;  // vLLM's StreamOptions.include_usage defaults to true (an explicit null is false)
        for (const auto & [key, v] : so.items()) {
            if (key != "include_usage" && key != "continuous_usage_stats") {
                bad("stream_options." + key, fmt::format("unknown field 'stream_options.{}' (include_usage, continuous_usage_stats)", key));
            }
            if (!v.is_null() && !v.is_boolean()) {
                bad("stream_options." + key, fmt::format("'stream_options.{}' must be a boolean, got {}", key, brief(v)));
            }
            (key == "include_usage" ? o.include_usage : o.continuous_usage) = v.is_boolean() && v.get<bool>();
        }
        o.continuous_usage = o.continuous_usage && o.include_usage;  // vLLM: usage on every chunk needs both
    }
    if (j.contains("user") && !j["user"].is_null() && !j["user"].is_string()) {
        bad("user", fmt::format("'user' must be a string, got {}", brief(j["user"])));
    }
    return o;
}

bool parse_vllm_fields(const ApiContext & ctx, const json & j, engine::GenerateRequest & gen) {
    auto given = [&](const char * key) { return j.contains(key) && !j[key].is_null(); };
    for (const char * key : {"return_token_ids", "add_special_tokens", "detokenize"}) {
        if (given(key) && !j[key].is_boolean()) { bad(key, fmt::format("'{}' must be a boolean", key)); }
    }
    gen.params.detokenize = !given("detokenize") || j["detokenize"].get<bool>();  // false: checked against `stop` in parse_sampling
    if (given("return_routed_experts")) {
        if (!j["return_routed_experts"].is_boolean()) {
            bad("return_routed_experts", fmt::format("'return_routed_experts' must be a boolean, got {}", brief(j["return_routed_experts"])));
        }
        if (j["return_routed_experts"].get<bool>()) {
            const auto & mc = ctx.engine->model_config();
            if (!mc.moe.enabled()) {
                bad("return_routed_experts", fmt::format("'return_routed_experts' needs a mixture-of-experts model; {} ({}) is dense: it "
                                                         "routes no token to experts", ctx.cfg.served_model_name, mc.architecture));
            }
            if (!ctx.cfg.enable_return_routed_experts) {
                bad("return_routed_experts", "'return_routed_experts' needs the daemon started with --enable-return-routed-experts "
                                             "(vLLM's flag; FD_ENABLE_RETURN_ROUTED_EXPERTS=1)");
            }
            gen.params.return_routed_experts = true;
        }
    }
    if (given("priority")) {
        if (!j["priority"].is_number_integer()) { bad("priority", "'priority' must be an integer"); }
        if (j["priority"].get<int64_t>() != 0) {
            bad("priority", fmt::format("'priority' {} is not supported: requests are scheduled first come, first served (priority 0 only)",
                                        brief(j["priority"])));
        }
    }
    if (given("cache_salt")) {
        if (!j["cache_salt"].is_string() || j["cache_salt"].get<std::string>().empty()) {
            bad("cache_salt", "'cache_salt' must be a non-empty string");
        }
        // never 0 (= no salt): an unsalted request cannot hit a salted request's blocks
        gen.prefix_salt = std::hash<std::string>{}(j["cache_salt"].get<std::string>()) | 1u;
    }
    if (given("response_format")) {
        const json & rf = j["response_format"];
        if (!rf.is_object() || !rf.contains("type") || !rf["type"].is_string()) {
            bad("response_format", "'response_format' must be an object {\"type\": \"text\"}");
        }
        if (rf["type"] != "text" || rf.size() != 1) {
            bad("response_format", fmt::format("'response_format' {} is not supported: only {{\"type\": \"text\"}} (no guided decoding)", brief(rf)));
        }
    }
    bool truncated = false;
    if (given("truncate_prompt_tokens")) {
        const json & tp = j["truncate_prompt_tokens"];
        if (!tp.is_number_integer()) { bad("truncate_prompt_tokens", "'truncate_prompt_tokens' must be an integer"); }
        const int64_t max_len = ctx.engine->config().max_model_len;
        if (tp.is_number_unsigned() && tp.get<uint64_t>() > static_cast<uint64_t>(max_len)) {  // before get<int64_t> wraps 2^64 - 1 to -1
            bad("truncate_prompt_tokens", fmt::format("'truncate_prompt_tokens' {} exceeds the maximum context length {} (--max-model-len)", brief(tp), max_len));
        }
        int64_t       k       = tp.get<int64_t>();
        if (k == -1) { k = max_len; }
        if (k < 1) { bad("truncate_prompt_tokens", fmt::format("'truncate_prompt_tokens' must be -1 or >= 1, got {}", k)); }
        if (k > max_len) {
            bad("truncate_prompt_tokens", fmt::format("'truncate_prompt_tokens' {} exceeds the maximum context length {} (--max-model-len)", k, max_len));
        }
        for (auto & p : gen.prompts) {
            if (static_cast<int64_t>(p.size()) > k) {
                p.erase(p.begin(), p.end() - k);  // vLLM keeps the last k tokens (left truncation)
                truncated = true;
            }
        }
    }
    return truncated;
}

void check_lengths(const ApiContext & ctx, const engine::GenerateRequest & gen, const char * prompt_param, const std::string & max_tokens_param) {
    const int32_t max_len = ctx.engine->config().max_model_len;
    const int32_t vocab   = ctx.engine->model_config().vocab_size;
    for (size_t i = 0; i < gen.prompts.size(); ++i) {
        const auto n = static_cast<int64_t>(gen.prompts[i].size());
        // Text can encode to ids the model has no embedding for (a tokenizer.json with added
        // tokens past config.json's vocab_size, embeddings never resized): refused here, before
        // the batch, whose forward would fail for every request in it.
        for (size_t t = 0; t < gen.prompts[i].size(); ++t) {
            const int32_t id = gen.prompts[i][t];
            if (id < 0 || id >= vocab) {
                bad(prompt_param, fmt::format("prompt {} encodes to token id {} (position {}), outside the model's vocabulary [0, {}): the "
                                              "tokenizer holds ids config.json's vocab_size does not (added tokens without resized embeddings)",
                                              i, id, t, vocab));
            }
        }
        if (n >= max_len && !(gen.params.max_tokens == 0 && n == max_len)) {
            bad(prompt_param, fmt::format("prompt {} has {} tokens; the maximum context length is {} (--max-model-len), leaving no room to generate", i, n, max_len));
        }
        if (n + gen.params.max_tokens > max_len) {
            bad(max_tokens_param, fmt::format("prompt {} has {} tokens and {} is {}: {} exceeds the maximum context length {}", i, n,
                                              max_tokens_param, gen.params.max_tokens, n + gen.params.max_tokens, max_len));
        }
    }
}

void cap_max_tokens(const ApiContext & ctx, engine::SamplingParams & sp) {
    const auto cap = ctx.cfg.sampling_defaults.max_new_tokens;
    if (!cap || sp.max_tokens <= *cap) { return; }
    sp.max_tokens = *cap;
    if (sp.min_tokens > sp.max_tokens) {  // vLLM's SamplingParams check, on the capped value
        bad("min_tokens", fmt::format("'min_tokens' ({}) must be <= max_tokens ({}: the model's generation_config.json max_new_tokens, "
                                      "--generation-config)", sp.min_tokens, sp.max_tokens));
    }
}

}  // namespace fd::api
