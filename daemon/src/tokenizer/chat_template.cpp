// ChatTemplate: the model dir's chat template and transformers' apply_chat_template semantics.
#include "fd/tokenizer/chat_template.h"

#include "jinja/jinja_interp.h"

#include <fmt/format.h>

#include <fstream>
#include <regex>
#include <sstream>

namespace fd::tokenizer {
namespace {

std::string read_text(const std::filesystem::path & p) {
    std::ifstream in(p, std::ios::binary);
    if (!in) { fail(Errc::invalid_checkpoint, "cannot read {}", p.string()); }
    std::ostringstream ss;
    ss << in.rdbuf();
    return ss.str();
}

/// A special token entry: a string or an AddedToken object {"content": ...}.
std::optional<std::string> token_string(const nlohmann::ordered_json & v) {
    if (v.is_string()) { return v.get<std::string>(); }
    if (v.is_object() && v.contains("content") && v["content"].is_string()) { return v["content"].get<std::string>(); }
    return std::nullopt;
}

std::string py_strip_ws(const std::string & s) { return jinja::py_strip(s, jinja::Value(jinja::NoneT{}), true, true); }
std::string py_lstrip_ws(const std::string & s) { return jinja::py_strip(s, jinja::Value(jinja::NoneT{}), true, false); }

}  // namespace

ChatTemplate::ChatTemplate(std::string_view source, std::string origin, nlohmann::ordered_json special_tokens)
    : tmpl_(source, std::move(origin)), special_tokens_(std::move(special_tokens)) {
    static const std::regex kLoopOverContent(R"(for\s+\w+\s+in\s+\w+\s*(\.\s*content\b|\[\s*['"]content['"]\s*\]))");
    takes_parts_ = std::regex_search(source.begin(), source.end(), kLoopOverContent);
}

std::optional<ChatTemplate> ChatTemplate::load(const std::filesystem::path & dir, const std::string & override_template) {
    nlohmann::ordered_json config = nlohmann::ordered_json::object();
    const auto             config_path = dir / "tokenizer_config.json";
    if (std::filesystem::exists(config_path)) {
        try {
            config = nlohmann::ordered_json::parse(read_text(config_path));
        } catch (const nlohmann::json::exception & e) {
            fail(Errc::invalid_checkpoint, "{}: invalid JSON: {}", config_path.string(), e.what());
        }
        if (!config.is_object()) { fail(Errc::invalid_checkpoint, "{}: expected a JSON object", config_path.string()); }
    }
    nlohmann::ordered_json special = nlohmann::ordered_json::object();
    for (const char * name : {"bos_token", "eos_token", "unk_token", "pad_token"}) {
        if (!config.contains(name) || config[name].is_null()) { continue; }
        auto s = token_string(config[name]);
        if (!s) { fail(Errc::invalid_checkpoint, "{}: '{}' must be a string or an AddedToken object", config_path.string(), name); }
        special[name] = *s;
    }
    std::string source, origin;
    const auto  jinja_path = dir / "chat_template.jinja";
    if (!override_template.empty()) {
        std::error_code ec;
        if (std::filesystem::is_regular_file(override_template, ec)) {
            std::ifstream in(override_template, std::ios::binary);
            if (!in) { fail(Errc::invalid_argument, "--chat-template {}: cannot read the file", override_template); }
            std::ostringstream ss;
            ss << in.rdbuf();
            source = ss.str();
            origin = override_template;
        } else if (override_template.find("{{") != std::string::npos || override_template.find("{%") != std::string::npos) {
            source = override_template;
            origin = "--chat-template";
        } else {
            fail(Errc::invalid_argument, "--chat-template '{}' is neither a readable file nor a Jinja template", override_template);
        }
        return ChatTemplate(source, origin, std::move(special));  // a malformed one: invalid_argument with line:column
    }
    if (std::filesystem::exists(jinja_path)) {
        source = read_text(jinja_path);
        origin = jinja_path.string();
    } else if (config.contains("chat_template") && !config["chat_template"].is_null()) {
        const auto & ct = config["chat_template"];
        origin          = config_path.string() + " chat_template";
        if (ct.is_string()) {
            source = ct.get<std::string>();
        } else if (ct.is_array()) {
            // Several named templates (Hermes-2-Pro, Command-R: default, tool_use, rag): "default"
            // serves, the others are picked per request by select() / named().
            std::vector<std::pair<std::string, std::string>> others;
            bool found = false;
            for (const auto & t : ct) {
                if (!t.is_object() || !t.contains("name") || !t.contains("template") || !t["name"].is_string() || !t["template"].is_string()) {
                    fail(Errc::invalid_checkpoint, "{}: chat_template must be a list of objects with \"name\" and \"template\" strings", config_path.string());
                }
                if (t["name"] == "default") {
                    source = t["template"].get<std::string>();
                    origin = config_path.string() + " chat_template[default]";
                    found  = true;
                } else {
                    others.emplace_back(t["name"].get<std::string>(), t["template"].get<std::string>());
                }
            }
            if (!found) { fail(Errc::invalid_checkpoint, "{}: chat_template is a list without a template named \"default\"", config_path.string()); }
            try {
                ChatTemplate main(source, origin, special);
                for (const auto & [name, text] : others) {
                    main.named_.emplace_back(name, std::make_shared<const ChatTemplate>(
                                                       text, config_path.string() + " chat_template[" + name + "]", special));
                }
                return main;
            } catch (const fd::Error & e) {
                throw fd::Error(Errc::invalid_checkpoint, e.what());
            }
        } else {
            fail(Errc::invalid_checkpoint, "{}: chat_template must be a string or a list", config_path.string());
        }
    } else {
        return std::nullopt;
    }
    try {
        return ChatTemplate(source, origin, std::move(special));
    } catch (const fd::Error & e) {
        throw fd::Error(Errc::invalid_checkpoint, e.what());
    }
}

ChatTemplate ChatTemplate::with_source(std::string_view source) const {
    try {
        return ChatTemplate(source, "request chat_template", special_tokens_);
    } catch (const fd::Error & e) {
        throw fd::Error(Errc::invalid_argument, e.what(), "chat_template");
    }
}

const ChatTemplate & ChatTemplate::select(const nlohmann::ordered_json & tools) const {
    if (tools.is_null()) { return *this; }
    const ChatTemplate * t = named("tool_use");
    return t ? *t : *this;
}

const ChatTemplate * ChatTemplate::named(std::string_view name) const {
    if (named_.empty()) { return nullptr; }
    if (name == "default") { return this; }
    for (const auto & [n, t] : named_) {
        if (n == name) { return t.get(); }
    }
    return nullptr;
}

std::string ChatTemplate::special_token(const std::string & name) const {
    return special_tokens_.contains(name) ? special_tokens_[name].get<std::string>() : std::string();
}

std::string ChatTemplate::render(const ChatRequest & req) const {
    if (!req.messages.is_array()) { throw fd::Error(Errc::invalid_argument, "messages must be an array", "messages"); }
    for (size_t i = 0; i < req.messages.size(); ++i) {
        if (!req.messages[i].is_object()) { throw fd::Error(Errc::invalid_argument, fmt::format("messages[{}] must be an object", i), "messages"); }
    }
    if (req.add_generation_prompt && req.continue_final_message) {
        throw fd::Error(Errc::invalid_argument, "continue_final_message and add_generation_prompt are not compatible: use continue_final_message when you want the model to continue the final message, and add_generation_prompt when you want to add a header that will prompt it to start a new assistant message instead");
    }
    if (!req.chat_template_kwargs.is_object()) { throw fd::Error(Errc::invalid_argument, "chat_template_kwargs must be an object", "chat_template_kwargs"); }
    nlohmann::ordered_json ctx = nlohmann::ordered_json::object();
    ctx["messages"]              = req.messages;
    ctx["tools"]                 = req.tools;
    ctx["documents"]             = req.documents;
    ctx["add_generation_prompt"] = req.add_generation_prompt;
    for (const auto & [k, v] : special_tokens_.items()) { ctx[k] = v; }
    for (const auto & [k, v] : req.chat_template_kwargs.items()) {
        if (k == "messages" || k == "tools" || k == "documents" || k == "add_generation_prompt") {
            throw fd::Error(Errc::invalid_argument, fmt::format("chat_template_kwargs must not set '{}' (a field of its own)", k), "chat_template_kwargs");
        }
        ctx[k] = v;
    }
    std::string out = tmpl_.render(ctx);
    if (!req.continue_final_message) { return out; }
    // transformers render_jinja_template: cut right after the final message's content.
    if (req.messages.empty()) { throw fd::Error(Errc::invalid_argument, "continue_final_message needs at least one message", "messages"); }
    const auto & content = req.messages.back().contains("content") ? req.messages.back()["content"] : nlohmann::ordered_json();
    std::string  final;
    if (content.is_string()) {
        final = content.get<std::string>();
    } else if (content.is_array()) {
        bool found = false;
        for (auto it = content.rbegin(); it != content.rend() && !found; ++it) {
            if (it->is_object() && it->contains("text") && (*it)["text"].is_string()) {
                final = (*it)["text"].get<std::string>();
                found = true;
            }
        }
        if (!found) { throw fd::Error(Errc::invalid_argument, "continue_final_message is set but we could not find any text to continue in the final message!", "messages"); }
    } else {
        throw fd::Error(Errc::invalid_argument, "continue_final_message is set but the final message has no text content", "messages");
    }
    const std::string stripped = py_strip_ws(final);
    const size_t      loc      = out.rfind(stripped);
    if (loc == std::string::npos) {
        throw fd::Error(Errc::invalid_argument, "continue_final_message is set but the final message does not appear in the chat after applying the chat template! This can happen if the chat template deletes portions of the final message. Please verify the chat template and final message in your chat to ensure they are compatible.", "messages");
    }
    // The template kept the message as written (no leading space to lose): cut after it whole;
    // else it trimmed the message: cut after the stripped text.
    const std::string lstripped = py_lstrip_ws(final);
    if (lstripped.size() == final.size() && out.compare(loc, final.size(), final) == 0) { return out.substr(0, loc + final.size()); }
    return out.substr(0, loc + stripped.size());
}

}  // namespace fd::tokenizer
