// POST /v1/completions: the prompt forms (text, texts, token ids, lists of them), echo and the
// legacy logprobs shape; the rest is shared with chat (generation.h).
#include "generation.h"

#include "fd/tokenizer/incremental_decoder.h"

#include <algorithm>

namespace fd::api {
namespace {

using nlohmann::json;
using engine::ChoiceEvent;
using engine::FinishReason;

struct CompletionRequest {
    engine::GenerateRequest  gen;
    std::vector<std::string> prompt_texts;  ///< [n_prompts] with echo, else empty (token-id prompts are decoded only for echo)
    std::vector<int32_t>     prompt_chars;  ///< [n_prompts] code points of each prompt text
    std::vector<std::vector<int32_t>> prompt_offsets;  ///< [n_prompts][n_tokens] echo text_offset of each prompt token
    StreamOptions            opts;
    bool                     echo = false;
    bool                     prompt_lps = false;  ///< prompt logprobs are computed (prompt_logprobs, or echo + logprobs)
    int32_t                  prompt_lps_k = -1;   ///< alternatives per row of the prompt_logprobs field: the request's, else logprobs (vLLM)
};

int32_t count_code_points(const std::string & s) {
    return static_cast<int32_t>(std::count_if(s.begin(), s.end(), [](char c) { return (static_cast<unsigned char>(c) & 0xC0) != 0x80; }));
}

/// Character offset of each prompt token's text in `text` (the echoed prompt): code points of
/// the decoded tokens before it, at most the text's length.
std::vector<int32_t> prompt_offsets(const tokenizer::Tokenizer & tok, const std::vector<int32_t> & ids, int32_t n_chars) {
    tokenizer::IncrementalDecoder dec(tok, {});
    std::vector<int32_t>          out;
    int32_t                       off = 0;
    for (int32_t id : ids) {
        out.push_back(std::min(off, n_chars));
        off += count_code_points(dec.push(id));
    }
    return out;
}

CompletionRequest parse(ApiContext & ctx, const std::string & body) {
    const json j = parse_body(body);
    static const std::set<std::string> kKnown = {
        "model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "n", "logprobs", "seed", "stop",
        "stop_token_ids", "ignore_eos", "stream", "echo", "stream_options", "user",
        "frequency_penalty", "presence_penalty", "repetition_penalty", "logit_bias", "min_tokens", "min_p",
        "skip_special_tokens", "spaces_between_special_tokens", "prompt_logprobs", "include_stop_str_in_output",
        "return_tokens_as_token_ids"};
    check_fields(j, kKnown);
    check_model(ctx, j);
    const auto & mc = ctx.engine->model_config();
    CompletionRequest r;

    // prompt: string | [string] | [int] | [[int]]; text is encoded with the tokenizer's special
    // tokens (BOS) unless add_special_tokens is false (vLLM's field, default true here)
    bool add_special = true;
    if (j.contains("add_special_tokens") && !j["add_special_tokens"].is_null()) {
        if (!j["add_special_tokens"].is_boolean()) { bad("add_special_tokens", "'add_special_tokens' must be a boolean"); }
        add_special = j["add_special_tokens"].get<bool>();
    }
    if (!j.contains("prompt")) { bad("prompt", "'prompt' is required"); }
    const json & p = j["prompt"];
    if (p.is_string()) {
        r.prompt_texts.push_back(p.get<std::string>());
        r.gen.prompts.push_back(ctx.tok->encode(r.prompt_texts.back(), add_special));
    } else if (p.is_array() && !p.empty() && p[0].is_string()) {
        for (const auto & s : p) {
            if (!s.is_string()) { bad("prompt", "a list prompt must hold only strings or only token ids"); }
            r.prompt_texts.push_back(s.get<std::string>());
            r.gen.prompts.push_back(ctx.tok->encode(r.prompt_texts.back(), add_special));
        }
    } else if (p.is_array() && !p.empty() && p[0].is_array()) {
        for (size_t i = 0; i < p.size(); ++i) {
            if (!p[i].is_array()) { bad("prompt", "'prompt': a list of token-id lists must hold only lists"); }
            r.gen.prompts.push_back(token_prompt(p[i], mc.vocab_size, i, "prompt"));
        }
    } else if (p.is_array() && !p.empty()) {
        r.gen.prompts.push_back(token_prompt(p, mc.vocab_size, 0, "prompt"));
    } else {
        bad("prompt", "'prompt' must be a string, a list of strings, a list of token ids or a list of token-id lists, and not empty");
    }
    for (size_t i = 0; i < r.gen.prompts.size(); ++i) {
        if (r.gen.prompts[i].empty()) { bad("prompt", fmt::format("prompt {} is empty", i)); }
    }
    const bool truncated = parse_vllm_fields(ctx, j, r.gen);  // truncate_prompt_tokens cuts the prompts here

    // vLLM's CompletionRequest: max_tokens absent = 16; an explicit null = the rest of the context
    // (of the longest prompt here, one max_tokens serving every prompt; at least 1: a prompt that
    // fills it is check_lengths' 400).
    size_t longest = 0;
    for (const auto & p : r.gen.prompts) { longest = std::max(longest, p.size()); }
    const int64_t room = static_cast<int64_t>(ctx.engine->config().max_model_len) - static_cast<int64_t>(longest);
    r.opts = parse_sampling(ctx, j, r.gen, {"max_tokens"}, j.contains("max_tokens") ? static_cast<int32_t>(std::max<int64_t>(room, 1)) : 16);
    auto & sp = r.gen.params;
    sp.logprobs = -1;
    if (j.contains("logprobs") && !j["logprobs"].is_null()) {
        const json & lp = j["logprobs"];
        // absent or null = off; else the number of top alternatives, 0..max (OpenAI)
        const bool in_range = lp.is_number_unsigned() ? lp.get<uint64_t>() <= static_cast<uint64_t>(ctx.cfg.max_logprobs)
                              : lp.is_number_integer() && lp.get<int64_t>() >= 0 && lp.get<int64_t>() <= ctx.cfg.max_logprobs;
        if (!in_range) {
            bad("logprobs", fmt::format("'logprobs' must be an integer in [0, {}], got {}", ctx.cfg.max_logprobs, brief(lp)));
        }
        sp.logprobs = lp.get<int32_t>();
    }
    if (j.contains("echo") && !j["echo"].is_null()) {
        if (!j["echo"].is_boolean()) { bad("echo", "'echo' must be a boolean"); }
        r.echo = j["echo"].get<bool>();
    }
    const bool detok = sp.detokenize;  // false: no text anywhere, the echoed prompt's included
    r.prompt_texts = echo_prompt_texts(*ctx.tok, r.gen.prompts, detok ? std::move(r.prompt_texts) : std::vector<std::string>{}, truncated,
                                       r.echo && detok);
    if (r.echo && !detok) { r.prompt_texts.assign(r.gen.prompts.size(), ""); }
    if (sp.max_tokens == 0 && !r.echo) { bad("max_tokens", "'max_tokens' must be >= 1 (0 only with \"echo\": true, to score the prompt)"); }
    // The prompt_logprobs field has the rows the request asked for; echoed tokens carry their
    // logprobs with `logprobs` alternatives (vLLM: prompt_logprobs defaults to logprobs), so the
    // engine computes the larger of the two and each answer takes its own.
    r.prompt_lps_k = sp.prompt_logprobs >= 0 ? sp.prompt_logprobs : sp.logprobs;
    if (r.echo && sp.logprobs >= 0) {
        sp.prompt_logprobs = std::max(sp.prompt_logprobs, sp.logprobs);
        for (size_t i = 0; i < r.gen.prompts.size(); ++i) {
            r.prompt_chars.push_back(count_code_points(r.prompt_texts[i]));
            r.prompt_offsets.push_back(detok ? prompt_offsets(*ctx.tok, r.gen.prompts[i], r.prompt_chars.back())
                                             : std::vector<int32_t>(r.gen.prompts[i].size(), 0));
        }
    } else if (r.echo) {
        for (const auto & t : r.prompt_texts) { r.prompt_chars.push_back(count_code_points(t)); }
    }
    r.prompt_lps = sp.prompt_logprobs >= 0;  // as vLLM: also when echo + logprobs asked for them
    check_lengths(ctx, r.gen, "prompt");
    cap_max_tokens(ctx, sp);
    return r;
}

/// The legacy completions logprobs of some tokens: {tokens, token_logprobs, top_logprobs,
/// text_offset}. `offsets` are code points into the returned text; `base` is added to each.
struct LegacyLogprobs {
    nlohmann::json tokens = json::array(), token_lps = json::array(), top = json::array(), offsets = json::array();

