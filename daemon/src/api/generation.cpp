// The parts of /v1/completions and /v1/chat/completions that are the same after parsing
// (request_fields.cpp): running a request to a JSON body or an SSE stream, and its JSON pieces.
#include "generation.h"

#include <atomic>
#include <chrono>
#include <ctime>
#include <limits>
#include <random>

namespace fd::api {

using nlohmann::json;
using engine::ChoiceEvent;
using engine::FinishReason;

std::string new_id(const std::string & prefix) {
    thread_local std::mt19937_64 rng{[] {
        std::random_device rd;
        std::seed_seq seq{rd(), rd(), rd(), rd(), rd(), rd(), rd(), rd()};
        return std::mt19937_64(seq);
    }()};
    const uint64_t hi = rng(), lo = rng();
    return fmt::format("{}-{:016x}{:016x}", prefix, hi, lo);
}

namespace {

json usage_json(const std::vector<ChoiceAcc> & acc, int32_t n) {
    int64_t prompt = 0, completion = 0, cached = 0, host_cached = -1;
    for (size_t c = 0; c < acc.size(); ++c) {
        completion += static_cast<int64_t>(acc[c].token_ids.size());
        if (c % n == 0) { prompt += acc[c].n_prompt; cached += acc[c].n_cached; }
        if (c % n == 0 && acc[c].n_host_cached >= 0) { host_cached = std::max<int64_t>(host_cached, 0) + acc[c].n_host_cached; }
    }
    json details = {{"cached_tokens", cached}};
    if (host_cached >= 0) { details["host_cached_tokens"] = host_cached; }  // only with a host KV tier
    return {{"prompt_tokens", prompt}, {"completion_tokens", completion}, {"total_tokens", prompt + completion},
            {"prompt_tokens_details", std::move(details)}};
}

/// One choice's usage so far (vLLM's continuous_usage_stats: its prompt and previous_num_tokens[i]).
json choice_usage_json(const ChoiceAcc & a) {
    const auto completion = static_cast<int64_t>(a.token_ids.size());
    return {{"prompt_tokens", a.n_prompt}, {"completion_tokens", completion}, {"total_tokens", a.n_prompt + completion}};
}
}  // namespace

json stop_reason_json(const engine::StopReason & r) {
    if (r.str) { return *r.str; }
    if (r.token_id) { return *r.token_id; }
    return nullptr;
}

std::string token_string(const tokenizer::Tokenizer & tok, int32_t id, bool as_ids) {
    return as_ids ? fmt::format("token_id:{}", id) : tok.token_text(id);
}

json prompt_logprobs_json(const tokenizer::Tokenizer & tok, const std::vector<engine::TokenLogprob> & lps, bool decode, int32_t k) {
    json out = json::array({nullptr});
    auto entry = [&](int32_t id, float lp, int32_t rank) {
        const int32_t one[1] = {id};
        return json{{"logprob", lp}, {"rank", rank},
                    {"decoded_token", decode ? json(tok.decode(std::span<const int32_t>(one), {.skip_special_tokens = false, .continuation = true}))
                                             : json(nullptr)}};
    };
    for (const auto & lp : lps) {
        json d = json::object();
        d[std::to_string(lp.id)] = entry(lp.id, lp.logprob, lp.rank);
        for (size_t r = 0; r < lp.top.size() && static_cast<int64_t>(r) < k; ++r) {
            const auto & [id, v] = lp.top[r];
            if (id != lp.id) { d[std::to_string(id)] = entry(id, v, static_cast<int32_t>(r) + 1); }
        }
        out.push_back(std::move(d));
    }
    return out;
}

void ChoiceAcc::add(ChoiceEvent && ev) {
    text += ev.text;
    token_ids.insert(token_ids.end(), ev.token_ids.begin(), ev.token_ids.end());
    logprobs.insert(logprobs.end(), ev.logprobs.begin(), ev.logprobs.end());
    text_offsets.insert(text_offsets.end(), ev.text_offsets.begin(), ev.text_offsets.end());
    if (!ev.prompt_logprobs.empty()) { prompt_logprobs = std::move(ev.prompt_logprobs); }
    if (ev.finish != FinishReason::none) {
        stop_reason = ev.stop_reason;
        finish      = ev.finish;
    }
    n_prompt      = ev.n_prompt_tokens;
    n_cached      = ev.n_cached_tokens;
    n_host_cached = ev.n_host_cached_tokens;
    if (!ev.weight_versions.empty()) { weight_versions = std::move(ev.weight_versions); }
    if (ev.routed_experts) { routed_experts = std::move(ev.routed_experts); }
    if (ev.spec.n_verify > spec.n_verify) { spec = ev.spec; }  // an abort's final event carries none
    weight_version = std::move(ev.weight_version);
}

namespace {

/// [{version, first_token, last_token}] (generated-token indices, inclusive).
json spans_json(const std::vector<engine::VersionSpan> & spans) {
    json a = json::array();
    for (const auto & sp : spans) { a.push_back({{"version", sp.version}, {"first_token", sp.first_token}, {"last_token", sp.last_token}}); }
    return a;
}

/// [n_rows][n_layers][top_k] nested lists (vLLM's and SGLang's [seq_len, num_layers, top_k]).
json routed_experts_json(const engine::RoutedExperts & r) {
    json rows = json::array();
    const int64_t n = r.n_rows(), k = r.top_k;
    for (int64_t t = 0; t < n; ++t) {
        json layers = json::array();
        for (int64_t l = 0; l < r.n_layers; ++l) {
            const int32_t * ids = r.ids.data() + (t * r.n_layers + l) * k;
            layers.push_back(json(std::vector<int32_t>(ids, ids + k)));
        }
        rows.push_back(std::move(layers));
    }
    return rows;
}

/// One completion in flight: what its AsyncBody's pump works on (the connection's strand).
struct Generation {
    ApiContext *                       ctx = nullptr;
    std::shared_ptr<engine::ResultChannel> channel;
    StreamOptions                      opts;
    ResponseFormat                     format;
    std::string                        id;
    int64_t                            created = 0;
    std::chrono::steady_clock::time_point deadline;
    int32_t                            n_per = 1;
    std::vector<ChoiceAcc>             acc;         ///< [n_choices]
    std::vector<bool>                  sent_first;  ///< [n_choices] streamed: the choice's first chunk went out
    std::string                        weight_version;

