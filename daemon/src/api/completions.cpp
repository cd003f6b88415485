// POST /v1/completions: the prompt forms (text, texts, token ids, lists of them), echo and the
// legacy logprobs shape; the rest is shared with chat (generation.h).
#include "generation.h"

namespace fd::api {
namespace {

using nlohmann::json;
using engine::ChoiceEvent;
using engine::FinishReason;

struct CompletionRequest {
    engine::GenerateRequest  gen;
    std::vector<std::string> prompt_texts;  ///< [n_prompts] for echo
    StreamOptions            opts;
    bool                     echo = false;
};

CompletionRequest parse(ApiContext & ctx, const std::string & body) {
    const json j = parse_body(body);
    static const std::set<std::string> kKnown = {
        "model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "n", "logprobs", "seed", "stop",
        "stop_token_ids", "ignore_eos", "stream", "echo", "stream_options", "user", "suffix",
        "frequency_penalty", "presence_penalty", "repetition_penalty", "best_of", "logit_bias", "min_tokens", "min_p",
        "skip_special_tokens", "spaces_between_special_tokens"};
    check_fields(j, kKnown);
    check_model(ctx, j);
    const auto & mc = ctx.engine->model_config();
    CompletionRequest r;

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
            r.gen.prompts.push_back(token_prompt(p[i], mc.vocab_size, i, "prompt"));
        }
    } else if (p.is_array() && !p.empty()) {
        r.gen.prompts.push_back(token_prompt(p, mc.vocab_size, 0, "prompt"));
    } else {
        bad("prompt", "'prompt' must be a string, a list of strings, a list of token ids or a list of token-id lists, and not empty");
    }
    for (size_t i = 0; i < r.gen.prompts.size(); ++i) {
        if (r.gen.prompts[i].empty()) { bad("prompt", fmt::format("prompt {} is empty", i)); }
        if (r.prompt_texts.size() <= i) { r.prompt_texts.push_back(ctx.tok->decode(r.gen.prompts[i])); }
    }

    r.opts = parse_sampling(ctx, j, r.gen, {"max_tokens"});
    auto & sp = r.gen.params;
    sp.logprobs = -1;
    if (j.contains("logprobs") && !j["logprobs"].is_null()) {
        const json & lp = j["logprobs"];
        // absent or null = off; else the number of top alternatives, 0..max (OpenAI)
        const bool in_range = lp.is_number_unsigned() ? lp.get<uint64_t>() <= static_cast<uint64_t>(ctx.cfg.max_logprobs)
                              : lp.is_number_integer() && lp.get<int64_t>() >= 0 && lp.get<int64_t>() <= ctx.cfg.max_logprobs;
        if (!in_range) {
            bad("logprobs", fmt::format("'logprobs' must be an integer in [0, {}], got {}", ctx.cfg.max_logprobs, lp.dump()));
        }
        sp.logprobs = lp.get<int32_t>();
    }
    if (j.contains("echo") && !j["echo"].is_null()) {
        if (!j["echo"].is_boolean()) { bad("echo", "'echo' must be a boolean"); }
        r.echo = j["echo"].get<bool>();
    }
    check_lengths(ctx, r.gen, "prompt");
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

}  // namespace

void post_completions(ApiContext & ctx, const Request & req, Response & res) {
    auto r            = std::make_shared<const CompletionRequest>(parse(ctx, req.body));
    const auto * tok  = ctx.tok;
    const int32_t n   = r->gen.n;
    const bool    lps = r->gen.params.logprobs >= 0;
    ResponseFormat f;
    f.object       = "text_completion";
    f.chunk_object = "text_completion";
    f.id_prefix    = "cmpl";
    f.choice       = [r, tok, n, lps](int32_t c, const ChoiceAcc & a) {
        const int32_t     ip     = c / n;
        const std::string prefix = r->echo ? r->prompt_texts[ip] : "";
        return json{{"index", c},
                    {"text", prefix + a.text},
                    {"logprobs", lps ? logprobs_json(*tok, a.logprobs, static_cast<int32_t>(prefix.size())) : json(nullptr)},
                    {"finish_reason", engine::to_string(a.finish)},
                    {"prompt_token_ids", r->gen.prompts[ip]},
                    {"token_ids", a.token_ids}};
    };
    f.chunk_choice = [r, tok, n, lps](const ChoiceEvent & ev, bool first) {
        const int32_t ip   = ev.choice / n;
        std::string   text = ev.text;
        json choice = {{"index", ev.choice}, {"token_ids", ev.token_ids},
                       {"finish_reason", ev.finish == FinishReason::none ? json(nullptr) : json(engine::to_string(ev.finish))}};
        if (first) {
            choice["prompt_token_ids"] = r->gen.prompts[ip];
            if (r->echo) { text = r->prompt_texts[ip] + text; }
        }
        choice["text"]     = text;
        choice["logprobs"] = lps ? logprobs_json(*tok, ev.logprobs, 0) : json(nullptr);
        return choice;
    };
    run_generation(ctx, r->gen, r->opts, f, res);
}

}  // namespace fd::api
