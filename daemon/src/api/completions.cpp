// POST /v1/completions: parse and validate into engine structs, submit, answer (JSON or SSE).
#include "handlers.h"

#include "fd/log.h"

#include <atomic>
#include <chrono>
#include <ctime>
#include <random>
#include <set>

namespace fd::api {
namespace {

using nlohmann::json;
using engine::ChoiceEvent;
using engine::FinishReason;

struct CompletionRequest {
    engine::GenerateRequest           gen;
    std::vector<std::string>          prompt_texts;  ///< [n_prompts] for echo
    bool                              stream        = false;
    bool                              echo          = false;
    bool                              include_usage = false;
};

[[noreturn]] void bad(const std::string & param, const std::string & msg) {
    throw Error(Errc::invalid_argument, msg, param);
}

/// `j[key]` as an integer in [lo, hi], `dflt` when absent or null.
/// Errors  invalid_argument naming `key` when not an integer or out of range.
int64_t get_int(const json & j, const char * key, int64_t dflt, int64_t lo, int64_t hi) {
    auto it = j.find(key);
    if (it == j.end() || it->is_null()) { return dflt; }
    if (!it->is_number_integer()) { bad(key, fmt::format("'{}' must be an integer, got {}", key, it->dump())); }
    const bool big = it->is_number_unsigned() && it->get<uint64_t>() > static_cast<uint64_t>(INT64_MAX);
    const int64_t v = big ? INT64_MAX : it->get<int64_t>();
    if (big || v < lo || v > hi) { bad(key, fmt::format("'{}' must be an integer in [{}, {}], got {}", key, lo, hi, it->dump())); }
    return v;
}

/// `j[key]` as a number, `dflt` when absent or null.   Errors  invalid_argument naming `key`.
double get_double(const json & j, const char * key, double dflt) {
    auto it = j.find(key);
    if (it == j.end() || it->is_null()) { return dflt; }
    if (!it->is_number()) { bad(key, fmt::format("'{}' must be a number, got {}", key, it->dump())); }
    return it->get<double>();
}

std::vector<int32_t> token_prompt(const json & arr, int32_t vocab, size_t i_prompt) {
    std::vector<int32_t> ids;
    for (const auto & v : arr) {
        if (!v.is_number_integer()) { bad("prompt", "token-id prompts must hold integers only"); }
        const int64_t id = v.get<int64_t>();
        if (id < 0 || id >= vocab) {
            bad("prompt", fmt::format("prompt {} has token id {} outside the vocabulary [0, {})", i_prompt, id, vocab));
        }
        ids.push_back(static_cast<int32_t>(id));
    }
    return ids;
}

CompletionRequest parse_body(ApiContext & ctx, const json & j);

/// Parse and validate a /v1/completions body. Every problem is a 400 naming the field; a JSON
/// type error this code did not foresee is still a 400 (never a library message or a 500).
CompletionRequest parse(ApiContext & ctx, const std::string & body) {
    json j;
    try {
        j = json::parse(body);
    } catch (const json::parse_error & e) {
        bad("", body.empty() ? std::string("request body is empty; send a JSON object such as {\"prompt\": \"...\"}")
                             : fmt::format("request body is not valid JSON (syntax error at byte {}; UTF-8 only, no NaN/Infinity, "
                                           "numbers within double range)", e.byte));
    } catch (const json::exception &) {
        bad("", "request body is not valid JSON");
    }
    if (!j.is_object()) { bad("", "request body must be a JSON object"); }
    try {
        return parse_body(ctx, j);
    } catch (const json::exception &) {
        bad("", "a field of the request body has the wrong JSON type (see the OpenAI completions API for each field's type)");
    }
}

CompletionRequest parse_body(ApiContext & ctx, const json & j) {
    // Unknown or unsupported fields are errors, not silently different sampling (OpenAI also
    // rejects unrecognized arguments). Unsupported ones pass only at their no-op value.
    static const std::set<std::string> kKnown = {
        "model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "n", "logprobs", "seed", "stop",
        "stop_token_ids", "ignore_eos", "stream", "echo", "stream_options", "user", "suffix",
        "frequency_penalty", "presence_penalty", "repetition_penalty", "best_of", "logit_bias", "min_tokens", "min_p",
        "skip_special_tokens", "spaces_between_special_tokens"};
    for (const auto & [key, v] : j.items()) {
        if (kKnown.count(key) == 0) { bad(key, fmt::format("unknown field '{}'", key)); }
        const bool noop = v.is_null() ||
                          ((key == "frequency_penalty" || key == "presence_penalty" || key == "min_tokens" || key == "min_p") && v.is_number() && v.get<double>() == 0.0) ||
                          (key == "repetition_penalty" && v.is_number() && v.get<double>() == 1.0) ||
                          (key == "best_of" && v.is_number() && v.get<double>() == 1.0) ||
                          (key == "logit_bias" && v.is_object() && v.empty()) || (key == "suffix" && v.is_string() && v.get<std::string>().empty());
        const bool supported = key != "frequency_penalty" && key != "presence_penalty" && key != "repetition_penalty" &&
                               key != "best_of" && key != "logit_bias" && key != "min_tokens" && key != "min_p" && key != "suffix";
        if (!supported && !noop) { bad(key, fmt::format("'{}' is not supported by fdrollout yet; remove it or use its neutral value", key)); }
    }
    const auto & mc = ctx.engine->model_config();
    CompletionRequest r;

    if (j.contains("model") && !j["model"].is_null()) {
        if (!j["model"].is_string()) { bad("model", "'model' must be a string"); }
        const auto name = j["model"].get<std::string>();
        if (name != ctx.cfg.served_model_name && name != ctx.cfg.model_dir) {
            throw Error(Errc::not_found, fmt::format("model '{}' does not exist; this server serves '{}'", name, ctx.cfg.served_model_name), "model");
        }
    }
    // prompt: string | [string] | [int] | [[int]]
    if (!j.contains("prompt")) { bad("prompt", "'prompt' is required"); }
    const json & p = j["prompt"];
    if (p.is_string()) {
        r.prompt_texts.push_back(p.get<std::string>());
        r.gen.prompts.push_back(ctx.tok->encode(r.prompt_texts.back()));
    } else if (p.is_array() && !p.empty() && p[0].is_string()) {
        for (const auto & s : p) {
            if (!s.is_string()) { bad("prompt", "a list prompt must hold only strings or only token ids"); }
            r.prompt_texts.push_back(s.get<std::string>());
            r.gen.prompts.push_back(ctx.tok->encode(r.prompt_texts.back()));
        }
    } else if (p.is_array() && !p.empty() && p[0].is_array()) {
        for (size_t i = 0; i < p.size(); ++i) {
            if (!p[i].is_array()) { bad("prompt", "'prompt': a list of token-id lists must hold only lists"); }
            r.gen.prompts.push_back(token_prompt(p[i], mc.vocab_size, i));
        }
    } else if (p.is_array() && !p.empty()) {
        r.gen.prompts.push_back(token_prompt(p, mc.vocab_size, 0));
    } else {
        bad("prompt", "'prompt' must be a string, a list of strings, a list of token ids or a list of token-id lists, and not empty");
    }
    for (size_t i = 0; i < r.gen.prompts.size(); ++i) {
        if (r.gen.prompts[i].empty()) { bad("prompt", fmt::format("prompt {} is empty", i)); }
        if (r.prompt_texts.size() <= i) { r.prompt_texts.push_back(ctx.tok->decode(r.gen.prompts[i])); }
    }

    auto & sp = r.gen.params;
    constexpr int64_t kI32 = INT32_MAX;
    sp.max_tokens  = static_cast<int32_t>(get_int(j, "max_tokens", 16, 1, kI32));
    sp.temperature = static_cast<float>(get_double(j, "temperature", 1.0));
    sp.top_p       = static_cast<float>(get_double(j, "top_p", 1.0));
    sp.top_k       = static_cast<int32_t>(get_int(j, "top_k", 0, -1, kI32));
    r.gen.n        = static_cast<int32_t>(get_int(j, "n", 1, 1, ctx.cfg.max_n));
    // logprobs: absent or null = off; else the number of top alternatives, 0..max (OpenAI).
    sp.logprobs    = static_cast<int32_t>(get_int(j, "logprobs", -1, 0, ctx.cfg.max_logprobs));
    if (!(sp.temperature >= 0.0f) || sp.temperature > 100.0f) { bad("temperature", "'temperature' must be in [0, 100]"); }
    if (!(sp.top_p > 0.0f) || sp.top_p > 1.0f) { bad("top_p", "'top_p' must be in (0, 1]"); }
    if (j.contains("seed") && !j["seed"].is_null()) {
        if (!j["seed"].is_number_integer()) { bad("seed", fmt::format("'seed' must be an integer, got {}", j["seed"].dump())); }
        sp.seed = j["seed"].is_number_unsigned() ? j["seed"].get<uint64_t>() : static_cast<uint64_t>(j["seed"].get<int64_t>());
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
            const bool in_vocab = e.is_number_unsigned() ? e.get<uint64_t>() < static_cast<uint64_t>(mc.vocab_size)
                                                         : e.get<int64_t>() >= 0 && e.get<int64_t>() < mc.vocab_size;
            if (!in_vocab) {
                bad("stop_token_ids", fmt::format("'stop_token_ids' holds {}, outside the vocabulary [0, {})", e.dump(), mc.vocab_size));
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
    r.stream      = get_bool("stream");
    r.echo        = get_bool("echo");
    if (j.contains("stream_options") && !j["stream_options"].is_null()) {
        const json & so = j["stream_options"];
        if (!so.is_object()) { bad("stream_options", fmt::format("'stream_options' must be an object {{\"include_usage\": bool}}, got {}", so.dump())); }
        if (!r.stream) { bad("stream_options", "'stream_options' is only allowed with \"stream\": true"); }
        for (const auto & [key, v] : so.items()) {
            if (key != "include_usage") { bad("stream_options." + key, fmt::format("unknown field 'stream_options.{}' (include_usage)", key)); }
            if (!v.is_null() && !v.is_boolean()) {
                bad("stream_options.include_usage", fmt::format("'stream_options.include_usage' must be a boolean, got {}", v.dump()));
            }
            r.include_usage = v.is_boolean() && v.get<bool>();
        }
    }
    if (j.contains("user") && !j["user"].is_null() && !j["user"].is_string()) {
        bad("user", fmt::format("'user' must be a string, got {}", j["user"].dump()));
    }
    const int32_t max_len = ctx.engine->config().max_model_len;
    for (size_t i = 0; i < r.gen.prompts.size(); ++i) {
        const auto n = static_cast<int64_t>(r.gen.prompts[i].size());
        if (n >= max_len) {
            bad("prompt", fmt::format("prompt {} has {} tokens; the maximum context length is {} (--max-model-len), leaving no room to generate", i, n, max_len));
        }
        if (n + sp.max_tokens > max_len) {
            bad("max_tokens", fmt::format("prompt {} has {} tokens and max_tokens is {}: {} exceeds the maximum context length {}",
                                          i, n, sp.max_tokens, n + sp.max_tokens, max_len));
        }
    }
    return r;
}

json logprobs_json(const tokenizer::Tokenizer & tok, const std::vector<engine::TokenLogprob> & lps, int32_t text_offset0) {
    json tokens = json::array(), token_lps = json::array(), top = json::array(), offsets = json::array();
    int32_t off = text_offset0;
    for (const auto & lp : lps) {
        const std::string piece = tok.piece(lp.id);
        tokens.push_back(piece);
        token_lps.push_back(lp.logprob);
        offsets.push_back(off);
        off += static_cast<int32_t>(piece.size());
        json t = json::object();
        for (const auto & [id, v] : lp.top) { t[tok.piece(id)] = v; }
        top.push_back(t);
    }
    return {{"tokens", tokens}, {"token_logprobs", token_lps}, {"top_logprobs", top}, {"text_offset", offsets}};
}

std::string new_id() {
    static std::atomic<uint64_t> counter{std::random_device{}()};
    return fmt::format("cmpl-{:016x}", counter.fetch_add(0x9e3779b97f4a7c15ULL));
}

/// Accumulated state of one choice.
struct ChoiceAcc {
    std::string                       text;
    std::vector<int32_t>              token_ids;
    std::vector<engine::TokenLogprob> logprobs;
    FinishReason                      finish = FinishReason::none;
    int32_t                           n_prompt = 0, n_cached = 0;
};

json usage_json(const std::vector<ChoiceAcc> & acc, int32_t n) {
    int64_t prompt = 0, completion = 0, cached = 0;
    for (size_t c = 0; c < acc.size(); ++c) {
        completion += static_cast<int64_t>(acc[c].token_ids.size());
        if (c % n == 0) { prompt += acc[c].n_prompt; cached += acc[c].n_cached; }
    }
    return {{"prompt_tokens", prompt}, {"completion_tokens", completion}, {"total_tokens", prompt + completion},
            {"prompt_tokens_details", {{"cached_tokens", cached}}}};
}

}  // namespace

void post_completions(ApiContext & ctx, const httplib::Request & req, httplib::Response & res) {
    auto r = std::make_shared<CompletionRequest>(parse(ctx, req.body));
    const int32_t n_choices = static_cast<int32_t>(r->gen.prompts.size()) * r->gen.n;
    auto channel     = std::make_shared<engine::ResultChannel>(n_choices, r->stream);
    r->gen.channel   = channel;
    auto prompts     = r->gen.prompts;
    ctx.engine->submit(std::move(r->gen));

    const std::string id      = new_id();
    const int64_t     created = static_cast<int64_t>(std::time(nullptr));
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                                                 std::chrono::duration<double>(ctx.cfg.request_timeout_s));
    auto acc = std::make_shared<std::vector<ChoiceAcc>>(n_choices);
    std::string weight_version = ctx.engine->stats().state.weight_version;

    if (!r->stream) {
        while (!channel->done()) {
            if (std::chrono::steady_clock::now() > deadline) {
                channel->cancel();
                fail(Errc::timeout, "completion did not finish within {} s (--request-timeout-s)", ctx.cfg.request_timeout_s);
            }
            for (auto & ev : channel->pop_all(std::chrono::milliseconds(100))) {
                if (ev.error) { channel->cancel(); throw *ev.error; }
                ChoiceAcc & a = (*acc)[ev.choice];
                a.text += ev.text;
                a.token_ids.insert(a.token_ids.end(), ev.token_ids.begin(), ev.token_ids.end());
                a.logprobs.insert(a.logprobs.end(), ev.logprobs.begin(), ev.logprobs.end());
                a.n_prompt = ev.n_prompt_tokens;
                a.n_cached = ev.n_cached_tokens;
                if (ev.finish != FinishReason::none) { a.finish = ev.finish; }
                weight_version = ev.weight_version;
            }
        }
        json choices = json::array();
        for (int32_t c = 0; c < n_choices; ++c) {
            const ChoiceAcc & a  = (*acc)[c];
            const int32_t     ip = c / r->gen.n;
            const std::string prefix = r->echo ? r->prompt_texts[ip] : "";
            choices.push_back({{"index", c},
                               {"text", prefix + a.text},
                               {"logprobs", r->gen.params.logprobs >= 0 ? logprobs_json(*ctx.tok, a.logprobs, static_cast<int32_t>(prefix.size())) : json(nullptr)},
                               {"finish_reason", engine::to_string(a.finish)},
                               {"prompt_token_ids", prompts[ip]},
                               {"token_ids", a.token_ids}});
        }
        json body = {{"id", id}, {"object", "text_completion"}, {"created", created}, {"model", ctx.cfg.served_model_name},
                     {"weight_version", weight_version}, {"choices", choices}, {"usage", usage_json(*acc, r->gen.n)}};
        res.set_content(dump(body), "application/json");
        return;
    }

    // Streaming: one SSE chunk per event, then [DONE]. The releaser cancels on disconnect.
    auto sent_first = std::make_shared<std::vector<bool>>(n_choices, false);
    auto provider = [&ctx, r, channel, acc, sent_first, prompts, id, created, deadline, n_choices](size_t, httplib::DataSink & sink) {
        auto write = [&](const json & j) {
            const std::string line = "data: " + dump(j) + "\n\n";
            return sink.write(line.data(), line.size());
        };
        auto end_stream = [&] {
            const std::string done = "data: [DONE]\n\n";
            sink.write(done.data(), done.size());
            sink.done();
            return true;
        };
        // An error once headers are sent is reported in-band; the stream still ends cleanly.
        auto end_with_error = [&](Errc code, const std::string & msg) {
            write({{"error", {{"message", msg}, {"type", errc_name(code)}, {"code", errc_http_status(code)}}}});
            channel->cancel();
            return end_stream();
        };
        if (channel->done()) {
            if (r->include_usage) {
                write({{"id", id}, {"object", "text_completion"}, {"created", created}, {"model", ctx.cfg.served_model_name},
                       {"choices", json::array()}, {"usage", usage_json(*acc, r->gen.n)}});
            }
            return end_stream();
        }
        if (std::chrono::steady_clock::now() > deadline) {
            return end_with_error(Errc::timeout, "completion timed out (--request-timeout-s)");
        }
        for (auto & ev : channel->pop_all(std::chrono::milliseconds(100))) {
            ChoiceAcc & a = (*acc)[ev.choice];
            a.token_ids.insert(a.token_ids.end(), ev.token_ids.begin(), ev.token_ids.end());
            a.n_prompt = ev.n_prompt_tokens;
            a.n_cached = ev.n_cached_tokens;
            if (ev.error) { return end_with_error(ev.error->code(), ev.error->what()); }
            const int32_t ip = ev.choice / r->gen.n;
            std::string text = ev.text;
            json choice = {{"index", ev.choice}, {"token_ids", ev.token_ids},
                           {"finish_reason", ev.finish == FinishReason::none ? json(nullptr) : json(engine::to_string(ev.finish))}};
            if (!(*sent_first)[ev.choice]) {
                (*sent_first)[ev.choice] = true;
                choice["prompt_token_ids"] = prompts[ip];
                if (r->echo) { text = r->prompt_texts[ip] + text; }
            }
            choice["text"] = text;
            choice["logprobs"] = r->gen.params.logprobs >= 0 ? logprobs_json(*ctx.tok, ev.logprobs, 0) : json(nullptr);
            json chunk = {{"id", id}, {"object", "text_completion"}, {"created", created}, {"model", ctx.cfg.served_model_name},
                          {"weight_version", ev.weight_version}, {"choices", json::array({choice})}};
            if (!write(chunk)) { return false; }
        }
        return true;
    };
    res.set_header("Cache-Control", "no-cache");
    res.set_chunked_content_provider("text/event-stream", provider, [channel](bool success) {
        if (!success || !channel->done()) { channel->cancel(); }
    });
}

}  // namespace fd::api
