// fd/tokenizer/chat_template.h — a model's chat template (Hugging Face apply_chat_template).
//
// Loaded from the model directory: `chat_template.jinja` when present, else
// tokenizer_config.json's `chat_template` (a string, or a list of {name, template}: the one named
// "default" serves, and the others are picked per request as transformers' get_chat_template does:
// select(), named()), with the special-token strings (bos_token, eos_token,
// unk_token, pad_token; plain strings or AddedToken objects {"content": ...}) the template may
// print. Rendering follows transformers' render_jinja_template: the context is
// {messages, tools, documents, add_generation_prompt, <special tokens>, <chat_template_kwargs>}
// (tools/documents are None when not given), and continue_final_message cuts the output right
// after the final message's content. Immutable after construction; render() is thread-safe.
#pragma once

#include "fd/tokenizer/jinja/jinja.h"

#include <nlohmann/json.hpp>

#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace fd::tokenizer {

struct ChatRequest {
    nlohmann::ordered_json messages = nlohmann::ordered_json::array();   ///< [{role, content, ...}, ...]
    nlohmann::ordered_json tools;                      ///< array of tool schemas, or null (template sees None)
    nlohmann::ordered_json documents;                  ///< array, or null (template sees None)
    bool                   add_generation_prompt  = false;  ///< transformers' default
    bool                   continue_final_message = false;
    nlohmann::ordered_json chat_template_kwargs = nlohmann::ordered_json::object();  ///< extra variables (enable_thinking...)
};

class ChatTemplate {
public:
    /// `source`: the template text; `origin` names it in errors ("<dir>/tokenizer_config.json
    /// chat_template"); `special_tokens`: {"bos_token": "<s>", ...} (strings only).
    /// Errors  fd::Error{invalid_argument, "<origin>:<line>:<col>: ..."} for a malformed template.
    ChatTemplate(std::string_view source, std::string origin, nlohmann::ordered_json special_tokens);

    /// The model's template, or nullopt when `dir` has none (no chat_template.jinja and no
    /// `chat_template` in tokenizer_config.json).
    /// Errors  fd::Error{invalid_checkpoint} naming the file: unreadable/invalid JSON, a
    ///         `chat_template` of the wrong type or a list without "default", a malformed
    ///         template (with line and column).
    /// `override_template` (vLLM's --chat-template): a file path, or the template itself when
    /// it holds "{{" or "{%" and names no file; it replaces the dir's template, whose special
    /// tokens it still gets.
    /// Errors  also fd::Error{invalid_argument} when `override_template` is neither a readable
    ///         file nor a template, or does not parse (line and column).
    static std::optional<ChatTemplate> load(const std::filesystem::path & dir, const std::string & override_template = {});

    /// A template a request brought (vLLM's `chat_template` field), with this one's special tokens.
    /// Errors  fd::Error{invalid_argument, param "chat_template"} when it does not parse.
    ChatTemplate with_source(std::string_view source) const;

    /// The prompt text for `req`.
    /// Errors  jinja::TemplateRaise (the template's raise_exception message);
    ///         fd::Error{invalid_argument}: messages not an array of objects, both
    ///         add_generation_prompt and continue_final_message, a reserved kwarg name,
    ///         continue_final_message whose final content is not in the output, render errors.
    std::string render(const ChatRequest & req) const;

    /// transformers' get_chat_template(None, tools) on a list of named templates: the one named
    /// "tool_use" when `tools` is not null (an empty list counts) and the list has one, else this
    /// ("default"). Documents do not select "rag": transformers picks it only by name. A single
    /// template (or an override) always gives itself. vLLM resolves the template the same way.
    const ChatTemplate & select(const nlohmann::ordered_json & tools) const;

    /// The template of that name when the model's chat_template is a list (get_chat_template(name):
    /// a request's `chat_template` may name one); "default" is this one. nullptr otherwise.
    const ChatTemplate * named(std::string_view name) const;

    /// Special-token strings given to the template ("" when the config has none).
    std::string special_token(const std::string & name) const;
    const std::string & origin() const { return tmpl_.name(); }
    /// Whether the template iterates over a message's content (`for x in message['content']`),
    /// i.e. takes OpenAI content-part lists; otherwise callers join text parts into a string
    /// (vLLM's "auto" content format detection, approximated on the template source).
    bool takes_content_parts() const { return takes_parts_; }

private:
    jinja::Template        tmpl_;
    nlohmann::ordered_json special_tokens_;
    bool                   takes_parts_ = false;
    /// The list's other templates (not "default"), in the config's order.
    std::vector<std::pair<std::string, std::shared_ptr<const ChatTemplate>>> named_;
};

}  // namespace fd::tokenizer
