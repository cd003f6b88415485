// POST /v1/chat/completions: messages are checked, rendered with the model's chat template
// (fd/tokenizer/chat_template.h, transformers' semantics), encoded, and generated like a
// completion (generation.h). Answers in OpenAI's chat shape plus fdrollout's weight_version,
// prompt_token_ids and token_ids.
#include "generation.h"

#include "fd/tokenizer/chat_template.h"

#include <algorithm>
#include <set>

namespace fd::api {
namespace {

using nlohmann::json;
using ojson = nlohmann::ordered_json;
using engine::ChoiceEvent;
using engine::FinishReason;

struct ChatCompletionRequest {
    engine::GenerateRequest gen;
    StreamOptions           opts;
    bool                    logprobs = false;
};

/// The first integer literal of JSON `text` beyond int64 that the chat template sees, or "":
/// every one when `whole` (a tool call's arguments), else those under the body's top-level keys
/// messages, tools, documents and chat_template_kwargs (a uint64 `seed` is fine).
std::string out_of_range_integer(const std::string & text, bool whole) {
    static const std::set<std::string> kTemplateKeys = {"messages", "tools", "documents", "chat_template_kwargs"};
    bool        in_str = false, counts = whole;
    int         depth  = 0;
    size_t      str_start = 0;
    std::string last_str;  // the last string closed at depth 1: the key when a ':' follows
    for (size_t i = 0; i < text.size(); ++i) {
        const char c = text[i];
        if (in_str) {
            if (c == '\\') {
                ++i;
            } else if (c == '"') {
                in_str = false;
                if (depth == 1) { last_str = text.substr(str_start, i - str_start); }
            }
            continue;
        }
        if (c == '"') {
            in_str    = true;
            str_start = i + 1;
            continue;
        }
        if (c == '{' || c == '[') { ++depth; continue; }
        if (c == '}' || c == ']') { --depth; continue; }
        if (c == ':' && depth == 1 && !whole) { counts = kTemplateKeys.count(last_str) != 0; continue; }
        if (c != '-' && (c < '0' || c > '9')) { continue; }
        size_t e = i + (c == '-');
        while (e < text.size() && text[e] >= '0' && text[e] <= '9') { ++e; }
        const bool integer = e == text.size() || (text[e] != '.' && text[e] != 'e' && text[e] != 'E');
        const std::string digits = text.substr(i + (c == '-'), e - i - (c == '-'));
        const std::string limit  = c == '-' ? "9223372036854775808" : "9223372036854775807";
        if (counts && integer && (digits.size() > limit.size() || (digits.size() == limit.size() && digits > limit))) {
            return text.substr(i, e - i);
        }
        while (e < text.size() && (text[e] == '.' || text[e] == 'e' || text[e] == 'E' || text[e] == '+' || text[e] == '-' ||
                                   (text[e] >= '0' && text[e] <= '9'))) {
            ++e;
        }
        i = e - 1;
    }
    return "";
}

/// Messages as the template sees them, as vLLM's parse_chat_messages gives them: checked; missing or
/// null content is "" (or [] for a template that loops over parts); an assistant's reasoning is
/// also its reasoning_content; an empty tool_calls list is dropped; tool-call arguments that are
/// empty become {} and JSON strings are parsed into objects (so templates can `| tojson` them);
/// text content parts are joined into one string unless the template loops over content parts.
/// Errors: 400 naming the offending field.
ojson check_messages(const ojson & msgs, bool takes_parts) {
    if (!msgs.is_array() || msgs.empty()) { bad("messages", "'messages' must be a non-empty list of message objects"); }
    ojson out = ojson::array();
    for (size_t i = 0; i < msgs.size(); ++i) {
        const std::string at = fmt::format("messages[{}]", i);
        ojson             m  = msgs[i];
        if (!m.is_object()) { bad(at, fmt::format("'{}' must be an object with 'role' and 'content'", at)); }
        if (!m.contains("role") || !m["role"].is_string()) { bad(at + ".role", fmt::format("'{}.role' must be a string", at)); }
        const std::string role = m["role"];
        const bool has_tool_calls = m.contains("tool_calls") && !m["tool_calls"].is_null();
        if (!m.contains("content") || m["content"].is_null()) {
            // No content (OpenAI sends "content": null for an assistant turn of tool calls only):
            // no content parts, for any role, as vLLM's _parse_chat_message_content renders it:
            // "" (or [] for a template that loops over parts), so templates testing
            // `'x' in message.content` work.
            m["content"] = takes_parts ? ojson::array() : ojson("");
        } else if (m["content"].is_array()) {
            std::string joined;
            for (size_t k = 0; k < m["content"].size(); ++k) {
                const ojson &     part = m["content"][k];
                const std::string pat  = fmt::format("{}.content[{}]", at, k);
                if (!part.is_object() || !part.contains("type") || !part["type"].is_string()) {
                    bad(pat, fmt::format("'{}' must be an object with a 'type'", pat));
                }
                if (part["type"] != "text") {
                    bad(pat + ".type", fmt::format("'{}.type' is '{}': this model takes text content only", pat, part["type"].get<std::string>()));
                }
                if (!part.contains("text") || !part["text"].is_string()) { bad(pat + ".text", fmt::format("'{}.text' must be a string", pat)); }
                joined += (k ? "\n" : "") + part["text"].get<std::string>();
            }
            if (!takes_parts) { m["content"] = joined; }
        } else if (!m["content"].is_string()) {
            bad(at + ".content", fmt::format("'{}.content' must be a string or a list of content parts", at));
        }
        // vLLM sends an assistant's `reasoning` to the template as `reasoning_content` too (what
        // Qwen3's template reads).
        if (role == "assistant" && m.contains("reasoning") && !m["reasoning"].is_null()) { m["reasoning_content"] = m["reasoning"]; }
        // vLLM's _postprocess_messages: an empty tool_calls list is dropped (the template takes the
        // plain assistant path).
        if (has_tool_calls && m["tool_calls"].is_array() && m["tool_calls"].empty()) {
            m.erase("tool_calls");
        } else if (has_tool_calls) {
            if (!m["tool_calls"].is_array()) { bad(at + ".tool_calls", fmt::format("'{}.tool_calls' must be a list", at)); }
            for (size_t k = 0; k < m["tool_calls"].size(); ++k) {
                ojson &           tc  = m["tool_calls"][k];
                const std::string tat = fmt::format("{}.tool_calls[{}]", at, k);
                if (!tc.is_object() || !tc.contains("function") || !tc["function"].is_object() || !tc["function"].contains("name") ||
                    !tc["function"]["name"].is_string()) {
                    bad(tat, fmt::format("'{}' must be an object with 'function': {{'name', 'arguments'}}", tat));
                }
                // vLLM's _postprocess_messages: missing, null, "" (any empty value) → {}; a
                // non-empty string is parsed (400 when it is not JSON, as vLLM's json.loads).
                ojson & args = tc["function"]["arguments"];
                if (args.is_null() || (args.is_string() && args.get<std::string>().empty()) || (args.is_structured() && args.empty()) ||
                    (args.is_boolean() && !args.get<bool>()) || (args.is_number() && args.get<double>() == 0)) {
                    args = ojson::object();
                } else if (args.is_string()) {
                    try {
                        args = parse_chat_json(args.get<std::string>(), tat + ".function.arguments");
                    } catch (const ojson::exception &) {  // (parse_chat_json's own refusal is an fd::Error: it passes)
                        bad(tat + ".function.arguments", fmt::format("'{}.function.arguments' is not valid JSON", tat));
                    }
                }
            }
        }
        out.push_back(std::move(m));
    }
    return out;
}

/// The prompt ids of rendered chat text. Templates that print bos_token themselves get it once:
/// the text's leading BOS string is dropped before encoding and the tokenizer's BOS stands for
/// it; templates that print none get no BOS (HF apply_chat_template(tokenize=True) encodes with
/// add_special_tokens=False).
std::vector<int32_t> encode_chat_prompt(const tokenizer::Tokenizer & tok, const tokenizer::ChatTemplate & tmpl, std::string text) {
    const std::string bos      = tmpl.special_token("bos_token");
    const bool        has_bos  = !bos.empty() && text.compare(0, bos.size(), bos) == 0;
    if (has_bos) { text.erase(0, bos.size()); }
    std::vector<int32_t> ids = tok.encode(text, /*add_special_tokens=*/false);
    if (has_bos) {
        if (const auto b = tok.bos_id()) { ids.insert(ids.begin(), *b); }
    }
    return ids;
}

bool get_bool(const json & j, const char * key, bool dflt) {
    if (!j.contains(key) || j[key].is_null()) { return dflt; }
    if (!j[key].is_boolean()) { bad(key, fmt::format("'{}' must be a boolean", key)); }
    return j[key].get<bool>();
}

}  // namespace

ojson parse_chat_json(const std::string & text, const std::string & param) {
    if (const std::string n = out_of_range_integer(text, /*whole=*/!param.empty()); !n.empty()) {
        bad(param, fmt::format("{} holds the integer {}, outside the signed 64-bit range the chat template engine holds; send it as a "
                               "string (or a float)", param.empty() ? "the request" : "'" + param + "'", n.size() > 40 ? n.substr(0, 40) + "..." : n));
    }
    return parse_ordered_json(text);
}

std::vector<int32_t> chat_prompt_ids(ApiContext & ctx, const json & j, const ojson & oj, bool add_special_tokens) {
    // vLLM's request `chat_template`: only with --trust-request-chat-template (vLLM's rule). It may
    // also name one of the model's templates when its chat_template is a list (transformers'
    // get_chat_template, which vLLM's apply_hf_chat_template reaches).
    std::optional<tokenizer::ChatTemplate> own;
    const tokenizer::ChatTemplate *        tmpl     = ctx.chat_template;
    bool                                   by_name  = false;
    if (j.contains("chat_template") && !j["chat_template"].is_null()) {
        if (!j["chat_template"].is_string()) { bad("chat_template", "'chat_template' must be a string (a Jinja template)"); }
        if (!ctx.cfg.trust_request_chat_template) {
            bad("chat_template", "a request's 'chat_template' is refused unless the daemon runs with --trust-request-chat-template "
                                 "(vLLM's flag); or start it with --chat-template FILE");
        }
        const std::string source = j["chat_template"].get<std::string>();
        if (const tokenizer::ChatTemplate * t = ctx.chat_template ? ctx.chat_template->named(source) : nullptr) {
            tmpl    = t;
            by_name = true;
        } else {
            own  = ctx.chat_template ? ctx.chat_template->with_source(source)
                                     : tokenizer::ChatTemplate(source, "request chat_template", ojson::object());
            tmpl = &*own;
        }
    }
    if (!tmpl) {
        bad("messages", fmt::format("model '{}' has no chat template (no chat_template.jinja, no 'chat_template' in tokenizer_config.json); "
                                    "start fdrollout with --chat-template FILE, or use /v1/completions with a prompt",
                                    ctx.cfg.served_model_name));
    }
    tokenizer::ChatRequest chat;
    if (oj.contains("tools") && !oj["tools"].is_null()) {
        if (!oj["tools"].is_array()) { bad("tools", "'tools' must be a list of tool objects"); }
        for (size_t i = 0; i < oj["tools"].size(); ++i) {
            if (!oj["tools"][i].is_object()) { bad("tools", fmt::format("'tools[{}]' must be an object", i)); }
        }
        chat.tools = oj["tools"];
    }
    // A list of named templates: "tool_use" when tools are given (transformers' get_chat_template).
    if (!own && !by_name) { tmpl = &tmpl->select(chat.tools); }
    chat.messages               = check_messages(oj.contains("messages") ? oj["messages"] : ojson(), tmpl->takes_content_parts());
    chat.add_generation_prompt  = get_bool(j, "add_generation_prompt", true);  // vLLM's default
    chat.continue_final_message = get_bool(j, "continue_final_message", false);
    if (j.contains("tool_choice") && !j["tool_choice"].is_null() && j["tool_choice"] != "none" && j["tool_choice"] != "auto") {
        bad("tool_choice", "'tool_choice' may be 'none' or 'auto' only: tools reach the template, tool calls are not parsed from the output");
    }
    if (oj.contains("documents") && !oj["documents"].is_null()) {
        if (!oj["documents"].is_array()) { bad("documents", "'documents' must be a list"); }
        chat.documents = oj["documents"];
    }
    if (oj.contains("chat_template_kwargs") && !oj["chat_template_kwargs"].is_null()) {
        if (!oj["chat_template_kwargs"].is_object()) { bad("chat_template_kwargs", "'chat_template_kwargs' must be an object"); }
        chat.chat_template_kwargs = oj["chat_template_kwargs"];
    }
    const std::string text = tmpl->render(chat);
    return add_special_tokens ? ctx.tok->encode(text, true) : encode_chat_prompt(*ctx.tok, *tmpl, text);
}

namespace {

ChatCompletionRequest parse(ApiContext & ctx, const std::string & body) {
    const json j = parse_body(body);
    static const std::set<std::string> kKnown = {
        "model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "n", "logprobs",
        "top_logprobs", "seed", "stop", "stop_token_ids", "ignore_eos", "stream", "stream_options", "user", "tools",
        "tool_choice", "documents", "add_generation_prompt", "continue_final_message", "chat_template_kwargs",
        "frequency_penalty", "presence_penalty", "repetition_penalty", "logit_bias", "min_tokens", "min_p",
        "skip_special_tokens", "spaces_between_special_tokens", "prompt_logprobs", "include_stop_str_in_output",
        "return_tokens_as_token_ids", "chat_template"};
    check_fields(j, kKnown, /*chat=*/true);
    check_model(ctx, j);
    const ojson oj = parse_chat_json(body, "");
    ChatCompletionRequest r;
    r.gen.prompts.push_back(chat_prompt_ids(ctx, j, oj, get_bool(j, "add_special_tokens", false)));  // vLLM's chat default: false
    parse_vllm_fields(ctx, j, r.gen);

    if (r.gen.prompts[0].empty()) { bad("messages", "the chat template rendered an empty prompt"); }
    // vLLM's chat default: no max_completion_tokens / max_tokens = the rest of the context (at
    // least 1: a prompt that fills it is check_lengths' 400 below).
    const int64_t room = static_cast<int64_t>(ctx.engine->config().max_model_len) - static_cast<int64_t>(r.gen.prompts[0].size());
    r.opts     = parse_sampling(ctx, j, r.gen, {"max_completion_tokens", "max_tokens"}, static_cast<int32_t>(std::max<int64_t>(room, 1)));
    const std::string mt_key = r.opts.max_tokens_field.empty() ? "max_tokens" : r.opts.max_tokens_field;
    if (r.gen.params.max_tokens == 0) { bad(mt_key, fmt::format("'{}' must be >= 1", mt_key)); }
    r.logprobs = get_bool(j, "logprobs", false);
    int32_t top = 0;
    if (j.contains("top_logprobs") && !j["top_logprobs"].is_null()) {
        if (!j["top_logprobs"].is_number_integer()) { bad("top_logprobs", "'top_logprobs' must be an integer"); }
        const json & t = j["top_logprobs"];  // range-checked before the narrowing (4294967299 is not 3)
        const bool in_range = t.is_number_unsigned() ? t.get<uint64_t>() <= static_cast<uint64_t>(ctx.cfg.max_logprobs)
                                                     : t.get<int64_t>() >= 0 && t.get<int64_t>() <= ctx.cfg.max_logprobs;
        if (!in_range) { bad("top_logprobs", fmt::format("'top_logprobs' must be in [0, {}], got {}", ctx.cfg.max_logprobs, brief(t))); }
        top = t.get<int32_t>();
        // vLLM refuses only top_logprobs > 0 without logprobs (0 asks for nothing)
        if (!r.logprobs && top > 0) { bad("top_logprobs", "'top_logprobs' > 0 needs 'logprobs': true"); }
    }
    if (top < 0 || top > ctx.cfg.max_logprobs) { bad("top_logprobs", fmt::format("'top_logprobs' must be in [0, {}], got {}", ctx.cfg.max_logprobs, top)); }
    r.gen.params.logprobs = r.logprobs ? top : -1;
    check_lengths(ctx, r.gen, "messages", mt_key);
    cap_max_tokens(ctx, r.gen.params);
    return r;
}

json token_entry(const std::string & piece, float logprob) {
    json bytes = json::array();
    for (unsigned char c : piece) { bytes.push_back(c); }
    return {{"token", piece}, {"logprob", logprob}, {"bytes", bytes}};
}

/// OpenAI chat logprobs: {"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]};
/// tokens are the decoded text, as in the completions route ("token_id:N" with
/// return_tokens_as_token_ids); bytes are the token's UTF-8 bytes (vLLM's).
json chat_logprobs_json(const tokenizer::Tokenizer & tok, const std::vector<engine::TokenLogprob> & lps, bool as_ids) {
    json content = json::array();
    for (const auto & lp : lps) {
        json e   = token_entry(token_string(tok, lp.id, as_ids), lp.logprob);
        json top = json::array();
        for (const auto & [id, v] : lp.top) { top.push_back(token_entry(token_string(tok, id, as_ids), v)); }
        e["top_logprobs"] = top;
        content.push_back(std::move(e));
    }
    return {{"content", content}};
}

}  // namespace

void post_chat_completions(ApiContext & ctx, const Request & req, Response & res) {
    auto r           = std::make_shared<const ChatCompletionRequest>(parse(ctx, req.body));
    const auto * tok = ctx.tok;
    const bool   ids = r->opts.tokens_as_ids;
    ResponseFormat f;
    f.object       = "chat.completion";
    f.chunk_object = "chat.completion.chunk";
    f.id_prefix    = "chatcmpl";
    f.choice       = [r, tok, ids](int32_t c, const ChoiceAcc & a) {
        return json{{"index", c},
                    {"message", {{"role", "assistant"}, {"content", a.text}}},
                    {"logprobs", r->logprobs ? chat_logprobs_json(*tok, a.logprobs, ids) : json(nullptr)},
                    {"finish_reason", engine::to_string(a.finish)},
                    {"stop_reason", stop_reason_json(a.stop_reason)},
                    {"prompt_token_ids", r->gen.prompts[0]},
                    {"token_ids", a.token_ids}};
    };
    // vLLM's chat response carries the (shared) prompt's ids and prompt_logprobs at the top level;
    // the ids stay in each choice too (fdrollout's earlier shape).
    f.body = [r, tok](const std::vector<ChoiceAcc> & acc, json & body) {
        body["prompt_token_ids"] = r->gen.prompts[0];
        if (r->gen.params.prompt_logprobs >= 0) {
            body["prompt_logprobs"] = acc.empty() ? json(nullptr) : prompt_logprobs_json(*tok, acc[0].prompt_logprobs, r->gen.params.detokenize);
        }
    };
    f.chunk_choice = [r, tok, ids](const ChoiceEvent & ev, bool first) {
        json delta = {{"content", ev.text}};
        if (first) { delta["role"] = "assistant"; }
        const bool done = ev.finish != FinishReason::none;
        json choice = {{"index", ev.choice}, {"delta", delta}, {"token_ids", ev.token_ids},
                       {"logprobs", r->logprobs ? chat_logprobs_json(*tok, ev.logprobs, ids) : json(nullptr)},
                       {"finish_reason", done ? json(engine::to_string(ev.finish)) : json(nullptr)},
                       {"stop_reason", done ? stop_reason_json(ev.stop_reason) : json(nullptr)}};
        if (first) { choice["prompt_token_ids"] = r->gen.prompts[0]; }
        return choice;
    };
    run_generation(ctx, req, r->gen, r->opts, f, res);
}

}  // namespace fd::api
