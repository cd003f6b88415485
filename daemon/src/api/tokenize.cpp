// POST /tokenize and POST /detokenize: vLLM's request and response shapes.
//   /tokenize   {"prompt": str, "add_special_tokens": true, "return_token_strs": false}
//            or {"messages": [...], "add_generation_prompt": true, "continue_final_message": false,
//                "chat_template_kwargs": {}, "tools": [...], "add_special_tokens": false,
//                "chat_template": str (with --trust-request-chat-template, as for chat completions), ...}
//            → {"count", "max_model_len", "tokens": [ids], "token_strs": [pieces] | null}
//   /detokenize {"tokens": [ids]} → {"prompt": str}   (special tokens kept, as HF decode does)
// The chat form renders exactly as /v1/chat/completions does (generation.h chat_prompt_ids).
#include "generation.h"
#include "handlers.h"

#include <set>

namespace fd::api {
namespace {

using nlohmann::json;

json parse_body(ApiContext & ctx, const std::string & body, const std::set<std::string> & known) {
    // The generation routes' parser and wording (nlohmann's own words reached the client here: a probe).
    const json j = api::parse_body(body);
    for (const auto & [key, v] : j.items()) {
        if (known.count(key) == 0) { bad(key, fmt::format("unknown field '{}'", key)); }
    }
    if (j.contains("model") && !j["model"].is_null()) {
        if (!j["model"].is_string()) { bad("model", "'model' must be a string"); }
        const auto name = j["model"].get<std::string>();
        if (!ctx.cfg.serves(name) && name != ctx.cfg.model_dir) {
            throw Error(Errc::not_found,
                        fmt::format("model '{}' does not exist; this server serves '{}'", name, ctx.cfg.served_model_name),
                        "model");
        }
    }
    return j;
}

bool get_bool(const json & j, const char * key, bool dflt) {
    if (!j.contains(key) || j[key].is_null()) { return dflt; }
    if (!j[key].is_boolean()) { bad(key, fmt::format("'{}' must be a boolean", key)); }
    return j[key].get<bool>();
}

}  // namespace

void post_tokenize(ApiContext & ctx, const Request & req, Response & res) {
    bool chat = false;  // the form: a body with "messages" is the chat form
    try {
        const json probe = parse_json(req.body);
        chat             = probe.is_object() && probe.contains("messages");
    } catch (const std::exception &) {}  // parse_body names the error
    const json j    = chat ? parse_body(ctx, req.body, {"model", "messages", "add_generation_prompt", "continue_final_message",
                                                        "chat_template_kwargs", "tools", "documents", "add_special_tokens",
                                                        "return_token_strs", "prompt", "chat_template"})
                           : parse_body(ctx, req.body, {"model", "prompt", "add_special_tokens", "return_token_strs"});
    std::vector<int32_t> ids;
    if (chat) {
        if (j.contains("prompt")) { bad("prompt", "send either 'prompt' or 'messages', not both"); }
        ids = chat_prompt_ids(ctx, j, parse_chat_json(req.body, ""), get_bool(j, "add_special_tokens", false));
    } else {
        if (!j.contains("prompt") || !j["prompt"].is_string()) { bad("prompt", "'prompt' must be a string"); }
        ids = ctx.tok->encode(j["prompt"].get<std::string>(), get_bool(j, "add_special_tokens", true));
    }
    json strs = nullptr;
    if (get_bool(j, "return_token_strs", false)) {
        strs = json::array();
        for (int32_t id : ids) { strs.push_back(ctx.tok->piece(id)); }
    }
    res.set_content(dump(json{{"count", ids.size()},
                              {"max_model_len", ctx.engine->config().max_model_len},
                              {"tokens", ids},
                              {"token_strs", strs}}),
                    "application/json");
}

void post_detokenize(ApiContext & ctx, const Request & req, Response & res) {
    const json j = parse_body(ctx, req.body, {"model", "tokens"});
    if (!j.contains("tokens") || !j["tokens"].is_array()) { bad("tokens", "'tokens' must be a list of token ids"); }
    const int32_t        vocab = ctx.engine->model_config().vocab_size;
    std::vector<int32_t> ids;
    for (const auto & v : j["tokens"]) {
        if (!v.is_number_integer()) { bad("tokens", "'tokens' must hold integers only"); }
        const int64_t id = v.get<int64_t>();
        if (id < 0 || id >= vocab) { bad("tokens", fmt::format("token id {} is outside the vocabulary [0, {})", id, vocab)); }
        ids.push_back(int32_t(id));
    }
    const std::string text = ctx.tok->decode(ids, {.skip_special_tokens = false});
    res.set_content(dump(json{{"prompt", text}}), "application/json");
}

}  // namespace fd::api