    void note_usage(Response & res) const {
        const json usage = usage_json(acc, n_per);
        res.n_prompt_tokens    = usage["prompt_tokens"].get<int64_t>();
        res.n_generated_tokens = usage["completion_tokens"].get<int64_t>();
    }

    /// Non-streamed: fold what arrived; once every choice finished, the whole body.
    bool pump_whole(Response & res) {
        try {
            for (auto & ev : channel->pop_all(std::chrono::milliseconds(0))) {
                if (ev.error) { channel->cancel(FinishReason::error); throw *ev.error; }
                weight_version = ev.weight_version;
                acc[ev.choice].add(std::move(ev));
            }
            if (!channel->done()) {
                if (std::chrono::steady_clock::now() < deadline) { return false; }
                channel->cancel(FinishReason::error);  // the client gets a 504: counted as error, not abort (a probe)
                fail(Errc::timeout, "completion did not finish within {} s (--request-timeout-s)", ctx->cfg.request_timeout_s);
            }
            json choices = json::array();
            for (int32_t c = 0; c < static_cast<int32_t>(acc.size()); ++c) {
                json choice = format.choice(c, acc[c]);
                if (acc[c].routed_experts) { choice["routed_experts"] = routed_experts_json(*acc[c].routed_experts); }
                if (!acc[c].weight_versions.empty()) {
                    choice["weight_versions"] = spans_json(acc[c].weight_versions);
                } else if (!acc[c].token_ids.empty() && acc[c].weight_version != weight_version) {
                    // One version, not the response's (a choice that ended before an update its
                    // siblings continued under): its span says which.
                    const int32_t last = static_cast<int32_t>(acc[c].token_ids.size()) - 1;
                    choice["weight_versions"] = spans_json({{.version = acc[c].weight_version, .first_token = 0, .last_token = last}});
                }
                choices.push_back(std::move(choice));
            }
            note_usage(res);
            json body = {{"id", id}, {"object", format.object}, {"created", created}, {"model", ctx->cfg.served_model_name},
                         {"weight_version", weight_version}, {"choices", choices}, {"usage", usage_json(acc, n_per)}};
            if (format.body) { format.body(acc, body); }
            res.status = 200;
            res.set_content(dump(body), "application/json");
        } catch (const Error & e) {
            write_error(res, e);
        }
        return true;
    }

