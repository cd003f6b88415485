// SGLang's native generation route, POST /generate (python/sglang/srt/entrypoints/http_server.py
// generate_request; the body is io_struct.py's GenerateReqInput, the answer tokenizer_manager.py's
// out_dict {text, output_ids, meta_info}), as slime, AReaL, SkyRL and verl's SGLang HTTP engine
// call it; plus GET /server_info (/get_server_info) and GET /health_generate. The body is
// translated into the OpenAI/vLLM field names and parsed by the one parser /v1/completions uses
// (request_fields.cpp), and run by the same run_generation; only the request and answer shapes
// are SGLang's (docs/peer_aliases.md, "SGLang's /generate").
#include "generation.h"

#include "fd/build_info.h"
#include "fd/shm/names.h"

#include <chrono>
#include <ctime>
#include <cstring>
#include <limits>
#include <map>
#include <set>

namespace fd::api {
namespace {

using nlohmann::json;
using engine::ChoiceEvent;
using engine::FinishReason;

/// sampling_params keys → the completions field parse_sampling reads (SGLang's SamplingParams).
const std::map<std::string, std::string> kSamplingNames = {
    {"max_new_tokens", "max_tokens"}, {"min_new_tokens", "min_tokens"}, {"no_stop_trim", "include_stop_str_in_output"},
    {"sampling_seed", "seed"}, {"seed", "seed"}, {"temperature", "temperature"}, {"top_p", "top_p"}, {"top_k", "top_k"},
    {"min_p", "min_p"}, {"n", "n"}, {"stop", "stop"}, {"stop_token_ids", "stop_token_ids"}, {"ignore_eos", "ignore_eos"},
    {"skip_special_tokens", "skip_special_tokens"}, {"spaces_between_special_tokens", "spaces_between_special_tokens"},
    {"frequency_penalty", "frequency_penalty"}, {"presence_penalty", "presence_penalty"},
    {"repetition_penalty", "repetition_penalty"}, {"logit_bias", "logit_bias"}};

using namespace neutral;

/// Fields SGLang defines that change nothing here at these values (null is always neutral); any
/// other value is a 400 naming the field. `any`: bookkeeping that never changes the output.
const NeutralField kTopNeutral[] = {
    {"input_embeds", false, only_null, "null"}, {"image_data", false, only_null, "null (text-only models)"},
    {"video_data", false, only_null, "null"}, {"audio_data", false, only_null, "null"}, {"mm_hashes", false, only_null, "null"},
    {"mm_content_hashes", false, only_null, "null"}, {"token_ids_logprob", false, only_null, "null"}, {"lora_path", false, only_null, "null"},
    {"lora_id", false, only_null, "null"}, {"custom_logit_processor", false, only_null, "null"},
    {"positional_embed_overrides", false, only_null, "null"}, {"bootstrap_host", false, only_null, "null"},
    {"bootstrap_port", false, only_null, "null"}, {"bootstrap_room", false, only_null, "null"}, {"bootstrap_pair_key", false, only_null, "null"},
    {"decode_tp_size", false, only_null, "null"}, {"routed_dp_rank", false, is_zero, "null or 0"},
    {"data_parallel_rank", false, is_zero, "null or 0"}, {"disagg_prefill_dp_rank", false, is_zero, "null or 0"},
    {"kv_router_hint", false, only_null, "null"}, {"session_params", false, only_null, "null"}, {"modalities", false, is_empty, "null or []"},
    {"extra_key", false, only_null, "null"}, {"return_hidden_states", false, is_false, "false"}, {"return_indexer_topk", false, is_false, "false"},
    {"return_sampling_mask", false, is_false, "false"}, {"return_flat_raw_top_logprobs", false, is_false, "false"},
    {"return_flat_raw_top_logprobs_b64", false, is_false, "false"}, {"return_entropy", false, is_false, "false"},
    {"return_bytes", false, is_false, "false"}, {"background", false, is_false, "false"}, {"require_reasoning", false, is_false, "false"},
    {"max_thinking_tokens", false, only_null, "null"}, {"use_audio_in_video", false, is_false, "false"}, {"video_config", false, only_null, "null"},
    {"need_wait_for_mm_inputs", false, is_false, "null or false"}, {"num_items_assigned", false, only_null, "null"},
    {"encoder_urls", false, only_null, "null"}, {"max_dynamic_patch", false, only_null, "null"}, {"min_dynamic_patch", false, only_null, "null"},
    {"image_max_dynamic_patch", false, only_null, "null"}, {"video_max_dynamic_patch", false, only_null, "null"},
    {"images_config", false, only_null, "null"}, {"multi_item_delimiter_indices", false, only_null, "null"},
    {"http_worker_ipc", false, only_null, "null"}, {"routed_experts_start_len", false, is_zero, "null or 0"},
    {"log_metrics", false, any, ""}, {"no_logs", false, any, ""}, {"session_id", false, any, ""},
    {"conversation_id", false, any, ""}, {"routing_key", false, any, ""}, {"custom_labels", false, any, ""},
    {"received_time", false, any, ""}, {"external_trace_header", false, any, ""}};
const NeutralField kSamplingNeutral[] = {
    {"stop_regex", false, is_empty, "null, \"\" or []"}, {"json_schema", false, only_null, "null (no guided decoding)"},
    {"regex", false, only_null, "null (no guided decoding)"}, {"ebnf", false, only_null, "null (no guided decoding)"},
    {"structural_tag", false, only_null, "null (no guided decoding)"}, {"custom_params", false, is_empty, "null or {}"},
    {"thinking_budget", false, only_null, "null"}, {"stream_interval", false, is_positive, "null or an integer >= 1 (chunks go out per step)"}};

/// A GenerateReqInput field that may be per prompt (a list): one value for all, else 400.
json uniform(const json & j, const char * key) {
    if (!j.contains(key)) { return nullptr; }
    const json & v = j[key];
    if (!v.is_array()) { return v; }
    for (const auto & e : v) {
        if (e != v.front()) { bad(key, fmt::format("per-prompt '{}' values differ; send one request per value", key)); }
    }
    return v.empty() ? json(nullptr) : v.front();
}

/// Standard base64 (RFC 4648, padded) of `n` bytes: SGLang's routed_experts encoding.
std::string base64(const uint8_t * p, size_t n) {
    static constexpr char kAlphabet[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    std::string out;
    out.reserve((n + 2) / 3 * 4);
    for (size_t i = 0; i < n; i += 3) {
        const uint32_t v = uint32_t(p[i]) << 16 | (i + 1 < n ? uint32_t(p[i + 1]) << 8 : 0u) | (i + 2 < n ? uint32_t(p[i + 2]) : 0u);
        out += kAlphabet[v >> 18 & 63];
        out += kAlphabet[v >> 12 & 63];
        out += i + 1 < n ? kAlphabet[v >> 6 & 63] : '=';
        out += i + 2 < n ? kAlphabet[v & 63] : '=';
    }
    return out;
}

/// The parsed request: what run_generation needs plus how to shape the answer.
struct SglRequest {
    engine::GenerateRequest  gen;
    StreamOptions            opts;
    bool                     single = true;     ///< one prompt, n 1: an object, else a list in SGLang's order
    bool                     logprobs = false;  ///< return_logprob
    int32_t                  start = -1;        ///< logprob_start_len (-1: the last prompt token only)
    int32_t                  top_n = 0;         ///< top_logprobs_num
    bool                     lp_text = false;   ///< return_text_in_logprobs
    bool                     prompt_ids = false;  ///< return_prompt_token_ids
    bool                     spec = false;      ///< --speculative-config on: the finished meta_info has spec_*
    std::vector<std::string> ids;               ///< [n_choices] meta_info.id
    std::chrono::steady_clock::time_point t0 = std::chrono::steady_clock::now();
};

/// Rethrow an error of the completions parser under SGLang's field names.
[[noreturn]] void rename(const Error & e) {
    std::string p = e.param(), msg = e.what();
    for (const auto & [sgl, ours] : kSamplingNames) {
        if (p == ours && sgl != "seed") { p = "sampling_params." + sgl; }
    }
    for (const auto & [from, to] : {std::pair{"max_tokens", "max_new_tokens"}, {"min_tokens", "min_new_tokens"},
                                    {"include_stop_str_in_output", "no_stop_trim"}}) {
        for (size_t at = msg.find(from); at != std::string::npos; at = msg.find(from, at + 1)) { msg.replace(at, std::strlen(from), to); }
    }
    throw Error(e.code(), msg, p);
}

/// `text` or `input_ids` into gen.prompts; sets `single`.
void parse_prompts(ApiContext & ctx, const json & j, SglRequest & r) {
    const bool has_text = j.contains("text") && !j["text"].is_null(), has_ids = j.contains("input_ids") && !j["input_ids"].is_null();
    if (has_text == has_ids) { bad(has_text ? "input_ids" : "text", "send exactly one of 'text' and 'input_ids'"); }
    if (has_text) {
        const json & t = j["text"];
        r.single = t.is_string();
        for (const auto & s : r.single ? json::array({t}) : t) {
            if (!s.is_string()) { bad("text", "'text' must be a string or a list of strings"); }
            r.gen.prompts.push_back(ctx.tok->encode(s.get<std::string>(), true));  // SGLang: the tokenizer's special tokens (BOS)
        }
    } else {
        const json & ids = j["input_ids"];
        if (!ids.is_array()) { bad("input_ids", "'input_ids' must be a list of token ids or a list of such lists"); }
        const int32_t vocab = ctx.engine->model_config().vocab_size;
        r.single = ids.empty() || !ids.front().is_array();
        if (r.single) {
            r.gen.prompts.push_back(token_prompt(ids, vocab, 0, "input_ids"));
        } else {
            for (size_t i = 0; i < ids.size(); ++i) {
                if (!ids[i].is_array()) { bad("input_ids", "'input_ids': a list of lists must hold only lists"); }
                r.gen.prompts.push_back(token_prompt(ids[i], vocab, i, "input_ids"));
            }
        }
    }
    if (r.gen.prompts.empty()) { bad(has_text ? "text" : "input_ids", "the batch is empty"); }
    for (size_t i = 0; i < r.gen.prompts.size(); ++i) {
        if (r.gen.prompts[i].empty()) { bad(has_text ? "text" : "input_ids", fmt::format("prompt {} is empty", i)); }
    }
}

/// sampling_params (one dict, or a list of equal ones) as the completions fields.
json sampling_as_completions(const json & j) {
    json sp = uniform(j, "sampling_params"), out = json::object();
    if (sp.is_null()) { return out; }
    if (!sp.is_object()) { bad("sampling_params", "'sampling_params' must be an object"); }
    if (sp.contains("seed") && sp.contains("sampling_seed") && !sp["seed"].is_null() && !sp["sampling_seed"].is_null() &&
        sp["seed"] != sp["sampling_seed"]) {
        bad("sampling_params.sampling_seed", "'sampling_seed' and 'seed' differ; send one");
    }
    for (const auto & [key, v] : sp.items()) {
        if (const auto it = kSamplingNames.find(key); it != kSamplingNames.end()) {
            if (!v.is_null()) { out[it->second] = v; }
        } else if (!check_neutral(kSamplingNeutral, key, v, "sampling_params." + key)) {
            bad("sampling_params." + key, fmt::format("unknown field 'sampling_params.{}'", key));
        }
    }
    return out;
}

SglRequest parse(ApiContext & ctx, const std::string & body) {
    const json j = parse_body(body);
    static const std::set<std::string> kKnown = {"text", "input_ids", "sampling_params", "return_logprob", "logprob_start_len",
                                                 "top_logprobs_num", "return_text_in_logprobs", "stream", "rid",
                                                 "return_routed_experts", "return_prompt_token_ids", "cache_salt", "priority"};
    for (const auto & [key, v] : j.items()) {
        if (kKnown.count(key) == 0 && !check_neutral(kTopNeutral, key, v, key)) { bad(key, fmt::format("unknown field '{}'", key)); }
    }
    SglRequest r;
    r.spec = ctx.engine->config().speculative.enabled();
    parse_prompts(ctx, j, r);
    json c = sampling_as_completions(j);
    for (const char * k : {"return_routed_experts", "cache_salt", "priority", "stream"}) {
        if (j.contains(k)) { c[k] = j[k]; }
    }
    auto flag = [&](const char * k) {
        const json v = uniform(j, k);
        if (!v.is_null() && !v.is_boolean()) { bad(k, fmt::format("'{}' must be a boolean", k)); }
        return v.is_boolean() && v.get<bool>();
    };
    auto integer = [&](const char * k, int32_t dflt, int32_t lo, int32_t hi) {
        const json v = uniform(j, k);
        if (v.is_null()) { return dflt; }
        if (!v.is_number_integer() || v.get<int64_t>() < lo || v.get<int64_t>() > hi) {
            bad(k, fmt::format("'{}' must be an integer in [{}, {}], got {}", k, lo, hi, brief(v)));
        }
        return v.get<int32_t>();
    };
    r.logprobs   = flag("return_logprob");
    r.top_n      = integer("top_logprobs_num", 0, 0, ctx.cfg.max_logprobs);
    r.start      = integer("logprob_start_len", -1, -1, std::numeric_limits<int32_t>::max());
    r.lp_text    = flag("return_text_in_logprobs");
    r.prompt_ids = flag("return_prompt_token_ids");
    try {
        parse_vllm_fields(ctx, c, r.gen);  // return_routed_experts, cache_salt, priority
        // SGLang: max_new_tokens absent 128; null = the rest of the context
        size_t longest = 0;
        for (const auto & p : r.gen.prompts) { longest = std::max(longest, p.size()); }
        const bool rest = j.contains("sampling_params") && j["sampling_params"].is_object() &&
                          j["sampling_params"].contains("max_new_tokens") && j["sampling_params"]["max_new_tokens"].is_null();
        const int32_t dflt = rest ? std::max(0, ctx.engine->config().max_model_len - static_cast<int32_t>(longest)) : 128;
        r.opts = parse_sampling(ctx, c, r.gen, {"max_tokens"}, dflt, /*model_defaults=*/false);
        auto & sp = r.gen.params;
        sp.logprobs = r.logprobs ? r.top_n : -1;
        if (r.logprobs && r.start >= 0) {
            for (const auto & p : r.gen.prompts) {
                if (r.start >= static_cast<int32_t>(p.size())) {
                    bad("logprob_start_len", fmt::format("'logprob_start_len' ({}) must be less than the prompt's {} tokens", r.start, p.size()));
                }
            }
            sp.prompt_logprobs = r.top_n;
        }
        if (sp.max_tokens == 0 && sp.prompt_logprobs < 0) {
            bad("max_tokens", "'max_tokens' 0 only scores the prompt: send \"return_logprob\": true with \"logprob_start_len\" >= 0");
        }
        check_lengths(ctx, r.gen, j.contains("text") && !j["text"].is_null() ? "text" : "input_ids");
    } catch (const Error & e) {
        rename(e);
    }
    // rid: a string (a prefix in a batch) or one per prompt; POST /abort_request finds the request by any
    const int32_t n = r.gen.n, n_prompts = static_cast<int32_t>(r.gen.prompts.size());
    r.single = r.single && n == 1;
    std::vector<std::string> per_prompt;
    const json rid = j.value("rid", json(nullptr));
    auto valid = [](const json & v) { return v.is_string() && shm::is_valid_request_id(v.get<std::string>()); };
    if (rid.is_array()) {
        if (static_cast<int32_t>(rid.size()) != n_prompts) { bad("rid", fmt::format("'rid' lists {} ids for {} prompts", rid.size(), n_prompts)); }
        for (const auto & e : rid) {
            if (!valid(e)) { bad("rid", fmt::format("each 'rid' must be 1..128 printable ASCII characters without spaces, got {}", brief(e))); }
            per_prompt.push_back(e.get<std::string>());
            r.gen.request_ids.push_back(per_prompt.back());
        }
    } else if (!rid.is_null()) {
        if (!valid(rid)) { bad("rid", fmt::format("'rid' must be 1..128 printable ASCII characters without spaces, got {}", brief(rid))); }
        r.opts.request_id = rid.get<std::string>();
    }
    if (r.opts.request_id.empty() && per_prompt.empty()) { r.opts.request_id = new_id("gen").substr(4); }  // SGLang's uuid4().hex
    for (int32_t c = 0; c < n_prompts * n; ++c) {
        const std::string base = per_prompt.empty() ? r.opts.request_id : per_prompt[c / n];
        r.ids.push_back(r.single || (!per_prompt.empty() && n == 1) ? base
                        : per_prompt.empty()                        ? fmt::format("{}-{}", base, c)
                                                                    : fmt::format("{}-{}", base, c % n));
    }
    return r;
}

/// SGLang's BaseFinishReason.to_json(), or null while running.
json finish_json(const ChoiceAcc & a, bool finished) {
    if (!finished) { return nullptr; }
    switch (a.finish) {
        case FinishReason::stop:  // matched: the stop string, else the stop token (the tokenizer's EOS included)
            if (a.stop_reason.str) { return {{"type", "stop"}, {"matched", *a.stop_reason.str}}; }
            if (a.stop_reason.token_id) { return {{"type", "stop"}, {"matched", *a.stop_reason.token_id}}; }
            return {{"type", "stop"}, {"matched", a.token_ids.empty() ? json(nullptr) : json(a.token_ids.back())}};
        case FinishReason::length: return {{"type", "length"}, {"length", a.token_ids.size()}};
        case FinishReason::error:
            return {{"type", "abort"}, {"message", "the request failed on the server"}, {"status_code", 500}};
        default:
            return {{"type", "abort"}, {"message", "aborted: pause, /abort_request, sleep or shutdown"}};
    }
}

/// [logprob, token_id, text|null] (tokenizer_manager's detokenize_logprob_tokens).
json lp_entry(const SglRequest & r, const tokenizer::Tokenizer & tok, json logprob, int32_t id) {
    return json::array({std::move(logprob), id, r.lp_text ? json(token_string(tok, id, false)) : json(nullptr)});
}
json top_entries(const SglRequest & r, const tokenizer::Tokenizer & tok, const engine::TokenLogprob & lp) {
    json out = json::array();
    for (size_t k = 0; k < lp.top.size() && static_cast<int32_t>(k) < r.top_n; ++k) { out.push_back(lp_entry(r, tok, lp.top[k].second, lp.top[k].first)); }
    return out;
}

/// SGLang's out_dict of choice `c`: {text, output_ids, meta_info} (cumulative, also when streamed).
json out_dict(const SglRequest & r, const tokenizer::Tokenizer & tok, int32_t c, const ChoiceAcc & a, bool finished) {
    const auto & prompt = r.gen.prompts[c / r.gen.n];
    const auto   n_out  = static_cast<int32_t>(a.token_ids.size());
    json m = {{"id", r.ids[c]}, {"finish_reason", finish_json(a, finished)}, {"prompt_tokens", a.n_prompt},
              {"weight_version", a.weight_version}};
    if (r.logprobs) {  // input: from logprob_start_len (-1: the last prompt token), the first without a logprob
        const int32_t s = r.start < 0 ? static_cast<int32_t>(prompt.size()) - 1 : r.start;
        json in = json::array(), in_top = json::array(), out = json::array(), out_top = json::array();
        for (int32_t i = s; i < static_cast<int32_t>(prompt.size()); ++i) {
            const bool known = i > s && i - 1 < static_cast<int32_t>(a.prompt_logprobs.size());
            in.push_back(lp_entry(r, tok, known ? json(a.prompt_logprobs[i - 1].logprob) : json(nullptr), prompt[i]));
            in_top.push_back(known && r.top_n > 0 ? top_entries(r, tok, a.prompt_logprobs[i - 1]) : json(nullptr));
        }
        for (const auto & lp : a.logprobs) {
            out.push_back(lp_entry(r, tok, lp.logprob, lp.id));
            out_top.push_back(top_entries(r, tok, lp));
        }
        m["input_token_logprobs"]         = std::move(in);
        m["output_token_logprobs"]        = std::move(out);
        m["output_token_logprobs_length"] = a.logprobs.size();
        if (r.top_n > 0) {
            m["input_top_logprobs"]  = std::move(in_top);
            m["output_top_logprobs"] = std::move(out_top);
        }
    }
    m["completion_tokens"] = n_out;
    m["cached_tokens"]     = a.n_cached;
    // SGLang's spans: {version, start, end} over generated tokens, end exclusive; one span unless
    // the choice was kept across an update (a keep pause: fdrollout's weight_versions)
    json spans = json::array();
    for (const auto & sp : a.weight_versions) { spans.push_back({{"version", sp.version}, {"start", sp.first_token}, {"end", sp.last_token + 1}}); }
    if (spans.empty()) { spans.push_back({{"version", a.weight_version}, {"start", 0}, {"end", n_out}}); }
    m["weight_versions"] = std::move(spans);
    if (a.routed_experts) {  // SGLang: base64 of int32 [prompt + completion - 1, layers * top_k]
        const auto & ids = a.routed_experts->ids;
        m["routed_experts"] = base64(reinterpret_cast<const uint8_t *>(ids.data()), ids.size() * sizeof(int32_t));
    }
    if (finished) {
        m["e2e_latency"] = std::chrono::duration<double>(std::chrono::steady_clock::now() - r.t0).count();
    }
    if (finished && r.spec && a.spec.n_verify > 0) {
        // SGLang's per-request counters (tokenizer_manager.py _calculate_spec_decoding_metrics: on
        // the finished answer, once a decode step ran), under its v0.5 names (slime's
        // Sample.SpecInfo reads spec_accept_token_num, spec_draft_token_num, spec_verify_ct) and
        // its current ones (spec_num_correct_drafts, spec_num_proposed_drafts).
        const engine::SpecCounts & sc = a.spec;
        m["spec_verify_ct"]           = sc.n_verify;
        m["spec_accept_token_num"]    = sc.n_accepted;
        m["spec_draft_token_num"]     = sc.n_draft_tokens;
        m["spec_num_correct_drafts"]  = sc.n_accepted;
        m["spec_num_proposed_drafts"] = sc.n_draft_tokens;
        m["spec_accept_rate"]   = sc.n_draft_tokens > 0 ? static_cast<double>(sc.n_accepted) / sc.n_draft_tokens : 0.0;
        m["spec_accept_length"] = static_cast<double>(n_out) / sc.n_verify;
    }
    json o = {{"text", a.text}, {"output_ids", a.token_ids}, {"meta_info", std::move(m)}};
    if (r.prompt_ids) { o["prompt_token_ids"] = prompt; }
    return o;
}

/// ServerArgs.speculative_algorithm as SGLang's /server_info shows it: "NGRAM"; MTP is SGLang's
/// NEXTN, which its ServerArgs turns into "EAGLE" at start-up (server_args.py
/// _handle_speculative_decoding), so an SGLang server started with NEXTN answers "EAGLE"; null when off.
json sglang_speculative_algorithm(spec::SpecMethod m) {
    switch (m) {
        case spec::SpecMethod::ngram: return "NGRAM";
        case spec::SpecMethod::mtp: return "EAGLE";
        default: return nullptr;
    }
}

}  // namespace

void post_sglang_generate(ApiContext & ctx, const Request & req, Response & res) {
    auto         r   = std::make_shared<const SglRequest>(parse(ctx, req.body));
    const auto * tok = ctx.tok;
    ResponseFormat f;
    f.object = f.chunk_object = "sglang.generate";
    f.id_prefix    = "generate";
    f.choice       = [](int32_t, const ChoiceAcc &) { return json::object(); };  // the body is built whole below
    f.body         = [r, tok](const std::vector<ChoiceAcc> & acc, json & body) {
        json list = json::array();
        for (int32_t c = 0; c < static_cast<int32_t>(acc.size()); ++c) { list.push_back(out_dict(*r, *tok, c, acc[c], true)); }
        body = r->single ? std::move(list[0]) : std::move(list);
    };
    // Streamed: SGLang's default (incremental_streaming_output off) sends each chunk cumulative.
    auto acc = std::make_shared<std::vector<ChoiceAcc>>(r->gen.prompts.size() * r->gen.n);
    f.chunk  = [r, tok, acc](const ChoiceEvent & ev, bool) {
        ChoiceAcc & a = (*acc)[ev.choice];
        a.add(ChoiceEvent(ev));
        json o = out_dict(*r, *tok, ev.choice, a, ev.finish != FinishReason::none);
        if (!r->single) { o["index"] = ev.choice; }  // SGLang's batch stream: the position in the answer list
        return o;
    };
    run_generation(ctx, req, r->gen, r->opts, f, res);
}

/// SGLang's server_info: its ServerArgs fields that have a meaning here, with this daemon's values
/// (slime's external-engine discovery reads tp_size, pp_size, ep_size, dp_size (num_gpus: tp_size x pp_size),
/// disaggregation_mode, encoder_only and compares enable_memory_saver, dtype,
/// enable_return_routed_experts with its own flags: slime/backends/sglang_utils/external.py,
/// sglang_engine.py _init_external; slime before 2026-06 (03b32d8) also asserts host, port,
/// node_rank, gpu_id_step and base_gpu_id equal to what it expects of an engine it started).
void get_sglang_server_info(ApiContext & ctx, const Request &, Response & res) {
    const auto   st  = ctx.engine->stats();
    const auto & ec  = ctx.engine->config();
    const int32_t tp = st.state.tensor_parallel_size;
    json info = {
        {"model_path", ctx.cfg.model_dir}, {"tokenizer_path", ctx.cfg.model_dir}, {"served_model_name", ctx.cfg.served_model_name},
        {"weight_version", st.state.weight_version}, {"version", kVersion}, {"engine", "fdrollout"},
        {"tp_size", tp}, {"pp_size", 1}, {"dp_size", 1}, {"ep_size", ec.expert_parallel_size}, {"nnodes", 1},
        // As bound (--host, --port). Only node 0 serves HTTP (a --node-rank > 0 runs the node agent:
        // main.cpp), so node_rank is 0; one GPU per rank from device 0, as SGLang's defaults.
        {"host", ctx.cfg.host}, {"port", ctx.cfg.port}, {"node_rank", 0}, {"gpu_id_step", 1}, {"base_gpu_id", 0},
        {"context_length", ec.max_model_len}, {"max_req_input_len", ec.max_model_len - 1},
        {"max_total_num_tokens", st.n_kv_blocks_total * st.kv_block_size}, {"page_size", st.kv_block_size},
        {"max_running_requests", ec.scheduler.max_num_seqs}, {"chunked_prefill_size", ec.scheduler.max_num_batched_tokens},
        {"dtype", ec.compute_dtype}, {"kv_cache_dtype", st.kv_cache_dtype},
        {"enable_memory_saver", ctx.control->config().dynamic_load_weight},  // release/resume_memory_occupation work
        {"enable_return_routed_experts", ctx.cfg.enable_return_routed_experts}, {"disaggregation_mode", "null"},
        {"encoder_only", false}, {"is_embedding", false}, {"skip_tokenizer_init", false}, {"enable_metrics", true},
        {"speculative_algorithm", sglang_speculative_algorithm(ec.speculative.method)},
        {"internal_states", json::array({{{"weight_version", st.state.weight_version}, {"paused", st.state.paused},
                                          {"num_running_reqs", st.n_running}, {"num_waiting_reqs", st.n_waiting}}})}};
    res.set_content(dump(info), "application/json");
}

/// SGLang's GET /v1/loads (entrypoints/v1_loads.py get_loads): {"timestamp", "version",
/// "dp_rank_count", "loads": [per DP rank: num_running_reqs, num_waiting_reqs, num_total_reqs,
/// token use], "aggregate": {total_running_reqs, total_waiting_reqs, total_reqs, ...}}. One DP
/// rank here. slime polls ?include=core after abort_request {"abort_all": true} until the
/// requests are gone (server_control.py abort_server_until_idle, num_requests_from_load). Only the
/// core section exists: the other `include` names are accepted and add nothing; ?dp_rank=N other
/// than 0 answers no loads (as SGLang for a rank it lacks); ?format=prometheus is GET /metrics.
void get_sglang_loads(ApiContext & ctx, const Request & req, Response & res) {
    if (req.has_param("format") && req.get_param_value("format") != "json") {
        throw Error(Errc::invalid_argument, fmt::format("format '{}': only json here; GET /metrics has the Prometheus text",
                                                        req.get_param_value("format")), "format");
    }
    bool rank0 = true;
    if (req.has_param("dp_rank")) {
        const std::string v = req.get_param_value("dp_rank");
        if (v.empty() || v.find_first_not_of("0123456789") != std::string::npos) {
            throw Error(Errc::invalid_argument, fmt::format("dp_rank '{}' must be a non-negative integer", v), "dp_rank");
        }
        rank0 = v.find_first_not_of('0') == std::string::npos;
    }
    const auto st = ctx.engine->stats();
    const int64_t used = st.n_kv_blocks_used * st.kv_block_size, total = st.n_kv_blocks_total * st.kv_block_size;
    const double usage = total > 0 ? static_cast<double>(used) / static_cast<double>(total) : 0.0;
    json loads = json::array();
    if (rank0) {
        loads.push_back({{"dp_rank", 0}, {"num_running_reqs", st.n_running}, {"num_waiting_reqs", st.n_waiting},
                         {"num_total_reqs", st.n_running + st.n_waiting}, {"num_used_tokens", used}, {"max_total_num_tokens", total},
                         {"token_usage", usage}, {"max_running_requests", ctx.engine->config().scheduler.max_num_seqs}});
    }
    const int64_t running = rank0 ? st.n_running : 0, waiting = rank0 ? st.n_waiting : 0;
    const std::time_t now = std::time(nullptr);
    std::tm utc{};
    char stamp[40] = "";
    std::strftime(stamp, sizeof stamp, "%Y-%m-%dT%H:%M:%S+00:00", gmtime_r(&now, &utc));
    json body = {{"timestamp", stamp},
                 {"version", kVersion}, {"dp_rank_count", loads.size()}, {"loads", loads},
                 {"aggregate", {{"total_running_reqs", running}, {"total_waiting_reqs", waiting}, {"total_reqs", running + waiting},
                                {"total_used_tokens", rank0 ? used : 0}, {"total_tokens", rank0 ? total : 0},
                                {"avg_token_usage", rank0 ? usage : 0.0}}}};
    res.set_content(dump(body), "application/json");
}

/// SGLang's /health_generate: a one-token greedy generation; 200 once it is answered, the
/// generation's error otherwise (503 engine_paused while paused or asleep).
void get_sglang_health_generate(ApiContext & ctx, const Request & req, Response & res) {
    engine::GenerateRequest gen;
    gen.prompts            = {{ctx.tok->bos_id().value_or(0)}};
    gen.params.max_tokens  = 1;
    gen.params.temperature = 0.0f;
    ResponseFormat f;
    f.object = f.chunk_object = "sglang.health_generate";
    f.id_prefix = "health";
    f.choice    = [](int32_t, const ChoiceAcc &) { return json::object(); };
    f.body      = [](const std::vector<ChoiceAcc> &, json & body) { body = json::object(); };  // SGLang: an empty 200
    run_generation(ctx, req, std::move(gen), StreamOptions{}, f, res);
}

}  // namespace fd::api