    void add(const tokenizer::Tokenizer & tok, const std::vector<engine::TokenLogprob> & lps, const std::vector<int32_t> & offs,
             int32_t base, bool as_ids, int32_t k) {
        for (size_t i = 0; i < lps.size(); ++i) {
            const auto & lp = lps[i];
            tokens.push_back(token_string(tok, lp.id, as_ids));
            token_lps.push_back(lp.logprob);
            offsets.push_back(base + (i < offs.size() ? offs[i] : 0));
            json t = json::object();
            for (size_t r = 0; r < lp.top.size() && static_cast<int32_t>(r) < k; ++r) { t[token_string(tok, lp.top[r].first, as_ids)] = lp.top[r].second; }
            // The chosen token is always there (OpenAI: "the logprob of the sampled token, up to
            // logprobs+1"; vLLM), also when it is not among the top k, and alone for logprobs 0.
            t[token_string(tok, lp.id, as_ids)] = lp.logprob;
            top.push_back(t);
        }
    }
    /// The echoed prompt's tokens: the first has no logprob (null), the rest theirs.
    void add_prompt(const tokenizer::Tokenizer & tok, const std::vector<int32_t> & ids, const std::vector<engine::TokenLogprob> & lps,
                    const std::vector<int32_t> & offs, bool as_ids, int32_t k) {
        if (ids.empty()) { return; }
        tokens.push_back(token_string(tok, ids[0], as_ids));
        token_lps.push_back(nullptr);
        top.push_back(nullptr);
        offsets.push_back(offs.empty() ? 0 : offs[0]);
        add(tok, lps, std::vector<int32_t>(offs.begin() + std::min<size_t>(1, offs.size()), offs.end()), 0, as_ids, k);
    }
    json to_json() const { return {{"tokens", tokens}, {"token_logprobs", token_lps}, {"top_logprobs", top}, {"text_offset", offsets}}; }
};

}  // namespace

std::vector<std::string> echo_prompt_texts(const tokenizer::Tokenizer & tok, const std::vector<std::vector<int32_t>> & prompts,
                                           std::vector<std::string> texts, bool truncated, bool echo) {
    if (!echo) { return {}; }
    for (size_t i = 0; i < prompts.size(); ++i) {
        if (truncated && i < texts.size()) { texts[i] = tok.decode(prompts[i]); }  // what ran
        if (texts.size() <= i) { texts.push_back(tok.decode(prompts[i])); }
    }
    return texts;
}

void post_completions(ApiContext & ctx, const Request & req, Response & res) {
    auto r            = std::make_shared<const CompletionRequest>(parse(ctx, req.body));
    const auto * tok  = ctx.tok;
    const int32_t n   = r->gen.n;
    const int32_t k   = r->gen.params.logprobs;
    const bool    lps = k >= 0;
    const bool    ids = r->opts.tokens_as_ids;
    ResponseFormat f;
    f.object       = "text_completion";
    f.chunk_object = "text_completion";
    f.id_prefix    = "cmpl";
    f.choice       = [r, tok, n, k, lps, ids](int32_t c, const ChoiceAcc & a) {
        const int32_t     ip     = c / n;
        const std::string prefix = r->echo ? r->prompt_texts[ip] : "";
        json logprobs = nullptr;
        if (lps) {
            LegacyLogprobs l;
            if (r->echo) { l.add_prompt(*tok, r->gen.prompts[ip], a.prompt_logprobs, r->prompt_offsets[ip], ids, k); }
            l.add(*tok, a.logprobs, a.text_offsets, r->echo ? r->prompt_chars[ip] : 0, ids, k);
            logprobs = l.to_json();
        }
        return json{{"index", c},
                    {"text", prefix + a.text},
                    {"logprobs", logprobs},
                    {"finish_reason", engine::to_string(a.finish)},
                    {"stop_reason", stop_reason_json(a.stop_reason)},
                    {"prompt_logprobs", r->prompt_lps ? prompt_logprobs_json(*tok, a.prompt_logprobs, r->gen.params.detokenize, r->prompt_lps_k) : json(nullptr)},
                    {"prompt_token_ids", r->gen.prompts[ip]},
                    {"token_ids", a.token_ids}};
    };
    f.chunk_choice = [r, tok, n, k, lps, ids](const ChoiceEvent & ev, bool first) {
        const int32_t ip   = ev.choice / n;
        std::string   text = ev.text;
        const bool    done = ev.finish != FinishReason::none;
        json choice = {{"index", ev.choice}, {"token_ids", ev.token_ids},
                       {"finish_reason", done ? json(engine::to_string(ev.finish)) : json(nullptr)},
                       {"stop_reason", done ? stop_reason_json(ev.stop_reason) : json(nullptr)}};
        if (first) {
            choice["prompt_token_ids"] = r->gen.prompts[ip];
            if (r->echo) { text = r->prompt_texts[ip] + text; }
        }
        choice["text"] = text;
        json logprobs  = nullptr;
        if (lps) {  // text_offset continues across chunks: offsets count from the start of the returned text
            LegacyLogprobs l;
            if (first && r->echo) { l.add_prompt(*tok, r->gen.prompts[ip], ev.prompt_logprobs, r->prompt_offsets[ip], ids, k); }
            l.add(*tok, ev.logprobs, ev.text_offsets, r->echo ? r->prompt_chars[ip] : 0, ids, k);
            logprobs = l.to_json();
        }
        choice["logprobs"] = logprobs;
        return choice;
    };
    run_generation(ctx, req, r->gen, r->opts, f, res);
}

}  // namespace fd::api