    /// Streamed: one SSE chunk per event, then the usage chunk (if asked) and [DONE]. An error
    /// once the headers are out is reported in-band; the stream still ends cleanly.
    bool pump_stream(Response & res, std::string & out) {
        auto write = [&](const json & j) { out += "data: " + dump(j) + "\n\n"; };
        auto end_stream = [&] {
            note_usage(res);
            out += "data: [DONE]\n\n";
            return true;
        };
        auto end_with_error = [&](Errc code, const std::string & msg) {
            write({{"error", {{"message", msg}, {"type", errc_name(code)}, {"param", nullptr}, {"code", errc_http_status(code)}}}});  // write_error's shape
            channel->cancel(FinishReason::error);
            return end_stream();
        };
        for (auto & ev : channel->pop_all(std::chrono::milliseconds(0))) {
            ChoiceAcc & a = acc[ev.choice];
            a.token_ids.insert(a.token_ids.end(), ev.token_ids.begin(), ev.token_ids.end());
            a.n_prompt = ev.n_prompt_tokens;
            a.n_cached = ev.n_cached_tokens;
            a.n_host_cached = ev.n_host_cached_tokens;
            if (ev.error) { return end_with_error(ev.error->code(), ev.error->what()); }
            const bool first      = !sent_first[ev.choice];
            sent_first[ev.choice] = true;
            weight_version        = ev.weight_version;  // the usage chunk names the version of the last tokens
            if (format.chunk) {  // the route's own envelope
                write(format.chunk(ev, first));
                continue;
            }
            json choice = format.chunk_choice(ev, first);
            if (!ev.weight_versions.empty()) { choice["weight_versions"] = spans_json(ev.weight_versions); }
            if (ev.routed_experts) { choice["routed_experts"] = routed_experts_json(*ev.routed_experts); }  // the final chunk
            json chunk = {{"id", id}, {"object", format.chunk_object}, {"created", created}, {"model", ctx->cfg.served_model_name},
                          {"weight_version", ev.weight_version}, {"choices", json::array({std::move(choice)})}};
            if (opts.continuous_usage) { chunk["usage"] = choice_usage_json(a); }  // vLLM's continuous_usage_stats: this choice so far
            write(chunk);
        }
        if (channel->done()) {
            if (opts.include_usage && !format.chunk) {
                write({{"id", id}, {"object", format.chunk_object}, {"created", created}, {"model", ctx->cfg.served_model_name},
                       {"weight_version", weight_version}, {"choices", json::array()}, {"usage", usage_json(acc, n_per)}});
            }
            return end_stream();
        }
        if (std::chrono::steady_clock::now() >= deadline) {
            return end_with_error(Errc::timeout, "completion timed out (--request-timeout-s)");
        }
        return false;
    }
};

}  // namespace

void run_generation(ApiContext & ctx, const Request & http_req, engine::GenerateRequest gen, StreamOptions opts,
                    const ResponseFormat & format, Response & res) {
    const int32_t n_choices = static_cast<int32_t>(gen.prompts.size()) * gen.n;
    auto g       = std::make_shared<Generation>();
    g->ctx       = &ctx;
    g->channel   = std::make_shared<engine::ResultChannel>(n_choices, opts.stream);
    g->opts      = opts;
    g->format    = format;
    g->n_per     = gen.n;
    g->acc.resize(n_choices);
    g->sent_first.assign(n_choices, false);
    gen.channel = g->channel;
    g->id       = opts.request_id.empty() ? new_id(format.id_prefix) : fmt::format("{}-{}", format.id_prefix, opts.request_id);
    gen.request_ids.insert(gen.request_ids.begin(), g->id);  // first, then the route's own (SGLang's rid list)
    if (!opts.request_id.empty()) { gen.request_ids.push_back(opts.request_id); }
    if (const std::string client_id = http_req.get_header_value("X-Request-Id"); !client_id.empty() && client_id.size() <= 128) {
        gen.request_ids.push_back(client_id);
    }
    ctx.engine->submit(std::move(gen));  // throws (paused, draining): the handler's error answer

    g->created  = static_cast<int64_t>(std::time(nullptr));
    g->deadline = std::chrono::steady_clock::now() + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                                         std::chrono::duration<double>(ctx.cfg.request_timeout_s));
    g->weight_version = ctx.engine->stats().state.weight_version;

    AsyncBody body;
    body.streamed     = opts.stream;
    body.content_type = "text/event-stream";
    body.deadline     = g->deadline;
    body.subscribe    = [g](std::function<void()> wake) { g->channel->set_notify(std::move(wake)); };
    body.pump         = [g](Response & r, std::string & chunk) { return g->opts.stream ? g->pump_stream(r, chunk) : g->pump_whole(r); };
    // Unfinished at the end (client gone, write failed, server stopping): the engine drops
    // the sequences at its next step and frees their KV blocks.
    body.release = [g](bool delivered) {
        g->channel->set_notify(nullptr);
        if (!delivered || !g->channel->done()) { g->channel->cancel(); }
    };
    if (opts.stream) { res.set_header("Cache-Control", "no-cache"); }
    res.set_async(std::move(body));
}

}  // namespace fd::api
